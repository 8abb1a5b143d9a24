"""Compile every kernel configuration for an H100/H200 (sm_90) without a GPU, and report resources.

Triton can compile to a cubin on any machine: this catches compile errors in configurations the
interpreter cannot check (it ignores layouts, shared memory and registers) and shows, per
configuration, the registers per thread, the spilled bytes and the shared memory, so that
candidates that spill can be pruned before any GPU time is spent.

    python scripts/compile_check.py [--dtype bf16] [--head-dim 128] [--kernel fwd]
"""
import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

# Make flashattn's runtime choice say "GPU" so that its kernels are defined for compilation, not
# for the interpreter; nothing below launches a kernel.
import torch  # noqa: E402

torch.cuda.is_available = lambda: True
torch.cuda.get_device_name = lambda *args: "sm_90, compile only"
from flashattn import backward, forward, tuning  # noqa: E402

KERNELS = {
    "fwd": (forward._attn_fwd, ["Q", "K", "V", "O"], ["LSE"]),
    "bwd_preprocess": (backward._attn_bwd_preprocess, ["O", "dO"], ["Delta"]),
    "bwd_dkdv": (backward._attn_bwd_dkdv, ["Q", "K", "V", "dO", "dK", "dV"], ["LSE", "Delta"]),
    "bwd_dq": (backward._attn_bwd_dq, ["Q", "K", "V", "dO", "dQ"], ["LSE", "Delta"]),
}
TYPES = {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32"}
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def signature(fn, tensors, fp32_tensors, dtype, constexprs):
    """Types as Triton would infer them for contiguous inputs: head-dim strides equal 1 (Triton
    turns such ints into constants), the others are i32 and divisible by 16."""
    sig, consts, attrs = {}, dict(constexprs), {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in tensors:
            sig[name] = "*" + dtype
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in fp32_tensors:
            sig[name] = "*fp32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name.startswith("stride_") and name.endswith("d"):
            sig[name] = "constexpr"
            consts[name] = 1
        elif name in ("scale", "qk_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn, sig, consts, attrs)


def resources(cubin: bytes):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return int(regs.group(1)) if regs else -1, int(stack.group(1)) if stack else -1


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", choices=list(KERNELS), action="append")
    p.add_argument("--dtype", choices=list(TYPES), action="append")
    p.add_argument("--head-dim", type=int, action="append")
    p.add_argument("--causal", type=int, choices=(0, 1), action="append")
    p.add_argument("--all", action="store_true", help="also compile the candidates tuning.fits prunes")
    args = p.parse_args()
    target = GPUTarget("cuda", 90, 32)
    failures = 0
    print(f"{'kernel':15} {'dtype':5} {'D':>4} {'causal':6} {'config':44} {'regs':>4} {'spill':>5} {'smem':>6}")
    for name, dtype, head_dim, causal in itertools.product(
            args.kernel or list(KERNELS), args.dtype or ["bf16"], args.head_dim or [64, 128],
            args.causal or [1]):
        fn, tensors, fp32_tensors = KERNELS[name]
        for config in tuning.GPU_CONFIGS[name]:
            const = dict(config.kwargs, HEAD_DIM=head_dim, BLOCK_D=tuning.block_d(head_dim))
            if name != "bwd_preprocess":
                const.update(IS_CAUSAL=bool(causal), DOT_PRECISION="tf32" if dtype == "fp32" else "ieee")
                if not (args.all or tuning.fits(name, config, const["BLOCK_D"], 4 if dtype == "fp32" else 2)):
                    continue
            label = f"{config.kwargs} w{config.num_warps} s{config.num_stages}"
            try:
                src = signature(fn, tensors, fp32_tensors, TYPES[dtype], const)
                compiled = triton.compile(src, target=target, options=dict(
                    num_warps=config.num_warps, num_stages=config.num_stages))
                regs, stack = resources(compiled.asm["cubin"])
                print(f"{name:15} {dtype:5} {head_dim:4} {causal:6} {label:44} {regs:4} {stack:5} "
                      f"{compiled.metadata.shared // 1024:5}K", flush=True)
            except Exception as e:  # report and go on: one bad config should not hide the others
                failures += 1
                print(f"{name:15} {dtype:5} {head_dim:4} {causal:6} {label:44} FAILED: "
                      f"{str(e).splitlines()[0][:200]}", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
