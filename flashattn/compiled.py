"""The kernels compiled for any NVIDIA architecture (sm_90 by default) on any machine, without a GPU.

Triton compiles to a GPU binary wherever it is installed; only running a kernel needs the GPU.
Compiling shows what the interpreter cannot: compile errors in a configuration, and the registers,
spilled bytes and shared memory each one needs. ``tools/compile_check.py`` prints them for every
configuration the tuner may pick, for each architecture of ``flashattn.gpus.ARCHS``; the
compiled-kernel tests look inside the compiled code.

flashattn must have defined its kernels for the compiler, not for the interpreter: the process
must make ``torch.cuda.is_available()`` answer True before it imports flashattn (nothing here
launches a kernel).
"""
import dataclasses
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import backward, forward

def target(capability: int) -> GPUTarget:
    """The compile target of a compute capability (75, 80, 86, 89, 90), 32 threads per warp."""
    return GPUTarget("cuda", capability, 32)


#: sm_90 (H100, H200).
SM90 = target(90)

#: The package's kernels: (kernel, its tensors in the input dtype, its float32 tensors).
KERNELS = {
    "fwd": (forward._attn_fwd, ["Q", "K", "V", "O"], ["LSE"]),
    "bwd_preprocess": (backward._attn_bwd_preprocess, ["O", "dO"], ["Delta"]),
    "bwd_dkdv": (backward._attn_bwd_dkdv, ["Q", "K", "V", "dO", "dK", "dV"], ["LSE", "Delta"]),
    "bwd_dq": (backward._attn_bwd_dq, ["Q", "K", "V", "dO", "dQ"], ["LSE", "Delta"]),
}


def compile_sm90(fn, pointers, constexprs, floats=(), aligned=(), target=SM90, **options):
    """Compile the @triton.jit ``fn`` for ``target`` (default sm_90) and return Triton's compiled kernel.

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
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options)


def compile_kernel(name, dtype, constexprs, num_warps=4, num_stages=2, target=SM90):
    """Compile one of the package's kernels (a key of :data:`KERNELS`) for contiguous inputs of
    ``dtype`` ("fp16", "bf16", "fp32"), as a launch would, for ``target`` (see :func:`target`): the
    head-dim strides equal 1 (Triton turns such ints into constants), the pointers and other strides
    are divisible by 16."""
    fn, tensors, fp32_tensors = KERNELS[name]
    constexprs = dict(constexprs)
    constexprs.update({arg: 1 for arg in fn.arg_names if arg.startswith("stride_") and arg.endswith("d")})
    pointers = {**{arg: dtype for arg in tensors}, **{arg: "fp32" for arg in fp32_tensors}}
    aligned = set(pointers) | {arg for arg in fn.arg_names if arg.startswith("stride_")}
    return compile_sm90(fn, pointers, constexprs, floats=("scale", "qk_scale"), aligned=aligned, target=target,
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


# --- Every configuration the package can run, for each architecture ------------------------------------

#: Head dims are padded to one of these (tuning.block_d): the head-dim classes.
BLOCK_DS = (16, 32, 64, 128, 256)


def dtype_paths(arch):
    """The (input dtype, dot precision) pairs the kernels run with on ``arch``: fp16 and bf16 on their
    tensor cores; float32 as 'highest' asks (3xTF32), as 'high'/'medium' ask (TF32) and under
    FLASHATTN_TF32X3=0 (IEEE). Before sm_80 there are no tensor cores: fp16 and IEEE float32 only
    (bfloat16 is computed in float32 there, runtime.bf16_in_float32)."""
    if not arch.tensor_cores:
        return [("fp16", "ieee"), ("fp32", "ieee")]
    return [("fp16", "ieee"), ("bf16", "ieee"), ("fp32", "tf32x3"), ("fp32", "tf32"), ("fp32", "ieee")]


def table_keys(arch, block_ds=BLOCK_DS):
    """The (kernel, dtype, dot precision, BLOCK_D) entries ``flashattn.defaults`` holds for ``arch``
    (the Delta kernel has no dot: its precision is None)."""
    from . import tuning

    keys = {}
    for dtype, precision in dtype_paths(arch):
        for name in KERNELS:
            for block_d in block_ds:
                if precision == "tf32x3" and block_d > tuning.TF32X3_MAX_BLOCK_D:
                    continue  # 'highest' float32 multiplies in IEEE there (tuning.dot_precision)
                keys[(name, dtype, None if name == "bwd_preprocess" else precision, block_d)] = True
    return list(keys)


def default_candidates(arch, name, dtype, precision, block_d):
    """What ``tools/compile_check.py --write-defaults`` tries for one entry, in order, keeping the
    first that compiles cleanly: the measured default (sm_90), then the candidates in the order the
    H200 measured them, those whose tiles fit the architecture's shared memory by the rule (the
    registers are left to the compiler, which counts them exactly), then the fallback and the
    smallest tiles."""
    import torch

    from . import tuning

    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    configs = tuning.candidates(name, torch_dtype, precision, arch) + [tuning.FALLBACK_CONFIGS[name]]
    if name == "bwd_preprocess":
        return configs
    kind = tuning.dot_kind(torch_dtype.itemsize, precision, arch)
    measured = tuning.MEASURED_DEFAULTS.get((arch.capability, name, kind, block_d))
    roomy = dataclasses.replace(arch, register_budget=tuple((k, 1e9) for k, _ in arch.register_budget))
    tried, order = set(), []
    for config in ([measured] if measured else []) + configs + tuning.SMALLEST_CONFIGS:
        key = (tuple(sorted(config.kwargs.items())), config.num_warps, config.num_stages)
        if key not in tried and tuning.fits(name, config, block_d, torch_dtype.itemsize, precision, roomy):
            tried.add(key)
            order.append(config)
    return order


def choosable(arch, block_ds=BLOCK_DS):
    """Every distinct (kernel, dtype, BLOCK_D, dot precision, configuration) that runs on ``arch``
    without timing (tuning.default_config), one per compile: the masking mode and head dims of one
    class share a compile here (HEAD_DIM = BLOCK_D, causal)."""
    import torch

    from . import tuning

    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    items = []
    for name, dtype, precision, block_d in table_keys(arch, block_ds):
        try:
            config = tuning.default_config(name, dtypes[dtype], precision, block_d, arch)
        except ValueError:  # no tile fits this GPU at all: it refuses with a clear error
            continue
        items.append((name, dtype, block_d, precision, tuple(sorted(config.kwargs.items())),
                      config.num_warps, config.num_stages))
    return items


def check(arch, item):
    """Compile one :func:`choosable` item for ``arch``; returns ``(registers, spilled bytes, shared
    memory bytes, problem or None)``."""
    name, dtype, block_d, precision, tiles, num_warps, num_stages = item
    constexprs = dict(tiles, HEAD_DIM=block_d, BLOCK_D=block_d)
    if name != "bwd_preprocess":
        constexprs.update(IS_CAUSAL=True, DOT_PRECISION=precision)
    kernel = compile_kernel(name, dtype, constexprs, num_warps=num_warps, num_stages=num_stages,
                            target=target(arch.capability))
    regs, spill, smem = resources(kernel)
    problem = None
    if spill:
        problem = f"spills {spill} bytes per thread"
    elif smem > arch.smem_per_block:
        problem = f"needs {smem} bytes of shared memory, more than the {arch.smem_per_block} a block may use"
    return regs, spill, smem, problem
