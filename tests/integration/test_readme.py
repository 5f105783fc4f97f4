"""The README's Python examples run as written, in order, in one namespace (later blocks use
what earlier ones define). A block that needs CUDA is skipped, with the reason, where CUDA
is missing."""

from __future__ import annotations

import pathlib
import re
from typing import Any

import pytest
import torch

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
NAMESPACE: dict[str, Any] = {"__name__": "readme"}


def test_readme_has_examples() -> None:
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("number", range(len(BLOCKS)))
def test_readme_example_runs(number: int) -> None:
    block = BLOCKS[number]
    if "cuda" in block and not torch.cuda.is_available():
        pytest.skip(f"README block {number + 1} needs CUDA (torch.cuda.is_available() is False)")
    first = block.strip().splitlines()[0]
    try:
        exec(compile(block, f"{README}: block {number + 1} ({first})", "exec"), NAMESPACE)  # noqa: S102
    except BaseException:
        NAMESPACE["__failed__"] = number
        raise
    finally:
        stop_workers(NAMESPACE)


def stop_workers(namespace: dict[str, Any]) -> None:
    """Later blocks reuse earlier names, not their workers: stop every live iterator (a
    persistent loader's included) so each test ends with no worker running."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    for name, value in list(namespace.items()):
        if isinstance(value, torch.utils.data.DataLoader) and value._iterator is not None:
            getattr(value._iterator, "_shutdown_workers", lambda: None)()
            value._iterator = None
        elif isinstance(value, _BaseDataLoaderIter):
            getattr(value, "_shutdown_workers", lambda: None)()
            del namespace[name]


def test_readme_blocks_ran_in_order() -> None:
    # The blocks share one namespace; a failed one explains the failures after it.
    assert "__failed__" not in NAMESPACE, f"README block {NAMESPACE.get('__failed__', -1) + 1} failed"


def test_readme_blocks_that_print_figures_assert_them() -> None:
    # A printed figure is a claim: the block checks it, after printing it.
    for number, block in enumerate(BLOCKS):
        if "print(" in block:
            assert "assert " in block.split("print(", 1)[1], f"README block {number + 1} prints what it never asserts"
