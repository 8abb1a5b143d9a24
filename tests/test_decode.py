"""flashattn.decode against a float64 reference: KV caches, grouped heads, split-KV.

Each case is judged by the rule of flashattn.testing.rule (error against float64 at most 2x the error of
plain PyTorch in the same dtype, plus a floor) on the output and the LSE. Rows with no keys
(L = 0) must give exactly 0 and -inf. The caches hold NaN past every valid length, so a kernel that
reads one entry too many fails loudly. The tests marked ``gpu`` run only on a CUDA GPU: long
caches, the tensor-core bf16 path and every split count the heuristic can choose.
"""
import re
import sys

import pytest
import torch

import flashattn
from flashattn.kernels.decode import (MAX_SPLITS, MIN_TILES_PER_SPLIT, choose_num_splits, decode_forward,
                                      max_block_r)
from flashattn.testing.reference import decode_reference, decode_split_partials, naive_attention
from flashattn.kernels.traversal import decode_split_bounds
from flashattn.testing.rule import judge

DEVICE = flashattn.DEVICE
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
from flashattn.kernels import decode as kernel_decode  # noqa: E402
from flashattn.ops import decode as DECODE  # noqa: E402  (flashattn.decode is the function)


def make_cache(lengths, n_max, heads, kv_heads, n_q, head_dim, dtype, seed=0, garbage=float("nan"),
               layout="bhnd"):
    """q (B, H_q, N_q, D) and caches (B, H_kv, N_max, D) holding ``garbage`` past each length;
    ``layout="bnhd"`` makes the caches (and q) transposed views of (B, N, H, D) tensors."""
    g = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    q = torch.randn(batch, n_q, heads, head_dim, generator=g).transpose(1, 2)
    k = torch.randn(batch, n_max, kv_heads, head_dim, generator=g).transpose(1, 2)
    v = torch.randn(batch, n_max, kv_heads, head_dim, generator=g).transpose(1, 2)
    for b, length in enumerate(lengths):
        k[b, :, length:] = garbage
        v[b, :, length:] = garbage
    if layout == "bhnd":
        q, k, v = (t.contiguous() for t in (q, k, v))
    q, k, v = (t.to(dtype=dtype, device=DEVICE) for t in (q, k, v))
    return q, k, v, torch.tensor(lengths, dtype=torch.int32)


def check(q, k, v, lengths, scale=None, num_splits=None):
    """Run decode (with ``num_splits`` forced if given) and judge it; returns the checks."""
    if num_splits is None:
        out, lse = flashattn.decode(q, k, v, lengths, scale=scale, return_lse=True)
    else:
        scale_ = q.shape[-1] ** -0.5 if scale is None else scale
        out, lse = decode_forward(q, k, v, lengths.to(DEVICE), int(lengths.max()), scale_, num_splits)
    ref_out, ref_lse = decode_reference(q.double(), k.double(), v.double(), lengths, scale)
    pt_out, pt_lse = decode_reference(q, k, v, lengths, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    empty = ref_lse == float("-inf")  # rows without keys: exactly 0 and -inf
    assert torch.equal(lse == float("-inf"), empty), "rows without keys must have lse -inf, and only they"
    assert torch.isfinite(out).all() and (out[empty.expand_as(out[..., 0])] == 0).all()
    finite = [torch.where(empty, 0.0, t.double()) for t in (lse, ref_lse, pt_lse)]
    return judge(dict(out=out, lse=finite[0]), dict(out=ref_out, lse=finite[1]),
                 dict(out=pt_out, lse=finite[2]), q.dtype)


def assert_rule(checks):
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


def ragged(n_q):
    """Lengths: empty, the shortest allowed, ragged (not multiples of any tile), one full cache."""
    return [0, n_q, 17, 70, 113]


@pytest.mark.parametrize("n_q", [1, 3])
@pytest.mark.parametrize("heads,kv_heads", [(1, 1), (4, 1), (4, 2), (8, 1), (8, 2)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ragged_lengths_grouped_heads(dtype, heads, kv_heads, n_q):
    q, k, v, lengths = make_cache(ragged(n_q), 113, heads, kv_heads, n_q, 32, dtype)
    assert_rule(check(q, k, v, lengths))


def test_the_default_splits_on_the_interpreter():
    """The heuristic splits the test caches above (pretend SMs on the interpreter), and not a
    short one."""
    if not flashattn.INTERPRET:
        pytest.skip("the interpreter's pretend SM count")
    assert choose_num_splits(5 * 2, 113, 16, 8) == 2
    assert choose_num_splits(5 * 1, 300, 16, 8) == 3
    assert choose_num_splits(5 * 2, 40, 16, 8) == 1


@pytest.mark.parametrize("num_splits", [1, 2, 5, 13])
@pytest.mark.parametrize("n_q", [1, 3])
def test_every_split_count(num_splits, n_q):
    """More splits than tiles leave splits without keys; each must merge as nothing."""
    q, k, v, lengths = make_cache([0, n_q, 16, 49, 131], 131, 4, 2, n_q, 16, torch.float32, seed=1)
    assert_rule(check(q, k, v, lengths, num_splits=num_splits))


@pytest.mark.parametrize("n_kv", [0, 1, 3, 16, 17, 64, 113])
@pytest.mark.parametrize("n_q", [1, 3])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_split_bounds_cut_the_cache_in_order(n_kv, n_q, num_splits):
    """traversal.decode_split_bounds: the splits cover [0, L) in order without overlap, start on
    whole tiles, and each split with keys starts with a key that every new token sees (with fewer
    keys than new tokens, the first split takes them all)."""
    bounds = decode_split_bounds(n_kv, n_q, num_splits, 16)
    assert len(bounds) == num_splits
    keys = [j for lo, hi in bounds for j in range(lo, hi)]
    assert keys == list(range(n_kv))
    for lo, hi in bounds:
        assert lo % 16 == 0 and lo <= hi
        assert lo == hi or lo <= n_kv - n_q or n_kv < n_q  # token 0 sits at L - N_q and sees key lo
    if n_kv < n_q:
        assert bounds[0] == (0, n_kv)
    everyone = decode_split_bounds(n_kv, n_q, num_splits, 16, causal=False)  # not causal: all see every key
    assert [j for lo, hi in everyone for j in range(lo, hi)] == list(range(n_kv))


@pytest.mark.parametrize("num_splits", [1, 2, 3, 9])
@pytest.mark.parametrize("n_q", [1, 3])
def test_partial_states_match_the_split_bounds(num_splits, n_q):
    """The split kernel's partial states (O_s, LSE_s in base 2) before the merge, against the
    formula applied to the keys traversal.decode_split_bounds gives each split."""
    q, k, v, lengths = make_cache(ragged(n_q), 113, 4, 2, n_q, 24, torch.float32, seed=6)
    config = dict(BLOCK_KV=16, num_warps=4, num_stages=2)
    o_part, lse_part = decode_forward(q, k, v, lengths.to(DEVICE), 113, 0.3, num_splits, config,
                                      partials=True)
    ref_o, ref_lse = decode_split_partials(q.double(), k.double(), v.double(), lengths, num_splits,
                                           16, scale=0.3)
    assert o_part.shape == ref_o.shape and lse_part.shape == ref_lse.shape
    empty = ref_lse == float("-inf")
    assert torch.equal(lse_part.cpu() == float("-inf"), empty.cpu())
    assert (o_part[empty] == 0).all()
    torch.testing.assert_close(o_part.double(), ref_o, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse_part.double().nan_to_num(neginf=0.0), ref_lse.nan_to_num(neginf=0.0),
                               atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_transposed_caches_and_queries(dtype):
    """Caches and q as (B, N, H, D) tensors viewed as (B, H, N, D): no copy, same answer."""
    q, k, v, lengths = make_cache([5, 64, 97], 100, 4, 2, 3, 40, dtype, seed=2, layout="bnhd")
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    assert_rule(check(q, k, v, lengths, num_splits=3))
    assert_rule(check(q, k, v, lengths, num_splits=1))


def test_long_garbage_past_short_lengths():
    """N_max much larger than every length; NaN and inf beyond; int64 lengths; head dim 24."""
    q, k, v, lengths = make_cache([1, 40, 9], 300, 2, 2, 1, 24, torch.float32, seed=3)
    k[:, :, 200:], v[:, :, 250:] = float("inf"), float("-inf")
    assert_rule(check(q, k, v, lengths.long()))
    assert_rule(check(q, k, v, lengths, num_splits=4))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_many_query_rows_take_several_tiles(dtype):
    """24 query heads on one KV head x 3 new tokens = 72 rows: two row tiles of 64 (three of 32
    in float32)."""
    assert max_block_r(dtype) == (32 if dtype == torch.float32 else 64)
    q, k, v, lengths = make_cache([3, 50], 50, 24, 1, 3, 16, dtype, seed=4)
    assert_rule(check(q, k, v, lengths))
    assert_rule(check(q, k, v, lengths, num_splits=2))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_magnitude_stays_finite(dtype):
    q, k, v, lengths = make_cache([33, 80], 80, 4, 2, 2, 32, dtype, seed=5)
    q, k = q * 6, k * 6
    assert_rule(check(q, k, v, lengths, num_splits=3))


@pytest.mark.parametrize("scale", [0.05, 1.0])
def test_explicit_scale(scale):
    q, k, v, lengths = make_cache([20, 45], 45, 2, 1, 1, 16, torch.float32, seed=6)
    assert_rule(check(q, k, v, lengths, scale=scale))


@pytest.mark.parametrize("num_splits", [None, 3])
def test_tiny_scale_gives_the_mean_of_the_values(num_splits):
    """scale * log2(e) below float32's normals (1e-46 is 0 in float32): a hidden score times it
    must not make NaN (-inf * 0); every score is ~0, so each query averages the values it sees."""
    q, k, v, lengths = make_cache([20, 45], 45, 2, 1, 2, 16, torch.float32, seed=7)
    if num_splits is None:
        out = flashattn.decode(q, k, v, lengths, scale=1e-46)
    else:
        out = decode_forward(q, k, v, lengths.to(DEVICE), int(lengths.max()), 1e-46, num_splits)[0]
    for b, length in enumerate(lengths.tolist()):
        for t in range(q.shape[2]):  # query t sees keys 0 .. length - n_q + t
            seen = v[b, :, :length - q.shape[2] + t + 1].double().mean(dim=1)
            torch.testing.assert_close(out[b, :, t].double(), seen.repeat_interleave(2, dim=0),
                                       atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_q", [1, 37])
def test_full_caches_match_attention_with_repeated_heads(dtype, n_q):
    """With every cache full, decode is attention on K and V repeated to H_q heads: causal (top
    left) when N_q equals the length, no mask when N_q is 1. flashattn.attention in the same dtype
    stands in for PyTorch in the rule."""
    n = 37
    q, k, v, lengths = make_cache([n, n], n, 8, 2, n_q, 32, dtype, seed=7)
    k_rep, v_rep = (t.repeat_interleave(4, dim=1) for t in (k, v))
    causal = n_q > 1
    out, lse = flashattn.decode(q, k, v, lengths, return_lse=True)
    att_out, att_lse = flashattn.attention(q, k_rep, v_rep, is_causal=causal, return_lse=True)
    ref_out, ref_lse = naive_attention(q.double(), k_rep.double(), v_rep.double(), is_causal=causal)
    assert_rule(judge(dict(out=out, lse=lse), dict(out=ref_out, lse=ref_lse),
                      dict(out=att_out, lse=att_lse), dtype))


def test_every_length_empty():
    q, k, v, lengths = make_cache([0, 0], 20, 4, 2, 3, 16, torch.float16)
    out, lse = flashattn.decode(q, k, v, lengths, return_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all()
    q, k, v, lengths = make_cache([0], 0, 2, 1, 1, 16, torch.float32)  # a cache with no room at all
    out, lse = flashattn.decode(q, k, v, lengths, return_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all()


def test_no_new_tokens_and_no_batch():
    q, k, v, lengths = make_cache([4], 8, 2, 1, 1, 16, torch.float32)
    out = flashattn.decode(q[:, :, :0], k, v, lengths)
    assert out.shape == (1, 2, 0, 16)
    out, lse = flashattn.decode(q[:0], k[:0], v[:0], lengths[:0], return_lse=True)
    assert out.shape == (0, 2, 1, 16) and lse.shape == (0, 2, 1)


def test_split_heuristic():
    """The count nearest to two programs per SM, each split at least MIN_TILES_PER_SPLIT tiles,
    at most MAX_SPLITS; no split when the programs fill the GPU or the cache is short."""
    assert choose_num_splits(8 * 8, 4096, 64, 132) == 4      # B = 8, H_kv = 8 on an H200
    assert choose_num_splits(8 * 8, 65536, 64, 132) == 4
    assert choose_num_splits(8 * 8, 65536, 64, 132, programs_per_sm=4) == 8
    assert choose_num_splits(1, 65536, 64, 132) == MAX_SPLITS
    assert choose_num_splits(264, 65536, 64, 132) == 1
    assert choose_num_splits(8, 64 * MIN_TILES_PER_SPLIT * 3, 64, 132) == 3
    assert choose_num_splits(8, 200, 64, 132) == 1
    assert choose_num_splits(8, 0, 64, 132) == 1


@pytest.mark.parametrize("asked, used", [("tf32x3", "ieee"), ("ieee", "ieee"), ("tf32", "tf32")])
def test_float32_decoding_never_takes_3xtf32(monkeypatch, asked, used):
    """Where the attention kernels take 3xTF32 for 'highest' float32 (FLASHATTN_TF32X3=1 on a GPU),
    decode still multiplies in IEEE float32 (3xTF32 decode tiles spill and overflow shared
    memory: tests/test_decode_compile.py)."""
    from flashattn.gpu import configs

    monkeypatch.setattr(configs, "dot_precision", lambda dtype: asked)
    assert configs.decode_precision(torch.float32) == used


def test_inputs_that_require_grad():
    """Forward only: with gradients enabled an input that requires grad is refused (a result
    that silently cuts the graph would be worse); under no_grad it runs and needs no grad."""
    q, k, v, lengths = make_cache([5, 9], 9, 2, 1, 1, 16, torch.float32)
    for name, t in (("q", q), ("k_cache", k), ("v_cache", v)):
        args = dict(q=q, k_cache=k, v_cache=v)
        args[name] = t.clone().requires_grad_()
        with pytest.raises(ValueError, match=f"{name} requires grad.*forward only.*no_grad"):
            flashattn.decode(**args, cache_seqlens=lengths)
        with torch.no_grad():
            out = flashattn.decode(**args, cache_seqlens=lengths)
        assert not out.requires_grad
        torch.testing.assert_close(out, flashattn.decode(q, k, v, lengths))
    with torch.inference_mode():
        assert not flashattn.decode(q.clone().requires_grad_(), k, v, lengths).requires_grad


def t(*shape, dtype=torch.float32, device=DEVICE):
    return torch.randn(*shape).to(dtype=dtype, device=device)


GOOD = dict(q=t(2, 4, 1, 16), k_cache=t(2, 2, 10, 16), v_cache=t(2, 2, 10, 16),
            cache_seqlens=torch.tensor([3, 10]))


@pytest.mark.parametrize("overrides,error,words", [
    (dict(q=t(2, 4, 1, 16, dtype=torch.float64)), TypeError, ["q", "float64"]),
    (dict(k_cache=t(2, 2, 10, 16, dtype=torch.float16)), TypeError, ["k_cache", "float16", "q has"]),
    (dict(v_cache=[1.0]), TypeError, ["v_cache", "torch.Tensor", "list"]),
    (dict(q=t(4, 1, 16)), ValueError, ["q", "4 dims", "(B, H_q, N_q, D)", "(4, 1, 16)"]),
    (dict(k_cache=t(2, 10, 16), v_cache=t(2, 10, 16)), ValueError, ["k_cache", "4 dims", "N_max"]),
    (dict(v_cache=t(2, 2, 11, 16)), ValueError, ["v_cache", "(2, 2, 11, 16)", "k_cache has"]),
    (dict(k_cache=t(3, 2, 10, 16), v_cache=t(3, 2, 10, 16)), ValueError, ["k_cache", "batch 3", "q has 2"]),
    (dict(k_cache=t(2, 2, 10, 8), v_cache=t(2, 2, 10, 8)), ValueError, ["k_cache", "head dim 8", "16"]),
    (dict(k_cache=t(2, 3, 10, 16), v_cache=t(2, 3, 10, 16)), ValueError, ["4 heads", "k_cache 3", "multiple"]),
    (dict(k_cache=t(2, 0, 10, 16), v_cache=t(2, 0, 10, 16)), ValueError, ["k_cache 0", "multiple"]),
    (dict(q=t(2, 4, 1, 300), k_cache=t(2, 2, 10, 300), v_cache=t(2, 2, 10, 300)), ValueError, ["head dim", "300", "256"]),
    (dict(cache_seqlens=[3, 10]), TypeError, ["cache_seqlens", "torch.Tensor", "list"]),
    (dict(cache_seqlens=torch.tensor([3.0, 10.0])), TypeError, ["cache_seqlens", "float32", "int32"]),
    (dict(cache_seqlens=torch.tensor([3, 10, 4])), ValueError, ["cache_seqlens", "(3,)", "(2,)"]),
    (dict(cache_seqlens=torch.tensor(3)), ValueError, ["cache_seqlens", "shape ()"]),
    (dict(cache_seqlens=torch.tensor([-1, 10])), ValueError, ["cache_seqlens[0] is -1", "N_max = 10"]),
    (dict(cache_seqlens=torch.tensor([3, 11])), ValueError, ["cache_seqlens[1] is 11", "N_max = 10"]),
    (dict(scale=float("nan")), ValueError, ["scale", "finite"]),
    (dict(scale=0.0), ValueError, ["scale", "positive"]),
    (dict(scale="0.1"), TypeError, ["scale", "str"]),
    (dict(return_lse=1), TypeError, ["return_lse", "bool"]),
])
def test_bad_input_is_named(overrides, error, words):
    args = dict(GOOD, **overrides)
    with pytest.raises(error) as info:
        flashattn.decode(**args)
    for word in words:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


def test_tensors_on_another_device():
    meta = dict(q=torch.empty(2, 4, 1, 16, device="meta"), k_cache=torch.empty(2, 2, 10, 16, device="meta"),
                v_cache=torch.empty(2, 2, 10, 16, device="meta"))
    with pytest.raises(ValueError, match="k_cache is on meta but q is on"):
        flashattn.decode(**dict(GOOD, k_cache=meta["k_cache"]))
    with pytest.raises(ValueError, match="q is on meta.*flashattn runs on"):
        flashattn.decode(**meta, cache_seqlens=GOOD["cache_seqlens"])
    with pytest.raises(ValueError, match="cache_seqlens is on meta"):
        flashattn.decode(**dict(GOOD, cache_seqlens=torch.empty(2, dtype=torch.int32, device="meta")))


def test_every_call_checks_what_the_plan_does_not_cover():
    """decode checks the tensors' types, dtypes, shapes, strides and devices once per such
    arguments (and plans), but the lengths, the grad mode, scale and return_lse at every call."""
    q, k, v, lengths = make_cache([5, 9], 9, 2, 1, 1, 16, torch.float32)
    flashattn.decode(q, k, v, lengths)
    good = dict(q=q, k_cache=k, v_cache=v, cache_seqlens=lengths)
    for overrides, error, words in [
        (dict(cache_seqlens=torch.tensor([5, 10], dtype=torch.int32)), ValueError, "cache_seqlens[1] is 10"),
        (dict(cache_seqlens=torch.tensor([-1, 9], dtype=torch.int32)), ValueError, "cache_seqlens[0] is -1"),
        (dict(q=q.clone().requires_grad_()), ValueError, "q requires grad"),
        (dict(v_cache=v.clone().requires_grad_()), ValueError, "v_cache requires grad"),
        (dict(scale="0.1"), TypeError, "scale must be a real number"),
        (dict(scale=-1.0), ValueError, "scale must be a finite positive"),
        (dict(return_lse=1), TypeError, "return_lse must be a bool"),
    ]:
        args = dict(good, **overrides)
        assert DECODE._plan_key(args["q"], args["k_cache"], args["v_cache"], args["cache_seqlens"]) in DECODE._PLANS
        with pytest.raises(error, match=re.escape(words)):
            flashattn.decode(**args)
    with pytest.raises(TypeError, match="cache_seqlens must be a torch.Tensor"):
        flashattn.decode(q, k, v, [5, 9])
    with pytest.raises(TypeError, match="v_cache must be a torch.Tensor"):
        flashattn.decode(q, k, v.cpu().numpy(), lengths)


def test_many_lengths_are_checked_too():
    """decode reads a few lengths as a list and many with torch.aminmax: both find a bad one."""
    lengths = [1 + b % 3 for b in range(70)]
    q, k, v, lens = make_cache(lengths, 3, 1, 1, 1, 16, torch.float32)
    assert_rule(check(q, k, v, lens))
    for bad, value in ((69, 4), (3, -2)):
        wrong = lens.clone()
        wrong[bad] = value
        with pytest.raises(ValueError, match=re.escape(f"cache_seqlens[{bad}] is {value}")):
            flashattn.decode(q, k, v, wrong)


@pytest.mark.parametrize("n_q", [1, 3])
def test_max_seqlen_reads_no_length_on_the_host(monkeypatch, n_q):
    """With max_seqlen the lengths stay where they are and are never read on the host (what a CUDA
    graph needs): the same answers as the checked path, whatever the split count it implies."""
    q, k, v, lens = make_cache([37, 0, 20, 64], 64, heads=4, kv_heads=2, n_q=n_q, head_dim=16,
                               dtype=torch.float32, seed=3)
    want, want_lse = flashattn.decode(q, k, v, lens, return_lse=True)
    monkeypatch.setattr(DECODE, "_lengths", lambda *args: pytest.fail("the lengths were read on the host"))
    on_device = lens.to(DEVICE)
    for bound in (64, 40):
        out, lse = flashattn.decode(q, k, v, on_device, return_lse=True, max_seqlen=bound)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-6)


def test_max_seqlen_keeps_unchecked_lengths_inside_the_cache():
    """Unchecked lengths past the cache read as the whole cache, negative ones as empty: nothing
    outside the cache is read."""
    q, k, v, _ = make_cache([16, 16], 16, heads=2, kv_heads=1, n_q=1, head_dim=16, dtype=torch.float32)
    out = flashattn.decode(q, k, v, torch.tensor([1000, -5], dtype=torch.int32, device=DEVICE), max_seqlen=16)
    want = flashattn.decode(q, k, v, torch.tensor([16, 0], dtype=torch.int32))
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("max_seqlen, error, words", [
    (65, ValueError, "max_seqlen is 65; expected 0 to N_max = 64"),
    (-1, ValueError, "max_seqlen is -1"),
    (3.0, TypeError, "max_seqlen must be an int"),
    (True, TypeError, "max_seqlen must be an int"),
])
def test_max_seqlen_is_checked(max_seqlen, error, words):
    q, k, v, lens = make_cache([10], 64, heads=2, kv_heads=1, n_q=1, head_dim=16, dtype=torch.float32)
    with pytest.raises(error, match=re.escape(words)):
        flashattn.decode(q, k, v, lens.to(DEVICE), max_seqlen=max_seqlen)


def test_the_host_settings_are_checked():
    with pytest.raises(ValueError, match="launch='fast'"):
        kernel_decode.set_host(launch="fast")


def test_a_plan_for_each_layout_and_dtype(monkeypatch):
    """The same shapes with other strides or another dtype get their own plan (and the right
    answer), called in turns; a repeated call finds its plan."""
    monkeypatch.setattr(DECODE, "_PLANS", {})
    cases = [make_cache([3, 40, 17], 40, 4, 2, 1, 16, torch.float32, seed=8),
             make_cache([3, 40, 17], 40, 4, 2, 1, 16, torch.float32, seed=8, layout="bnhd"),
             make_cache([3, 40, 17], 40, 4, 2, 1, 16, torch.float16, seed=8)]
    for _ in range(2):
        for q, k, v, lengths in cases:
            assert_rule(check(q, k, v, lengths))
    assert len(DECODE._PLANS) == 3


def test_the_plans_stay_few(monkeypatch):
    monkeypatch.setattr(DECODE, "_PLANS", {i: None for i in range(DECODE.MAX_PLANS)})
    q, k, v, lengths = make_cache([5, 9], 9, 2, 1, 1, 16, torch.float32)
    flashattn.decode(q, k, v, lengths)
    assert len(DECODE._PLANS) == 1


# -- on a GPU ----------------------------------------------------------------------------------

def gpu_case(lengths, n_max, dtype, heads=32, kv_heads=8, n_q=1, head_dim=128, seed=0):
    """Like make_cache, but drawn on the GPU (fast at 64k keys)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch = len(lengths)
    q = torch.randn(batch, heads, n_q, head_dim, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(batch, kv_heads, n_max, head_dim, device="cuda", generator=g).to(dtype)
            for _ in range(2))
    for b, length in enumerate(lengths):
        k[b, :, length:] = float("nan")
        v[b, :, length:] = float("nan")
    return q, k, v, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("lengths,n_max,n_q", [
    ([16384, 16384], 16384, 1), ([65536, 65536], 65536, 1),
    ([0, 1, 4097, 16383, 65536, 777], 65536, 1), ([4, 5000, 65535], 65536, 4)])
def test_gpu_long_caches(dtype, lengths, n_max, n_q):
    q, k, v, lens = gpu_case(lengths, n_max, dtype, heads=8, kv_heads=2, n_q=n_q)
    assert_rule(check(q, k, v, lens))                    # lengths on the CPU: no synchronisation
    assert_rule(check(q, k, v, lens.to("cuda").long()))  # lengths on the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_every_split_count_the_heuristic_can_choose(dtype):
    q, k, v, lens = gpu_case([0, 3, 200, 1111, 8192, 5000], 8192, dtype, heads=8, kv_heads=2, n_q=3)
    for num_splits in range(1, MAX_SPLITS + 1):
        assert_rule(check(q, k, v, lens, num_splits=num_splits))


@pytest.mark.gpu
@pytest.mark.parametrize("candidate", range(8))
def test_gpu_every_candidate_configuration(candidate):
    """The configurations the decode benchmark times, on the benchmark's shapes and ragged lengths."""
    from flashattn.gpu import configs

    c = configs.DECODE_CANDIDATES[candidate]
    q, k, v, lens = gpu_case([1, 4096, 3001, 129], 4096, torch.bfloat16, n_q=1)
    config = configs.decode_config(q.dtype, "ieee", 16, 128, c)
    for num_splits in (1, 5):
        out, lse = decode_forward(q, k, v, lens.cuda(), 4096, 128 ** -0.5, num_splits, config)
        ref_out, ref_lse = decode_reference(q.double(), k.double(), v.double(), lens)
        pt_out, pt_lse = decode_reference(q, k, v, lens)
        assert_rule(judge(dict(out=out, lse=lse), dict(out=ref_out, lse=ref_lse),
                          dict(out=pt_out, lse=pt_lse), q.dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_later_calls_launch_the_compiled_kernels_directly(dtype):
    """After the first call, decode launches the kernels Triton compiled for it without going
    through Triton's JIT (flashattn.gpu.direct.launch): the answers stay right as the lengths change (and the
    split count with them), with the lengths on the CPU and on the GPU."""
    q, k, v, _ = gpu_case([4096] * 4, 4096, dtype, heads=8, kv_heads=2)
    for lengths in ([4096, 100, 0, 3000], [1, 4096, 2000, 7], [4096] * 4, [64, 3, 0, 1]):
        lens = torch.tensor(lengths, dtype=torch.int32)
        for where in ("cpu", "cuda"):
            assert_rule(check(q, k, v, lens.to(where)))
    plan = DECODE.plan_for(q, k, v, lens)
    assert plan.kernels, "no compiled kernel was kept for direct launches"


@pytest.mark.gpu
def test_gpu_capture_in_a_cuda_graph_is_refused():
    """Without max_seqlen, decode reads the lengths on the host at every call: a CUDA graph would
    replay the lengths of its capture, so decode refuses to be captured, and says what to pass."""
    q, k, v, lens = gpu_case([64, 30], 64, torch.float16, heads=4, kv_heads=2)
    flashattn.decode(q, k, v, lens)
    for lengths in (lens, lens.cuda()):
        with pytest.raises(ValueError, match="CUDA graph.*max_seqlen"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                flashattn.decode(q, k, v, lengths)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_a_generation_loop_captured_in_a_cuda_graph(dtype):
    """With max_seqlen and the lengths on the GPU, decode is captured once and replayed: each
    replay reads the lengths (and the query) of its own step and matches an uncaptured call."""
    q, k, v, _ = gpu_case([4096] * 4, 4096, dtype, heads=8, kv_heads=2)
    lens = torch.tensor([4096, 100, 0, 3000], dtype=torch.int32, device="cuda")
    static_q = q.clone()
    flashattn.decode(static_q, k, v, lens, max_seqlen=4096)  # compile and plan outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = flashattn.decode(static_q, k, v, lens, max_seqlen=4096)
    g = torch.Generator(device="cuda").manual_seed(1)
    for lengths in ([1, 4096, 2000, 7], [4096] * 4, [64, 3, 0, 1]):
        lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        static_q.copy_(torch.randn(q.shape, device="cuda", generator=g).to(dtype))
        graph.replay()
        want = flashattn.decode(static_q, k, v, lens.cpu())
        torch.testing.assert_close(static_out, want)  # the split count may differ: rounding only
