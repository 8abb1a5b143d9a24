"""Packed sequences (``flashattn.varlen_attention``, the layout of flash_attn_varlen_func) against a
float64 reference that attends one sequence at a time; with grouped heads and sliding windows, and
sequences with no queries or no keys.
"""
from functools import partial

import numpy as np
import pytest
import torch

import flashattn
from flashattn.testing import reference
from flashattn.ops.attention import SUPPORTED_DTYPES as DTYPES
from flashattn.testing.rule import compare_with_reference
from flashattn.kernels.sequences import Sequences

DEVICE = flashattn.DEVICE


def cu_seqlens(lengths):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=DEVICE)


def make_packed(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), heads_q, head_dim, generator=g)
    k = torch.randn(sum(lengths_k), heads_kv, head_dim, generator=g)
    v = torch.randn(sum(lengths_k), heads_kv, head_dim, generator=g)
    return [t.to(dtype=dtype, device=DEVICE) for t in (q, k, v)]


def check_varlen(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, is_causal=False,
                 window_size=(-1, -1)):
    q, k, v = make_packed(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype)
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    gqa = heads_q != heads_kv
    impl = partial(flashattn.varlen_attention, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                   max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k), enable_gqa=gqa,
                   window_size=window_size)
    ref = partial(reference.varlen_attention, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, enable_gqa=gqa,
                  window_size=window_size)
    checks = compare_with_reference(q, k, v, is_causal=is_causal, impl=impl, reference=ref)
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lengths_q,lengths_k,heads_q,heads_kv,is_causal,window_size", [
    ([5, 40, 17], [9, 3, 50], 2, 2, False, (-1, -1)),          # ragged, keys shorter and longer
    ([33, 1, 70], [33, 0, 40], 4, 2, True, (-1, -1)),          # a sequence without keys, grouped
    ([37, 0, 20], [50, 12, 10], 3, 1, True, (6, -1)),          # no queries; causal window; one K/V head
    ([40, 17], [30, 45], 2, 2, False, (3, 2)),                 # a window on both sides
])
def test_varlen_against_reference(lengths_q, lengths_k, heads_q, heads_kv, is_causal, window_size, dtype):
    check_varlen(lengths_q, lengths_k, heads_q, heads_kv, 24, dtype, is_causal, window_size)


def test_one_sequence_is_plain_attention():
    q, k, v = make_packed([45], [45], 2, 2, 16, torch.float32)
    cu = cu_seqlens([45])
    out, lse = flashattn.varlen_attention(q, k, v, cu, cu, 45, 45, is_causal=True, return_lse=True)
    out_ref, lse_ref = flashattn.attention(*(t.transpose(0, 1) for t in (q, k, v)), is_causal=True,
                                           return_lse=True)
    torch.testing.assert_close(out, out_ref.transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-6, atol=1e-6)
    assert out.shape == q.shape and lse.shape == (2, 45) and lse.dtype == torch.float32


def test_sequences_do_not_see_each_other():
    """Changing one sequence's keys changes no other sequence's output."""
    q, k, v = make_packed([20, 30], [25, 35], 2, 2, 16, torch.float32)
    cu_q, cu_k = cu_seqlens([20, 30]), cu_seqlens([25, 35])
    out = flashattn.varlen_attention(q, k, v, cu_q, cu_k, 30, 35)
    k2, v2 = k.clone(), v.clone()
    k2[25:], v2[25:] = 5 * torch.randn_like(k2[25:]), torch.randn_like(v2[25:])
    out2 = flashattn.varlen_attention(q, k2, v2, cu_q, cu_k, 30, 35)
    assert torch.equal(out[:20], out2[:20]) and not torch.allclose(out[20:], out2[20:])


def test_program_table_covers_every_block_once():
    lengths_q, lengths_k = [5, 0, 40, 17, 64], [9, 3, 0, 50, 64]
    seqs = Sequences(cu_seqlens(lengths_q), cu_seqlens(lengths_k), lengths_q, lengths_k)
    for side, lengths in (("q", lengths_q), ("kv", lengths_k)):
        for block in (16, 32):
            table = seqs.programs(side, block, 1000, 0).tolist()
            expected = [(s, b) for s, n in enumerate(lengths) for b in range(-(-n // block))]
            assert sorted(map(tuple, table)) == expected
    causal = seqs.programs("q", 16, 1000, 0).tolist()
    assert causal[0] == [4, 3]  # the block with the most keys to visit starts first


def test_varlen_writes_every_element(nan_buffers):
    """Sequences without keys, without queries, and keys no query sees (a window, causal tails):
    every output and gradient element is written, finite, and zero where nothing is seen."""
    from flashattn.kernels import backward
    assert torch.isnan(backward.torch.empty_like(torch.zeros(2))).all()  # the fixture is in place
    lengths_q, lengths_k = [20, 0, 30, 5], [40, 17, 0, 33]
    q, k, v = (t.requires_grad_() for t in make_packed(lengths_q, lengths_k, 4, 2, 16, torch.float32))
    out, lse = flashattn.varlen_attention(q, k, v, cu_seqlens(lengths_q), cu_seqlens(lengths_k), 30, 40,
                                          is_causal=True, return_lse=True, enable_gqa=True,
                                          window_size=(4, -1))
    dq, dk, dv = torch.autograd.grad(out.sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum(),
                                     (q, k, v))
    for t in (out, dq, dk, dv):
        assert torch.isfinite(t).all()
    assert (out[20:50] == 0).all() and (lse[:, 20:50] == float("-inf")).all()   # the keyless sequence
    assert (dk[20:40] == 0).all() and (dk[40:57] == 0).all()   # keys 20..39: past every query; no queries
    assert (dv[20:40] == 0).all() and (dv[40:57] == 0).all()


def test_varlen_backward_is_deterministic():
    lengths = [30, 7, 45]
    q, k, v = (t.requires_grad_() for t in make_packed(lengths, lengths, 4, 1, 16, torch.float32))
    cu = cu_seqlens(lengths)
    run = lambda: torch.autograd.grad(  # noqa: E731
        flashattn.varlen_attention(q, k, v, cu, cu, 45, 45, is_causal=True, enable_gqa=True).sum(), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(run(), run()))


def test_varlen_takes_int64_cu_seqlens():
    """int64 cumulative lengths (what torch.cumsum of lengths gives) run as int32 ones do, forward
    and backward; a total past int32's range is refused by name."""
    lengths = [5, 0, 9]
    q, k, v = (t.requires_grad_() for t in make_packed(lengths, lengths, 2, 1, 16, torch.float32))
    cu = cu_seqlens(lengths)
    results = []
    for bounds in (cu, cu.long()):
        out = flashattn.varlen_attention(q, k, v, bounds, bounds, 9, 9, is_causal=True, enable_gqa=True)
        results.append((out, *torch.autograd.grad(out.sum(), (q, k, v))))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    with pytest.raises(ValueError, match=r"cu_seqlens_k: 2147483648 tokens; at most 2\*\*31 - 1 are supported"):
        from flashattn.ops.varlen import _check_cu_seqlens  # the total cannot be reached with real tensors
        _check_cu_seqlens("cu_seqlens_k", torch.tensor([0, 2 ** 31], device=DEVICE), 2 ** 31, q.device)


def test_varlen_errors():
    q, k, v = make_packed([5, 7], [5, 7], 2, 2, 16, torch.float32)
    cu = cu_seqlens([5, 7])
    call = lambda **kw: flashattn.varlen_attention(  # noqa: E731
        **{"q": q, "k": k, "v": v, "cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": 7,
           "max_seqlen_k": 7, **kw})
    with pytest.raises(TypeError, match=r"cu_seqlens_q has dtype torch.int16; expected torch.int32 \(or torch.int64\)"):
        call(cu_seqlens_q=cu.short())  # int64 is accepted (converted): tests/test_sdpa_dropin.py
    with pytest.raises(ValueError, match="cu_seqlens_k is on meta"):
        call(cu_seqlens_k=torch.zeros(3, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0; got 1"):
        call(cu_seqlens_q=torch.tensor([1, 5, 12], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing; it decreases from 8 to 5"):
        call(cu_seqlens_k=torch.tensor([0, 8, 5, 12], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="cu_seqlens_q must end at the number of tokens, 12; got 11"):
        call(cu_seqlens_q=torch.tensor([0, 5, 11], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="cu_seqlens_q must be 1-D"):
        call(cu_seqlens_q=cu[None])
    with pytest.raises(ValueError, match="cu_seqlens_q has 3 entries but cu_seqlens_k has 4"):
        call(cu_seqlens_k=torch.tensor([0, 5, 5, 12], dtype=torch.int32, device=DEVICE))
    with pytest.raises(TypeError, match="cu_seqlens_q must be a torch.Tensor"):
        call(cu_seqlens_q=[0, 5, 12])
    with pytest.raises(ValueError, match="max_seqlen_q is 6 but the longest sequence in cu_seqlens_q has 7"):
        call(max_seqlen_q=6)
    with pytest.raises(TypeError, match="max_seqlen_k must be an int"):
        call(max_seqlen_k=7.0)
    with pytest.raises(ValueError, match="q must be 3-D"):
        call(q=q[None])
    with pytest.raises(ValueError, match="k has 1 heads but q has 2"):
        call(k=k[:, :1], v=v[:, :1])
    with pytest.raises(TypeError, match="window_size"):
        call(window_size=3)


def test_bench_variants_quick(tmp_path):
    """The benchmark's tiny mode runs through the interpreter and writes its three CSVs."""
    from flashattn.measure import variants as bench_variants
    paths = bench_variants.main(["--quick", "--out-dir", str(tmp_path)])
    for name in ("varlen", "gqa", "window"):
        rows = (tmp_path / f"variants_{name}.csv").read_text().splitlines()
        assert rows[0].startswith("gpu,") and len(rows) > 2, name
    assert len(paths) == 3


# --- On a GPU: compiled, bf16 on the tensor cores, long sequences ---------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("is_causal,window_size", [(False, (-1, -1)), (True, (-1, -1)), (True, (500, -1))])
def test_varlen_long_on_gpu(dtype, is_causal, window_size):
    lengths = [1, 2000, 0, 777, 3000, 129]
    check_varlen(lengths, lengths, 8, 2, 128, dtype, is_causal, window_size)


@pytest.mark.gpu
def test_varlen_against_sdpa_per_sequence_on_gpu():
    rng = np.random.default_rng(0)
    lengths = rng.integers(100, 3000, size=12).tolist()
    q, k, v = make_packed(lengths, lengths, 16, 16, 128, torch.bfloat16)
    cu = cu_seqlens(lengths)
    out = flashattn.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), is_causal=True)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True).transpose(0, 1)
        assert (out[a:b].float() - ref.float()).abs().max().item() < 2e-2


@pytest.mark.gpu
def test_varlen_unwritten_and_deterministic_on_gpu():
    lengths_q, lengths_k = [3000, 0, 100, 2048], [1000, 500, 0, 4096]
    q, k, v = (t.requires_grad_() for t in make_packed(lengths_q, lengths_k, 8, 2, 128, torch.bfloat16))
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    run = lambda: torch.autograd.grad(flashattn.varlen_attention(  # noqa: E731
        q, k, v, cu_q, cu_k, 3000, 4096, is_causal=True, enable_gqa=True).float().sum(), (q, k, v))
    first = run()
    assert all(torch.isfinite(t).all() for t in first)
    assert (first[1][1000:1500] == 0).all() and (first[1][1500 + 2048:] == 0).all()
    assert all(torch.equal(a, b) for a, b in zip(first, run()))
