"""`shmloader bench`: runs side by side, reports missing peers, writes JSON and plots."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

from shmloader import __main__ as cli
from shmloader._bench import loaders

pytestmark = pytest.mark.slow  # (make check leaves them out: frameworks, examples and the bench CLI)


@pytest.fixture
def no_spdl(monkeypatch: pytest.MonkeyPatch) -> None:
    real = loaders.Loader.available
    monkeypatch.setattr(loaders.Loader, "available", lambda self: self.name != "spdl" and real(self))


def test_bench_runs_side_by_side(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], no_spdl: None) -> None:
    out = tmp_path / "r.json"
    code = cli.main([
        "bench", "--quick", "--workloads", "tiny,memmap", "--loaders", "torch,shmloader,spdl",
        "--batches", "5", "--repeats", "2", "--cache", str(tmp_path), "--json", str(out),
        "--memory-budget", "256MiB", "--report",
    ])
    assert code == 0
    text = capsys.readouterr().out
    assert "| workload | loader | batches/s" in text
    assert "spdl: skipped, not installed (pip install spdl" in text
    assert "loader-bound" in text
    data = json.loads(out.read_text())
    rows = {(r["workload"], r["loader"]): r for r in data["results"]}
    assert set(rows) == {("tiny", "torch"), ("tiny", "shmloader"), ("memmap", "torch"), ("memmap", "shmloader")}
    assert rows["tiny", "torch"]["ratio_to_torch"] == 1.0
    for key in [("tiny", "shmloader"), ("memmap", "shmloader")]:
        r = rows[key]
        assert r["within_budget"] is True and r["ring_mb"] <= 256
        assert r["batches_per_s_min"] <= r["batches_per_s"] <= r["batches_per_s_max"]
        assert r["cpu_ms_per_batch"] >= 0 and r["peak_mb"] > 0 and r["first_batch_s"] > 0
    assert rows["memmap", "shmloader"]["batch_bytes"] == 2 * 32 * 1024 * 8
    assert data["meta"]["versions"]["torch"]


def test_bench_memory_both_worker_modes(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m.json"
    assert cli.main(["bench", "--memory", "--workloads", "hold", "--loaders", "torch,shmloader", "--batches", "4",
                     "--rounds", "2", "--cache", str(tmp_path), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| hold | shmloader | False |" in text and "| hold | torch | True |" in text
    data = json.loads(out.read_text())
    assert data["notes"] == []
    rows = {(r["loader"], r["persistent_workers"]): r for r in data["results"]}
    assert set(rows) == {(name, p) for name in ("torch", "shmloader") for p in (False, True)}
    for (name, _), r in rows.items():
        assert len(r["round_mb"]) == 2 and r["peak_mb"] > 0
        if name == "torch":
            assert r["ratio_to_torch"] == 1.0


@pytest.mark.skipif(importlib.util.find_spec("PIL") is None, reason="the jpeg workload needs Pillow (bench extra)")
def test_jpeg_workload_makes_its_files_once(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "--quick", "--workloads", "jpeg", "--loaders", "shmloader", "--batches", "2",
            "--repeats", "1", "--cache", str(tmp_path)]
    assert cli.main(args) == 0
    files = sorted((tmp_path / "jpeg-200").glob("*.jpg"))
    assert len(files) == 200
    stamp = files[0].stat().st_mtime_ns
    assert cli.main(args) == 0
    assert files[0].stat().st_mtime_ns == stamp
    assert "| jpeg | shmloader |" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="--plot needs matplotlib (bench extra)")
def test_plot(tmp_path: pathlib.Path) -> None:
    png = tmp_path / "p.png"
    assert cli.main(["bench", "--workloads", "tiny", "--loaders", "torch,shmloader", "--batches", "3",
                     "--repeats", "1", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_names_and_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="unknown loader"):
        cli.main(["bench", "--loaders", "nope"])
    with pytest.raises(SystemExit):
        cli.main(["bench", "--rounds", "0"])
    assert "argument --rounds: must be at least 1, not 0" in capsys.readouterr().err
    assert cli.main([]) == 2


def test_python_dash_m() -> None:
    done = subprocess.run([sys.executable, "-m", "shmloader", "bench", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--memory-budget" in done.stdout


def test_rounds_alternate_loaders_and_pair_ratios(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--rounds runs every loader once per round, each round starting with another loader, and
    the ratio to torch is the median of each round's own ratio, not a ratio of medians."""
    from shmloader import _bench
    from shmloader._bench.measure import Result

    order: list[tuple[str, str]] = []
    # Per round, (torch, shmloader) rates: the machine speeds up threefold between rounds.
    rates = {"torch": [100.0, 300.0, 120.0], "shmloader": [1000.0, 1800.0, 1440.0]}

    def fake_measure(workload: str, loader: str, make: object, batches: int, repeats: int,
                     step_s: float, epochs: bool = False, hold: bool = False) -> Result:
        order.append((workload, loader))
        rate = rates[loader][sum(1 for w, ld in order if ld == loader) - 1]
        return Result(workload, loader, rate, rate / 2, rate * 2, 0.0, 0.1, 1.0,
                      peak_mb=rate / 10, loader_mb=1.0, batch_bytes=8)

    monkeypatch.setattr(_bench, "measure", fake_measure)
    args = _bench.parser().parse_args(["--workloads", "tiny", "--loaders", "torch,shmloader", "--rounds", "3",
                                       "--cache", str(tmp_path)])
    results, notes = _bench.run(args)
    assert notes == []
    assert order == [("tiny", "torch"), ("tiny", "shmloader"), ("tiny", "shmloader"), ("tiny", "torch"),
                     ("tiny", "torch"), ("tiny", "shmloader")]
    by = {r.loader: r for r in results}
    assert [r.loader for r in results] == ["torch", "shmloader"]
    assert by["torch"].ratio_to_torch == 1.0 and by["torch"].rounds == 3
    # Rounds' own ratios are 10, 6 and 12: their median is 10. The ratio of the medians would be 12.
    assert by["shmloader"].ratio_to_torch == 10.0
    assert by["shmloader"].batches_per_s == 1440.0
    assert by["shmloader"].round_rates == [1000.0, 1800.0, 1440.0]
    assert (by["shmloader"].batches_per_s_min, by["shmloader"].batches_per_s_max) == (500.0, 3600.0)
    assert by["shmloader"].peak_mb == 180.0  # the most memory any round took


def test_peak_memory_counts_a_child_read_between_pss_reads() -> None:
    """PSS is read every second, and whenever measure() asks: a child that lives for less than
    that interval still counts once sample() is called while it runs."""
    from shmloader._bench.measure import PeakMemory

    memory = PeakMemory(pss_interval=3600.0)  # the thread alone would never read PSS again
    before = memory.peak
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; b = b'\\1' * (64 << 20); print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        memory.sample()
    finally:
        child.communicate("")
    assert memory.stop() - before >= 64 << 20


def _shm_names() -> set[str]:
    return set(os.listdir("/dev/shm"))


def test_ceiling_runs_a_bare_ring_beside_the_loaders(tmp_path: pathlib.Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    before = _shm_names()
    out = tmp_path / "c.json"
    assert cli.main(["bench", "--ceiling", "--quick", "--workloads", "tiny", "--batches", "20", "--repeats", "1",
                     "--rounds", "2", "--cpu", "--latency", "--step-ms", "0.1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| workload | loader | batches/s (median; each round) | share of the bare ring | vs torch |" in text
    assert "| tiny | ceiling |" in text and "main user µs" in text and "next() p50 µs" in text
    data = json.loads(out.read_text())
    assert data["notes"] == []
    rows = {r["loader"]: r for r in data["results"]}
    assert list(rows) == ["ceiling", "torch", "shmloader"]  # --ceiling's defaults: the ring, torch, the product
    assert rows["ceiling"]["ratio_to_ceiling"] == 1.0 and rows["torch"]["ratio_to_torch"] == 1.0
    for r in rows.values():
        assert r["ratio_to_ceiling"] > 0 and len(r["round_rates"]) == 2
        split = r["cpu_us"]
        assert split["main_user"] + split["main_system"] > 0 and split["main_switches"] >= 0
        p50, p90, p99 = r["next_us"]
        assert 0 <= p50 <= p90 <= p99
    assert _shm_names() <= before  # the ring's memory and semaphores have no names left behind


class Numbered:
    """Sample i: int64[3] all equal to i."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> Any:
        import torch

        return torch.full((3,), i, dtype=torch.int64)


def test_the_bare_ring_delivers_every_batch_in_order_and_stops_its_workers() -> None:
    import torch

    from shmloader._bench.ceiling import BareRing

    ring = BareRing(Numbered(), batch_size=4, num_workers=2, prefetch_factor=2)
    want = [torch.arange(i, i + 4)[:, None].expand(4, 3) for i in range(0, 40, 4)]
    for _ in range(2):  # epochs
        got = [batch.clone() for batch in ring]
        assert len(got) == 10 and all(torch.equal(a, b) for a, b in zip(got, want))
    pids = list(ring.pids)
    ring.close()
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reaped


def test_the_ceiling_imports_nothing_of_the_product() -> None:
    import ast

    from shmloader._bench import ceiling

    tree = ast.parse(pathlib.Path(ceiling.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {"." * node.level + (node.module or "") for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not [name for name in imported if name.startswith((".", "shmloader"))], imported


def test_index_workloads_read_a_plain_list_and_a_shared_one(tmp_path: pathlib.Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "i.json"
    assert cli.main(["bench", "--quick", "--workloads", "index,shared-index", "--loaders", "shmloader,dataset",
                     "--batches", "5", "--repeats", "1", "--json", str(out)]) == 0
    capsys.readouterr()
    rows = {(r["workload"], r["loader"]) for r in json.loads(out.read_text())["results"]}
    assert rows == {(w, ld) for w in ("index", "shared-index") for ld in ("shmloader", "dataset")}


def test_torchdata_nodes_peers_run_in_threads_and_processes_and_stop(tmp_path: pathlib.Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torchdata.nodes")
    from shmloader._bench.measure import _tree

    out = tmp_path / "n.json"
    assert cli.main(["bench", "--quick", "--workloads", "tiny,varlen", "--loaders", "torch,nodes-thread,nodes-process",
                     "--batches", "5", "--repeats", "1", "--json", str(out)]) == 0
    capsys.readouterr()
    data = json.loads(out.read_text())
    assert data["notes"] == []
    rows = {(r["workload"], r["loader"]): r for r in data["results"]}
    assert set(rows) == {(w, ld) for w in ("tiny", "varlen") for ld in ("torch", "nodes-thread", "nodes-process")}
    assert all(r["cpu_ms_per_batch"] > 0 for r in rows.values())  # threads' CPU counts too
    assert _tree(os.getpid()) == [os.getpid()]  # every peer's workers stopped


def _neighbours_running() -> int:
    """This process's children that are bench neighbours (``neighbours.SPIN``), from /proc."""
    me, count = str(os.getpid()), 0
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = f.read().rsplit(")", 1)[1].split()[1]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, IndexError):
            continue
        count += parent == me and b"# shmloader bench neighbour" in cmdline
    return count


def test_neighbours_run_beside_each_loader_and_ratios_pair_within_a_crowd(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--neighbours 2 measures each loader alone and beside 2 CPU-bound processes, which run
    exactly while it is measured; its ratio to torch pairs it with torch beside as many, in the
    same round, and its share is of its own rate alone in that round."""
    from shmloader import _bench
    from shmloader._bench.measure import Result

    seen: list[tuple[str, int]] = []
    # Per (loader, neighbours), each round's rate.
    rates = {("torch", 0): [100.0, 200.0], ("torch", 2): [80.0, 100.0],
             ("shmloader", 0): [4000.0, 6000.0], ("shmloader", 2): [400.0, 1500.0]}

    def fake_measure(workload: str, loader: str, make: object, batches: int, repeats: int,
                     step_s: float, epochs: bool = False, hold: bool = False, settle_s: float = 0.0,
                     least_s: float = 0.0) -> Result:
        crowd = _neighbours_running()
        seen.append((loader, crowd))
        # (every run a steady state of seconds, alone too: the share compares like with like)
        assert (settle_s, least_s) == (_bench.neighbours.SETTLE_S, _bench.neighbours.LEAST_S) > (0, 0)
        rate = rates[(loader, crowd)][sum(1 for s in seen if s == (loader, crowd)) - 1]
        return Result(workload, loader, rate, rate, rate, 0.0, 0.1, 1.0, peak_mb=1.0, loader_mb=1.0, batch_bytes=8)

    monkeypatch.setattr(_bench, "measure", fake_measure)
    args = _bench.parser().parse_args(["--workloads", "tiny", "--loaders", "torch,shmloader", "--rounds", "2",
                                       "--neighbours", "2", "--cache", str(tmp_path)])
    results, notes = _bench.run(args)
    assert notes == [] and _neighbours_running() == 0  # stopped and reaped after each measure
    # Round 1: torch alone, beside 2, then shmloader alone, beside 2; round 2 starts with the other loader and crowd.
    assert seen == [("torch", 0), ("torch", 2), ("shmloader", 0), ("shmloader", 2),
                    ("shmloader", 2), ("shmloader", 0), ("torch", 2), ("torch", 0)]
    by = {(r.loader, r.neighbours): r for r in results}
    assert by[("shmloader", 0)].ratio_to_torch == 35.0  # rounds: 40x and 30x
    assert by[("shmloader", 2)].ratio_to_torch == 10.0  # rounds: 5x and 15x, each beside 2 as torch was
    assert by[("shmloader", 2)].ratio_to_alone == pytest.approx(0.175)  # rounds: 10% and 25% of its own rate alone
    assert by[("shmloader", 0)].ratio_to_alone is None
    print(_bench.neighbours_table(results))
    text = capsys.readouterr().out
    assert "| tiny | shmloader | 2 | 950 (400, 1,500) | 10.00x | 18% |" in text


def test_neighbours_flag_refuses_a_negative_count_or_a_word() -> None:
    with pytest.raises(SystemExit, match="at least 0"):
        cli.main(["bench", "--neighbours", "-1", "--workloads", "tiny", "--batches", "1"])
    with pytest.raises(SystemExit, match="comma-separated"):
        cli.main(["bench", "--neighbours", "1,,2", "--workloads", "tiny", "--batches", "1"])


def test_a_neighbour_exits_by_itself_once_the_bench_is_gone() -> None:
    # The bench killed outright (no finally runs): its neighbours must not spin on forever.
    from shmloader._bench import neighbours

    code = ("import os, subprocess, sys\n"
            f"p = subprocess.Popen([sys.executable, '-c', {neighbours.SPIN!r}, str(os.getpid())])\n"
            "print(p.pid, flush=True)\n"
            "sys.stdin.read()\n")
    import select

    with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as bench:
        assert bench.stdout is not None
        pid = int(bench.stdout.readline())
        fd = os.pidfd_open(pid)  # (the neighbour is re-parented once the bench dies: not ours to reap)
        try:
            bench.kill()
            bench.wait()
            assert select.select([fd], [], [], 30)[0] == [fd]  # readable once the neighbour has exited
        finally:
            os.close(fd)


def test_the_loaders_process_tree_leaves_the_neighbours_out() -> None:
    import importlib

    from shmloader._bench import neighbours

    measure = importlib.import_module("shmloader._bench.measure")  # (the package's `measure` is its function)
    with neighbours.neighbours(2) as procs:
        tree = measure._tree(os.getpid())
        assert _neighbours_running() == 2 and not {p.pid for p in procs} & set(tree)
    assert _neighbours_running() == 0 and not neighbours.RUNNING
