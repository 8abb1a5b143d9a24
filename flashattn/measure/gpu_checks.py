"""Checks of the Hopper paths on a GPU, each group in a child process that is watched.

A wrong mbarrier phase in a Gluon kernel does not raise an error, it deadlocks the GPU; an illegal
memory access poisons the CUDA context, and every later call in that process fails with it. So
the checks never run in the process that asks for them: :func:`run_job` starts a child
(``python -m flashattn.measure.gpu_checks JOB ...``), reads its lines, kills it when it prints nothing for
a while (the case it was running is reported as HANG), and after a crash or a hang starts it again
without the cases already reported. ``tests/test_hopper.py`` and ``tools/hopper_check.py`` use it.

A child prints ``START <case>`` before each case and ``ok <case>: ...`` or ``FAIL <case>: ...``
after it; after a CUDA error it exits at once, so that the next case gets a fresh context.

Jobs:

  gluon      the Gluon kernels through flashattn.attention (forward, and for most shapes the
             backward, whose dK/dV is Gluon too) against float64 under flashattn.testing.rule's rule,
             with counters proving the Gluon kernels ran: one (dtype, head dim, causal) group.
  variants   each Gluon variant (forward, and dK/dV) of one head dim and dtype, under the rule.
  fp32       float32 over the test grid at one matmul precision, through flashattn.attention with
             each kernel's first candidate, forward and backward, under the rule.
  configs    float32 at one precision and head dim: every candidate of every kernel (and the
             configurations ``configs.fits`` excludes for a compiler fault) launched explicitly on
             one ragged causal shape, each a case of its own.
"""
import argparse
import os
import queue
import signal
import subprocess
import sys
import threading
import time

DTYPES = ("fp16", "bf16")
HEAD_DIMS = (64, 128)
#: (name, B, H, N_q, N_kv, layout, backward, magnitude): the Gluon kernels' correctness grid.
SHAPES = [
    ("1x1", 1, 2, 1, 1, "bhnd", False, 1.0),
    ("17x17", 2, 3, 17, 17, "bhnd", True, 1.0),
    ("128x128", 2, 3, 128, 128, "bhnd", True, 1.0),
    ("1000x1000", 2, 3, 1000, 1000, "bhnd", True, 1.0),
    ("4103x4103", 1, 2, 4103, 4103, "bhnd", True, 1.0),
    ("17x1000", 2, 3, 17, 1000, "bhnd", True, 1.0),
    ("1000x17", 2, 3, 1000, 17, "bhnd", True, 1.0),
    ("4103x1000", 1, 2, 4103, 1000, "bhnd", True, 1.0),
    ("1000x4103", 1, 2, 1000, 4103, "bhnd", True, 1.0),
    ("1000x1000-bnhd", 2, 3, 1000, 1000, "bnhd", True, 1.0),
    ("200x333-bnhd", 2, 3, 200, 333, "bnhd", True, 1.0),
    ("1000x1000-big", 1, 2, 1000, 1000, "bhnd", True, 6.0),
]
#: Gluon forward variants (overrides of hopper.tile_config) checked here and timed by
#: tools/hopper_check.py. Head dim 64, whose default has three consumer warpgroups (192 query
#: rows; 128 registers at launch, 160 per consumer after setmaxnreg): ping-pong, 2 stages, the
#: two consumers it had before (alone, with ping-pong, and with exponentials partly on the FMA
#: units, which spill with three), and every consumer walking every tile (TRIM off). Head
#: dim 128: the defaults of the other masking mode and ping-pong off, so that every default keeps
#: being compared with its neighbours.
VARIANTS = {
    64: [dict(PINGPONG=True), dict(STAGES=2), dict(CONSUMERS=2), dict(CONSUMERS=2, PINGPONG=True),
         dict(CONSUMERS=2, EXP2_FMA=4), dict(TRIM=False)],
    128: [dict(PINGPONG=False), dict(STAGES=2), dict(STAGES=3)],
}
#: Gluon dK/dV variants (overrides of hopper_backward.tile_config): a third stage, and the other
#: query tile (at head dim 128, 64 queries spill a few bytes; tools/compile_hopper.py shows them).
BWD_VARIANTS = {64: [dict(STAGES=3), dict(BLOCK_M=32)], 128: [dict(STAGES=3), dict(BLOCK_M=64)]}
#: (name, B, H_q, H_kv, N_q, N_kv, layout, magnitude, flashattn.attention's arguments): the Gluon
#: kernels' score modifications. A softcap of 3 bends scores of unit inputs (30 would hardly
#: touch them); ALiBi's slopes are per head or per (batch, head); windows one- and two-sided;
#: the bottom-right alignment with fewer queries than keys (every query block sees keys: Gluon)
#: and with more (the first blocks see none: the forward falls back to Triton, the backward not);
#: dropout alone and with everything else (its reference is handed the mask the call drew; with 8
#: query heads a K/V head, the fused backward's walk split, ``hopper.backward.head_split``);
#: key-padding masks (``key_mask``: the fused backward reads them, the forward is Triton's): right
#: padding with a sequence of no key, left padding under the causal mask (the first queries see
#: nothing), random keys kept (one row for every batch, or one per batch), with the rest.
MOD_SHAPES = [
    ("softcap", 2, 3, 3, 1000, 1000, "bhnd", 1.0, dict(softcap=3.0)),
    ("softcap-causal", 2, 3, 3, 1000, 1000, "bhnd", 1.0, dict(softcap=3.0, is_causal=True)),
    ("softcap-big", 1, 2, 2, 1000, 1000, "bhnd", 6.0, dict(softcap=20.0, is_causal=True)),
    ("alibi", 2, 3, 3, 1000, 1000, "bhnd", 1.0, dict(alibi="heads")),
    ("alibi-causal-long", 1, 2, 2, 4103, 4103, "bhnd", 1.0, dict(alibi="rows", is_causal=True)),
    ("alibi-1x1", 1, 2, 2, 1, 1, "bhnd", 1.0, dict(alibi="heads")),
    ("window", 2, 3, 3, 1000, 1000, "bhnd", 1.0, dict(window_size=(200, 100))),
    ("window-causal", 2, 3, 3, 1000, 1000, "bhnd", 1.0, dict(window_size=(257, -1), is_causal=True)),
    ("window-right", 2, 3, 3, 1000, 1000, "bhnd", 1.0, dict(window_size=(-1, 50))),
    ("window-17", 2, 3, 3, 17, 17, "bhnd", 1.0, dict(window_size=(3, 5))),
    ("bottom-right", 2, 3, 3, 333, 1000, "bhnd", 1.0, dict(is_causal=True, causal_alignment="bottom_right")),
    ("bottom-right-more-q", 2, 3, 3, 1000, 333, "bhnd", 1.0, dict(is_causal=True, causal_alignment="bottom_right")),
    ("bottom-right-window", 2, 3, 3, 200, 1000, "bhnd", 1.0,
     dict(window_size=(100, -1), is_causal=True, causal_alignment="bottom_right")),
    ("all-gqa", 2, 6, 2, 777, 777, "bnhd", 1.0,
     dict(softcap=3.0, alibi="heads", window_size=(300, 20), enable_gqa=True)),
    ("all-17", 2, 3, 3, 17, 17, "bhnd", 1.0, dict(softcap=3.0, alibi="rows", is_causal=True)),
    ("alibi-bottom-right", 2, 3, 3, 333, 1000, "bhnd", 1.0,
     dict(alibi="rows", is_causal=True, causal_alignment="bottom_right")),
    ("alibi-fewer-q", 2, 3, 3, 333, 1000, "bhnd", 1.0, dict(alibi="heads", is_causal=True)),
    ("alibi-window-bottom-right", 2, 3, 3, 200, 1000, "bhnd", 1.0,
     dict(alibi="heads", window_size=(100, 30), causal_alignment="bottom_right")),
    ("dropout", 2, 3, 3, 1000, 1000, "bhnd", 1.0, dict(dropout_p=0.17)),
    ("dropout-causal", 2, 3, 3, 1000, 1000, "bhnd", 1.0, dict(dropout_p=0.1, is_causal=True)),
    ("dropout-gqa-long", 1, 4, 2, 4103, 4103, "bnhd", 1.0, dict(dropout_p=0.3, is_causal=True, enable_gqa=True)),
    ("dropout-all-gqa8", 1, 16, 2, 300, 300, "bnhd", 1.0,
     dict(dropout_p=0.2, softcap=3.0, alibi="heads", window_size=(100, 30), enable_gqa=True)),
    ("dropout-17", 2, 3, 3, 17, 17, "bhnd", 1.0, dict(dropout_p=0.5)),
    ("dropout-all", 2, 3, 3, 333, 1000, "bhnd", 1.0,
     dict(dropout_p=0.2, softcap=3.0, alibi="heads", window_size=(100, 30), causal_alignment="bottom_right")),
    ("key-lengths", 3, 3, 3, 1000, 1000, "bhnd", 1.0, dict(key_mask="lengths")),
    ("key-lengths-causal", 3, 3, 3, 1000, 1000, "bhnd", 1.0, dict(key_mask="lengths", is_causal=True)),
    ("key-left-gqa-causal", 3, 4, 2, 777, 777, "bnhd", 1.0, dict(key_mask="left", is_causal=True, enable_gqa=True)),
    ("key-random", 2, 3, 3, 1000, 1000, "bhnd", 1.0, dict(key_mask="random")),
    ("key-one-row-long", 2, 2, 2, 4103, 4103, "bhnd", 1.0, dict(key_mask="one-row", is_causal=True)),
    ("key-17", 2, 3, 3, 17, 17, "bhnd", 1.0, dict(key_mask="random")),
    ("key-all", 2, 3, 3, 333, 1000, "bhnd", 1.0,
     dict(key_mask="random", dropout_p=0.2, softcap=3.0, alibi="heads", window_size=(100, 30),
          causal_alignment="bottom_right")),
]


def key_padding_mask(kind, batch, n_kv, g):
    """A bool key-padding mask (B or 1, 1, 1, N_kv) for MOD_SHAPES' ``key_mask``: "lengths" keeps
    the first N, 0.6 N and 0 keys of three sequences, "left" hides the first 0, 0.3 N and N - 1
    keys, "random" keeps each key with probability 0.7 and "one-row" the same for every batch."""
    import torch

    cols = torch.arange(n_kv, device="cuda")
    if kind == "lengths":
        keep = cols[None, :] < torch.tensor([n_kv, n_kv * 3 // 5, 0], device="cuda")[:batch, None]
    elif kind == "left":
        keep = cols[None, :] >= torch.tensor([0, n_kv * 3 // 10, n_kv - 1], device="cuda")[:batch, None]
    else:
        keep = torch.rand(1 if kind == "one-row" else batch, n_kv, generator=g, device="cuda") < 0.7
    return keep.reshape(keep.shape[0], 1, 1, n_kv)


#: The float32 grid: the lengths of tests/test_attention.py (odd, equal and not), head dims that
#: are not powers of two, large magnitudes, scales, a transposed layout, and longer sequences.
FP32_LENGTHS = [(1, 1), (17, 17), (69, 69), (113, 113), (128, 128), (200, 200), (17, 113), (113, 17)]


def gluon_cases(dtype, head_dim, causal):
    return [f"gluon-{dtype}-d{head_dim}-{'causal' if causal else 'full'}-{s[0]}" for s in SHAPES]


def gluon_mod_cases(dtype, head_dim):
    return [f"gluon-mods-{dtype}-d{head_dim}-{s[0]}" for s in MOD_SHAPES]


def fp32_cases():
    """(name, n_q, n_kv, head_dim, causal, magnitude, scale, layout) of the float32 grid."""
    cases = []
    for n_q, n_kv in FP32_LENGTHS:
        for causal in (False, True):
            cases.append((f"len{n_q}x{n_kv}", n_q, n_kv, 64, causal, 1.0, None, "bhnd"))
    for d in (16, 40, 128):
        for causal in (False, True):
            cases.append((f"hd{d}", 69, 69, d, causal, 1.0, None, "bhnd"))
    for d in (1, 3, 24, 96, 200, 256):
        cases.append((f"hd{d}", 33, 40, d, True, 1.0, None, "bhnd"))
    for causal in (False, True):
        cases.append(("113x69", 113, 69, 64, causal, 1.0, None, "bhnd"))
        cases.append(("big", 113, 113, 64, causal, 6.0, None, "bhnd"))
    for scale in (0.05, 1.0, 3.0):
        cases.append((f"scale{scale}", 69, 50, 32, True, 1.0, scale, "bhnd"))
    cases.append(("bnhd", 69, 69, 40, True, 1.0, None, "bnhd"))
    for n in (1000, 2048):
        for d in (64, 128):
            cases.append((f"long{n}-hd{d}", n, n, d, True, 1.0, None, "bhnd"))
    return cases


# ---------------------------------------------------------------------------- children


def make(b, h, n, d, layout, dtype, magnitude, gen, device="cuda"):
    """A random (B, H, N, D) tensor; "bnhd" gives a (B, N, H, D) tensor seen as (B, H, N, D)."""
    import torch
    if layout == "bnhd":
        t = torch.randn(b, n, h, d, generator=gen, device=device).transpose(1, 2)
    else:
        t = torch.randn(b, h, n, d, generator=gen, device=device)
    return (t * magnitude).to(dtype)


def verdict(cid, checks, extra=""):
    """Print one line for a case: ok/FAIL, the worst error/bound ratio, each quantity's."""
    ok = all(c.ok for c in checks)
    worst = max(c.error / c.bound for c in checks)
    detail = "; ".join(f"{c.name} {c.error:.2e}/{c.bound:.2e}" for c in checks)
    print(f"{'ok' if ok else 'FAIL'} {cid}: worst={worst:.2f} error/bound {detail}{extra}", flush=True)


def fail(cid, error):
    """Report a failed case; after a CUDA error the context is unusable, so exit and let the
    parent start a fresh child after this case."""
    print(f"FAIL {cid}: {type(error).__name__}: {str(error)[:300]}", flush=True)
    if "CUDA" in str(error) or "cuda" in type(error).__name__.lower():
        sys.stdout.flush()
        os._exit(3)


def _count_calls(module, name, calls):
    """Make ``module.name`` append to ``calls`` each time it runs; returns the original."""
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    setattr(module, name, counted)
    return original


def child_gluon(args):
    """Each case of one (dtype, head dim, causal) group through flashattn.attention, with counters
    proving the Gluon kernels ran, and the Gluon results next to the Triton kernels' own."""
    import torch
    from ..hopper import backward as hopper_backward, forward as hopper
    from ..kernels import backward, forward
    from ..ops import dispatch
    from ..testing.rule import compare_with_reference

    os.environ["FLASHATTN_AUTOTUNE"] = "0"  # the Triton kernels' first candidates: fewer compilations
    dtype = getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[args.dtype])
    calls = []
    fwd = _count_calls(hopper, "attention_forward", calls)
    dkdv = _count_calls(hopper_backward, "attention_backward_dkdv", calls)
    _count_calls(hopper_backward, "attention_backward", calls)  # the fused backward (Triton >= 3.8)
    causal, d, scale = bool(args.causal), args.head_dim, args.head_dim ** -0.5
    for cid, (name, b, h, n_q, n_kv, layout, bwd, mag) in zip(gluon_cases(args.dtype, d, causal), SHAPES):
        if cid in args.skip:
            continue
        print(f"START {cid}", flush=True)
        try:
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k = (make(b, h, n, d, layout, dtype, mag, g) for n in (n_q, n_kv))
            v = make(b, h, n_kv, d, layout, dtype, 1.0, g)
            assert hopper.supports(q, k, v), "hopper.supports refused these inputs"
            calls.clear()
            checks = compare_with_reference(q, k, v, is_causal=causal, backward=bwd)
            torch.cuda.synchronize()
            assert "attention_forward" in calls, "flashattn.attention did not call the Gluon forward"
            # The backward takes the fused Gluon kernel where Triton has TMA reduce-adds, else the
            # Gluon dK/dV only at dispatch.GLUON_DKDV_HEAD_DIMS (compared with the Triton kernel's
            # below at every head dim).
            kernel = "attention_backward" if hopper_backward.has_dq_reduce() else "attention_backward_dkdv"
            wanted = bwd and (kernel == "attention_backward" or d in dispatch.GLUON_DKDV_HEAD_DIMS)
            assert (kernel in calls) == wanted, (
                f"the backward {'did not call' if wanted else 'called'} the Gluon {kernel} at head dim {d}")
            # The Gluon results next to the Triton kernels' (FLASHATTN_GLUON=0 turns Gluon off).
            o, lse2 = fwd(q, k, v, causal, scale)
            os.environ["FLASHATTN_GLUON"] = "0"
            o_triton, _ = forward.attention_forward(q, k, v, causal, scale)
            extra = f"; |gluon-triton| out {(o.float() - o_triton.float()).abs().max().item():.2e}"
            if bwd:
                do = torch.randn(o.shape, generator=g, device="cuda").to(dtype)
                _, dk_t, dv_t = backward.attention_backward(q, k, v, o, lse2, do, causal, scale)
                delta = (o.float() * do.float()).sum(-1)
                dk, dv = dkdv(q, k, v, do, lse2, delta, causal, scale)
                extra += (f" dk {(dk.float() - dk_t.float()).abs().max().item():.2e}"
                          f" dv {(dv.float() - dv_t.float()).abs().max().item():.2e}")
            os.environ.pop("FLASHATTN_GLUON")
            verdict(cid, checks, extra)
        except Exception as e:
            os.environ.pop("FLASHATTN_GLUON", None)
            fail(cid, e)


def child_gluon_mods(args):
    """Each case of MOD_SHAPES for one dtype and head dim through flashattn.attention against
    float64 under the rule, forward and backward, with counters proving which kernels ran: the
    Gluon forward wherever ``hopper.supports`` takes the call (never with a mask), the Gluon
    backward always (with a mask, the fused one only).
    ``--tanh-approx`` chooses the softcap's tanh (``hopper.forward.TANH_APPROX``);
    ``--deterministic 1`` asks for the backward without dQ's reduce-adds; ``--only`` runs the
    cases whose name holds one of its parts."""
    import functools

    import torch
    from .. import attention, hopper as hopper_package
    from ..hopper import backward as hopper_backward, forward as hopper
    from ..ops import dispatch
    from ..ops.modifiers import score_mods
    from ..testing.reference import naive_attention
    from ..testing.rule import compare_with_reference

    os.environ["FLASHATTN_AUTOTUNE"] = "0"
    hopper_package.FUSED_KEY_MASKS = True  # the key-mask cases check the fused backward's KEY_MASK
    if args.tanh_approx is not None:  # the softcap's tanh: the special-function unit's, or exact
        hopper.TANH_APPROX = bool(args.tanh_approx)  # read by the forward and both backward kernels
    if args.deterministic:  # the backward without dQ's reduce-adds (Gluon dK/dV + Triton dQ)
        torch.use_deterministic_algorithms(True)
    dtype = getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[args.dtype])
    calls = []
    _count_calls(hopper, "attention_forward", calls)
    _count_calls(hopper_backward, "attention_backward_dkdv", calls)
    _count_calls(hopper_backward, "attention_backward", calls)
    d = args.head_dim
    for cid, (name, b, h, h_kv, n_q, n_kv, layout, mag, kw) in zip(gluon_mod_cases(args.dtype, d), MOD_SHAPES):
        if cid in args.skip or (args.only and not any(part in name for part in args.only)):
            continue
        print(f"START {cid}", flush=True)
        try:
            g = torch.Generator(device="cuda").manual_seed(0)
            q = make(b, h, n_q, d, layout, dtype, mag, g)
            k = make(b, h_kv, n_kv, d, layout, dtype, mag, g)
            v = make(b, h_kv, n_kv, d, layout, dtype, 1.0, g)
            kw = dict(kw)
            if "alibi" in kw:  # per head, or per (batch, head)
                rows = kw.pop("alibi")
                kw["alibi_slopes"] = torch.rand((h,) if rows == "heads" else (b, h), generator=g, device="cuda")
            if "key_mask" in kw:
                kw["attn_mask"] = key_padding_mask(kw.pop("key_mask"), b, n_kv, g)
            causal = kw.pop("is_causal", False)
            mods = score_mods(q, k, kw.get("attn_mask"), kw.get("dropout_p", 0.0), causal,
                              kw.get("causal_alignment", "top_left"), kw.get("softcap", 0.0), kw.get("alibi_slopes"),
                              b, h)  # as flashattn.attention
            call = dispatch.gluon_call(q, k, v, causal, kw.get("window_size", (-1, -1)), None, mods)
            gluon_fwd = call is not None and hopper.supports(q, k, v, window=call["window"]) and not (
                call["softcap"] > 0 and not hopper.TANH_APPROX)  # dispatch's exact softcap: Triton
            ref_kw = dict(kw)
            if "dropout_p" in kw:  # the reference takes the pairs the call drops (its seed: drawn again)
                torch.manual_seed(5)
                ref_kw["dropout_keep"] = attention(q, k, v, is_causal=causal, return_dropout_mask=True, **kw)[1]
                torch.manual_seed(5)
            calls.clear()
            checks = compare_with_reference(q, k, v, is_causal=causal, impl=functools.partial(attention, **kw),
                                            reference=functools.partial(naive_attention, **ref_kw))
            torch.cuda.synchronize()
            assert ("attention_forward" in calls) == gluon_fwd, (
                f"the Gluon forward {'did not run' if gluon_fwd else 'ran'}: {call}")
            fused = hopper_backward.has_dq_reduce() and not args.deterministic
            kernel = "attention_backward" if fused else "attention_backward_dkdv"
            wanted = fused or (d in dispatch.GLUON_DKDV_HEAD_DIMS and "attn_mask" not in kw)
            assert (kernel in calls) == wanted, f"the backward {'did not call' if wanted else 'called'} {kernel}"
            verdict(cid, checks, f"; gluon forward {gluon_fwd}")
        except Exception as e:
            fail(cid, e)


def _references(q, k, v, do, causal, scale=None):
    """(float64, PyTorch in q's dtype) references of out, lse, dq, dk, dv, for judge(); the
    second on testing.baseline_inputs (rounded to TF32 where the kernels use TF32)."""
    import torch
    from ..testing import reference
    from ..testing.rule import baseline_inputs, ieee_float32

    refs = []
    for dtype, inputs in ((torch.float64, (q, k, v)), (q.dtype, baseline_inputs(q, k, v))):
        leaves = [x.detach().to(dtype).requires_grad_() for x in inputs]
        with ieee_float32():  # the baseline's TF32 is its inputs' rounding (testing.rule)
            out, lse = reference.naive_attention(*leaves, is_causal=causal, scale=scale)
            grads = torch.autograd.grad(out, leaves, do.to(dtype))
        refs.append(dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2]))
    return refs


def child_variants(args):
    """Each Gluon variant of one head dim and dtype against float64 under the rule: the forward
    variants (out, lse), and the dK/dV variants (dk, dv, after the default forward)."""
    import torch
    from ..hopper import forward as hopper, backward as hopper_backward
    from ..testing.rule import judge
    from ..kernels.tiles import LN2

    dtype = getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[args.dtype])
    d, scale = args.head_dim, args.head_dim ** -0.5
    g = torch.Generator(device="cuda").manual_seed(1)
    n_q, n_kv = 4103, 777
    q = make(2, 3, n_q, d, "bhnd", dtype, 1.0, g)
    k = make(2, 3, n_kv, d, "bnhd", dtype, 1.0, g)
    v = make(2, 3, n_kv, d, "bhnd", dtype, 1.0, g)
    do = make(2, 3, n_q, d, "bhnd", dtype, 1.0, g)
    cases = [("fwd", i, c, causal) for i, c in enumerate(VARIANTS[d]) for causal in (False, True)]
    cases += [("dkdv", i, c, causal) for i, c in enumerate(BWD_VARIANTS[d]) for causal in (False, True)]
    refs = {}
    for kind, i, cfg, causal in cases:
        cid = f"variant-d{d}-{i}-{args.dtype}-{int(causal)}" if kind == "fwd" else \
            f"dkdv-variant-d{d}-{i}-{args.dtype}-{int(causal)}"
        if cid in args.skip:
            continue
        print(f"START {cid} {cfg}", flush=True)
        try:
            if causal not in refs:
                refs[causal] = _references(q, k, v, do, causal)
            ref64, ref_pt = refs[causal]
            if kind == "fwd":
                o, lse2 = hopper.attention_forward(q, k, v, causal, scale, cfg)
                ours = dict(out=o, lse=lse2 * LN2)
            else:
                o, lse2 = hopper.attention_forward(q, k, v, causal, scale)
                delta = (o.float() * do.float()).sum(-1)
                dk, dv = hopper_backward.attention_backward_dkdv(q, k, v, do, lse2, delta, causal, scale, cfg)
                ours = dict(dk=dk, dv=dv)
            torch.cuda.synchronize()
            verdict(cid, judge(ours, ref64, ref_pt, dtype, do.abs().max().item()), f" {cfg}")
        except Exception as e:
            fail(f"{cid} {cfg}", e)


def child_fp32(args):
    """float32 at one matmul precision over the grid, forward and backward, under the rule."""
    import torch
    from ..gpu import configs
    from ..testing.rule import compare_with_reference

    os.environ["FLASHATTN_AUTOTUNE"] = "0"
    torch.set_float32_matmul_precision(args.precision)
    print(f"info precision {args.precision!r}: tl.dot input_precision "
          f"{configs.dot_precision(torch.float32)!r}", flush=True)
    # Split between children by causal, then in chunks of neighbouring head dims.
    cases = sorted((c for c in fp32_cases() if int(c[4]) == args.causal), key=lambda c: c[3])
    part, parts = map(int, args.part.split("/"))
    size = -(-len(cases) // parts)
    for name, n_q, n_kv, d, causal, mag, scale, layout in cases[part * size:(part + 1) * size]:
        cid = f"fp32-{args.precision}-{name}-{'causal' if causal else 'full'}"
        if cid in args.skip:
            continue
        print(f"START {cid}", flush=True)
        try:
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k = (make(1, 2, n, d, layout, torch.float32, mag, g) for n in (n_q, n_kv))
            v = make(1, 2, n_kv, d, layout, torch.float32, 1.0, g)
            verdict(cid, compare_with_reference(q, k, v, is_causal=causal, scale=scale))
        except Exception as e:
            fail(cid, e)


#: Configurations ``configs.fits`` excludes because of a compiler fault, launched on purpose by
#: the configs job (kernel, config, precision): the 3xTF32 fault, and the same tile with TF32 and
#: with 4 warps, to show which part of it matters.
PROBES = [("bwd_dkdv", dict(BLOCK_Q=16, BLOCK_KV=64, num_warps=8, num_stages=2), "tf32x3"),
          ("bwd_dkdv", dict(BLOCK_Q=16, BLOCK_KV=64, num_warps=8, num_stages=2), "tf32"),
          ("bwd_dkdv", dict(BLOCK_Q=16, BLOCK_KV=64, num_warps=4, num_stages=2), "tf32x3")]


def child_configs(args):
    """Every float32 candidate of one precision at one head dim, launched explicitly (the other
    kernels with their first candidates) on a ragged causal shape, judged under the rule."""
    import torch
    from ..gpu import configs
    from ..kernels.backward import attention_backward
    from ..kernels.forward import attention_forward
    from ..kernels.tiles import LN2
    from ..testing.rule import judge

    os.environ["FLASHATTN_AUTOTUNE"] = "0"
    torch.set_float32_matmul_precision(args.precision)
    precision = configs.dot_precision(torch.float32)
    d, n_q, n_kv = args.head_dim, 113, 241
    block_d = configs.block_d(d)
    jobs = [(name, dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages), "")
            for name in ("fwd", "bwd_dkdv", "bwd_dq") for c in configs.candidates(name, torch.float32, precision)
            if configs.fits(name, c, block_d, 4, precision)]
    jobs += [(name, cfg, " (excluded by configs.fits)") for name, cfg, p in PROBES if p == precision]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (make(1, 2, n, d, "bhnd", torch.float32, 1.0, g) for n in (n_q, n_kv, n_kv))
    do = make(1, 2, n_q, d, "bhnd", torch.float32, 1.0, g)
    ref64, ref_pt = _references(q, k, v, do, True)
    for name, cfg, note in jobs:
        cid = f"config-{args.precision}-d{d}-{name}-{cfg['BLOCK_Q']}x{cfg['BLOCK_KV']}w{cfg['num_warps']}s{cfg['num_stages']}"
        if cid in args.skip:
            continue
        print(f"START {cid}", flush=True)
        try:
            o, lse2 = attention_forward(q, k, v, True, d ** -0.5, config=cfg if name == "fwd" else None)
            dq, dk, dv = attention_backward(q, k, v, o, lse2, do, True, d ** -0.5,
                                            configs={name: cfg} if name != "fwd" else None)
            torch.cuda.synchronize()
            ours = dict(out=o, lse=lse2 * LN2, dq=dq, dk=dk, dv=dv)
            verdict(cid, judge(ours, ref64, ref_pt, torch.float32, do.abs().max().item()),
                    f" ({precision}){note}")
        except Exception as e:
            fail(cid + note, e)


CHILDREN = {"gluon": child_gluon, "gluon_mods": child_gluon_mods, "variants": child_variants, "fp32": child_fp32,
            "configs": child_configs}


# ---------------------------------------------------------------------------- the parent


def run_job(cmd, idle_timeout, deadline, max_restarts=3, cwd=None):
    """Run the child ``cmd`` (a list). A child that prints nothing for ``idle_timeout`` seconds is
    killed and its current case reported as HANG; a child that dies is reported with its exit
    status. Either way it is started again with ``--skip`` naming the cases already reported (at
    most ``max_restarts`` times). Returns (lines, {case id: 'ok' | 'FAIL' | 'HANG'})."""
    import flashattn

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(flashattn.__file__)),
                                                      env.get("PYTHONPATH")]))
    lines, status = [], {}
    for attempt in range(max_restarts + 1):
        argv = list(cmd) + (["--skip", ",".join(status)] if status else [])
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=cwd, env=env, start_new_session=True)
        out = queue.Queue()

        def read(stream=proc.stdout, out=out):
            for line in stream:
                out.put(line)
            out.put(None)

        threading.Thread(target=read, daemon=True).start()
        current, hung = None, False
        while True:
            try:
                line = out.get(timeout=max(1.0, min(idle_timeout, deadline - time.time())))
            except queue.Empty:
                hung = True
                break
            if line is None:
                break
            line = line.rstrip()
            if line.startswith("START "):
                current = line.split()[1]
                continue
            if line.startswith("info") and line in lines:
                continue
            lines.append(line)
            word, _, rest = line.partition(" ")
            if word in ("ok", "FAIL") and rest:
                status[rest.split(":")[0].split()[0]] = word
        if hung:
            os.killpg(proc.pid, signal.SIGKILL)  # the child's own process group, started above
            proc.wait()
            late = time.time() >= deadline
            lines.append(f"HANG {current or cmd[-1]}: " + ("out of time" if late else
                                                          f"no output for {idle_timeout:.0f} s") + "; killed")
            if current is None or late:
                break
            status.setdefault(current, "HANG")
            continue
        code = proc.wait()
        if code == 0:
            break
        if current not in status:  # died without a verdict (a crash, or an error before any case)
            lines.append(f"FAIL {' '.join(cmd[2:])}: child exited with status {code}"
                         + (f" during {current}" if current else ""))
        if current is None or time.time() >= deadline:
            break
        status.setdefault(current, "FAIL")
    return lines, status


def run_jobs(cmds, idle_timeout, deadline, workers=4):
    """:func:`run_job` for each command, ``workers`` children at a time (threads wait on them).
    Returns (lines in the commands' order, {case id: verdict} of them all)."""
    import concurrent.futures

    lines, status = [], {}
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for job_lines, job_status in pool.map(lambda cmd: run_job(cmd, idle_timeout, deadline), cmds):
            lines += job_lines
            status.update(job_status)
    return lines, status


def command(job, **options):
    """The command line of a child running ``job`` with ``options`` (--name value)."""
    argv = [sys.executable, "-m", "flashattn.measure.gpu_checks", job]
    for name, value in options.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job", choices=list(CHILDREN))
    p.add_argument("--dtype")
    p.add_argument("--precision")
    p.add_argument("--part", default="0/1")
    p.add_argument("--head-dim", type=int)
    p.add_argument("--causal", type=int, default=0)
    p.add_argument("--skip", default="")
    p.add_argument("--only", default="", help="gluon_mods: the cases whose name holds one of these (comma-separated)")
    p.add_argument("--tanh-approx", type=int, choices=(0, 1),
                   help="gluon_mods: the softcap's tanh (default: the kernels')")
    p.add_argument("--deterministic", type=int, choices=(0, 1), default=0,
                   help="gluon_mods: torch.use_deterministic_algorithms (no fused backward)")
    args = p.parse_args(argv)
    args.skip = set(filter(None, args.skip.split(",")))
    args.only = list(filter(None, args.only.split(",")))
    CHILDREN[args.job](args)


if __name__ == "__main__":
    main()
