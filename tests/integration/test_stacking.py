"""Batches of plain tensors whose layout repeats are stacked into their slot in one step
(``SlotWriter.restack``, learnt from the batch before it in the same slot). Whatever
changes from one batch to the next (count, shape, dtype, a subclass, an array, a sample of
another size), the batches, their types and the errors are torch's, in torch's order."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils.data as tud
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmloader
from tests.conftest import examples, raw
from tests.datasets import Runs
from tests.integration.test_errors import outcomes

TWISTS = ["dtype", "shape", "subclass", "array"]


def layout(batch: Any) -> tuple[Any, ...]:
    return type(batch).__name__, batch.dtype, tuple(batch.shape), raw(batch)


def original(exc: BaseException) -> tuple[str, str]:
    """The error's type and the last line of its message: the original error's, under a worker's traceback."""
    name = type(exc).__name__
    return name, str(exc).splitlines()[-1].removeprefix(f"{name}: ")


def compare(plan: list[tuple[int, tuple[int, ...], torch.dtype, str | None, int]], workers: int,
            epochs: int = 1) -> list[list[tuple[str, Any]]]:
    dataset = Runs(plan)
    # In-process torch: its workers stack into a shared segment sized by the first sample, so
    # samples of unequal sizes fail there with "Trying to resize storage that is not
    # resizable"; shmloader raises default_collate's own error, as num_workers=0 does.
    want = outcomes(tud.DataLoader(dataset, batch_sampler=dataset.batches), epochs, layout, original)
    want = [[WORKERS_RAISE.get(entry, entry) for entry in epoch] for epoch in want]
    got = outcomes(shmloader.DataLoader(dataset, batch_sampler=dataset.batches, num_workers=workers,
                                        persistent_workers=True), epochs, layout, original)
    assert got == want
    return got


# An array or a number after a tensor: where default_collate in the main process raises TypeError,
# torch's workers (and so shmloader's) raise AttributeError (test_odd_values checks it against them).
WORKERS_RAISE = {
    ("error", ("TypeError", f"expected Tensor as element {k} in argument 0, but got {name}")):
        ("error", ("AttributeError", f"'{name}' object has no attribute 'numel'"))
    for k in range(1, 8) for name in ("numpy.ndarray", "int", "float")
}


@pytest.mark.parametrize("twist", TWISTS)
@pytest.mark.parametrize("spot", [0, 2])
def test_a_twisted_batch_among_repeating_ones_is_torchs(twist: str, spot: int) -> None:
    # Twelve batches of one layout teach every slot its stack; then one batch with a twisted
    # sample (first or in the middle), then the layout again.
    run = [(4, (3, 5), torch.float32, None, 0)] * 12
    got = compare([*run, (4, (3, 5), torch.float32, twist, spot), *run], workers=1, epochs=2)
    # torch raises for a sample of another size, and for an array after a tensor (an array
    # first makes every sample an array: default_collate converts them)
    fails = twist == "shape" or (twist == "array" and spot > 0)
    assert [kind for epoch in got for kind, _ in epoch].count("error") == (2 if fails else 0)


@pytest.mark.parametrize("change", ["count", "shape", "dtype", "rank"])
def test_a_new_layout_after_repeating_ones_is_torchs(change: str) -> None:
    layouts = {
        "count": (3, (6,), torch.int64),
        "shape": (4, (7,), torch.int64),
        "dtype": (4, (6,), torch.uint8),
        "rank": (4, (2, 3), torch.int64),
    }
    run = [(4, (6,), torch.int64, None, 0)] * 10
    other = [(*layouts[change], None, 0)] * 10
    compare(run + other + run, workers=2, epochs=2)


plans = st.lists(
    st.tuples(
        st.integers(1, 5),  # batches in the run
        st.integers(1, 4),  # samples per batch
        st.sampled_from([(3,), (4,), (2, 2), ()]),
        st.sampled_from([torch.float32, torch.int64, torch.uint8]),
        st.sampled_from([None, None, *TWISTS]),  # the run's last batch
        st.integers(0, 3),
    ),
    min_size=1,
    max_size=6,
).map(lambda runs: [(count, shape, dtype, twist if k == n - 1 else None, spot)
                    for n, count, shape, dtype, twist, spot in runs for k in range(n)])


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=plans, workers=st.integers(1, 2))
def test_property_runs_of_layouts_are_torchs(plan: list[tuple[int, tuple[int, ...], torch.dtype, str | None, int]],
                                             workers: int) -> None:
    compare(plan, workers, epochs=2)


class Composite(tud.Dataset):  # type: ignore[type-arg]
    """``Runs``' samples as the input of a (input, label) pair, in a tuple, a list or a dict (the
    default collate stacks each column), the label seeded by the index: a 0-d int64 tensor, a
    Python int or a float. The run's twists apply to the input; these to the container of the
    sample at ``spot``: "longer" (one more tensor), "keys" (another key), or its label another
    kind ("int", "float", "tensor")."""

    def __init__(self, runs: Runs, form: str, twisted: dict[int, str], label: str = "tensor") -> None:
        self.runs, self.form, self.twisted, self.label = runs, form, twisted, label
        self.batches = runs.batches

    def __len__(self) -> int:
        return len(self.runs)

    def __getitem__(self, i: int) -> Any:
        twist = self.twisted.get(i)
        label: Any = torch.tensor(i % 7) if self.label == "tensor" else i % 7 if self.label == "int" else i / 4
        parts = [self.runs[i], {"int": i % 7, "float": i / 4, "tensor": torch.tensor(i % 7)}.get(twist or "", label)]
        if twist == "longer":
            parts.append(torch.tensor(i))
        if self.form == "dict":
            return dict(zip(["x", "y"] if twist == "keys" else ["x", "label", "extra"], parts))
        return tuple(parts) if self.form == "tuple" else parts


def composite_layout(batch: Any) -> Any:
    if isinstance(batch, dict):
        return "dict", tuple((k, composite_layout(v)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)):
        return type(batch).__name__, tuple(composite_layout(v) for v in batch)
    return layout(batch)


@pytest.mark.parametrize("form, label, twist", [
    (form, label, twist)
    for form, label in [("tuple", "tensor"), ("list", "tensor"), ("dict", "tensor"), ("tuple", "int"), ("dict", "float")]
    for twist in [None, "longer", "keys", "int", "float", "tensor", *TWISTS] if twist != label
])
def test_pairs_and_dicts_among_repeating_ones_are_torchs(form: str, label: str, twist: str | None) -> None:
    """Samples of (input, label) in a tuple, list or dict: after a run that teaches every slot its
    columns, one batch with a twisted sample (its input, its container, or its label), then the
    run again."""
    run = [(4, (3, 5), torch.float32, None, 0)] * 12
    runs = Runs([*run, (4, (3, 5), torch.float32, twist if twist in TWISTS else None, 2), *run])
    twisted = {} if twist in TWISTS or twist is None else {12 * 4 + 2: twist}
    dataset = Composite(runs, form, twisted, label)
    want = outcomes(tud.DataLoader(dataset, batch_sampler=dataset.batches), 2, composite_layout, original)
    want = [[WORKERS_RAISE.get(entry, entry) for entry in epoch] for epoch in want]
    got = outcomes(shmloader.DataLoader(dataset, batch_sampler=dataset.batches, num_workers=1,
                                        persistent_workers=True), 2, composite_layout, original)
    assert got == want
    errors = [kind for epoch in got for kind, _ in epoch].count("error")
    # (a dict's other keys are not looked at: only the first sample's are collated)
    # (numbers of both kinds, or with a 0-d tensor, make one tensor: torch.tensor of them)
    fails = (twist in ("shape", "array") or (twist == "longer") != (form == "dict") and twist in ("longer", "keys")
             or label == "tensor" and twist in ("int", "float"))
    assert errors == (2 if fails else 0)
