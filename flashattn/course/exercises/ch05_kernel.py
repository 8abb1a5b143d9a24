"""Checkers of chapter 05's last two exercises: the whole forward kernel ``my_attn_fwd`` (the outer
program around the key loop) and its launcher ``my_attention_forward(q, k, v, is_causal=False,
scale=None) -> (o, lse2)``.

Both are judged against the float64 reference under the course's rule (``flashattn.testing.rule``)
on odd sizes: N_q = 19 and N_kv = 27, a head dim of 24 (padded to 32 inside the kernel),
non-contiguous inputs, causal and not. The inputs lie in larger buffers whose rows past N hold 0 and
whose columns past D hold NaN, so that a missing column mask shows as NaN and the missing row masks
behave like the loops of ``tiled_forward_with_mistake``, which name them. A wrong result that equals
a known mistake is named: the second stage without its mask, the scale or log2 e missing, the LSE
in the wrong base, strides assumed contiguous, a grid one block short, the wrong causal start.
"""
import ast
import inspect
import math
import textwrap
import warnings
from contextlib import contextmanager

import numpy as np
import torch
import triton

from ..notebook import pick
from ...gpu.runtime import DEVICE
from ...kernels.tiles import LN2, LOG2E
from ...kernels.traversal import kv_ranges
from ...testing.reference import naive_attention
from ...testing.rule import compare_with_reference
from .ch03_05 import tiled_forward_with_mistake
from .common import ExerciseError, attempt, close, expect_close, is_stub, launch_learner_kernel, passed

FORBID = ("flashattn", "softmax", "sdpa")
GPU_TOL = 5e-3  # on a GPU, tl.dot multiplies float32 tiles in TF32 unless told input_precision="ieee"
UNTOUCHED = -7.0
UNWRITTEN = 1234.5  # what O holds before the kernel runs: no attention output can equal it


def make_inputs(batch, heads, n_q, n_kv, d, layout, seed):
    """(q, k, v) on DEVICE, float32, (B, H, N, D) views: ``"contiguous"``; ``"bnhd"``, a
    (B, N, H, D) storage viewed through ``transpose(1, 2)``, with zeros outside the view;
    ``"strided_d"``, columns two elements apart, rows past N holding 0 and columns past D NaN
    (so that a missing column mask shows, and a column stride taken as 1 reads other numbers)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (n_q, n_kv, n_kv):
        values = torch.randn(batch, heads, n, d, generator=g)
        if layout == "contiguous":
            out.append(values.to(DEVICE))
            continue
        if layout == "bnhd":
            storage = torch.zeros(batch, n + 64, heads, d + 16)
            view = storage.to(DEVICE)[:, :n, :, :d].transpose(1, 2)
        else:
            storage = torch.zeros(batch, heads, n + 64, 2 * d + 32)
            storage[..., 2 * d:] = float("nan")
            view = storage.to(DEVICE)[:, :, :n, 0:2 * d:2]
        view.copy_(values)
        out.append(view)
    return out


def _output_buffer(batch, heads, n_q, d):
    """O as a (B, H, N_q, D) view holding UNWRITTEN, in a buffer whose other rows and columns hold
    UNTOUCHED (so a store outside O shows)."""
    buffer = torch.full((batch, heads, n_q + 64, d + 16), UNTOUCHED, device=DEVICE)
    view = buffer[:, :, :n_q, :d]
    view.fill_(UNWRITTEN)
    return view, buffer


def launch_my_attn_fwd(kernel, q, k, v, is_causal, scale, block_q, block_kv):
    """The course's launcher around a learner's ``my_attn_fwd``: grid (query blocks, heads, batch),
    every stride passed, ``qk_scale = scale * log2 e``. Returns ``(o, lse2, o's buffer)``."""
    batch, heads, n_q, d = q.shape
    o, buffer = _output_buffer(batch, heads, n_q, d)
    lse2 = torch.full((batch, heads, n_q), float("nan"), device=DEVICE)
    grid = (triton.cdiv(n_q, block_q), heads, batch)
    launch_learner_kernel(kernel, grid,
                          (q, k, v, o, lse2, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                           heads, n_q, k.shape[2], scale * LOG2E),
                          dict(HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_Q=block_q,
                               BLOCK_KV=block_kv, IS_CAUSAL=bool(is_causal)),
                          "my_attn_fwd", kernel, forbid=FORBID)
    return o, lse2, buffer


def _masked_attention(q, k, v, scale, visible):
    """Float64 attention with the (N_q, N_kv) boolean mask ``visible``; (out, natural lse)."""
    s = (q.double() @ k.double().transpose(-2, -1)) * scale
    s = s.masked_fill(~visible, float("-inf"))
    return torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)


def _late_start(n_q, n_kv, block_q, block_kv):
    """The causal mask of a kernel whose key loop starts at its own block's stage boundary instead
    of key 0: query i sees keys kv_full_end(its block) .. i."""
    i = torch.arange(n_q)[:, None]
    j = torch.arange(n_kv)[None, :]
    start = torch.tensor([kv_ranges(r // block_q * block_q, block_q, block_kv, n_kv, True)[0]
                          for r in range(n_q)])[:, None]
    return (j <= i) & (j >= start)


def _judge(o, lse_natural, q, k, v, is_causal, scale):
    """Whether (o, natural lse) pass: the rule on the interpreter, TF32's tolerance on a GPU."""
    if pick(cpu=False, gpu=True):
        o_ref, lse_ref = naive_attention(q.double(), k.double(), v.double(), is_causal=is_causal, scale=scale)
        return close(o, o_ref, GPU_TOL, GPU_TOL) and close(lse_natural, lse_ref, GPU_TOL, GPU_TOL)
    checks = compare_with_reference(q, k, v, is_causal=is_causal, scale=scale, backward=False,
                                    impl=lambda *a, **kw: (o, lse_natural))
    return all(c.ok for c in checks)


def _lse_hint(lse2, q, k, is_causal, scale, tol):
    """The name of a wrong base-2 LSE: natural log, or M + ln L; None if neither."""
    s = (q.double() @ k.double().transpose(-2, -1)) * scale * LOG2E
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    m = s.amax(-1)
    l_sum = torch.exp2(s - m[..., None]).sum(-1)
    got = lse2.detach().double().cpu()
    if close(got, (m + torch.log2(l_sum)) * LN2, tol, tol):
        return ("the LSE was stored in natural log; the kernels keep it in base 2: lse2 = m_i + "
                "tl.log2(l_i) (M is already in base-2 units, because qk_scale holds log2 e)")
    if close(got, m + torch.log(l_sum), tol, tol):
        return ("the LSE mixes two bases: M is in base 2 but tl.log(l_i) is natural; store m_i + tl.log2(l_i)")
    if close(got, m, tol, tol):
        return "the LSE is M alone: add log2(L), lse2 = m_i + tl.log2(l_i)"
    return None


# --- The whole forward kernel ----------------------------------------------------------------------

#: (B, H, N_q, N_kv, D, causal, layout, BLOCK_Q, BLOCK_KV): aligned first (a mistake shows alone
#: there), then ragged lengths, a padded head dim, non-contiguous and strided layouts.
KERNEL_CASES = [(1, 2, 32, 32, 32, True, "contiguous", 16, 16),
                (2, 3, 19, 27, 24, False, "bnhd", 16, 16),
                (2, 3, 19, 27, 24, True, "bnhd", 16, 16),
                (1, 2, 27, 19, 24, True, "strided_d", 16, 32)]

KERNEL_MISTAKES = {
    "causal": "the diagonal tiles were folded in without the causal mask: the second stage, "
              "[kv_full_end, kv_end), runs with MASKED=True (query i sees key j only if j <= i)",
    "ragged": "keys past N_kv were not hidden: the second stage must run with the mask (MASKED=True), "
              "and its mask hides keys j >= n_kv even when not causal",
    "alpha": "alpha is missing: when M grows, L and acc are rescaled by alpha = 2^(M_old - M_new)",
    "alpha_acc": "acc is not rescaled when M grows (L is): the output accumulated so far is relative to "
                 "the old max, so acc = acc * alpha[:, None] + P V, with alpha = 2^(M_old - M_new)",
    "alpha_l": "L is not rescaled when M grows (acc is): the sum so far is relative to the old max, so "
               "L = L * alpha + rowsum(P), with alpha = 2^(M_old - M_new)",
    "causal_off_by_one": "the causal mask is off by one: query i sees keys j <= i",
    "no_scale": "the scores were not multiplied by qk_scale: m_new = max(m_i, rowmax(s) * qk_scale), "
                "p = exp2(s * qk_scale - m_new)",
    "exp": "tl.exp was used where tl.exp2 belongs: qk_scale already holds log2 e",
    "per_tile": "each tile's probabilities were normalised on their own; divide by L once, at the end",
}


def check_my_attn_fwd(my_attn_fwd):
    """``my_attn_fwd[(cdiv(N_q, BLOCK_Q), H, B)](Q, K, V, O, LSE2, <16 strides>, n_heads, n_q, n_kv,
    qk_scale, HEAD_DIM=..., BLOCK_D=..., BLOCK_Q=..., BLOCK_KV=..., IS_CAUSAL=...)``: each program
    writes BLOCK_Q rows of O and of the base-2 LSE of one (batch, head), for any strides, ragged
    lengths and a head dim padded to BLOCK_D."""
    name = "my_attn_fwd"
    passed_layouts = set()
    for n, (batch, heads, n_q, n_kv, d, causal, layout, block_q, block_kv) in enumerate(KERNEL_CASES):
        q, k, v = make_inputs(batch, heads, n_q, n_kv, d, layout, 460 + n)
        scale = 1.0 / math.sqrt(d)
        o, lse2, buffer = launch_my_attn_fwd(my_attn_fwd, q, k, v, causal, scale, block_q, block_kv)
        what = (f" (B={batch}, H={heads}, N_q={n_q}, N_kv={n_kv}, D={d}, is_causal={causal}, {layout} "
                f"inputs, BLOCK_Q={block_q}, BLOCK_KV={block_kv})")
        outside = buffer.cpu().clone()
        outside[:, :, :n_q, :d] = UNTOUCHED
        if (outside != UNTOUCHED).any():
            raise ExerciseError(f"{name} wrote outside O{what}: mask the store with rows < n_q and "
                                "columns < HEAD_DIM (the tile has BLOCK_D >= HEAD_DIM columns)")
        got, lse_got = o.cpu(), lse2.cpu()
        unwritten = (got == UNWRITTEN).all(-1)
        if unwritten.any():
            b, h, row = (int(x) for x in unwritten.nonzero()[0])
            hint = ("each program computes query block tl.program_id(0) of head tl.program_id(1) of batch "
                    "tl.program_id(2)")
            if causal:
                hint += (" (reversed under IS_CAUSAL, so the longest programs start first: "
                         "q_block = tl.num_programs(0) - 1 - tl.program_id(0))")
            raise ExerciseError(f"{name} left row {row} of head {h}, batch {b} of O unwritten{what}: {hint}")
        if _judge(o, lse2.double() * LN2, q, k, v, causal, scale):
            passed_layouts.add(layout)
            continue
        qc, kc, vc = (t.cpu().double() for t in (q, k, v))
        o_ref, lse_ref = naive_attention(qc, kc, vc, is_causal=causal, scale=scale)
        tol = pick(cpu=1e-4, gpu=GPU_TOL)
        if torch.isnan(got).any():
            raise ExerciseError(f"{name} returned NaN{what}: the columns past HEAD_DIM hold NaN in this "
                                "check; load Q, K and V with the column mask offs_d < HEAD_DIM (other=0.0)")
        if not close(got, o_ref, tol, tol):
            for mistake, hint in KERNEL_MISTAKES.items():
                wrong = tiled_forward_with_mistake(qc, kc, vc, causal, block_q, block_kv, scale, mistake)[0]
                if not close(wrong, o_ref, tol, tol) and close(got, wrong, tol, tol):
                    raise ExerciseError(f"the output O of {name} is wrong{what}: {hint}.")
            if causal:
                late = _masked_attention(qc, kc, vc, scale, _late_start(n_q, n_kv, block_q, block_kv))[0]
                if close(got, late, tol, tol):
                    raise ExerciseError(f"the output O of {name} is wrong{what}: under the causal mask the "
                                        "first stage still starts at key 0; only its end, kv_full_end, moves "
                                        "with the query block")
            if close(got, naive_attention(qc, kc, vc, is_causal=not causal, scale=scale)[0], tol, tol):
                raise ExerciseError(f"the output O of {name} is {'not ' if causal else ''}causal{what}: "
                                    "follow IS_CAUSAL, in the stage bounds and in the mask")
            if layout == "strided_d" and passed_layouts:
                raise ExerciseError(f"the output O of {name} is wrong{what}, where the columns are 2 elements "
                                    "apart, and right where they are contiguous: multiply the column offsets "
                                    "by stride_qd, stride_kd, stride_vd and stride_od")
            if layout != "contiguous" and "contiguous" in passed_layouts and layout == "bnhd":
                raise ExerciseError(f"the output O of {name} is wrong{what}, for a (B, N, H, D) tensor seen "
                                    "as (B, H, N, D), and right for a contiguous one: move to the (batch, "
                                    "head) with the strides, Q + batch * stride_qb + head * stride_qh")
            expect_close(f"the output O of {name}{what}", got, o_ref, atol=tol, rtol=tol, heatmap=True)
        hint = _lse_hint(lse_got, qc, kc, causal, scale, tol)
        if hint:
            raise ExerciseError(f"the LSE of {name} is wrong{what}: {hint}.")
        expect_close(f"the base-2 LSE of {name}{what}, times ln 2", lse_got.double() * LN2, lse_ref,
                     atol=tol, rtol=tol)
    passed(f"{name} passes the rule against float64 in all {len(KERNEL_CASES)} cases (N_q = 19, N_kv = 27, "
           "D = 24, non-contiguous and strided inputs, causal and not)")


# --- Its launcher ----------------------------------------------------------------------------------

#: (B, H, N_q, N_kv, D, causal, layout, scale): contiguous and aligned first, so that what only the
#: strides or the ragged ends break shows as such.
LAUNCHER_CASES = [(1, 2, 32, 32, 32, False, "contiguous", None),
                  (1, 2, 32, 32, 32, True, "contiguous", None),
                  (2, 3, 19, 27, 24, True, "bnhd", None),
                  (2, 3, 19, 27, 24, False, "strided_d", 0.3)]


def names_kernel(fn, kernel_name, _seen=None):
    """Whether the learner's ``fn``, or a function of theirs that it calls, names ``kernel_name``."""
    seen = _seen if _seen is not None else set()
    if fn in seen or not inspect.isfunction(fn):
        return False
    seen.add(fn)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return True  # source unknown: leave it to the launches
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    return kernel_name in names or any(
        names_kernel(fn.__globals__[n], kernel_name, seen) for n in names
        if inspect.isfunction(fn.__globals__.get(n)) and fn.__globals__[n].__module__ == fn.__module__)


@contextmanager
def counting_launches(kernel):
    """While inside: every launch of ``kernel`` (a @triton.jit function, or None) is counted in the
    list it yields. Both runtimes launch ``kernel[grid](...)`` through ``kernel.run``."""
    launches = []
    if kernel is None or not hasattr(kernel, "run"):
        yield launches
        return

    had, original = "run" in vars(kernel), kernel.run

    def run(*args, **kwargs):
        launches.append(1)
        return original(*args, **kwargs)
    kernel.run = run
    try:
        yield launches
    finally:
        if had:
            kernel.run = original
        else:
            del kernel.run


def check_my_attention_forward(my_attention_forward):
    """``my_attention_forward(q, k, v, is_causal=False, scale=None) -> (o, lse2)`` on (B, H, N, D)
    tensors of any strides: o like q, lse2 float32 (B, H, N_q) in base 2; scale None means
    1/sqrt(D)."""
    name = "my_attention_forward"
    kernel = getattr(my_attention_forward, "__globals__", {}).get("my_attn_fwd")
    if not is_stub(my_attention_forward) and not names_kernel(my_attention_forward, "my_attn_fwd"):
        raise ExerciseError(f"{name} never launches my_attn_fwd: this exercise is the launcher of your kernel "
                            "(Exercise 3), so its outputs must come from my_attn_fwd[grid](q, k, v, o, lse2, ...).")
    if kernel is not None and not is_stub(my_attention_forward) and is_stub(kernel):
        raise ExerciseError(f"{name} launches my_attn_fwd, which is not implemented yet: write the kernel "
                            "(Exercise 3) first, then run this check again.")
    aligned_ok = strided_ok = False
    for n, (batch, heads, n_q, n_kv, d, causal, layout, scale) in enumerate(LAUNCHER_CASES):
        q, k, v = make_inputs(batch, heads, n_q, n_kv, d, layout, 470 + n)
        what = (f" (B={batch}, H={heads}, N_q={n_q}, N_kv={n_kv}, D={d}, is_causal={causal}, {layout} "
                f"inputs, scale={scale})")
        with warnings.catch_warnings(), np.errstate(all="ignore"):  # NumPy's warnings of a wrong kernel
            warnings.simplefilter("ignore", RuntimeWarning)
            with counting_launches(kernel) as launches:
                result = attempt(my_attention_forward, q, k, v, is_causal=causal, scale=scale, name=name,
                                 forbid=FORBID)
        if kernel is not None and not launches:
            raise ExerciseError(f"{name} did not launch my_attn_fwd{what}: its outputs must come from your "
                                "kernel, launched on every call as my_attn_fwd[grid](q, k, v, o, lse2, ...)")
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            raise ExerciseError(f"{name} should return a tuple (o, lse2), got {type(result).__name__}")
        o, lse2 = result
        if not isinstance(o, torch.Tensor) or tuple(o.shape) != tuple(q.shape):
            raise ExerciseError(f"{name}'s o should be a tensor shaped like q, {tuple(q.shape)}{what}")
        if not isinstance(lse2, torch.Tensor) or tuple(lse2.shape) != (batch, heads, n_q):
            raise ExerciseError(f"{name}'s lse2 should be a tensor of shape (B, H, N_q) = "
                                f"{(batch, heads, n_q)}{what}")
        used = 1.0 / math.sqrt(d) if scale is None else scale
        if _judge(o, lse2.double() * LN2, q, k, v, causal, used):
            aligned_ok = aligned_ok or layout == "contiguous"
            strided_ok = strided_ok or layout != "contiguous"
            continue
        qc, kc, vc = (t.cpu().double() for t in (q, k, v))
        o_ref, lse_ref = naive_attention(qc, kc, vc, is_causal=causal, scale=used)
        tol = pick(cpu=1e-4, gpu=GPU_TOL)
        got = o.detach().cpu().double()
        if not close(got, o_ref, tol, tol):
            wrong_scales = [
                (used * LN2, "qk_scale lacks log2 e: the kernel computes 2^(s * qk_scale), so pass "
                             "qk_scale = scale * log2(e) (= scale / ln 2), not the natural-log scale"),
                (1.0, "the softmax scale is missing: qk_scale = scale * log2(e), with scale = 1/sqrt(D) "
                      "when scale is None"),
                (LN2, "qk_scale is neither scaled nor in base 2: qk_scale = scale * log2(e)"),
            ]
            if scale is not None:
                wrong_scales.append((1.0 / math.sqrt(d), "the scale argument was ignored: use it when it is "
                                                         "given, 1/sqrt(D) only when it is None"))
            for wrong_scale, hint in wrong_scales:
                if close(got, naive_attention(qc, kc, vc, is_causal=causal, scale=wrong_scale)[0], tol, tol):
                    raise ExerciseError(f"the output o of {name} is wrong{what}: {hint}.")
            if close(got, naive_attention(qc, kc, vc, is_causal=not causal, scale=used)[0], tol, tol):
                raise ExerciseError(f"the output o of {name} is {'not ' if causal else ''}causal{what}: pass "
                                    "IS_CAUSAL=is_causal to the kernel")
            bad_rows = ~torch.isclose(got, o_ref, atol=tol, rtol=tol).all(-1).all(0).all(0)
            first_bad = int(bad_rows.nonzero()[0])
            if first_bad > 0 and bad_rows[first_bad:].all():
                raise ExerciseError(f"the rows {first_bad}..{n_q - 1} of {name}'s o are wrong{what}, the rows "
                                    f"before them right: the grid must cover the ragged last block too, "
                                    "triton.cdiv(N_q, BLOCK_Q) query blocks, not N_q // BLOCK_Q")
            if aligned_ok and not strided_ok:
                raise ExerciseError(f"the output o of {name} is wrong{what}, and right for contiguous inputs: "
                                    "pass each tensor's own strides, *q.stride(), *k.stride(), *v.stride(), "
                                    "*o.stride(), never ones computed from the shape")
            bad = ~torch.isclose(got, o_ref, atol=tol, rtol=tol).all(-1).all(-1)
            b, h = (int(x) for x in bad.nonzero()[0])
            if not bad.all():
                raise ExerciseError(f"head {h} of batch {b} of {name}'s o is wrong{what}, other heads are "
                                    "right: the grid is (cdiv(N_q, BLOCK_Q), H, B), query blocks on axis 0, "
                                    "heads on axis 1, batch on axis 2")
            expect_close(f"the output o of {name}{what}", got, o_ref, atol=tol, rtol=tol, heatmap=True)
        lse_got = lse2.detach().cpu().double()
        if close(lse_got, lse_ref, tol, tol) and not close(lse_got * LN2, lse_ref, tol, tol):
            raise ExerciseError(f"the lse2 of {name} is in natural log{what}: return the base-2 LSE the "
                                "kernel stores (the public flashattn.attention converts it, not this launcher)")
        hint = _lse_hint(lse_got, qc, kc, causal, used, tol)
        if hint:
            raise ExerciseError(f"the lse2 of {name} is wrong{what}: {hint}.")
        expect_close(f"lse2 of {name}{what}, times ln 2", lse_got * LN2, lse_ref, atol=tol, rtol=tol)
    passed(f"{name} passes the rule against float64 in all {len(LAUNCHER_CASES)} cases (contiguous, "
           "(B, N, H, D) views and strided columns; N_q = 19, N_kv = 27, D = 24; causal and not; a given scale)")
