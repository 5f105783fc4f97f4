"""torchdata's ``test/stateful_dataloader/test_hugging_face.py``, rewritten: a Hugging Face
``datasets.IterableDataset`` (which has its own ``state_dict()``) checkpointed and resumed through
the loader under test (``SDL``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

datasets = pytest.importorskip("datasets")

from datasets.info import DatasetInfo  # noqa: E402
from datasets.iterable_dataset import ExamplesIterable, IterableDataset  # noqa: E402

from tests.compat.upstream import identity  # noqa: E402

DEFAULT_N_EXAMPLES = 20
DEFAULT_FILEPATH = "file.txt"


def generate_examples_fn(**kwargs: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    kwargs = kwargs.copy()
    n = kwargs.pop("n", DEFAULT_N_EXAMPLES)
    filepaths = kwargs.pop("filepaths", None)
    for filepath in filepaths or [DEFAULT_FILEPATH]:
        if filepaths is not None:
            kwargs["filepath"] = filepath
        for i in range(n):
            yield f"{filepath}_{i}", {"id": i, **kwargs}


def run_and_checkpoint(SDL: Any, num_workers: int, pw: bool, interrupt: int, every_n_steps: int = 1) -> None:
    dataset = IterableDataset(ExamplesIterable(generate_examples_fn, {}), info=DatasetInfo(description="dummy"),
                              split="train")
    kw = dict(num_workers=num_workers, collate_fn=identity, snapshot_every_n_steps=every_n_steps, persistent_workers=pw)
    dl = SDL(dataset=dataset, **kw)
    it = iter(dl)
    for _ in range(interrupt):
        next(it)
    state_dict = dl.state_dict()
    exp = list(it)
    dl = SDL(dataset=dataset, **kw)
    dl.load_state_dict(state_dict)
    assert exp == list(iter(dl))


BS_INTERRUPT = list(itertools.product([None, 7], [0, 1, 10]))


# (upstream takes a batch_size it does not pass to the loader: neither does this)
@pytest.mark.parametrize("batch_size,interrupt", BS_INTERRUPT)
def test_no_mp(SDL: Any, batch_size: int | None, interrupt: int) -> None:
    run_and_checkpoint(SDL, num_workers=0, pw=False, interrupt=interrupt)


@pytest.mark.parametrize("batch_size,interrupt", BS_INTERRUPT)
def test_mp_x(SDL: Any, batch_size: int | None, interrupt: int) -> None:
    run_and_checkpoint(SDL, num_workers=3, pw=False, interrupt=interrupt)


@pytest.mark.parametrize("batch_size,interrupt", BS_INTERRUPT)
def test_mp_pw(SDL: Any, batch_size: int | None, interrupt: int) -> None:
    run_and_checkpoint(SDL, num_workers=3, pw=True, interrupt=interrupt)


@pytest.mark.parametrize("every_n_steps,interrupt", list(itertools.product([2, 5], [0, 1, 10])))
def test_mp_every_n_steps(SDL: Any, every_n_steps: int, interrupt: int) -> None:
    # (upstream's loop passes every_n_steps to nothing: the default, 1, is run)
    run_and_checkpoint(SDL, num_workers=3, pw=True, interrupt=interrupt)
