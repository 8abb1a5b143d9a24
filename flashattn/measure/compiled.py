"""The kernels compiled for any NVIDIA architecture (sm_90 by default) on any machine, without a GPU.

Triton compiles to a GPU binary wherever it is installed; only running a kernel needs the GPU.
Compiling shows what the interpreter cannot: compile errors in a configuration, and the registers,
spilled bytes and shared memory each one needs. ``tools/compile_check.py`` prints them for every
configuration the tuner may pick, for each architecture of ``flashattn.gpu.archs.ARCHS``, and the
decode kernels as ``flashattn.decode`` launches them; the compiled-kernel tests look inside the
compiled code.

flashattn must have defined its kernels for the compiler, not for the interpreter: the process
must make ``torch.cuda.is_available()`` answer True before it imports flashattn (nothing here
launches a kernel). :func:`in_child` does that in a child process, so that a test or a notebook
running on the interpreter can ask for a compiled kernel's facts.

The Gluon kernels for Hopper (``flashattn.hopper.forward``, ``flashattn.hopper.backward``) have no
interpreter at all: ``flashattn.measure.compiled_gluon`` compiles them, and :func:`facts` reads
what the compiler made (wgmma, TMA copies and reduce-adds, mbarrier waits, register budgets).

A notebook asks for the PTX of a kernel (one of the package's, or one it defines) compiled for any
NVIDIA architecture with :func:`ptx_of`, which runs the compiler through :func:`in_child`.
"""
import dataclasses
import functools
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ..gpu import archs, configs
from ..kernels import backward, forward
from ..kernels.decode import decode_merge, decode_split  # (flashattn.decode is the function)

def target(capability: int) -> GPUTarget:
    """The compile target of a compute capability (75, 80, 86, 89, 90), 32 threads per warp."""
    return GPUTarget("cuda", capability, 32)


SM90 = target(90)  # H100, H200
#: Shared memory one block may use on an H100/H200.
SMEM_PER_BLOCK = 227 * 1024

#: The package's kernels: (kernel, its tensors in the input dtype, its tensors of a fixed type).
#: The decode kernel is listed twice: with several splits it writes float32 partial states (O,
#: LSE) for the merge; as the only split (FINAL) it writes the output in the input dtype.
KERNELS = {
    "fwd": (forward.attn_fwd, ["Q", "K", "V", "O"], {"LSE": "fp32"}),
    "bwd_preprocess": (backward.attn_bwd_preprocess, ["O", "dO"], {"Delta": "fp32"}),
    "bwd_dkdv": (backward.attn_bwd_dkdv, ["Q", "K", "V", "dO", "dK", "dV"], {"LSE": "fp32", "Delta": "fp32"}),
    "bwd_dq": (backward.attn_bwd_dq, ["Q", "K", "V", "dO", "dQ"], {"LSE": "fp32", "Delta": "fp32"}),
    "decode_split": (decode_split, ["Q", "K", "V"], {"LENS": "i32", "O": "fp32", "LSE": "fp32"}),
    "decode_final": (decode_split, ["Q", "K", "V", "O"], {"LENS": "i32", "LSE": "fp32"}),
    "decode_merge": (decode_merge, ["O"], {"O_PART": "fp32", "LSE_PART": "fp32", "LSE": "fp32"}),
}
#: The attention kernels, which flashattn.gpu.configs configures, and the decode kernels.
ATTENTION_KERNELS = ("fwd", "bwd_preprocess", "bwd_dkdv", "bwd_dq")
DECODE_KERNELS = ("decode_split", "decode_final", "decode_merge")
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def compile_sm90(fn, pointers, constexprs, floats=(), aligned=(), target=SM90, **options):
    """Compile the @triton.jit ``fn`` for ``target`` (default sm_90) and return Triton's compiled kernel.

    ``pointers`` maps each pointer argument to its element type ("fp16", "bf16", "fp32", ...),
    ``constexprs`` gives the compile-time arguments, ``floats`` names the float32 scalars; every
    other argument is an int32. ``aligned`` names the arguments Triton may assume divisible by 16,
    as it does for the pointers and strides of contiguous tensors. ``options`` go to the
    compiler (``num_warps``, ``num_stages``, ``enable_fp_fusion``; Triton's defaults otherwise).
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


#: The tables of packed sequences (flashattn.ops.varlen): ``constexprs`` of :func:`compile_kernel`
#: gives them as "pointer" to compile the VARLEN kernels.
VARIANT_POINTERS = ("Programs", "CuSeqQ", "CuSeqK")
#: The score modifications' tensors (flashattn.kernels.mods; Lists: an attn_mask's tile lists),
#: decode's block table, left padding and cache rows: ``constexprs`` gives their element type ("fp32",
#: "u8", "i32") to compile the kernels with ALIBI, MASK_KIND, PAGED, LEFTPAD or CACHE_ROWS on.
MOD_POINTERS = ("Slopes", "Mask", "Lists", "Pages", "LeftPad", "CacheRows")
#: decode with every variant on: a paged cache (pages of 16 keys) of a left-padded batch, ALiBi,
#: softcap and a window (CACHE_ROWS goes without pages).
DECODE_ALL_VARIANTS = dict(PAGED=True, PAGE_SIZE=16, ALIBI=True, SOFTCAP=True, WINDOW=True, LEFTPAD=True,
                           Pages="i32", Slopes="fp32", LeftPad="i32")


def compile_kernel(name, dtype, constexprs, num_warps=4, num_stages=2, target=SM90, **options):
    """Compile one of the package's kernels (a key of :data:`KERNELS`) for contiguous inputs of
    ``dtype`` ("fp16", "bf16", "fp32"), as a launch would, for ``target`` (see :func:`target`): the
    head-dim strides equal 1 (Triton turns such ints into constants), the pointers and other strides
    are divisible by 16; v's head dim (HEAD_DIM_V, BLOCK_DV) is q's unless ``constexprs`` gives
    it. Without grouped heads (``n_group="runtime"`` compiles them) and without packed sequences
    (``Programs=CuSeqQ=CuSeqK="pointer"`` compiles them, with ``VARLEN=True``). ``options``: more
    of the compiler's (``enable_fp_fusion``)."""
    fn, tensors, fixed = KERNELS[name]
    # As flashattn.attention launches them without grouped heads, windows or packed sequences:
    # Triton turns n_group = 1 into a constant and the absent tables (None) into constexprs.
    # ``constexprs`` may override them (a table is then an int32 pointer, see VARIANT_POINTERS).
    variants = {"n_group": 1, "Programs": None, "CuSeqQ": None, "CuSeqK": None, "WINDOW": False,
                "VARLEN": False, "Slopes": None, "Mask": None, "Lists": None, "Pages": None, "LeftPad": None,
                "CacheRows": None}
    constexprs = {**{arg: value for arg, value in variants.items() if arg in fn.arg_names}, **constexprs}
    # Every other switch at its default (SOFTCAP, ALIBI, MASK_KIND, DROPOUT, BOTTOM_RIGHT off), as a
    # launch that does not pass it: left out here, it would compile as a run-time int.
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constexprs}
    if "HEAD_DIM_V" in fn.arg_names:  # v's head dim: q's unless given (DeepSeek's MLA: 192/128)
        constexprs = {"HEAD_DIM_V": constexprs.get("HEAD_DIM"), "BLOCK_DV": constexprs.get("BLOCK_D"), **constexprs}
    constexprs.update({arg: 1 for arg in fn.arg_names if arg.startswith("stride_") and arg.endswith("d")})
    pointers = {**{arg: dtype for arg in tensors}, **fixed}
    for arg in VARIANT_POINTERS:
        if constexprs.get(arg, 0) == "pointer":  # a packed batch's table: an int32 pointer
            del constexprs[arg]
            pointers[arg] = "i32"
    for arg in MOD_POINTERS:  # ALiBi's slopes, attn_mask: a pointer of the type given ("fp32", "u8")
        if isinstance(constexprs.get(arg), str):
            pointers[arg] = constexprs.pop(arg)
    if pointers.get("Mask"):  # a mask's key dim is contiguous, which Triton turns into a constant
        constexprs["stride_mk"] = 1
    if constexprs.get("n_group") == "runtime":  # grouped-query attention: a run-time int
        del constexprs["n_group"]
    # The mask's, its tile lists' and the slopes' strides are plain ints (0 on broadcast dims), not
    # multiples of 16, nor is the block table's (its row: max_blocks pages).
    aligned = set(pointers) | {arg for arg in fn.arg_names if arg.startswith("stride_")
                               and not arg.startswith(("stride_m", "stride_s", "stride_p", "stride_l"))}
    return compile_sm90(fn, pointers, constexprs, floats=("scale", "qk_scale", "softcap", "p_drop"),
                        aligned=aligned, target=target, num_warps=num_warps, num_stages=num_stages, **options)


@functools.lru_cache(maxsize=4)  # several facts of one kernel read the same SASS: disassembled once
def cuobjdump(cubin: bytes, flag: str) -> str:
    """What the cuobjdump that ships with Triton prints about a cubin (``flag``: -sass, -res-usage)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout


def resources(compiled):
    """``(registers per thread, spilled bytes per thread, shared memory bytes)`` of a compiled
    kernel, read with the cuobjdump that ships with Triton (-1 where it cannot say)."""
    out = cuobjdump(compiled.asm["cubin"], "-res-usage")
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return (int(regs.group(1)) if regs else -1, int(stack.group(1)) if stack else -1,
            compiled.metadata.shared)


def decode_launches(dtype, head_dim, precision="ieee", block_r=16, candidate=None, variants=None, arch=None):
    """The decode kernels as ``flashattn.decode`` launches them on a GPU, for inputs of ``dtype``
    ("fp16", "bf16", "fp32") and ``head_dim``, in dot ``precision`` ("ieee", "tf32"), with query
    tiles of ``block_r`` rows (16, 32 or 64: the query heads of a KV group times the new tokens,
    padded) and the configuration ``configs.decode_config`` gives on ``arch`` (an ``archs.Arch``;
    default sm_90) (or its ``candidate``, one of ``configs.DECODE_CANDIDATES``); ``variants``
    switches more on (e.g. :data:`DECODE_ALL_VARIANTS`). A list of ``(kernel name, compile-time
    arguments, options)`` for :func:`compile_kernel`: the split kernel writing partial states,
    then as the only split."""
    block_d = configs.block_d(head_dim)
    config = configs.decode_config(TORCH_DTYPES[dtype], precision, block_r, block_d, candidate, arch,
                                   paged=bool((variants or {}).get("PAGED")))
    options = dict(num_warps=config.pop("num_warps"), num_stages=config.pop("num_stages"))
    return [(name, dict(config, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_R=block_r, FINAL=final,
                        DOT_PRECISION=precision, **(variants or {})), options)
            for name, final in (("decode_split", False), ("decode_final", True))]


def decode_merge_launch(head_dim, num_splits):
    """The merge kernel as ``flashattn.decode`` launches it for ``num_splits`` splits (Triton's
    default warps and stages): ``(kernel name, compile-time arguments, options)``."""
    return ("decode_merge", dict(HEAD_DIM=head_dim, BLOCK_D=configs.block_d(head_dim),
                                 BLOCK_S=triton.next_power_of_2(num_splits)), dict(num_warps=4, num_stages=3))


def facts(compiled):
    """What a compiled kernel holds, as a dict: registers per thread at launch, spilled bytes,
    shared memory bytes, and counts read from its PTX: wgmma instructions (``wgmma``) and waits
    for them (``wgmma_waits``), TMA copies into and out of shared memory (``tma_loads``,
    ``tma_stores``) and TMA reduce-adds into global memory (``tma_reduces``), mbarrier waits
    (``mbarrier_waits``), the register budgets the warps set themselves (``setmaxnreg``, sorted),
    and two kinds of instructions that run on the special-function unit, 16 per clock and SM:
    exponentials (``exp2``) and float-to-integer roundings and conversions (``roundings``)."""
    regs, spill, smem = resources(compiled)
    ptx = compiled.asm["ptx"]
    return dict(regs=regs, spill=spill, smem=smem,
                wgmma=len(re.findall(r"\bwgmma\.mma_async", ptx)),
                wgmma_waits=len(re.findall(r"\bwgmma\.wait_group", ptx)),
                tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global", ptx)),
                tma_stores=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx)),
                mbarrier_waits=len(re.findall(r"mbarrier\.try_wait", ptx)),
                tma_reduces=len(re.findall(r"cp\.reduce\.async\.bulk", ptx)),
                setmaxnreg=sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
                exp2=len(re.findall(r"\bex2\.approx", ptx)),
                roundings=len(re.findall(r"\bcvt\.r[mnpz]i\.", ptx)))


def sass_instructions(compiled):
    """How many machine instructions (SASS, as cuobjdump disassembles it) a compiled kernel holds:
    a rough guide to what a change costs where the kernel is bound by issuing them (not a timing:
    docs/performance.md says where the count followed the measured speed and where it did not)."""
    sass = cuobjdump(compiled.asm["cubin"], "-sass")
    return len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+[A-Z@]", sass, flags=re.M))


# ---------------------------------------------------------------------------- Gluon kernels


class CannotCompile(RuntimeError):
    """This machine's Triton cannot compile for sm_90 (no CUDA backend, no ptxas, no Gluon)."""


def variant_report(dtype="bf16", head_dim=128, arch=90):
    """The attention kernels compiled for sm_``arch`` with each variant on (grouped heads, a window,
    packed sequences, all three; the score modifications and dropout with a bottom-right window, with
    packed sequences; a float, a boolean and a key-padding mask; causal dropout), in ``dtype`` with the
    default tiles of ``flashattn.gpu.defaults`` there: one dict per kernel and variant with its
    registers, spilled bytes and shared memory. Run it through :func:`in_child`."""
    torch_dtype = TORCH_DTYPES[dtype]
    rows = []
    for name in ("fwd", "bwd_dkdv", "bwd_dq"):
        precision = configs.dot_precision(torch_dtype, head_dim)
        config = configs.default_config(name, torch_dtype, precision, head_dim, archs.ARCHS[arch])
        for variant, extra in (("gqa", dict(n_group="runtime", IS_CAUSAL=True)), ("window", dict(WINDOW=True, IS_CAUSAL=False)),
                               ("varlen", dict(VARLEN=True, IS_CAUSAL=True, Programs="pointer",
                                               CuSeqQ="pointer", CuSeqK="pointer")),
                               ("all", dict(n_group="runtime", WINDOW=True, VARLEN=True, IS_CAUSAL=False,
                                            Programs="pointer", CuSeqQ="pointer", CuSeqK="pointer")),
                               ("mods", dict(n_group="runtime", WINDOW=True, IS_CAUSAL=False, BOTTOM_RIGHT=True,
                                             SOFTCAP=True, ALIBI=True, Slopes="fp32", MASK_KIND=1, Mask="u8",
                                             Lists="i32", DROPOUT=1)),
                               ("mods-varlen", dict(WINDOW=True, VARLEN=True, IS_CAUSAL=False, BOTTOM_RIGHT=True,
                                                    Programs="pointer", CuSeqQ="pointer", CuSeqK="pointer",
                                                    ALIBI=True, Slopes="fp32", DROPOUT=2)),
                               ("float-mask", dict(IS_CAUSAL=False, MASK_KIND=2, Mask="fp32", Lists="i32")),
                               ("bool-mask", dict(IS_CAUSAL=False, MASK_KIND=1, Mask="u8", Lists="i32")),
                               ("key-padding", dict(IS_CAUSAL=False, MASK_KIND=5, Mask="u8", Lists="i32")),
                               ("dropout", dict(IS_CAUSAL=True, DROPOUT=1))):
            constexprs = dict(config.kwargs, HEAD_DIM=head_dim, BLOCK_D=head_dim, DOT_PRECISION=precision,
                              **extra)
            kernel = compile_kernel(name, dtype, constexprs, num_warps=config.num_warps,
                                    num_stages=config.num_stages, target=target(arch))
            registers, spilled, smem = resources(kernel)
            rows.append(dict(kernel=name, variant=variant, config=str(config), registers=registers,
                             spilled=spilled, smem=smem))
    return rows


def helper_report(arch=90):
    """The small kernels beside the attention kernels compiled for sm_``arch``: an attn_mask's tile
    classes (``kernels.masks``) and the dropout mask a call returns (``kernels.mods``). The
    interpreter lets a kernel read a plain Python global; the compiler does not, so only compiling
    tells. One dict per kernel: registers, spilled bytes, shared memory. Run it through
    :func:`in_child`."""
    from ..kernels import masks, mods, tiles

    rows = []
    for name, fn, pointers, constexprs, floats in (
            ("mask_classes", masks.mask_classes_kernel, dict(Mask="u8", Classes="i8"),
             dict(IS_BOOL=True, BLOCK_Q=16, BLOCK_KV=16), ()),
            ("dropout_mask", mods.dropout_mask_kernel,
             dict(Keep="i8", Row0="i64", Col0="i64", Rows="i64", Cols="i64"),
             dict(BLOCK=64, DROPOUT=tiles.DROP_PAIR), ("p_drop",))):
        kernel = compile_sm90(fn, pointers, constexprs, floats=floats, target=target(arch), enable_fp_fusion=True)
        registers, spilled, smem = resources(kernel)
        rows.append(dict(kernel=name, registers=registers, spilled=spilled, smem=smem))
    return rows


# ---------------------------------------------------------------------------- in a child process

#: The exit status of a child that cannot compile for sm_90 on this machine.
SKIP = 77
_RESULT = "flashattn.measure.compiled result: "
_CHILD = f"""
import importlib, json, sys
import torch
torch.cuda.is_available = lambda: True  # flashattn then defines its kernels for the compiler
torch.cuda.get_device_name = lambda *args: "sm_90, compile only"
from flashattn.measure.compiled import CannotCompile
module, name = sys.argv[1].split(":")
try:
    result = getattr(importlib.import_module(module), name)(**json.loads(sys.argv[2]))
except CannotCompile as error:
    print(error)
    sys.exit({SKIP})
print({_RESULT!r} + json.dumps(result))
"""


def in_child(target, timeout=600, **kwargs):
    """Call ``target`` ("module:function", e.g. "flashattn.measure.compiled:gluon_report") with the
    JSON-able ``kwargs`` in a child process whose flashattn defines its kernels for the compiler,
    and return what it returns (through JSON). Works from any process, the interpreter's included.
    Raises CannotCompile where this machine cannot compile for sm_90, RuntimeError with the
    child's output if it fails otherwise."""
    import flashattn

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # set by flashattn on a CPU
    # the child imports the flashattn this process uses, installed or not
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(flashattn.__file__)),
                                                      env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", _CHILD, target, json.dumps(kwargs)], env=env,
                            capture_output=True, text=True, timeout=timeout)
    if result.returncode == SKIP:
        raise CannotCompile(result.stdout.strip().splitlines()[-1] if result.stdout.strip() else "cannot compile")
    lines = [line for line in result.stdout.splitlines() if line.startswith(_RESULT)]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"{target} failed in the child (status {result.returncode}):\n"
                           + result.stdout[-3000:] + result.stderr[-3000:])
    return json.loads(lines[-1][len(_RESULT):])
# --- PTX for a notebook: compiled in a child process ------------------------------------------------

#: The imports a notebook kernel compiled by the child may use.
_HEADER = "import math\n\nimport triton\nimport triton.language as tl\n\nfrom flashattn.kernels import tiles\n\n\n"


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


#: The compiler's options a job of :func:`ptx_of_many` may set (Triton's default where it does not).
#: ``enable_fp_fusion``: whether a multiply and an add may fuse into one fma; Triton 3.9 fuses
#: unless told otherwise and warns that Triton 3.10 will not, so a PTX that depends on it sets it.
PTX_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


def ptx_of_many(jobs, timeout=300):
    """:func:`ptx_of` for several kernels (``jobs``: dicts of its arguments, and any of
    :data:`PTX_OPTIONS`), compiled by one child process (starting one costs a few seconds: torch
    and Triton are imported afresh)."""
    specs = []
    for job in jobs:
        kernel = job["kernel"]
        spec = {key: job.get(key) for key in ("constexprs", "arch", "dtype", *PTX_OPTIONS)}
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
    return in_child("flashattn.measure.compiled:_ptx_jobs", timeout=timeout, specs=specs)


def _ptx_jobs(specs):
    """In the child of :func:`ptx_of_many`: compile each job, return the PTX of each."""
    out = []
    with tempfile.TemporaryDirectory() as folder:
        for n, spec in enumerate(specs):
            options = {k: spec[k] for k in PTX_OPTIONS if spec.get(k) is not None}
            constexprs = spec.get("constexprs") or {}
            if "package" in spec:
                compiled = compile_kernel(spec["package"], spec["dtype"], constexprs, target=target(spec["arch"]), **options)
            else:
                path = os.path.join(folder, f"kernel_{n}.py")
                with open(path, "w", encoding="utf8") as f:
                    f.write(_HEADER + spec["source"] + "\n")
                module_spec = importlib.util.spec_from_file_location(f"kernel_{n}", path)
                module = importlib.util.module_from_spec(module_spec)
                module_spec.loader.exec_module(module)
                compiled = compile_sm90(getattr(module, spec["name"]), spec["pointers"], constexprs,
                                        floats=spec["floats"], aligned=tuple(spec["pointers"]),
                                        target=target(spec["arch"]), **options)
            out.append(compiled.asm["ptx"])
    return out


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
    for line in cuobjdump(compiled.asm["cubin"], "-sass").splitlines():
        match = re.match(r"\s+/\*[0-9a-f]+\*/\s+([A-Z0-9_]+)", line)
        if match and match.group(1) in counts:
            counts[match.group(1)] += 1
    ptx = compiled.asm["ptx"]
    counts["shapes"] = sorted({f"wgmma {m}" for m in re.findall(r"wgmma\.mma_async\.\S*?(m\d+n\d+k\d+)", ptx)}
                              | {f"mma {m}" for m in re.findall(r"\bmma\.sync\.\S*?(m\d+n\d+k\d+)", ptx)})
    return counts


# --- Every configuration the package can run, for each architecture ------------------------------------

#: Head dims are padded to one of these (configs.block_d): the head-dim classes.
BLOCK_DS = (16, 32, 64, 128, 256)


def dtype_paths(arch):
    """The (input dtype, dot precision) pairs the kernels run with on ``arch``: fp16 and bf16 on their
    tensor cores; float32 as 'highest' asks (IEEE), as 'high'/'medium' ask (TF32) and under the
    experimental FLASHATTN_TF32X3=1 (3xTF32). Before sm_80 there are no tensor cores: fp16 and
    IEEE float32 only (bfloat16 is computed in float32 there, runtime.bf16_in_float32)."""
    if not arch.tensor_cores:
        return [("fp16", "ieee"), ("fp32", "ieee")]
    return [("fp16", "ieee"), ("bf16", "ieee"), ("fp32", "tf32x3"), ("fp32", "tf32"), ("fp32", "ieee")]


def table_keys(arch, block_ds=BLOCK_DS):
    """The (kernel, dtype, dot precision, BLOCK_D) entries ``flashattn.gpu.defaults`` holds for ``arch``
    (the Delta kernel has no dot: its precision is None)."""
    keys = {}
    for dtype, precision in dtype_paths(arch):
        for name in ATTENTION_KERNELS:
            for block_d in block_ds:
                if precision == "tf32x3" and block_d > configs.TF32X3_MAX_BLOCK_D:
                    continue  # 'highest' float32 multiplies in IEEE there (configs.dot_precision)
                keys[(name, dtype, None if name == "bwd_preprocess" else precision, block_d)] = True
    return list(keys)


def default_candidates(arch, name, dtype, precision, block_d):
    """What ``tools/compile_check.py --write-defaults`` tries for one entry, in order, keeping the
    first that compiles cleanly: the measured default (sm_90), then the candidates in the order the
    H200 measured them, those whose tiles fit the architecture's shared memory by the rule (the
    registers are left to the compiler, which counts them exactly), then the fallback and the
    smallest tiles."""
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    candidates = configs.candidates(name, torch_dtype, precision, arch) + [configs.FALLBACK_CONFIGS[name]]
    if name == "bwd_preprocess":
        return candidates
    kind = configs.dot_kind(torch_dtype.itemsize, precision, arch)
    measured = configs.MEASURED_DEFAULTS.get((arch.capability, name, kind, block_d))
    roomy = dataclasses.replace(arch, register_budget=tuple((k, 1e9) for k, _ in arch.register_budget))
    tried, order = set(), []
    for config in ([measured] if measured else []) + candidates + configs.SMALLEST_CONFIGS:
        key = (tuple(sorted(config.kwargs.items())), config.num_warps, config.num_stages)
        if key not in tried and configs.fits(name, config, block_d, torch_dtype.itemsize, precision, roomy):
            tried.add(key)
            order.append(config)
    return order


def choosable(arch, block_ds=BLOCK_DS):
    """Every distinct (kernel, dtype, BLOCK_D, dot precision, configuration) that runs on ``arch``
    without timing (configs.default_config), one per compile: the masking mode and head dims of one
    class share a compile here (HEAD_DIM = BLOCK_D, causal)."""
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    items = []
    for name, dtype, precision, block_d in table_keys(arch, block_ds):
        try:
            config = configs.default_config(name, dtypes[dtype], precision, block_d, arch)
        except ValueError:  # no tile fits this GPU at all: it refuses with a clear error
            continue
        items.append((name, dtype, block_d, precision, tuple(sorted(config.kwargs.items())),
                      config.num_warps, config.num_stages))
    return items


def triton_release():
    """Triton's release as (major, minor, patch), from ``triton.__version__`` (no local suffix)."""
    return tuple(int(part) for part in re.findall(r"\d+", triton.__version__.split("+")[0])[:3])


def problem(arch, item, spill, smem, head_dim=None):
    """What is wrong with a compiled :func:`choosable` item (at ``head_dim``, default BLOCK_D) on
    ``arch``, or None: too much shared memory; spills beyond ``defaults.SPILLS`` (or spills it could
    not read), under a release in ``defaults.TRITONS`` (another allocates registers its own way: its
    spills are shown, not failed)."""
    from ..gpu.defaults import SPILLS, TRITONS

    if smem > arch.smem_per_block:
        return f"needs {smem} bytes of shared memory, more than the {arch.smem_per_block} a block may use"
    release = ".".join(map(str, triton_release()))
    known = SPILLS.get(release, {}).get((arch.capability, *item[:2], item[3], head_dim or item[2]), 0)
    if (spill < 0 or spill > known) and release in TRITONS:
        return f"spills {spill} bytes per thread" + (f" (at most {known} expected)" if known else "")
    return None


def check(arch, item, head_dims=None):
    """Compile one :func:`choosable` item for ``arch``: ``(registers, spilled bytes, shared memory
    bytes, problem or None)``; ``head_dims`` (``configs.head_dims``) default: HEAD_DIM = BLOCK_D."""
    name, dtype, block_d, precision, tiles, num_warps, num_stages = item
    constexprs = dict(tiles, **(head_dims or dict(HEAD_DIM=block_d, BLOCK_D=block_d)))
    if name != "bwd_preprocess":
        constexprs.update(IS_CAUSAL=True, DOT_PRECISION=precision)
    kernel = compile_kernel(name, dtype, constexprs, num_warps=num_warps, num_stages=num_stages,
                            target=target(arch.capability))
    regs, spill, smem = resources(kernel)
    return regs, spill, smem, problem(arch, item, spill, smem, (head_dims or {}).get("HEAD_DIM"))


def head_dim_v_report(head_dim=192, head_dim_v=128):
    """The attention kernels with v's head dim apart from q's (default DeepSeek's MLA, 192/128)
    compiled for every architecture with the tiles they run with there (the defaults of the wider
    padded head dim, ``configs.tile_block_d``): one dict per architecture, kernel, dtype and dot
    precision with registers, spills, shared memory and :func:`check`'s problem. The Delta kernel
    has v's head dim alone, a default of its own. Run it through :func:`in_child`."""
    dims = configs.head_dims(head_dim, head_dim_v)
    rows = []
    for capability, arch in archs.ARCHS.items():
        for item in choosable(arch, (configs.tile_block_d(dims),)):
            if item[0] != "bwd_preprocess":
                registers, spilled, smem, problem = check(arch, item, dims)
                rows.append(dict(arch=capability, kernel=item[0], dtype=item[1], precision=item[3],
                                 registers=registers, spilled=spilled, smem=smem, problem=problem))
    return rows
