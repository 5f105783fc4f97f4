"""Where a resumed epoch's sampler goes on (the sampler's part of the NOTE in ``_checkpoint``):
a stateful sampler's states after each pull the consumer is behind (``SamplerPulls``), the
tasks an ``in_order=False`` epoch already consumed skipped (``Skipping``), and ``position``,
which puts a new iterator's sampler where a state says, drawing what it had drawn then."""

from __future__ import annotations

import itertools
import weakref
from collections import deque
from typing import Any, Callable, Iterator, Protocol

from shmloader._errors import ShmLoaderError
from shmloader._state_layout import Plan
from shmloader.worker.produce import has_state


class Consuming(Protocol):
    def consumed_below(self) -> int:
        """Every batch of the epoch below this one was consumed."""


def state_of(obj: Any) -> Any:
    """``obj.state_dict()`` where it has the Stateful protocol, else None (torchdata's rule)."""
    return obj.state_dict() if has_state(obj) else None


class SamplerPulls:
    """A stateful index sampler's iterator, remembering its state after each pull not yet below
    ``floor()`` (the batches consumed: every one below it), so that a state taken after k batches
    has the sampler as it was after the k-th pull (the workers prefetch: the sampler is ahead of
    the consumer). ``floor`` does not hold the iterator (a dropped one must die at once)."""

    def __init__(self, index_sampler: Any, it: Iterator[Any], pulled: int, floor: Callable[[], int]) -> None:
        self.index_sampler = index_sampler
        self.floor = floor
        self.start(it, pulled)

    def start(self, it: Iterator[Any], pulled: int) -> None:
        """Go on from ``it``, which has given ``pulled`` batches."""
        self.it = it
        self.pulled = pulled
        self.states: deque[tuple[int, Any, Any]] = deque([(pulled, state_of(it), state_of(self.index_sampler))])

    def __iter__(self) -> SamplerPulls:
        return self

    def __next__(self) -> Any:
        index = next(self.it)
        self.pulled += 1
        states = self.states
        states.append((self.pulled, state_of(self.it), state_of(self.index_sampler)))
        floor = self.floor()
        while states[0][0] < floor:
            states.popleft()
        return index

    def at(self, pulled: int) -> tuple[Any, Any]:
        for n, it_state, sampler_state in self.states:
            if n == pulled:
                return it_state, sampler_state
        raise ShmLoaderError(f"the sampler's state after {pulled} batches is no longer kept "
                             f"(kept: {[n for n, _, _ in self.states]})")


class Skipping:
    """The sampler's batches from task ``seq`` of the epoch on, less those already consumed (a
    resumed ``in_order=False`` epoch). ``source``: what it draws from."""

    def __init__(self, source: Iterator[Any], seq: int, consumed: tuple[int, ...]) -> None:
        self.source, self.seq, self.consumed = source, seq, set(consumed)

    def __iter__(self) -> Skipping:
        return self

    def __next__(self) -> Any:
        while True:
            index = next(self.source)
            self.seq += 1
            if self.seq - 1 not in self.consumed:
                return index


def pulled_from(index_sampler: Any, sampler_iter: Any, iterable: bool, it: Consuming) -> Any:
    """A ring iterator's ``sampler_iter`` (of ``index_sampler``): a stateful sampler's wrapped in
    ``SamplerPulls``, whose floor is ``it.consumed_below()`` (read without holding ``it``)."""
    if iterable or not stateful_sampler(index_sampler, sampler_iter):
        return sampler_iter
    ref = weakref.ref(it)

    def floor() -> int:
        live = ref()
        return 0 if live is None else int(live.consumed_below())
    return SamplerPulls(index_sampler, sampler_iter, 0, floor)


def sampler_states(sampler_iter: Any, consumed: int) -> tuple[Any, Any]:
    """A stateful sampler's (iterator, index sampler) states after the ``consumed``-th pull."""
    pulls = sampler_iter.source if isinstance(sampler_iter, Skipping) else sampler_iter
    return pulls.at(consumed) if isinstance(pulls, SamplerPulls) else (None, None)


def stateful_sampler(index_sampler: Any, sampler_iter: Any) -> bool:
    return has_state(index_sampler) or has_state(sampler_iter)


def position(index_sampler: Any, sampler_iter: Any, plan: Plan, iterable: bool,
             rng: Callable[[], None] | None) -> Any:
    """Where a resumed epoch's new iterator goes on from ``plan``'s snapshot (see the NOTE, steps
    2-3): its sampler iterator (``sampler_iter``, of ``index_sampler``, put where the snapshot
    was; returned), then the RNG (``rng``; None: its caller puts it back later)."""
    if not iterable:
        pulls = sampler_iter if isinstance(sampler_iter, SamplerPulls) else None
        inner = sampler_iter if pulls is None else pulls.it
        if stateful_sampler(index_sampler, inner) and plan.sampler_states != (None, None):
            inner = restore_sampler(index_sampler, inner, plan)
        else:
            for _ in range(plan.below):
                if next(inner, DONE) is DONE:
                    break
            # The batches it had given ahead of the consumer are drawn now too, and kept, and its
            # end if it had ended: what it drew from the RNG for them (torch's RandomSampler: its
            # seed, and at its end one more permutation) was drawn before the state was taken.
            ahead = list(itertools.islice(inner, max(0, plan.pulled - plan.below)))
            if plan.drained:
                ahead.extend(inner)  # (nothing more: its end is reached, and drawn for, now)
            if ahead:
                inner = itertools.chain(ahead, inner)
        if pulls is not None:
            pulls.start(inner, plan.below)  # (counting the epoch's tasks, those skipped below too)
        source = inner if pulls is None else pulls
        sampler_iter = Skipping(source, plan.below, plan.ahead) if plan.ahead else source
    if rng is not None:
        rng()
    return sampler_iter


DONE = object()


def restore_sampler(index_sampler: Any, inner: Any, plan: Plan) -> Any:
    """A stateful index sampler (or its iterator) loads its own state, as torchdata's does:
    returns the iterator to go on with."""
    iter_state, sampler_state = plan.sampler_states
    if sampler_state is not None and has_state(index_sampler):
        index_sampler.load_state_dict(sampler_state)
        inner = iter(index_sampler)
    if iter_state is not None and has_state(inner):
        inner.load_state_dict(iter_state)
    return inner


def carry_sampler(index_sampler: Any, plan: Plan) -> None:
    """A state taken after its epoch ended: a stateful sampler goes where that epoch left it (its
    next ``iter()`` is the next epoch's). Called just before that ``iter()``."""
    if plan.sampler_states != (None, None):
        restore_sampler(index_sampler, iter(index_sampler), plan)
