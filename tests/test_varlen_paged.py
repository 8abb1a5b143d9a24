"""flashattn.varlen_attention over a paged KV cache (``block_table``, as ``flash_attn_varlen_func``
takes it): chunked prefill, a chunk of new queries per sequence against everything cached in its
pages. Checked against the float64 reference on the packed keys the pages stand for, under the
rule of flashattn.testing.rule. The pages are in random order, and every page row no sequence owns
holds NaN: a kernel that reads a wrong page or row fails loudly. Forward only (the backward is
refused). Sizes are tiny and odd (the interpreter runs them).
"""
import pytest
import torch

import flashattn
from flashattn.testing import reference
from flashattn.testing.rule import judge

DEVICE = flashattn.DEVICE
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def paged(lengths_k, page_size, max_blocks, kv_heads, head_dim, head_dim_v, dtype, seed=0, spare=2):
    """``(k_pages, v_pages, block_table, k, v)``: the pages (NaN where no sequence owns a row) and
    the packed keys and values ``(total_k, H_kv, D)`` they stand for."""
    g = torch.Generator().manual_seed(seed)
    batch = len(lengths_k)
    n_pages = batch * max_blocks + spare
    k_pages = torch.randn(n_pages, page_size, kv_heads, head_dim, generator=g)
    v_pages = torch.randn(n_pages, page_size, kv_heads, head_dim_v, generator=g)
    table = torch.randperm(n_pages, generator=g)[:batch * max_blocks].view(batch, max_blocks).int()
    owned = torch.zeros(n_pages, page_size, dtype=torch.bool)
    ks, vs = [], []
    for b, n in enumerate(lengths_k):
        for j in range(n):
            page, row = table[b, j // page_size], j % page_size
            owned[page, row] = True
            ks.append(k_pages[page, row])
            vs.append(v_pages[page, row])
    k = torch.stack(ks) if ks else k_pages.new_zeros(0, kv_heads, head_dim)
    v = torch.stack(vs) if vs else v_pages.new_zeros(0, kv_heads, head_dim_v)
    k_pages[~owned], v_pages[~owned] = float("nan"), float("nan")
    return (k_pages.to(DEVICE, dtype), v_pages.to(DEVICE, dtype), table.to(DEVICE),
            k.to(DEVICE, dtype), v.to(DEVICE, dtype))


def assert_rule(out, lse, q, k, v, cu_q, cu_k, **kwargs):
    ref, ref_lse = reference.varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k, **kwargs)
    low, low_lse = reference.varlen_attention(q, k, v, cu_q, cu_k, **kwargs)
    empty = ref_lse == float("-inf")
    assert torch.equal(lse == float("-inf"), empty)
    finite = [torch.where(empty, 0.0, t.double()) for t in (lse, ref_lse, low_lse)]
    checks = judge(dict(out=out, lse=finite[0]), dict(out=ref, lse=finite[1]), dict(out=low, lse=finite[2]),
                   q.dtype)
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


# Chunks of queries and the keys cached so far: an empty chunk, a chunk as long as the cache, a
# chunk shorter than a page, a cache that ends inside a page, a sequence without keys, a full table.
LENGTHS_Q = [0, 17, 5, 13, 3]
LENGTHS_K = [9, 17, 40, 0, 48]


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_prefill_over_pages(dtype, is_causal, alignment):
    """Grouped heads (4 query heads, 2 KV heads), v's head dim of its own."""
    k_pages, v_pages, table, k, v = paged(LENGTHS_K, 16, 3, 2, 24, 16, dtype)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(LENGTHS_Q), 4, 24, generator=g).to(DEVICE, dtype)
    cu_q, cu_k = cu(LENGTHS_Q), cu(LENGTHS_K)
    out, lse = flashattn.varlen_attention(q, k_pages, v_pages, cu_q, cu_k, 17, 48, is_causal, return_lse=True,
                                          enable_gqa=True, causal_alignment=alignment, block_table=table)
    assert out.shape == (sum(LENGTHS_Q), 4, 16) and out.dtype == dtype
    kwargs = dict(is_causal=is_causal, enable_gqa=True)
    if alignment == "bottom_right":
        kwargs["causal_alignment"] = "bottom_right"
    assert_rule(out, lse, q, k, v, cu_q, cu_k, **kwargs)


@pytest.mark.parametrize("page_size", [16, 32])
def test_pages_with_windows_softcap_and_alibi(page_size):
    k_pages, v_pages, table, k, v = paged(LENGTHS_K, page_size, 96 // page_size, 1, 20, 20, torch.float32, seed=2)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(LENGTHS_Q), 2, 20, generator=g).to(DEVICE)
    slopes = torch.rand(len(LENGTHS_Q), 2, generator=g).to(DEVICE) * 0.3
    cu_q, cu_k = cu(LENGTHS_Q), cu(LENGTHS_K)
    mods = dict(causal_alignment="bottom_right", softcap=5.0, alibi_slopes=slopes)
    out, lse = flashattn.varlen_attention(q, k_pages, v_pages, cu_q, cu_k, 17, 48, True, return_lse=True,
                                          enable_gqa=True, window_size=(6, 0), block_table=table, **mods)
    assert_rule(out, lse, q, k, v, cu_q, cu_k, is_causal=True, enable_gqa=True, window_size=(6, 0), **mods)


def test_pages_give_what_the_packed_keys_give():
    k_pages, v_pages, table, k, v = paged(LENGTHS_K, 16, 3, 2, 16, 16, torch.float32, seed=4)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(sum(LENGTHS_Q), 2, 16, generator=g).to(DEVICE)
    cu_q, cu_k = cu(LENGTHS_Q), cu(LENGTHS_K)
    args = (cu_q, cu_k, 17, 48, True)
    with torch.no_grad():
        from_pages = flashattn.varlen_attention(q, k_pages, v_pages, *args, return_lse=True, block_table=table,
                                                causal_alignment="bottom_right")
        packed = flashattn.varlen_attention(q, k, v, *args, return_lse=True, causal_alignment="bottom_right")
    torch.testing.assert_close(from_pages, packed, atol=1e-6, rtol=1e-6)


def test_the_backward_is_refused():
    k_pages, v_pages, table, _, _ = paged([5], 16, 1, 1, 16, 16, torch.float32)
    q = torch.randn(3, 1, 16, device=DEVICE, requires_grad=True)
    args = (cu([3]), cu([5]), 3, 5)
    with pytest.raises(ValueError, match="q requires grad.*block_table is forward only"):
        flashattn.varlen_attention(q, k_pages, v_pages, *args, block_table=table)
    with torch.no_grad():
        assert torch.isfinite(flashattn.varlen_attention(q, k_pages, v_pages, *args, block_table=table)).all()


def bad_args():
    k_pages, v_pages, table, _, _ = paged([5, 20], 16, 2, 1, 16, 16, torch.float32)
    q = torch.randn(4, 1, 16, device=DEVICE)
    return dict(q=q, k=k_pages, v=v_pages, cu_seqlens_q=cu([1, 3]), cu_seqlens_k=cu([5, 20]), max_seqlen_q=3,
                max_seqlen_k=20, block_table=table)


@pytest.mark.parametrize("change, error, words", [
    (dict(block_table=torch.zeros(2, 2, dtype=torch.int64)), TypeError, ["block_table", "int64", "int32"]),
    (dict(block_table=torch.zeros(3, 2, dtype=torch.int32)), ValueError, ["block_table", "(3, 2)", "(B, max_blocks) = (2, >= 1)"]),
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int32)), ValueError,
     ["cu_seqlens_k", "sequence 1", "20 keys", "block_table", "1 pages of 16"]),
    (dict(k=torch.zeros(6, 8, 1, 16), v=torch.zeros(6, 8, 1, 16)), ValueError, ["k", "page_size = 8", "multiple of 16"]),
    (dict(k=torch.zeros(36, 1, 16)), ValueError, ["k must be 4-D", "block_table"]),
    (dict(v=torch.zeros(5, 16, 1, 16)), ValueError, ["v has shape (5, 16, 1, 16)", "k has", "num_pages, page_size, H_kv"]),
])
def test_bad_paged_arguments_are_named(change, error, words):
    args = bad_args()
    args.update({name: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for name, t in change.items()})
    with pytest.raises(error) as info:
        flashattn.varlen_attention(**args)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_page_indices_are_checked_where_the_table_is_on_the_host():
    """On the interpreter the table is on the host: a page index past the cache is named. (On a
    GPU, checking would wait for it: each index is clamped into the cache instead.)"""
    if not flashattn.INTERPRET:
        pytest.skip("on a GPU the page indices are clamped, not checked")
    args = dict(bad_args(), block_table=torch.tensor([[0, 1], [2, 9]], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] is 9, but the caches have 6 pages"):
        flashattn.varlen_attention(**args)


def test_dropout_over_pages_draws_the_packed_calls_pairs():
    """Dropout through a paged cache draws what the same call on the packed keys draws (a pair is
    its sequence's row and column in the packed tensors, wherever its page lies): the same output,
    and the returned mask (return_dropout_mask) that the reference needs to reproduce it."""
    k_pages, v_pages, table, k, v = paged(LENGTHS_K, 16, 3, 2, 24, 16, torch.float32)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(sum(LENGTHS_Q), 2, 24, generator=g).to(DEVICE)
    cu_q, cu_k = cu(LENGTHS_Q), cu(LENGTHS_K)
    torch.manual_seed(3)
    out, keep = flashattn.varlen_attention(q, k_pages, v_pages, cu_q, cu_k, 17, 48, True, dropout_p=0.3,
                                           block_table=table, return_dropout_mask=True)
    torch.manual_seed(3)
    packed, packed_keep = flashattn.varlen_attention(q, k, v, cu_q, cu_k, 17, 48, True, dropout_p=0.3,
                                                     return_dropout_mask=True)
    assert torch.equal(keep, packed_keep) and torch.equal(out, packed)
    plain = flashattn.varlen_attention(q, k_pages, v_pages, cu_q, cu_k, 17, 48, True, block_table=table)
    assert keep.any() and not torch.equal(out, plain)   # some pairs kept, some dropped
    for b, (nq, nk) in enumerate(zip(LENGTHS_Q, LENGTHS_K)):
        if nq == 0:
            continue
        s_q, s_k = int(cu_q[b]), int(cu_k[b])
        qs, ks, vs = (t[s:s + n].transpose(0, 1).double() for t, s, n in ((q, s_q, nq), (k, s_k, nk), (v, s_k, nk)))
        expected, _ = reference.naive_attention(qs, ks, vs, is_causal=True, dropout_p=0.3,
                                                dropout_keep=keep[b, :, :nq, :nk])
        torch.testing.assert_close(out[s_q:s_q + nq].transpose(0, 1).double(), expected, rtol=0, atol=2e-6)
