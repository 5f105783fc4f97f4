"""The fast path's native parts, whether each is on, and the command that turns one on.

``shmloader._native`` is the ring (required: shmloader does not import without it). Its
``stack_into`` stacks a worker's plain samples with one memcpy each; it reads torch's tensors
without torch's C++ API, so the one build serves every torch, after ``learn_tensors`` has found
and checked, here, where this torch keeps what it reads (``native/_tensors.c``). If this torch's
tensors are not recognised, or ``SHMLOADER_NO_FAST_PATH=1`` is in the environment, workers stack
with ``torch.stack`` (about 8 times the CPU for a batch of small samples), and the first
``DataLoader`` with workers says so once, in a warning that points at the user's line.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Callable, Iterator

import torch

from shmloader import _native
from shmloader._errors import user_stacklevel
from shmloader._reinstall import reinstall_command, upgrade_command

OFF_VARIABLE = "SHMLOADER_NO_FAST_PATH"
TORCH_LIB = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")  # (torch's C shim)


Off = tuple[str, str]  # why the fast path is off, and the command that turns it on


def learn() -> tuple[Callable[[Any, torch.Tensor], bool] | None, Off | None]:
    """``_native.stack_into`` once it knows this torch's tensors, or None and why not."""
    if os.environ.get(OFF_VARIABLE):
        return None, (f"{OFF_VARIABLE} is set in the environment", f"unset {OFF_VARIABLE}")
    if not hasattr(_native, "learn_tensors"):
        return None, ("shmloader._native predates stack_into (a stale build)", reinstall_command())
    why: str | None
    try:  # (torch's own answers, which learn_tensors checks what it finds against)
        with _as_torch_starts():
            arguments = _probes()
        why = _native.learn_tensors(TORCH_LIB, torch.Tensor, *arguments)
    except (AttributeError, ImportError, KeyError, RuntimeError, TypeError, ValueError) as error:
        why = f"{type(error).__name__}: {error}"
    if why is not None:  # (a newer shmloader may know them)
        return None, (f"torch {torch.__version__}'s tensors are not recognised: {why}", upgrade_command())
    return _native.stack_into, None


@contextlib.contextmanager
def _as_torch_starts() -> Iterator[None]:
    """Grad on, inference mode off, no torch function or dispatch mode: the probes are then
    what they are meant to be whatever the caller (a first loader made under no_grad, say) set."""
    from torch.utils._python_dispatch import _disable_current_modes

    popped = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    try:
        with torch.enable_grad(), torch.inference_mode(False), _disable_current_modes():
            yield
    finally:
        for mode in reversed(popped):
            torch._C._push_on_torch_function_stack(mode)


def _probes() -> tuple[Any, ...]:
    """learn_tensors's arguments after the library's path and the tensor type."""
    from shmloader.wire.layout import CODE_OF_DTYPE  # (the dtypes a slot holds)

    plain = torch.arange(6.0, device="cpu").view(2, 3)
    with torch.inference_mode():
        inferred = torch.zeros(3, device="cpu")
    others = [torch.zeros(3, dtype=torch.complex64, device="cpu").conj(), torch._neg_view(torch.zeros(3, device="cpu")),
              torch.empty(3, device="meta"), torch._efficientzerotensor(3, device="cpu")]
    probes = [(t, t._cdata, torch._C._dispatch_keys(t).raw_repr(), t.data_ptr() if t.device.type == "cpu" else 0,
               tuple(t.shape), t.stride()) for t in (plain, inferred, *others)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("ComplexHalf support is experimental")
        dtypes = [(torch.empty(0, dtype=dtype, device="cpu"), dtype.itemsize) for dtype in CODE_OF_DTYPE]
    modes = (torch._C._is_torch_function_mode_enabled, torch._C._len_torch_dispatch_stack)
    descriptors = (torch._C.TensorBase.__dict__["requires_grad"], torch._C.TensorBase.untyped_storage)
    fresh = [torch.zeros(3, device="cpu"), torch.ones(2, 2, dtype=torch.int64, device="cpu"), torch.empty(0)]
    leaf = torch.zeros(3, requires_grad=True, device="cpu")
    graded = [leaf, leaf * 2, leaf[1:], torch.ones(2, device="cpu").requires_grad_()]
    return (*descriptors, modes, dtypes, probes, fresh, graded)


STACK_INTO, WHY_OFF = learn()
_warned = False


def warn_if_off() -> None:
    """Say once, from the first line outside shmloader, that workers stack with torch.stack."""
    global _warned
    if WHY_OFF is None or _warned or os.environ.get(OFF_VARIABLE):
        return
    _warned = True
    why, command = WHY_OFF
    warnings.warn("shmloader's workers stack samples with torch.stack (about 8 times the CPU for a batch of "
                  f"small samples): {why}. To turn its fast path on: {command} ({OFF_VARIABLE}=1 silences this)",
                  RuntimeWarning, stacklevel=user_stacklevel())
