#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py) on a lent GPU machine, whose image has torch and
# transformers but not the rest of pdserve's dependencies, and cannot reach a registry.
#
#   benchmarks/gpu_check.sh --prepare   # here, once: wheels into .whl/, stories260K into .gpu/
#   benchmarks/gpu_check.sh             # there, carrying .whl and .gpu; results under $OUT
#
# Both folders are listed in .git/info/exclude by --prepare: they travel only when carried.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--prepare" ]; then
  rm -rf .whl && mkdir -p .git/info .whl .gpu
  for d in /.whl/ /.gpu/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >>.git/info/exclude; done
  # the GPU image's Python is 3.12; these are what pdserve needs beyond its packages
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 -d .whl \
    msgspec pyzmq llguidance fastapi starlette uvicorn pydantic pydantic-core \
    annotated-types typing-inspection typing-extensions opentelemetry-api
  rm -rf .gpu/stories260K && cp -r ../shared/models/stories260K .gpu/
  du -sh .whl .gpu
  exit 0
fi

OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null
export PATH="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.txt" || true
python3 benchmarks/gpu_check.py --device cuda --model .gpu/stories260K --output "$OUT/gpu.json" 2>&1 \
  | tee "$OUT/gpu-check.log"
