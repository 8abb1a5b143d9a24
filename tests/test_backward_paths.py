"""Which backward runs a call, and what it is handed.

On Hopper with a Triton whose Gluon has TMA reduce-adds, the default backward is one Gluon kernel
that computes dK, dV and dQ (dQ's shares added in an order that varies from run to run);
``deterministic=True`` or ``torch.use_deterministic_algorithms(True)`` keeps the path whose
gradients are bit-identical from run to run (the Triton dQ kernel). The softcap, ALiBi, windows and
the bottom-right alignment and dropout are handed to it; calls the Gluon kernels do not compute
(an attn_mask, packed sequences, fixed configurations) never take it.

Checked here on any machine with a stand-in for the Gluon module that computes the gradients from
the formula, from exactly what the fused kernel is handed (q, k, v, dO, the base-2 LSE and Delta),
so a mistake in that contract (Delta without the LSE's gradient, say) fails the rule. The kernel
itself runs on a GPU (tools/backward_check.py, tests/test_gpu.py).
"""
import functools

import pytest
import torch

import flashattn
from flashattn import DEVICE, hopper
from flashattn.kernels.mods import dropout_mask
from flashattn.ops import warmup
from flashattn.kernels.tiles import LOG2E
from flashattn.testing.reference import naive_attention
from flashattn.testing.rule import compare_with_reference


class StandIn:
    """Plays flashattn.hopper.backward: supports everything, counts calls, computes from the
    formula in float64."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def supports(q, k, v):
        return True

    @staticmethod
    def has_dq_reduce():
        return True

    @staticmethod
    def _grads(q, k, v, do, lse2, delta, is_causal, scale, window=None, softcap=0.0, alibi_slopes=None, shift=0,
               dropout_p=0.0, seed=0):
        """The kernel's contract: ``window`` = (left, right) bounds already moved to the
        bottom-right alignment, ALiBi at query positions ``i + shift``, dropout's pairs those
        ``dropout_mask`` draws for ``seed``."""
        group = q.shape[1] // k.shape[1]
        q64, do64 = q.double(), do.double()
        k64, v64 = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
        s = q64 @ k64.transpose(-2, -1) * scale
        dcap = 1.0
        if softcap:
            t = torch.tanh(s / softcap)
            s, dcap = softcap * t, 1 - t * t
        i = torch.arange(q.shape[2], device=q.device)[:, None]
        j = torch.arange(k.shape[2], device=q.device)[None, :]
        if alibi_slopes is not None:
            s = s - alibi_slopes.double()[..., None, None] * (i + shift - j).abs()
        if is_causal:
            s = s.masked_fill(j > i, float("-inf"))
        if window is not None:
            s = s.masked_fill((j < i - window[0]) | (j > i + window[1]), float("-inf"))
        lse = lse2.double()[..., None]
        p = torch.exp2(s * LOG2E - lse).masked_fill(lse == float("-inf"), 0.0)  # rows that see no key
        kept = 1.0
        if dropout_p:
            kept = dropout_mask(s.shape, dropout_p, seed, q.device).double() / (1 - dropout_p)
        ds = p * (do64 @ v64.transpose(-2, -1) * kept - delta.double()[..., None]) * dcap
        dq = ds @ k64 * scale
        dk, dv = ds.transpose(-2, -1) @ q64 * scale, (p * kept).transpose(-2, -1) @ do64
        fold = lambda t: t.unflatten(1, (k.shape[1], group)).sum(2)  # noqa: E731  (a group's sum)
        return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)

    def attention_backward(self, q, k, v, do, lse2, delta, is_causal, scale, **mods):
        self.calls.append("fused")
        return self._grads(q, k, v, do, lse2, delta, is_causal, scale, **mods)

    def attention_backward_dkdv(self, q, k, v, do, lse2, delta, is_causal, scale, **mods):
        self.calls.append("dkdv")
        return self._grads(q, k, v, do, lse2, delta, is_causal, scale, **mods)[1:]


@pytest.fixture
def gluon(monkeypatch):
    stand_in = StandIn()
    monkeypatch.setattr(hopper, "load", lambda name: stand_in if name == "backward" else None)
    # On a GPU the forward of a new setting has the backward's kernels compiled in the background,
    # which asks the backward once more (not knowing a later ``deterministic``): not counted here.
    monkeypatch.setattr(warmup, "start", lambda *args: None)
    return stand_in


def qkv(heads=4, heads_kv=2, n=37, head_dim=128, dtype=torch.float16, n_q=None):
    g = torch.Generator(device="cpu").manual_seed(n)
    q = torch.randn(2, heads, n_q or n, head_dim, generator=g, dtype=dtype).to(DEVICE)
    k, v = (torch.randn(2, heads_kv, n, head_dim, generator=g, dtype=dtype).to(DEVICE) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("is_causal", [False, True])
def test_the_default_backward_is_the_fused_kernel(gluon, is_causal):
    """By default the fused kernel computes all three gradients, from Delta minus the LSE's
    gradient (compare_with_reference sends a gradient to the LSE too): within the rule."""
    impl = functools.partial(flashattn.attention, enable_gqa=True)
    checks = compare_with_reference(*qkv(), is_causal=is_causal, impl=impl,
                                    reference=functools.partial(naive_attention, enable_gqa=True))
    assert gluon.calls == ["fused"]
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


def test_deterministic_keeps_the_dq_kernel(gluon):
    q, k, v = (t.requires_grad_() for t in qkv())
    flashattn.attention(q, k, v, is_causal=True, enable_gqa=True, deterministic=True).sum().backward()
    assert gluon.calls == ["dkdv"]  # dK/dV from the Gluon kernel, dQ from the Triton kernel
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    flashattn.attention(q, k, v, is_causal=True, enable_gqa=True, deterministic=True).sum().backward()
    assert all(torch.equal(a, t.grad) for a, t in zip(grads, (q, k, v)))


def test_torch_deterministic_algorithms_keep_the_dq_kernel(gluon):
    q, k, v = (t.requires_grad_() for t in qkv())
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        flashattn.attention(q, k, v, enable_gqa=True).sum().backward()
    finally:
        torch.use_deterministic_algorithms(before)
    assert gluon.calls == ["dkdv"]


MODIFIED = {
    "softcap": dict(is_causal=True, softcap=1.5),
    "alibi": dict(alibi_slopes=torch.tensor([0.3, 0.1, 0.7, 0.02])),
    "alibi-rows": dict(is_causal=True, alibi_slopes=torch.tensor([[0.3, 0.1, 0.7, 0.02], [0.5, 0.2, 0.0, 1.0]])),
    "window": dict(window_size=(8, 3)),
    "window-causal": dict(is_causal=True, window_size=(8, -1)),
    "bottom-right": dict(is_causal=True, causal_alignment="bottom_right", n_q=20),
    "bottom-right-more-queries": dict(is_causal=True, causal_alignment="bottom_right", n_q=50),
    "all": dict(softcap=1.5, alibi_slopes=torch.tensor([0.3, 0.1, 0.7, 0.02]), window_size=(6, 2),
                causal_alignment="bottom_right", n_q=29),
}


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("variant", list(MODIFIED))
def test_score_modifications_reach_the_gluon_backward(gluon, variant, deterministic):
    """The softcap, ALiBi's slopes, the window's bounds (moved where positions align bottom-right)
    and the shift of ALiBi's positions, handed to the kernels as their contract says: within the
    rule, through the fused kernel or (deterministic) the dK/dV one."""
    kw = dict(MODIFIED[variant])
    n_q, causal = kw.pop("n_q", None), kw.pop("is_causal", False)
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = kw["alibi_slopes"].to(DEVICE)
    impl = functools.partial(flashattn.attention, enable_gqa=True, deterministic=deterministic, **kw)
    checks = compare_with_reference(*qkv(n_q=n_q), is_causal=causal, impl=impl,
                                    reference=functools.partial(naive_attention, enable_gqa=True, **kw))
    assert gluon.calls == ["dkdv" if deterministic else "fused"], gluon.calls
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("is_causal", [False, True])
def test_dropout_reaches_the_gluon_backward(gluon, is_causal, deterministic):
    """Dropout's probability and the forward's seed reach the Gluon backward (the stand-in
    rebuilds the mask from them): within the rule against the reference handed the mask the call
    drew."""
    q, k, v = qkv()
    kw = dict(enable_gqa=True, dropout_p=0.2)
    torch.manual_seed(8)
    _, keep = flashattn.attention(q, k, v, is_causal=is_causal, return_dropout_mask=True, **kw)
    torch.manual_seed(8)  # compare_with_reference's call draws the same seed again
    impl = functools.partial(flashattn.attention, deterministic=deterministic, **kw)
    checks = compare_with_reference(q, k, v, is_causal=is_causal, impl=impl,
                                    reference=functools.partial(naive_attention, dropout_keep=keep, **kw))
    assert gluon.calls == ["dkdv" if deterministic else "fused"], gluon.calls
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


@pytest.mark.parametrize("variant", ["attn_mask", "varlen"])
def test_calls_the_gluon_kernels_do_not_compute_never_take_it(gluon, variant):
    q, k, v = (t.requires_grad_() for t in qkv(heads_kv=4))
    if variant == "varlen":  # two packed sequences of 30 and 44 tokens: (tokens, heads, head dim)
        cu = torch.tensor([0, 30, 74], dtype=torch.int32, device=DEVICE)
        packed = [t.detach()[0, :, :37].transpose(0, 1).repeat(2, 1, 1)[:74].requires_grad_() for t in (q, k, v)]
        out = flashattn.varlen_attention(*packed, cu, cu, 44, 44, is_causal=True)
    else:
        out = flashattn.attention(q, k, v, attn_mask=torch.ones(37, 37, dtype=torch.bool, device=DEVICE).tril())
    out.float().sum().backward()
    assert gluon.calls == [], gluon.calls  # neither Gluon backward kernel


def test_a_fixed_configuration_never_takes_it(gluon):
    """A fixed dQ configuration keeps the Triton dQ kernel (dK/dV may still be Gluon's)."""
    from flashattn.ops import dispatch
    q, k, v = qkv(heads_kv=4, n=20)
    o, lse2 = dispatch.attention_forward(q, k, v, True, 0.1)
    configs = {"bwd_dq": dict(BLOCK_Q=16, BLOCK_KV=16, num_warps=4, num_stages=1)}
    dispatch.attention_backward(q, k, v, o, lse2, torch.randn_like(o), True, 0.1, configs=configs)
    assert gluon.calls == ["dkdv"], gluon.calls


@pytest.mark.parametrize("flag", ["yes", 1, None])
def test_deterministic_must_be_a_bool(flag):
    q, k, v = qkv(heads_kv=4, n=5)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        flashattn.attention(q, k, v, deterministic=flag)


def test_the_fused_kernel_needs_the_reduce_add(gluon, monkeypatch):
    """A Triton whose Gluon lacks TMA reduce-adds (3.6, 3.7.1) keeps the two-kernel backward."""
    monkeypatch.setattr(gluon, "has_dq_reduce", lambda: False)
    q, k, v = (t.requires_grad_() for t in qkv())
    flashattn.attention(q, k, v, enable_gqa=True).sum().backward()
    assert gluon.calls == ["dkdv"]
