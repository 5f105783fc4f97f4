"""How a worker makes a batch again in one step (``SlotWriter.restack``, worker side).

``default_collate``'s batches repeat their layout: the same count of samples, the same sample
shapes and dtypes, the same container. ``collate.SlotWriter.finish`` remembers, per slot, how
the last such batch went into the slot: its columns (each the view its samples were stacked
into, or the tensor its numbers were written to) and the skeleton and leaf table it wrote. The
next batch at that slot whose samples are like those is stacked into the same views and given
the same description; anything else is collated the general way, which makes torch's batch or
raises torch's error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import numpy as np
import torch

from shmloader import _native
from shmloader.wire.layout import CODE_OF_DTYPE

if TYPE_CHECKING:
    from shmloader.worker.collate import SlotWriter

# Where finish wrote a batch's skeleton and leaf table: (skeleton offset, its length, table
# offset, its length, the bytes the batch needs, the block of both as written)
Layout = tuple[int, int, int, int, int, bytes]
StackInto = Callable[[Any, torch.Tensor], bool]  # _native.stack_into (collate's, which tests may replace)
# The dtype torch's collate gives numbers all of one type (torch.tensor of ints, of bools; floats as float64)
NUMBER_DTYPES = {int: torch.int64, float: torch.float64, bool: torch.bool}
_STRIDED = torch.strided


class Column(NamedTuple):
    """How one column of a batch (its samples' tensors, or numbers) went into the slot: stacked
    by ``collate._stack_into_slot``, or made a tensor by ``numbers_into_slot``."""

    n: int  # samples
    shape: torch.Size  # of a sample
    dtype: torch.dtype
    out: torch.Tensor  # the slot's view they were stacked into
    number: type | None = None  # numbers: their type (int, float, bool), and out as an array
    array: np.ndarray[Any, Any] | None = None

    def stack(self, samples: Any, stack_into: StackInto | None) -> bool:
        """Stack ``samples`` into ``out`` again: one memcpy each (plain tensors, ``stack_into``
        when given), or ``torch.stack`` when they are tensors like the planned ones (sample
        shape, dtype); numbers as torch's collate makes them a tensor. False, when they are not
        (the general way then collates them, and writes the slot again)."""
        if self.number is not None:
            return self._numbers(samples)
        if stack_into is not None and stack_into(samples, self.out):
            return True
        elem = samples[0]
        if (len(samples) != self.n or type(elem) is not torch.Tensor or elem.shape != self.shape or elem.is_nested
                or elem.layout is not _STRIDED or not elem.is_cpu):
            return False
        try:
            if _native.same_attr(samples, "dtype") is not self.dtype:
                return False
            return torch.stack(samples, 0, out=self.out) is self.out  # (a subclass may make another object)
        except (RuntimeError, AttributeError):
            return False  # unequal shapes, a number among tensors: the general way raises torch's own error

    def _numbers(self, samples: Any) -> bool:
        """Numbers all of the planned type, written as torch's collate makes them a tensor (of
        ints int64, of floats float64, of bools bool): numpy converts each exactly, or raises
        (a value out of int64's range: the general way raises torch's own error)."""
        number = self.number
        if (len(samples) != self.n or number is None or NUMBER_DTYPES.get(number) is not self.dtype
                or self.array is None or set(map(type, samples)) != {number}):
            return False
        try:
            self.array[...] = samples
        except (OverflowError, ValueError, TypeError):
            return False
        return True


class Restack(NamedTuple):
    """How the default collate stacked the last batch at a slot (``SlotWriter.restack``)."""

    columns: tuple[Column, ...]
    samples_type: type  # tuple, list or dict; or torch.Tensor, int, float (the batch is its one column)
    keys: tuple[str, ...] | None  # a dict's
    used: int
    layout: Layout

    def stack(self, samples: list[Any], stack_into: StackInto | None) -> Any:
        """The batch of ``samples`` stacked into the columns' views, as default_collate makes it
        of samples like the planned ones; None for any others (nothing that matters written)."""
        elem, columns = samples[0], self.columns
        if type(elem) is not self.samples_type:
            return None
        if self.samples_type is torch.Tensor or self.samples_type is columns[0].number:  # (the batch is one column)
            return columns[0].out if columns[0].stack(samples, stack_into) else None
        keys = self.keys
        try:
            if keys is None:  # (default_collate raises for samples of unequal lengths: the general way)
                transposed: list[Any] = list(zip(*samples, strict=True))
            elif tuple(samples[0]) == keys and set(map(type, samples[0])) == {str}:  # (a dict, as samples_type says)
                transposed = [[d[key] for d in samples] for key in keys]
            else:
                return None
        except (ValueError, TypeError, KeyError):
            return None
        if len(transposed) != len(columns) or not all(c.stack(t, stack_into) for c, t in zip(columns, transposed)):
            return None
        outs = [c.out for c in columns]
        return outs if keys is None else dict(zip(keys, outs))


def numbers_into_slot(writer: SlotWriter, collate: Callable[..., torch.Tensor], batch: list[Any], *,
                      collate_fn_map: dict[Any, Callable[..., Any]] | None = None) -> torch.Tensor:
    """The collate map's int and float entry (``collate.slot_collate_map``): torch's
    ``collate_int_fn`` or ``collate_float_fn`` (a tensor of the numbers), its tensor written
    into the slot, so that a batch's labels are a column ``SlotWriter.restack`` makes again as
    it stacks the batch's tensors."""
    made = collate(batch, collate_fn_map=collate_fn_map)
    if type(made) is not torch.Tensor or made.dtype not in CODE_OF_DTYPE:
        return made
    out = writer.tensor(made.dtype, tuple(made.shape))
    out.copy_(made)
    # (numbers of one type only are made again: their dtype has a numpy array; a mix of them
    # under another default dtype, bfloat16 say, may not)
    array = out.numpy() if made.dtype in NUMBER_DTYPES.values() else None
    writer.stacked.append(Column(len(batch), torch.Size(()), made.dtype, out, type(batch[0]), array))
    return out
