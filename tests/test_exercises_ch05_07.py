"""The exercise checkers of chapters 05-07 pass the notebooks' solutions and reject stubs and
plausible wrong answers with a message that names the mistake.

The solutions here are the same as in the notebooks' solution cells (05_backward_derivation,
06_backward_kernels, 07_autograd_and_testing)."""
import math

import flashattn  # first: it picks the runtime (TRITON_INTERPRET) before triton.language is imported
import pytest
import torch
import triton
import triton.language as tl

from flashattn import exercises as ex
from flashattn.reference import causal_mask, naive_attention

LOG2E = 1.0 / math.log(2.0)


# Chapter 05 -----------------------------------------------------------------------------------

def softmax_backward(p, dp):
    return p * (dp - (p * dp).sum(dim=-1, keepdim=True))


def attention_backward(q, k, v, o, do, lse, is_causal, scale):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    p = torch.exp(scale * q @ k.transpose(-2, -1) - lse[..., None])
    if is_causal:
        p = p.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), 0.0)
    dv = p.transpose(-2, -1) @ do
    dp = do @ v.transpose(-2, -1)
    ds = p * (dp - (do * o).sum(dim=-1, keepdim=True))
    return scale * ds @ k, scale * ds.transpose(-2, -1) @ q, dv


def stub(*args, **kwargs):
    raise NotImplementedError()


def test_ch05_solutions_pass(capsys):
    ex.check_softmax_backward(softmax_backward)
    ex.check_attention_backward(attention_backward)
    assert capsys.readouterr().out.count("PASSED") == 2


@pytest.mark.parametrize("wrong,words", [
    (stub, "not implemented yet"),
    (lambda p, dp: p * dp, "forgot to subtract the row sum"),
    (lambda p, dp: p * (dp - (p * dp).sum(-2, keepdim=True)), "wrong dimension"),
    (lambda p, dp: p * (dp - dp.sum(-1, keepdim=True)), "rowsum(P * dP)"),
    (lambda p, dp: p * (dp - (p * dp).sum(-1, keepdim=True)) * 1.001, "wrong at"),
])
def test_softmax_backward_mistakes(wrong, words):
    with pytest.raises(ex.ExerciseError, match=words.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        ex.check_softmax_backward(wrong)


def _no_scale(q, k, v, o, do, lse, is_causal, scale):
    dq, dk, dv = attention_backward(q, k, v, o, do, lse, is_causal, scale)
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return dq / sc, dk, dv


def _no_mask(q, k, v, o, do, lse, is_causal, scale):
    return attention_backward(q, k, v, o, do, lse, False, scale)


def _no_delta(q, k, v, o, do, lse, is_causal, scale):
    return attention_backward(q, k, v, torch.zeros_like(o), do, lse, is_causal, scale)


@pytest.mark.parametrize("wrong,words", [
    (stub, "not implemented yet"),
    (_no_scale, "missing the factor scale"),
    (_no_mask, "dq .*is_causal=True"),
    (_no_delta, "dq .*wrong at"),
])
def test_attention_backward_mistakes(wrong, words, monkeypatch):
    monkeypatch.setattr("matplotlib.pyplot.show", lambda *a, **k: None)
    with pytest.raises(ex.ExerciseError, match=words):
        ex.check_attention_backward(wrong)


# Chapter 06 -----------------------------------------------------------------------------------

@triton.jit
def delta_kernel(O, dO, Delta, n_rows, stride_o, stride_do,
                 HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    inside = (rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM)
    o = tl.load(O + rows[:, None] * stride_o + cols[None, :], mask=inside, other=0.0)
    do = tl.load(dO + rows[:, None] * stride_do + cols[None, :], mask=inside, other=0.0)
    tl.store(Delta + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1), mask=rows < n_rows)


@triton.jit
def delta_stub(O, dO, Delta, n_rows, stride_o, stride_do,
               HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    raise NotImplementedError()


@triton.jit
def delta_unmasked_store(O, dO, Delta, n_rows, stride_o, stride_do,
                         HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    inside = (rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM)
    o = tl.load(O + rows[:, None] * stride_o + cols[None, :], mask=inside, other=0.0)
    do = tl.load(dO + rows[:, None] * stride_do + cols[None, :], mask=inside, other=0.0)
    tl.store(Delta + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1))


@triton.jit
def delta_no_column_mask(O, dO, Delta, n_rows, stride_o, stride_do,
                         HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    inside = rows[:, None] < n_rows
    o = tl.load(O + rows[:, None] * stride_o + cols[None, :], mask=inside, other=0.0)
    do = tl.load(dO + rows[:, None] * stride_do + cols[None, :], mask=inside, other=0.0)
    tl.store(Delta + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1), mask=rows < n_rows)


@triton.jit
def delta_in_half(O, dO, Delta, n_rows, stride_o, stride_do,
                  HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    inside = (rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM)
    o = tl.load(O + rows[:, None] * stride_o + cols[None, :], mask=inside, other=0.0)
    do = tl.load(dO + rows[:, None] * stride_do + cols[None, :], mask=inside, other=0.0)
    tl.store(Delta + rows, tl.sum(o * do, axis=1), mask=rows < n_rows)


@triton.jit
def dq_inner(dq, q, do, lse, delta, K, V, stride_kn, offs_q, offs_d, kv_lo, kv_hi, n_kv, qk_scale,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_KV: tl.constexpr,
             MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr):
    for start in range(kv_lo, kv_hi, BLOCK_KV):
        keys = start + tl.arange(0, BLOCK_KV)
        in_range = (keys[:, None] < n_kv) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(K + keys[:, None] * stride_kn + offs_d[None, :], mask=in_range, other=0.0)
        v = tl.load(V + keys[:, None] * stride_kn + offs_d[None, :], mask=in_range, other=0.0)
        s = tl.dot(q, tl.trans(k))
        if MASKED:
            keep = keys[None, :] < n_kv
            if IS_CAUSAL:
                keep = keep & (keys[None, :] <= offs_q[:, None])
            s = tl.where(keep, s, float("-inf"))
        p = tl.exp2(s * qk_scale - lse[:, None])
        dp = tl.dot(do, tl.trans(v))
        dq += tl.dot(p * (dp - delta[:, None]), k)
    return dq


NO_DELTA, NO_MASK, NATURAL_EXP = 1, 2, 3


@triton.jit
def _dq_inner_mistake(dq, q, do, lse, delta, K, V, stride_kn, offs_q, offs_d, kv_lo, kv_hi, n_kv, qk_scale,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_KV: tl.constexpr,
                      MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, MISTAKE: tl.constexpr):
    for start in range(kv_lo, kv_hi, BLOCK_KV):
        keys = start + tl.arange(0, BLOCK_KV)
        in_range = (keys[:, None] < n_kv) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(K + keys[:, None] * stride_kn + offs_d[None, :], mask=in_range, other=0.0)
        v = tl.load(V + keys[:, None] * stride_kn + offs_d[None, :], mask=in_range, other=0.0)
        s = tl.dot(q, tl.trans(k))
        if MASKED and MISTAKE != 2:
            keep = keys[None, :] < n_kv
            if IS_CAUSAL:
                keep = keep & (keys[None, :] <= offs_q[:, None])
            s = tl.where(keep, s, float("-inf"))
        if MISTAKE == 3:
            p = tl.exp(s * qk_scale - lse[:, None])
        else:
            p = tl.exp2(s * qk_scale - lse[:, None])
        dp = tl.dot(do, tl.trans(v))
        if MISTAKE == 1:
            dq += tl.dot(p * dp, k)
        else:
            dq += tl.dot(p * (dp - delta[:, None]), k)
    return dq


@triton.jit
def dq_no_delta(dq, q, do, lse, delta, K, V, stride_kn, offs_q, offs_d, kv_lo, kv_hi, n_kv, qk_scale,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_KV: tl.constexpr,
                MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr):
    return _dq_inner_mistake(dq, q, do, lse, delta, K, V, stride_kn, offs_q, offs_d, kv_lo, kv_hi, n_kv,
                             qk_scale, HEAD_DIM, BLOCK_D, BLOCK_KV, MASKED, IS_CAUSAL, 1)


@triton.jit
def dq_no_mask(dq, q, do, lse, delta, K, V, stride_kn, offs_q, offs_d, kv_lo, kv_hi, n_kv, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_KV: tl.constexpr,
               MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr):
    return _dq_inner_mistake(dq, q, do, lse, delta, K, V, stride_kn, offs_q, offs_d, kv_lo, kv_hi, n_kv,
                             qk_scale, HEAD_DIM, BLOCK_D, BLOCK_KV, MASKED, IS_CAUSAL, 2)


@triton.jit
def dq_natural_exp(dq, q, do, lse, delta, K, V, stride_kn, offs_q, offs_d, kv_lo, kv_hi, n_kv, qk_scale,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_KV: tl.constexpr,
                   MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr):
    return _dq_inner_mistake(dq, q, do, lse, delta, K, V, stride_kn, offs_q, offs_d, kv_lo, kv_hi, n_kv,
                             qk_scale, HEAD_DIM, BLOCK_D, BLOCK_KV, MASKED, IS_CAUSAL, 3)


@triton.jit
def dq_stub(dq, q, do, lse, delta, K, V, stride_kn, offs_q, offs_d, kv_lo, kv_hi, n_kv, qk_scale,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_KV: tl.constexpr,
            MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr):
    raise NotImplementedError()


def test_ch06_solutions_pass(capsys):
    ex.check_delta_kernel(delta_kernel)
    ex.check_dq_inner(dq_inner)
    assert capsys.readouterr().out.count("PASSED") == 2


@pytest.mark.parametrize("wrong,words", [
    (delta_stub, "not implemented yet"),
    (delta_unmasked_store, "wrote past the end of Delta"),
    (delta_no_column_mask, "Delta .*wrong at|NaN"),
    (delta_in_half, "lost precision|wrong at"),
])
def test_delta_kernel_mistakes(wrong, words):
    with pytest.raises(ex.ExerciseError, match=words):
        ex.check_delta_kernel(wrong)


@pytest.mark.parametrize("wrong,words", [
    (dq_stub, "not implemented yet"),
    (dq_no_delta, "forgot Delta"),
    (dq_no_mask, "no causal mask"),
    (dq_natural_exp, "exp instead of exp2"),
])
def test_dq_inner_mistakes(wrong, words, monkeypatch):
    monkeypatch.setattr("matplotlib.pyplot.show", lambda *a, **k: None)
    with pytest.raises(ex.ExerciseError, match=words):
        ex.check_dq_inner(wrong)


# Chapter 07 -----------------------------------------------------------------------------------

def rule_test(impl, q, k, v, is_causal=False):
    eps = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}[q.dtype]
    ours = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    base = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = impl(*ours, is_causal=is_causal)
    out_pt = naive_attention(*base, is_causal=is_causal)[0]
    out_ref = naive_attention(*ref, is_causal=is_causal)[0]
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(q.dtype).to(q.device)
    results = [("out", 2.0, out, out_pt, out_ref)]
    grads = [torch.autograd.grad(o, inputs, do.to(o.dtype)) for o, inputs in
             ((out, ours), (out_pt, base), (out_ref, ref))]
    for n, name in enumerate(("dq", "dk", "dv")):
        results.append((name, 3.0, grads[0][n], grads[1][n], grads[2][n]))
    for name, factor, x, pt, r in results:
        error = (x.double() - r).abs().max().item()
        baseline = (pt.double() - r).abs().max().item()
        bound = factor * baseline + 8 * eps * max(r.abs().max().item(), 1.0)
        if not error <= bound:
            return False
    return True


def test_ch07_rule_test_solution_passes(capsys):
    ex.check_rule_test(rule_test)
    assert "PASSED" in capsys.readouterr().out


def _forward_only(impl, q, k, v, is_causal=False):
    """Forgets the gradients."""
    out = impl(q, k, v, is_causal=is_causal)
    ref = naive_attention(q.double(), k.double(), v.double(), is_causal=is_causal)[0]
    pt = naive_attention(q, k, v, is_causal=is_causal)[0]
    eps = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}[q.dtype]
    return (out.double() - ref).abs().max() <= 2 * (pt.double() - ref).abs().max() + 8 * eps * max(ref.abs().max(), 1)


def _fixed_atol(impl, q, k, v, is_causal=False):
    out = impl(q, k, v, is_causal=is_causal)
    ref = naive_attention(q.double(), k.double(), v.double(), is_causal=is_causal)[0]
    return bool((out.double() - ref).abs().max() < 1e-2)


def _exact(impl, q, k, v, is_causal=False):
    out = impl(q, k, v, is_causal=is_causal)
    ref = naive_attention(q.double(), k.double(), v.double(), is_causal=is_causal)[0]
    return bool((out.double() - ref).abs().max() == 0)


@pytest.mark.parametrize("wrong,words", [
    (stub, "not implemented yet"),
    (_forward_only, "accepted a wrong implementation: the kernel with dK"),
    (_fixed_atol, "accepted a wrong implementation"),
    (_exact, "rejected a correct implementation"),
    (lambda *a, **k: "yes", "must return True or False"),
])
def test_rule_test_mistakes(wrong, words):
    with pytest.raises(ex.ExerciseError, match=words):
        ex.check_rule_test(wrong)


@triton.jit
def row_lse_kernel(X, LSE, n_rows, n_cols, stride_row, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    m = tl.full([BLOCK_ROWS], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_COLS):
        cols = start + tl.arange(0, BLOCK_COLS)
        inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        x = tl.load(X + rows[:, None] * stride_row + cols[None, :], mask=inside, other=0.0)
        x = tl.where(cols[None, :] < n_cols, x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=1))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
        m = m_new
    tl.store(LSE + rows, m + tl.log(l), mask=rows < n_rows)


@triton.jit
def row_lse_buggy(X, LSE, n_rows, n_cols, stride_row, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    m = tl.full([BLOCK_ROWS], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_COLS):
        cols = start + tl.arange(0, BLOCK_COLS)
        inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        x = tl.load(X + rows[:, None] * stride_row + cols[None, :], mask=inside, other=0.0)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
        m = m_new
    tl.store(LSE + rows, m + tl.log(l), mask=rows < n_rows)


@triton.jit
def row_lse_stub(X, LSE, n_rows, n_cols, stride_row, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    raise NotImplementedError()


def test_row_lse_solution_passes(capsys):
    ex.check_row_lse_kernel(row_lse_kernel)
    assert "PASSED" in capsys.readouterr().out


@pytest.mark.parametrize("wrong,words", [
    (row_lse_stub, "not implemented yet"),
    (row_lse_buggy, "not a multiple of BLOCK_COLS"),
])
def test_row_lse_mistakes(wrong, words):
    with pytest.raises(ex.ExerciseError, match=words):
        ex.check_row_lse_kernel(wrong)
