"""flashattn.decode's arguments for batches as FlashAttention's ``flash_attn_with_kvcache`` takes them:
``cache_leftpad`` (a left-padded batch decoded in place), ``cache_batch_idx`` (the cache row of each
sequence) and ``causal=False`` (every new token sees every key), each against float64 references.

The caches hold NaN in every entry a sequence does not own (before its first valid key, past its
length, in the rows no sequence reads): a kernel that reads one of them fails loudly. Sizes are tiny
and odd (the interpreter runs them).
"""
import re

import pytest
import torch

import flashattn
from flashattn.kernels.decode import decode_forward
from flashattn.testing.reference import decode_reference, gather_pages
from flashattn.testing.rule import judge

DEVICE = flashattn.DEVICE
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def caches(batch, kv_heads, n_max, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, kv_heads, n_max, head_dim, generator=g).to(DEVICE, dtype) for _ in range(2))


def queries(batch, heads, n_q, head_dim, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, n_q, head_dim, generator=g).to(DEVICE, dtype)


def poison(k, v, starts, ends):
    """NaN in every cache entry outside ``[start, end)`` of each row."""
    k, v = k.clone(), v.clone()
    for b, (lo, hi) in enumerate(zip(starts, ends)):
        for t in (k, v):
            t[b, :, :lo] = float("nan")
            t[b, :, hi:] = float("nan")
    return k, v


def zero_nan(t):
    return torch.nan_to_num(t, nan=0.0)  # the reference multiplies 0 by every hidden value


def assert_rule(out, lse, q, k, v, lengths, **mods):
    """decode's ``(out, lse)`` against float64 and against PyTorch in q's dtype (the rule); rows
    that see no key exactly 0 and -inf."""
    k, v = zero_nan(k), zero_nan(v)
    ref, ref_lse = decode_reference(q.double(), k.double(), v.double(), lengths, **mods)
    low, low_lse = decode_reference(q, k, v, lengths, **mods)
    empty = ref_lse == float("-inf")
    assert torch.equal(lse == float("-inf"), empty), "rows without keys must have lse -inf, and only they"
    assert torch.isfinite(out).all() and (out[empty] == 0).all()
    finite = [torch.where(empty, 0.0, t.double()) for t in (lse, ref_lse, low_lse)]
    checks = judge(dict(out=out, lse=finite[0]), dict(out=ref, lse=finite[1]), dict(out=low, lse=finite[2]),
                   q.dtype)
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


# Lengths L and first valid keys: no padding, padding inside a tile and across tiles, a sequence whose
# padding fills it (no key), one with fewer keys than the 3 new tokens, a full cache.
LENGTHS = [21, 30, 9, 14, 47]
LEFTPAD = [0, 5, 9, 12, 17]


# -- cache_leftpad ---------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n_q", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_leftpad_against_the_reference(dtype, n_q, causal):
    k, v = caches(5, 2, 47, 20, dtype)
    k, v = poison(k, v, LEFTPAD, LENGTHS)
    q = queries(5, 4, n_q, 20, dtype)
    lengths, leftpad = i32(LENGTHS), i32(LEFTPAD)
    with torch.no_grad():
        out, lse = flashattn.decode(q, k, v, lengths, return_lse=True, cache_leftpad=leftpad, causal=causal)
    assert_rule(out, lse, q, k, v, lengths, cache_leftpad=leftpad, causal=causal)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_leftpad_across_splits_with_windows_and_alibi(num_splits):
    """Each split's keys counted from the first valid one; windows and ALiBi measure the same
    distances as without padding."""
    k, v = caches(5, 1, 47, 16, torch.float32, seed=3)
    k, v = poison(k, v, LEFTPAD, LENGTHS)
    q = queries(5, 2, 3, 16, torch.float32, seed=4)
    lengths, leftpad = i32(LENGTHS), i32(LEFTPAD)
    slopes = torch.tensor([0.3, 0.05], device=DEVICE)
    for window in (-1, 6):
        out, lse = decode_forward(q, k, v, lengths.to(DEVICE), 47, 0.25, num_splits, cache_leftpad=leftpad.to(DEVICE),
                                  window=window, alibi_slopes=slopes[None])
        assert_rule(out, lse, q, k, v, lengths, scale=0.25, window=window, alibi_slopes=slopes,
                    cache_leftpad=leftpad)


def test_a_left_padded_batch_decodes_as_the_unpadded_sequences():
    """The point of cache_leftpad: a left-padded batch, decoded in place, gives what each sequence
    gives stored from entry 0 on its own (causal, windows and ALiBi depend only on distances)."""
    k, v = caches(5, 2, 47, 24, torch.float32, seed=5)
    q = queries(5, 4, 2, 24, torch.float32, seed=6)
    slopes = torch.linspace(0.1, 0.5, 4, device=DEVICE)
    with torch.no_grad():
        padded = flashattn.decode(q, k, v, i32(LENGTHS), cache_leftpad=i32(LEFTPAD), alibi_slopes=slopes,
                                  window_size=(7, 0), return_lse=True)
        for b, (lo, hi) in enumerate(zip(LEFTPAD, LENGTHS)):
            alone = flashattn.decode(q[b:b + 1], k[b:b + 1, :, lo:], v[b:b + 1, :, lo:], i32([hi - lo]),
                                     alibi_slopes=slopes, window_size=(7, 0), return_lse=True)
            torch.testing.assert_close(padded[0][b:b + 1], alone[0], atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(padded[1][b:b + 1], alone[1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_leftpad_on_a_paged_cache(dtype):
    """Padding that ends inside a page and on a page's end; pages in random order."""
    page_size, max_blocks = 16, 3
    g = torch.Generator().manual_seed(7)
    lengths, leftpad = [21, 40, 48, 33], [3, 16, 0, 33]
    n_pages = 4 * max_blocks + 2
    k_pages, v_pages = (torch.randn(n_pages, page_size, 2, 20, generator=g).to(DEVICE, dtype) for _ in range(2))
    table = torch.randperm(n_pages, generator=g)[:4 * max_blocks].view(4, max_blocks).int().to(DEVICE)
    k, v = poison(gather_pages(k_pages, table), gather_pages(v_pages, table), leftpad, lengths)
    owned = torch.zeros(n_pages, page_size, dtype=torch.bool)
    for b, (lo, hi) in enumerate(zip(leftpad, lengths)):
        for j in range(lo, hi):
            owned[table[b, j // page_size], j % page_size] = True
    k_pages[~owned.to(DEVICE)], v_pages[~owned.to(DEVICE)] = float("nan"), float("nan")
    q = queries(4, 4, 3, 20, dtype)
    with torch.no_grad():
        out, lse = flashattn.decode(q, k_pages, v_pages, i32(lengths), return_lse=True, block_table=table,
                                    cache_leftpad=i32(leftpad))
    assert_rule(out, lse, q, k, v, i32(lengths), cache_leftpad=i32(leftpad))


def test_leftpad_appends_and_rotates_at_cache_positions():
    """As flash_attn_with_kvcache: k_new goes to entries cache_seqlens.., and rotary positions
    count from the cache's entry 0, padding or not."""
    from test_kv_cache import rope_reference, rope_tables
    before, leftpad = [4, 11, 0], [2, 0, 0]
    k, v = caches(3, 1, 20, 16, torch.float32, seed=8)
    q = queries(3, 2, 2, 16, torch.float32, seed=9)
    g = torch.Generator().manual_seed(10)
    k_new, v_new = (torch.randn(3, 1, 2, 16, generator=g).to(DEVICE) for _ in range(2))
    cos, sin = rope_tables(32, 16)
    positions = [[n, n + 1] for n in before]
    q_rot, k_rot = (rope_reference(t, positions, cos, sin, False) for t in (q, k_new))
    expected_k, expected_v = k.double().clone(), v.double().clone()
    for b, n in enumerate(before):
        expected_k[b, :, n:n + 2], expected_v[b, :, n:n + 2] = k_rot[b], v_new[b].double()
    with torch.no_grad():
        out = flashattn.decode(q, k, v, i32(before), k_new=k_new, v_new=v_new, rotary_cos=cos, rotary_sin=sin,
                               cache_leftpad=i32(leftpad))
    torch.testing.assert_close(k.double(), expected_k, atol=1e-6, rtol=0)
    assert torch.equal(v.double(), expected_v)
    ref = decode_reference(q_rot, expected_k, expected_v, i32(before) + 2, cache_leftpad=i32(leftpad))[0]
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=0)


def test_leftpad_with_max_seqlen_reads_nothing_on_the_host(monkeypatch):
    k, v = caches(5, 2, 47, 16, torch.float32, seed=11)
    q = queries(5, 2, 1, 16, torch.float32, seed=12)
    lengths, leftpad, rows = i32(LENGTHS).to(DEVICE), i32(LEFTPAD).to(DEVICE), i32([4, 0, 3, 1, 2]).to(DEVICE)
    with torch.no_grad():
        expected = flashattn.decode(q, k, v, lengths, cache_leftpad=leftpad, cache_batch_idx=rows)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("a value was read on the host"))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("a value was read on the host"))
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self: pytest.fail("a tensor was copied to the host"))
    with torch.no_grad():
        out = flashattn.decode(q, k, v, lengths, max_seqlen=47, cache_leftpad=leftpad, cache_batch_idx=rows)
    assert torch.equal(out, expected)


def test_unchecked_leftpad_stays_inside_the_sequence():
    """With max_seqlen nothing is checked: a first key past the length (or negative) is clamped
    into [0, L], as if the sequence were empty (or unpadded)."""
    k, v = caches(2, 1, 20, 16, torch.float32, seed=13)
    q = queries(2, 1, 1, 16, torch.float32, seed=14)
    lengths = i32([9, 12]).to(DEVICE)
    with torch.no_grad():
        out, lse = flashattn.decode(q, k, v, lengths, max_seqlen=20, return_lse=True,
                                    cache_leftpad=i32([15, -4]).to(DEVICE))
        unpadded = flashattn.decode(q, k, v, lengths, return_lse=True)
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()
    assert torch.equal(out[1], unpadded[0][1]) and torch.equal(lse[1], unpadded[1][1])


# -- lengths shorter than the new tokens --------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fewer_keys_than_new_tokens(dtype):
    """As FlashAttention: causal tokens placed before key 0 see nothing (0, lse -inf); the later
    ones see the keys up to their position."""
    k, v = caches(3, 1, 24, 16, dtype, seed=15)
    k, v = poison(k, v, [0, 0, 0], [1, 3, 24])
    q = queries(3, 2, 5, 16, dtype, seed=16)
    lengths = i32([1, 3, 24])
    with torch.no_grad():
        out, lse = flashattn.decode(q, k, v, lengths, return_lse=True)
    assert (lse[0, :, :4] == float("-inf")).all() and (lse[0, :, 4] > float("-inf")).all()
    assert_rule(out, lse, q, k, v, lengths)


# -- causal=False ------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [(-1, -1), (4, -1), (-1, 2), (3, 1)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_causal_decoding_of_several_tokens(dtype, window):
    """Every new token sees every valid key, or the window around its position (both sides)."""
    lengths = [0, 2, 17, 40]
    k, v = caches(4, 2, 40, 20, dtype, seed=17)
    k, v = poison(k, v, [0] * 4, lengths)
    q = queries(4, 4, 5, 20, dtype, seed=18)
    with torch.no_grad():
        out, lse = flashattn.decode(q, k, v, i32(lengths), return_lse=True, causal=False, window_size=window)
    assert_rule(out, lse, q, k, v, i32(lengths), causal=False, window=window[0], window_right=window[1])


def test_non_causal_differs_from_causal_only_for_several_tokens():
    k, v = caches(2, 1, 30, 16, torch.float32, seed=19)
    lengths = i32([13, 30])
    with torch.no_grad():
        one = queries(2, 2, 1, 16, torch.float32, seed=20)
        assert torch.equal(flashattn.decode(one, k, v, lengths), flashattn.decode(one, k, v, lengths, causal=False))
        three = queries(2, 2, 3, 16, torch.float32, seed=21)
        seen_all = flashattn.decode(three, k, v, lengths, causal=False)
        last = flashattn.decode(three[:, :, 2:], k, v, lengths)       # the last token sees every key
    assert not torch.allclose(seen_all, flashattn.decode(three, k, v, lengths))
    torch.testing.assert_close(seen_all[:, :, 2:], last)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_causal_on_pages_with_alibi_and_leftpad(dtype):
    page_size, max_blocks = 16, 3
    g = torch.Generator().manual_seed(22)
    lengths, leftpad = [7, 40, 48], [0, 9, 20]
    n_pages = 3 * max_blocks + 1
    k_pages, v_pages = (torch.randn(n_pages, page_size, 1, 24, generator=g).to(DEVICE, dtype) for _ in range(2))
    table = torch.randperm(n_pages, generator=g)[:3 * max_blocks].view(3, max_blocks).int().to(DEVICE)
    k, v = gather_pages(k_pages, table), gather_pages(v_pages, table)
    q = queries(3, 3, 4, 24, dtype, seed=23)
    slopes = torch.rand(3, 3, generator=g).to(DEVICE) * 0.3
    with torch.no_grad():
        out, lse = flashattn.decode(q, k_pages, v_pages, i32(lengths), return_lse=True, block_table=table,
                                    causal=False, alibi_slopes=slopes, cache_leftpad=i32(leftpad))
    assert_rule(out, lse, q, k, v, i32(lengths), causal=False, alibi_slopes=slopes, cache_leftpad=i32(leftpad))


@pytest.mark.parametrize("window", [(-1, -1), (5, 0)])
@pytest.mark.parametrize("paged", [False, True])
def test_non_causal_rotary_as_flash_attn_with_kvcache(paged, window):
    """Not causal and without a window, q's tokens are all rotated at the first new token's
    position (FlashAttention's convention); with a window, each at its own."""
    from test_kv_cache import rope_reference, rope_tables
    before, n_q, page_size = [3, 20, 9], 3, 16
    q = queries(3, 2, n_q, 16, torch.float32, seed=24)
    g = torch.Generator().manual_seed(25)
    k_new, v_new = (torch.randn(3, 1, n_q, 16, generator=g).to(DEVICE) for _ in range(2))
    k, v = caches(3, 1, 32, 16, torch.float32, seed=26)
    cos, sin = rope_tables(32, 8)
    local = window != (-1, -1)
    q_rot = rope_reference(q, [[n + t if local else n for t in range(n_q)] for n in before], cos, sin, True)
    k_rot = rope_reference(k_new, [[n + t for t in range(n_q)] for n in before], cos, sin, True)
    expected_k, expected_v = k.double().clone(), v.double().clone()
    for b, n in enumerate(before):
        expected_k[b, :, n:n + n_q], expected_v[b, :, n:n + n_q] = k_rot[b], v_new[b].double()
    if paged:  # the same cache in pages of 16, sequence b in pages 2b + 1, 2b
        table = torch.tensor([[2 * b + 1, 2 * b] for b in range(3)], dtype=torch.int32, device=DEVICE)
        pages_k, pages_v = (torch.empty(6, page_size, 1, 16, device=DEVICE) for _ in range(2))
        for b in range(3):
            for i, page in enumerate(table[b].tolist()):
                pages_k[page] = k[b, :, i * page_size:(i + 1) * page_size].transpose(0, 1)
                pages_v[page] = v[b, :, i * page_size:(i + 1) * page_size].transpose(0, 1)
        cache = dict(k_cache=pages_k, v_cache=pages_v, block_table=table)
    else:
        cache = dict(k_cache=k, v_cache=v)
    with torch.no_grad():
        out = flashattn.decode(q, cache_seqlens=i32(before), k_new=k_new, v_new=v_new, rotary_cos=cos,
                               rotary_sin=sin, rotary_interleaved=True, causal=False, window_size=window, **cache)
    if paged:
        k_now, v_now = gather_pages(pages_k, table), gather_pages(pages_v, table)
    else:
        k_now, v_now = k, v
    torch.testing.assert_close(k_now.double(), expected_k, atol=1e-6, rtol=0)
    ref = decode_reference(q_rot, expected_k, expected_v, i32(before) + n_q, causal=False, window=window[0],
                           window_right=window[1])[0]
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=0)


# -- cache_batch_idx ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cache_batch_idx_reads_and_writes_the_named_rows(dtype):
    """Three sequences in rows 4, 0, 2 of a cache of 5 rows: each attends over its row, k_new
    lands there, and the other rows are left as they were."""
    rows, before = [4, 0, 2], [6, 0, 13]
    k, v = caches(5, 2, 24, 20, dtype, seed=27)
    q = queries(3, 4, 2, 20, dtype, seed=28)
    g = torch.Generator().manual_seed(29)
    k_new, v_new = (torch.randn(3, 2, 2, 20, generator=g).to(DEVICE, dtype) for _ in range(2))
    expected_k, expected_v = k.clone(), v.clone()
    for b, (row, n) in enumerate(zip(rows, before)):
        expected_k[row, :, n:n + 2], expected_v[row, :, n:n + 2] = k_new[b], v_new[b]
    with torch.no_grad():
        out, lse = flashattn.decode(q, k, v, i32(before), k_new=k_new, v_new=v_new, return_lse=True,
                                    cache_batch_idx=i32(rows))
    assert torch.equal(k, expected_k) and torch.equal(v, expected_v)
    index = torch.tensor(rows, device=DEVICE)
    assert_rule(out, lse, q, k[index], v[index], i32(before) + 2)


def test_cache_batch_idx_with_leftpad_and_int64_indices():
    rows, lengths, leftpad = [1, 1, 0], [30, 12, 19], [4, 0, 18]
    k, v = caches(2, 1, 30, 16, torch.float32, seed=30)
    q = queries(3, 2, 1, 16, torch.float32, seed=31)
    with torch.no_grad():
        out, lse = flashattn.decode(q, k, v, i32(lengths), return_lse=True,
                                    cache_batch_idx=torch.tensor(rows), cache_leftpad=torch.tensor(leftpad))
    index = torch.tensor(rows, device=DEVICE)
    assert_rule(out, lse, q, k[index], v[index], i32(lengths), cache_leftpad=i32(leftpad))


# -- bad arguments ------------------------------------------------------------------------------

def good_args():
    k, v = caches(2, 1, 32, 16, torch.float32)
    return dict(q=queries(2, 2, 1, 16, torch.float32), k_cache=k, v_cache=v, cache_seqlens=i32([5, 32]))


@pytest.mark.parametrize("change, error, words", [
    (dict(cache_leftpad=[0, 1]), TypeError, ["cache_leftpad", "torch.Tensor", "list"]),
    (dict(cache_leftpad=torch.tensor([0.0, 1.0])), TypeError, ["cache_leftpad", "float32", "int32"]),
    (dict(cache_leftpad=i32([0, 1, 2])), ValueError, ["cache_leftpad", "(3,)", "(2,)"]),
    (dict(cache_leftpad=i32([6, 0])), ValueError, ["cache_leftpad[0] is 6", "from 0", "5"]),
    (dict(cache_leftpad=i32([0, -1])), ValueError, ["cache_leftpad[1] is -1"]),
    (dict(cache_batch_idx=torch.tensor([0, 1], dtype=torch.int16)), TypeError, ["cache_batch_idx", "int16"]),
    (dict(cache_batch_idx=i32([1])), ValueError, ["cache_batch_idx", "(1,)", "(2,)"]),
    (dict(cache_batch_idx=i32([0, 2])), ValueError, ["cache_batch_idx[1] is 2", "2 rows", "0 to 1"]),
    (dict(causal=1), TypeError, ["causal", "bool"]),
    (dict(window_size=(3, 2)), ValueError, ["window_size", "causal=True", "causal=False"]),
])
def test_bad_arguments_are_named(change, error, words):
    args = dict(good_args(), **change)
    with torch.no_grad(), pytest.raises(error) as info:
        flashattn.decode(**args)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_leftpad_of_a_step_is_checked_against_the_tokens_cached_before_it():
    """With k_new, cache_seqlens counts the tokens before the step: the first valid key must be
    among them (the new tokens land from cache_seqlens on)."""
    args = good_args()
    k_new = v_new = torch.zeros(2, 1, 1, 16, device=DEVICE)
    with torch.no_grad(), pytest.raises(ValueError, match=re.escape("cache_leftpad[0] is 5")):
        flashattn.decode(**dict(args, cache_seqlens=i32([4, 9])), k_new=k_new, v_new=v_new,
                         cache_leftpad=i32([5, 0]))


def test_cache_batch_idx_is_refused_with_a_block_table():
    k = torch.zeros(4, 16, 1, 16, device=DEVICE)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    with torch.no_grad(), pytest.raises(ValueError, match="cache_batch_idx and block_table"):
        flashattn.decode(queries(2, 1, 1, 16, torch.float32), k, k, i32([3, 4]), block_table=table,
                         cache_batch_idx=i32([1, 0]))


@pytest.mark.parametrize("appending", [False, True])
def test_a_full_paged_cache_names_the_block_table(appending):
    """As FlashAttention's: appending past a full table, or a length past it, names block_table."""
    k = torch.zeros(4, 16, 1, 16, device=DEVICE)
    table = torch.tensor([[2], [3]], dtype=torch.int32, device=DEVICE)
    q = queries(2, 1, 1, 16, torch.float32)
    step = dict(k_new=torch.zeros(2, 1, 1, 16, device=DEVICE), v_new=torch.zeros(2, 1, 1, 16, device=DEVICE))
    lengths = i32([16, 3]) if appending else i32([17, 3])
    with torch.no_grad(), pytest.raises(ValueError, match="block_table") as info:
        flashattn.decode(q, k, k, lengths, block_table=table, **(step if appending else {}))
    assert "cache_seqlens[0]" in str(info.value)
    with torch.no_grad():  # at capacity, without appending: fine
        assert torch.isfinite(flashattn.decode(q, k, k, i32([16, 3]), block_table=table)).all()


# -- on a GPU ----------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_a_left_padded_generation_loop_replays_in_a_cuda_graph():
    """A left-padded batch decoding step, appending, with the left padding and the cache rows on
    the GPU: captured once, replayed with the lengths of each step."""
    batch, heads, n_max, dim = 3, 4, 64, 32
    dtype = torch.bfloat16
    k, v = caches(4, 2, n_max, dim, dtype, seed=32)
    leftpad, rows = i32([0, 7, 3]).cuda(), i32([2, 0, 3]).cuda()
    lengths = i32([10, 10, 10]).cuda()
    q = queries(batch, heads, 1, dim, dtype, seed=33)
    k_new = torch.randn(batch, 2, 1, dim, device="cuda", dtype=dtype)
    v_new = torch.randn_like(k_new)
    kw = dict(k_new=k_new, v_new=v_new, cache_leftpad=leftpad, cache_batch_idx=rows, max_seqlen=n_max)
    with torch.no_grad():
        flashattn.decode(q, k.clone(), v.clone(), lengths, **kw)  # compile outside the capture
        k_ref, v_ref = k.clone(), v.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = flashattn.decode(q, k, v, lengths, **kw)
        for step in range(3):
            lengths.fill_(10 + step)
            graph.replay()
            expected = flashattn.decode(q, k_ref, v_ref, lengths.cpu(), **dict(kw, max_seqlen=None))
            torch.testing.assert_close(out, expected, atol=0, rtol=0)
        torch.testing.assert_close(k, k_ref, atol=0, rtol=0)
