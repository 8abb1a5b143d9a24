"""flashattn.attention as a drop-in for scaled_dot_product_attention: its arguments in SDPA's order,
a GPT-like block with SDPA replaced, the errors for bad new arguments, torch.compile with each new
argument, and varlen_attention's new arguments against the reference.
"""
import inspect
from functools import partial

import flashattn  # first: it picks the interpreter before triton is imported
import pytest
import torch
import torch.nn.functional as F

from flashattn.kernels.mods import dropout_mask
from flashattn.ops.modifiers import draw_seed
from flashattn.testing import reference
from flashattn.testing.rule import judge, max_error

DEVICE = flashattn.DEVICE
SDPA_ORDER = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]


def make_qkv(n_q=19, n_kv=27, head_dim=24, dtype=torch.float32, batch=2, heads_q=2, heads_kv=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((batch, heads_q, n_q, head_dim), (batch, heads_kv, n_kv, head_dim), (batch, heads_kv, n_kv, head_dim))
    return [torch.randn(s, generator=g).to(dtype=dtype, device=DEVICE) for s in shapes]


def test_signature_is_sdpas():
    params = inspect.signature(flashattn.attention).parameters
    assert list(params)[:8] == SDPA_ORDER
    keyword_only = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keyword_only == ["return_lse", "window_size", "causal_alignment", "softcap", "alibi_slopes",
                            "return_dropout_mask", "deterministic"]
    q, k, v = make_qkv(9, 9, 16)
    mask = torch.ones(9, 9, dtype=torch.bool, device=DEVICE).tril()
    # positionally, as SDPA is called (SDPA's scale and enable_gqa are keyword-only; here they may be
    # either)
    torch.testing.assert_close(flashattn.attention(q, k, v, None, 0.0, True, 0.3, False),
                               F.scaled_dot_product_attention(q, k, v, None, 0.0, True, scale=0.3, enable_gqa=False))
    torch.testing.assert_close(flashattn.attention(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, mask))
    # and by SDPA's keyword names
    torch.testing.assert_close(flashattn.attention(query=q, key=k, value=v, is_causal=True),
                               F.scaled_dot_product_attention(query=q, key=k, value=v, is_causal=True))


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_a_mask_and_is_causal_together_apply_both(alignment):
    """SDPA's CPU path up to PyTorch 2.13 takes attn_mask with is_causal=True and applies both
    (2.14 refuses the pair); flashattn applies both, aligned as causal_alignment says, forward and
    backward under the rule, and agrees with SDPA given the two as one mask."""
    from flashattn.testing.rule import compare_with_reference

    q, k, v = make_qkv(19, 27, 24)
    g = torch.Generator().manual_seed(4)
    mask = (torch.rand(2, 1, 19, 27, generator=g) > 0.3).to(DEVICE)
    mask[..., 20:] = False     # and whole key columns
    shift = 27 - 19 if alignment == "bottom_right" else 0
    causal = torch.ones(19, 27, dtype=torch.bool, device=DEVICE).tril(shift)

    def impl(q, k, v, is_causal, **kwargs):  # the reference gets the two as one mask, not causal
        return flashattn.attention(q, k, v, mask, is_causal=True, causal_alignment=alignment, **kwargs)
    ref = partial(reference.naive_attention, attn_mask=mask & causal)
    checks = compare_with_reference(q, k, v, impl=impl, reference=ref)
    assert all(c.ok for c in checks), "\n".join(map(str, checks))
    torch.testing.assert_close(impl(q, k, v, True), F.scaled_dot_product_attention(q, k, v, mask & causal),
                               rtol=0, atol=2e-6)


class Block(torch.nn.Module):
    """A GPT block: pre-norm causal self-attention (grouped heads, a padding mask) and an MLP,
    attention through F.scaled_dot_product_attention, called positionally as models do."""

    def __init__(self, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        h = self.ln1(x)
        q = self.q(h).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, n, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if mask is None:
            a = F.scaled_dot_product_attention(q, k, v, None, 0.0, True, enable_gqa=True)
        else:
            a = F.scaled_dot_product_attention(q, k, v, mask, 0.0, False, enable_gqa=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, -1))
        return x + self.mlp(self.ln2(x))


@pytest.mark.parametrize("masked", [False, True])
def test_gpt_block_with_sdpa_replaced(monkeypatch, masked):
    torch.manual_seed(0)
    block = Block().to(DEVICE)
    x = torch.randn(2, 21, 32, device=DEVICE)
    mask = None
    if masked:  # causal and key padding, as one boolean mask
        pad = torch.ones(2, 1, 1, 21, dtype=torch.bool, device=DEVICE)
        pad[1, ..., 15:] = False
        mask = torch.ones(21, 21, dtype=torch.bool, device=DEVICE).tril() & pad

    def run():
        out = block(x, mask)
        grads = torch.autograd.grad(out.square().sum(), list(block.parameters()))
        return out, grads

    want, want_grads = run()
    monkeypatch.setattr(F, "scaled_dot_product_attention", flashattn.attention)
    got, got_grads = run()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def on_device(kwargs):
    """The parameters' tensors (made at collection, on the CPU) on the inputs' device."""
    return {name: value.detach().to(DEVICE).requires_grad_(value.requires_grad) if isinstance(value, torch.Tensor)
            else value for name, value in kwargs.items()}


# -- Bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,error,match", [
    (dict(attn_mask=True), TypeError, "attn_mask must be None, a torch.Tensor.*4th positional"),
    (dict(attn_mask=torch.ones(19, 27, dtype=torch.int32)), TypeError, "attn_mask has dtype torch.int32"),
    (dict(attn_mask=torch.ones(19, 26, dtype=torch.bool)), ValueError, r"attn_mask has shape \(19, 26\)"),
    (dict(attn_mask=torch.ones(3, 1, 19, 27, dtype=torch.bool)), ValueError, "does not broadcast"),
    (dict(attn_mask=torch.ones(1, 2, 2, 19, 27, dtype=torch.bool)), ValueError, "does not broadcast"),
    (dict(attn_mask=torch.zeros(19, 27, requires_grad=True)), ValueError, "attn_mask requires grad"),
    (dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_p=-0.1), ValueError, r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_p=float("nan")), ValueError, r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_p="0.1"), TypeError, "dropout_p must be a real number"),
    (dict(softcap=-1.0), ValueError, "softcap must be a finite number >= 0"),
    (dict(softcap=float("inf")), ValueError, "softcap must be a finite number >= 0"),
    (dict(softcap=None), TypeError, "softcap must be a real number"),
    (dict(causal_alignment="lower_right"), ValueError, "causal_alignment must be 'top_left' or 'bottom_right'"),
    (dict(causal_alignment=1), TypeError, "causal_alignment must be a str"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes has shape \(3,\)"),
    (dict(alibi_slopes=torch.ones(3, 2)), ValueError, r"alibi_slopes has shape \(3, 2\)"),
    (dict(alibi_slopes=torch.ones(2, dtype=torch.float64)), TypeError, "alibi_slopes has dtype torch.float64"),
    (dict(alibi_slopes=[0.5, 0.25]), TypeError, "alibi_slopes must be a torch.Tensor"),
    (dict(alibi_slopes=torch.ones(2, requires_grad=True)), ValueError, "alibi_slopes requires grad"),
])
def test_bad_new_arguments(kwargs, error, match):
    q, k, v = make_qkv()
    with pytest.raises(error, match=match):
        flashattn.attention(q, k, v, **on_device(kwargs))


def test_causal_bias_errors():
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="causal bias for 19 queries and 26 keys"):
        flashattn.attention(q, k, v, attn_mask=causal_lower_right(19, 26))
    with pytest.raises(ValueError, match="causal bias .* and is_causal=True"):
        flashattn.attention(q, k, v, attn_mask=causal_lower_right(19, 27), is_causal=True)
    with pytest.raises(ValueError, match="causal_alignment="):
        flashattn.attention(q, k, v, attn_mask=causal_lower_right(19, 27), causal_alignment="bottom_right")


def test_old_positional_order_is_refused_clearly():
    """A 4th positional ``True`` is ``attn_mask``, as in SDPA: refused, with the hint to pass
    ``is_causal=True``."""
    q, k, v = make_qkv()
    with pytest.raises(TypeError, match="4th positional argument is attn_mask"):
        flashattn.attention(q, k, v, True)


# -- torch.compile ----------------------------------------------------------------------------------

COMPILE_CASES = {
    "plain": dict(),
    "mask": dict(attn_mask="padding"),
    "causal-bias": dict(attn_mask="lower-right"),
    "softcap-alibi-bottom-right": dict(softcap=2.0, alibi_slopes="slopes", is_causal=True,
                                       causal_alignment="bottom_right"),
    "window-gqa": dict(window_size=(4, 1), enable_gqa=True),
    "dropout": dict(dropout_p=0.3),
}


def compile_kwargs(name):
    from torch.nn.attention.bias import causal_lower_right

    kwargs = dict(COMPILE_CASES[name])
    if kwargs.get("attn_mask") == "padding":
        kwargs["attn_mask"] = torch.ones(1, 1, 1, 11, dtype=torch.bool, device=DEVICE)
        kwargs["attn_mask"][..., 7:] = False
    elif kwargs.get("attn_mask") == "lower-right":
        kwargs["attn_mask"] = causal_lower_right(7, 11)
    if kwargs.get("alibi_slopes") == "slopes":
        kwargs["alibi_slopes"] = torch.tensor([0.5, 0.25], device=DEVICE)
    return kwargs


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("name", list(COMPILE_CASES))
def test_torch_compile_fullgraph_with_new_arguments(name, grad):
    """Bit for bit the eager call (aot_eager: nothing around the operators is compiled; the dropout
    seed is drawn in the graph from the same generator), with and without requires_grad."""
    torch._dynamo.reset()
    compiled = torch.compile(flashattn.attention, fullgraph=True, backend="aot_eager")
    kwargs = compile_kwargs(name)
    q, k, v = make_qkv(7, 11, 16, batch=1, heads_q=2, heads_kv=1 if kwargs.get("enable_gqa") else 2)
    leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    eager = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    torch.manual_seed(3)
    out, lse = compiled(*leaves, return_lse=True, **kwargs)
    torch.manual_seed(3)
    out_e, lse_e = flashattn.attention(*eager, return_lse=True, **kwargs)
    assert torch.equal(out, out_e) and torch.equal(lse, lse_e)
    if grad:
        do = torch.randn_like(out)
        for g, g_e in zip(torch.autograd.grad((out * do).sum(), leaves),
                          torch.autograd.grad((out_e * do).sum(), eager)):
            assert torch.equal(g, g_e)


# -- varlen_attention's new arguments ---------------------------------------------------------------

LENGTHS_Q, LENGTHS_K = [5, 0, 13, 9], [8, 3, 6, 12]


def packed(dtype, heads_q=2, heads_kv=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(LENGTHS_Q), heads_q, 16, generator=g).to(DEVICE, dtype)
    k = torch.randn(sum(LENGTHS_K), heads_kv, 16, generator=g).to(DEVICE, dtype)
    v = torch.randn(sum(LENGTHS_K), heads_kv, 16, generator=g).to(DEVICE, dtype)
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int64, device=DEVICE)
          for n in (LENGTHS_Q, LENGTHS_K)]
    return q, k, v, *cu


def varlen_checks(dtype, seed_of_call=None, **kwargs):
    """The rule's checks of varlen_attention(**kwargs) against the reference (int64 cu_seqlens)."""
    heads_q = 4 if kwargs.get("enable_gqa") else 2
    q, k, v, cu_q, cu_k = packed(dtype, heads_q=heads_q)
    ref_kwargs = dict(kwargs)
    if kwargs.get("dropout_p"):
        torch.manual_seed(seed_of_call)
        ref_kwargs["dropout_keep"] = dropout_mask((1, heads_q, q.shape[0], k.shape[0]), kwargs["dropout_p"],
                                                  draw_seed(), DEVICE)[0]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    base = [t.detach().clone().requires_grad_() for t in reference_inputs(q, k, v)]
    if seed_of_call is not None:
        torch.manual_seed(seed_of_call)
    out = flashattn.varlen_attention(*leaves, cu_q, cu_k, 13, 12, **kwargs)
    out_ref, _ = reference.varlen_attention(*ref64, cu_q, cu_k, **ref_kwargs)
    out_pt, _ = reference.varlen_attention(*base, cu_q, cu_k, **ref_kwargs)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(dtype).to(DEVICE)
    grads = [torch.autograd.grad(o, t, do.to(o.dtype)) for o, t in ((out, leaves), (out_ref, ref64), (out_pt, base))]
    results = {"out": (out, out_ref, out_pt)}
    for i, name in enumerate(("dq", "dk", "dv")):
        results[name] = tuple(g[i] for g in grads)
    return judge(*({n: r[j] for n, r in results.items()} for j in range(3)), dtype, max_error(do, 0 * do))


def reference_inputs(*tensors):
    from flashattn.testing.rule import baseline_inputs
    return baseline_inputs(*tensors)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", ["softcap", "alibi-per-sequence", "bottom-right-causal-gqa",
                                  "bottom-right-window-alibi", "dropout"])
def test_varlen_new_arguments_against_reference(case, dtype):
    kwargs, seed = {}, None
    if case == "softcap":
        kwargs = dict(softcap=2.0, is_causal=True)
    elif case == "alibi-per-sequence":
        kwargs = dict(alibi_slopes=torch.rand(4, 2, generator=torch.Generator().manual_seed(1)).to(DEVICE))
    elif case == "bottom-right-causal-gqa":
        kwargs = dict(is_causal=True, causal_alignment="bottom_right", enable_gqa=True)
    elif case == "bottom-right-window-alibi":
        kwargs = dict(window_size=(3, 1), causal_alignment="bottom_right", alibi_slopes=torch.tensor([0.3, 0.7], device=DEVICE))
    else:
        kwargs, seed = dict(dropout_p=0.3, is_causal=True), 17
    checks = varlen_checks(dtype, seed, **kwargs)
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


def test_varlen_check_can_fail_and_int64_is_int32():
    q, k, v, cu_q, cu_k = packed(torch.float32)
    a = flashattn.varlen_attention(q, k, v, cu_q, cu_k, 13, 12, causal_alignment="bottom_right", is_causal=True)
    b = flashattn.varlen_attention(q, k, v, cu_q.int(), cu_k.int(), 13, 12, causal_alignment="bottom_right",
                                   is_causal=True)
    assert torch.equal(a, b)
    top_left, _ = reference.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True)
    assert max_error(a, top_left) > 0.1


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(alibi_slopes=torch.ones(3, 2)), ValueError, r"alibi_slopes has shape \(3, 2\).*the sequences"),
    (dict(dropout_p=1.5), ValueError, "dropout_p"),
    (dict(softcap=-2.0), ValueError, "softcap"),
    (dict(causal_alignment="x"), ValueError, "causal_alignment"),
])
def test_varlen_bad_new_arguments(kwargs, error, match):
    q, k, v, cu_q, cu_k = packed(torch.float32)
    with pytest.raises(error, match=match):
        flashattn.varlen_attention(q, k, v, cu_q, cu_k, 13, 12, **on_device(kwargs))
    with pytest.raises(TypeError, match="cu_seqlens_q has dtype torch.float32"):
        flashattn.varlen_attention(q, k, v, cu_q.float(), cu_k, 13, 12)


# -- Broadcast leading dims ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("gqa", [False, True])
def test_kv_broadcast_over_the_batch(dtype, gqa):
    """k and v of batch 1 against q of batch 3, as SDPA broadcasts them: read in place (stride 0),
    their gradients summed over the batch, under the rule."""
    from flashattn.testing.rule import compare_with_reference

    q = make_qkv(19, 27, 24, dtype, batch=3, heads_q=4)[0]
    _, k, v = make_qkv(19, 27, 24, dtype, batch=1, heads_kv=2 if gqa else 4, seed=1)
    impl = partial(flashattn.attention, enable_gqa=gqa)
    ref = partial(reference.naive_attention, enable_gqa=gqa)
    checks = compare_with_reference(q, k, v, is_causal=True, impl=impl, reference=ref)
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


def test_kv_broadcast_errors():
    q = make_qkv(9, 9, 16, batch=3)[0]
    _, k, v = make_qkv(9, 9, 16, batch=2)
    with pytest.raises(ValueError, match="k has leading dims .* but q has"):  # 3 against 2
        flashattn.attention(q, k, v)
    _, k, v = make_qkv(9, 9, 16, batch=3, heads_kv=3)
    q = make_qkv(9, 9, 16, batch=3, heads_q=2)[0]
    with pytest.raises(ValueError, match="multiple of k.s heads"):  # heads 2 against 3
        flashattn.attention(q, k, v, enable_gqa=True)


@pytest.mark.parametrize("shape_q, shape_kv", [
    ((3, 4, 19, 16), (4, 27, 16)),        # k and v without q's batch dim
    ((3, 4, 19, 16), (27, 16)),           # nor its heads
    ((3, 4, 19, 16), (3, 1, 27, 16)),     # one K/V head for every query head
    ((4, 19, 16), (3, 4, 27, 16)),        # q without k's batch dim
    ((1, 4, 19, 16), (3, 1, 27, 16)),     # both broadcast
    ((2, 1, 4, 19, 16), (3, 1, 27, 16)),  # five dims
])
def test_leading_dims_broadcast_as_in_sdpa(shape_q, shape_kv):
    """SDPA broadcasts q's and k/v's leading dims against each other (a missing dim is 1); so does
    flashattn, forward and gradients, against SDPA on the same inputs."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(shape_q, generator=g).to(DEVICE).requires_grad_()
    k, v = (torch.randn(shape_kv, generator=g).to(DEVICE).requires_grad_() for _ in range(2))
    out = flashattn.attention(q, k, v, is_causal=True)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-6)
    do = torch.randn(out.shape, generator=g).to(DEVICE)
    for ours, theirs in zip(torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(expected, (q, k, v), do)):
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5)


# -- Dispatch ----------------------------------------------------------------------------------------

def fake_gluon_forward(monkeypatch, tanh_approx):
    """A stand-in for the Gluon forward on the CPU that takes every call, returns zeros and records
    the keyword arguments it was handed (the list returned); ``tanh_approx`` as
    ``hopper.forward.TANH_APPROX``."""
    from flashattn import hopper

    calls = []

    class FakeGluon:
        TANH_APPROX = tanh_approx

        @staticmethod
        def supports(q, k, v, window=None):
            return True

        @staticmethod
        def attention_forward(q, k, v, scale, **call):
            calls.append(call)
            return torch.zeros_like(q), torch.zeros(q.shape[:-1], device=q.device)

    monkeypatch.setattr(hopper, "load", lambda name: FakeGluon if name == "forward" else None)
    return calls


@pytest.mark.parametrize("kwargs", [dict(), dict(attn_mask="padding"), dict(softcap=5.0), dict(alibi_slopes="slopes"),
                                    dict(dropout_p=0.2), dict(is_causal=True, causal_alignment="bottom_right")],
                         ids=["plain", "mask", "softcap", "alibi", "dropout", "bottom-right"])
def test_what_the_gluon_forward_gets(monkeypatch, kwargs):
    """A fake Gluon module stands in on the CPU: a plain call reaches it, and so do a softcap,
    ALiBi's slopes, the bottom-right alignment (as the window bounds moved by N_kv - N_q and the
    shift of ALiBi's positions) and dropout (its probability and the call's seed); a mask takes
    the Triton kernels (the Gluon kernels implement no mask)."""
    calls = fake_gluon_forward(monkeypatch, tanh_approx=True)
    kwargs = dict(kwargs)
    if kwargs.get("attn_mask") == "padding":
        kwargs["attn_mask"] = torch.ones(1, 1, 1, 11, dtype=torch.bool, device=DEVICE)
    if kwargs.get("alibi_slopes") == "slopes":
        kwargs["alibi_slopes"] = torch.tensor([0.5, 0.25], device=DEVICE)
    q, k, v = make_qkv(7, 11, 16, batch=1)
    torch.manual_seed(3)
    out = flashattn.attention(q, k, v, **kwargs)
    gluon = "attn_mask" not in kwargs
    assert len(calls) == int(gluon) and (out.abs().max().item() == 0.0) == gluon
    if gluon:
        call = calls[0]
        torch.manual_seed(3)  # the seed the call drew, drawn again
        dropout = dict(dropout_p=0.2, seed=int(draw_seed())) if "dropout_p" in kwargs else {}
        assert ("dropout_p" in call) == ("dropout_p" in kwargs)
        assert {name: call.get(name) for name in dropout} == dropout
        assert call["softcap"] == kwargs.get("softcap", 0.0)
        assert (call["alibi_slopes"] is None) == ("alibi_slopes" not in kwargs)
        if "alibi_slopes" in kwargs:
            assert call["alibi_slopes"].flatten().tolist() == [0.5, 0.25]
        if "causal_alignment" in kwargs:  # causal aligned bottom-right: a window moved by 11 - 7
            assert call["shift"] == 4 and call["window"] == (7 + 11 - 4, 4) and not call["is_causal"]
        else:
            assert call["shift"] == 0 and call["window"] is None


def test_vmap_with_a_mask_and_slopes_per_batch_element():
    """vmap folds its dim into the kernels' batch: a mask and slopes with a batch dim follow it."""
    q, k, v = make_qkv(7, 11, 16, batch=2)
    qs = torch.stack([q, 2 * q])  # vmap over this leading dim
    mask = torch.rand(2, 1, 7, 11, generator=torch.Generator().manual_seed(2)).to(DEVICE) > 0.4
    mask[..., 0] = True
    s = torch.rand(2, 2, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    fn = partial(flashattn.attention, attn_mask=mask, alibi_slopes=s)
    out = torch.func.vmap(lambda a: fn(a, k, v))(qs)
    for i in range(2):
        want, _ = reference.naive_attention(qs[i].double(), k.double(), v.double(), attn_mask=mask, alibi_slopes=s)
        torch.testing.assert_close(out[i].double(), want, atol=2e-6, rtol=2e-6)


def test_an_exact_softcap_takes_the_triton_forward(monkeypatch):
    """With the exact tanh (``hopper.forward.TANH_APPROX`` off) the softcap's forward is the Triton
    kernel's, measured faster on an H100; a plain call still reaches the Gluon forward."""
    calls = fake_gluon_forward(monkeypatch, tanh_approx=False)
    q, k, v = make_qkv(7, 11, 16, batch=1)
    assert flashattn.attention(q, k, v, softcap=5.0).abs().max().item() > 0 and calls == []
    flashattn.attention(q, k, v)
    assert len(calls) == 1
