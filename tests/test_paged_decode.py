"""flashattn.decode on a paged KV cache (``block_table``, as ``flash_attn_with_kvcache``) and with
ALiBi slopes, against float64 references.

A paged cache ``(num_pages, page_size, H_kv, D)`` is checked against ``decode_reference`` on the
contiguous cache it stands for (``gather_pages``). The pages are a random permutation of the
cache's, and every page no table names, and every row past a sequence's length, holds NaN: a kernel
that reads a wrong page or row fails loudly. Sizes are tiny and odd (the interpreter runs them).
"""
import pytest
import torch

import flashattn
from flashattn.kernels.decode import decode_forward
from flashattn.testing.reference import decode_reference, gather_pages
from flashattn.testing.rule import judge

DEVICE = flashattn.DEVICE
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def paged_cache(lengths, page_size, max_blocks, kv_heads, head_dim, dtype, seed=0, spare=3):
    """``(k_cache, v_cache, block_table)``: ``B * max_blocks + spare`` pages, each sequence's
    ``max_blocks`` of them drawn at random; NaN in the spare pages and past each length."""
    g = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    n_pages = batch * max_blocks + spare
    k, v = (torch.randn(n_pages, page_size, kv_heads, head_dim, generator=g) for _ in range(2))
    table = torch.randperm(n_pages, generator=g)[:batch * max_blocks].view(batch, max_blocks).int()
    used = torch.zeros(n_pages, page_size, dtype=torch.bool)
    for b, length in enumerate(lengths):
        for j in range(length):
            used[table[b, j // page_size], j % page_size] = True
    k[~used], v[~used] = float("nan"), float("nan")
    return k.to(DEVICE, dtype), v.to(DEVICE, dtype), table.to(DEVICE)


def queries(batch, heads, n_q, head_dim, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, n_q, head_dim, generator=g).to(DEVICE, dtype)


def alibi(heads, batch=None, seed=2):
    """Slopes as ALiBi draws them (powers of 2 below 1), shuffled and jittered per sequence."""
    g = torch.Generator().manual_seed(seed)
    base = 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads)
    slopes = base[torch.randperm(heads, generator=g)]
    if batch is not None:
        slopes = slopes * (0.5 + torch.rand(batch, 1, generator=g))
    return slopes.float().to(DEVICE)


def zero_nan(t):
    return torch.nan_to_num(t, nan=0.0)  # the reference multiplies 0 by every value: no NaN there


def assert_rule(out, lse, q, k, v, lengths, **mods):
    """decode's ``(out, lse)`` against float64 and against PyTorch in q's dtype (the rule), on
    the contiguous caches ``k``, ``v``; rows without keys exactly 0 and -inf."""
    k, v = zero_nan(k), zero_nan(v)
    ref, ref_lse = decode_reference(q.double(), k.double(), v.double(), lengths, **mods)
    low, low_lse = decode_reference(q, k, v, lengths, **mods)
    empty = ref_lse == float("-inf")
    assert torch.equal(lse == float("-inf"), empty)
    assert torch.isfinite(out).all() and (out[empty] == 0).all()
    finite = [torch.where(empty, 0.0, t.double()) for t in (lse, ref_lse, low_lse)]
    checks = judge(dict(out=out, lse=finite[0]), dict(out=ref, lse=finite[1]), dict(out=low, lse=finite[2]),
                   q.dtype)
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


@pytest.mark.parametrize("n_q", [1, 3])
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_decode_against_the_gathered_cache(dtype, page_size, n_q):
    """Ragged lengths (empty, the shortest, inside a page, on a page's end, a full table), grouped
    heads (4 query heads per KV head), pages in random order."""
    max_blocks = 96 // page_size
    lengths = [0, n_q, 17, 2 * page_size, 96]
    k, v, table = paged_cache(lengths, page_size, max_blocks, 1, 20, dtype)
    q = queries(len(lengths), 4, n_q, 20, dtype)
    lens = torch.tensor(lengths, dtype=torch.int32)
    with torch.no_grad():
        out, lse = flashattn.decode(q, k, v, lens, block_table=table, return_lse=True)
    assert out.shape == q.shape and out.dtype == dtype
    assert_rule(out, lse, q, gather_pages(k, table), gather_pages(v, table), lens)


@pytest.mark.parametrize("page_size", [16, 48])
@pytest.mark.parametrize("block_kv", [16, 64])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_key_tiles_across_pages_and_splits(block_kv, num_splits, page_size):
    """Tiles of 64 keys span four pages of 16, or straddle pages of 48 (the gather of rows); split
    bounds fall inside pages."""
    lengths = [113, 40, 1]
    k, v, table = paged_cache(lengths, page_size, -(-128 // page_size), 2, 16, torch.float32, seed=3)
    q = queries(3, 2, 1, 16, torch.float32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    with torch.no_grad():
        out, lse = decode_forward(q, k, v, lens.to(DEVICE), 113, 0.25, num_splits, dict(BLOCK_KV=block_kv),
                                  block_table=table)
    assert_rule(out, lse.view(3, 2, 1), q, gather_pages(k, table), gather_pages(v, table), lens, scale=0.25)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("softcap, window", [(4.0, -1), (0.0, 5), (3.0, 20)])
def test_paged_decode_with_softcap_and_windows(dtype, softcap, window):
    lengths = [0, 2, 37, 64]
    k, v, table = paged_cache(lengths, 16, 4, 2, 24, dtype, seed=4)
    q = queries(4, 4, 2, 24, dtype)
    lens = torch.tensor(lengths, dtype=torch.int64)  # decode takes int64 lengths too
    with torch.no_grad():
        out, lse = flashattn.decode(q, k, v, lens, block_table=table, softcap=softcap, window_size=(window, 0),
                                    return_lse=True)
    assert_rule(out, lse, q, gather_pages(k, table), gather_pages(v, table), lens, softcap=softcap,
                window=window)


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_appending_writes_the_pages_in_place(dtype, page_size):
    """k_new and v_new land at rows cache_seqlens .. + N_q - 1 of each sequence's pages (one step
    crosses a page boundary), in the same memory; no other row changes; attention runs over them."""
    n_q, max_blocks = 3, 64 // page_size
    before = [0, page_size - 1, 30, 61]
    k, v, table = paged_cache([n + n_q for n in before], page_size, max_blocks, 2, 16, dtype, seed=5)
    g = torch.Generator().manual_seed(6)
    k_new, v_new = (torch.randn(4, 2, n_q, 16, generator=g).to(DEVICE, dtype) for _ in range(2))
    q = queries(4, 4, n_q, 16, dtype)
    want_k, want_v = gather_pages(k, table).clone(), gather_pages(v, table).clone()
    for b, n in enumerate(before):
        want_k[b, :, n:n + n_q], want_v[b, :, n:n + n_q] = k_new[b], v_new[b]
    spare = torch.ones(k.shape[0], dtype=torch.bool)
    spare[table.flatten().long()] = False
    k_spare = k[spare].clone()
    k_ptr, v_ptr = k.data_ptr(), v.data_ptr()
    lens = torch.tensor(before, dtype=torch.int32)
    with torch.no_grad():
        out, lse = flashattn.decode(q, k, v, lens, k_new=k_new, v_new=v_new, block_table=table, return_lse=True)
    assert k.data_ptr() == k_ptr and v.data_ptr() == v_ptr
    same = torch.equal  # NaN rows (past the new lengths) compare by position
    assert same(gather_pages(k, table).isnan(), want_k.isnan()) and same(zero_nan(gather_pages(k, table)), zero_nan(want_k))
    assert same(zero_nan(gather_pages(v, table)), zero_nan(want_v))
    assert k[spare].isnan().all() and k_spare.isnan().all()  # the pages no table names: untouched
    assert_rule(out, lse, q, want_k, want_v, lens + n_q)


def test_paged_caches_of_any_strides():
    """K and V as views into one pool (num_pages, 2, page_size, H_kv, D), and heads first within a
    page: the same output as contiguous pages."""
    lengths = [30, 7]
    k, v, table = paged_cache(lengths, 16, 2, 2, 16, torch.float16, seed=13)
    q = queries(2, 4, 1, 16, torch.float16)
    lens = torch.tensor(lengths, dtype=torch.int32)
    pool = torch.stack((k, v), dim=1)                              # (num_pages, 2, 16, 2, 16)
    heads_first = torch.stack((k, v)).transpose(2, 3).contiguous().transpose(2, 3)  # (2, pages, 16, 2, 16)
    with torch.no_grad():
        want = flashattn.decode(q, k, v, lens, block_table=table)
        for k_view, v_view in ((pool[:, 0], pool[:, 1]), (heads_first[0], heads_first[1])):
            assert not k_view.is_contiguous()
            got = flashattn.decode(q, k_view, v_view, lens, block_table=table)
            torch.testing.assert_close(got, want, atol=1e-3, rtol=0)  # a wrong row would be far off (or NaN)


def test_each_call_reads_its_own_block_table():
    """Two tables of the same shape over one pool (the plan is shared): each call follows its own."""
    lengths = [40, 25]
    k, v, table = paged_cache(lengths, 16, 3, 1, 16, torch.float32, seed=14, spare=0)
    k, v = zero_nan(k), zero_nan(v)
    q = queries(2, 2, 1, 16, torch.float32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    for t in (table, table.flip(0).contiguous(), table.flip(1).contiguous()):
        with torch.no_grad():
            out, lse = flashattn.decode(q, k, v, lens, block_table=t, return_lse=True)
        assert_rule(out, lse, q, gather_pages(k, t), gather_pages(v, t), lens)


def test_a_paged_step_matches_the_contiguous_step():
    """Append, rotary embedding, GQA, softcap, a window and ALiBi together: the paged step gives
    the contiguous step's output and cache, the lengths checked on the host or bound by max_seqlen."""
    n_q, before = 2, [5, 0, 40]
    k, v, table = paged_cache([n + n_q for n in before], 16, 4, 2, 16, torch.float32, seed=7)
    k, v = zero_nan(k), zero_nan(v)
    g = torch.Generator().manual_seed(8)
    k_new, v_new = (torch.randn(3, 2, n_q, 16, generator=g).to(DEVICE) for _ in range(2))
    q = queries(3, 4, n_q, 16, torch.float32)
    angles = torch.arange(64.0)[:, None] * 10000.0 ** (-torch.arange(0, 8, 2) / 8)
    mods = dict(rotary_cos=angles.cos().to(DEVICE), rotary_sin=angles.sin().to(DEVICE), softcap=6.0,
                window_size=(9, 0), alibi_slopes=alibi(4, 3), return_lse=True)
    lens = torch.tensor(before, dtype=torch.int32)
    k_flat, v_flat = gather_pages(k, table).clone(), gather_pages(v, table).clone()
    with torch.no_grad():
        want = flashattn.decode(q, k_flat, v_flat, lens, k_new=k_new, v_new=v_new, **mods)
        for bound in (dict(), dict(max_seqlen=64)):
            k_paged, v_paged = k.clone(), v.clone()
            got = flashattn.decode(q, k_paged, v_paged, lens.to(DEVICE), k_new=k_new, v_new=v_new,
                                   block_table=table, **mods, **bound)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
            assert torch.equal(gather_pages(k_paged, table), k_flat)
            assert torch.equal(gather_pages(v_paged, table), v_flat)


def test_bad_page_indices_are_clamped_when_not_checked():
    """With max_seqlen nothing is read on the host: an index past the cache must not make the
    kernel or the append read or write outside it (each is clamped to the last page)."""
    k, v, table = paged_cache([20, 20], 16, 2, 1, 16, torch.float32, seed=9, spare=0)
    k, v = zero_nan(k), zero_nan(v)
    bad = table.clone()
    bad[1, 1] = 10**6
    q = queries(2, 1, 1, 16, torch.float32)
    k_new = v_new = torch.ones(2, 1, 1, 16, device=DEVICE)
    with torch.no_grad():
        out = flashattn.decode(q, k, v, torch.tensor([19, 19], dtype=torch.int32, device=DEVICE),
                               max_seqlen=32, block_table=bad, k_new=k_new, v_new=v_new)
    assert torch.isfinite(out).all()
    assert torch.equal(k[k.shape[0] - 1, 3], torch.ones(1, 16, device=DEVICE))  # row 19 % 16 of the last page


# -- ALiBi ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("n_q", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_alibi_in_decode_against_the_reference(dtype, n_q, batched):
    """Slopes (H_q,) or (B, H_q), each row of a GQA tile its own head's, over ragged lengths."""
    g = torch.Generator().manual_seed(10)
    lengths = torch.tensor([0, n_q, 29, 70], dtype=torch.int32)
    k, v = (torch.randn(4, 2, 70, 24, generator=g).to(DEVICE, dtype) for _ in range(2))
    q = queries(4, 6, n_q, 24, dtype)
    slopes = alibi(6, 4 if batched else None)
    with torch.no_grad():
        out, lse = flashattn.decode(q, k, v, lengths, alibi_slopes=slopes, return_lse=True)
    assert_rule(out, lse, q, k, v, lengths, alibi_slopes=slopes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_alibi_with_paged_softcap_and_window_against_the_reference(dtype):
    lengths = [3, 45, 64]
    k, v, table = paged_cache(lengths, 32, 2, 1, 16, dtype, seed=11)
    q = queries(3, 2, 3, 16, dtype)
    slopes, lens = alibi(2, 3), torch.tensor(lengths, dtype=torch.int32)
    with torch.no_grad():
        out, lse = flashattn.decode(q, k, v, lens, block_table=table, alibi_slopes=slopes, softcap=5.0,
                                    window_size=(12, 0), return_lse=True)
    assert_rule(out, lse, q, gather_pages(k, table), gather_pages(v, table), lens, alibi_slopes=slopes,
                softcap=5.0, window=12)


def test_alibi_in_decode_is_attentions_aligned_bottom_right():
    g = torch.Generator().manual_seed(12)
    q = queries(1, 2, 3, 16, torch.float32)
    k, v = (torch.randn(1, 2, 50, 16, generator=g).to(DEVICE) for _ in range(2))
    slopes = alibi(2)
    with torch.no_grad():
        out = flashattn.decode(q, k, v, torch.tensor([41], dtype=torch.int32), alibi_slopes=slopes)
        want = flashattn.attention(q, k[:, :, :41], v[:, :, :41], is_causal=True, causal_alignment="bottom_right",
                                   alibi_slopes=slopes)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


# -- Bad input -----------------------------------------------------------------------------------

def _cases():
    int64 = torch.zeros(2, 2, dtype=torch.int64)
    return [
        (dict(block_table=int64), TypeError, "block_table has dtype torch.int64; expected torch.int32"),
        (dict(block_table=[[0, 1], [2, 3]]), TypeError, "block_table must be a torch.Tensor"),
        (dict(block_table=torch.zeros(3, 2, dtype=torch.int32)), ValueError,
         r"block_table has shape \(3, 2\); expected \(B, max_blocks\) = \(2, >= 1\)"),
        (dict(block_table=torch.zeros(2, dtype=torch.int32)), ValueError, "block_table has shape"),
        (dict(block_table=torch.zeros(2, 4, dtype=torch.int32)[:, ::2]), ValueError, "each row must be contiguous"),
        (dict(page_size=8), ValueError, "page_size = 8 must be a positive multiple of 16"),
        (dict(contiguous=True), ValueError, r"with block_table the caches are paged.*page_size = 2"),
        (dict(v_pages=5), ValueError, r"v_cache has shape \(5, 16, 2, 16\) but k_cache has \(6, 16, 2, 16\)"),
        (dict(table_value=6), ValueError, r"block_table\[1, 0\] is 6, but the caches have 6 pages"),
        (dict(table_value=-1), ValueError, r"block_table\[1, 0\] is -1"),
        (dict(lengths=[4, 33]), ValueError, r"cache_seqlens\[1\] is 33.*N_max = 32 \(block_table's max_blocks"),
        (dict(max_seqlen=40), ValueError, r"max_seqlen is 40; expected 0 to N_max = 32 \(block_table's"),
        (dict(k_new=torch.zeros(2, 2, 3, 16)), ValueError, r"k_new has shape \(2, 2, 3, 16\); expected"),
        (dict(alibi_slopes=torch.zeros(4, dtype=torch.float64)), TypeError, "alibi_slopes has dtype torch.float64"),
        (dict(alibi_slopes=torch.zeros(3)), ValueError, r"alibi_slopes has shape \(3,\); expected \(4,\) or \(2, 4\)"),
        (dict(alibi_slopes=torch.zeros(3, 4)), ValueError, r"alibi_slopes has shape \(3, 4\)"),
        (dict(alibi_slopes=0.5), TypeError, "alibi_slopes must be a torch.Tensor"),
    ]


def on_device(t):
    """``t`` on DEVICE with its strides (``Tensor.to`` makes a strided view contiguous on a GPU)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=DEVICE).copy_(t)


@pytest.mark.parametrize("change, error, words", _cases())
def test_bad_paged_and_alibi_arguments_are_named(change, error, words):
    change = dict(change)
    if "table_value" in change and DEVICE.type == "cuda":
        pytest.skip("page indices are checked only where the table is on the host")
    page_size, n_pages = change.pop("page_size", 16), 6
    k = torch.zeros(n_pages, page_size, 2, 16, device=DEVICE)
    v = torch.zeros(change.pop("v_pages", n_pages), page_size, 2, 16, device=DEVICE)
    if change.pop("contiguous", False):
        k = v = torch.zeros(2, 2, 32, 16, device=DEVICE)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    if "table_value" in change:
        table[1, 0] = change.pop("table_value")
    lengths = torch.tensor(change.pop("lengths", [4, 9]), dtype=torch.int32)
    args = dict(block_table=table.to(DEVICE))
    if "max_seqlen" in change:
        lengths = lengths.to(DEVICE)
    args.update({name: on_device(t) if isinstance(t, torch.Tensor) else t for name, t in change.items()})
    if "k_new" in args:
        args["v_new"] = args["k_new"]
    q = torch.zeros(2, 4, 2, 16, device=DEVICE)
    with pytest.raises(error, match=words), torch.no_grad():
        flashattn.decode(q, k, v, lengths, **args)


@pytest.mark.gpu
def test_gpu_a_paged_step_replays_in_a_cuda_graph():
    """A paged serving step (append, rotary) captured once: each replay writes its own new keys
    into its own pages, at its own lengths, and matches an uncaptured step on a copy of the cache."""
    dtype, page_size, max_blocks = torch.bfloat16, 64, 32
    g = torch.Generator(device="cuda").manual_seed(0)
    n_pages = 4 * max_blocks + 5
    k_cache, v_cache = (torch.randn(n_pages, page_size, 2, 64, device="cuda", generator=g).to(dtype)
                        for _ in range(2))
    table = torch.randperm(n_pages, device="cuda", generator=g)[:4 * max_blocks].view(4, max_blocks).int()
    static = {name: torch.randn(shape, device="cuda", generator=g).to(dtype)
              for name, shape in (("q", (4, 8, 1, 64)), ("k", (4, 2, 1, 64)), ("v", (4, 2, 1, 64)))}
    n_max = page_size * max_blocks
    angles = torch.arange(float(n_max), device="cuda")[:, None] * 10000.0 ** (
        -torch.arange(0, 64, 2, device="cuda") / 64)
    cos, sin = angles.cos(), angles.sin()
    lens = torch.tensor([0, 100, 2000, 7], dtype=torch.int32, device="cuda")

    def step(k_c, v_c, lengths, **bound):
        return flashattn.decode(static["q"], k_c, v_c, lengths, k_new=static["k"], v_new=static["v"],
                                rotary_cos=cos, rotary_sin=sin, block_table=table, **bound)

    with torch.inference_mode():
        step(k_cache.clone(), v_cache.clone(), lens, max_seqlen=n_max)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = step(k_cache, v_cache, lens, max_seqlen=n_max)
        for lengths in ([5, n_max - 1, 0, 1000], [1, 2, 3, 4]):
            for t in static.values():
                t.copy_(torch.randn(t.shape, device="cuda", generator=g).to(dtype))
            table.copy_(torch.randperm(n_pages, device="cuda", generator=g)[:4 * max_blocks].view(4, max_blocks))
            lens.copy_(torch.tensor(lengths, dtype=torch.int32))
            k_copy, v_copy = k_cache.clone(), v_cache.clone()
            graph.replay()
            want = step(k_copy, v_copy, lens.cpu())
            torch.testing.assert_close(static_out, want)
            torch.testing.assert_close(k_cache, k_copy, rtol=0, atol=0)
