"""Checkers of chapters 05 and 07: the softmax and attention backward from the formulas (05), the
tolerance rule and a find-the-bug kernel (07). Chapter 06's kernels are checked in ``ch06``.
"""
import numpy as np
import torch
import triton

from ...ops.attention import attention
from ...testing.reference import naive_attention
from ...gpu.runtime import DEVICE
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
