#!/usr/bin/env bash
# One GPU session, as run through the device tool on an H200: the environment, the test suite on
# the GPU, the GPU-only checks, compute-sanitizer, and the performance probe. Logs go to $OUT.
#   bash scripts/gpu_session.sh [checks] [probe] [bench ARGS...]
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
log="$OUT/gpu_check.txt"
what=${1:-checks}

if [ "$what" = checks ]; then
  {
    echo "# GPU record, $(date -u +%Y-%m-%dT%H:%MZ)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
    echo; echo "## the test suite on the GPU (tests/, default tile configs, 8 processes)"
    FLASHATTN_AUTOTUNE=0 timeout 400 python3 -m pytest -q -o addopts="" -p no:cacheprovider -n 8 tests 2>&1 | tail -25
    echo; echo "## every tile configuration the tuner may pick"
    for i in 0 1 2 3 4 5 6 7; do
      timeout 300 python3 scripts/gpu_check.py configs --part $i/8 > "$OUT/part$i" 2>&1 &
    done
    wait
    cat "$OUT"/part* | grep -v '^#' | sort; rm -f "$OUT"/part*
    echo; echo "## long sequences, 64-bit offsets, determinism"
    timeout 300 python3 scripts/gpu_check.py long int64 determinism 2>&1 | grep -v '^#'
    echo; echo "## compute-sanitizer memcheck"
    timeout 200 compute-sanitizer --tool memcheck python3 scripts/gpu_check.py sanitize 2>&1 | grep -v '^#' | tail -6
  } 2>&1 | tee "$log"
  shift
fi
if [ "${1:-}" = probe ]; then
  timeout 300 python3 scripts/perf_probe.py --tma 2>&1 | tee "$OUT/probe.txt"
fi
