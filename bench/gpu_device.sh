#!/usr/bin/env bash
# Issue 13 item 7 in one lent-GPU call: bench/gpu_kernels.py (Triton kernels, then the engine against transformers)
# on a GPU machine whose Python has torch, triton and transformers but not pydantic, which the engine imports, and
# cannot reach a package index.
#
#   bench/gpu_device.sh wheels   # here: the missing packages as Python 3.12 wheels in .whl/ (ignored by git)
#   bench/gpu_device.sh run      # there, as the device tool's command with carry [".whl"]; writes $OUT/gpu.json
#                                # and $OUT/gpu.log (the bench's budget: 8 minutes; give the call timeout_s 600)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# pydantic and what it needs beyond the image (typing-extensions is there); the versions this project's venv has
WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5)

case "${1:-}" in
wheels)
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
  py=python3
  [ -x .venv/bin/python ] && py=.venv/bin/python
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}"
  ls .whl
  ;;
run)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.log"
  python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)' |
    tee -a "$OUT/gpu.log"
  python3 bench/gpu_kernels.py --out "$OUT/gpu.json" 2>&1 | tee -a "$OUT/gpu.log"
  ;;
*)
  echo "usage: bench/gpu_device.sh wheels|run" >&2
  exit 2
  ;;
esac
