"""The plain-PyTorch references and the traversal twins, checked against first principles."""
import itertools

import numpy as np
import pytest
import torch

import flashattn
from flashattn.kernels import traversal
from flashattn.testing import reference
from flashattn.kernels.backward import attention_backward
from flashattn.kernels.forward import attention_forward

f64 = dict(dtype=torch.float64)


def test_naive_attention_matches_sdpa_and_logsumexp():
    q, k, v = (torch.randn(2, 3, n, 16, **f64) for n in (17, 23, 23))
    for causal in (False, True):
        out, lse = reference.naive_attention(q, k, v, is_causal=causal)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.testing.assert_close(out, sdpa)
        s = q @ k.transpose(-2, -1) / 4.0
        if causal:
            s = s.masked_fill(~reference.causal_mask(17, 23), float("-inf"))
        torch.testing.assert_close(lse, torch.logsumexp(s, -1))


def test_online_softmax_and_merge():
    x = torch.randn(5, 37, **f64) * 10
    for block in (1, 4, 16, 37, 64):
        torch.testing.assert_close(reference.online_softmax(x, block), torch.softmax(x, -1))
    trace = reference.online_softmax_trace(x, 8)
    assert trace["M"].shape == (5, 5)  # ceil(37 / 8) blocks, 5 rows
    torch.testing.assert_close(trace["M"][-1], x.max(-1).values)
    # M only grows, and alpha is 1 exactly when it did not.
    assert (trace["M"][1:] >= trace["M"][:-1]).all()
    assert torch.equal(trace["alpha"][1:] == 1, trace["M"][1:] == trace["M"][:-1])
    a, b = x[:, :20], x[:, 20:]
    m, l = reference.merge_states(a.max(-1).values, torch.exp(a - a.max(-1, keepdim=True).values).sum(-1),
                                  b.max(-1).values, torch.exp(b - b.max(-1, keepdim=True).values).sum(-1))
    torch.testing.assert_close(m + torch.log(l), torch.logsumexp(x, -1))


@pytest.mark.parametrize("block_q,block_kv", [(32, 16), (16, 32), (64, 64), (7, 5)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_tiled_forward_equals_naive(block_q, block_kv, is_causal):
    for n_q, n_kv in ((69, 69), (17, 113), (113, 17), (1, 1)):
        q, k, v = torch.randn(2, n_q, 24, **f64), torch.randn(2, n_kv, 24, **f64), torch.randn(2, n_kv, 24, **f64)
        out, lse = reference.tiled_forward(q, k, v, is_causal, block_q=block_q, block_kv=block_kv)
        ref_out, ref_lse = reference.naive_attention(q, k, v, is_causal)
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(lse, ref_lse)


def test_backward_formulas_equal_autograd():
    for causal in (False, True):
        q, k, v = (torch.randn(2, n, 16, **f64, requires_grad=True) for n in (29, 41, 41))
        out, lse = reference.naive_attention(q, k, v, is_causal=causal, scale=0.3)
        do = torch.randn_like(out)
        want = torch.autograd.grad(out, (q, k, v), do)
        got = reference.attention_backward(q, k, v, out, do, lse, is_causal=causal, scale=0.3)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)


@pytest.mark.parametrize("n_q,n_kv,block_q,block_kv", [
    (69, 69, 32, 16), (69, 69, 16, 32), (200, 130, 64, 16), (17, 113, 32, 32), (113, 17, 32, 16), (1, 1, 16, 16),
])
@pytest.mark.parametrize("is_causal", [False, True])
def test_block_classification_against_brute_force(n_q, n_kv, block_q, block_kv, is_causal):
    kinds = traversal.classify_blocks(n_q, n_kv, block_q, block_kv, is_causal)
    visible = reference.causal_mask(n_q, n_kv).numpy() if is_causal else np.ones((n_q, n_kv), bool)
    for qb, kb in itertools.product(*map(range, kinds.shape)):
        rows = slice(qb * block_q, (qb + 1) * block_q)
        cols = slice(kb * block_kv, (kb + 1) * block_kv)
        tile = visible[rows, cols]
        if tile.any():
            assert kinds[qb, kb] != traversal.SKIPPED, (qb, kb)  # nothing visible is ever skipped
        if kinds[qb, kb] == traversal.FULL:              # the unmasked path must be safe
            assert tile.all() and (kb + 1) * block_kv <= n_kv, (qb, kb)
        if kinds[qb, kb] == traversal.SKIPPED:
            assert not tile.any(), (qb, kb)
    # The masked stage never holds more tiles than one block of queries spans, plus one.
    assert ((kinds == traversal.MASKED).sum(1) <= -(-block_q // block_kv) + 1).all()


def test_q_ranges_cover_exactly_the_queries_that_see_a_key_block():
    for n_q, n_kv, block_q, block_kv, causal in itertools.product((1, 17, 69, 128), (1, 40, 69), (16, 32), (32, 64), (False, True)):
        for kv_start in range(0, n_kv, block_kv):
            start, full_start, full_end, end = traversal.q_ranges(kv_start, block_kv, block_q, n_q, causal)
            seen = [i for i in range(n_q) if not causal or i >= kv_start]
            assert list(range(start, end)) == seen or (not seen and start >= end)
            assert start <= full_start and full_end <= end
            # Whole unmasked blocks: every query there sees every key of the block.
            if full_end > full_start:
                assert (full_end - full_start) % block_q == 0
                assert not causal or full_start >= kv_start + block_kv - 1


@pytest.mark.parametrize("fwd,dkdv,dq", [
    (dict(BLOCK_Q=16, BLOCK_KV=32), dict(BLOCK_KV=16, BLOCK_Q=16), dict(BLOCK_Q=16, BLOCK_KV=32)),
    (dict(BLOCK_Q=64, BLOCK_KV=16), dict(BLOCK_KV=64, BLOCK_Q=32), dict(BLOCK_Q=64, BLOCK_KV=64)),
])
@pytest.mark.parametrize("is_causal", [False, True])
def test_kernels_with_other_tile_sizes(fwd, dkdv, dq, is_causal):
    """Every tile configuration the tuner may pick must give the same answer."""
    q, k, v = (torch.randn(1, 2, n, 40, **f64).to(flashattn.DEVICE) for n in (113, 69, 69))
    out, lse2 = attention_forward(q.float(), k.float(), v.float(), is_causal, 0.2, config=fwd)
    ref_out, ref_lse = reference.naive_attention(q, k, v, is_causal, scale=0.2)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse2.double() * np.log(2), ref_lse, atol=1e-5, rtol=1e-5)
    do = torch.randn_like(ref_out)
    grads = attention_backward(q.float(), k.float(), v.float(), out, lse2, do.float(), is_causal, 0.2,
                               configs={"bwd_dkdv": dkdv, "bwd_dq": dq})
    want = reference.attention_backward(q, k, v, ref_out, do, ref_lse, is_causal, scale=0.2)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=1e-5)
