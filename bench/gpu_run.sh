#!/usr/bin/env bash
# What bench/gpu_check.py needs on a bare GPU machine with torch installed: posix_ipc
# (from wheels in .whl/ when given), the C extension built in place, the CUDA tests,
# then the check itself. Output goes to $OUT when set.
set -uo pipefail
OUT=${OUT:-/tmp/shmloader-gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace 2>&1 | tail -3
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/cuda 2>&1 | tee "$OUT/cuda_tests.txt" | tail -15
timeout 120 python3 -m pytest -q -p no:cacheprovider -x tests/unit tests/integration 2>&1 | tee "$OUT/all_tests.txt" | tail -8
python3 bench/gpu_check.py --seconds 3 2>&1 | tee "$OUT/gpu_check.md"
