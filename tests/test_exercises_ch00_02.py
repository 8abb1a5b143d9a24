"""The exercise checkers of chapters 00-02: the notebooks' solutions pass, stubs and typical
mistakes fail with a message that names the mistake."""
import math

import pytest
import torch

from flashattn import exercises as ex
from flashattn.exercises import ExerciseError

LOG2E = 1.0 / math.log(2.0)


def stub(*args, **kwargs):
    raise NotImplementedError()


# --- chapter 00 -----------------------------------------------------------------------------------

def naive_causal_attention(q, k, v, scale):
    s = q @ k.transpose(-2, -1) * scale
    n_q, n_kv = s.shape[-2], s.shape[-1]
    hidden = torch.arange(n_kv)[None, :] > torch.arange(n_q)[:, None]
    p = torch.softmax(s.masked_fill(hidden, float("-inf")), dim=-1)
    return p @ v


def no_mask(q, k, v, scale):
    return torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) @ v


def bottom_right(q, k, v, scale):
    n_q, n_kv = q.shape[-2], k.shape[-2]
    hidden = torch.arange(n_kv)[None, :] > torch.arange(n_q)[:, None] + n_kv - n_q
    s = (q @ k.transpose(-2, -1) * scale).masked_fill(hidden, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def fixed_scale(q, k, v, scale):
    return naive_causal_attention(q, k, v, q.shape[-1] ** -0.5)


def zero_fill(q, k, v, scale):
    n_q, n_kv = q.shape[-2], k.shape[-2]
    hidden = torch.arange(n_kv)[None, :] > torch.arange(n_q)[:, None]
    return torch.softmax((q @ k.transpose(-2, -1) * scale).masked_fill(hidden, 0.0), dim=-1) @ v


def strict_mask(q, k, v, scale):
    n_q, n_kv = q.shape[-2], k.shape[-2]
    hidden = torch.arange(n_kv)[None, :] >= torch.arange(n_q)[:, None]
    return torch.softmax((q @ k.transpose(-2, -1) * scale).masked_fill(hidden, float("-inf")), -1) @ v


def score_bytes(batch, heads, n, dtype):
    return 2 * batch * heads * n * n * torch.empty((), dtype=dtype).element_size()


def test_ch00_solutions_pass(capsys):
    ex.check_naive_causal_attention(naive_causal_attention)
    ex.check_score_bytes(score_bytes)
    assert capsys.readouterr().out.count("PASSED") == 2


@pytest.mark.parametrize("wrong,message", [
    (stub, "not implemented yet"),
    (no_mask, "WITHOUT the causal mask"),
    (bottom_right, "bottom-right"),
    (fixed_scale, "use the `scale` argument"),
    (zero_fill, "-inf before the softmax, not 0"),
    (strict_mask, "NaN in query row 0"),
    (lambda q, k, v, scale: (naive_causal_attention(q, k, v, scale), None), "return only the output"),
])
def test_naive_causal_attention_catches(wrong, message):
    with pytest.raises(ExerciseError, match=message):
        ex.check_naive_causal_attention(wrong)


@pytest.mark.parametrize("wrong,message", [
    (stub, "not implemented yet"),
    (lambda b, h, n, dtype: b * h * n * n * torch.empty((), dtype=dtype).element_size(), "ONE matrix"),
    (lambda b, h, n, dtype: 2 * b * h * n * n * 4, "4 bytes per element"),
    (lambda b, h, n, dtype: 2 * b * h * n * torch.empty((), dtype=dtype).element_size(), "squared"),
    (lambda b, h, n, dtype: 8 * b * h * n * n, "4 bytes|expected"),
    (lambda b, h, n, dtype: 2 * b * h * n * n * 2.5, "expected|whole number"),
    (lambda b, h, n, dtype: "many", "return a number"),
])
def test_score_bytes_catches(wrong, message):
    with pytest.raises(ExerciseError, match=message):
        ex.check_score_bytes(wrong)


# --- chapter 01 -----------------------------------------------------------------------------------

def online_softmax(x, block):
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for start in range(0, x.shape[-1], block):
        xb = x[:, start:start + block]
        m_new = torch.maximum(m, xb.max(dim=-1).values)
        l = l * torch.exp(m - m_new) + torch.exp(xb - m_new[:, None]).sum(dim=-1)
        m = m_new
    return torch.exp(x - m[:, None]) / l[:, None]


def merge_softmax_states(m_a, l_a, m_b, l_b):
    m = torch.maximum(m_a, m_b)
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    return m, l_a * torch.exp(m_a - m_safe) + l_b * torch.exp(m_b - m_safe)


def online_softmax_weighted_sum(s, v, block):
    m = torch.full(s.shape[:-1], float("-inf"), dtype=s.dtype)
    l = torch.zeros(s.shape[:-1], dtype=s.dtype)
    acc = torch.zeros(s.shape[0], v.shape[-1], dtype=s.dtype)
    for start in range(0, s.shape[-1], block):
        sb, vb = s[:, start:start + block], v[start:start + block]
        m_new = torch.maximum(m, sb.max(dim=-1).values)
        p = torch.exp(sb - m_new[:, None])
        alpha = torch.exp(m - m_new)
        l = l * alpha + p.sum(dim=-1)
        acc = acc * alpha[:, None] + p @ vb
        m = m_new
    return acc / l[:, None]


def test_ch01_solutions_pass(capsys):
    ex.check_online_softmax(online_softmax)
    ex.check_merge_softmax_states(merge_softmax_states)
    ex.check_online_softmax_weighted_sum(online_softmax_weighted_sum)
    assert capsys.readouterr().out.count("PASSED") == 3


def online_softmax_no_alpha(x, block):
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for start in range(0, x.shape[-1], block):
        xb = x[:, start:start + block]
        m = torch.maximum(m, xb.max(dim=-1).values)
        l = l + torch.exp(xb - m[:, None]).sum(dim=-1)
    return torch.exp(x - m[:, None]) / l[:, None]


def online_softmax_drop_tail(x, block):
    n = x.shape[-1]
    keep = n - n % block if n > block else n  # forgets the last, shorter block
    out = torch.zeros_like(x)
    out[:, :keep] = online_softmax(x[:, :keep], block)
    return out


@pytest.mark.parametrize("wrong,message", [
    (stub, "not implemented yet"),
    (online_softmax_no_alpha, "never rescaled"),
    (lambda x, block: torch.exp(x) / torch.exp(x).sum(-1, keepdim=True), "inf or NaN"),
    (online_softmax_drop_tail, "last, shorter block"),
])
def test_online_softmax_catches(wrong, message):
    with pytest.raises(ExerciseError, match=message):
        ex.check_online_softmax(wrong)


def merge_without_guard(m_a, l_a, m_b, l_b):
    m = torch.maximum(m_a, m_b)
    return m, l_a * torch.exp(m_a - m) + l_b * torch.exp(m_b - m)


def merge_factored(m_a, l_a, m_b, l_b):
    # (l_a e^(m_a - m_b) + l_b) e^(m_b - m) is right on paper, but gives inf * 0 when b is empty
    m = torch.maximum(m_a, m_b)
    return m, (l_a * torch.exp(m_a - m_b) + l_b) * torch.exp(m_b - m)


@pytest.mark.parametrize("wrong,message", [
    (stub, "not implemented yet"),
    (lambda m_a, l_a, m_b, l_b: (torch.maximum(m_a, m_b), l_a + l_b), "l_a \\+ l_b"),
    (lambda m_a, l_a, m_b, l_b: (torch.maximum(m_a, m_b),
                                 l_a + l_b * torch.exp(m_b - torch.maximum(m_a, m_b))), "only l_b"),
    (lambda m_a, l_a, m_b, l_b: (torch.minimum(m_a, m_b), l_a + l_b), "LARGER"),
    (lambda m_a, l_a, m_b, l_b: torch.maximum(m_a, m_b), "tuple of 2"),
    (merge_without_guard, "both pieces are empty"),
    (merge_factored, "overflows"),
    (lambda m_a, l_a, m_b, l_b: merge_softmax_states(m_a, l_a, m_b, l_b) if torch.isfinite(m_a).all()
     and torch.isfinite(m_b).all() else (torch.maximum(m_a, m_b), torch.full_like(l_a, float("nan"))),
     "one piece is empty"),
])
def test_merge_softmax_states_catches(wrong, message):
    with pytest.raises(ExerciseError, match=message):
        ex.check_merge_softmax_states(wrong)


def weighted_sum_variant(rescale_l=True, rescale_acc=True, safe=True):
    def fn(s, v, block):
        m = torch.full(s.shape[:-1], float("-inf"), dtype=s.dtype)
        l = torch.zeros(s.shape[:-1], dtype=s.dtype)
        acc = torch.zeros(s.shape[0], v.shape[-1], dtype=s.dtype)
        for start in range(0, s.shape[-1], block):
            sb, vb = s[:, start:start + block], v[start:start + block]
            m_new = torch.maximum(m, sb.max(dim=-1).values) if safe else torch.zeros_like(m)
            p = torch.exp(sb - m_new[:, None])
            alpha = torch.exp(m - m_new) if safe else torch.ones_like(m)
            l = (l * alpha if rescale_l else l) + p.sum(dim=-1)
            acc = (acc * alpha[:, None] if rescale_acc else acc) + p @ vb
            m = m_new
        return acc / l[:, None]
    return fn


@pytest.mark.parametrize("wrong,message", [
    (stub, "not implemented yet"),
    (weighted_sum_variant(rescale_acc=False), "accumulator O was not rescaled"),
    (weighted_sum_variant(rescale_l=False), "L was not rescaled"),
    (weighted_sum_variant(rescale_l=False, rescale_acc=False), "neither L nor O"),
    (weighted_sum_variant(safe=False), "inf or NaN"),
])
def test_online_softmax_weighted_sum_catches(wrong, message):
    with pytest.raises(ExerciseError, match=message):
        ex.check_online_softmax_weighted_sum(wrong)


# --- chapter 02 -----------------------------------------------------------------------------------

def lse_from_state(m2, l):
    return (m2 + torch.log2(l)) * math.log(2.0)


def softmax_exp2(s, scale):
    qk_scale = scale * LOG2E
    m = (s * qk_scale).max(dim=-1, keepdim=True).values
    p = torch.exp2(s * qk_scale - m)
    return p / p.sum(dim=-1, keepdim=True)


def test_ch02_solutions_pass(capsys):
    ex.check_lse_from_state(lse_from_state)
    ex.check_softmax_exp2(softmax_exp2)
    assert capsys.readouterr().out.count("PASSED") == 2


@pytest.mark.parametrize("wrong,message", [
    (stub, "not implemented yet"),
    (lambda m2, l: m2 + torch.log2(l), "base-2 value"),
    (lambda m2, l: m2 + torch.log(l), "m2 \\+ ln\\(l\\)"),
    (lambda m2, l: (m2 + torch.log2(l)) / math.log(2.0), "MULTIPLY"),
    (lambda m2, l: m2 * math.log(2.0) + torch.log2(l), "whole sum"),
])
def test_lse_from_state_catches(wrong, message):
    with pytest.raises(ExerciseError, match=message):
        ex.check_lse_from_state(wrong)


def softmax_exp2_no_log2e(s, scale):
    y = s * scale
    p = torch.exp2(y - y.max(-1, keepdim=True).values)
    return p / p.sum(-1, keepdim=True)


@pytest.mark.parametrize("wrong,message", [
    (stub, "not implemented yet"),
    (softmax_exp2_no_log2e, "ln 2"),
    (lambda s, scale: torch.softmax(s, -1), "scale is missing"),
    (lambda s, scale: torch.exp2(s * scale * LOG2E) / torch.exp2(s * scale * LOG2E).sum(-1, keepdim=True),
     "inf or NaN"),
    (lambda s, scale: torch.softmax(s * scale * LOG2E, -1), "did you use exp"),
])
def test_softmax_exp2_catches(wrong, message):
    with pytest.raises(ExerciseError, match=message):
        ex.check_softmax_exp2(wrong)
