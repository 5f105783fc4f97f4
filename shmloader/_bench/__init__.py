"""``shmloader bench``: shmloader against torch's DataLoader (and SPDL, torchdata when
installed), side by side in one run, on transport-bound and real workloads.

    shmloader bench --quick                       # what `make bench` runs (< 3 min on 2 cores)
    shmloader bench --workloads tiny,jpeg --loaders torch,shmloader --json out.json --plot out.png
    shmloader bench --rounds 3 --report           # on a noisy machine: loaders alternated, ratios paired
    shmloader bench --memory --rounds 3           # peak memory, workers stopped after each epoch and persistent
    shmloader bench --ceiling --rounds 12         # each loader as a share of a bare ring (ready tensors)
    shmloader bench --cpu --latency --step-ms 1   # CPU per batch, main and workers; next()'s percentiles
    shmloader bench --neighbours 1,2 --rounds 3   # beside 1 and 2 CPU-bound processes, and alone

Rows ``dataset`` (the dataset and collate alone, in this process: the floor under every
loader's CPU per batch) and, with ``--ceiling``, ``ceiling`` (the bare ring of ``ceiling.py``)
are yardsticks beside the loaders.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import statistics
import sys
import time
import warnings
from typing import Any, Callable

import torch

from . import neighbours as _neighbours
from .loaders import CEILING, LOADERS, Loader
from .measure import CpuSplit, MemoryResult, Result, measure, peak_memory
from .tables import ceiling_table, cpu_table, latency_table, memory_table, neighbours_table, plot, report, table
from .workloads import CACHE, WORKLOADS, Workload


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shmloader bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(w for w, work in WORKLOADS.items() if not work.by_name),
                   help=f"comma-separated, of {', '.join(WORKLOADS)} (big: only when named)")
    p.add_argument("--loaders", default=",".join(LOADERS), help=f"comma-separated, of {', '.join(LOADERS)}")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--prefetch-factor", type=int, default=None,
                   help="given to every loader (default: none, as a user who leaves it out: torch's 2, "
                        "shmloader's depth that adapts)")
    p.add_argument("--batches", type=int, default=None, help="measured batches per repeat (default: per workload)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=_at_least_one, default=1,
                   help="run every loader this many times, alternated (each round starts with another loader); "
                        "ratios to torch are then the median of each round's own ratio")
    p.add_argument("--quick", action="store_true", help="small settings: what `make bench` runs")
    p.add_argument("--memory", action="store_true",
                   help="measure peak memory instead of speed: two epochs, workers stopped after each "
                        "(torch's default) and persistent")
    p.add_argument("--memory-budget", default=None, help="pass memory_budget= to shmloader and check its memory")
    p.add_argument("--ceiling", action="store_true",
                   help="run a bare ring (no shmloader code: the design's ceiling) too, and print each loader's "
                        "rate as a share of it; default workloads tiny,tokens,image and loaders torch,shmloader")
    p.add_argument("--neighbours", default=None, metavar="N[,N...]",
                   help="run each loader beside N CPU-bound processes (while True: pass, same priority) and "
                        "alone, alternated; print rates, ratios to torch beside as many, and the share of "
                        "the loader's own rate alone; default workloads tiny,tokens and loaders torch,shmloader")
    p.add_argument("--cpu", action="store_true",
                   help="print CPU µs (user, system) and context switches per batch, main process and workers")
    p.add_argument("--latency", action="store_true",
                   help="print the 50th/90th/99th percentiles of a next() call (with --step-ms: a ready batch's)")
    p.add_argument("--step-ms", type=float, default=0.0, help="simulated training step per batch (CPU spin)")
    p.add_argument("--report", action="store_true", help="print shmloader's loader-bound share and advice")
    p.add_argument("--data", type=pathlib.Path, default=None, help="folder with your JPEGs and/or a uint16 token file")
    p.add_argument("--cache", type=pathlib.Path, default=CACHE)
    p.add_argument("--json", type=pathlib.Path, default=None, help="write results as JSON")
    p.add_argument("--plot", type=pathlib.Path, default=None, help="draw throughput and memory (needs matplotlib)")
    return p


def _at_least_one(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    return n


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm

        return tqdm(total=total, unit="run", file=sys.stderr)
    except ImportError:
        return None


def run(args: argparse.Namespace) -> tuple[list[Result], list[str]]:
    workloads, loaders, notes = _selected(args)
    repeats = 2 if args.quick and args.repeats == 3 else args.repeats
    rounds = args.rounds
    crowds = _neighbours.counts(getattr(args, "neighbours", None))
    bar = _progress(len(workloads) * len(loaders) * rounds * len(crowds))
    results: list[Result] = []
    for w in workloads:
        batches = args.batches or (w.quick_batches if args.quick else w.batches)
        samples = (batches if w.epochs else batches * repeats + 8) * w.batch_size
        steady_s: dict[str, float] = {}  # (--neighbours: each run a steady state of seconds)
        if crowds != [0] and not w.epochs and not w.hold:
            steady_s = {"settle_s": _neighbours.SETTLE_S, "least_s": _neighbours.LEAST_S}
            samples = _neighbours.steady_batches(repeats, batches) * w.batch_size
        dataset = w.make(args.cache, args.quick, args.data, samples)
        # (loader, neighbours) -> round -> result
        runs: dict[tuple[str, int], dict[int, Result]] = {(ld.name, n): {} for ld in loaders for n in crowds}
        for r, ld in _alternated(loaders, rounds):
            for n in crowds[r % len(crowds):] + crowds[: r % len(crowds)]:
                if bar is not None:
                    bar.set_description(f"{w.name} / {ld.name}" + (f" / {n} neighbours" if n else "")
                                        + (f" / round {r + 1}" if rounds > 1 else ""))
                budget = args.memory_budget if ld.name == "shmloader" else None
                make = _maker(args, w, ld, dataset, budget, persistent_workers=True if w.epochs else None)
                try:
                    with _neighbours.neighbours(n):
                        res = measure(w.name, ld.name, make, batches, repeats, args.step_ms / 1e3, epochs=w.epochs,
                                      hold=w.hold, **steady_s)
                except Exception as exc:  # a peer that cannot run this workload is reported, not fatal
                    notes.append(f"{w.name} / {ld.name}: failed: {type(exc).__name__}: {exc}")
                else:
                    if budget is not None:
                        from shmloader.main.budget import parse_size

                        res.within_budget = res.loader_mb * 2**20 <= parse_size(budget)
                    res.neighbours = n
                    runs[(ld.name, n)][r] = res
                if bar is not None:
                    bar.update()
        for (name, n), own in runs.items():
            if own:
                merged = _merge(own, runs.get(("torch", n), {}), runs.get((CEILING.name, n), {}))
                merged.ratio_to_alone = _paired(own, runs.get((name, 0), {})) if n else None
                results.append(merged)
    if bar is not None:
        bar.close()
    return results, notes


def run_memory(args: argparse.Namespace) -> tuple[list[MemoryResult], list[str]]:
    """``--memory``: each loader's peak over two epochs of ``batches`` batches (a replay
    buffer's workload: three epochs of a third of them, every batch kept), with torch's default
    (workers stopped after each epoch) and with persistent workers."""
    workloads, loaders, notes = _selected(args)
    rounds = args.rounds
    bar = _progress(len(workloads) * len(loaders) * rounds * 2)
    results: list[MemoryResult] = []
    for w in workloads:
        batches = args.batches or (w.quick_batches if args.quick else w.batches)
        epochs = 3 if w.hold else 2
        if w.hold:
            batches = max(1, batches // epochs)  # every batch of the run kept: the epochs share them
        dataset = w.make(args.cache, args.quick, args.data, batches * w.batch_size)
        for persistent in (False, True):
            peaks: dict[str, dict[int, float]] = {ld.name: {} for ld in loaders}  # loader -> round -> MiB
            trees: dict[str, dict[int, float]] = {ld.name: {} for ld in loaders}  # the tree's PSS peaks
            for r, ld in _alternated(loaders, rounds):
                if bar is not None:
                    bar.set_description(f"{w.name} / {ld.name} / persistent={persistent}")
                budget = args.memory_budget if ld.name == "shmloader" else None
                try:
                    peaks[ld.name][r], trees[ld.name][r] = peak_memory(
                        _maker(args, w, ld, dataset, budget, persistent), epochs, w.hold)
                except Exception as exc:
                    notes.append(f"{w.name} / {ld.name}: failed: {type(exc).__name__}: {exc}")
                if bar is not None:
                    bar.update()
            for name, own in peaks.items():
                if own:
                    tree = trees[name]
                    results.append(MemoryResult(w.name, name, persistent, statistics.median(own.values()),
                                                [own[k] for k in sorted(own)], _peak_ratio(own, peaks.get("torch", {})),
                                                statistics.median(tree.values()),
                                                _peak_ratio(tree, trees.get("torch", {}))))
    if bar is not None:
        bar.close()
    return results, notes


def _peak_ratio(own: dict[int, float], base: dict[int, float]) -> float | None:
    """The median of each round's peak over torch's (None without torch)."""
    paired = [mb / base[k] for k, mb in own.items() if base.get(k)]
    return statistics.median(paired) if paired else None


def _selected(args: argparse.Namespace) -> tuple[list[Workload], list[Loader], list[str]]:
    """The workloads and the installed loaders asked for, and a note for each one missing."""
    known = {**LOADERS, CEILING.name: CEILING}
    workloads = [WORKLOADS[w] for w in _names(args.workloads, WORKLOADS, "workload")]
    asked = _names(args.loaders, known, "loader")
    if getattr(args, "ceiling", False) and CEILING.name not in asked:
        asked.insert(0, CEILING.name)
    notes, loaders = [], []
    for ld in (known[n] for n in asked):
        if ld.available():
            loaders.append(ld)
        else:
            notes.append(f"{ld.name}: skipped, not installed (pip install {ld.pip}, or pip install 'shmloader[bench]')")
    return workloads, loaders, notes


def _alternated(loaders: list[Loader], rounds: int) -> list[tuple[int, Loader]]:
    """A noisy machine drifts between runs minutes apart: alternating the loaders, and rotating
    which goes first, pairs each loader's run with torch's of the same round."""
    return [(r, ld) for r in range(rounds) for ld in loaders[r % len(loaders):] + loaders[: r % len(loaders)]]


def _maker(args: argparse.Namespace, w: Workload, ld: Loader, dataset: Any, budget: str | None,
           persistent_workers: bool | None) -> Callable[[], Any]:
    extra: dict[str, Any] = {}
    if w.collate_fn is not None:
        extra["collate_fn"] = w.collate_fn
    if w.epochs:
        extra["shuffle"] = True
    if persistent_workers is not None:
        extra["persistent_workers"] = persistent_workers

    def make() -> Any:
        seeded = {"generator": torch.Generator().manual_seed(0)} if w.epochs else {}
        return ld.make(dataset, w.batch_size, args.num_workers, args.prefetch_factor, budget, **extra, **seeded)

    return make


def _merge(by_round: dict[int, Result], torch_by_round: dict[int, Result],
           ceiling_by_round: dict[int, Result]) -> Result:
    """One loader's rounds on one workload as one result: the median of the rounds' rates (and
    CPU, and latency percentiles), the range over every repeat, the most memory any round
    took, and the ratios to torch and to the bare ring as the median of each round's ratio to
    their run of the same round (None without them)."""
    runs = list(by_round.values())
    out = dataclasses.replace(runs[0])
    out.rounds = len(runs)
    out.round_rates = [by_round[k].batches_per_s for k in sorted(by_round)]
    out.batches_per_s = statistics.median(r.batches_per_s for r in runs)
    out.batches_per_s_min = min(r.batches_per_s_min for r in runs)
    out.batches_per_s_max = max(r.batches_per_s_max for r in runs)
    out.gb_per_s = statistics.median(r.gb_per_s for r in runs)
    out.first_batch_s = statistics.median(r.first_batch_s for r in runs)
    out.cpu_ms_per_batch = statistics.median(r.cpu_ms_per_batch for r in runs)
    out.peak_mb = max(r.peak_mb for r in runs)
    out.loader_mb = max(r.loader_mb for r in runs)
    if any(r.within_budget is not None for r in runs):
        out.within_budget = all(r.within_budget for r in runs)
    out.ratio_to_torch = _paired(by_round, torch_by_round)
    out.ratio_to_ceiling = _paired(by_round, ceiling_by_round)
    splits = [r.cpu_us for r in runs if r.cpu_us is not None]
    if splits:
        out.cpu_us = CpuSplit(*(statistics.median(getattr(c, f.name) for c in splits)
                                for f in dataclasses.fields(CpuSplit)))
    latencies = [r.next_us for r in runs if r.next_us]
    if latencies:
        out.next_us = [statistics.median(q) for q in zip(*latencies)]
    return out


def _paired(by_round: dict[int, Result], other: dict[int, Result]) -> float | None:
    """The median over rounds of this loader's rate over ``other``'s in the same round."""
    paired = [r.batches_per_s / other[k].batches_per_s for k, r in by_round.items() if k in other]
    return statistics.median(paired) if paired else None


def _names(text: str, known: dict[str, Any], what: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in known]
    if unknown:
        raise SystemExit(f"unknown {what}(s): {', '.join(unknown)}; choose from {', '.join(known)}")
    return names


def metadata(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "python": platform.python_version(),
        "versions": {ld.name: ld.version() for ld in LOADERS.values() if ld.available() and ld.name != "dataset"},
        "command": (" ".join(["shmloader", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"]
                    else " ".join(sys.argv)),
        "num_workers": args.num_workers,
        "prefetch_factor": args.prefetch_factor,
        "rounds": args.rounds,
        "neighbours": getattr(args, "neighbours", None),
    }


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    defaults = parser().parse_args([])
    if args.ceiling or args.neighbours is not None:  # (a comparison needs torch and the product)
        if args.workloads == defaults.workloads:  # (the bare ring serves ready tensors)
            args.workloads = "tiny,tokens,image" if args.ceiling else "tiny,tokens"
        if args.loaders == defaults.loaders:
            args.loaders = "torch,shmloader"
    meta = metadata(args)
    results: list[Result] = []
    peaks: list[MemoryResult] = []
    with warnings.catch_warnings():
        # Here torch's loader reads the dataset shmloader's did on purpose: side by side.
        warnings.filterwarnings("ignore", "a torch DataLoader over the dataset of a shmloader.DataLoader", UserWarning)
        if args.memory:
            peaks, notes = run_memory(args)
        else:
            results, notes = run(args)
    print(f"# {meta['date']} | {meta['machine']} | Python {meta['python']} | "
          + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()))
    print(f"# num_workers={args.num_workers} prefetch_factor="
          + (str(args.prefetch_factor) if args.prefetch_factor is not None else "not given (each loader's default)")
          + (f" memory_budget={args.memory_budget}" if args.memory_budget else "")
          + (f" step={args.step_ms} ms" if args.step_ms else "")
          + (f" rounds={args.rounds} (alternated; vs torch: the median of each round's ratio)"
             if args.rounds > 1 else ""))
    if args.memory:
        print("# peak of the process tree's private PSS plus the system's shared-memory growth, above the "
              "baseline before the loader existed, over two epochs, each batch read (hold: three, every batch "
              "kept, a random kept one read instead); tree PSS: the tree's PSS with its shared pages "
              "(psutil's, smem's)")
        print(memory_table(peaks))
    elif args.neighbours is not None:
        print("# neighbours: processes running `while True: pass` at the loader's priority; vs torch: torch beside "
              "as many in the same round; share: of the loader's own rate with none, in the same round")
        print(f"# each run (none beside too): {_neighbours.SETTLE_S:g} s untimed, then each repeat "
              f"{_neighbours.LEAST_S:g} s at least (a steady state: the depth adapted, the processes placed)")
        print(neighbours_table(results))
    elif args.ceiling:
        print(ceiling_table(results))
    else:
        print(table(results))
    if args.cpu:
        print("# per batch, over the measured batches; the workers' sum")
        print(cpu_table(results))
    if args.latency:
        step = f", after a {args.step_ms} ms step" if args.step_ms else ""
        print("# one next() call, from the call to its return" + step)
        print(latency_table(results))
    for note in notes:
        print(f"- {note}")
    if args.report and results:
        print(report(results))
    if args.json is not None:
        rows = [dataclasses.asdict(r) for r in (peaks if args.memory else results)]
        args.json.write_text(json.dumps({"meta": meta, "notes": notes, "results": rows}, indent=2))
    if args.plot is not None and results:
        plot(results, args.plot)
    return 0
