"""flashattn.attention gives a right answer or a clear error, never a silent wrong answer: double
backward, threads, torch.compile and torch.func, extreme scales, non-finite inputs, numpy flags,
autocast, batches past CUDA's grid limit, and a seeded random sweep of all of these.

Sizes are tiny: on a CPU the kernels run in Triton's interpreter. The tests marked ``gpu`` repeat
what needs the compiler (inductor, compiled launches from several threads)."""
import contextlib
import threading
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flashattn
from flashattn.testing.reference import naive_attention
from flashattn.testing.rule import compare_with_reference

DEVICE = flashattn.DEVICE


def randn(*shape, seed=0, dtype=torch.float32, magnitude=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * magnitude).to(DEVICE, dtype)


def qkv(*shape, seed=0, dtype=torch.float32, requires_grad=False):
    return [randn(*shape, seed=seed + i, dtype=dtype).requires_grad_(requires_grad) for i in range(3)]


def assert_rule(checks):
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


# -- Double backward -----------------------------------------------------------------------------

def test_double_backward_raises_instead_of_dropping_the_second_order_term():
    q, k, v = qkv(1, 2, 9, 8, requires_grad=True)
    out = flashattn.attention(q, k, v, is_causal=True)
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    # The first-order gradient itself is right.
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    (dq_ref,) = torch.autograd.grad(naive_attention(*ref, is_causal=True)[0].square().sum(), ref[0])
    torch.testing.assert_close(dq.double(), dq_ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="does not support double backward.*scaled_dot_product_attention"):
        torch.autograd.grad(dq.square().sum(), (q, k, v))


def test_create_graph_alone_still_works():
    """create_graph=True for the sake of other terms of the loss is fine, as long as flashattn's
    gradient is not differentiated again."""
    q, k, v = qkv(1, 1, 5, 4, requires_grad=True)
    w = torch.ones((), requires_grad=True)
    (dw,) = torch.autograd.grad((w * flashattn.attention(q, k, v)).sum() + w ** 3, w, create_graph=True)
    (d2w,) = torch.autograd.grad(dw, w)
    assert d2w.item() == pytest.approx(6.0)


# -- Threads --------------------------------------------------------------------------------------

def run_in_threads(n_threads, calls, work):
    """Run ``work(thread, call)`` for ``calls`` calls in each of ``n_threads`` threads started together;
    returns the exceptions raised, if any."""
    errors = []
    start = threading.Barrier(n_threads)

    def body(thread):
        start.wait()
        try:
            for call in range(calls):
                work(thread, call)
        except Exception as e:  # noqa: BLE001 (reported by the test)
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def check_one_call(thread, call, backward=True):
    """flashattn on a shape of its own (each thread and call differs) against float64."""
    n_q, n_kv, d = 3 + 4 * thread + call, 5 + 3 * call + thread, (4, 8, 16)[(thread + call) % 3]
    q, k, v = qkv(1, 1 + thread % 2, n_q, d, seed=10 * thread + call, requires_grad=backward)
    k, v = (randn(1, 1 + thread % 2, n_kv, d, seed=100 + 10 * thread + call + i).requires_grad_(backward)
            for i in range(2))
    causal = (thread + call) % 2 == 0
    out = flashattn.attention(q, k, v, is_causal=causal)
    ref = [t.detach().double().requires_grad_(backward) for t in (q, k, v)]
    out_ref = naive_attention(*ref, is_causal=causal)[0]
    torch.testing.assert_close(out.double(), out_ref, atol=1e-5, rtol=1e-5)
    if backward:
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        grads_ref = torch.autograd.grad(out_ref.sum(), ref)
        for got, want in zip(grads, grads_ref):
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_threads_get_right_answers():
    errors = run_in_threads(4, 3, check_one_call)
    assert not errors, errors[0]


@pytest.mark.gpu
def test_threads_get_right_answers_on_the_gpu():
    """Compiled launches from several threads: the configuration caches are shared."""
    from flashattn.gpu import launcher

    launcher._defaults.clear()  # every thread asks for a configuration at once
    errors = run_in_threads(8, 6, check_one_call)
    assert not errors, errors[0]


# -- torch.compile and torch.func -------------------------------------------------------------------

def compiled_matches_eager(backend, dtype=torch.float32, shape=(1, 2, 9, 8)):
    """The compiled call against the eager one, bit for bit: with aot_eager nothing around the
    operators is compiled, so the kernels see exactly the same inputs."""
    torch._dynamo.reset()
    compiled = torch.compile(flashattn.attention, fullgraph=True, backend=backend)  # a break raises
    leaves = qkv(*shape, dtype=dtype, requires_grad=True)
    eager_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    do = randn(*shape, seed=7, dtype=dtype)
    dlse = randn(*shape[:-1], seed=8)
    for causal in (False, True):
        out, lse = compiled(*leaves, is_causal=causal, scale=0.3, return_lse=True)
        out_e, lse_e = flashattn.attention(*eager_leaves, is_causal=causal, scale=0.3, return_lse=True)
        assert torch.equal(out, out_e) and torch.equal(lse, lse_e)
        grads = torch.autograd.grad((out * do).sum() + (lse * dlse).sum(), leaves)
        grads_e = torch.autograd.grad((out_e * do).sum() + (lse_e * dlse).sum(), eager_leaves)
        for g, g_e in zip(grads, grads_e):
            assert torch.equal(g, g_e)


def test_torch_compile_fullgraph_forward_and_backward():
    # aot_eager: dynamo and AOTAutograd as with inductor, without its minute of C++ compiling on
    # a CPU; the GPU test below uses inductor.
    compiled_matches_eager("aot_eager")


def test_no_graph_break():
    q, k, v = qkv(1, 2, 9, 8)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(flashattn.attention)(q, k, v, is_causal=True)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_torch_compile_inductor_on_the_gpu(dtype):
    # Inductor generates its own code around the operators (the LSE's conversion, the gradients'
    # sums), which may round differently from eager: judged by the rule against float64, as the
    # eager kernels are, with random gradients for both the output and the LSE.
    torch._dynamo.reset()
    compiled = torch.compile(flashattn.attention, fullgraph=True, backend="inductor")
    q, k, v = qkv(2, 3, 100, 64, dtype=dtype)
    for causal in (False, True):
        assert_rule(compare_with_reference(q, k, v, is_causal=causal, scale=0.3, impl=compiled))


def test_vmap_folds_into_the_batch():
    q, k, v = qkv(3, 2, 9, 8)
    for causal in (False, True):
        out = torch.func.vmap(lambda a, b, c: flashattn.attention(a, b, c, is_causal=causal))(q, k, v)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                   atol=1e-6, rtol=1e-6)
    # Only q batched, along dim 1; k and v shared.
    out = torch.func.vmap(lambda a: flashattn.attention(a, k[0], v[0]), in_dims=1)(q.transpose(0, 1))
    want = F.scaled_dot_product_attention(q, k[0], v[0])
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


def test_func_grad_and_vmap_of_grad():
    q, k, v = qkv(3, 2, 9, 8)

    def loss(q, k, v):
        return flashattn.attention(q, k, v, is_causal=True).square().sum()

    def loss_ref(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum()

    for got, want in ((torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v),
                       torch.func.grad(loss_ref, argnums=(0, 1, 2))(q, k, v)),
                      (torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)))(q, k, v),
                       torch.func.vmap(torch.func.grad(loss_ref, argnums=(0, 1, 2)))(q, k, v))):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


# -- Flags, autocast, large batches ----------------------------------------------------------------

def test_numpy_bools_are_bools():
    q, k, v = qkv(1, 2, 9, 8)
    out, lse = flashattn.attention(q, k, v, is_causal=np.True_, return_lse=np.bool_(True))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True),
                               atol=1e-6, rtol=1e-6)
    with pytest.raises(TypeError, match=r"is_causal must be a bool, got numpy\.int64"):
        flashattn.attention(q, k, v, is_causal=np.int64(1))
    with pytest.raises(TypeError, match=r"return_lse must be a bool, got int$"):
        flashattn.attention(q, k, v, return_lse=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_autocast_casts_like_sdpa(dtype):
    device = DEVICE.type
    q = randn(1, 2, 9, 8, dtype=dtype)
    k, v = randn(1, 2, 9, 8, seed=1), randn(1, 2, 9, 8, seed=2)  # float32
    with torch.autocast(device, dtype=dtype):
        out = flashattn.attention(q, k, v, is_causal=True)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == want.dtype == dtype
    assert torch.equal(out, flashattn.attention(q, k.to(dtype), v.to(dtype), is_causal=True))
    assert_rule(compare_with_reference(q, k.to(dtype), v.to(dtype), is_causal=True))
    # Outside autocast, mixed dtypes stay an error.
    with pytest.raises(TypeError, match=f"k has dtype torch.float32 but q has {dtype}"):
        flashattn.attention(q, k, v)


@pytest.mark.gpu
def test_batch_past_the_grid_limit():
    """CUDA allows at most 65535 programs along grid axes 1 and 2 (heads, batch): larger products
    are launched in slices, with the same answer. (The interpreter takes minutes for 70000
    programs: the CPU test below cuts a small input on a small limit.)"""
    q, k, v = qkv(70_000, 1, 1, requires_grad=True)  # B = 70000 rows of one query, one key, D = 1
    q2, k2, v2 = qkv(2, 70_000, 1, 1, seed=5)         # H = 70000
    out = flashattn.attention(q, k, v)
    torch.testing.assert_close(out, v)                # one key: the output is its value
    (dv,) = torch.autograd.grad(out.sum(), v)
    # P = 1 up to exp2's rounding on a GPU (the score's product with the scale is fused there)
    torch.testing.assert_close(dv, torch.ones_like(v))
    torch.testing.assert_close(flashattn.attention(q2, k2, v2), v2)


def test_grid_slices_join_in_order(monkeypatch):
    """The slicing on a small limit: batch and heads both cut, against float64."""
    from flashattn.ops import autograd

    monkeypatch.setattr(autograd, "MAX_GRID_DIM", 2)
    q, k, v = (randn(5, 3, n, 8, seed=s) for s, n in ((0, 7), (1, 6), (2, 6)))
    assert_rule(compare_with_reference(q, k, v, is_causal=True))


# -- Extreme scales and non-finite values -----------------------------------------------------------

def exact_attention(q, k, v, is_causal=False, scale=None):
    """float64 attention that sums, for each row, only the keys the row sees: an inf or NaN value
    of a hidden key cannot reach it (a masked product, ``0 * inf``, would)."""
    q, k, v = (t.detach().double() for t in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    rows = []
    for i in range(q.shape[-2]):
        seen = min(i + 1, k.shape[-2]) if is_causal else k.shape[-2]
        s = (q[..., i:i + 1, :] @ k[..., :seen, :].transpose(-2, -1)) * scale
        rows.append(torch.softmax(s, dim=-1) @ v[..., :seen, :])
    return torch.cat(rows, dim=-2)


@pytest.mark.parametrize("scale", [1e-46, 1e-40, 2.0 ** -130])
@pytest.mark.parametrize("is_causal", [False, True])
def test_tiny_scale_gives_the_mean_of_the_values(scale, is_causal):
    """scale * log2(e) underflows float32 (to 0 or a denormal); -inf * 0 must not make NaN.
    Every score is ~0: each row averages the values it sees."""
    q, k, v = qkv(1, 2, 37, 8, requires_grad=True)
    out = flashattn.attention(q, k, v, is_causal=is_causal, scale=scale)
    torch.testing.assert_close(out.double().cpu(), exact_attention(q, k, v, is_causal, scale).cpu(),
                               atol=1e-6, rtol=1e-6)
    if not is_causal:  # SDPA agrees (its causal path returns NaN here)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, scale=scale),
                                   atol=1e-6, rtol=1e-6)
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    n_seen = torch.arange(1, 38).double() if is_causal else torch.full((37,), 37.0, dtype=torch.float64)
    want_dv = (1 / n_seen).flip(0).cumsum(0).flip(0) if is_causal else torch.ones(37, dtype=torch.float64)
    torch.testing.assert_close(dv[0, 0, :, 0].double().cpu(), want_dv, atol=1e-6, rtol=1e-6)


@contextlib.contextmanager
def quiet_nonfinite():
    """No NumPy warning (an error under this suite's settings) for the inf - inf, 0 * inf and
    all-NaN rows that the interpreter meets on purpose here; a GPU meets them silently."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def nonfinite_pattern(t):
    return torch.isnan(t), torch.isposinf(t), torch.isneginf(t)


def assert_same_nonfinite(got, want):
    for g, w, kind in zip(nonfinite_pattern(got), nonfinite_pattern(want), ("NaN", "+inf", "-inf")):
        assert torch.equal(g, w), f"{kind} at {g.nonzero().tolist()[:6]}, expected at {w.nonzero().tolist()[:6]}"


def ieee_float32_dots(dtype):
    """Whether the kernels multiply ``dtype`` tiles as IEEE float32 here."""
    if flashattn.INTERPRET:
        return dtype != torch.float16
    return dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_nonfinite_value_reaches_only_the_rows_that_see_it(value, is_causal, dtype, request):
    if is_causal:
        # Known limit: in a tile on the causal diagonal, a hidden key's p = 0 times its inf/NaN
        # value still makes NaN for the rows before it in that tile (rows 32-39 for key 40 with
        # the interpreter's 32-row tiles). Keeping them finite costs two more products per
        # diagonal tile, which made the compiled forward spill registers. Strict: fails once fixed.
        request.applymarker(pytest.mark.xfail(strict=True, reason="causal diagonal tiles spread inf/NaN"))
    elif ieee_float32_dots(dtype) and abs(value) == float("inf"):
        # Known limit: the IEEE float32 product (float32 at 'highest', the interpreter's bfloat16,
        # every dtype but float16 before sm_80: seen on an H200 and on the CPU) adds each tile's product started from acc * 0.0, which is NaN where acc
        # is inf: the row becomes NaN instead of inf. Every other start cost registers (a spill
        # in the compiled dK/dV kernel). Strict: fails once fixed.
        request.applymarker(pytest.mark.xfail(strict=True, reason="acc * 0.0 of an inf accumulator"))
    q, k, v = qkv(1, 2, 70, 8, dtype=dtype)
    v[0, 0, 40, 3] = value
    v[0, 1, 45, 2] = value
    v[0, 1, 45, 5] = -value  # +inf and -inf in one row of one head: NaN where both are seen
    with quiet_nonfinite():
        out = flashattn.attention(q, k, v, is_causal=is_causal)
    assert_same_nonfinite(out, exact_attention(q, k, v, is_causal))
    finite = torch.isfinite(exact_attention(q, k, v, is_causal))
    want = exact_attention(q, k, v, is_causal)
    assert torch.allclose(out.double()[finite], want[finite], atol=1e-2, rtol=1e-2)


# -- A seeded random sweep ----------------------------------------------------------------------------

def random_case(rng):
    """One random case: shapes (odd sizes), a layout, a dtype, a scale and a mask."""
    batch, heads = int(rng.integers(1, 3)), int(rng.integers(1, 3))
    n_q, n_kv = (int(n) for n in rng.integers(1, 48, size=2))
    head_dim = int(rng.choice([1, 3, 8, 16, 24, 40]))
    dtype = [torch.float32, torch.float16, torch.bfloat16][int(rng.integers(3))]
    layout = str(rng.choice(["contiguous", "transposed", "sliced", "expanded"]))
    scale = None if rng.random() < 0.4 else float(np.exp(rng.uniform(np.log(1e-3), np.log(1.5))))
    is_causal = bool(rng.random() < 0.5)
    seed = int(rng.integers(2 ** 31))

    def make(n, i):
        g = torch.Generator().manual_seed(seed + i)
        if layout == "transposed":    # (B, N, H, D) viewed as (B, H, N, D)
            t = torch.randn(batch, n, heads, head_dim, generator=g).transpose(1, 2)
        elif layout == "sliced":      # a window of a bigger tensor
            t = torch.randn(batch, heads + 1, n + 5, head_dim + 3, generator=g)[:, 1:, 2:n + 2, 3:]
        elif layout == "expanded":    # one batch element broadcast with stride 0
            t = torch.randn(1, heads, n, head_dim, generator=g).expand(batch, -1, -1, -1)
        else:
            t = torch.randn(batch, heads, n, head_dim, generator=g)
        return t.to(DEVICE, dtype)

    q, k, v = make(n_q, 0), make(n_kv, 1), make(n_kv, 2)
    name = (f"B={batch} H={heads} N_q={n_q} N_kv={n_kv} D={head_dim} {dtype} {layout} "
            f"scale={scale} causal={is_causal}")
    return name, q, k, v, scale, is_causal


def with_special_values(rng, q, k, v):
    """Copies of q, k, v with a few entries set to inf, -inf or NaN."""
    q, k, v = (t.clone() for t in (q, k, v))
    for _ in range(int(rng.integers(1, 4))):
        t = (q, k, v)[int(rng.integers(3))]
        index = tuple(int(rng.integers(s)) for s in t.shape)
        # v gets NaN only: an inf value gives NaN rows in IEEE float32 (a known limit, see above)
        t[index] = float(rng.choice([np.inf, -np.inf, np.nan])) if t is not v else float("nan")
    return q, k, v


def test_random_sweep():
    """Forward and backward under the 2x/3x rule against float64 on random cases, and, on copies
    with inf or NaN entries, inf and NaN exactly where the row-by-row float64 result has them
    (causal: at least there)."""
    rng = np.random.default_rng(20261201)
    for _ in range(40):
        name, q, k, v, scale, is_causal = random_case(rng)
        checks = compare_with_reference(q, k, v, is_causal=is_causal, scale=scale)
        assert all(c.ok for c in checks), name + "\n" + "\n".join(map(str, checks))
        q, k, v = with_special_values(rng, q, k, v)
        with quiet_nonfinite():
            out = flashattn.attention(q, k, v, is_causal=is_causal, scale=scale)
        want = exact_attention(q, k, v, is_causal, scale)
        try:
            if is_causal:  # rows before a bad key in its diagonal tile may be NaN too (see above)
                assert not (torch.isfinite(out) & ~torch.isfinite(want)).any(), "a finite answer where exact is not"
            else:
                assert_same_nonfinite(out, want)
        except AssertionError as e:
            raise AssertionError(f"{name}, with inf/NaN: {e}") from None


# -- float32 at large scores -----------------------------------------------------------------------

# Known limit on a GPU: with one query and one key, the exact dQ and dK are 0 and what the kernels
# give is only rounding: dP and Delta, equal in exact arithmetic, are summed in different orders.
# An H200 gave 6e-6 and 1.2e-5, 1.2x and 1.5x the rule's bound (PyTorch: 3e-7 and 4e-7).
ONE_KEY_ON_GPU = pytest.mark.xfail(not flashattn.INTERPRET, strict=False,
                                   reason="one query, one key: dQ/dK rounding past the rule on a GPU")


@pytest.mark.parametrize("seed,n_q,n_kv,is_causal", [(1, 17, 17, False), (1, 69, 69, True), (2, 40, 33, True),
                                                      (0, 9, 1, False),
                                                      pytest.param(3, 1, 1, True, marks=ONE_KEY_ON_GPU)])
def test_float32_at_large_scores(seed, n_q, n_kv, is_causal):
    """Scale 10 at head dim 8: scores of +-100. A float32 LSE rounded at that size scaled every
    rebuilt P of a row by one factor, and dV's error reached several times PyTorch's; the LSE is
    now kept in float64 for float32 inputs. With one key (n_kv = 1) the exact dQ and dK are 0."""
    q, k, v = (randn(1, 2, n, 8, seed=seed * 10 + i) for i, n in enumerate((n_q, n_kv, n_kv)))
    assert_rule(compare_with_reference(q, k, v, is_causal=is_causal, scale=10.0))
