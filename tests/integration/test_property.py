"""Property: for any nested sample structure default_collate accepts, shmloader's batches
equal torch's DataLoader(num_workers=0) batches, type for type and bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.utils.data as tud
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmloader
from tests.conftest import examples, same
from tests.datasets import Point

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.complex64]
NP_DTYPES = [np.bool_, np.uint8, np.int16, np.int32, np.int64, np.float32, np.float64, np.complex64]

shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
leaf_schema = st.one_of(
    st.tuples(st.just("tensor"), st.sampled_from(DTYPES), shapes, st.booleans()),
    st.tuples(st.just("numpy"), st.sampled_from(NP_DTYPES), shapes),
    st.sampled_from([("int",), ("float",), ("bool",), ("str",), ("bytes",)]),
)
schemas = st.recursive(
    leaf_schema,
    lambda inner: st.one_of(
        st.dictionaries(st.sampled_from("abcde"), inner, min_size=1, max_size=3).map(lambda d: ("dict", d)),
        st.lists(inner, min_size=1, max_size=3).map(lambda xs: ("list", xs)),
        st.lists(inner, min_size=1, max_size=3).map(lambda xs: ("tuple", xs)),
        st.tuples(inner, inner).map(lambda xy: ("point", xy)),
    ),
    max_leaves=6,
)


def make(schema: tuple[Any, ...], rng: np.random.Generator) -> Any:
    kind = schema[0]
    if kind == "tensor":
        _, dtype, shape, transpose = schema
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        raw = torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))
        t = raw % 2 == 1 if dtype is torch.bool else raw.view(dtype)
        t = t.reshape(shape)
        return t.t() if transpose and t.dim() == 2 else t  # non-contiguous when 2-D
    if kind == "numpy":
        _, dtype, shape = schema
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if n == 0:
            return np.empty(shape, dtype=dtype)
        if dtype is np.bool_:
            return rng.integers(0, 2, shape).astype(np.bool_)
        return rng.integers(0, 256, n, dtype=np.uint8).view(dtype).reshape(shape)
    if kind == "int":
        return int(rng.integers(-(2**40), 2**40))
    if kind == "float":
        return float(rng.standard_normal())
    if kind == "bool":
        return bool(rng.integers(0, 2))
    if kind == "str":
        return "s" * int(rng.integers(0, 5))
    if kind == "bytes":
        return bytes(rng.integers(0, 256, 3, dtype=np.uint8))
    if kind == "dict":
        return {k: make(v, rng) for k, v in schema[1].items()}
    if kind == "list":
        return [make(v, rng) for v in schema[1]]
    if kind == "tuple":
        return tuple(make(v, rng) for v in schema[1])
    return Point(make(schema[1][0], rng), make(schema[1][1], rng))


class Samples(tud.Dataset):  # type: ignore[type-arg]
    def __init__(self, samples: list[Any]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Any:
        return self.samples[i]


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=schemas, seed=st.integers(0, 2**32 - 1), n=st.integers(1, 9), batch_size=st.integers(1, 4))
def test_batches_equal_torchs(schema: tuple[Any, ...], seed: int, n: int, batch_size: int) -> None:
    rng = np.random.default_rng(seed)
    dataset = Samples([make(schema, rng) for _ in range(n)])
    want = list(tud.DataLoader(dataset, batch_size=batch_size))
    got = list(shmloader.DataLoader(dataset, batch_size=batch_size, num_workers=2))
    same(got, want)
