"""The kernels compiled for an H100/H200 (sm_90) on any machine, without a GPU.

Triton compiles to a GPU binary wherever it is installed; only running a kernel needs the GPU.
Compiling shows what the interpreter cannot: compile errors in a configuration, and the registers,
spilled bytes and shared memory each one needs. ``tools/compile_check.py`` prints them for every
configuration the tuner may pick, and the decode kernels as ``flashattn.decode`` launches them;
the compiled-kernel tests look inside the compiled code and check the decode kernels' resources.

flashattn must have defined its kernels for the compiler, not for the interpreter: the process
must make ``torch.cuda.is_available()`` answer True before it imports flashattn (nothing here
launches a kernel).
"""
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import backward, forward, tuning
from .decode import _decode_merge, _decode_split  # (flashattn.decode is the function)

#: sm_90 (H100, H200), 32 threads per warp.
SM90 = GPUTarget("cuda", 90, 32)
#: Shared memory one block may use on an H100/H200.
SMEM_PER_BLOCK = 227 * 1024

#: The package's kernels: (kernel, its tensors in the input dtype, its tensors of a fixed type).
#: The decode kernel is listed twice: with several splits it writes float32 partial states (O,
#: LSE) for the merge; as the only split (FINAL) it writes the output in the input dtype.
KERNELS = {
    "fwd": (forward._attn_fwd, ["Q", "K", "V", "O"], {"LSE": "fp32"}),
    "bwd_preprocess": (backward._attn_bwd_preprocess, ["O", "dO"], {"Delta": "fp32"}),
    "bwd_dkdv": (backward._attn_bwd_dkdv, ["Q", "K", "V", "dO", "dK", "dV"], {"LSE": "fp32", "Delta": "fp32"}),
    "bwd_dq": (backward._attn_bwd_dq, ["Q", "K", "V", "dO", "dQ"], {"LSE": "fp32", "Delta": "fp32"}),
    "decode_split": (_decode_split, ["Q", "K", "V"], {"LENS": "i32", "O": "fp32", "LSE": "fp32"}),
    "decode_final": (_decode_split, ["Q", "K", "V", "O"], {"LENS": "i32", "LSE": "fp32"}),
    "decode_merge": (_decode_merge, ["O"], {"O_PART": "fp32", "LSE_PART": "fp32", "LSE": "fp32"}),
}
DECODE_KERNELS = ("decode_split", "decode_final", "decode_merge")
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def compile_sm90(fn, pointers, constexprs, floats=(), aligned=(), **options):
    """Compile the @triton.jit ``fn`` for sm_90 and return Triton's compiled kernel.

    ``pointers`` maps each pointer argument to its element type ("fp16", "bf16", "fp32", ...),
    ``constexprs`` gives the compile-time arguments, ``floats`` names the float32 scalars; every
    other argument is an int32. ``aligned`` names the arguments Triton may assume divisible by 16,
    as it does for the pointers and strides of contiguous tensors. ``options`` go to the
    compiler (``num_warps``, ``num_stages``; Triton's defaults otherwise).
    """
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
        else:
            signature[name] = "fp32" if name in floats else "i32"
        if name in aligned and name not in constexprs:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=SM90, options=options)


def compile_kernel(name, dtype, constexprs, num_warps=4, num_stages=2):
    """Compile one of the package's kernels (a key of :data:`KERNELS`) for contiguous inputs of
    ``dtype`` ("fp16", "bf16", "fp32"), as a launch would: the head-dim strides equal 1 (Triton
    turns such ints into constants), the pointers and other strides are divisible by 16."""
    fn, tensors, fixed = KERNELS[name]
    constexprs = dict(constexprs)
    constexprs.update({arg: 1 for arg in fn.arg_names if arg.startswith("stride_") and arg.endswith("d")})
    pointers = {**{arg: dtype for arg in tensors}, **fixed}
    aligned = set(pointers) | {arg for arg in fn.arg_names if arg.startswith("stride_")}
    return compile_sm90(fn, pointers, constexprs, floats=("scale", "qk_scale"), aligned=aligned,
                        num_warps=num_warps, num_stages=num_stages)


def resources(compiled):
    """``(registers per thread, spilled bytes per thread, shared memory bytes)`` of a compiled
    kernel, read with the cuobjdump that ships with Triton (-1 where it cannot say)."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return (int(regs.group(1)) if regs else -1, int(stack.group(1)) if stack else -1,
            compiled.metadata.shared)


def decode_launches(dtype, head_dim, precision="ieee", block_r=16, candidate=None):
    """The decode kernels as ``flashattn.decode`` launches them on a GPU, for inputs of ``dtype``
    ("fp16", "bf16", "fp32") and ``head_dim``, in dot ``precision`` ("ieee", "tf32"), with query
    tiles of ``block_r`` rows (16, 32 or 64: the query heads of a KV group times the new tokens,
    padded) and the configuration ``tuning.decode_config`` gives (or its ``candidate``, one of
    ``tuning.DECODE_CANDIDATES``). A list of ``(kernel name, compile-time arguments, options)``
    for :func:`compile_kernel`: the split kernel writing partial states, then as the only split."""
    block_d = tuning.block_d(head_dim)
    config = tuning.decode_config(TORCH_DTYPES[dtype], precision, block_r, block_d, candidate)
    options = dict(num_warps=config.pop("num_warps"), num_stages=config.pop("num_stages"))
    return [(name, dict(config, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_R=block_r, FINAL=final,
                        DOT_PRECISION=precision), options)
            for name, final in (("decode_split", False), ("decode_final", True))]


def decode_merge_launch(head_dim, num_splits):
    """The merge kernel as ``flashattn.decode`` launches it for ``num_splits`` splits (Triton's
    default warps and stages): ``(kernel name, compile-time arguments, options)``."""
    return ("decode_merge", dict(HEAD_DIM=head_dim, BLOCK_D=tuning.block_d(head_dim),
                                 BLOCK_S=triton.next_power_of_2(num_splits)), dict(num_warps=4, num_stages=3))
