"""The kernels compiled for an H100/H200 (sm_90) on any machine, without a GPU.

Triton compiles to a GPU binary wherever it is installed; only running a kernel needs the GPU.
Compiling shows what the interpreter cannot: compile errors in a configuration, and the registers,
spilled bytes and shared memory each one needs. ``tools/compile_check.py`` prints them for every
configuration the tuner may pick; the compiled-kernel tests look inside the compiled code.

flashattn must have defined its kernels for the compiler, not for the interpreter: the process
must make ``torch.cuda.is_available()`` answer True before it imports flashattn (nothing here
launches a kernel). A notebook, which runs on the interpreter, asks a child process that does so:
:func:`ptx_of` returns the PTX of a kernel (one of the package's, or one defined in the notebook)
compiled for any NVIDIA architecture, on any machine.
"""
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
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


def compile_sm90(fn, pointers, constexprs, floats=(), aligned=(), arch=90, **options):
    """Compile the @triton.jit ``fn`` for sm_90 (or sm_``arch``) and return Triton's compiled kernel.

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
    target = SM90 if arch == 90 else GPUTarget("cuda", arch, 32)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options)


def compile_kernel(name, dtype, constexprs, num_warps=4, num_stages=2, arch=90):
    """Compile one of the package's kernels (a key of :data:`KERNELS`) for contiguous inputs of
    ``dtype`` ("fp16", "bf16", "fp32"), as a launch would: the head-dim strides equal 1 (Triton
    turns such ints into constants), the pointers and other strides are divisible by 16."""
    fn, tensors, fp32_tensors = KERNELS[name]
    constexprs = dict(constexprs)
    constexprs.update({arg: 1 for arg in fn.arg_names if arg.startswith("stride_") and arg.endswith("d")})
    pointers = {**{arg: dtype for arg in tensors}, **{arg: "fp32" for arg in fp32_tensors}}
    aligned = set(pointers) | {arg for arg in fn.arg_names if arg.startswith("stride_")}
    return compile_sm90(fn, pointers, constexprs, floats=("scale", "qk_scale"), aligned=aligned,
                        arch=arch, num_warps=num_warps, num_stages=num_stages)


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


# --- PTX for a notebook: compiled in a child process ------------------------------------------------

#: What the child runs first: flashattn must see a CUDA device before it is imported.
_CHILD = """
import os, sys, torch
os.environ.pop("TRITON_INTERPRET", None)
torch.cuda.is_available = lambda: True
torch.cuda.get_device_name = lambda *args: "compile only"
from flashattn.compiled import _serve
_serve()
"""
#: The imports a notebook kernel compiled by the child may use.
_HEADER = "import math\n\nimport triton\nimport triton.language as tl\n\nfrom flashattn import tiles\n\n\n"


def ptx_of(kernel, pointers=None, constexprs=None, floats=(), arch=90, dtype="fp16", num_warps=4,
           num_stages=None):
    """The PTX of ``kernel`` compiled for sm_``arch`` (80: A100, 90: H100/H200), on any machine.

    ``kernel`` is a @triton.jit function, which the child compiles from its source (it may use
    ``triton``, ``tl``, ``math`` and flashattn's ``tiles``), with ``pointers`` mapping each pointer
    argument to its element type ("fp16", "fp32", ...), ``constexprs`` its compile-time arguments
    and ``floats`` its float32 scalars (every other argument is an int32); or the name of one of
    the package's kernels (a key of :data:`KERNELS`), compiled as :func:`compile_kernel` does for
    contiguous ``dtype`` inputs. See :func:`ptx_of_many` to compile several in one child."""
    return ptx_of_many([dict(kernel=kernel, pointers=pointers, constexprs=constexprs, floats=floats,
                             arch=arch, dtype=dtype, num_warps=num_warps, num_stages=num_stages)])[0]


def ptx_of_many(jobs, timeout=300):
    """:func:`ptx_of` for several kernels (``jobs``: dicts of its arguments), compiled by one child
    process (starting one costs a few seconds: torch and Triton are imported afresh)."""
    specs = []
    for job in jobs:
        kernel = job["kernel"]
        spec = {key: job.get(key) for key in ("constexprs", "arch", "dtype", "num_warps", "num_stages")}
        spec["floats"] = list(job.get("floats") or ())
        spec["pointers"] = job.get("pointers") or {}
        spec["arch"] = spec["arch"] or 90
        if isinstance(kernel, str):
            spec["package"] = kernel
        else:
            fn = getattr(kernel, "fn", kernel)
            lines = inspect.getsource(fn).splitlines()
            indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
            source = "\n".join(line[indent:] for line in lines)
            # the source of a @triton.jit function starts at its decorator; compile it as a kernel
            spec["source"] = source if source.lstrip().startswith("@") else "@triton.jit\n" + source
            spec["name"] = fn.__name__
        specs.append(spec)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(specs), capture_output=True,
                            text=True, env=env, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"compiling for sm_{specs[0]['arch']} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _serve():
    """The child of :func:`ptx_of_many`: read the jobs (JSON) on stdin, print the PTX (JSON)."""
    specs = json.loads(sys.stdin.read())
    out = []
    with tempfile.TemporaryDirectory() as folder:
        for n, spec in enumerate(specs):
            options = {k: spec[k] for k in ("num_warps", "num_stages") if spec.get(k) is not None}
            constexprs = spec.get("constexprs") or {}
            if "package" in spec:
                compiled = compile_kernel(spec["package"], spec["dtype"], constexprs, arch=spec["arch"], **options)
            else:
                path = os.path.join(folder, f"kernel_{n}.py")
                with open(path, "w", encoding="utf8") as f:
                    f.write(_HEADER + spec["source"] + "\n")
                module_spec = importlib.util.spec_from_file_location(f"kernel_{n}", path)
                module = importlib.util.module_from_spec(module_spec)
                module_spec.loader.exec_module(module)
                compiled = compile_sm90(getattr(module, spec["name"]), spec["pointers"], constexprs,
                                        floats=spec["floats"], aligned=tuple(spec["pointers"]),
                                        arch=spec["arch"], **options)
            out.append(compiled.asm["ptx"])
    print(json.dumps(out))
