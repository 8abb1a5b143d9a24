"""Checkers of chapters 05-07: the softmax and attention backward from the formulas (05), the
Delta kernel and the dQ stage's inner loop in Triton (06), the tolerance rule and a find-the-bug
kernel (07), with the kernel that runs a learner's dQ loop (``dq_exercise_kernel``).
"""
import math

import numpy as np
import torch
import triton
import triton.language as tl

from ..api import attention
from ..notebook import pick
from ..reference import causal_mask, naive_attention
from ..runtime import DEVICE
from ..tiles import LN2, LOG2E, kv_stage_bounds
from .common import ExerciseError, attempt, close, expect_close, launch_learner_kernel, passed


def _generator(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


def _randn(shape, gen, dtype=torch.float64, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype=dtype, device=DEVICE)


# --- Chapter 05 -----------------------------------------------------------------------------------

def check_softmax_backward(softmax_backward):
    """``softmax_backward(p, dp) -> ds`` for P = softmax(S) along the last dim: dS = P * (dP - rowsum(P * dP)).

    Drawn inputs: several shapes (one row, one column, batched, wide), a row with hidden (-inf)
    scores whose probabilities are exactly 0; compared with torch.autograd in float64."""
    cases = [((1, 5), 0), ((4, 1), 1), ((3, 7), 2), ((2, 3, 9), 3), ((6, 33), 4), ((2, 2, 4, 17), 5)]
    for shape, seed in cases:
        g = _generator(100 + seed)
        s = _randn(shape, g, scale=2.0)
        if seed % 2 and shape[-1] > 3:
            s[..., -2:] = float("-inf")  # hidden keys: P = 0 there, and so is their gradient
        s.requires_grad_(True)
        p = torch.softmax(s, dim=-1)
        dp = _randn(shape, g)
        (want,) = torch.autograd.grad(p, s, dp)
        want = torch.nan_to_num(want)  # hidden scores get a zero gradient
        p_in, dp_in = p.detach().clone(), dp.clone()
        got = attempt(softmax_backward, p_in, dp_in, name="softmax_backward")
        if not (torch.equal(p_in, p.detach()) and torch.equal(dp_in, dp)):
            raise ExerciseError("softmax_backward changed its inputs p or dp in place; return a new tensor")
        if close(got, want, atol=1e-9, rtol=1e-7):
            continue
        pd = p.detach()
        if close(got, pd * dp, atol=1e-9, rtol=1e-7):
            raise ExerciseError(f"for shape {shape}, your dS equals P * dP: you forgot to subtract the row sum "
                                "rowsum(P * dP) (a softmax row sums to 1, so a change of one score moves all "
                                "the probabilities of its row).")
        if close(got, pd * (dp - (pd * dp).sum(-2, keepdim=True)), atol=1e-9, rtol=1e-7):
            raise ExerciseError(f"for shape {shape}, you summed P * dP over the wrong dimension (dim -2, the "
                                "rows): the sum runs along each row, over the last dim, with keepdim=True.")
        if close(got, pd * (dp - dp.sum(-1, keepdim=True)), atol=1e-9, rtol=1e-7):
            raise ExerciseError(f"for shape {shape}, you subtracted rowsum(dP); the weights of that sum are the "
                                "probabilities: rowsum(P * dP).")
        expect_close(f"dS for shape {shape}", got, want, atol=1e-9, rtol=1e-7)
    passed("softmax_backward matches torch.autograd on 6 shapes, hidden (-inf) scores included")


def _attention_case(n_q, n_kv, d, lead, is_causal, scale, seed):
    g = _generator(seed)
    q, k, v = (_randn((*lead, n, d), g).requires_grad_(True) for n in (n_q, n_kv, n_kv))
    out, lse = naive_attention(q, k, v, is_causal=is_causal, scale=scale)
    do = _randn(out.shape, g)
    want = torch.autograd.grad(out, (q, k, v), do)
    return [t.detach() for t in (q, k, v, out)], do, lse.detach(), want


def check_attention_backward(attention_backward):
    """``attention_backward(q, k, v, o, do, lse, is_causal, scale) -> (dq, dk, dv)`` from the formulas,
    checked against torch.autograd in float64 (causal and not, N_q != N_kv, leading dims)."""
    cases = [  # n_q, n_kv, d, leading dims, causal, scale
        (7, 7, 4, (), False, 0.5), (9, 9, 8, (2,), True, None), (5, 11, 6, (1, 2), True, 0.3),
        (12, 4, 5, (2, 1), True, None), (6, 13, 3, (), False, 1.7), (1, 1, 2, (), True, None),
    ]
    for n, (n_q, n_kv, d, lead, causal, scale) in enumerate(cases):
        (q, k, v, o), do, lse, want = _attention_case(n_q, n_kv, d, lead, causal, scale, 200 + n)
        what = f"N_q={n_q}, N_kv={n_kv}, D={d}, leading dims {lead}, is_causal={causal}, scale={scale}"
        got = attempt(attention_backward, q.clone(), k.clone(), v.clone(), o.clone(), do.clone(), lse.clone(),
                      causal, scale, name="attention_backward")
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            raise ExerciseError("attention_backward must return a tuple (dq, dk, dv)")
        sc = 1.0 / d ** 0.5 if scale is None else scale
        for name, g_, w in zip(("dq", "dk", "dv"), got, want):
            if close(g_, w, atol=1e-9, rtol=1e-7):
                continue
            if name != "dv" and close(torch.as_tensor(g_) * sc, w, atol=1e-9, rtol=1e-7):
                raise ExerciseError(f"{name} is wrong ({what}): it is missing the factor scale: S = scale * Q K^T, "
                                    "so dQ = scale * dS K and dK = scale * dS^T Q.")
            if name != "dv" and close(torch.as_tensor(g_), w * sc, atol=1e-9, rtol=1e-7):
                raise ExerciseError(f"{name} is wrong ({what}): it carries the factor scale twice.")
            expect_close(f"{name} ({what})", g_, w, atol=1e-9, rtol=1e-7, heatmap=True)
    passed("attention_backward matches torch.autograd in float64 on 6 cases (causal, N_q != N_kv, leading dims)")


# --- Chapter 06 -----------------------------------------------------------------------------------

def check_delta_kernel(delta_kernel):
    """The Delta preprocess as a Triton kernel, launched as
    ``delta_kernel[(cdiv(n_rows, BLOCK_ROWS),)](O, dO, Delta, n_rows, stride_o, stride_do,
    HEAD_DIM=..., BLOCK_ROWS=..., BLOCK_D=...)`` on (n_rows, HEAD_DIM) matrices whose rows are
    ``stride_o``/``stride_do`` elements apart (columns contiguous). Checks ragged row counts, head dims
    that need padding, float16 inputs (which must be multiplied and summed in float32) and that
    nothing is written past the end of Delta."""
    cases = [(1, 16, 16, torch.float32), (17, 40, 16, torch.float32), (69, 64, 32, torch.float32),
             (130, 24, 64, torch.float32), (69, 64, 16, torch.float16), (33, 40, 32, torch.float16)]
    for n, (n_rows, d, block_rows, dtype) in enumerate(cases):
        g = _generator(300 + n)
        block_d = max(16, triton.next_power_of_2(d))
        pad = block_rows + 1  # rows past the end hold NaN: a load there is harmless only if masked
        o_buf = torch.full((n_rows + pad, d + 8), float("nan"), dtype=dtype)
        do_buf = torch.full((n_rows + pad, d + 3), float("nan"), dtype=dtype)
        o_buf[:n_rows, :d] = torch.randn(n_rows, d, generator=g) * 2
        do_buf[:n_rows, :d] = torch.randn(n_rows, d, generator=g) * 2
        o_buf, do_buf = o_buf.to(DEVICE), do_buf.to(DEVICE)
        o, do = o_buf[:n_rows, :d], do_buf[:n_rows, :d]
        o[:, 0], do[:, 0] = 30.0, 30.0  # a large common term: float16 sums lose the small ones
        delta_buf = torch.full((n_rows + pad,), -7.0, dtype=torch.float32, device=DEVICE)
        launch_learner_kernel(delta_kernel, (triton.cdiv(n_rows, block_rows),),
                              (o, do, delta_buf, n_rows, o.stride(0), do.stride(0)),
                              dict(HEAD_DIM=d, BLOCK_ROWS=block_rows, BLOCK_D=block_d), "delta_kernel",
                              delta_kernel)
        what = f"n_rows={n_rows}, HEAD_DIM={d}, BLOCK_ROWS={block_rows}, BLOCK_D={block_d}, {dtype}"
        if not (delta_buf[n_rows:].cpu() == -7.0).all():
            raise ExerciseError(f"{what}: your kernel wrote past the end of Delta (rows >= n_rows): "
                                "mask the store with `rows < n_rows`.")
        want = (o.double() * do.double()).sum(-1)
        got = delta_buf[:n_rows]
        if torch.isnan(got).any():
            raise ExerciseError(f"{what}: Delta has NaN: some loads read outside the {n_rows} x {d} matrix "
                                "(the padded columns d >= HEAD_DIM or the rows >= n_rows need a mask, "
                                "with other=0.0).")
        if dtype == torch.float16 and not close(got, want, atol=2e-4, rtol=2e-5) \
                and close(got, want, atol=1e-2, rtol=5e-3):  # close, but not float32-close
            raise ExerciseError(f"{what}: Delta lost precision: convert O and dO to float32 before "
                                "multiplying (`.to(tl.float32)`), as the package's preprocess does.")
        expect_close(f"Delta ({what})", got, want, atol=2e-4, rtol=2e-5)
    passed("delta_kernel computes Delta = rowsum(dO * O) for ragged rows, padded head dims and float16")


@triton.jit
def dq_exercise_kernel(Q, K, V, dO, LSE, Delta, dQ,
                       stride_qh, stride_qn, stride_kh, stride_kn, stride_dqh, stride_dqn,
                       n_q, n_kv, scale, qk_scale, INNER: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
                       BLOCK_KV: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """The dQ stage of chapter 06's exercise, around the learner's inner loop ``INNER`` (a
    @triton.jit function passed as a compile-time constant, and called like flashattn's _dq_inner).

    One program per (query block, head) of (heads, N, D) tensors whose columns are contiguous; K and
    V share their strides, and so do Q and dO. It loads the resident tiles (q, do, and the rows' LSE2
    and Delta), then calls INNER twice with the key ranges of flashattn.traversal.kv_ranges: the
    whole unmasked tiles (MASKED=False), then the diagonal and ragged tiles (MASKED=True)."""
    q_block, head = tl.program_id(0), tl.program_id(1)
    Q += head * stride_qh
    dO += head * stride_qh
    K += head * stride_kh
    V += head * stride_kh
    dQ += head * stride_dqh
    LSE += head * n_q
    Delta += head * n_q
    q_start = q_block * BLOCK_Q
    offs_q = q_start + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    inside = (offs_q[:, None] < n_q) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + offs_q[:, None] * stride_qn + offs_d[None, :], mask=inside, other=0.0)
    do = tl.load(dO + offs_q[:, None] * stride_qn + offs_d[None, :], mask=inside, other=0.0)
    lse = tl.load(LSE + offs_q, mask=offs_q < n_q, other=0.0)
    delta = tl.load(Delta + offs_q, mask=offs_q < n_q, other=0.0)
    dq = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    kv_full_end, kv_end = kv_stage_bounds(q_start, n_kv, BLOCK_Q, BLOCK_KV, IS_CAUSAL)
    dq = INNER(dq, q, do, lse, delta, K, V, stride_kn, offs_q, offs_d, 0, kv_full_end, n_kv, qk_scale,
               HEAD_DIM, BLOCK_D, BLOCK_KV, False, IS_CAUSAL)
    dq = INNER(dq, q, do, lse, delta, K, V, stride_kn, offs_q, offs_d, kv_full_end, kv_end, n_kv, qk_scale,
               HEAD_DIM, BLOCK_D, BLOCK_KV, True, IS_CAUSAL)
    dq *= scale
    tl.store(dQ + offs_q[:, None] * stride_dqn + offs_d[None, :], dq, mask=inside)


def run_dq_inner(dq_inner, q, k, v, do, is_causal=False, scale=None, block_q=32, block_kv=16):
    """Run the dQ stage built around ``dq_inner`` on float32 (heads, N, D) tensors; the LSE and
    Delta come from a float64 reference. Returns dQ (float32)."""
    heads, n_q, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q, k, v, do = (t.float().contiguous() for t in (q, k, v, do))
    o64, lse64 = naive_attention(q.double(), k.double(), v.double(), is_causal=is_causal, scale=scale)
    lse2 = (lse64 * LOG2E).float().contiguous()
    delta = (o64 * do.double()).sum(-1).float().contiguous()
    dq = torch.full_like(q, float("nan"))
    launch_learner_kernel(dq_exercise_kernel, (triton.cdiv(n_q, block_q), heads),
                          (q, k, v, do, lse2, delta, dq, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                          dq.stride(0), dq.stride(1), n_q, k.shape[1], scale, scale * LOG2E, dq_inner),
                          dict(HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_Q=block_q,
                               BLOCK_KV=block_kv, IS_CAUSAL=bool(is_causal)), "dq_inner", dq_inner)
    return dq


def _dq_variants(q, k, v, do, is_causal, scale, block_q=32):
    """dQ in float64 for the correct formulas and for three classic mistakes (the unmasked one
    reaches only the key tiles the kernel visits: up to the end of each query block's diagonal).

    Each comes as ``(dq, size)`` with ``size = scale * |dS| @ |K|``, the sum of the magnitudes of
    the terms a kernel adds up for each element of dQ: a kernel's rounding error grows with it."""
    q, k, v, do = (t.double() for t in (q, k, v, do))
    o, lse = naive_attention(q, k, v, is_causal=is_causal, scale=scale)
    s = scale * q @ k.transpose(-2, -1)
    hidden = ~causal_mask(q.shape[-2], k.shape[-2], q.device) if is_causal else torch.zeros_like(s, dtype=torch.bool)
    delta = (do * o).sum(-1, keepdim=True)
    dp = do @ v.transpose(-2, -1)
    p = torch.exp(s - lse[..., None]).masked_fill(hidden, 0.0)
    i = torch.arange(q.shape[-2], device=q.device)[:, None]
    j = torch.arange(k.shape[-2], device=q.device)[None, :]
    p_unmasked = torch.exp(s - lse[..., None]).masked_fill(is_causal & (j >= (i // block_q + 1) * block_q), 0.0)
    p_natural = torch.exp((s - lse[..., None]) / LN2).masked_fill(hidden, 0.0)
    ds = {
        "correct": p * (dp - delta),
        "forgot Delta (dS = P * dP)": p * dp,
        "no causal mask on the diagonal tiles": p_unmasked * (dp - delta),
        "exp instead of exp2 (the LSE and qk_scale are in base 2)": p_natural * (dp - delta),
    }
    return {name: (scale * d @ k, scale * d.abs() @ k.abs()) for name, d in ds.items()}


def check_dq_inner(dq_inner):
    """The dQ stage's inner loop in Triton, run inside a given kernel on tiny inputs (ragged lengths,
    causal and not, N_q != N_kv, a padded head dim) and compared with a float64 reference."""
    tol = pick(cpu=2e-5, gpu=1e-2)  # a GPU multiplies float32 tiles in TF32 by default
    cases = [(2, 69, 69, 32, True), (2, 69, 69, 32, False), (1, 45, 70, 32, True), (1, 70, 45, 40, True),
             (2, 33, 17, 16, False), (1, 1, 1, 16, True)]
    for n, (heads, n_q, n_kv, d, causal) in enumerate(cases):
        g = _generator(400 + n)
        q, k, v, do = (torch.randn(heads, m, d, generator=g).to(DEVICE) for m in (n_q, n_kv, n_kv, n_q))
        scale = 1.0 / d ** 0.5
        got = run_dq_inner(dq_inner, q, k, v, do, is_causal=causal, scale=scale)
        variants = {name: (dq.cpu(), size.cpu()) for name, (dq, size) in
                    _dq_variants(q, k, v, do, causal, scale).items()}
        want = variants["correct"][0]
        atol = tol * max(1.0, want.abs().max().item())
        what = f"heads={heads}, N_q={n_q}, N_kv={n_kv}, D={d}, is_causal={causal}"
        if close(got, want, atol=atol, rtol=tol):
            continue
        # Name the mistake the output matches. Its terms may be far larger than dQ itself (without
        # the causal mask, terms of size ~100 cancel to a few units), and a kernel's rounding error
        # grows with the terms it adds up, not with their sum: on a GPU, TF32 products leave errors
        # well above tol * |dQ| there. So a mistake is recognised within tol x the size of its terms.
        got64 = torch.as_tensor(got).detach().double().cpu()
        for mistake, (wrong, size) in variants.items():
            allowed = tol * (1.0 + size)
            if mistake == "correct" or ((wrong - want).abs() <= allowed).all():
                continue  # this mistake changes nothing in this case
            if got64.shape == wrong.shape and ((got64 - wrong).abs() <= allowed).all():
                raise ExerciseError(f"dQ is wrong ({what}); it equals what you get with this mistake: {mistake}.")
        expect_close(f"dQ ({what})", got, want, atol=atol, rtol=tol, heatmap=True)
    passed("dq_inner gives the right dQ for ragged lengths, causal and not, N_q != N_kv and a padded head dim")


# --- Chapter 07 -----------------------------------------------------------------------------------

class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient passing back through it is multiplied by ``factor``."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _rule_impls():
    """A correct implementation and subtly wrong ones, all called as impl(q, k, v, is_causal=...)."""
    def flash(q, k, v, is_causal=False):
        return attention(q, k, v, is_causal=is_causal)

    def pytorch(q, k, v, is_causal=False):
        return naive_attention(q, k, v, is_causal=is_causal)[0]

    def scale_off(q, k, v, is_causal=False):
        return attention(q, k, v, is_causal=is_causal, scale=1.01 / q.shape[-1] ** 0.5)

    def dk_off(q, k, v, is_causal=False):
        return attention(q, _ScaleGrad.apply(k, 1.02), v, is_causal=is_causal)

    def last_row_off(q, k, v, is_causal=False):
        out = attention(q, k, v, is_causal=is_causal)
        bump = torch.ones(out.shape[-2], 1, dtype=out.dtype, device=out.device)
        bump[-1] = 1.004
        return out * bump

    def sees_next_key(q, k, v, is_causal=False):
        if not is_causal:
            return attention(q, k, v)
        n_q, n_kv = q.shape[-2], k.shape[-2]
        i = torch.arange(n_q, device=q.device)[:, None]
        j = torch.arange(n_kv, device=q.device)[None, :]
        mask = torch.zeros(n_q, n_kv, dtype=q.dtype, device=q.device).masked_fill(j > i + 1, float("-inf"))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    right = {"flashattn.attention": flash, "plain PyTorch in the same dtype": pytorch}
    wrong = {"the kernel with a scale 1% too large": scale_off,
             "the kernel with dK 2% too large (forward exact)": dk_off,
             "the kernel with only the last query row 0.4% off": last_row_off,
             "causal attention where query i also sees key i+1": sees_next_key}
    return right, wrong


def _verdict(verdict):
    if isinstance(verdict, torch.Tensor) and verdict.numel() == 1:
        verdict = bool(verdict)
    if not isinstance(verdict, (bool, np.bool_)):
        raise ExerciseError(f"rule_test must return True or False, got {type(verdict).__name__}")
    return bool(verdict)


def check_rule_test(rule_test):
    """``rule_test(impl, q, k, v, is_causal) -> bool`` applies the tolerance rule (error against a
    float64 reference at most 2x (out) or 3x (dq, dk, dv) plain PyTorch's error in the same dtype,
    plus the floor). It must accept correct implementations and reject subtly wrong ones."""
    right, wrong = _rule_impls()

    def inputs(n_q, n_kv, d, dtype, seed):
        g = _generator(500 + seed)
        return [torch.randn(1, 1, n, d, generator=g).to(dtype=dtype, device=DEVICE) for n in (n_q, n_kv, n_kv)]

    right_cases = [("flashattn.attention", (37, 37, 32, torch.float32, 0), True),
                   ("flashattn.attention", (37, 50, 40, torch.float16, 1), False),
                   ("flashattn.attention", (50, 23, 16, torch.bfloat16, 2), True),
                   ("plain PyTorch in the same dtype", (29, 29, 16, torch.float16, 3), True)]
    for label, shape, causal in right_cases:
        verdict = _verdict(attempt(rule_test, right[label], *inputs(*shape), is_causal=causal, name="rule_test"))
        if not verdict:
            raise ExerciseError(f"rule_test rejected a correct implementation ({label}) on N_q, N_kv, D = "
                                f"{shape[:3]}, {shape[3]}, is_causal={causal}: is the bound factor x "
                                "PyTorch's error + floor, with errors measured against float64?")
    for label, impl in wrong.items():
        verdict = _verdict(attempt(rule_test, impl, *inputs(45, 45, 32, torch.float32, 7), is_causal=True,
                                       name="rule_test"))
        if verdict:
            raise ExerciseError(f"rule_test accepted a wrong implementation: {label} (float32, causal). "
                                "Does it compare the gradients too, take the LARGEST error over all "
                                "elements, and use a bound relative to PyTorch's own error?")
    passed("rule_test accepts flashattn and PyTorch in fp32, fp16 and bf16, and rejects 4 subtly wrong "
           "implementations")


def check_row_lse_kernel(row_lse_kernel):
    """The fixed find-the-bug kernel: ``row_lse_kernel[(cdiv(n_rows, BLOCK_ROWS),)](X, LSE, n_rows,
    n_cols, stride_row, BLOCK_ROWS=..., BLOCK_COLS=...)`` writes logsumexp of each row of X."""
    cases = [(8, 64, 4, 16), (5, 17, 4, 16), (3, 1, 4, 16), (9, 69, 8, 32), (2, 100, 4, 32), (7, 48, 4, 32)]
    for n, (n_rows, n_cols, block_rows, block_cols) in enumerate(cases):
        g = _generator(600 + n)
        x = (torch.randn(n_rows, n_cols + 5, generator=g) * 3).to(DEVICE)[:, :n_cols]
        lse = torch.full((n_rows + block_rows,), -7.0, device=DEVICE)
        launch_learner_kernel(row_lse_kernel, (triton.cdiv(n_rows, block_rows),),
                              (x, lse, n_rows, n_cols, x.stride(0)),
                              dict(BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols), "row_lse_kernel",
                              row_lse_kernel)
        want = torch.logsumexp(x.double(), dim=-1)
        what = f"n_rows={n_rows}, n_cols={n_cols}, BLOCK_ROWS={block_rows}, BLOCK_COLS={block_cols}"
        if not (lse[n_rows:].cpu() == -7.0).all():
            raise ExerciseError(f"{what}: the kernel wrote past the end of LSE: mask the store with rows < n_rows.")
        if close(lse[:n_rows], want, atol=1e-5, rtol=1e-5):
            continue
        if n_cols % block_cols and n > 0:  # case 0 (n_cols a multiple of the block) passed
            raise ExerciseError(f"{what}: wrong when n_cols is not a multiple of BLOCK_COLS (right when it is). "
                                "The padded columns of the last block still count: their scores must be "
                                "-inf (probability 0), not 0.")
        expect_close(f"LSE ({what})", lse[:n_rows], want, atol=1e-5, rtol=1e-5)
    passed("row_lse_kernel is right on aligned and ragged column counts (1, 17, 69, 100)")
