"""µs per batch of a worker's stack, by route: torch.stack(out=), a dispatcher op called from
Python (``torch.ops.aten.stack.out``: what a ``STABLE_TORCH_LIBRARY`` op pays to be reached), and
``_native.stack_into`` (the route shmloader takes). Minimum of 7 repeats.

    python bench/stack_cost.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import timeit

import torch

from shmloader import _accel, _native

CASES = [("tiny", 32, (16,), torch.float32), ("tokens", 64, (512,), torch.int64),
         ("image-like", 32, (3, 64, 64), torch.uint8), ("hold", 64, (1024,), torch.float32)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    calls = parser.parse_args().calls
    if _accel.WHY_OFF is not None:
        raise SystemExit(f"stack_into is off here: {_accel.WHY_OFF[0]}")
    print(f"torch {torch.__version__}; µs per batch, min of 7 repeats of {calls} calls")
    print("| samples | torch.stack(out=) | torch.ops.aten.stack.out | _native.stack_into |")
    print("|---|---|---|---|")
    op = torch.ops.aten.stack.out
    for name, n, shape, dtype in CASES:
        samples = [torch.ones(shape, dtype=dtype) for _ in range(n)]
        out = torch.empty((n, *shape), dtype=dtype)
        cost = [min(timeit.repeat(f, number=calls, repeat=7)) / calls * 1e6 for f in (
            lambda: torch.stack(samples, 0, out=out), lambda: op(samples, 0, out=out),
            lambda: _native.stack_into(samples, out))]
        print(f"| {name}: {n} x {str(dtype).removeprefix('torch.')}{list(shape)} | "
              + " | ".join(f"{c:.2f}" for c in cost) + " |")


if __name__ == "__main__":
    main()
