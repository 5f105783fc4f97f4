"""shmloader.share(): a read-only shared-memory copy with the original's read interface, usable
by torch's and shmloader's workers under every start method, leaving nothing behind."""

from __future__ import annotations

import collections
import enum
import math
import os
import pathlib
import pickle
import signal
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

import shmloader
from tests.conftest import examples


class Color(enum.IntEnum):  # an int subclass: marshal would read it back as an int
    RED = 1
    BLUE = 2


LEAVES = (
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats(allow_nan=True) | st.text(max_size=20) | st.binary(max_size=20)
    | st.lists(st.integers(-1000, 1000), max_size=6).map(lambda v: np.asarray(v, dtype=np.int32))
    | st.lists(st.floats(-1e6, 1e6, width=32), max_size=6).map(lambda v: torch.tensor(v, dtype=torch.float32))
    | st.binary(max_size=8).map(bytearray) | st.sampled_from(list(Color)) | st.frozensets(st.integers(0, 9), max_size=3)
)
NESTED = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=5) | st.integers(0, 9), inner, max_size=4),
    max_leaves=12,
)


def equal(a: Any, b: Any) -> bool:
    """Equality that compares arrays and tensors by dtype, shape and bits, and NaN as NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, (list, tuple)):  # (and their subclasses: same type checked above)
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(equal(a[k], b[k]) for k in a)
    return bool(a == b)


@settings(max_examples=examples(150), deadline=None)
@given(st.lists(NESTED, max_size=8))
def test_a_shared_list_reads_back_equal(values: list[Any]) -> None:
    shared = shmloader.share(values)
    assert len(shared) == len(values)
    assert equal(list(shared), values)
    assert all(equal(shared[i], v) for i, v in enumerate(values))
    if values:
        assert equal(shared[-1], values[-1]) and equal(shared[1:3], values[1:3]) and equal(shared[::-1], values[::-1])
    with pytest.raises(IndexError):
        shared[len(values)]


@settings(max_examples=examples(100), deadline=None)
@given(st.dictionaries(st.text(max_size=8) | st.integers() | st.tuples(st.integers(0, 5), st.text(max_size=3)), NESTED,
                       max_size=10))
def test_a_shared_dict_reads_back_equal(mapping: dict[Any, Any]) -> None:
    shared = shmloader.share(mapping)
    assert len(shared) == len(mapping) and list(shared) == list(mapping) and list(shared.keys()) == list(mapping)
    assert all(equal(shared[k], v) for k, v in mapping.items())
    assert equal(dict(shared.items()), mapping) and equal(list(shared.values()), list(mapping.values()))
    assert all(k in shared for k in mapping) and "not a key \x00" not in shared
    assert shared.get("not a key \x00", 7) == 7
    with pytest.raises(KeyError):
        shared["not a key \x00"]


def test_each_element_comes_back_with_its_own_types_and_sharing() -> None:
    # Plain elements are marshalled and read in C; these must not be (marshal would change
    # their type or copy a shared container), and come back exactly as pickle keeps them.
    inner = [1, 2]
    deep: list[Any] = []
    for _ in range(100):
        deep = [deep]
    recursive: list[Any] = []
    recursive.append(recursive)
    odd = [bytearray(b"ab"), Color.RED, collections.OrderedDict(a=1), {"k": Color.BLUE}, (inner, inner),
           {"s": frozenset({1})}, deep, recursive, -0.0, float("nan"), 2**100, "\udc80", b"\x00", True, None]
    shared = shmloader.share(odd)
    assert equal(list(shared[:6]), odd[:6]) and equal(shared[6], deep) and type(shared[1]) is Color
    pair = shared[4]
    assert pair[0] is pair[1]  # one list, as pickle keeps it
    again = shared[7]
    assert again[0] is again
    assert math.copysign(1, shared[8]) == -1 and math.isnan(shared[9]) and shared[10] == 2**100
    assert shared[11] == "\udc80" and shared[12] == b"\x00" and shared[13] is True and shared[14] is None
    assert all(shared[i] is not shared[i] for i in (0, 2))  # fresh copies, never the same object


def test_tuples_stay_tuples_and_arrays_are_read_only_views() -> None:
    arrays = {"x": np.arange(6, dtype=np.int64).reshape(2, 3), "t": torch.arange(4.0)}
    shared = shmloader.share((arrays, "two"))
    assert shared[1] == "two" and shared[0:2][1] == "two" and isinstance(shared[0:2], tuple)
    got = shared[0]
    assert np.array_equal(got["x"], arrays["x"]) and torch.equal(got["t"], arrays["t"])
    maps = pathlib.Path("/proc/self/maps").read_text().splitlines()
    for ptr in (got["x"].__array_interface__["data"][0], got["t"].data_ptr()):
        owners = [m for m in maps if int(m.split()[0].split("-")[0], 16) <= ptr < int(m.split()[0].split("-")[1], 16)]
        assert owners and "shmloader-share" in owners[0], owners  # a view of the shared file, not a copy
    with pytest.raises(ValueError, match="read-only"):
        got["x"][0, 0] = 5


def test_it_cannot_be_changed() -> None:
    shared_list, shared_dict = shmloader.share([1, 2]), shmloader.share({"a": 1})
    with pytest.raises(TypeError):
        shared_list[0] = 5  # type: ignore[index]
    with pytest.raises(TypeError):
        del shared_list[0]  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        shared_dict["a"] = 2  # type: ignore[index]
    with pytest.raises(AttributeError):
        shared_list.append(3)  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="share\\(\\) takes a list, tuple, dict, iterator"):
        shmloader.share({1, 2})
    with pytest.raises(PermissionError):  # the file is sealed: not even its descriptor can write it
        os.pwrite(shared_list._store.fd, b"x", 0)


def test_dict_keys_match_as_in_a_dict() -> None:
    keys = {1: "int", (2, "b"): "tuple", frozenset({"x", "y"}): "frozenset", None: "none", Color.BLUE: "enum",
            "s": "str", b"s": "bytes"}
    shared = shmloader.share(keys)
    assert shared[1] == "int" and shared[(2, "b")] == "tuple" and shared[frozenset({"y", "x"})] == "frozenset"
    assert shared[1.0] == shared[True] == "int" and shared[2] == "enum" and shared[None] == "none"
    assert shared["s"] == "str" and shared[b"s"] == "bytes" and (2.5 in shared, "t" in shared) == (False, False)
    with pytest.raises(TypeError, match="unhashable"):
        shared[[1]]  # as from a dict


class ByFrozensetKeys(Dataset):  # type: ignore[type-arg]
    """Looks its samples up by frozensets of strings, which hash differently under each hash seed."""

    def __init__(self, table: Any) -> None:
        self.table = table

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> str:
        return str(self.table[frozenset({f"k{i}", f"v{i}", "shared"})])


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_frozenset_keys_are_found_by_spawn_and_forkserver_workers(context: str) -> None:
    table = shmloader.share({frozenset({f"k{i}", f"v{i}", "shared"}): f"sample {i}" for i in range(12)})
    got = list(shmloader.DataLoader(ByFrozensetKeys(table), batch_size=None, num_workers=2,
                                    multiprocessing_context=context))
    assert got == [f"sample {i}" for i in range(12)]


def test_a_generator_is_stored_as_it_comes() -> None:
    shared = shmloader.share({"path": f"/data/{i}.jpg", "label": i} for i in range(500))
    assert len(shared) == 500 and shared[499] == {"path": "/data/499.jpg", "label": 499}
    assert list(shmloader.share(iter([]))) == []


def test_nothing_appears_in_dev_shm() -> None:
    before = set(os.listdir("/dev/shm"))
    shared = shmloader.share([{"path": f"/data/{i}.jpg", "label": i} for i in range(1000)])
    assert set(os.listdir("/dev/shm")) == before
    assert shared[999] == {"path": "/data/999.jpg", "label": 999}
    assert repr(shared) == "<shmloader shared list of 1,000 elements>"


class Samples(Dataset):  # type: ignore[type-arg]
    """An ImageFolder-style dataset: (path, label) entries, here as a tensor of the label."""

    def __init__(self, entries: Any) -> None:
        self.entries = entries

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, str]:
        entry = self.entries[i]
        return torch.tensor([entry["label"], len(entry["path"])]), entry["path"]


ENTRIES = [{"path": f"/data/class{i % 7}/{i:05d}.jpg", "label": i % 7} for i in range(120)]


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
@pytest.mark.parametrize("loader", ["torch", "shmloader"])
def test_workers_read_it_under_every_start_method(context: str, loader: str) -> None:
    want = list(TorchDataLoader(Samples(ENTRIES), batch_size=8))
    make = TorchDataLoader if loader == "torch" else shmloader.DataLoader
    got = list(make(Samples(shmloader.share(ENTRIES)), batch_size=8, num_workers=2, multiprocessing_context=context))
    assert len(got) == len(want)
    for (x, paths), (wx, wpaths) in zip(got, want):
        assert torch.equal(x, wx) and paths == wpaths


def test_it_pickles_as_a_handle_not_as_data() -> None:
    shared = shmloader.share([b"x" * 100_000] * 10)
    assert len(pickle.dumps(shared)) < 1000  # the descriptor, through multiprocessing's resource sharer
    again = pickle.loads(pickle.dumps(shared))
    assert len(again) == 10 and again[3] == b"x" * 100_000


@pytest.mark.slow
def test_owner_killed_leaves_nothing_and_its_workers_exit(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "owner.py"
    script.write_text(
        "import json, signal, sys\n"
        f"sys.path.insert(0, {str(pathlib.Path(__file__).resolve().parents[2])!r})\n"
        "import shmloader\n"
        "from tests.integration.test_share import ENTRIES, Samples\n"
        "if __name__ == '__main__':\n"
        "    loader = shmloader.DataLoader(Samples(shmloader.share(ENTRIES)), batch_size=4, num_workers=2,\n"
        "                                  multiprocessing_context='spawn')\n"
        "    it = iter(loader)\n"
        "    next(it)\n"
        "    print(json.dumps([p.pid for p in it._life.pool.procs]), flush=True)\n"
        "    signal.pause()\n"
    )
    before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, proc.communicate()[1]
    proc.send_signal(signal.SIGKILL)
    _, stderr = proc.communicate()
    from tests.integration.test_failures import wait_exit

    assert wait_exit(__import__("json").loads(line), timeout=10) == []
    assert set(os.listdir("/dev/shm")) == before
    assert "Traceback" not in stderr, stderr
