"""Resumes at random points equal one uninterrupted run of torch's own DataLoader.

A run is a stream of events: each batch yielded, and each epoch's end (its StopIteration). A
state taken after a batch is taken inside the loop (the last batch too: its resume yields the
empty rest of that epoch); one taken after an epoch's end resumes into the next epoch. After
each state the loader is dropped, torch's global RNG is moved elsewhere (a new process's), and
a new loader built on the same arguments loads the state and goes on. Up to three such
resumes in one run (chained: a state taken soon after a resume, before every worker has
delivered, included), over three epochs; ``in_order`` either way, ``snapshot_every_n_steps``,
torch's samplers and a stateful one (torchdata's). What the run yields, epoch by epoch, must be
what torch's DataLoader yields uninterrupted from the same seed: contents, order (with
``in_order=False``, each batch exactly once) and epoch lengths.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any, Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset
from torchdata.stateful_dataloader.sampler import BatchSampler as StatefulBatchSampler
from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler

import shmloader
from tests.conftest import examples
from tests.datasets import Shards, StatefulShards

EPOCHS = 3
N, BS = 14, 3  # 5 batches an epoch, the last one short


class Range(Dataset[list[int]]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> list[int]:
        return [i]


class Noisy(Dataset[list[int]]):
    """Each item draws from torch's global RNG (a worker's, seeded as torch seeds it), which its
    state carries: a resume is exact only if every worker's RNG goes on where it was."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> list[int]:
        return [i, int(torch.randint(1000, ()).item())]

    def state_dict(self) -> dict[str, Any]:
        return {"rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["rng"])


def flat(batch: Any) -> list[int]:
    """A batch's values: a tensor, or (default collate of lists) a list of tensors."""
    parts = batch if isinstance(batch, list) else [batch]
    return [x for part in parts for x in part.flatten().tolist()]


def factory(cls: Any, run: Run) -> Callable[[], Any]:
    """The loader of ``run``: torch's (the reference) or shmloader's (with its own options)."""
    def make() -> Any:
        kw: dict[str, Any] = {"batch_size": BS, "num_workers": run.workers, "persistent_workers": run.persistent}
        if cls is shmloader.DataLoader:
            kw.update(in_order=run.in_order, snapshot_every_n_steps=run.every)
        if run.dataset == "iterable":
            return cls(Shards(N), **kw)
        if run.dataset == "iterable-stateful":
            return cls(StatefulShards(N), **kw)
        dataset = Noisy() if run.dataset == "map-stateful" else Range()
        if run.shuffle == "stateful-sampler":  # torchdata's: a batch sampler whose iterator has a state
            del kw["batch_size"]
            sampler = StatefulRandomSampler(dataset, generator=torch.Generator().manual_seed(3))
            return cls(dataset, batch_sampler=StatefulBatchSampler(sampler, BS, False), **kw)
        if run.shuffle == "generator":
            kw["generator"] = torch.Generator().manual_seed(7)
        return cls(dataset, shuffle=run.shuffle != "none", **kw)
    return make


def close(loader: Any) -> None:
    if loader._iterator is not None and hasattr(loader._iterator, "_shutdown_workers"):
        loader._iterator._shutdown_workers()


def uninterrupted(make: Callable[[], Any]) -> list[list[list[int]]]:
    torch.manual_seed(0)
    loader = make()
    epochs = [[flat(b) for b in loader] for _ in range(EPOCHS)]
    close(loader)
    return epochs


def interrupted(make: Callable[[], Any], cuts: set[int]) -> list[list[list[int]]]:
    torch.manual_seed(0)
    loader = make()
    events = 0

    def resumed(old: Any) -> Any:
        state = pickle.loads(pickle.dumps(old.state_dict()))  # (as a checkpoint file holds it)
        close(old)
        torch.manual_seed(1234)  # the resumed process's global RNG is somewhere else
        new = make()
        new.load_state_dict(state)
        return new

    epochs = []
    for _ in range(EPOCHS):
        batches = []
        it = iter(loader)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                break
            batches.append(flat(batch))
            events += 1
            if events in cuts:  # inside the loop
                del it
                loader = resumed(loader)
                it = iter(loader)
        epochs.append(batches)
        events += 1
        if events in cuts:  # after the epoch's end
            del it
            loader = resumed(loader)
    close(loader)
    return epochs


@dataclasses.dataclass(frozen=True)
class Run:
    dataset: str
    workers: int
    persistent: bool
    shuffle: str
    in_order: bool  # False: a map dataset whose items do not depend on the worker (batches compared as sets)
    every: int  # snapshot_every_n_steps
    cuts: frozenset[int]


@st.composite
def runs(draw: st.DrawFn) -> Run:
    dataset = draw(st.sampled_from(["map", "map-stateful", "iterable", "iterable-stateful"]))
    workers = draw(st.integers(0, 3))
    persistent = workers > 0 and draw(st.booleans())
    shuffles = ["none", "global", "generator", "stateful-sampler"]
    shuffle = "none" if dataset.startswith("iterable") else draw(st.sampled_from(shuffles))
    in_order = not (dataset == "map" and workers > 1 and draw(st.booleans()))
    every = draw(st.sampled_from([1, 1, 2, 3, 0])) if workers else 1
    total = EPOCHS * (N // BS + 2)  # events: an epoch's batches (at most 5 with 3 workers' shards) and its end
    gaps = draw(st.lists(st.integers(1, 8), min_size=1, max_size=3))  # small gaps: chained resumes
    at = draw(st.integers(0, total))
    cuts = set()
    for gap in gaps:
        cuts.add(at)
        at += gap
    return Run(dataset, workers, persistent, shuffle, in_order, every, frozenset(c for c in cuts if 0 < c <= total))


@settings(max_examples=examples(40), deadline=None, print_blob=True)
@given(runs())
def test_resumes_equal_torchs_uninterrupted_run(run: Run) -> None:
    want = uninterrupted(factory(torch.utils.data.DataLoader, run))
    got = interrupted(factory(shmloader.DataLoader, run), set(run.cuts))
    if not run.in_order:  # ready first: each epoch's batches, each exactly once
        want, got = [sorted(epoch) for epoch in want], [sorted(epoch) for epoch in got]
    assert got == want, (run, got, want)


class Count(Dataset[list[int]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> list[int]:
        return [i]


@pytest.mark.parametrize("n", [14, 15])  # (15: the sampler's end is a pull of its own, after the last batch)
@pytest.mark.parametrize("cut", [7, 9, 11])  # events: the second epoch's 1st, 3rd and 5th batch
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("every", [1, 2])
def test_a_samplers_end_draws_on_the_same_side_of_the_state_as_in_the_run(n: int, cut: int, persistent: bool,
                                                                          every: int) -> None:
    # torch's RandomSampler draws one more permutation from the generator at its end. The state
    # holds the generator as it was when taken: a resume must draw that end before it puts the
    # generator back if the run had, and after it if not, or every later epoch is shuffled anew.
    def factory(cls: Any) -> Callable[[], Any]:
        def make() -> Any:
            kw: dict[str, Any] = {"snapshot_every_n_steps": every} if cls is shmloader.DataLoader else {}
            return cls(Count(n), batch_size=BS, num_workers=2, persistent_workers=persistent, shuffle=True,
                       generator=torch.Generator().manual_seed(7), **kw)
        return make

    assert interrupted(factory(shmloader.DataLoader), {cut}) == uninterrupted(factory(torch.utils.data.DataLoader))


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("prefetch_factor", [None, 4])
def test_a_state_of_a_resumed_iterator_before_its_first_batch_counts_what_the_resume_drew(
        persistent: bool, prefetch_factor: int | None) -> None:
    # The first state is taken after the second epoch's first batch, while the workers have
    # drawn the epoch's indices to the sampler's end. A resumed iterator draws that much at once
    # (the RNG is past it), then dispatches: a state it gives before its first batch counts what
    # it drew, or the next resume draws the sampler's end again and shuffles the third epoch anew.
    def factory(cls: Any) -> Callable[[], Any]:
        def make() -> Any:
            kw: dict[str, Any] = {} if prefetch_factor is None else {"prefetch_factor": prefetch_factor}
            return cls(Count(N), batch_size=BS, num_workers=2, persistent_workers=persistent, shuffle=True,
                       generator=torch.Generator().manual_seed(7), **kw)
        return make

    want = uninterrupted(factory(torch.utils.data.DataLoader))
    make = factory(shmloader.DataLoader)
    loader = make()
    got = [[flat(b) for b in loader]]
    it = iter(loader)
    second = [flat(next(it))]
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    del it
    close(loader)
    resumed = make()
    resumed.load_state_dict(state)
    it = iter(resumed)
    state = pickle.loads(pickle.dumps(resumed.state_dict()))  # before its first batch
    del it
    close(resumed)
    again = make()
    again.load_state_dict(state)
    second += [flat(b) for b in again]
    got += [second, [flat(b) for b in again]]
    close(again)
    assert got == want
