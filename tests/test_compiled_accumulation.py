"""IEEE float32 accumulation as a GPU compiles it: each tile's product is summed, then added.

In IEEE float32, ``tl.dot(a, b, acc)`` is a chain of FMAs running through ``acc``, so a sum over N
keys or queries is rounded N times in a row; on an H200 that gave dV 5.7x PyTorch's error at N = 1000
(notes/performance.md). ``tiles.dot_acc`` keeps the tile's product a separate sum. Triton's
compiler would fuse a plain ``acc + tl.dot(a, b)`` back into ``tl.dot(a, b, acc)``, which the
interpreter never shows, so this test compiles the kernels for sm_90 (in a child process that
believes it has a GPU; nothing is launched) and looks for the separate additions in the compiled
IR: one per accumulator and per loop stage. 16-bit inputs must keep the fused form. Skipped where
Triton cannot compile for CUDA.
"""
import os
import re
import sys

from sm90_child import ROOT, SKIP, run_as_child

# kernel: (tile configuration, accumulator tile shape, separate additions expected in IEEE fp32)
CASES = {
    "fwd": (dict(BLOCK_Q=32, BLOCK_KV=16), "32x64", 2),       # O, in 2 stages
    "bwd_dkdv": (dict(BLOCK_Q=16, BLOCK_KV=32), "32x64", 6),  # dK and dV, in 3 stages
    "bwd_dq": (dict(BLOCK_Q=32, BLOCK_KV=16), "32x64", 2),    # dQ, in 2 stages
}


def test_ieee_float32_sums_each_tile_before_adding_it():
    run_as_child(__file__)


def _child():
    sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
    import torch

    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_name = lambda *args: "sm_90, compile only"
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError as error:
        print(f"no Triton CUDA compiler: {error}")
        sys.exit(SKIP)
    import compile_check  # scripts/compile_check.py: the kernels' signatures for contiguous inputs

    def additions(name, dtype, precision):
        fn, tensors, fp32_tensors = compile_check.KERNELS[name]
        config, shape, _ = CASES[name]
        const = dict(config, HEAD_DIM=64, BLOCK_D=64, IS_CAUSAL=True, DOT_PRECISION=precision)
        compiled = triton.compile(compile_check.signature(fn, tensors, fp32_tensors, dtype, const),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))
        return len(re.findall(rf"arith\.addf .*tensor<{shape}xf32", compiled.asm["ttir"]))

    try:
        additions("bwd_dq", "fp16", "ieee")
    except Exception as error:
        print(f"cannot compile for sm_90 here: {type(error).__name__}: {str(error)[:200]}")
        sys.exit(SKIP)
    problems = []
    for name, (_, _, expected) in CASES.items():
        found = additions(name, "fp32", "ieee")
        if found != expected:
            problems.append(f"{name}, IEEE float32: {found} separate additions of the accumulator, "
                            f"expected {expected} (one per accumulator and loop stage)")
        fused = additions(name, "fp16", "ieee")
        if fused:
            problems.append(f"{name}, float16: {fused} separate additions; the tensor-core path must "
                            "accumulate inside tl.dot")
    print("\n".join(problems) or "ok")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    _child()
