"""v with a head dim of its own (D_v != D, as SDPA allows; DeepSeek's MLA has 192 for q and k,
128 for v): the output and dV have D_v columns, dQ and dK have D, in the Triton kernels (HEAD_DIM_V
and BLOCK_DV beside HEAD_DIM and BLOCK_D), against the float64 reference under the course's rule,
in every dtype, with each variant and modification; varlen, torch.compile, the Gluon dispatch and
the errors.
"""
from functools import partial

import flashattn  # first: it picks the interpreter before triton is imported
import numpy as np
import pytest
import torch

from flashattn import hopper
from flashattn.gpu import configs, launcher
from flashattn.kernels.mods import dropout_mask
from flashattn.measure import compiled
from flashattn.ops import dispatch
from flashattn.ops.attention import SUPPORTED_DTYPES as DTYPES
from flashattn.ops.modifiers import draw_seed
from flashattn.testing import reference
from flashattn.testing.reference import naive_attention
from flashattn.testing.rule import compare_with_reference

DEVICE = flashattn.DEVICE
N_Q, N_KV = 19, 27


def make_qkv(head_dim, head_dim_v, n_q=N_Q, n_kv=N_KV, dtype=torch.float32, batch=1, heads_q=2, heads_kv=2,
             seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads_q, n_q, head_dim, generator=g)
    k = torch.randn(batch, heads_kv, n_kv, head_dim, generator=g)
    v = torch.randn(batch, heads_kv, n_kv, head_dim_v, generator=g)
    return [t.to(dtype=dtype, device=DEVICE) for t in (q, k, v)]


def checks_of(q, k, v, is_causal=False, ref_kwargs=None, **kwargs):
    gqa = k.shape[1] != q.shape[1]
    impl = partial(flashattn.attention, enable_gqa=gqa, **kwargs)
    ref = partial(naive_attention, enable_gqa=gqa, **kwargs, **(ref_kwargs or {}))
    return compare_with_reference(q, k, v, is_causal=is_causal, impl=impl, reference=ref)


def assert_rule(checks):
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim, head_dim_v", [(24, 40), (40, 24), (64, 16)])
def test_forward_and_backward_against_reference(head_dim, head_dim_v, is_causal, dtype):
    q, k, v = make_qkv(head_dim, head_dim_v, dtype=dtype)
    out = flashattn.attention(q, k, v, is_causal=is_causal)
    assert out.shape == (1, 2, N_Q, head_dim_v) and out.dtype == dtype
    assert_rule(checks_of(q, k, v, is_causal))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim, head_dim_v", [(192, 128), (256, 16), (16, 256)])
def test_large_head_dims_at_a_tiny_length(head_dim, head_dim_v, dtype):
    """DeepSeek's MLA (192 for q and k, 128 for v: BLOCK_D = 256 beside BLOCK_DV = 128) and the
    two extremes of the range."""
    q, k, v = make_qkv(head_dim, head_dim_v, n_q=5, n_kv=9, dtype=dtype, heads_q=1, heads_kv=1)
    assert_rule(checks_of(q, k, v, is_causal=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_heads_and_a_window(dtype):
    q, k, v = make_qkv(40, 24, dtype=dtype, heads_q=4, heads_kv=2)
    assert_rule(checks_of(q, k, v, window_size=(5, 2)))
    assert_rule(checks_of(q, k, v, is_causal=True, window_size=(6, -1)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mask_softcap_alibi_bottom_right(dtype):
    q, k, v = make_qkv(24, 40, dtype=dtype)
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(1, 1, 1, N_KV, generator=g) > 0.3
    mask[..., 0] = True
    slopes = torch.tensor([0.3, 0.1], device=DEVICE)
    assert_rule(checks_of(q, k, v, attn_mask=mask.to(DEVICE), softcap=3.0))
    assert_rule(checks_of(q, k, v, True, causal_alignment="bottom_right", alibi_slopes=slopes))


def test_dropout_against_reference_with_the_same_mask():
    q, k, v = make_qkv(40, 24)
    torch.manual_seed(21)
    keep = dropout_mask((1, 2, N_Q, N_KV), 0.25, draw_seed(), DEVICE)
    torch.manual_seed(21)  # compare_with_reference's call draws the same seed
    assert_rule(checks_of(q, k, v, ref_kwargs=dict(dropout_keep=keep), dropout_p=0.25))


def test_the_check_can_fail():
    """A v whose columns are swapped gives a wrong output and dV: the rule sees it."""
    q, k, v = make_qkv(24, 40)
    impl = lambda q, k, v, **kw: flashattn.attention(q, k, v.flip(-1), **kw)  # noqa: E731
    checks = compare_with_reference(q, k, v, impl=impl)
    assert not all(c.ok for c in checks if c.name in ("out", "dv"))


def test_leading_dims_and_strides():
    """Any leading dims, a v transposed from (B, N, H, D_v), the LSE of q's rows."""
    q, k, _ = make_qkv(24, 40, batch=2)
    v = torch.randn(2, N_KV, 2, 40, device=DEVICE).transpose(1, 2)
    out, lse = flashattn.attention(q[None], k[None], v[None], return_lse=True)
    ref, ref_lse = naive_attention(q.double(), k.double(), v.double())
    assert out.shape == (1, 2, 2, N_Q, 40) and lse.shape == (1, 2, 2, N_Q)
    torch.testing.assert_close(out[0].double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[0].double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_vmap_folds_into_the_batch():
    q, k, v = make_qkv(24, 40, batch=3)
    out = torch.func.vmap(lambda a, b, c: flashattn.attention(a, b, c, is_causal=True))(q, k, v)
    ref, _ = naive_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert out.shape == (3, 2, N_Q, 40)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_mla_head_dims_compiled_on_the_gpu(dtype, is_causal):
    """The compiled kernels with the tiles of head dim 256, several blocks of each kind, grouped
    heads; on an H100/H200 the Triton kernels, not the Gluon ones."""
    q, k, v = make_qkv(192, 128, n_q=777, n_kv=1029, dtype=dtype, batch=2, heads_q=4, heads_kv=2)
    assert_rule(checks_of(q, k, v, is_causal))


# -- Packed sequences ---------------------------------------------------------------------------------

def cu_seqlens(lengths):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_causal, window_size", [(False, (-1, -1)), (True, (4, -1))])
def test_varlen(dtype, is_causal, window_size):
    lengths_q, lengths_k = [5, 21, 0, 9], [12, 17, 4, 0]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lengths_q), 4, 40, generator=g).to(dtype=dtype, device=DEVICE)
    k = torch.randn(sum(lengths_k), 2, 40, generator=g).to(dtype=dtype, device=DEVICE)
    v = torch.randn(sum(lengths_k), 2, 24, generator=g).to(dtype=dtype, device=DEVICE)
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    impl = partial(flashattn.varlen_attention, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=21,
                   max_seqlen_k=17, enable_gqa=True, window_size=window_size)
    ref = partial(reference.varlen_attention, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, enable_gqa=True,
                  window_size=window_size)
    assert impl(q, k, v).shape == (sum(lengths_q), 4, 24)
    assert_rule(compare_with_reference(q, k, v, is_causal=is_causal, impl=impl, reference=ref))


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_transformers_integration_whole_and_packed(grad):
    """The Hugging Face path with keys outnumbering queries (a KV cache): without a gradient it
    would decode, which holds one head dim, so it runs attention instead; packed rows keep v's."""
    from flashattn.integrations.transformers import Call

    q, k, v = make_qkv(24, 40, n_q=3, n_kv=10, batch=2, heads_q=4, heads_kv=2)
    call = Call(scale=None, causal=True, window=(-1, 0), dropout=0.0, softcap=None, gqa=True)
    expected, _ = naive_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True,
                                  causal_alignment="bottom_right")
    inputs = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    out = call.dense(*inputs)
    torch.testing.assert_close(out.detach().double(), expected, rtol=0, atol=1e-5)
    flat = [t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]) for t in inputs]  # (tokens, H, D)
    packed = call.packed(*flat, [3, 3], [10, 10])
    torch.testing.assert_close(packed.detach().double(), expected.transpose(1, 2).reshape(6, 4, 40),
                               rtol=0, atol=1e-5)


# -- torch.compile --------------------------------------------------------------------------------------

@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_torch_compile_fullgraph(grad):
    """Bit for bit the eager call: the fake operators give O v's head dim and the real strides."""
    torch._dynamo.reset()
    compiled_attention = torch.compile(flashattn.attention, fullgraph=True, backend="aot_eager")
    q, k, v = make_qkv(24, 40, n_q=7, n_kv=11)
    leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    eager = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    out, lse = compiled_attention(*leaves, is_causal=True, return_lse=True)
    out_e, lse_e = flashattn.attention(*eager, is_causal=True, return_lse=True)
    assert out.shape == (1, 2, 7, 40) and torch.equal(out, out_e) and torch.equal(lse, lse_e)
    if grad:
        do = torch.randn_like(out)
        grads = torch.autograd.grad((out * do).sum(), leaves)
        assert [g.shape[-1] for g in grads] == [24, 24, 40]
        for g, g_e in zip(grads, torch.autograd.grad((out_e * do).sum(), eager)):
            assert torch.equal(g, g_e)


# -- Which kernels, which tiles -----------------------------------------------------------------------

class FakeGluon:
    """Stands in for both Gluon modules on the CPU: it accepts every call and records it."""
    calls = []

    @staticmethod
    def supports(q, k, v, window=None):
        return True

    @staticmethod
    def has_dq_reduce():  # as on Triton 3.6 and 3.7.1: the dK/dV kernel, not the fused backward
        return False

    @classmethod
    def attention_forward(cls, q, k, v, scale, **call):
        cls.calls.append("forward")
        return torch.zeros_like(q), q.new_zeros(q.shape[:-1])

    @classmethod
    def attention_backward_dkdv(cls, q, k, v, *args, **mods):
        cls.calls.append("dkdv")
        return torch.zeros_like(k), torch.zeros_like(v)


@pytest.mark.parametrize("head_dim_v, gluon", [(128, True), (64, False)])
def test_gluon_kernels_only_where_v_has_q_head_dim(monkeypatch, head_dim_v, gluon):
    """The Gluon kernels hold V and O in tiles of q's head dim: D_v != D goes to the Triton ones."""
    monkeypatch.setattr(hopper, "load", lambda name: FakeGluon)
    monkeypatch.setattr(FakeGluon, "calls", [])
    q, k, v = make_qkv(128, head_dim_v, n_q=5, n_kv=5, heads_q=1, heads_kv=1)
    o, lse2 = dispatch.attention_forward(q, k, v, False, 0.1)
    do = torch.randn_like(o)
    dispatch.attention_backward(q, k, v, o, lse2, do, False, 0.1)
    assert FakeGluon.calls == (["forward", "dkdv"] if gluon else [])
    assert o.shape[-1] == head_dim_v


def test_tiles_are_those_of_the_wider_padded_head_dim(monkeypatch):
    """192/128 runs the defaults of head dim 256 (what was compiled and measured), 24/40 those of 64."""
    assert configs.tile_block_d(configs.head_dims(192, 128)) == 256
    assert configs.tile_block_d(configs.head_dims(24, 40)) == 64
    monkeypatch.setattr(launcher, "_defaults", {})
    launched = []

    class FakeKernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(kwargs)

    q = torch.empty(2, 2, dtype=torch.bfloat16)
    constexprs = dict(configs.head_dims(192, 128), IS_CAUSAL=True, DOT_PRECISION="ieee")
    ran = launcher._default("bwd_dkdv", FakeKernel(), None, (q,), constexprs)
    assert ran == configs.as_dict(configs.default_config("bwd_dkdv", torch.bfloat16, "ieee", 256))
    assert ran != configs.as_dict(configs.default_config("bwd_dkdv", torch.bfloat16, "ieee", 128))


@pytest.mark.slow
def test_mla_head_dims_compile_for_every_architecture():
    """D = 192, D_v = 128 with the tiles each architecture runs them with (the defaults of head dim
    256, chosen for 256), sm_75 to sm_90: compiled, within the shared memory of a block. A spill
    is printed with the Triton release, not failed: the tiles were chosen to compile cleanly at 256,
    and at 192 some releases spill 8-32 bytes a thread in the float32 and sm_75 kernels."""
    import triton

    try:
        rows = compiled.in_child("flashattn.measure.compiled:head_dim_v_report", timeout=3000)
    except compiled.CannotCompile as e:
        pytest.skip(str(e))
    assert {r["arch"] for r in rows} == {75, 80, 86, 89, 90}
    assert {r["kernel"] for r in rows} == {"fwd", "bwd_dkdv", "bwd_dq"}
    print(f"triton {triton.__version__}:", *(r for r in rows if r["spilled"]), sep="\n")
    problems = [r for r in rows if r["problem"] and not r["problem"].startswith("spills")]
    assert not problems, problems


# -- Errors -------------------------------------------------------------------------------------------

def test_errors_name_the_argument():
    q, k, v = make_qkv(24, 40)
    with pytest.raises(ValueError, match=r"v's head dim .* is 300; expected 1 to 256"):
        flashattn.attention(q, k, torch.zeros(1, 2, N_KV, 300, device=DEVICE))
    with pytest.raises(ValueError, match=r"k has head dim 40 but q has 24"):
        flashattn.attention(q, v, v)
    with pytest.raises(ValueError, match=r"k has 27 keys but v has 26 values"):
        flashattn.attention(q, k, v[:, :, :26])
    with pytest.raises(ValueError, match=r"v must be 3-D"):
        flashattn.varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v, cu_seqlens([N_Q]),
                                   cu_seqlens([N_KV]), N_Q, N_KV)


def test_decode_refuses_another_head_dim_for_v_by_name():
    q = torch.randn(1, 2, 1, 24, device=DEVICE)
    k_cache, v_cache = torch.randn(1, 2, 8, 24, device=DEVICE), torch.randn(1, 2, 8, 40, device=DEVICE)
    lengths = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"v_cache has head dim 40 but k_cache has 24"):
        flashattn.decode(q, k_cache, v_cache, lengths)
