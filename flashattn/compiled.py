"""The kernels compiled for an H100/H200 (sm_90) on any machine, without a GPU.

Triton compiles to a GPU binary wherever it is installed; only running a kernel needs the GPU.
Compiling shows what the interpreter cannot: compile errors in a configuration, and the registers,
spilled bytes and shared memory each one needs. ``tools/compile_check.py`` prints them for every
configuration the tuner may pick; the compiled-kernel tests look inside the compiled code.

flashattn must have defined its kernels for the compiler, not for the interpreter: the process
must make ``torch.cuda.is_available()`` answer True before it imports flashattn (nothing here
launches a kernel).
"""
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import backward, forward

#: sm_90 (H100, H200), 32 threads per warp.
SM90 = GPUTarget("cuda", 90, 32)

#: The package's kernels: (kernel, its tensors in the input dtype, its float32 tensors).
KERNELS = {
    "fwd": (forward._attn_fwd, ["Q", "K", "V", "O"], ["LSE"]),
    "bwd_preprocess": (backward._attn_bwd_preprocess, ["O", "dO"], ["Delta"]),
    "bwd_dkdv": (backward._attn_bwd_dkdv, ["Q", "K", "V", "dO", "dK", "dV"], ["LSE", "Delta"]),
    "bwd_dq": (backward._attn_bwd_dq, ["Q", "K", "V", "dO", "dQ"], ["LSE", "Delta"]),
}


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
    fn, tensors, fp32_tensors = KERNELS[name]
    constexprs = dict(constexprs)
    constexprs.update({arg: 1 for arg in fn.arg_names if arg.startswith("stride_") and arg.endswith("d")})
    pointers = {**{arg: dtype for arg in tensors}, **{arg: "fp32" for arg in fp32_tensors}}
    aligned = set(pointers) | {arg for arg in fn.arg_names if arg.startswith("stride_")}
    return compile_sm90(fn, pointers, constexprs, floats=("scale", "qk_scale"), aligned=aligned,
                        num_warps=num_warps, num_stages=num_stages)


def _cuobjdump(compiled, flag):
    """What the cuobjdump that ships with Triton prints about a compiled kernel's cubin."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([cuobjdump, flag, f.name], capture_output=True, text=True).stdout


def resources(compiled):
    """``(registers per thread, spilled bytes per thread, shared memory bytes)`` of a compiled
    kernel, read with the cuobjdump that ships with Triton (-1 where it cannot say)."""
    out = _cuobjdump(compiled, "-res-usage")
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return (int(regs.group(1)) if regs else -1, int(stack.group(1)) if stack else -1,
            compiled.metadata.shared)


#: SASS opcodes worth counting in an attention loop: Hopper's warpgroup matrix products (HGMMA, PTX
#: ``wgmma``), the warp-level ones of earlier GPUs (HMMA, PTX ``mma.sync``), float32 fused
#: multiply-adds (FFMA), the special-function unit (MUFU: ex2, rcp, ...), and the local-memory
#: stores and loads that spilled registers cost (STL, LDL).
OPCODES = ("HGMMA", "HMMA", "FFMA", "MUFU", "STL", "LDL")


def instructions(compiled):
    """``{opcode: count}`` of the :data:`OPCODES` in a compiled kernel's machine code (SASS, as
    cuobjdump disassembles it), and ``"shapes"``: the sorted PTX shapes of its matrix products
    (``wgmma ... m64n64k16`` gives "wgmma m64n64k16", ``mma.sync ... m16n8k16`` "mma m16n8k16")."""
    counts = dict.fromkeys(OPCODES, 0)
    for line in _cuobjdump(compiled, "-sass").splitlines():
        match = re.match(r"\s+/\*[0-9a-f]+\*/\s+([A-Z0-9_]+)", line)
        if match and match.group(1) in counts:
            counts[match.group(1)] += 1
    ptx = compiled.asm["ptx"]
    counts["shapes"] = sorted({f"wgmma {m}" for m in re.findall(r"wgmma\.mma_async\.\S*?(m\d+n\d+k\d+)", ptx)}
                              | {f"mma {m}" for m in re.findall(r"\bmma\.sync\.\S*?(m\d+n\d+k\d+)", ptx)})
    return counts
