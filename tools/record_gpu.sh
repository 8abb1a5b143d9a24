#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: the checks and measurements a GPU record is made of, most
# important first, each part under its own time limit so that one slow part cannot starve the rest.
#
#     bash tools/record_gpu.sh OUT_DIR [PART ...]
#
# Parts: backward (tools/backward_check.py: the fused Gluon backward and the deterministic one
# against float64, then the 24 cells of the sweep and grouped heads beside cuDNN; needs Triton >= 3.8
# on Hopper), backward-split (the fused kernel's HEAD_SPLIT, a group's query heads walked by 1, 2
# or 4 programs: checked against float64, timed beside the default, hopper.backward.head_split, at
# grouped heads 16/4, 32/4 and 32/8, then the training step without and with a split of 4),
# key-masks (the fused kernel reading key-padding masks, hopper.FUSED_KEY_MASKS: its gpu_checks
# cases in both dtypes and head dims against float64, then the key-padding row of score_mods, where
# the default runs beside flashattn-triton-key-mask (the switch off), FlexAttention and SDPA),
# backward-tiles (the fused kernel's tile variants side by side), train-step (a
# Llama-shaped transformers model's training step: flashattn against sdpa),
# tests-variants (every test of grouped heads, windows, varlen and the reliability fixes,
# compiled: all dtypes and odd sizes, torch.compile and threads on the GPU), bench-variants,
# tests-mods (masks and their tile lists, softcap, ALiBi, dropout, bottom-right, SDPA's signature, the
# KV-cache step), bench-mods (those modifications timed next to PyTorch's and FlexAttention's),
# decode-host, decode-paged (a paged KV cache's decoding step next to the contiguous one and SDPA),
# bench-generate (a transformers Llama generating on a left-padded batch: flashattn, sdpa and eager,
# dynamic and static caches, the dynamic cache's steps first profiled on the device and the host),
# tests-gpu (every other GPU test: tile configurations, long sequences, decode, the
# Gluon kernels), first-call, first-call-timeline (where a first call's seconds go), chapters;
# tests-kernels (the core kernels' and decode's GPU tests alone), bench-readme (the sweep behind the
# README's table and figure: bf16 and fp16, head dims 64 and 128, causal or not, N 1k-16k, against
# SDPA's backends), tf32x3-checks (float32 'highest' as 3xTF32 against float64 over the whole
# float32 grid, in four processes), bench-tf32x3 and first-call-tf32x3 (its speed against SDPA's
# float32, and its first calls), dropout-draws (experiments/dropout_draws.py: cheaper dropout draws
# checked and timed beside the calls without dropout), bench-sweep (the 24 cells of bf16 and fp16,
# head dims 64 and 128, N 4k-16k, causal or not, forward and backward, beside cuDNN, SDPA's
# FlashAttention-2 backend and FlexAttention in one run) run only when named.
# Each part writes OUT_DIR/<part>.txt (and its CSV files); the screen gets one line per part.
set -u
out=${1:?usage: bash tools/record_gpu.sh OUT_DIR [PART ...]}
shift
parts=${*:-backward backward-split key-masks backward-tiles train-step tests-variants bench-variants tests-mods bench-mods decode-host decode-paged bench-generate tests-gpu first-call first-call-timeline chapters}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
mkdir -p "$out"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# pytest-xdist, where installed, spreads the variants' tests over processes (compiling dominates
# them); the other GPU tests run in one process, as their module fixtures compile and check once
workers=$(python -c "import xdist" 2>/dev/null && echo "-n 8")
pytest="python -m pytest -q -p no:cacheprovider -p no:benchmark -o addopts= -rfE $workers"
variant_tests="tests/test_reliability.py tests/test_gqa.py tests/test_window.py tests/test_varlen.py"

python -c "import torch, triton; print(torch.cuda.get_device_name(), torch.version.cuda, 'torch', torch.__version__, 'triton', triton.__version__)" | tee "$out/versions.txt"
date -u | tee -a "$out/versions.txt"

part() {  # part NAME SECONDS COMMAND...
    local name=$1 limit=$2 start=$SECONDS status
    shift 2
    case " $parts " in *" $name "*) ;; *) return ;; esac
    timeout "$limit" "$@" > "$out/$name.txt" 2>&1
    status=$?
    [ $status = 124 ] && echo "(stopped at the part's limit of $limit s)" >> "$out/$name.txt"
    printf '%-16s exit %-3s %4d s  %s\n' "$name" "$status" $((SECONDS - start)) "$(tail -n 1 "$out/$name.txt")"
}

part backward 420 python tools/backward_check.py --csv "$out/backward.csv"
split='[{"HEAD_SPLIT": 1}, {"HEAD_SPLIT": 2}, {"HEAD_SPLIT": 4}]'  # 1: the whole walk
part backward-split 480 bash -c "python tools/backward_check.py --no-checks --check-variants --no-timings --bwd-variants '$split' && python tools/backward_check.py --no-checks --dtypes bf16 --head-dims 64 128 --seq-lens 4096 --causal 1 0 --batch-heads 4x16 4x32 --kv-heads 4 --bwd-variants '$split' && python tools/backward_check.py --no-checks --dtypes bf16 --head-dims 128 --seq-lens 8192 --causal 1 --batch-heads 4x32 --kv-heads 8 --bwd-variants '$split' && for n in 1 4; do python -m flashattn.measure.bench_train --fused-config HEAD_SPLIT=\$n --out '$out/train_step_split'\$n.csv; done"
key_masks() {  # the four (dtype, head dim) groups of checks side by side, each watched (a hang or a
    # crash ends its case, not the part), then the timing
    python -c "
import time
from flashattn.measure import gpu_checks as g
jobs = [g.command('gluon_mods', dtype=t, head_dim=d, only='key-') for t in g.DTYPES for d in g.HEAD_DIMS]
print(*g.run_jobs(jobs, 120, time.time() + 240, workers=len(jobs))[0], sep='\\n')
"
    python -m flashattn.measure.score_mods --cases key-padding --out "$1/score_mods_key_padding.csv"
}
export -f key_masks
part key-masks 420 bash -c 'key_masks "$0"' "$out"
part backward-tiles 150 python tools/backward_tiles.py '{"64": [{}, {"PREFETCH": false}], "128": [{}, {"PREFETCH": false}]}'
part train-step 240 python -m flashattn.measure.bench_train --profile --out "$out/train_step.csv"
part tests-variants 150 $pytest $variant_tests
part tests-kernels 170 ${pytest/$workers/} -m gpu tests/test_gpu.py tests/test_decode.py
part bench-variants 150 python -m flashattn.measure.variants --out-dir "$out"
part tests-mods 420 $pytest tests/test_modifiers.py tests/test_mask_tiles.py tests/test_sdpa_dropin.py tests/test_kv_cache.py tests/test_paged_decode.py
part bench-mods 600 python -m flashattn.measure.score_mods --out "$out/score_mods.csv"
part dropout-draws 420 python experiments/dropout_draws.py --time --out-dir "$out"
part decode-host 50 python -m flashattn.measure.bench_decode --host-ab --out "$out/decode_host_ab.csv"
part decode-paged 180 python -m flashattn.measure.bench_decode --paged --lengths 4096 16384 --out "$out/decode_paged.csv"
part bench-generate 300 bash -c "python -m flashattn.measure.bench_generate --profile --out '$out/generate_left_padded.csv' && python -m flashattn.measure.bench_generate --cache static --out '$out/generate_left_padded_static.csv'"
# the other modules with GPU tests (collecting every module would need the notebook tools too)
gpu_tests=$(grep -l "pytest.mark.gpu" tests/test_*.py | grep -v -F "$(printf '%s\n' $variant_tests)")
part tests-gpu 300 ${pytest/$workers/} -m gpu $gpu_tests
part first-call 400 python tools/first_call.py
part first-call-timeline 120 python tools/first_call.py --timeline
part chapters 420 python tools/time_chapters.py --jobs 4
part bench-readme 420 python -m flashattn.measure.bench --dtypes bf16 fp16 --providers flashattn sdpa sdpa-flash sdpa-cudnn sdpa-efficient --out "$out/bench.csv" --plots "$out"
part bench-sweep 600 python -m flashattn.measure.bench --dtypes bf16 fp16 --head-dims 64 128 --seq-lens 4096 8192 16384 --causal 0 1 --providers flashattn sdpa-cudnn sdpa-flash flex --out "$out/bench_sweep.csv" --plots ""

tf32x3_checks() {  # the causal and the non-causal half of the grid, each in two processes at once
    local causal part
    for causal in 0 1; do
        for part in 0/2 1/2; do
            python -m flashattn.measure.gpu_checks fp32 --precision highest --causal $causal --part $part &
        done
    done
    wait
}
export -f tf32x3_checks
part tf32x3-checks 300 env FLASHATTN_TF32X3=1 bash -c tf32x3_checks
part bench-tf32x3 200 env FLASHATTN_TF32X3=1 python -m flashattn.measure.bench --dtypes fp32 --head-dims 64 128 --seq-lens 4096 --causal 0 1 --providers flashattn sdpa --no-warm --plots "" --out "$out/bench_fp32_tf32x3.csv"
part first-call-tf32x3 120 env FLASHATTN_TF32X3=1 python tools/first_call.py --quick
