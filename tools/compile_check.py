"""Compile every kernel configuration for an H100/H200 (sm_90) without a GPU, and report resources.

Triton can compile to a cubin on any machine: this catches compile errors in configurations the
interpreter cannot check (it ignores layouts, shared memory and registers) and shows, per
configuration, the registers per thread, the spilled bytes and the shared memory, so that
candidates that spill can be pruned before any GPU time is spent.

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
from flashattn.compiled import KERNELS, compile_kernel, resources  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", choices=list(KERNELS), action="append")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], action="append")
    p.add_argument("--head-dim", type=int, action="append")
    p.add_argument("--causal", type=int, choices=(0, 1), action="append")
    p.add_argument("--all", action="store_true", help="also compile the candidates tuning.fits prunes")
    args = p.parse_args()
    failures = 0
    print(f"{'kernel':15} {'dtype':5} {'D':>4} {'causal':6} {'config':44} {'regs':>4} {'spill':>5} {'smem':>6}")
    for name, dtype, head_dim, causal in itertools.product(
            args.kernel or list(KERNELS), args.dtype or ["bf16"], args.head_dim or [64, 128],
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
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
