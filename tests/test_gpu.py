"""Checks that need a CUDA GPU, on top of the rest of the suite (which runs there too): every tile
configuration the tuner may pick, long sequences (autotuned), offsets past 2**31 elements,
bit-identical gradients, and a small ragged case under compute-sanitizer's memcheck.

All are marked ``gpu``: skipped without a GPU, run on one with

    python -m pytest -m gpu tests

Each case is judged by the rule of flashattn.testing.rule (error against float64 within 2x, or 3x for
gradients, of PyTorch's own error in the same dtype, plus a floor); the checks are printed (see
them with ``-rP``).
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashattn
from flashattn.gpu import configs
from flashattn.measure import bench
from flashattn.testing import reference
from flashattn.kernels.backward import attention_backward
from flashattn.kernels.forward import attention_forward
from flashattn.testing.rule import compare_with_reference, judge
from flashattn.kernels.tiles import LN2

pytestmark = pytest.mark.gpu
DTYPES = bench.DTYPES
ROOT = Path(__file__).resolve().parent.parent


def qkv(shape_q, shape_kv, dtype, seed=0):
    g = torch.Generator(device=flashattn.DEVICE).manual_seed(seed)
    q = torch.randn(shape_q, device=flashattn.DEVICE, generator=g)
    k = torch.randn(shape_kv, device=flashattn.DEVICE, generator=g)
    v = torch.randn(shape_kv, device=flashattn.DEVICE, generator=g)
    return [t.to(dtype) for t in (q, k, v)]


def assert_rule(checks):
    print("\n".join(map(str, checks)))
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


def kernel_level(q, k, v, causal, fwd_config=None, bwd_configs=None):
    """Run the launchers directly (explicit configurations) and the references; judge all outputs."""
    scale = q.shape[-1] ** -0.5
    o, lse2 = attention_forward(q, k, v, causal, scale, config=fwd_config)
    g = torch.Generator(device=flashattn.DEVICE).manual_seed(1)
    do = torch.randn(o.shape, device=flashattn.DEVICE, generator=g).to(q.dtype)
    dq, dk, dv = attention_backward(q, k, v, o, lse2, do, causal, scale, configs=bwd_configs)

    def ref(t_q, t_k, t_v):
        t = [x.detach().requires_grad_() for x in (t_q, t_k, t_v)]
        out, lse = reference.naive_attention(*t, is_causal=causal)
        grads = torch.autograd.grad(out, t, do.to(out.dtype))
        return dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])

    ours = dict(out=o, lse=lse2 * LN2, dq=dq, dk=dk, dv=dv)
    return judge(ours, ref(q.double(), k.double(), v.double()), ref(q, k, v), q.dtype, do.abs().max().item())


# --- Every tile configuration the tuner may pick ----------------------------------------------------

SETTINGS = (("bf16", 128), ("fp16", 64), ("bf16", 40))  # (dtype, head dim)
CONFIGS = [(dtype, head_dim, name, dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages))
           for dtype, head_dim in SETTINGS for name in ("fwd", "bwd_dkdv", "bwd_dq")
           for c in configs.GPU_CONFIGS[name]
           if configs.fits(name, c, configs.block_d(head_dim), DTYPES[dtype].itemsize)]


@pytest.fixture(scope="module")
def compiled_configs():
    """Every candidate compiled in parallel processes first, into Triton's disk cache."""
    for dtype in sorted({dtype for dtype, _ in SETTINGS}):
        count, problems = bench.warm_compile([dtype], [hd for d, hd in SETTINGS if d == dtype], [True, False])
        print(f"compiled {count} {dtype} configurations; rejected: {problems or 'none'}")


@pytest.mark.parametrize("dtype, head_dim, name, config", CONFIGS,
                         ids=[f"{name}-{dtype}-D{hd}-{c['BLOCK_Q']}x{c.get('BLOCK_KV')}-w{c['num_warps']}"
                              f"-s{c['num_stages']}" for dtype, hd, name, c in CONFIGS])
def test_every_tile_configuration(compiled_configs, monkeypatch, dtype, head_dim, name, config):
    """A ragged causal and non-causal case, with ``config`` for one kernel and the first candidate
    that fits for the others."""
    monkeypatch.setenv("FLASHATTN_AUTOTUNE", "0")
    for causal in (True, False):
        q, k, v = qkv((1, 3, 1000, head_dim), (1, 3, 1000, head_dim), DTYPES[dtype], seed=CONFIGS.index(
            (dtype, head_dim, name, config)))
        fwd = config if name == "fwd" else None
        bwd = {name: config} if name != "fwd" else None
        assert_rule(kernel_level(q, k, v, causal, fwd, bwd))


# --- Long sequences, 64-bit offsets, determinism ----------------------------------------------------

@pytest.mark.parametrize("n, head_dim, dtype, causal", [
    (8192, 128, "bf16", True), (8192, 64, "fp16", False), (16384, 128, "bf16", True),
    (16384, 64, "fp16", False), (2048, 64, "fp32", True), (2048, 128, "fp32", False)])
def test_long_sequences_autotuned(n, head_dim, dtype, causal):
    q, k, v = qkv((1, 2, n, head_dim), (1, 2, n, head_dim), DTYPES[dtype])
    assert_rule(compare_with_reference(q, k, v, is_causal=causal))
    torch.cuda.empty_cache()


def test_offsets_past_2_to_the_31():
    """B*H*N*D past 2**31 elements: the last heads start beyond any 32-bit offset."""
    heads, n, head_dim = 8200, 4096, 64
    assert heads * n * head_dim > 2**31
    q, k, v = (t.requires_grad_() for t in qkv((1, heads, n, head_dim), (1, heads, n, head_dim), torch.float16))
    out = flashattn.attention(q, k, v, is_causal=True)
    g = torch.Generator(device=flashattn.DEVICE).manual_seed(2)
    do = torch.randn(out.shape, device=flashattn.DEVICE, generator=g).to(out.dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    last = slice(heads - 2, heads)

    def ref(dtype):
        t = [x[:, last].detach().to(dtype).requires_grad_() for x in (q, k, v)]
        o, _ = reference.naive_attention(*t, is_causal=True)
        grads = torch.autograd.grad(o, t, do[:, last].to(dtype))
        return dict(out=o, dq=grads[0], dk=grads[1], dv=grads[2])

    ours = dict(out=out[:, last], dq=dq[:, last], dk=dk[:, last], dv=dv[:, last])
    assert_rule(judge(ours, ref(torch.float64), ref(torch.float16), torch.float16))
    del q, k, v, out, dq, dk, dv
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype, head_dim", [("bf16", 128), ("fp16", 64)])
def test_gradients_are_bit_identical(dtype, head_dim):
    """With deterministic=True; the default backward on Hopper with Triton >= 3.8 adds dQ's shares
    in an order that varies (test_the_fused_backward_is_within_the_rule checks it)."""
    q, k, v = (t.requires_grad_() for t in qkv((2, 4, 3000, head_dim), (2, 4, 3000, head_dim), DTYPES[dtype]))
    do = torch.randn_like(q)

    def grads():
        out = flashattn.attention(q, k, v, is_causal=True, deterministic=True)
        return torch.autograd.grad(out, (q, k, v), do)

    first = grads()
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(first, grads()))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("n_q, n_kv, is_causal, magnitude", [
    (3000, 3000, True, 1.0), (1000, 777, False, 1.0), (300, 1, False, 3.0), (777, 200, True, 3.0)])
def test_the_fused_backward_is_within_the_rule(dtype, head_dim, n_q, n_kv, is_causal, magnitude):
    """The fused Gluon backward (Hopper, Triton >= 3.8: dQ by TMA reduce-adds), where it runs: within
    the rule against float64, ragged ends and large scores included (keys past the end must add
    nothing to dQ: their probabilities, 2**-LSE, can overflow fp16 when the scores are large and
    negative)."""
    from flashattn import hopper

    gluon = hopper.load("backward")
    if gluon is None or torch.cuda.get_device_capability()[0] != 9 or not gluon.has_dq_reduce():
        pytest.skip("the fused backward runs on compute capability 9 with Triton >= 3.8")
    g = torch.Generator(device="cuda").manual_seed(n_q + n_kv)
    q = magnitude * torch.randn(2, 4, n_q, head_dim, device="cuda", generator=g)
    k = magnitude * torch.randn(2, 4, n_kv, head_dim, device="cuda", generator=g)
    v = torch.randn(2, 4, n_kv, head_dim, device="cuda", generator=g)
    q, k, v = (t.to(DTYPES[dtype]) for t in (q, k, v))
    calls = []
    real = gluon.attention_backward
    gluon.attention_backward = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        checks = compare_with_reference(q, k, v, is_causal=is_causal)
    finally:
        gluon.attention_backward = real
    assert calls, "the fused backward did not run"
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


# --- compute-sanitizer -----------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
def test_small_ragged_case(monkeypatch, causal):
    """Small and ragged, fixed configurations: what the memcheck below runs."""
    monkeypatch.setenv("FLASHATTN_AUTOTUNE", "0")
    q, k, v = qkv((1, 2, 77, 40), (1, 2, 45, 40), torch.float16)
    assert_rule(kernel_level(q, k, v, causal))


def test_memcheck_finds_no_error():
    """compute-sanitizer's memcheck over test_small_ragged_case: no out-of-bounds or misaligned access."""
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        pytest.skip("compute-sanitizer is not on PATH")
    result = subprocess.run(
        [sanitizer, "--tool", "memcheck", "--error-exitcode", "1", sys.executable, "-m", "pytest", "-q",
         "-p", "no:cacheprovider", "-o", "addopts=", f"{__file__}::test_small_ragged_case"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "FLASHATTN_AUTOTUNE": "0"})
    output = result.stdout + result.stderr
    print(output[-3000:])
    assert result.returncode == 0 and "ERROR SUMMARY: 0 errors" in output, output[-6000:]


WARMUP_CHILD = """
import json, sys, triton, torch, flashattn
from flashattn.ops import warmup
dtype, head_dim, causal = getattr(torch, sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
compiled = []  # (kernel, compiled by flashattn.ops.warmup's thread?)
triton.knobs.runtime.jit_post_compile_hook = \\
    lambda **hook: compiled.append([hook["fn"].name, hook.get("is_manual_warmup")])
q, k, v = (torch.randn(2, 3, 300, head_dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
out = flashattn.attention(q, k, v, is_causal=causal)
warmup.wait()
before = len(compiled)
out.backward(torch.randn_like(out))
print("RESULT " + json.dumps(dict(before=compiled[:before], backward=compiled[before:])))
"""


@pytest.mark.parametrize("dtype,head_dim,causal", [("bfloat16", 128, True), ("float16", 64, False),
                                                    ("float32", 96, True)])
def test_backward_kernels_compile_during_the_forward(dtype, head_dim, causal):
    """flashattn.ops.warmup compiles the backward's kernels beside the forward's, in a fresh process:
    the backward then compiles nothing (its results are checked by every other GPU test)."""
    result = subprocess.run([sys.executable, "-c", WARMUP_CHILD, dtype, str(head_dim), str(int(causal))],
                            capture_output=True, text=True, timeout=600, cwd=ROOT,
                            env={**os.environ, "FLASHATTN_AUTOTUNE": "0"})
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    compiled = json.loads(lines[-1][len("RESULT "):])
    print(compiled)
    assert compiled["backward"] == [], compiled
    warmed = {name for name, in_warmup in compiled["before"] if in_warmup}
    assert any("bwd" in name for name in warmed) and any("dq" in name for name in warmed), compiled
