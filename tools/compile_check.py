"""Compile every kernel configuration for an H100/H200 (sm_90) without a GPU, and report resources.

Triton can compile to a cubin on any machine: this catches compile errors in configurations the
interpreter cannot check (it ignores layouts, shared memory and registers) and shows, per
configuration, the registers per thread, the spilled bytes and the shared memory, so that
candidates that spill can be pruned before any GPU time is spent. The decode kernels are compiled
as ``flashattn.decode`` launches them (query tiles of 16, 32 and 64 rows; ``--all`` adds every
candidate the decode benchmark times); a decode configuration that spills fails the check.

    python tools/compile_check.py [--dtype bf16] [--head-dim 128] [--kernel fwd] [--all]
"""
import argparse
import itertools
import os
import sys

import torch

# flashattn defines its kernels for the compiler only where it sees a GPU: say there is one (nothing
# below launches a kernel), before flashattn is imported.
os.environ.pop("TRITON_INTERPRET", None)
torch.cuda.is_available = lambda: True
torch.cuda.get_device_name = lambda *args: "sm_90, compile only"

from flashattn import tuning  # noqa: E402
from flashattn.compiled import (DECODE_KERNELS, KERNELS, SMEM_PER_BLOCK, TORCH_DTYPES,  # noqa: E402
                                compile_kernel, decode_launches, decode_merge_launch, resources)
from flashattn.decode import MAX_SPLITS, max_block_r  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", choices=list(KERNELS), action="append")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], action="append")
    p.add_argument("--head-dim", type=int, action="append")
    p.add_argument("--causal", type=int, choices=(0, 1), action="append")
    p.add_argument("--all", action="store_true", help="also compile the candidates tuning.fits prunes")
    args = p.parse_args()
    failures = 0
    kernels = args.kernel or list(KERNELS)
    print(f"{'kernel':15} {'dtype':5} {'D':>4} {'causal':6} {'config':44} {'regs':>4} {'spill':>5} {'smem':>6}")
    for name, dtype, head_dim, causal in itertools.product(
            [k for k in kernels if k not in DECODE_KERNELS], args.dtype or ["bf16"], args.head_dim or [64, 128],
            args.causal or [1]):
        for config in tuning.GPU_CONFIGS[name]:
            const = dict(config.kwargs, HEAD_DIM=head_dim, BLOCK_D=tuning.block_d(head_dim))
            if name != "bwd_preprocess":
                const.update(IS_CAUSAL=bool(causal), DOT_PRECISION="tf32" if dtype == "fp32" else "ieee")
                if not (args.all or tuning.fits(name, config, const["BLOCK_D"], 4 if dtype == "fp32" else 2)):
                    continue
            label = f"{config.kwargs} w{config.num_warps} s{config.num_stages}"
            try:
                compiled = compile_kernel(name, dtype, const, num_warps=config.num_warps,
                                          num_stages=config.num_stages)
                regs, spill, smem = resources(compiled)
                print(f"{name:15} {dtype:5} {head_dim:4} {causal:6} {label:44} {regs:4} {spill:5} "
                      f"{smem // 1024:5}K", flush=True)
            except Exception as e:  # report and go on: one bad config should not hide the others
                failures += 1
                print(f"{name:15} {dtype:5} {head_dim:4} {causal:6} {label:44} FAILED: "
                      f"{str(e).splitlines()[0][:200]}", flush=True)
    for dtype, head_dim in itertools.product(args.dtype or ["bf16"], args.head_dim or [64, 128]):
        failures += check_decode(kernels, dtype, head_dim, args.all)
    sys.exit(1 if failures else 0)


def check_decode(kernels, dtype, head_dim, everything):
    """Compile the decode kernels of ``kernels`` for one dtype and head dim, print a line each (no
    causal flag: the new tokens always see the cache up to themselves); return the failures."""
    launches = []
    for precision in ["ieee", "tf32"] if dtype == "fp32" else ["ieee"]:
        fma = dtype == "fp32" and precision == "ieee"  # one configuration, whatever the candidate
        rows = [r for r in (16, 32, 64) if r <= max_block_r(TORCH_DTYPES[dtype])]
        for block_r, candidate in itertools.product(rows, tuning.DECODE_CANDIDATES
                                                    if everything and not fma else [None]):
            launches += [(f"{precision} BLOCK_R={block_r}", launch)
                         for launch in decode_launches(dtype, head_dim, precision, block_r, candidate)]
    launches += [(f"{splits} splits", decode_merge_launch(head_dim, splits)) for splits in (2, MAX_SPLITS)]
    failures, seen = 0, set()
    for what, (name, const, options) in launches:
        key = (name, tuple(sorted(const.items())), tuple(sorted(options.items())))
        if name not in kernels or key in seen:  # tall tiles can cut two candidates to one
            continue
        seen.add(key)
        shown = {k: v for k, v in const.items() if k in ("BLOCK_KV", "BLOCK_S")}
        label = f"{what} {shown} w{options['num_warps']} s{options['num_stages']}"
        try:
            regs, spill, smem = resources(compile_kernel(name, dtype, const, **options))
        except Exception as e:  # report and go on
            failures += 1
            print(f"{name:15} {dtype:5} {head_dim:4} {'-':>6} {label:44} FAILED: {str(e).splitlines()[0][:200]}")
            continue
        bad = spill != 0 or smem > SMEM_PER_BLOCK
        failures += bad
        print(f"{name:15} {dtype:5} {head_dim:4} {'-':>6} {label:44} {regs:4} {spill:5} {smem // 1024:5}K"
              + ("  <- spills or too much shared memory" if bad else ""), flush=True)
    return failures


if __name__ == "__main__":
    main()
