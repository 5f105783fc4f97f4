"""The wheel, as a user without a compiler meets it: ``make wheel`` builds it (isolated, tagged
manylinux, nothing of the build machine's paths inside), a fresh virtual environment installs it
beside torch from the same local wheel this checkout runs, with no compiler and binaries only,
and there ``python -m shmloader info`` says the fast path is on and a small job gives torch's
batches. Slow: a venv with torch is about half a minute here."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]

JOB = textwrap.dedent('''
    import os, sys
    import torch, shmloader

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 203
        def __getitem__(self, i):
            return {"x": torch.arange(16, dtype=torch.float32) * i, "y": i}

    def batches(make):
        return [b for b in make(Rows(), batch_size=8, shuffle=True, num_workers=2,
                                generator=torch.Generator().manual_seed(7))]

    want, got = batches(torch.utils.data.DataLoader), batches(shmloader.DataLoader)
    assert len(got) == len(want) == 26
    for g, w in zip(got, want):
        assert torch.equal(g["x"], w["x"]) and torch.equal(g["y"], w["y"])
    assert shmloader.__file__.startswith(sys.prefix), shmloader.__file__  # (the wheel's, not the tree's)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("shmloader")]
    print("same batches as torch:", len(got))
''')


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_wheel_installs_without_a_compiler_and_runs_the_fast_path(tmp_path: pathlib.Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(["make", "-s", "wheel", f"DIST={dist}"], cwd=ROOT, check=True, capture_output=True, timeout=300)
    (wheel,) = dist.glob("shmloader-*.whl")
    assert re.search(r"-manylinux_\d+_\d+_(x86_64|aarch64)\.whl$", wheel.name), wheel.name
    with zipfile.ZipFile(wheel) as zf:
        (native,) = [n for n in zf.namelist() if n.startswith("shmloader/_native") and n.endswith(".so")]
        (tmp_path / "native.so").write_bytes(zf.read(native))
        metadata = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    dynamic = subprocess.run(["readelf", "-d", str(tmp_path / "native.so")], capture_output=True, text=True).stdout
    assert "RPATH" not in dynamic and "RUNPATH" not in dynamic and "libtorch" not in dynamic and "libpython" not in dynamic
    assert "Requires-Dist: torch>=2.6" in metadata.splitlines()

    venv = tmp_path / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(CC="/bin/false", CXX="/bin/false", PIP_ONLY_BINARY=":all:", PIP_DISABLE_PIP_VERSION_CHECK="1")
    subprocess.run([python, "-m", "pip", "install", "-q", str(wheel), f"torch=={torch.__version__}"],
                   cwd=tmp_path, env=env, check=True, capture_output=True, timeout=400)
    info = subprocess.run([python, "-m", "shmloader", "info"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, check=True).stdout.splitlines()
    assert info[0].startswith("shmloader 0.") and str(venv) in info[0]
    assert info[2] == f"torch {torch.__version__}"
    fast = [line for line in info if line.startswith("fast path: ")]
    assert len(fast) == 2 and all(line.startswith("fast path: on (") for line in fast), info
    job = subprocess.run([python, "-c", JOB], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert job.returncode == 0 and job.stdout == "same batches as torch: 26\n", job.stderr[-3000:]
