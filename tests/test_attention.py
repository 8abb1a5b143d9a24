"""flashattn.attention against a float64 reference: forward, LSE and all three gradients.

The rule (flashattn.testing.rule): the error against float64 may be at most 2x (output, LSE) or 3x
(gradients) the error that plain PyTorch attention makes in the same dtype against the same
float64 reference, plus a floor of a few roundings of the dtype. Upstream gradients reach both
the output and the LSE, so the LSE's backward is tested too.

On a CPU the kernels run in Triton's interpreter; there bfloat16 is computed in float32 (the
interpreter cannot multiply bf16 tiles) and the rule still holds. On a GPU these tests run compiled
(bf16 on the tensor cores), and tests/test_gpu.py adds every tile configuration, long sequences
and 64-bit offsets.
"""
import flashattn  # first: it picks the interpreter before triton is imported (for split_kernel)
import pytest
import torch
import triton
import triton.language as tl

from flashattn.kernels.tiles import split_tf32
from flashattn.ops.attention import SUPPORTED_DTYPES as DTYPES
from flashattn.testing.rule import compare_with_reference

DEVICE = flashattn.DEVICE
# Lengths that are not multiples of any tile (1, 17, 69, 113), one that is (128), one longer than
# several tiles (200), and query/key lengths that differ both ways.
LENGTHS = [(1, 1), (17, 17), (69, 69), (113, 113), (128, 128), (200, 200), (17, 113), (113, 17)]


def make_qkv(n_q, n_kv, head_dim, dtype, batch=1, heads=2, magnitude=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = lambda n: (batch, heads, n, head_dim)  # noqa: E731
    q = torch.randn(shape(n_q), generator=g) * magnitude
    k = torch.randn(shape(n_kv), generator=g) * magnitude
    v = torch.randn(shape(n_kv), generator=g)
    return [t.to(dtype=dtype, device=DEVICE) for t in (q, k, v)]


def assert_rule(checks):
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("n_q,n_kv", LENGTHS)
def test_lengths(n_q, n_kv, dtype, is_causal):
    assert_rule(compare_with_reference(*make_qkv(n_q, n_kv, 64, dtype), is_causal=is_causal))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [16, 40, 128])
def test_head_dims(head_dim, dtype, is_causal):
    assert_rule(compare_with_reference(*make_qkv(69, 69, head_dim, dtype), is_causal=is_causal))


@pytest.mark.parametrize("head_dim", [1, 3, 24, 96, 200, 256])
def test_unusual_head_dims(head_dim):
    assert_rule(compare_with_reference(*make_qkv(33, 40, head_dim, torch.float32), is_causal=True))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bfloat16_and_friends_on_ragged_unequal_lengths(dtype, is_causal):
    assert_rule(compare_with_reference(*make_qkv(113, 69, 64, dtype), is_causal=is_causal))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_magnitude_stays_finite(dtype, is_causal):
    """q and k scaled by 6: scores of +-100s, where a naive exp would overflow."""
    q, k, v = make_qkv(113, 113, 64, dtype, magnitude=6.0)
    out, lse = flashattn.attention(q, k, v, is_causal=is_causal, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_rule(compare_with_reference(q, k, v, is_causal=is_causal))


@pytest.mark.parametrize("scale", [0.05, 1.0, 3.0])
def test_explicit_scale(scale):
    assert_rule(compare_with_reference(*make_qkv(69, 50, 32, torch.float32), is_causal=True,
                                       scale=scale))


def test_transposed_layout_needs_no_copy():
    """A (B, N, H, D) tensor viewed as (B, H, N, D), the usual layout after a projection."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 69, 3, 40, generator=g).to(DEVICE).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    assert_rule(compare_with_reference(q, k, v, is_causal=True))


def test_sliced_inputs_and_non_contiguous_upstream_gradient():
    g = torch.Generator().manual_seed(2)
    base = torch.randn(1, 2, 150, 96, generator=g).to(DEVICE)
    q, k, v = base[..., 3:120, :64], base[..., 10:80, 16:80], base[..., 50:120, 32:96]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    assert_rule(compare_with_reference(q, k, v, is_causal=False))
    # An upstream gradient that is itself a transposed view.
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = flashattn.attention(q, k, v)
    do = torch.randn(out.shape[::-1], generator=g).to(DEVICE).permute(3, 2, 1, 0)
    assert not do.is_contiguous()
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_grads = torch.autograd.grad(flashattn.testing.reference.naive_attention(*ref)[0], ref, do.double())
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape_q,shape_kv", [
    ((37, 32), (45, 32)),                   # 2-D: a single head
    ((3, 37, 32), (3, 45, 32)),             # 3-D: heads only
    ((2, 2, 2, 37, 32), (2, 2, 2, 45, 32)),  # 5-D: extra leading dims merge into the batch
])
def test_leading_dims(shape_q, shape_kv):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(shape_q, generator=g).to(DEVICE)
    k, v = (torch.randn(shape_kv, generator=g).to(DEVICE) for _ in range(2))
    out, lse = flashattn.attention(q, k, v, is_causal=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == q.shape[:-1]
    assert_rule(compare_with_reference(q, k, v, is_causal=True))


def test_five_dim_non_mergeable_layout():
    """Leading dims whose strides cannot merge: reshape copies, the answer must not change."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(3, 2, 4, 40, 16, generator=g).to(DEVICE).permute(1, 0, 2, 3, 4)
               for _ in range(3))
    assert_rule(compare_with_reference(q, k, v, is_causal=True))


def test_matches_sdpa():
    q, k, v = make_qkv(113, 113, 64, torch.float32)
    for causal in (False, True):
        torch.testing.assert_close(
            flashattn.attention(q, k, v, is_causal=causal),
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal),
            atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_backward_is_deterministic(dtype):
    q, k, v = (t.requires_grad_() for t in make_qkv(113, 113, 64, dtype))
    do = torch.randn_like(q)

    def grads():
        return torch.autograd.grad(flashattn.attention(q, k, v, is_causal=True), (q, k, v), do)

    first, second = grads(), grads()
    for a, b in zip(first, second):
        assert torch.equal(a, b)
        assert a.dtype == dtype


def test_zero_length_sequences():
    q, k, v = make_qkv(0, 17, 32, torch.float32)
    out, lse = flashattn.attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and lse.shape == q.shape[:-1]

    q, k, v = (t.requires_grad_() for t in make_qkv(5, 0, 32, torch.float32))
    out, lse = flashattn.attention(q, k, v, is_causal=True, return_lse=True)
    ref, ref_lse = flashattn.testing.reference.naive_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, ref)  # an empty sum of values: zeros, like SDPA
    assert torch.equal(lse, ref_lse)      # log of an empty sum: -inf, like torch.logsumexp
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert (dq == 0).all() and dk.numel() == 0 and dv.numel() == 0


def test_gradient_through_lse_only():
    q, k, v = (t.requires_grad_() for t in make_qkv(40, 30, 16, torch.float32))
    _, lse = flashattn.attention(q, k, v, is_causal=True, return_lse=True)
    got = torch.autograd.grad(lse.sum(), (q, k, v), allow_unused=True)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(flashattn.testing.reference.naive_attention(*ref, is_causal=True)[1].sum(),
                               ref, allow_unused=True)
    for g, w, t in zip(got, want, ref):
        w = torch.zeros_like(t) if w is None else w  # the LSE does not depend on V
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_the_rule_rejects_a_slightly_wrong_kernel(dtype):
    """The tolerance must be able to fail: the kernel run with a scale off by 1% fails it."""
    q, k, v = make_qkv(69, 69, 64, dtype)

    def off_by_one_percent(q, k, v, is_causal, scale, return_lse):
        return flashattn.attention(q, k, v, is_causal=is_causal, scale=1.01 / 8.0, return_lse=return_lse)

    checks = compare_with_reference(q, k, v, is_causal=True, impl=off_by_one_percent)
    assert not any(c.ok for c in checks), "\n".join(map(str, checks))


@pytest.mark.parametrize("precision", ["high", "medium"])
def test_the_tf32_rule_passes_tf32_and_rejects_a_slightly_wrong_kernel(precision):
    """With TF32 matmuls allowed, the baseline is PyTorch on TF32-rounded inputs and the floor is
    at TF32's unit roundoff: a kernel that rounds its operands to TF32 passes, one whose scale is
    off by 1% still fails every quantity."""
    from flashattn.testing.rule import round_to_tf32, unit_roundoff

    q, k, v = make_qkv(69, 69, 64, torch.float32)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        assert unit_roundoff(torch.float32) == 2.0 ** -11

        def tf32_inputs(q, k, v, is_causal, scale, return_lse):  # the roundings of a TF32 kernel
            rounded = [t + (round_to_tf32(t.detach()) - t.detach()) for t in (q, k, v)]  # gradients pass
            return flashattn.attention(*rounded, is_causal=is_causal, scale=scale, return_lse=return_lse)

        assert_rule(compare_with_reference(q, k, v, is_causal=True, impl=tf32_inputs))

        def off_by_one_percent(q, k, v, is_causal, scale, return_lse):
            return tf32_inputs(q, k, v, is_causal, 1.01 / 8.0, return_lse)

        checks = compare_with_reference(q, k, v, is_causal=True, impl=off_by_one_percent)
        assert not any(c.ok for c in checks), "\n".join(map(str, checks))
    finally:
        torch.set_float32_matmul_precision(previous)


def test_round_to_tf32():
    from flashattn.testing.rule import round_to_tf32

    x = torch.tensor([1.0, 1.0 + 2.0 ** -10, 1.0 + 2.0 ** -11, 1.0 + 2.0 ** -12, -(1.0 + 2.0 ** -11), 3.0e38,
                      float("inf"), 0.0])
    want = torch.tensor([1.0, 1.0 + 2.0 ** -10, 1.0 + 2.0 ** -10, 1.0, -(1.0 + 2.0 ** -10), 3.0e38, float("inf"), 0.0])
    assert torch.equal(round_to_tf32(x)[:5], want[:5]) and torch.equal(round_to_tf32(x)[6:], want[6:])
    assert round_to_tf32(x)[5].item() == pytest.approx(3.0e38, rel=2.0 ** -11)


@triton.jit
def split_kernel(x_ptr, hi_ptr, lo_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    hi, lo = split_tf32(tl.load(x_ptr + offs))
    tl.store(hi_ptr + offs, hi)
    tl.store(lo_ptr + offs, lo)


def test_split_tf32_rounds_both_halves_to_nearest():
    """kernels.tiles.split_tf32, the split 3xTF32 multiplies: hi is x rounded to nearest TF32 (as
    the rule's round_to_tf32), lo too, hi + lo within 2^-22 of x; infinities and NaN pass whole."""
    from flashattn.testing.rule import round_to_tf32

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, generator=g) * torch.logspace(-30, 30, 256)
    x[:8] = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.4e38, 0.0, -0.0, 1.0 + 2.0 ** -11,
                          1.0 + 3 * 2.0 ** -12])
    x = x.to(DEVICE)
    hi, lo = torch.empty_like(x), torch.empty_like(x)
    split_kernel[(1,)](x, hi, lo, N=x.numel())
    finite = torch.isfinite(x)
    low_bits = lambda t: t.view(torch.int32) & 0x1FFF  # noqa: E731  (the bits a TF32 core ignores)
    assert torch.equal(hi[8:], round_to_tf32(x[8:])), "hi must be x rounded to nearest TF32"
    assert not low_bits(hi[finite]).any() and not low_bits(lo[finite]).any(), "hi and lo must be TF32"
    exact = x[finite].double()
    assert ((hi[finite].double() + lo[finite].double() - exact).abs() <= 2.0 ** -22 * exact.abs()).all()
    assert (lo[8:].abs() <= 2.0 ** -11 * x[8:].abs()).all(), "lo must be at most half a TF32 step of x"
    assert hi[0] == float("inf") and hi[1] == -float("inf") and lo[0] == 0 and lo[1] == 0
    assert hi[2].isnan() and lo[2].isnan(), "NaN must stay NaN"
    assert hi[6] == 1.0 + 2.0 ** -10 and lo[6] == -(2.0 ** -11), "a tie rounds away from zero"


def test_tf32x3_candidates_avoid_the_compiler_fault():
    """configs.fits excludes the 3xTF32 tiles that the compiler got wrong on an H200 (a 64-row
    wgmma spread over 8 warps) and keeps every other 3xTF32 candidate it would keep anyway."""
    from flashattn.gpu import configs

    bad = triton_config(16, 64, 8, 2)
    for block_d in (32, 64):
        assert not configs.fits("bwd_dkdv", bad, block_d, 4, "tf32x3")
        assert configs.fits("bwd_dkdv", bad, block_d, 4, "tf32")  # the rule is 3xTF32's alone
    for name in ("fwd", "bwd_dkdv", "bwd_dq"):
        for c in configs.TF32X3_CONFIGS[name]:
            resident = c.kwargs["BLOCK_KV" if name == "bwd_dkdv" else "BLOCK_Q"]
            faulty = 64 <= resident < 16 * c.num_warps
            assert faulty == (c.kwargs == bad.kwargs and c.num_warps == 8), (name, c)


def triton_config(block_q, block_kv, warps, stages):
    import triton
    return triton.Config({"BLOCK_Q": block_q, "BLOCK_KV": block_kv}, num_warps=warps, num_stages=stages)
