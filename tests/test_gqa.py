"""Grouped-query attention (``flashattn.attention(..., enable_gqa=True)``) against a float64
reference: query head h reads K/V head h // (H_q // H_kv), as SDPA's enable_gqa.

The kernels read each group's K and V in place, and the dK/dV program of K/V head j sums the shares
of its H_q // H_kv query heads itself (no atomics), so the gradients of K and V are the sums over
the group, bit-identical from run to run.
"""
from functools import partial

import pytest
import torch

import flashattn
from flashattn.ops.attention import SUPPORTED_DTYPES as DTYPES
from flashattn.testing.reference import masked_attention
from flashattn.testing.rule import compare_with_reference

DEVICE = flashattn.DEVICE


def make_qkv(heads_q, heads_kv, n_q, n_kv, head_dim, dtype, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads_q, n_q, head_dim, generator=g)
    k = torch.randn(batch, heads_kv, n_kv, head_dim, generator=g)
    v = torch.randn(batch, heads_kv, n_kv, head_dim, generator=g)
    return [t.to(dtype=dtype, device=DEVICE) for t in (q, k, v)]


def check_gqa(q, k, v, is_causal=False, window_size=(-1, -1), backward=True):
    impl = partial(flashattn.attention, enable_gqa=True, window_size=window_size)
    reference = partial(masked_attention, enable_gqa=True, window_size=window_size)
    checks = compare_with_reference(q, k, v, is_causal=is_causal, backward=backward, impl=impl,
                                    reference=reference)
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads_q,heads_kv,n_q,n_kv,head_dim,is_causal", [
    (4, 2, 37, 45, 24, False),    # groups of 2, ragged lengths, head dim not a power of two
    (6, 2, 69, 17, 16, True),     # groups of 3, more queries than keys
    (3, 1, 17, 70, 40, True),     # multi-query attention: one K/V head for all
])
def test_gqa_against_reference(heads_q, heads_kv, n_q, n_kv, head_dim, is_causal, dtype):
    check_gqa(*make_qkv(heads_q, heads_kv, n_q, n_kv, head_dim, dtype, batch=2), is_causal=is_causal)


def test_gqa_with_equal_heads_is_plain_attention():
    q, k, v = make_qkv(2, 2, 33, 33, 16, torch.float32)
    assert torch.equal(flashattn.attention(q, k, v, enable_gqa=True), flashattn.attention(q, k, v))


def test_gqa_equals_attention_on_repeated_kv():
    """The grouped kernels give what plain attention gives on K/V repeated per query head; dK and
    dV are the sums over each group of the repeated copies' gradients."""
    q, k, v = (t.requires_grad_() for t in make_qkv(6, 2, 40, 52, 32, torch.float32))
    k_rep, v_rep = (t.detach().repeat_interleave(3, dim=1).requires_grad_() for t in (k, v))
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out = flashattn.attention(q, k, v, is_causal=True, enable_gqa=True)
    out_rep = flashattn.attention(q.detach(), k_rep, v_rep, is_causal=True)
    torch.testing.assert_close(out, out_rep, rtol=1e-6, atol=1e-6)
    dk, dv = torch.autograd.grad(out, (k, v), do)
    dk_rep, dv_rep = torch.autograd.grad(out_rep, (k_rep, v_rep), do)
    torch.testing.assert_close(dk, dk_rep.unflatten(1, (2, 3)).sum(2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dv, dv_rep.unflatten(1, (2, 3)).sum(2), rtol=1e-5, atol=1e-5)


def test_gqa_reads_kv_in_place(monkeypatch):
    """No copy of K and V per query head: repeat_interleave and expand are never called."""
    q, k, v = (t.requires_grad_() for t in make_qkv(4, 1, 20, 20, 16, torch.float32))

    def refuse(*args, **kwargs):
        raise AssertionError("K/V were copied per query head")
    for name in ("repeat_interleave", "expand", "repeat"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    monkeypatch.setattr(torch, "repeat_interleave", refuse)
    out = flashattn.attention(q, k, v, enable_gqa=True)
    out.sum().backward()
    assert k.grad.shape == k.shape


def test_gqa_strided_inputs_and_leading_dims():
    """(B, N, H, D) tensors transposed to (B, H, N, D), and extra leading dims."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 29, 4, 16, generator=g).to(DEVICE).transpose(1, 2)
    k = torch.randn(2, 31, 2, 16, generator=g).to(DEVICE).transpose(1, 2)
    v = torch.randn(2, 31, 2, 16, generator=g).to(DEVICE).transpose(1, 2)
    check_gqa(q, k, v, is_causal=True)
    q5, k5, v5 = (t.unsqueeze(0).expand(2, *t.shape) for t in (q, k, v))
    out5 = flashattn.attention(q5, k5, v5, enable_gqa=True)
    torch.testing.assert_close(out5[1], flashattn.attention(q, k, v, enable_gqa=True))


def test_gqa_backward_writes_every_element(nan_buffers):
    """Keys no query sees (causal, more keys than queries) get dK = dV = 0, written, not left as
    the buffer held them; with every query head of the group summed in."""
    from flashattn.kernels import backward
    assert torch.isnan(backward.torch.empty_like(torch.zeros(2))).all()  # the fixture is in place
    q, k, v = (t.requires_grad_() for t in make_qkv(4, 2, 20, 70, 16, torch.float32))
    out, lse = flashattn.attention(q, k, v, is_causal=True, enable_gqa=True, return_lse=True)
    dq, dk, dv = torch.autograd.grad((out.sum() + lse.sum()), (q, k, v))
    for t in (out, lse, dq, dk, dv):
        assert torch.isfinite(t).all()
    assert (dk[:, :, 20:] == 0).all() and (dv[:, :, 20:] == 0).all()


def test_gqa_backward_is_deterministic():
    q, k, v = (t.requires_grad_() for t in make_qkv(4, 1, 45, 45, 16, torch.float32))
    grads = [torch.autograd.grad(flashattn.attention(q, k, v, enable_gqa=True).sum(), (q, k, v))
             for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_gqa_errors():
    q, k, v = make_qkv(4, 2, 8, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="k has 2 heads but q has 4.*enable_gqa"):
        flashattn.attention(q, k, v)
    q3, _, _ = make_qkv(3, 2, 8, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple of k's heads.*3 query heads and 2 k heads"):
        flashattn.attention(q3, k, v, enable_gqa=True)
    with pytest.raises(ValueError, match="k has leading dims .* but v has"):
        flashattn.attention(q, k, v[:, :1], enable_gqa=True)
    with pytest.raises(ValueError, match="leading dims"):  # batch 3 against 2: no broadcasting
        flashattn.attention(q.expand(3, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1),
                            enable_gqa=True)
    with pytest.raises(TypeError, match="enable_gqa must be a bool"):
        flashattn.attention(q, k, v, enable_gqa=1)


# --- On a GPU: compiled, bf16 on the tensor cores, long sequences ---------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_gqa_long_on_gpu(dtype, is_causal):
    check_gqa(*make_qkv(8, 2, 2048 + 37, 2048 + 37, 128, dtype), is_causal=is_causal)


@pytest.mark.gpu
def test_gqa_against_sdpa_on_gpu():
    q, k, v = make_qkv(32, 8, 4096, 4096, 128, torch.bfloat16)
    out = flashattn.attention(q, k, v, is_causal=True, enable_gqa=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (out.float() - ref.float()).abs().max().item() < 2e-2


@pytest.mark.gpu
def test_gqa_backward_deterministic_on_gpu():
    q, k, v = (t.requires_grad_() for t in make_qkv(16, 2, 4096, 4096, 128, torch.bfloat16))
    grads = [torch.autograd.grad(flashattn.attention(q, k, v, is_causal=True, enable_gqa=True).sum(),
                                 (q, k, v)) for _ in range(3)]
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads_q,heads_kv,n_q,n_kv,is_causal", [
    (8, 2, 300, 300, True),      # groups of 4, ragged
    (8, 1, 257, 1000, False),    # multi-query, more keys than queries
    (6, 3, 1024, 1024, True),
])
def test_gpu_grouped_heads_take_the_gluon_forward(monkeypatch, heads_q, heads_kv, n_q, n_kv, is_causal,
                                                   head_dim, dtype):
    """On an H100/H200 the Gluon forward reads grouped K/V heads in place: it is the kernel that
    runs, and its output, LSE and gradients (dK/dV from the Gluon kernel at head dim 128) are within the rule."""
    from flashattn import hopper

    gluon = hopper.load("forward")
    if gluon is None or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels run on compute capability 9 only")
    calls = []
    real = gluon.attention_forward
    monkeypatch.setattr(gluon, "attention_forward", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    check_gqa(*make_qkv(heads_q, heads_kv, n_q, n_kv, head_dim, dtype, batch=2), is_causal=is_causal)
    assert calls, "the Gluon forward did not run"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads_q,heads_kv,n_q,n_kv,is_causal", [
    (8, 2, 300, 300, True),      # groups of 4, ragged
    (8, 1, 257, 1000, False),    # multi-query, more keys than queries
    (6, 3, 1024, 1024, True),
])
def test_gpu_grouped_heads_take_the_gluon_dkdv(monkeypatch, heads_q, heads_kv, n_q, n_kv, is_causal, dtype):
    """On an H100/H200 at head dim 128 the Gluon backward sums each group's shares of dK and dV
    itself: the fused kernel (Triton >= 3.8) or the dK/dV kernel is the kernel that runs, once per
    backward, and the gradients are within the rule."""
    from flashattn import hopper
    from flashattn.ops import dispatch

    gluon = hopper.load("backward")
    if gluon is None or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels run on compute capability 9 only")
    assert 128 in dispatch.GLUON_DKDV_HEAD_DIMS
    name = "attention_backward" if gluon.has_dq_reduce() else "attention_backward_dkdv"
    calls = []
    real = getattr(gluon, name)
    monkeypatch.setattr(gluon, name, lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    check_gqa(*make_qkv(heads_q, heads_kv, n_q, n_kv, 128, dtype, batch=2), is_causal=is_causal)
    assert calls and all(shape[1] == heads_kv for shape in calls), f"the Gluon {name} did not run: {calls}"

