"""``python -m shmloader info``, line by line, with the fast path on and forced off; and the
fallback's one warning, at the user's line."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import warnings
from typing import Any

import numpy as np
import pytest
import torch

import shmloader
from shmloader import _accel, _info, _native
from shmloader._reinstall import PACKAGE_DIR, reinstall_command
from shmloader.worker import collate as _collate


def expected_head() -> list[str]:
    return [
        f"shmloader {_info.version_of('shmloader')} ({PACKAGE_DIR})",
        f"Python {sys.version.split()[0]} (CPython, {sys.executable})",
        f"torch {torch.__version__}",
        f"numpy {np.__version__}",
        f"posix_ipc {_info.version_of('posix_ipc')}",
        f"uvloop {_info.version_of('uvloop')}",
        "fast path: on (shmloader._native: the ring's slots, semaphores and per-batch steps, " + _native.__file__ + ")",
    ]


def memory(line: str) -> None:
    total = shutil.disk_usage("/dev/shm").total / (1 << 30)  # (what is free moves between two reads)
    assert re.fullmatch(rf"shared memory: /dev/shm, \d+\.\d GiB free of {total:.1f} GiB "
                        r"\(a ring it cannot hold goes to a memory file, memfd\)", line), line


@pytest.mark.skipif(_accel.WHY_OFF is not None, reason="the fast path is off here: test_the_off_case covers it")
def test_the_on_case_line_by_line() -> None:
    got = _info.lines()
    assert got[:7] == expected_head()
    assert got[7] == (f"fast path: on (stack_into: a worker stacks plain samples with one memcpy each; "
                      f"torch {torch.__version__}'s tensors read through its C shim)")
    memory(got[8])
    assert len(got) == 9


def test_the_off_case_line_by_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_accel.OFF_VARIABLE, "1")
    monkeypatch.setattr(_accel, "WHY_OFF", _accel.learn()[1])
    got = _info.lines()
    assert got[:7] == expected_head()
    assert got[7] == "fast path: off (SHMLOADER_NO_FAST_PATH is set in the environment, unset SHMLOADER_NO_FAST_PATH)"
    memory(got[8])


def test_an_unknown_torch_says_why_and_the_command_that_upgrades_shmloader_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native, "learn_tensors", lambda *args: "no word of a 48-byte tensor object holds its TensorImpl")
    stack, off = _accel.learn()
    assert stack is None and off is not None
    assert off[0] == f"torch {torch.__version__}'s tensors are not recognised: no word of a 48-byte tensor object holds its TensorImpl"
    tree = _info.os.path.dirname(PACKAGE_DIR)  # (this checkout: a tree, brought up to date and built again)
    assert off[1] == f"git -C {tree} pull && {sys.executable} -m pip install --no-deps --force-reinstall -e {tree}"


def test_a_missing_native_part_says_the_command_that_rebuilds_it() -> None:
    line = _info.native_line(None, "No module named 'shmloader._native'")
    assert line == (f"fast path: off (shmloader._native did not load: No module named 'shmloader._native'; "
                    f"shmloader cannot run without it, {reinstall_command()})")
    assert "--no-deps --force-reinstall" in line


def test_unusable_shared_memory_is_said() -> None:
    assert _info.memory_line("/no/such/dir") == (
        "shared memory: /no/such/dir does not exist (to use it: mount a tmpfs there); rings go to memory files "
        "(memfd), which it does not bound")


@pytest.mark.slow
def test_python_dash_m_shmloader_info_prints_the_lines() -> None:
    done = subprocess.run([sys.executable, "-m", "shmloader", "info"], capture_output=True, text=True, check=True)
    printed = done.stdout.splitlines()
    assert printed[:7] == expected_head() and printed[7].startswith("fast path: ")
    assert printed[8].startswith("shared memory: /dev/shm, ") and done.stderr == ""


class Rows(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), float(i))


def test_without_the_fast_path_batches_are_torch_s_and_it_warns_once_at_the_user_s_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_collate, "_stack_into", None)  # (the forked workers inherit it)
    monkeypatch.setattr(_accel, "WHY_OFF", ("torch 9.9's tensors are not recognised: a test", "pip install x"))
    monkeypatch.setattr(_accel, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = shmloader.DataLoader(Rows(), batch_size=5, num_workers=2); line = sys._getframe().f_lineno  # noqa: E702
        second = shmloader.DataLoader(Rows(), batch_size=5, num_workers=2)
    ours = [w for w in caught if "stack samples with torch.stack" in str(w.message)]
    assert len(ours) == 1 and ours[0].category is RuntimeWarning
    assert (ours[0].filename, ours[0].lineno) == (__file__, line)
    assert str(ours[0].message) == (
        "shmloader's workers stack samples with torch.stack (about 8 times the CPU for a batch of small samples): "
        "torch 9.9's tensors are not recognised: a test. To turn its fast path on: pip install x "
        "(SHMLOADER_NO_FAST_PATH=1 silences this)")
    want = [b.clone() for b in torch.utils.data.DataLoader(Rows(), batch_size=5)]
    for loader in (first, second):
        got = [b.clone() for b in loader]
        assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


class Dist:
    def __init__(self, direct: str | None) -> None:
        self.direct = direct

    def read_text(self, name: str) -> str | None:
        return self.direct if name == "direct_url.json" else None


@pytest.mark.parametrize("direct, reinstall, upgrade", [
    ('{"url": "file:///wheels/shmloader-0.1.0-cp311-cp311-manylinux_2_34_x86_64.whl", "archive_info": {}}',
     "/wheels/shmloader-0.1.0-cp311-cp311-manylinux_2_34_x86_64.whl", "shmloader"),
    ('{"url": "file:///home/me/my%20clone", "dir_info": {}}', "'/home/me/my clone'", "shmloader"),
    ('{"url": "ssh://git@example.org/shmloader.git", "vcs_info": {"vcs": "git", "commit_id": "abc123"}}',
     "git+ssh://git@example.org/shmloader.git@abc123", "git+ssh://git@example.org/shmloader.git"),
    (None, "shmloader", "shmloader"),
], ids=["a wheel file", "a directory", "a git URL", "the package index"])
def test_the_commands_reinstall_or_upgrade_shmloader_alone_as_it_was_installed(
        direct: str | None, reinstall: str, upgrade: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from shmloader import _reinstall

    monkeypatch.setattr(_reinstall, "PACKAGE_DIR", str(tmp_path / "site-packages" / "shmloader"))
    monkeypatch.setattr(_reinstall.metadata, "distribution", lambda name: Dist(direct))
    assert _reinstall.reinstall_command() == f"{sys.executable} -m pip install --no-deps --force-reinstall {reinstall}"
    assert _reinstall.upgrade_command() == f"{sys.executable} -m pip install --no-deps --upgrade {upgrade}"


def test_from_a_source_tree_the_command_rebuilds_the_tree() -> None:
    tree = _info.os.path.dirname(PACKAGE_DIR)
    assert reinstall_command() == f"{sys.executable} -m pip install --no-deps --force-reinstall -e {tree}"
