"""``shmloader bench``'s output: its tables (markdown, as bench/RESULTS.md keeps them), the
advice report, and the plot."""

from __future__ import annotations

import pathlib

from .measure import MemoryResult, Result


def table(results: list[Result]) -> str:
    head = ("| workload | loader | batches/s (median, min-max) | GB/s | vs torch | first batch s "
            "| CPU ms/batch | peak MB | loader MB |")
    rows = [head, "|" + "---|" * 9]
    notes = []
    for r in results:
        ratio = "" if r.ratio_to_torch is None else f"{r.ratio_to_torch:.2f}x"
        budget = "" if r.within_budget is None else (" (within budget)" if r.within_budget else " (OVER budget)")
        rows.append(
            f"| {r.workload} | {r.loader} | {r.batches_per_s:,.1f} "
            f"({r.batches_per_s_min:,.1f}-{r.batches_per_s_max:,.1f}) "
            f"| {r.gb_per_s:.2f} | {ratio} | {r.first_batch_s:.2f} | {r.cpu_ms_per_batch:.2f} "
            f"| {r.peak_mb:,.0f} | {r.loader_mb:,.0f}{budget} |"
        )
        if r.overflow_share is not None:
            notes.append(f"- {r.workload} / {r.loader}: {r.overflow_share:.1%} of the batches after the first "
                         f"epoch took the overflow path; {r.ring_growths} ring growth(s), "
                         f"slots of {r.slot_bytes:,} bytes")
    return "\n".join(rows + notes)


def ceiling_table(results: list[Result]) -> str:
    rows = ["| workload | loader | batches/s (median; each round) | share of the bare ring | vs torch |",
            "|" + "---|" * 5]
    for r in results:
        rounds = ", ".join(f"{x:,.0f}" for x in r.round_rates or [r.batches_per_s])
        share = "" if r.ratio_to_ceiling is None else f"{r.ratio_to_ceiling:.0%}"
        ratio = "" if r.ratio_to_torch is None else f"{r.ratio_to_torch:.2f}x"
        rows.append(f"| {r.workload} | {r.loader} | {r.batches_per_s:,.0f} ({rounds}) | {share} | {ratio} |")
    return "\n".join(rows)


def neighbours_table(results: list[Result]) -> str:
    rows = ["| workload | loader | neighbours | batches/s (median; each round) | vs torch beside as many "
            "| share of its own rate alone |", "|" + "---|" * 6]
    for r in sorted(results, key=lambda r: (r.workload, r.neighbours)):
        rounds = ", ".join(f"{x:,.0f}" for x in r.round_rates or [r.batches_per_s])
        ratio = "" if r.ratio_to_torch is None else f"{r.ratio_to_torch:.2f}x"
        alone = "" if r.ratio_to_alone is None else f"{r.ratio_to_alone:.0%}"
        rows.append(f"| {r.workload} | {r.loader} | {r.neighbours} | {r.batches_per_s:,.0f} ({rounds}) | {ratio} "
                    f"| {alone} |")
    return "\n".join(rows)


def cpu_table(results: list[Result]) -> str:
    rows = ["| workload | loader | main user µs | main system µs | workers user µs | workers system µs "
            "| main switches | workers switches |", "|" + "---|" * 8]
    for r in results:
        c = r.cpu_us
        if c is not None:
            rows.append(f"| {r.workload} | {r.loader} | {c.main_user:.1f} | {c.main_system:.1f} | {c.workers_user:.1f} "
                        f"| {c.workers_system:.1f} | {c.main_switches:.2f} | {c.workers_switches:.2f} |")
    return "\n".join(rows)


def latency_table(results: list[Result]) -> str:
    rows = ["| workload | loader | next() p50 µs | p90 µs | p99 µs |", "|" + "---|" * 5]
    for r in results:
        if r.next_us:
            rows.append(f"| {r.workload} | {r.loader} | " + " | ".join(f"{x:,.1f}" for x in r.next_us) + " |")
    return "\n".join(rows)


def memory_table(results: list[MemoryResult]) -> str:
    rows = ["| workload | loader | persistent_workers | peak MiB above baseline (median; each round) | vs torch "
            "| tree PSS MiB | vs torch |",
            "|" + "---|" * 7]
    for r in results:
        ratio = "" if r.ratio_to_torch is None else f"{r.ratio_to_torch:.2f}x"
        tree = "" if r.tree_ratio_to_torch is None else f"{r.tree_ratio_to_torch:.2f}x"
        rounds = ", ".join(f"{mb:,.0f}" for mb in r.round_mb)
        rows.append(f"| {r.workload} | {r.loader} | {r.persistent_workers} | {r.peak_mb:,.0f} ({rounds}) | {ratio} "
                    f"| {r.tree_pss_mb:,.0f} | {tree} |")
    return "\n".join(rows)


def report(results: list[Result]) -> str:
    """shmloader's ``stats().advice`` per workload (what the README's stats section explains)."""
    return "\n".join(f"{r.workload}: {r.advice}" for r in results if r.advice is not None)


def plot(results: list[Result], path: pathlib.Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib (or 'shmloader[bench]')") from None
    workloads = list(dict.fromkeys(r.workload for r in results))
    loaders = list(dict.fromkeys(r.loader for r in results))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(loaders))
    for k, name in enumerate(loaders):
        xs = [i + k * width for i, w in enumerate(workloads)]
        get = {r.workload: r for r in results if r.loader == name}
        ax1.bar(xs, [get[w].batches_per_s if w in get else 0 for w in workloads], width, label=name)
        ax2.bar(xs, [get[w].peak_mb if w in get else 0 for w in workloads], width, label=name)
    for ax, title in ((ax1, "batches/s (log)"), (ax2, "peak memory, MB (PSS + shared memory, all processes)")):
        ax.set_xticks([i + width * (len(loaders) - 1) / 2 for i in range(len(workloads))], workloads)
        ax.set_title(title)
    ax1.set_yscale("log")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
