#!/usr/bin/env bash
# One GPU session, as run through the device tool on an H200. Steps run in the order given:
#   probe      scripts/perf_probe.py: every tile configuration timed at reference settings, with SDPA
#   tests      the test suite on the GPU (default tile configurations, 14 processes)
#   checks     scripts/gpu_check.py (all tile configurations, long sequences, 64-bit offsets,
#              determinism) and compute-sanitizer memcheck
#   sweep      python -m flashattn.bench over bf16/fp16, head dims 64/128, causal or not, N 1k-16k,
#              flashattn against every SDPA backend; then long sequences against float64 and the
#              forward pipelining experiment
#   record     the ladder, memory against N, FlexAttention at the reference setting
#   notebooks  every chapter executed on the GPU, in parallel (nbclient and ipykernel are not on
#              the GPU image: carry them as wheels in .whl/, see notes/gpu_runs/README.md)
#   bench      python -m flashattn.bench (arguments after "bench" go to it)
# Logs and CSVs go to $OUT.
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

header() {
  echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)"
  python3 -c "import torch, triton; print('# torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
}

while [ $# -gt 0 ]; do
  step=$1; shift
  case $step in
    probe)
      { header; timeout 240 python3 scripts/perf_probe.py --tma; } 2>&1 | tee "$OUT/probe.txt" ;;
    tests)
      {
        header
        echo; echo "## the test suite on the GPU (tests/ but the student-notebook test, default tiles, 14 processes)"
        FLASHATTN_AUTOTUNE=0 timeout 200 python3 -m pytest -q -o addopts="" -p no:cacheprovider -n 14 \
          --ignore=tests/test_student_notebooks.py tests 2>&1 | tail -25
      } 2>&1 | tee "$OUT/tests.txt" ;;
    checks)
      {
        header
        echo; echo "## every tile configuration the tuner may pick"
        for i in 0 1 2 3 4 5 6 7; do
          timeout 200 python3 scripts/gpu_check.py configs --part $i/8 > "$OUT/part$i" 2>&1 &
        done
        wait
        cat "$OUT"/part* | grep -v '^#' | sort; rm -f "$OUT"/part*
        echo; echo "## long sequences, 64-bit offsets, determinism"
        timeout 200 python3 scripts/gpu_check.py long int64 determinism 2>&1 | grep -v '^#'
        echo; echo "## compute-sanitizer memcheck"
        timeout 120 compute-sanitizer --tool memcheck python3 scripts/gpu_check.py sanitize 2>&1 | grep -v '^#' | tail -6
      } 2>&1 | tee "$OUT/gpu_check.txt" ;;
    sweep)
      {
        header
        echo "## python -m flashattn.bench (bf16, fp16; head dims 64, 128; causal or not; N 1k-16k)"
        timeout 420 python3 -m flashattn.bench --dtypes bf16 fp16 --head-dims 128 64 \
          --providers flashattn sdpa sdpa-flash sdpa-cudnn sdpa-efficient \
          --out "$OUT/h200_bench.csv" --plots ""
        echo; echo "## long sequences against float64"
        timeout 60 python3 scripts/gpu_check.py long 2>&1 | grep -v '^#'
        echo; echo "## the forward loop pipelined by hand (notes/experiments/fwd_pipelined.py)"
        timeout 60 python3 scripts/perf_probe.py --pipelined
      } 2>&1 | grep -v "UserWarning\|return scaled_dot\|warnings.warn" | tee "$OUT/sweep.txt" ;;
    record)
      {
        header
        echo "## ladder and memory (scripts/perf_probe.py)"
        timeout 150 python3 scripts/perf_probe.py --ladder "$OUT/h200_ladder.csv" --memory "$OUT/h200_memory.csv"
        echo; echo "## FlexAttention at the reference setting, side by side"
        timeout 90 python3 -m flashattn.bench --dtypes bf16 --head-dims 128 --seq-lens 8192 --causal 1 0 \
          --providers flashattn sdpa flex --no-warm --out "$OUT/h200_flex.csv" --plots ""
      } 2>&1 | grep -v "UserWarning\|return scaled_dot\|warnings.warn" | tee "$OUT/record.txt" ;;
    notebooks)
      {
        header
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "could not install the wheels in .whl/"
        if [ -z "${NOTEBOOKS:-}" ]; then  # NOTEBOOKS (a glob) runs a subset, without this step
          echo "## the candidates chapter 08 tunes over, compiled in parallel first"
          python3 -c "from flashattn import bench; print(bench.warm_compile(['bf16'], [128], [False, True]))"
        fi
        echo "## every notebook executed on the GPU (one process each); chapter 08 and failures saved"
        PYTHONPATH=/tmp/site timeout 300 python3 - "$OUT" <<'PY'
import concurrent.futures, glob, os, sys, time
import nbclient, nbformat

def execute(path):
    nb = nbformat.read(path, as_version=4)
    start = time.time()
    try:
        nbclient.NotebookClient(nb, timeout=280, kernel_name="python3",
                                resources={"metadata": {"path": "notebooks"}}).execute()
        status = "ok  "
    except Exception as e:
        status = "FAIL " + str(e).strip().splitlines()[-1][:300]
    if status != "ok  " or path.endswith("08_performance.ipynb"):  # the device tool returns few files
        nbformat.write(nb, os.path.join(sys.argv[1], os.path.basename(path)))
    return f"{status} {os.path.basename(path)} ({time.time() - start:.0f} s)"

with concurrent.futures.ProcessPoolExecutor(9) as pool:
    for line in pool.map(execute, sorted(glob.glob(os.environ.get("NOTEBOOKS", "notebooks/*.ipynb")))):
        print(line, flush=True)
PY
      } 2>&1 | tee "$OUT/notebooks.txt" ;;
    bench)
      { header; python3 -m flashattn.bench "$@"; } 2>&1 | tee "$OUT/bench.txt"
      cp figures/data/bench.csv figures/tflops_*.png "$OUT"/ 2>/dev/null
      break ;;
  esac
done
