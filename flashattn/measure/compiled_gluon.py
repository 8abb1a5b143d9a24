"""The Gluon kernels for Hopper (``flashattn.hopper.forward``, ``flashattn.hopper.backward``)
compiled for sm_90 on any machine, without a GPU, and what the compiler made of them.

Gluon has no interpreter: compiling is the only check these kernels get where there is no H100 or
H200. :func:`gluon_report` compiles a kernel for every (head dim, dtype, masking, configuration)
asked for, as a launch would, and returns ``flashattn.measure.compiled.facts`` for each, plus the
notes ptxas prints about the scheduling (:func:`ptxas_notes`). Like ``compiled``, it runs where
flashattn defined its kernels for the compiler: through ``compiled.in_child``, e.g.
``in_child("flashattn.measure.compiled_gluon:gluon_report", kernel="bwd")``.
"""
import functools
import os
import re
import subprocess
import tempfile

import triton

from ..kernels.tiles import DROP_TILE
from .compiled import SM90, TORCH_DTYPES, CannotCompile, facts, sass_instructions


def _gluon(module):
    """``flashattn.hopper.<module>`` ("forward" or "backward"), a Gluon kernel module;
    CannotCompile where Triton has no Gluon."""
    import importlib

    try:
        return importlib.import_module(f"flashattn.hopper.{module}")
    except ImportError as error:
        raise CannotCompile(f"no Gluon compiler here: {error}") from error


def compile_gluon(fn, signature, constexprs, aligned=(), **options):
    """Compile the @gluon.jit ``fn`` for sm_90: ``signature`` maps each run-time argument to its
    type ("*fp32", "i32", "fp32", "tensordesc<...>"), ``constexprs`` gives the compile-time ones;
    ``aligned`` names the arguments Triton may assume divisible by 16."""
    try:
        from triton.experimental.gluon._runtime import GluonASTSource
    except ImportError as error:
        raise CannotCompile(f"no Gluon compiler here: {error}") from error
    sig = dict(signature, **{name: "constexpr" for name in constexprs})
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return triton.compile(GluonASTSource(fn, sig, constexprs, attrs), target=SM90, options=options)


def _descriptor_type(module, dtype, rows, head_dim):
    """The signature type of a TMA descriptor argument, as ``module.descriptor`` builds it."""
    block = [1, 1, rows, head_dim]
    layout = module.block_layout(block, TORCH_DTYPES[dtype])
    return f"tensordesc<{dtype}{block},{layout!r}>"


#: The score modifications a Gluon kernel may be compiled with (``mods`` below): their constexprs.
MODS = {"softcap": "SOFTCAP", "alibi": "ALIBI", "window": "WINDOW", "dropout": "DROPOUT"}
#: The backward's, which also reads a key-padding mask.
BACKWARD_MODS = dict(MODS, key_mask="KEY_MASK")
#: The run-time arguments the modifications add to both kernels' signatures.
MOD_SIGNATURE = dict(win_left="i32", win_right="i32", shift="i32", softcap="fp32", Slopes="*fp32",
                     stride_sb="i32", stride_sh="i32", seed="i32", p_drop="fp32")
#: And to the backward's: the key-padding mask.
KEY_MASK_SIGNATURE = dict(KeyMask="*u8", stride_mkb="i32", stride_mkk="i32")


def _mod_constexprs(mods, known=MODS):
    unknown = set(mods) - set(known)
    if unknown:
        raise ValueError(f"mods: unknown {sorted(unknown)}; expected some of {sorted(known)}")
    flags = {flag: name in mods for name, flag in known.items()}
    flags["DROPOUT"] = DROP_TILE if flags["DROPOUT"] else 0  # how a launch passes it
    return flags


def compile_hopper_forward(head_dim, dtype, causal, config=None, window=False, mods=()):
    """The Gluon forward (``flashattn.hopper.forward``) compiled for ``dtype`` ("fp16", "bf16"), head dim,
    masking (``window``: a sliding window, which takes the masked configuration), score
    modifications (``mods``, names of :data:`MODS`) and ``config`` (overrides of
    ``hopper.tile_config``) as a launch compiles it."""
    hopper = _gluon("forward")
    window = window or "window" in mods
    cfg = hopper.tile_config(head_dim, causal or window, config, modified=bool(mods) or window)
    regs, options = hopper.launch_options(cfg)
    q, kv = (_descriptor_type(hopper, dtype, rows, head_dim) for rows in (cfg["BLOCK_M"], cfg["BLOCK_N"]))
    signature = dict(desc_q=q, desc_k=kv, desc_v=kv, desc_o=q, LSE="*fp32", n_heads="i32",
                     n_q="i32", n_kv="i32", qk_scale="fp32", n_group="i32", **MOD_SIGNATURE)
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                      STAGES=cfg["STAGES"], IS_CAUSAL=bool(causal) and not window,
                      PINGPONG=bool(cfg["PINGPONG"]), CONSUMERS=cfg["CONSUMERS"], EXP2_FMA=cfg["EXP2_FMA"],
                      TRIM=bool(cfg["TRIM"]),
                      TANH_APPROX=bool(cfg.get("TANH_APPROX", hopper.TANH_APPROX)),
                      **dict(_mod_constexprs(mods), WINDOW=bool(window)), **regs)
    return compile_gluon(hopper.attn_fwd_sm90, signature, constexprs, aligned=["LSE"], **options)


def compile_hopper_backward(head_dim, dtype, causal, config=None, dq=False, mods=()):
    """The Gluon backward kernel (``flashattn.hopper.backward``) compiled as a launch compiles it:
    dK/dV only, or with ``dq`` its variant that adds dQ too (TMA reduce-adds, Triton >= 3.8);
    ``mods`` as :func:`compile_hopper_forward` takes them."""
    bwd = _gluon("backward")
    if dq and not bwd.has_dq_reduce():
        raise CannotCompile(f"Triton {triton.__version__}'s Gluon has no TMA reduce-add (tma.async_atomic_add)")
    cfg = bwd.dq_config(head_dim, config, modified=bool(set(mods) - {"key_mask"})) if dq \
        else bwd.tile_config(head_dim, config)
    regs, options = bwd.launch_options(cfg)
    q, kv = (_descriptor_type(bwd, dtype, rows, head_dim) for rows in (cfg["BLOCK_M"], cfg["BLOCK_N"]))
    signature = dict(desc_q=q, desc_do=q, desc_k=kv, desc_v=kv, desc_dk=kv, desc_dv=kv, desc_dq="constexpr",
                     LSE="*fp32", Delta="*fp32", n_heads="i32", n_group="i32", n_q="i32", n_kv="i32",
                     scale="fp32", qk_scale="fp32", **MOD_SIGNATURE, **KEY_MASK_SIGNATURE, head_split="i32")
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                      STAGES=cfg["STAGES"], IS_CAUSAL=bool(causal) and "window" not in mods, DQ=bool(dq),
                      PREFETCH=cfg["PREFETCH"], desc_dq=None,
                      TANH_APPROX=bool(cfg.get("TANH_APPROX", bwd.hopper_forward.TANH_APPROX)),
                      **_mod_constexprs(mods, BACKWARD_MODS),
                      **regs)
    if dq:
        block = bwd.dq_block(cfg["BLOCK_M"], head_dim)
        layout = bwd.gl.NVMMASharedLayout.get_default_for(block, bwd.gl.float32)
        signature["desc_dq"] = f"tensordesc<fp32{block},{layout!r}>"
        del constexprs["desc_dq"]
    return compile_gluon(bwd.attn_bwd_sm90, signature, constexprs, aligned=["LSE", "Delta"], **options)


def gluon_report(kernel="fwd", head_dims=(64, 128), dtypes=("fp16", "bf16"), causal=(False, True),
                 configs=(None,), mods=(), instructions=False):
    """Compile a Gluon kernel ("fwd" or "bwd") for every combination and return one dict per
    compilation: its settings and :func:`facts` (with ``instructions``, its SASS instruction count
    too), or ``error``. ``causal`` may hold "window" for the forward: its sliding-window variant;
    ``mods`` (names of :data:`MODS`) apply to every one. CannotCompile when the first one fails
    in the assembler (this machine lacks ptxas), so callers can tell the two apart."""
    compile_one = {"fwd": functools.partial(compile_hopper_forward, mods=mods),
                   "bwd": functools.partial(compile_hopper_backward, mods=mods),
                   "bwd_dq": functools.partial(compile_hopper_backward, dq=True, mods=mods)}[kernel]
    rows = []
    for head_dim in head_dims:
        for dtype in dtypes:
            for is_causal in causal:
                for config in configs:
                    row = dict(kernel=kernel, head_dim=head_dim, dtype=dtype, causal=bool(is_causal),
                               config=config or {}, mods=list(mods))
                    try:
                        if is_causal == "window":  # the forward's sliding window (masked tiles)
                            row["causal"] = "window"
                            binary = compile_hopper_forward(head_dim, dtype, True, config, window=True, mods=mods)
                        else:
                            binary = compile_one(head_dim, dtype, is_causal, config)
                        row.update(facts(binary), ptxas_notes=ptxas_notes(binary))
                        if instructions:
                            row["instructions"] = sass_instructions(binary)
                    except CannotCompile:
                        raise
                    except Exception as error:  # report and go on: one configuration cannot hide others
                        if not rows and "ptxas" in str(error).lower():
                            raise CannotCompile(f"cannot compile for sm_90 here: {str(error)[:200]}")
                        text = str(error)  # a compile error ends with its cause, after the source
                        text = text if len(text) <= 900 else f"{text[:300]} ... {text[-600:]}"
                        row["error"] = f"{type(error).__name__}: {text}"
                    rows.append(row)
    return rows


def ptxas_notes(compiled):
    """The performance notes ptxas prints for a compiled kernel's PTX (``-v``), such as C7517, a
    ``wgmma.wait_group`` it had to inject because registers an asynchronous wgmma still uses were
    read or written: a wait the kernel did not ask for, which serialises matmuls meant to overlap.
    An empty list where this Triton ships no ptxas that reads its PTX."""
    binaries = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        with open(path, "w") as f:
            f.write(compiled.asm["ptx"])
        for name in ("ptxas-blackwell", "ptxas"):  # Triton >= 3.8 writes PTX that only the first reads
            ptxas = os.path.join(binaries, name)
            if not os.path.exists(ptxas):
                continue
            out = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull],
                                 capture_output=True, text=True)
            if out.returncode == 0:
                return re.findall(r"\((C7\d+)\) ([^\n]*)", out.stdout + out.stderr)
    return []


def gluon_reports(jobs):
    """:func:`gluon_report` for each dict of arguments in ``jobs``, one list of rows: several
    reports from one child process."""
    return [row for job in jobs for row in gluon_report(**job)]
