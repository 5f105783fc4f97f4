"""The README's Python examples run as written (CUDA ones only where CUDA exists)."""

from __future__ import annotations

import pathlib
import re

import torch

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples() -> None:
    assert len(BLOCKS) >= 3


def test_readme_examples_run() -> None:
    namespace: dict[str, object] = {"__name__": "readme"}
    for block in BLOCKS:
        if "cuda" in block and not torch.cuda.is_available():
            continue
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102
