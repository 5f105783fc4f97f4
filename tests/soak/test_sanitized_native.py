"""The C extension built with AddressSanitizer and UBSan, fuzzed (``make soak``).

The build is the one ``setup.py`` documents (SHMLOADER_SANITIZE=1), made here with the
compiler directly into a temporary directory, so the installed extension is left alone. The
fuzz (``native_fuzz.py``) runs in a child process with the sanitizer runtime preloaded: any
out-of-bounds access, use after free or undefined behaviour aborts it with a report, which
this test prints and fails on.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = [pytest.mark.soak, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
FUZZ = Path(__file__).with_name("native_fuzz.py")


def runtime(name: str) -> str:
    path = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(path):
        pytest.skip(f"gcc has no {name} (the sanitizer runtime) on this machine")
    return path


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("asan") / ("_native" + sysconfig.get_config_var("EXT_SUFFIX"))
    flags = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g", "-O1"]
    cmd = ["gcc", "-std=c11", "-shared", "-fPIC", "-pthread", "-Wall", "-Wextra", "-Wno-unused-parameter", *flags,
           f"-I{sysconfig.get_paths()['include']}", *map(str, sorted(ROOT.glob("native/*.c"))), "-o", str(out)]
    built = subprocess.run(cmd, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    return out


COUNT = int(os.environ.get("SHMLOADER_FUZZ_INPUTS", 500_000))  # per seed; about 20 s under the sanitizers


@pytest.mark.parametrize("seed", [1, 2])
def test_native_under_sanitizers(sanitized: Path, seed: int) -> None:
    count = COUNT
    # PYTHONMALLOC=malloc: every Python object is its own malloc block, with ASan's red zones
    # around it, so a read or write past a bytes object the codec was given is caught too.
    env = dict(os.environ, LD_PRELOAD=runtime("libasan.so"), PYTHONMALLOC="malloc",
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
               UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1")
    run = subprocess.run([sys.executable, str(FUZZ), str(sanitized), str(seed), str(count)],
                         capture_output=True, text=True, env=env)
    print(run.stdout, run.stderr[-4000:])
    assert run.returncode == 0, run.stderr[-4000:]
    assert "runtime error" not in run.stderr and "AddressSanitizer" not in run.stderr
    assert f"{count} inputs, seed {seed}: no finding (AddressSanitizer loaded)" in run.stdout
