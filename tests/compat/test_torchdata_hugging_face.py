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

from tests.compat.test_torchdata_state_dict import run_iterable  # noqa: E402

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


def hf_dataset(shuffle: bool) -> IterableDataset:
    return IterableDataset(ExamplesIterable(generate_examples_fn, {}), info=DatasetInfo(description="dummy"),
                           split="train")


def run_and_checkpoint(SDL: Any, num_workers: int, pw: bool, interrupt: int) -> None:
    """Upstream's _run_and_checkpoint: test_state_dict.py's iterable one, on this dataset."""
    run_iterable(SDL, hf_dataset, num_workers=num_workers, pw=pw, interrupt=interrupt)


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
