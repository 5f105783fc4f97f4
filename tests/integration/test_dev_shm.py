"""Where training runs: a /dev/shm too small for the ring (Docker's 64 MiB default, 16 MiB),
read-only, or absent. The ring then goes to a memory file (memfd) that /dev/shm does not bound,
with one warning naming the cause, and the job gives torch's batches; only when the memory
itself is not there is it an error, which says so. The mounts are made in a private mount
namespace (``unshare -m``: root); the last tests need neither."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

import shmloader
from shmloader.wire import shm as _shm
from tests.conftest import ours

# 4 batches of 128 x uint8[3,224,224] (19 MB each): a ring of 5 slots, 96 MB, as the image job
JOB = textwrap.dedent("""
    import hashlib, json, os, sys, warnings
    import torch, shmloader

    class Images(torch.utils.data.Dataset):
        def __len__(self):
            return 512
        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return torch.randint(0, 256, (3, 224, 224), dtype=torch.uint8, generator=g), i

    def digest(loader):
        h, n = hashlib.sha256(), 0
        for x, y in loader:
            h.update(x.numpy().tobytes()); h.update(y.numpy().tobytes()); n += 1
        return n, h.hexdigest()

    if __name__ == "__main__":
        if sys.argv[1] == "torch":
            print(json.dumps(digest(torch.utils.data.DataLoader(Images(), batch_size=128))))
            sys.exit()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            n, d = digest(shmloader.DataLoader(Images(), batch_size=128, num_workers=2, prefetch_factor=2))
        left = sorted(f for f in os.listdir("/dev/shm") if f.startswith("shmloader")) if os.path.isdir("/dev/shm") else []
        print(json.dumps({"batches": n, "digest": d, "left": left,
                          "warnings": [(str(w.message), os.path.basename(w.filename)) for w in caught],
                          "memfds": sorted(os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                                           if "memfd:shmloader" in os.path.realpath(f"/proc/self/fd/{fd}"))}))
""")

MOUNTS = {
    "64 MiB": ("mount -t tmpfs -o size=64m tmpfs /dev/shm",
               "/dev/shm has 67,108,864 bytes free and the ring needs 96,382,976 (to use it: give it room, "
               "Docker: --shm-size=...)"),
    "16 MiB": ("mount -t tmpfs -o size=16m tmpfs /dev/shm",
               "/dev/shm has 16,777,216 bytes free and the ring needs 96,382,976 (to use it: give it room, "
               "Docker: --shm-size=...)"),
    "read-only": ("mount -t tmpfs -o ro tmpfs /dev/shm", "/dev/shm is read-only (to use it: mount it writable)"),
    # (a /dev of its own without shm in it: the two device nodes Python and torch open at start)
    "absent": ("mount -t tmpfs tmpfs /dev && mknod -m 666 /dev/null c 1 3 && mknod -m 666 /dev/urandom c 1 9",
               "/dev/shm does not exist (to use it: mount a tmpfs there)"),
}


@pytest.fixture(scope="module")
def torchs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, str]:
    """torch's batches of the job, on this machine's /dev/shm; and the job's script."""
    script = tmp_path_factory.mktemp("dev_shm") / "job.py"
    script.write_text(JOB)
    done = subprocess.run([sys.executable, str(script), "torch"], capture_output=True, text=True, check=True,
                          timeout=300)
    return json.loads(done.stdout), str(script)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a private mount namespace needs root and unshare")
@pytest.mark.parametrize("case", list(MOUNTS))
def test_the_image_job_completes_as_torch_s_with_one_warning_naming_the_cause(case: str, torchs: Any) -> None:
    (batches, digest), script = torchs
    mount, cause = MOUNTS[case]
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           f"{{ {mount} ; }} || exit 97; exec {sys.executable} {script} shmloader"],
                          capture_output=True, text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)),
                          env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(__file__)))})
    if done.returncode == 97 or (done.returncode != 0 and done.stderr.startswith("unshare:")):
        pytest.skip(f"cannot mount here: {done.stderr.strip()[:200]}")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert (report["batches"], report["digest"]) == (batches, digest)
    assert [w for w in report["warnings"] if "memory file (memfd)" in w[0]] == [[
        f"shmloader's ring (96,382,976 bytes) is in a memory file (memfd), not in /dev/shm: {cause}. Batches "
        "travel as fast and are not copied; the memory counts against this process and its cgroup as any other "
        "(memory_budget= bounds it).", "job.py"]]  # (at the user's line: the loop)
    assert report["left"] == [] and report["memfds"] == []  # (the ring's memory file closed with its epoch)


def test_where_dev_shm_cannot_hold_it_the_ring_is_a_memory_file_said_once_per_cause(
        monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder) -> None:
    from shmloader.main import lifecycle

    monkeypatch.setattr(_shm, "shm_problem", lambda needed, path=_shm.SHM_DIR: "/dev/shm is a test's (to use it: no)")
    monkeypatch.setattr(lifecycle, "_said_elsewhere", set())
    before = ours()
    data = torch.arange(64.0).view(32, 2)
    want = [b.clone() for b in torch.utils.data.DataLoader(data, batch_size=4)]
    loader = shmloader.DataLoader(data, batch_size=4, num_workers=2)
    for _ in range(2):  # (two epochs, two rings: one warning)
        assert all(torch.equal(g, w) for g, w in zip(loader, want))
    said = [w for w in recwarn.list if "memory file (memfd)" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__ and said[0].category is shmloader.SharedMemoryWarning
    assert "/dev/shm is a test's (to use it: no)" in str(said[0].message)
    assert ours() == before


def test_when_the_memory_itself_is_not_there_the_error_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_shm, "shm_problem", lambda needed, path=_shm.SHM_DIR: "/dev/shm is read-only (to use it: x)")

    def no_memory(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(_shm.os, "posix_fallocate", no_memory)
    with pytest.raises(shmloader.SharedMemoryFullError) as caught:
        _shm.create_ring_memory(1 << 20)
    assert str(caught.value) == (
        "the ring needs 1,048,576 bytes of shared memory (/dev/shm is read-only (to use it: x), so it went to a "
        "memory file), and the system could not provide them (Cannot allocate memory): the machine's memory, or "
        "this process's cgroup limit, is used up. Lower batch_size, num_workers or prefetch_factor, set "
        "memory_budget= so that batches wait for room, or give the job more memory.")


@pytest.mark.parametrize("state, cause", [
    ("missing", "does not exist (to use it: mount a tmpfs there)"),
    ("read-only", "is not writable by this user (to use it: let this user write there)"),
])
def test_each_cause_is_named(state: str, cause: str, tmp_path: Any) -> None:
    where = tmp_path / "shm"
    if state == "read-only":
        where.mkdir(mode=0o500)
        if os.access(where, os.W_OK):
            pytest.skip("root writes anywhere: the read-only mount is tested in a mount namespace")
    assert _shm.shm_problem(1, str(where)) == f"{where} {cause}"
    assert _shm.shm_problem(1 << 62, "/dev/shm").startswith("/dev/shm has ")
    assert _shm.shm_problem(1, "/dev/shm") is None


def test_the_warning_is_once_per_kind_of_cause_whatever_its_figures(monkeypatch: pytest.MonkeyPatch,
                                                                    recwarn: pytest.WarningsRecorder) -> None:
    from shmloader.main import lifecycle

    free = iter(range(1_000, 10_000, 1_000))
    monkeypatch.setattr(_shm, "shm_problem", lambda needed, path=_shm.SHM_DIR:
                        f"/dev/shm has {next(free):,} bytes free and the ring needs {needed:,} (to use it: room)")
    monkeypatch.setattr(lifecycle, "_said_elsewhere", set())
    loader = shmloader.DataLoader(torch.arange(16.0), batch_size=4, num_workers=2)
    for _ in range(3):  # (three rings, three figures of free space: one warning)
        assert len(list(loader)) == 4
    assert len([w for w in recwarn.list if "memory file (memfd)" in str(w.message)]) == 1


def test_where_memory_files_are_not_available_the_error_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_shm, "shm_problem", lambda needed, path=_shm.SHM_DIR: "/dev/shm is read-only (to use it: x)")

    def blocked(name: str, flags: int = 0) -> int:
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(_shm.os, "memfd_create", blocked)
    with pytest.raises(shmloader.SharedMemoryFullError, match=r"memory files are not available here \(memfd_create: "
                       r"Operation not permitted\)\. Give /dev/shm room \(Docker: --shm-size=\.\.\.\)"):
        _shm.create_ring_memory(1 << 20)


def test_a_dev_shm_filled_between_its_look_and_the_segment_sends_the_ring_to_a_memory_file(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def filled(size: int) -> Any:
        raise shmloader.SharedMemoryFullError(f"/dev/shm cannot hold {size:,} more bytes (No space left on device)")

    monkeypatch.setattr(_shm, "create_segment_fd", filled)  # (its look said there was room)
    name, fd, mm, why = _shm.create_ring_memory(1 << 20)
    try:
        assert (name, why) == (None, "/dev/shm is full") and len(mm) == 1 << 20
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:shmloader-ring")
    finally:
        mm.close()
        os.close(fd)
