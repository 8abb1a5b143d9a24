"""What flashattn.attention adds to plain attention, in the kernels, against the float64 reference
(``flashattn.testing.reference.naive_attention`` with the same arguments) under the course's rule:
the bottom-right alignment, softcap, ALiBi, attn_mask and dropout, forward and backward, at odd
sizes, in every dtype, with grouped heads and windows where they combine.
"""
import itertools
import random
from functools import partial

import flashattn  # first: it picks the interpreter before triton is imported
import pytest
import torch
import triton
import triton.language as tl

from flashattn.kernels import traversal
from flashattn.kernels.mods import dropout_mask
from flashattn.kernels.tiles import DROP_PAIR, DROP_TILE, dropout_keep
from flashattn.ops.attention import SUPPORTED_DTYPES as DTYPES
from flashattn.ops.modifiers import check_mask, draw_seed
from flashattn.testing.reference import naive_attention, window_mask
from flashattn.testing.rule import compare_with_reference
from test_window import _bounds_probe  # the window tests' kernel that returns the tile bounds

DEVICE = flashattn.DEVICE
N_Q, N_KV, HEAD_DIM = 19, 27, 24


def make_qkv(n_q=N_Q, n_kv=N_KV, head_dim=HEAD_DIM, dtype=torch.float32, batch=2, heads_q=2, heads_kv=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads_q, n_q, head_dim, generator=g)
    k = torch.randn(batch, heads_kv, n_kv, head_dim, generator=g)
    v = torch.randn(batch, heads_kv, n_kv, head_dim, generator=g)
    return [t.to(dtype=dtype, device=DEVICE) for t in (q, k, v)]


def checks_of(q, k, v, is_causal=False, ref_kwargs=None, **kwargs):
    """The rule's checks of flashattn.attention(**kwargs) against naive_attention(**kwargs) (plus
    ``ref_kwargs``, the reference's alone)."""
    gqa = k.shape[1] != q.shape[1]
    impl = partial(flashattn.attention, enable_gqa=gqa, **kwargs)
    reference = partial(naive_attention, enable_gqa=gqa, **kwargs, **(ref_kwargs or {}))
    return compare_with_reference(q, k, v, is_causal=is_causal, impl=impl, reference=reference)


def assert_rule(checks):
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


def slopes(heads, batch=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (heads,) if batch is None else (batch, heads)
    return (torch.rand(shape, generator=g) * 0.5 + 0.05).to(DEVICE)


def key_padding(batch=2, n_kv=N_KV, seed=2):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, 1, 1, n_kv, generator=g) > 0.3
    mask[..., 0] = True  # every row sees a key (rows that see none are tested on their own)
    return mask.to(DEVICE)


# -- Bottom-right alignment -----------------------------------------------------------------------

def shifted_window_mask(n_q, n_kv, window_size, is_causal):
    """The mask aligned bottom-right, by brute force: query i at key position i + n_kv - n_q."""
    shift = n_kv - n_q
    i = torch.arange(n_q)[:, None] + shift
    j = torch.arange(n_kv)[None, :]
    left, right = window_size
    seen = torch.ones(n_q, n_kv, dtype=torch.bool)
    if left >= 0:
        seen &= j >= i - left
    if right >= 0:
        seen &= j <= i + right
    if is_causal:
        seen &= j <= i
    return seen


def test_reference_bottom_right_mask_is_brute_force():
    for n_q, n_kv, window, causal in itertools.product((5, 19, 27), (5, 19, 27), ((-1, -1), (3, 2), (-1, 4), (2, -1)),
                                                       (False, True)):
        q, k, v = (torch.randn(1, 1, n, 4, dtype=torch.float64) for n in (n_q, n_kv, n_kv))
        _, lse = naive_attention(q, k, v, causal, window_size=window, causal_alignment="bottom_right")
        seen = shifted_window_mask(n_q, n_kv, window, causal)
        assert torch.equal(torch.isinf(lse[0, 0]), ~seen.any(dim=1))


@pytest.mark.parametrize("dkdv", [False, True])
def test_bottom_right_tiles_against_brute_force(dkdv):
    """The kernels' tile ranges under the bottom-right alignment (the window's bounds shifted by
    N_kv - N_q, possibly negative): every visible pair in a visited tile, full tiles only visible
    pairs, skipped tiles none, and the tiles that the shifted mask hides are skipped."""
    rnd = random.Random(0)
    skipped_some = False
    for _ in range(300):
        n_q, n_kv = rnd.randint(1, 90), rnd.randint(1, 90)
        block_q, block_kv = rnd.choice([16, 32]), rnd.choice([16, 32])
        window = rnd.choice([(-1, 0), (-1, 0), (0, 0), (5, 0), (16, 3), (-1, 2), (7, -1)])
        span = n_q + n_kv
        _, _, left, right = traversal.window_masking(False, window, span, bottom_right=True)
        left, right = traversal.aligned_bounds(left, right, n_q, n_kv)
        kinds = traversal.classify_blocks_window(n_q, n_kv, block_q, block_kv, left, right, dkdv=dkdv)
        seen = shifted_window_mask(n_q, n_kv, window, False).numpy()
        for qb, kb in itertools.product(*map(range, kinds.shape)):
            tile = seen[qb * block_q:(qb + 1) * block_q, kb * block_kv:(kb + 1) * block_kv]
            case = (n_q, n_kv, block_q, block_kv, window, qb, kb)
            if kinds[qb, kb] == traversal.SKIPPED:
                assert not tile.any(), case
                skipped_some = True
            else:
                assert tile.any(), case  # a tile that nobody sees is never visited
            if kinds[qb, kb] == traversal.FULL:
                assert tile.all(), case
    assert skipped_some


def test_kernel_bounds_match_the_twins_with_negative_bounds():
    """Shifted bottom-right, a bound may be negative (a block that sees nothing): the kernels'
    ranges are the twins', and empty."""
    out = torch.empty(8, dtype=torch.int32, device=DEVICE)
    rnd = random.Random(3)
    for _ in range(12):
        n_q, n_kv, block_q, block_kv = rnd.randint(20, 90), rnd.randint(1, 40), rnd.choice([16, 32]), 16
        left, right = traversal.aligned_bounds(rnd.choice([0, 3, 200]), 0, n_q, n_kv)  # right < 0
        start_q, start_kv = rnd.randrange(0, n_q, block_q), rnd.randrange(0, n_kv, block_kv)
        _bounds_probe[(1,)](out, start_q, start_kv, n_q, n_kv, left, right, block_q, block_kv)
        assert out.tolist() == [*traversal.kv_window_ranges(start_q, block_q, block_kv, n_kv, left, right),
                                *traversal.q_window_ranges(start_kv, block_kv, block_q, n_q, left, right)]


def test_bottom_right_skips_keys_no_query_reaches():
    """Aligned bottom-right, queries 0..29 of 30 against 200 keys sit at positions 170..199: with
    a window of 5 to the left they see keys from 165 on. Keys in whole tiles before that are NaN:
    had the kernels loaded them, 0 * NaN would spread into the output or the gradients."""
    q, k, v = make_qkv(30, 200, 16, batch=1)
    unseen = 165 // 128 * 128  # whole tiles of every BLOCK_KV (16 to 128, CPU and GPU) below key 165
    k[:, :, :unseen] = float("nan")
    v[:, :, :unseen] = float("nan")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flashattn.attention(*leaves, is_causal=True, window_size=(5, -1), causal_alignment="bottom_right")
    expected, _ = naive_attention(q, k[:, :, unseen:], v[:, :, unseen:], True, window_size=(5, -1),
                                  causal_alignment="bottom_right")
    torch.testing.assert_close(out, expected)
    dq, dk, dv = torch.autograd.grad(out.sum(), leaves)
    assert torch.isfinite(dq).all() and (dk[:, :, :unseen] == 0).all() and (dv[:, :, :unseen] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_q,n_kv,window_size,is_causal,gqa", [
    (19, 27, (-1, -1), True, False),   # causal, more keys than queries
    (27, 19, (-1, -1), True, True),    # more queries: the first 8 see no key
    (19, 27, (4, 1), False, False),    # a window around pos(i)
    (27, 19, (3, -1), True, True),     # a causal window, grouped heads
])
def test_bottom_right_against_reference(n_q, n_kv, window_size, is_causal, gqa, dtype):
    q, k, v = make_qkv(n_q, n_kv, dtype=dtype, heads_q=4 if gqa else 2)
    assert_rule(checks_of(q, k, v, is_causal, window_size=window_size, causal_alignment="bottom_right"))


def test_bottom_right_is_sdpa_causal_lower_right():
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    q, k, v = make_qkv(11, 27, 16)
    for bias, alignment in ((causal_lower_right(11, 27), "bottom_right"), (causal_upper_left(11, 27), "top_left")):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        torch.testing.assert_close(flashattn.attention(q, k, v, attn_mask=bias), want, atol=2e-6, rtol=2e-6)
        torch.testing.assert_close(flashattn.attention(q, k, v, is_causal=True, causal_alignment=alignment),
                                   want, atol=2e-6, rtol=2e-6)
    # the two alignments differ when the lengths do, and agree when they are equal
    assert not torch.allclose(flashattn.attention(q, k, v, is_causal=True),
                              flashattn.attention(q, k, v, is_causal=True, causal_alignment="bottom_right"))
    q, k, v = make_qkv(19, 19, 16)
    assert torch.equal(flashattn.attention(q, k, v, is_causal=True),
                       flashattn.attention(q, k, v, is_causal=True, causal_alignment="bottom_right"))


# -- Softcap and ALiBi ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["softcap", "softcap-causal-gqa", "alibi", "alibi-batched-bottom-right",
                                  "alibi-window", "both"])
def test_softcap_and_alibi_against_reference(case, dtype):
    gqa = "gqa" in case
    q, k, v = make_qkv(dtype=dtype, heads_q=4 if gqa else 2)
    q = q * 3  # scores of several units, so that the cap bends them
    kwargs, causal = {}, "causal" in case
    if "softcap" in case or case == "both":
        kwargs["softcap"] = 2.5
    if "alibi" in case or case == "both":
        kwargs["alibi_slopes"] = slopes(q.shape[1], q.shape[0] if "batched" in case else None)
    if "bottom-right" in case or case == "both":
        kwargs.update(causal_alignment="bottom_right")
        causal = True
    if "window" in case:
        kwargs["window_size"] = (6, 2)
    assert_rule(checks_of(q, k, v, causal, **kwargs))


def test_softcap_and_alibi_checks_can_fail():
    """The rule sees a missing cap, a wrong slope and ALiBi at the wrong alignment."""
    q, k, v = make_qkv()
    q = q * 3
    assert not any(c.ok for c in checks_of(q, k, v, ref_kwargs=dict(softcap=2.5)))
    s = slopes(2)
    wrong = compare_with_reference(q, k, v, impl=partial(flashattn.attention, alibi_slopes=s),
                                   reference=partial(naive_attention, alibi_slopes=s * 1.05))
    assert not all(c.ok for c in wrong)
    wrong = compare_with_reference(q, k, v, impl=partial(flashattn.attention, alibi_slopes=s),
                                   reference=partial(naive_attention, alibi_slopes=s, causal_alignment="bottom_right"))
    assert not all(c.ok for c in wrong)


def test_softcap_bounds_the_scores():
    q, k, v = make_qkv(9, 9, 16, batch=1)
    _, lse = flashattn.attention(q * 100, k, v, softcap=1.0, return_lse=True)
    assert (lse <= 1.0 + torch.log(torch.tensor(9.0)) + 1e-5).all()  # every score <= 1


# -- attn_mask ------------------------------------------------------------------------------------

def mask_case(name, dtype):
    g = torch.Generator().manual_seed(3)
    if name == "key-padding":
        return key_padding()
    if name == "bool-full":
        mask = torch.rand(2, 2, N_Q, N_KV, generator=g) > 0.5
        mask[..., 0] = True
        return mask.to(DEVICE)
    if name == "bool-2d":
        return window_mask(N_Q, N_KV, (5, 5), device=DEVICE)
    if name == "float-heads":
        return torch.randn(2, N_Q, N_KV, generator=g).to(DEVICE, dtype)
    if name == "float-inf":  # -inf hides a pair, as a False does
        mask = torch.randn(1, 1, N_Q, N_KV, generator=g)
        mask[..., 3:9] = float("-inf")
        return mask.to(DEVICE, dtype)
    raise AssertionError(name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["key-padding", "bool-full", "bool-2d", "float-heads", "float-inf"])
def test_attn_mask_against_reference(name, dtype):
    q, k, v = make_qkv(dtype=dtype)
    assert_rule(checks_of(q, k, v, attn_mask=mask_case(name, dtype)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_attn_mask_with_gqa_window_softcap(dtype):
    q, k, v = make_qkv(dtype=dtype, heads_q=4)
    assert_rule(checks_of(q, k, v, attn_mask=key_padding(), window_size=(7, 3), softcap=4.0,
                          alibi_slopes=slopes(4)))


def test_attn_mask_check_can_fail():
    q, k, v = make_qkv()
    mask = key_padding()
    assert not all(c.ok for c in compare_with_reference(
        q, k, v, impl=partial(flashattn.attention, attn_mask=mask), reference=naive_attention))


def test_fully_masked_rows_get_zero_and_minus_inf():
    q, k, v = (t.requires_grad_() for t in make_qkv())
    mask = torch.ones(2, 1, N_Q, N_KV, dtype=torch.bool, device=DEVICE)
    mask[0, :, 4] = False  # row 4 of batch 0 sees nothing
    out, lse = flashattn.attention(q, k, v, attn_mask=mask, return_lse=True)
    assert (out[0, :, 4] == 0).all() and (lse[0, :, 4] == float("-inf")).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[1]).all()
    dq, dk, dv = torch.autograd.grad(out.sum() + lse[torch.isfinite(lse)].sum(), (q, k, v))
    assert (dq[0, :, 4] == 0).all() and all(torch.isfinite(g).all() for g in (dq, dk, dv))


def test_mask_is_read_in_place():
    """A key-padding mask reaches the kernels as the same memory, with its broadcast dims of size 1,
    and a mask the caller expanded with stride 0 stays a view, its expanded dims read as size 1
    (the same path, so the same result to the bit)."""
    q, k, _ = make_qkv()
    mask = key_padding()
    view = check_mask(mask, q, k)
    assert view.data_ptr() == mask.data_ptr() and view.shape == (2, 1, 1, N_KV)
    expanded = mask.expand(2, 2, N_Q, N_KV)
    view = check_mask(expanded, q, k)
    assert view.data_ptr() == mask.data_ptr() and view.shape == (2, 1, 1, N_KV)  # read as a row of keys
    q, k, v = make_qkv()
    torch.testing.assert_close(flashattn.attention(q, k, v, attn_mask=expanded),
                               flashattn.attention(q, k, v, attn_mask=mask), atol=0, rtol=0)


def test_mask_with_more_leading_dims():
    q, k, v = make_qkv()
    q5, k5, v5 = (t.reshape(1, *t.shape).expand(3, *t.shape).contiguous() for t in (q, k, v))
    g = torch.Generator().manual_seed(4)
    mask = (torch.rand(3, 1, 1, 1, N_KV, generator=g) > 0.3).to(DEVICE)
    mask[..., 0] = True
    out = flashattn.attention(q5, k5, v5, attn_mask=mask)
    want = torch.nn.functional.scaled_dot_product_attention(q5, k5, v5, attn_mask=mask)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=2e-6)


# -- Dropout --------------------------------------------------------------------------------------

def kernel_keep_mask(seed_of_call, shape, dropout_p):
    """The keep-mask of the call made after ``torch.manual_seed(seed_of_call)``."""
    torch.manual_seed(seed_of_call)
    return dropout_mask(shape, dropout_p, draw_seed(), DEVICE)


def test_dropout_is_reproducible_and_drops_p():
    q, k, v = make_qkv(33, 40, 16)
    torch.manual_seed(11)
    a = flashattn.attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(11)
    b = flashattn.attention(q, k, v, dropout_p=0.3)
    c = flashattn.attention(q, k, v, dropout_p=0.3)
    assert torch.equal(a, b) and not torch.equal(a, c)
    keep = kernel_keep_mask(11, (2, 2, 33, 40), 0.3)
    assert abs((1 - keep.float().mean().item()) - 0.3) < 0.02  # 5280 draws: 4 standard deviations
    assert not torch.equal(keep, kernel_keep_mask(12, (2, 2, 33, 40), 0.3))


def test_dropout_mask_is_the_kernels():
    """With V the identity, output row i is ``P_i * keep_i / (1 - p)``: the mask the kernel used,
    seen from outside, is the debug path's."""
    n = 16
    q, k, _ = make_qkv(n, n, n, batch=1)
    v = torch.eye(n, device=DEVICE).expand(1, 2, n, n)
    torch.manual_seed(5)
    out = flashattn.attention(q, k, v, dropout_p=0.4)
    keep = kernel_keep_mask(5, (1, 2, n, n), 0.4)
    assert torch.equal(out != 0, keep)
    p = torch.softmax(q @ k.transpose(-2, -1) * n ** -0.5, dim=-1)
    torch.testing.assert_close(out, p * keep / 0.6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["plain", "causal-gqa", "window-softcap-mask", "bottom-right-alibi"])
def test_dropout_against_reference_with_the_same_mask(case, dtype):
    q, k, v = make_qkv(dtype=dtype, heads_q=4 if "gqa" in case else 2)
    kwargs, causal = dict(dropout_p=0.25), "causal" in case
    if "window" in case:
        kwargs.update(window_size=(5, 2), softcap=3.0, attn_mask=key_padding())
    if "bottom-right" in case:
        kwargs.update(causal_alignment="bottom_right", alibi_slopes=slopes(2))
        causal = True
    keep = kernel_keep_mask(21, (2, q.shape[1], N_Q, N_KV), 0.25)
    torch.manual_seed(21)  # compare_with_reference's call of flashattn.attention draws the same seed
    assert_rule(checks_of(q, k, v, causal, ref_kwargs=dict(dropout_keep=keep), **kwargs))


def test_dropout_check_can_fail():
    q, k, v = make_qkv()
    keep = kernel_keep_mask(22, (2, 2, N_Q, N_KV), 0.25)  # another seed than the call's
    torch.manual_seed(21)
    assert not all(c.ok for c in checks_of(q, k, v, ref_kwargs=dict(dropout_keep=keep), dropout_p=0.25))


def philox(seed, c0, c1, c2, c3, rounds=10):
    """Philox 4x32 in plain numpy (Salmon et al., SC 2011), with the constants of triton.language's:
    the four 32-bit numbers of counter (c0, c1, c2, c3) under key ``seed``."""
    import numpy as np

    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in (c0, c1, c2, c3))
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
    low = np.uint64(0xFFFFFFFF)
    for _ in range(rounds):
        a, b = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = (b >> np.uint64(32)) ^ c1 ^ k0, b & low, (a >> np.uint64(32)) ^ c3 ^ k1, a & low
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & low, (k1 + np.uint64(0xBB67AE85)) & low
    return c0, c1, c2, c3


def keep_by_numpy(seed, p, rows, cols):
    """Dropout's keep-mask by its definition (tiles.dropout_keep): pair (r, c) takes the 16 bits
    16 * (c % 2) on of number c // 8 % 4 of Philox's counter (4 * (c // 32) + c % 8 // 2, r's low
    and high 32 bits, 0), kept where they reach round(p * 2**16) (in float32, as the kernels)."""
    import numpy as np

    r, c = np.meshgrid(np.asarray(rows, dtype=np.uint64), np.asarray(cols, dtype=np.uint64), indexing="ij")
    u = np.uint64
    words = philox(seed, (c >> u(5)) * u(4) + ((c >> u(1)) & u(3)), r & u(0xFFFFFFFF), r >> u(32), r * u(0))
    word = np.choose(((c >> u(3)) & u(3)).astype(np.int64), words)
    bits = (word >> (u(16) * (c & u(1)))) & u(0xFFFF)
    threshold = int(np.float32(p) * np.float32(65536.0) + np.float32(0.5))
    return torch.from_numpy(bits.astype(np.int64) >= threshold)


@triton.jit
def _keep_probe(Keep, seed, p_drop, row0, col0, ROWS: tl.constexpr, COLS: tl.constexpr, DROPOUT: tl.constexpr):
    keep = dropout_keep(seed, p_drop, row0 + tl.arange(0, ROWS).to(tl.int64)[:, None], tl.arange(0, COLS)[None, :],
                        col0, COLS, DROPOUT)
    tl.store(Keep + tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :], keep.to(tl.int8))


@pytest.mark.parametrize("row0, col0", [(0, 0), (5, 32), (2 ** 33 + 7, 4096 + 64)])
def test_dropout_bits_are_philox_by_its_definition(row0, col0):
    """Both ways the kernels find a pair's bits (from the offsets in a tile whose first column is
    a multiple of 32, or from the whole column, where packed sequences start anywhere) give the
    mask of the definition, computed here in plain numpy; and the debug path (mods.dropout_mask)."""
    seed, p = 123456789, 0.3
    for kind, start, width in ((DROP_TILE, col0, 64), (DROP_TILE, col0, 32), (DROP_PAIR, col0, 32),
                               (DROP_PAIR, col0 + 3, 32), (DROP_PAIR, col0 + 13, 16)):
        keep = torch.empty(16, width, dtype=torch.int8, device=DEVICE)
        _keep_probe[(1,)](keep, seed, p, row0, start, 16, width, kind)
        want = keep_by_numpy(seed, p, range(row0, row0 + 16), range(start, start + width))
        assert torch.equal(keep.bool().cpu(), want), (kind, start, width)
    if row0 == 5:
        mask = dropout_mask((1, 1, 21, 70), p, seed, DEVICE).cpu()
        assert torch.equal(mask, keep_by_numpy(seed, p, range(21), range(70)).reshape(1, 1, 21, 70))
        # packed sequences: sequence b's pairs are rows head * total_q + cu_q[b] + i, columns cu_k[b] + j
        cu_q, cu_k = torch.tensor([0, 7, 7, 20]), torch.tensor([0, 37, 40, 75])
        mask = dropout_mask((3, 2, 13, 37), p, seed, DEVICE, cu_q, cu_k).cpu()
        for b in range(3):
            nq, nk = int(cu_q[b + 1] - cu_q[b]), int(cu_k[b + 1] - cu_k[b])
            for head in range(2):
                rows = range(head * 20 + int(cu_q[b]), head * 20 + int(cu_q[b + 1]))
                want = keep_by_numpy(seed, p, rows, range(int(cu_k[b]), int(cu_k[b + 1])))
                assert torch.equal(mask[b, head, :nq, :nk], want), (b, head)
            assert not mask[b, :, nq:].any() and not mask[b, :, :, nk:].any()


@pytest.mark.parametrize("case", ["plain", "causal-gqa-window", "five-dims"])
def test_the_call_returns_its_dropout_mask(case):
    """``return_dropout_mask=True``: the mask the call drew, with no knowledge of how its seed is
    drawn. With V the identity, output row i is ``P_i * keep_i / (1 - p)``: the kept pairs are
    where the output is not 0; and the reference given the mask reproduces the call, forward and
    backward, under the rule (a dtype per case)."""
    kwargs = dict(dropout_p=0.3)
    n = 16
    q, k, _ = make_qkv(n, n, n, heads_q=4 if "gqa" in case else 2)
    v = torch.eye(n, device=DEVICE).expand(2, k.shape[1], n, n)
    if "window" in case:
        kwargs.update(is_causal=True, window_size=(5, 0))
    gqa = dict(enable_gqa="gqa" in case)
    if case == "five-dims":
        q, k, v = (t.reshape(1, 2, *t.shape[1:]) for t in (q, k, v))
    out, keep = flashattn.attention(q, k, v, **kwargs, **gqa, return_dropout_mask=True)
    assert keep.dtype == torch.bool and keep.shape == (*q.shape[:-1], n)
    visible = naive_attention(q, k, v, **{key: val for key, val in kwargs.items() if key != "dropout_p"},
                              **gqa)[0] != 0
    assert torch.equal(out != 0, keep & visible)
    dtype = {"plain": torch.float16, "causal-gqa-window": torch.bfloat16}.get(case, torch.float32)
    qd, kd, vd = (t.to(dtype) for t in make_qkv(heads_q=q.shape[-3], seed=3))
    causal = kwargs.get("is_causal", False)
    call = {key: val for key, val in kwargs.items() if key != "is_causal"}
    torch.manual_seed(8)
    _, _, keep = flashattn.attention(qd, kd, vd, **call, **gqa, is_causal=causal, return_lse=True,
                                     return_dropout_mask=True)
    torch.manual_seed(8)   # compare_with_reference's call draws the same mask again
    assert_rule(checks_of(qd, kd, vd, causal, ref_kwargs=dict(dropout_keep=keep), **call))
    # without dropout every pair is kept
    assert flashattn.attention(q, k, v, **gqa, return_dropout_mask=True)[1].all()


def test_varlen_returns_its_dropout_mask():
    """varlen_attention's mask, batch x heads x max_q x max_k, each sequence's in its corner: the
    reference of each sequence given its block reproduces the call, forward and backward (the
    backward kernels draw the same pairs); past a sequence, False."""
    lengths_q, lengths_k = [5, 0, 13, 9], [8, 3, 6, 12]
    g = torch.Generator().manual_seed(4)
    q = torch.randn(sum(lengths_q), 2, 16, generator=g).to(DEVICE).requires_grad_()
    k, v = (torch.randn(sum(lengths_k), 2, 16, generator=g).to(DEVICE).requires_grad_() for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32, device=DEVICE)
                  for n in (lengths_q, lengths_k))
    out, keep = flashattn.varlen_attention(q, k, v, cu_q, cu_k, 13, 12, is_causal=True, dropout_p=0.3,
                                           causal_alignment="bottom_right", return_dropout_mask=True)
    do = torch.randn(out.shape, generator=g).to(DEVICE)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    out = out.detach()
    assert keep.shape == (4, 2, 13, 12)
    for b, (nq, nk) in enumerate(zip(lengths_q, lengths_k)):
        sq, sk = sum(lengths_q[:b]), sum(lengths_k[:b])
        assert not keep[b, :, nq:].any() and not keep[b, :, :, nk:].any()
        if nq == 0:
            assert not dk[sk:sk + nk].any() and not dv[sk:sk + nk].any()
            continue
        qs, ks, vs = (t[s:s + n].detach().transpose(0, 1).double().requires_grad_()
                      for t, s, n in ((q, sq, nq), (k, sk, nk), (v, sk, nk)))
        expected, _ = naive_attention(qs, ks, vs, is_causal=True, causal_alignment="bottom_right", dropout_p=0.3,
                                      dropout_keep=keep[b, :, :nq, :nk])
        torch.testing.assert_close(out[sq:sq + nq].transpose(0, 1).double(), expected.detach(), rtol=0, atol=2e-6)
        grads = torch.autograd.grad(expected, (qs, ks, vs), do[sq:sq + nq].transpose(0, 1).double())
        for got, want, s, n in zip((dq, dk, dv), grads, (sq, sk, sk), (nq, nk, nk)):
            torch.testing.assert_close(got[s:s + n].transpose(0, 1).double(), want, rtol=0, atol=2e-5)
        qs, ks, vs = (t.detach() for t in (qs, ks, vs))
        # a mask of another call does not reproduce this one
        other = ~keep[b, :, :nq, :nk]
        wrong, _ = naive_attention(qs, ks, vs, is_causal=True, causal_alignment="bottom_right", dropout_p=0.3,
                                   dropout_keep=other)
        assert (out[sq:sq + nq].transpose(0, 1).double() - wrong).abs().max() > 1e-2
