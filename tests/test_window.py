"""Sliding windows (``flashattn.attention(..., window_size=(left, right))``) against a float64
reference, and the tile ranges that make their cost grow with N * window instead of N**2.

Query i sees key j iff j >= i - left (left >= 0) and j <= i + right (right >= 0), top-left aligned;
is_causal adds j <= i. A row that sees no key gets the output 0, lse -inf and zero gradients.
"""
import itertools
import random
from functools import partial

import flashattn  # first: it picks the interpreter before triton is imported (for _bounds_probe)
import pytest
import torch
import triton
import triton.language as tl

from flashattn.gpu import configs
from flashattn.kernels import traversal
from flashattn.ops.attention import SUPPORTED_DTYPES as DTYPES
from flashattn.testing.reference import masked_attention, window_mask
from flashattn.testing.rule import compare_with_reference
from flashattn.kernels.tiles import kv_window_bounds, q_window_bounds

DEVICE = flashattn.DEVICE


def make_qkv(n_q, n_kv, head_dim, dtype, heads_q=2, heads_kv=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads_q, n_q, head_dim, generator=g)
    k = torch.randn(1, heads_kv, n_kv, head_dim, generator=g)
    v = torch.randn(1, heads_kv, n_kv, head_dim, generator=g)
    return [t.to(dtype=dtype, device=DEVICE) for t in (q, k, v)]


def check_window(q, k, v, window_size, is_causal=False):
    gqa = k.shape[1] != q.shape[1]
    impl = partial(flashattn.attention, enable_gqa=gqa, window_size=window_size)
    reference = partial(masked_attention, enable_gqa=gqa, window_size=window_size)
    checks = compare_with_reference(q, k, v, is_causal=is_causal, impl=impl, reference=reference)
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


# --- The tile ranges: plain-Python twins against brute force, and the kernels' own against the twins ---

def window_cases(count, seed=0):
    rnd = random.Random(seed)
    for _ in range(count):
        yield (rnd.randint(1, 90), rnd.randint(1, 90), rnd.choice([16, 32]), rnd.choice([16, 32]),
               rnd.choice([0, 1, 5, 16, 40]), rnd.choice([0, 2, 17, 33]))


@pytest.mark.parametrize("dkdv", [False, True])
def test_window_tiles_against_brute_force(dkdv):
    """Every visible pair lies in a visited tile; full tiles hold only visible pairs; skipped tiles
    none; and a query block visits at most the tiles its window spans, plus one at each end."""
    for n_q, n_kv, block_q, block_kv, left, right in window_cases(300):
        kinds = traversal.classify_blocks_window(n_q, n_kv, block_q, block_kv, left, right, dkdv=dkdv)
        seen = window_mask(n_q, n_kv, (left, right)).numpy()
        for qb, kb in itertools.product(*map(range, kinds.shape)):
            tile = seen[qb * block_q:(qb + 1) * block_q, kb * block_kv:(kb + 1) * block_kv]
            case = (n_q, n_kv, block_q, block_kv, left, right, qb, kb)
            if kinds[qb, kb] == traversal.SKIPPED:
                assert not tile.any(), case
            if kinds[qb, kb] == traversal.FULL:  # and unmasked loads stay inside the sequence
                assert tile.all(), case
                assert tile.shape[0] == block_q if dkdv else tile.shape[1] == block_kv, case
        if not dkdv:
            span = traversal.cdiv(left + right + block_q, block_kv) + 2
            assert ((kinds != traversal.SKIPPED).sum(axis=1) <= span).all()


@triton.jit
def _bounds_probe(Out, q_start, kv_start, n_q, n_kv, left, right,
                  BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr):
    a, b, c, d = kv_window_bounds(q_start, n_kv, left, right, BLOCK_Q, BLOCK_KV)
    e, f, g, h = q_window_bounds(kv_start, n_q, left, right, BLOCK_Q, BLOCK_KV)
    tl.store(Out + 0, a)  # one store each: compiled Triton has no loop over a tuple of values
    tl.store(Out + 1, b)
    tl.store(Out + 2, c)
    tl.store(Out + 3, d)
    tl.store(Out + 4, e)
    tl.store(Out + 5, f)
    tl.store(Out + 6, g)
    tl.store(Out + 7, h)


def test_kernel_bounds_match_the_twins():
    out = torch.empty(8, dtype=torch.int32, device=DEVICE)
    for n_q, n_kv, block_q, block_kv, left, right in window_cases(12, seed=1):
        start_q, start_kv = (n_q // 2) // block_q * block_q, (n_kv // 2) // block_kv * block_kv
        _bounds_probe[(1,)](out, start_q, start_kv, n_q, n_kv, left, right, block_q, block_kv)
        assert out.tolist() == [*traversal.kv_window_ranges(start_q, block_q, block_kv, n_kv, left, right),
                                *traversal.q_window_ranges(start_kv, block_kv, block_q, n_q, left, right)]


def test_window_masking():
    span = 1000
    assert traversal.window_masking(False, (-1, -1), span) == (False, False, span, span)
    assert traversal.window_masking(True, (-1, -1), span) == (True, False, span, 0)
    assert traversal.window_masking(False, (-1, 0), span) == (True, False, span, 0)
    assert traversal.window_masking(True, (-1, 7), span) == (True, False, span, 0)
    assert traversal.window_masking(True, (4, 7), span) == (False, True, 4, 0)
    assert traversal.window_masking(False, (4, -1), span) == (False, True, 4, span)


# --- The kernels against float64 -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_q,n_kv,window_size,is_causal", [
    (69, 69, (5, 3), False),      # both sides bounded
    (37, 45, (16, 0), False),     # a causal window of 16
    (50, 70, (-1, 4), False),     # right only
    (69, 40, (7, -1), True),      # left with is_causal; rows 47.. see no key
    (40, 100, (3, 2), False),     # keys 43.. seen by nobody
])
def test_window_against_reference(n_q, n_kv, window_size, is_causal, dtype):
    check_window(*make_qkv(n_q, n_kv, 24, dtype), window_size, is_causal)


def test_window_zero_sees_only_the_diagonal():
    q, k, v = make_qkv(33, 33, 16, torch.float32)
    torch.testing.assert_close(flashattn.attention(q, k, v, window_size=(0, 0)), v.expand_as(q))


def test_unbounded_windows_are_the_plain_paths():
    q, k, v = make_qkv(45, 45, 16, torch.float32)
    assert torch.equal(flashattn.attention(q, k, v, window_size=(-1, -1)), flashattn.attention(q, k, v))
    assert torch.equal(flashattn.attention(q, k, v, window_size=(-1, 0)),
                       flashattn.attention(q, k, v, is_causal=True))
    wide = flashattn.attention(q, k, v, window_size=(100, 100))  # the window path, seeing everything
    torch.testing.assert_close(wide, flashattn.attention(q, k, v), rtol=1e-6, atol=1e-6)


def test_rows_without_keys_and_unwritten_buffers(nan_buffers):
    """Rows outside every window: output 0, lse -inf, gradients 0, no NaN anywhere, also with
    grouped heads; keys nobody sees get dK = dV = 0, written (the buffers start as NaN)."""
    from flashattn.kernels import backward
    assert torch.isnan(backward.torch.empty_like(torch.zeros(2))).all()  # the fixture is in place
    q, k, v = (t.requires_grad_() for t in make_qkv(70, 30, 16, torch.float32, heads_q=4, heads_kv=2))
    out, lse = flashattn.attention(q, k, v, is_causal=True, window_size=(20, -1), enable_gqa=True,
                                   return_lse=True)
    lse_term = torch.where(torch.isfinite(lse), lse, 0.0).sum()
    dq, dk, dv = torch.autograd.grad(out.sum() + lse_term, (q, k, v))
    assert (out[:, :, 50:] == 0).all() and (lse[:, :, 50:] == float("-inf")).all()
    assert torch.isfinite(lse[:, :, :50]).all()
    for t in (out, dq, dk, dv):
        assert torch.isfinite(t).all()
    assert (dq[:, :, 50:] == 0).all()
    q, k, v = (t.detach().requires_grad_() for t in make_qkv(20, 90, 16, torch.float32))
    out = flashattn.attention(q, k, v, window_size=(2, 3))
    dk, dv = torch.autograd.grad(out.sum(), (k, v))
    assert torch.isfinite(out).all() and (dk[:, :, 23:] == 0).all() and (dv[:, :, 23:] == 0).all()


def forward_key_tile(dtype, head_dim):
    """BLOCK_KV of the forward kernel that flashattn.attention runs: the interpreter's fixed tile, or
    the GPU's default configuration."""
    if flashattn.gpu.runtime.INTERPRET:
        return configs.INTERPRETER_CONFIGS["fwd"]["BLOCK_KV"]
    block_d = configs.block_d(head_dim)
    return configs.default_config("fwd", dtype, configs.dot_precision(dtype, block_d), block_d).kwargs["BLOCK_KV"]


def test_tiles_outside_the_window_are_not_loaded():
    """K and V rows in whole key tiles that no query's window reaches are NaN: had the kernel loaded
    them, 0 * NaN would spread into the output."""
    q, k, v = make_qkv(30, 200, 16, torch.float32)
    tile = forward_key_tile(torch.float32, 16)
    unseen = -(-33 // tile) * tile  # queries 0..29 with right = 3 see keys up to 32
    assert unseen < 200
    v[:, :, unseen:] = float("nan")
    k[:, :, unseen:] = float("nan")
    out = flashattn.attention(q, k, v, window_size=(5, 3))
    expected, _ = masked_attention(q, k[:, :, :unseen], v[:, :, :unseen], window_size=(5, 3))
    torch.testing.assert_close(out, expected)


def test_window_backward_is_deterministic():
    q, k, v = (t.requires_grad_() for t in make_qkv(60, 60, 16, torch.float32, heads_q=4, heads_kv=1))
    run = lambda: torch.autograd.grad(  # noqa: E731
        flashattn.attention(q, k, v, window_size=(9, 2), enable_gqa=True).sum(), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(run(), run()))


@pytest.mark.parametrize("window_size,error,match", [
    ((1,), TypeError, "window_size must be a pair"),
    ("ab", TypeError, "window_size must be a pair"),
    (4, TypeError, "window_size must be a pair"),
    ((1.5, 2), TypeError, "window_size must be a pair of ints"),
    ((True, 2), TypeError, "window_size must be a pair of ints"),
    ((-2, 0), ValueError, "window_size=.*>= 0, or -1"),
])
def test_window_errors(window_size, error, match):
    q, k, v = make_qkv(8, 8, 16, torch.float32)
    with pytest.raises(error, match=match):
        flashattn.attention(q, k, v, window_size=window_size)


# --- On a GPU: compiled, bf16 on the tensor cores, long sequences ---------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("window_size,is_causal", [((256, 0), False), ((300, 77), False), ((511, -1), True)])
def test_window_long_on_gpu(dtype, window_size, is_causal):
    check_window(*make_qkv(4096 + 37, 4096 + 37, 128, dtype, heads_q=8, heads_kv=2), window_size, is_causal)


@pytest.mark.gpu
def test_window_rows_without_keys_on_gpu():
    q, k, v = (t.requires_grad_() for t in make_qkv(3000, 1000, 128, torch.bfloat16, heads_q=8, heads_kv=2))
    out, lse = flashattn.attention(q, k, v, is_causal=True, window_size=(512, -1), enable_gqa=True,
                                   return_lse=True)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert (out[:, :, 1512:] == 0).all() and (lse[:, :, 1512:] == float("-inf")).all()
    assert all(torch.isfinite(t).all() for t in (out, *grads))


@pytest.mark.gpu
def test_window_backward_deterministic_on_gpu():
    q, k, v = (t.requires_grad_() for t in make_qkv(8192, 8192, 128, torch.bfloat16, heads_q=8, heads_kv=2))
    run = lambda: torch.autograd.grad(  # noqa: E731
        flashattn.attention(q, k, v, is_causal=True, window_size=(1024, 0), enable_gqa=True).sum(), (q, k, v))
    first = run()
    assert all(torch.equal(a, b) for a, b in zip(first, run()))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("n, window_size, is_causal", [
    (1, (0, 0), False), (17, (3, 5), False), (1000, (0, 0), False), (1000, (129, -1), True),
    (2100, (700, 0), False), (4103, (256, 300), False), (4103, (5000, 0), False), (3000, (-1, 200), False),
])
def test_gpu_windows_take_the_gluon_forward(monkeypatch, n, window_size, is_causal, head_dim, dtype):
    """On an H100/H200 a sliding window with as many queries as keys takes the Gluon forward (its
    tiles from the window's first to its last, masked at both edges): it is the kernel that runs,
    and output, LSE and gradients are within the rule; a window wider than the sequence too."""
    from flashattn import hopper

    gluon = hopper.load("forward")
    if gluon is None or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels run on compute capability 9 only")
    calls = []
    real = gluon.attention_forward
    monkeypatch.setattr(gluon, "attention_forward", lambda *a, **kw: calls.append(kw.get("window")) or real(*a, **kw))
    check_window(*make_qkv(n, n, head_dim, dtype, heads_q=4, heads_kv=2), window_size, is_causal)
    assert calls and calls[0] is not None, "the Gluon forward did not run with the window"


@pytest.mark.parametrize("seed", range(4))
def test_every_block_sees_keys_is_the_brute_forces(seed):
    """``traversal.every_block_sees_keys`` (when the Gluon forward may take a window) against every
    block's keys counted one by one, for bounds moved to the bottom-right alignment too."""
    rng = random.Random(seed)
    for _ in range(300):
        n_q, n_kv, block = rng.randint(1, 90), rng.randint(1, 90), rng.choice([4, 16, 32])
        left, right = rng.randint(0, 40), rng.randint(0, 40)
        if rng.random() < 0.5:  # bottom-right: both bounds moved by N_kv - N_q
            left, right = traversal.aligned_bounds(left, right, n_q, n_kv)
        seen = [any(0 <= j < n_kv and i - left <= j <= i + right for i in range(q0, q0 + block) for j in range(n_kv))
                for q0 in range(0, n_q, block)]
        assert traversal.every_block_sees_keys(n_q, n_kv, left, right, block) == all(seen), \
            (n_q, n_kv, left, right, block, seen)
