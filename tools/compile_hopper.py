"""Compile the Gluon forward for Hopper (sm_90) without a GPU, and report registers and memory.

    python tools/compile_hopper.py [--head-dim 64] [--dtype bf16] [--causal 1]

Gluon has no interpreter, so compiling is the only check this kernel gets on a machine without
a GPU: it catches errors in layouts, shared memory and barriers that only the compiler sees, and
prints what each configuration costs (registers per thread, spilled bytes, shared memory).
"""
import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

TYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _hopper():
    # Import the kernel module without flashattn/__init__ choosing the interpreter on this machine.
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_name = lambda *args: "sm_90, compile only"
    from flashattn import hopper
    return hopper


def compile_forward(head_dim, dtype, causal, config=None):
    """The compiled kernel (``triton.compile``'s result) for one configuration."""
    hopper = _hopper()
    cfg = dict(hopper.CONFIGS[head_dim], PINGPONG=True)
    cfg.update(config or {})
    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def desc(rows):
        block = [1, 1, rows, head_dim]
        return f"tensordesc<{name}{block},{hopper.block_layout(block, dtype)!r}>"

    fn = hopper._attn_fwd_sm90
    sig = dict(desc_q=desc(cfg["BLOCK_M"]), desc_k=desc(cfg["BLOCK_N"]), desc_v=desc(cfg["BLOCK_N"]),
               desc_o=desc(cfg["BLOCK_M"]), LSE="*fp32", n_heads="i32", n_q="i32", n_kv="i32",
               qk_scale="fp32")
    consts = dict(HEAD_DIM=head_dim, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                  STAGES=cfg["STAGES"], IS_CAUSAL=bool(causal), PINGPONG=bool(cfg["PINGPONG"]))
    sig.update({k: "constexpr" for k in consts})
    attrs = {(fn.arg_names.index("LSE"),): [["tt.divisibility", 16]]}
    src = GluonASTSource(fn, sig, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=hopper.MAXNREG))


def resources(compiled):
    """Registers per thread at launch (``regs``; each partition then sets its own budget with
    ``setmaxnreg``), stack bytes (spills), shared memory bytes, wgmma instructions in the PTX."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    ptx = compiled.asm["ptx"]
    return dict(regs=int(regs.group(1)) if regs else -1, stack=int(stack.group(1)) if stack else -1,
                smem=compiled.metadata.shared,
                setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx))),
                wgmma=len(re.findall(r"wgmma\.mma_async", ptx)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dim", type=int, action="append")
    p.add_argument("--dtype", choices=list(TYPES), action="append")
    p.add_argument("--causal", type=int, choices=(0, 1), action="append")
    args = p.parse_args()
    hopper = _hopper()
    failures = 0
    print(f"triton {triton.__version__}")
    print(f"{'D':>4} {'dtype':5} {'causal':6} {'config':40} {'regs':>4} {'stack':>5} {'smem':>6} setmaxnreg")
    for head_dim, dtype, causal in itertools.product(args.head_dim or list(hopper.HEAD_DIMS),
                                                     args.dtype or list(TYPES), args.causal or [0, 1]):
        label = str(hopper.CONFIGS[head_dim])
        try:
            r = resources(compile_forward(head_dim, TYPES[dtype], causal))
            print(f"{head_dim:4} {dtype:5} {causal:6} {label:40} {r['regs']:4} {r['stack']:5} "
                  f"{r['smem'] // 1024:5}K {r['setmaxnreg']}", flush=True)
        except Exception as e:  # report and go on: one bad configuration should not hide the others
            failures += 1
            print(f"{head_dim:4} {dtype:5} {causal:6} {label:40} FAILED: {e}", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
