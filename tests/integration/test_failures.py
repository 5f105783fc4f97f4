"""Nothing lost, nothing leaked, nothing hangs: the loader's process dies, Ctrl-C, exit
mid-epoch, a small /dev/shm, other users, bad input. Each scenario runs in a child process
that the test observes from outside."""

from __future__ import annotations

import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import shmloader
from tests.datasets import Range

REPO = pathlib.Path(__file__).resolve().parents[2]
CHILD_PRELUDE = f"""
import json, os, signal, sys, asyncio, multiprocessing
sys.path.insert(0, {str(REPO)!r})
signal.signal(signal.SIGINT, signal.default_int_handler)
import shmloader
from tests.datasets import Gated, Range, Sized
def ours():
    return sorted(n for n in os.listdir("/dev/shm") if str(os.getpid()) in n)
"""


def child_source(body: str) -> str:
    """The prelude, then ``body`` as main() behind a __main__ guard (spawn re-imports the script)."""
    return CHILD_PRELUDE + "def main():\n" + textwrap.indent(textwrap.dedent(body), "    ") + (
        "\nif __name__ == '__main__':\n    main()\n"
    )


def child(tmp_path: pathlib.Path, body: str, *args: str, prefix: list[str] | None = None) -> subprocess.Popen[str]:
    script = tmp_path / "child.py"
    script.write_text(child_source(body))
    return subprocess.Popen([*(prefix or []), sys.executable, str(script), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_exit(pids: list[int], timeout: float) -> list[int]:
    """Pids still running after ``timeout`` seconds (waits on pidfds, no polling)."""
    fds = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            pass
    try:
        pending = dict(fds)
        while pending:
            ready, _, _ = select.select(list(pending), [], [], timeout)
            if not ready:
                break
            for fd in ready:
                pending.pop(fd)
        return sorted(pending.values())
    finally:
        for fd in fds:
            os.close(fd)


def shm_entries_of(pid: int) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if f"-{pid}-" in n)


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_loader_process_killed_workers_exit_and_nothing_is_left(tmp_path: pathlib.Path, context: str) -> None:
    proc = child(tmp_path, """
        loader = shmloader.DataLoader(Range(1000), batch_size=2, num_workers=2,
                                      multiprocessing_context=sys.argv[1])
        it = iter(loader)
        next(it)
        print(json.dumps([p.pid for p in it._life.pool.procs]), flush=True)
        signal.pause()
    """, context)
    kill_and_check_nothing_is_left(proc)


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_loader_process_killed_while_its_workers_set_up_they_exit_quietly(tmp_path: pathlib.Path, context: str) -> None:
    # Killed before the first batch: the workers wait on their setup pipe, which breaks.
    proc = child(tmp_path, """
        loader = shmloader.DataLoader(Range(1000), batch_size=2, num_workers=2,
                                      multiprocessing_context=sys.argv[1])
        it = iter(loader)
        print(json.dumps([p.pid for p in it._life.pool.procs]), flush=True)
        signal.pause()
    """, context)
    stderr = kill_and_check_nothing_is_left(proc)
    assert "Traceback" not in stderr, stderr  # a parent gone is no error of the worker's


def kill_and_check_nothing_is_left(proc: subprocess.Popen[str]) -> str:
    """Read the worker pids ``proc`` prints, SIGKILL it: its workers exit, /dev/shm holds nothing
    of it. Returns what it and its workers wrote to stderr."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise AssertionError(proc.stderr.read() if proc.stderr else "no output")
    workers = json.loads(line)
    proc.kill()
    _, stderr = proc.communicate()  # until the workers, which share the pipe, have exited too
    assert wait_exit(workers, timeout=10) == []
    assert shm_entries_of(proc.pid) == []
    return stderr


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ctrl_c_reaches_the_user_and_stops_the_workers(tmp_path: pathlib.Path, mode: str) -> None:
    proc = child(tmp_path, """
        import gc
        from tests.datasets import LoudGate
        gate = multiprocessing.get_context("fork").Event()  # never set: the workers block
        loader = shmloader.DataLoader(LoudGate(10, gate), batch_size=2, num_workers=2)
        async def consume():
            async for batch in loader:
                pass
        try:
            if sys.argv[1] == "sync":
                for batch in loader:
                    pass
            else:
                asyncio.run(consume())
        except KeyboardInterrupt:
            gc.collect()
            print(json.dumps({"caught": True, "children": len(multiprocessing.active_children()),
                              "shm": ours()}), flush=True)
    """, mode)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # a worker is inside __getitem__, so the loop waits in the loader
    assert line.startswith("blocked "), line
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    report = json.loads(out.splitlines()[-1])
    assert report == {"caught": True, "children": 0, "shm": []}, err
    assert proc.returncode == 0 and wait_exit([int(line.split()[1])], timeout=5) == []


@pytest.mark.slow
def test_interpreter_exit_mid_epoch(tmp_path: pathlib.Path) -> None:
    proc = child(tmp_path, """
        for persistent in (False, True):
            loader = shmloader.DataLoader(Range(1000), batch_size=2, num_workers=2, persistent_workers=persistent)
            it = iter(loader)
            next(it)
            print(json.dumps([p.pid for p in it._life.pool.procs]), flush=True)
        sys.exit(0)  # two loaders mid-epoch, never closed
    """)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    workers = [pid for line in out.splitlines() for pid in json.loads(line)]
    assert len(workers) == 4 and wait_exit(workers, timeout=10) == []
    assert shm_entries_of(proc.pid) == [] and "Traceback" not in err


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")
def test_another_user_cannot_open_the_ring() -> None:
    from shmloader.wire import shm as _shm
    name, mm = _shm.create_segment(4096)
    try:
        assert os.stat(f"/dev/shm{name}").st_mode & 0o777 == 0o600
        pid = os.fork()
        if pid == 0:  # the child becomes nobody and must be refused
            import posix_ipc

            code = 0
            try:
                os.setgid(65534)
                os.setuid(65534)
                try:
                    posix_ipc.SharedMemory(name)
                    code = 1
                except posix_ipc.PermissionsError:
                    pass
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        _shm.unlink_segment(name)


def test_names_are_unpredictable_and_carry_the_pid() -> None:
    from shmloader.wire import shm as _shm
    names = {_shm.new_name(_shm.SEGMENT_PREFIX) for _ in range(100)}
    assert len(names) == 100
    assert all(n.startswith(f"/shmloader-{os.getpid()}-") and len(n.rsplit("-", 1)[1]) == 16 for n in names)


class FailingSampler(torch.utils.data.Sampler):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 10

    def __iter__(self):  # type: ignore[no-untyped-def]
        yield from range(5)
        raise LookupError("the sampler broke at 5")


def test_sampler_errors_reach_the_user() -> None:
    with pytest.raises(LookupError, match="the sampler broke at 5"):
        list(shmloader.DataLoader(Range(10), sampler=FailingSampler(), batch_size=2, num_workers=2))


def test_iterable_dataset_errors_keep_type_and_traceback() -> None:
    from tests.datasets import BrokenStream

    with pytest.raises(ArithmeticError) as info:
        list(shmloader.DataLoader(BrokenStream(), batch_size=2, num_workers=2))
    text = str(info.value)
    assert "stream broke after 3 items" in text and "Traceback" in text and "__iter__" in text


def test_a_slot_published_for_another_task_is_a_corrupt_slot_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # The worker echoes each task's epoch and seq with its result; a slot whose echo does not
    # match the task the consumer gave it (a torn or foreign write) is refused, never delivered.
    from shmloader.wire.ring import AttachedRing

    publish = AttachedRing.publish

    def misdirected(self: AttachedRing, slot: int, results: tuple[int, ...]) -> bool:
        if results[8] == 3:  # the result of batch 3 claims to be batch 7's
            results = results[:8] + (7,) + results[9:]
        return publish(self, slot, results)

    monkeypatch.setattr(AttachedRing, "publish", misdirected)  # the workers fork with it
    loader = shmloader.DataLoader(Range(40), batch_size=4, num_workers=2, multiprocessing_context="fork")
    it = iter(loader)
    got = []
    with pytest.raises(shmloader.CorruptSlotError, match=r"published for task 7 of epoch 0, but holds task 3 of epoch 0"):
        for batch in it:
            got.append(batch.flatten().tolist())
    assert len(got) <= 3 and got == [list(range(i, i + 4)) for i in range(0, 4 * len(got), 4)]  # found when collected
    with pytest.raises(RuntimeError, match="stopped after an earlier error"):
        next(it)
