"""``_native.lend_lone`` builds what ``read_batch`` builds for a batch that is one tensor in its
slot, or a list, tuple or dict of tensors whose skeleton ``read_batch`` learnt (a recipe), and
lends it as ``Leases.lend`` would; for anything else it answers None and changes nothing, so
that ``read_batch`` builds that batch or says what is wrong with it. The tensors it lends over
the slot's arrays are ``torch.from_numpy``'s."""

from __future__ import annotations

import gc
import mmap
import sys
from collections import OrderedDict, namedtuple
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from shmloader import CorruptSlotError, _native
from shmloader.main import lease
from shmloader.main.lease import lone_args, read_batch
from shmloader.wire.layout import Field, Region, RingGeometry
from shmloader.wire.ring import _Views
from shmloader.worker.collate import SlotWriter

GEOMETRY = RingGeometry(num_workers=1, num_slots=3, data_bytes=1 << 19)
MOST_LENT = 2  # Delivery.most_lent() of this ring: one slot left to its one worker


def written(batch: Any, slot: int = 1) -> _Views:
    views = _Views(GEOMETRY, mmap.mmap(-1, GEOMETRY.total_bytes))
    writer = SlotWriter(views.mm)
    writer.begin(views.data_offsets[slot], GEOMETRY.data_bytes)
    writer.finish(batch)
    hdr = views.headers[slot]
    hdr[Field.TABLE_OFF], hdr[Field.TABLE_LEN] = writer.table_off, writer.table_len
    hdr[Field.PICKLED_OFF], hdr[Field.PICKLED_LEN] = writer.pickled_off, writer.pickled_len
    hdr[Field.REGION] = int(Region.SLOT)
    return views


def lend(views: _Views, bases: dict[int, Any], slot: int = 1) -> tuple[Any, int] | None:
    return _native.lend_lone(slot, bases, lone_args(views, MOST_LENT))  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def no_recipes() -> Iterator[None]:
    """Each test starts with no recipe learnt (read_batch learns them for the whole process)."""
    saved = dict(lease.RECIPES)
    lease.RECIPES.clear()
    yield
    lease.RECIPES.clear()
    lease.RECIPES.update(saved)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(32 * 16, dtype=torch.float32).reshape(32, 16) / 7,
        torch.arange(64 * 512, dtype=torch.int64).reshape(64, 512) - 5000,
        torch.arange(2 * 3 * 4 * 5, dtype=torch.uint8).reshape(2, 3, 4, 5),
        torch.tensor([True, False, True]),
        torch.tensor(-3, dtype=torch.int16),  # 0-d
        torch.arange(6, dtype=torch.float64).reshape(2, 3).t().contiguous(),
        torch.arange(8, dtype=torch.float32).to(torch.complex64) * 1j,
    ],
    ids=["f32", "i64", "u8-4d", "bool", "0d", "f64", "c64"],
)
def test_builds_what_read_batch_builds_over_the_same_bytes(tensor: torch.Tensor) -> None:
    views = written(tensor)
    bases: dict[int, Any] = {}
    built = lend(views, bases)
    assert built is not None
    batch, nbytes = built
    want, _, want_nbytes = read_batch(views, 1)  # type: ignore[arg-type]
    assert type(batch) is torch.Tensor and batch.dtype == tensor.dtype and batch.shape == tensor.shape
    assert torch.equal(batch, tensor) and torch.equal(batch, want)
    assert nbytes == want_nbytes == tensor.nbytes
    assert batch.data_ptr() == want.data_ptr()  # a view of the slot, not a copy
    assert list(bases) == [1] and type(bases[1]) is np.ndarray
    assert not batch.requires_grad and batch.is_contiguous()


def test_the_slot_comes_back_when_the_last_view_is_gone() -> None:
    views = written(torch.arange(100, dtype=torch.int32).reshape(10, 10))
    bases: dict[int, Any] = {}
    built = lend(views, bases)
    assert built is not None
    batch = built[0]
    del built
    row = batch[3]
    del batch
    gc.collect()
    assert _native.unviewed(bases, False) == []  # a row of it still views the slot
    assert torch.equal(row, torch.arange(30, 40, dtype=torch.int32))
    del row
    assert _native.unviewed(bases, True) == [1] and bases == {}


def test_writes_to_the_batch_land_in_the_slot() -> None:
    views = written(torch.zeros(4, dtype=torch.int64))
    built = lend(views, {})
    assert built is not None
    built[0][2] = 7
    again, _, _ = read_batch(views, 1)  # type: ignore[arg-type]
    assert again.tolist() == [0, 0, 7, 0]


@pytest.mark.parametrize(
    "batch",
    [
        {"x": torch.arange(4)},
        (torch.arange(4), torch.arange(4)),
        [torch.arange(4)],
        np.arange(4),  # a numpy batch: read_batch's own path
        torch.arange(4, dtype=torch.bfloat16),  # no numpy dtype
        torch.zeros(0, 3),  # no bytes
    ],
    ids=["dict", "tuple", "list", "numpy", "bf16", "empty"],
)
def test_anything_but_one_tensor_or_a_learnt_recipe_is_left_to_read_batch(batch: Any) -> None:
    views = written(batch)
    bases: dict[int, Any] = {}
    assert lend(views, bases) is None  # (no recipe learnt yet)
    assert bases == {}
    read_batch(views, 1)  # type: ignore[arg-type]  # which builds it


def same_batch(got: Any, want: Any, memory: bool = True) -> None:
    """The same container (type, keys) of tensors of the same dtype, shape and bytes (and with
    ``memory``, over the same memory)."""
    assert type(got) is type(want)
    if isinstance(want, dict):
        assert list(got) == list(want)
        got, want = list(got.values()), list(want.values())
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert type(g) is torch.Tensor and g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
        assert (g.data_ptr() == w.data_ptr() or not memory) and not g.requires_grad


Pair = namedtuple("Pair", "x y")
COLUMNS = [torch.arange(32 * 16, dtype=torch.float32).reshape(32, 16) / 7, torch.arange(32) % 10,
           torch.arange(32 * 8).reshape(32, 8) > 100, torch.tensor(2.5, dtype=torch.float64)]


@pytest.mark.parametrize(
    "batch",
    [
        COLUMNS[:2],  # (input, label) samples: default_collate makes a list
        tuple(COLUMNS),
        {"input_ids": COLUMNS[1], "attention_mask": COLUMNS[2], "pixels": COLUMNS[0]},
        [COLUMNS[0]],
        {"x": COLUMNS[3]},
    ],
    ids=["list", "tuple", "dict", "list of one", "dict of one 0-d"],
)
def test_a_container_of_tensors_is_built_by_its_recipe_as_read_batch_builds_it(batch: Any) -> None:
    views = written(batch)
    assert lend(views, {}) is None  # the first: unpickled by read_batch, which learns its skeleton
    read_batch(views, 1)  # type: ignore[arg-type]
    assert len(lease.RECIPES) == 1
    again = written(batch)  # (another batch of that skeleton)
    bases: dict[int, Any] = {}
    built = lend(again, bases)
    assert built is not None
    got, nbytes = built
    want, _, want_nbytes = read_batch(again, 1)  # type: ignore[arg-type]
    same_batch(got, want)
    values = list(batch.values()) if isinstance(batch, dict) else batch
    same_batch(got, batch, memory=False)
    assert nbytes == want_nbytes == sum(t.nbytes for t in values)
    assert list(bases) == [1] and type(bases[1]) is np.ndarray and bases[1].nbytes == GEOMETRY.data_bytes


def test_a_recipe_builds_any_leaves_of_its_skeleton() -> None:
    """The skeleton of a pair names no dtype or shape: the table's are built."""
    read_batch(written([torch.zeros(3), torch.zeros(2, dtype=torch.int64)]), 1)  # type: ignore[arg-type]
    pair = [torch.arange(12, dtype=torch.int16).reshape(3, 4), torch.tensor([True, False])]
    built = lend(written(pair), {})
    assert built is not None
    same_batch(built[0], pair, memory=False)


@pytest.mark.parametrize(
    "batch",
    [
        Pair(torch.arange(3), torch.arange(3)),  # a class: unpickled
        OrderedDict(x=torch.arange(3)),
        {1: torch.arange(3)},  # not a str key
        {"x": torch.arange(3), "y": [torch.arange(2)]},  # nested
        [torch.arange(3), 7],  # not only leaves
        [torch.arange(3)] * 2,  # one tensor twice: one leaf
        [torch.arange(6)[1:3], torch.arange(2)],  # a view of part of a storage (a VIEW, not a leaf)
        [],
    ],
    ids=["namedtuple", "OrderedDict", "int key", "nested", "a number", "twice", "view", "empty"],
)
def test_only_a_plain_container_of_its_own_leaves_in_order_is_learnt(batch: Any) -> None:
    views = written(batch)
    read_batch(views, 1)  # type: ignore[arg-type]
    assert lease.RECIPES == {}
    assert lend(views, {}) is None


def test_a_recipe_is_learnt_only_for_the_skeleton_the_workers_write() -> None:
    """A skeleton that unpickles to a list of the leaves some other way (here: the list's items
    set one by one after it is made) is not a recipe's: its opcodes are not the pickler's."""
    leaves = [torch.arange(3), torch.arange(2)]
    views = written(leaves)
    read_batch(views, 1)  # type: ignore[arg-type]
    (skeleton,) = lease.RECIPES
    lease.RECIPES.clear()
    odd = b"\x80\x05](K\x00QK\x01Qe."  # (no frame, no memo: unpickles to the same list)
    assert odd != skeleton
    lease.learn_recipe(odd, list(leaves), leaves)
    assert lease.RECIPES == {}
    lease.learn_recipe(skeleton, list(leaves), leaves)
    assert lease.RECIPES == {skeleton: (0, 2, None)}


@pytest.mark.parametrize("odd", ["bf16", "empty", "numpy", "more leaves"])
def test_a_recipe_leaves_what_it_does_not_build_to_read_batch(odd: str) -> None:
    read_batch(written([torch.arange(3), torch.arange(2)]), 1)  # type: ignore[arg-type]
    second = {"bf16": torch.zeros(2, dtype=torch.bfloat16), "empty": torch.zeros(0), "numpy": np.arange(2)}
    if odd == "more leaves":  # the pair's skeleton over a table of three leaves (a torn write)
        views = written([torch.arange(3), torch.arange(2), torch.arange(4)])
        (skeleton,) = lease.RECIPES
        at = views.data_offsets[1] + 4096
        views.bytes[at : at + len(skeleton)] = np.frombuffer(skeleton, np.uint8)
        views.headers[1][Field.PICKLED_OFF], views.headers[1][Field.PICKLED_LEN] = 4096, len(skeleton)
    else:
        views = written([torch.arange(3), second[odd]])
    bases: dict[int, Any] = {}
    assert lend(views, bases) is None and bases == {}
    if odd == "more leaves":  # (what was refused: a recipe of three leaves would build it)
        lease.RECIPES[skeleton] = (0, 3, None)
        built = lend(views, bases)
        assert built is not None and [t.tolist() for t in built[0]] == [[0, 1, 2], [0, 1], [0, 1, 2, 3]]


def test_a_recipes_slot_comes_back_when_its_last_leaf_is_gone() -> None:
    read_batch(written([torch.arange(100, dtype=torch.int32), torch.arange(4)]), 1)  # type: ignore[arg-type]
    views = written([torch.arange(100, dtype=torch.int32), torch.arange(4)])
    bases: dict[int, Any] = {}
    built = lend(views, bases)
    assert built is not None
    label = built[0][1]
    del built
    gc.collect()
    assert _native.unviewed(bases, False) == []  # the label still views the slot
    assert label.tolist() == [0, 1, 2, 3]
    del label
    assert _native.unviewed(bases, True) == [1] and bases == {}


@pytest.mark.parametrize(
    "field, value, message",
    [
        (Field.REGION, int(Region.OVERFLOW), "header says region 1, expected SLOT"),
        (Field.TABLE_OFF, 1 << 19, "leaf table .* lies outside"),
        (Field.TABLE_LEN, -8, "leaf table .* lies outside"),
        (Field.PICKLED_OFF, -8, "skeleton .* lies outside"),
        (Field.TABLE_LEN, 4, "shorter than its head"),
    ],
)
def test_a_header_that_does_not_check_is_left_for_read_batch_to_report(field: int, value: int, message: str) -> None:
    views = written(torch.arange(16))
    views.headers[1][field] = value
    bases: dict[int, Any] = {}
    assert lend(views, bases) is None and bases == {}
    with pytest.raises(CorruptSlotError, match=message):
        read_batch(views, 1)  # type: ignore[arg-type]


def test_a_torn_table_is_left_for_read_batch_to_report() -> None:
    views = written(torch.arange(16))
    views.bytes[views.data_offsets[1] + views.headers[1][Field.TABLE_OFF]] ^= 0xFF  # the table's magic
    bases: dict[int, Any] = {}
    assert lend(views, bases) is None and bases == {}
    with pytest.raises(CorruptSlotError, match="magic"):
        read_batch(views, 1)  # type: ignore[arg-type]


def test_when_the_workers_would_be_left_one_slot_it_lends_nothing() -> None:
    """Never a worker's last slot: with most_lent slots lent the caller decides whether to copy."""
    views = written(torch.arange(16))
    held = {0: np.zeros(1), 2: np.zeros(1)}
    bases = dict(held)
    assert lend(views, bases) is None and bases == held
    del bases[2]
    built = lend(views, bases)
    assert built is not None and set(bases) == {0, 1}


def test_it_refuses_what_is_not_its_arguments() -> None:
    views = written(torch.arange(16))
    args = lone_args(views, MOST_LENT)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        _native.lend_lone(1, [], args)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        _native.lend_lone(1, {}, args[:-1])
    with pytest.raises(TypeError):
        _native.lend_lone(1, {})  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="slot 3"):
        _native.lend_lone(3, {}, args)
    with pytest.raises(ValueError, match="slot -1"):
        _native.lend_lone(-1, {}, args)
    refs = sys.getrefcount(views.mm)
    for _ in range(100):
        assert _native.lend_lone(1, {0: 0, 2: 0}, args) is None
    after = sys.getrefcount(views.mm)
    assert after == refs  # nothing kept
    with pytest.raises(TypeError):
        _native.lend_lone(1, {}, (*args[:-1], []))  # recipes: a dict


@pytest.mark.parametrize("recipe, error", [((0, 2), TypeError), ((5, 2, None), ValueError),
                                           ((2, 2, None), ValueError), ((2, 2, ("x",)), ValueError),
                                           ((0, "two", None), TypeError)])
def test_a_malformed_recipe_raises_and_lends_nothing(recipe: Any, error: type) -> None:
    views = written([torch.arange(3), torch.arange(2)])
    read_batch(views, 1)  # type: ignore[arg-type]
    (skeleton,) = lease.RECIPES
    lease.RECIPES[skeleton] = recipe
    bases: dict[int, Any] = {}
    with pytest.raises(error):
        lend(views, bases)
    assert bases == {}


def test_building_by_recipe_keeps_nothing() -> None:
    batch = {"x": torch.arange(8), "y": torch.arange(3)}
    read_batch(written(batch), 1)  # type: ignore[arg-type]
    views = written(batch)
    args = lone_args(views, MOST_LENT)  # type: ignore[arg-type]
    recipe = next(iter(lease.RECIPES.values()))
    refs = sys.getrefcount(views.mm), sys.getrefcount(recipe), sys.getrefcount(recipe[2][0])
    for _ in range(100):
        bases: dict[int, Any] = {}
        built = _native.lend_lone(1, bases, args)
        assert built is not None
        del built
        assert _native.unviewed(bases, True) == [1]
    assert (sys.getrefcount(views.mm), sys.getrefcount(recipe), sys.getrefcount(recipe[2][0])) == refs
