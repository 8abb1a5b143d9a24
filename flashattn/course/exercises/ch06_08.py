"""Checkers of chapters 06 and 08: the softmax and attention backward from the formulas (06), the
tolerance rule and a find-the-bug kernel (08). Chapter 07's kernels are checked in ``ch07``.
"""
import numpy as np
import torch
import triton

from ...ops.attention import attention
from ...testing.reference import naive_attention
from ...gpu.runtime import DEVICE
from .common import ExerciseError, attempt, close, expect_close, launch_learner_kernel, passed


def _generator(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


def _randn(shape, gen, dtype=torch.float64, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype=dtype, device=DEVICE)


# --- Chapter 06 -----------------------------------------------------------------------------------

def check_softmax_backward(softmax_backward):
    """``softmax_backward(p, dp) -> ds`` for P = softmax(S) along the last dim, derived from the
    softmax Jacobian without building it: dS = P * (dP - rowsum(P * dP)).

    Drawn inputs: several shapes (one row, one column, batched, wide), a row with hidden (-inf)
    scores whose probabilities are exactly 0; compared with torch.autograd in float64. The slips of
    the derivation are named: the delta term alone, the Jacobian's diagonal alone, the sum along
    the wrong dim or without its weights, its sign, the factor P in front."""
    cases = [((1, 5), 0), ((4, 1), 1), ((3, 7), 2), ((2, 3, 9), 3), ((6, 33), 4), ((2, 2, 4, 17), 5)]
    wrong_cases = []
    for shape, seed in cases:
        g = _generator(100 + seed)
        s = _randn(shape, g, scale=2.0)
        if seed % 2 and shape[-1] > 3:
            s[..., -2:] = float("-inf")  # hidden keys: P = 0 there, and so is their gradient
        s.requires_grad_(True)
        p = torch.softmax(s, dim=-1)
        dp = _randn(shape, g)
        (want,) = torch.autograd.grad(p, s, dp)
        want = torch.nan_to_num(want)  # hidden scores get a zero gradient
        p_in, dp_in = p.detach().clone(), dp.clone()
        got = attempt(softmax_backward, p_in, dp_in, name="softmax_backward", forbid=("jacobian",))
        if not (torch.equal(p_in, p.detach()) and torch.equal(dp_in, dp)):
            raise ExerciseError("softmax_backward changed its inputs p or dp in place; return a new tensor")
        if close(got, want, atol=1e-9, rtol=1e-7):
            continue
        pd = p.detach()
        row = (pd * dp).sum(-1, keepdim=True)
        slips = [
            (pd * dp, "your dS equals P * dP: that is the delta_jk term of the sum alone. Changing s_k also moves "
                      "every other p_j of the row (the -P_ij P_ik part of the Jacobian), and those terms add up "
                      "to -P_ik * rowsum(P * dP)"),
            (pd * (1 - pd) * dp, "your dS equals P * (1 - P) * dP: that uses only the Jacobian's diagonal, "
                                 "dp_k/ds_k = p_k (1 - p_k). The chain rule sums over every p_j that s_k moves, "
                                 "j != k included: dS_ik = sum_j dP_ij P_ij (delta_jk - P_ik)"),
            (pd * (dp - (pd * dp).sum(-2, keepdim=True)),
             "you summed P * dP over the wrong dimension (dim -2, across rows): the sum over j runs along "
             "each row, over the last dim, with keepdim=True"),
            (pd * (dp - dp.sum(-1, keepdim=True)), "you subtracted rowsum(dP); the sum over j carries the "
                                                   "weights P_ij: rowsum(P * dP)"),
            (pd * (dp + row), "the row sum enters with a minus sign: the Jacobian is P_ij (delta_jk - P_ik)"),
            (dp - row, "the factor P_ik in front is missing: both terms of the sum carry it, so dS_ik = "
                       "P_ik (dP_ik - rowsum(P * dP)_i), and a hidden score (P = 0) gets no gradient"),
        ]
        matched = {n for n, (wrong, _) in enumerate(slips)
                   if close(got, wrong, atol=1e-9, rtol=1e-7) and not close(wrong, want, atol=1e-9, rtol=1e-7)}
        wrong_cases.append((shape, got, want, matched, [text for _, text in slips]))
    if not wrong_cases:
        passed("softmax_backward matches torch.autograd on 6 shapes, hidden (-inf) scores included")
        return
    # a slip is named when it explains every shape that came out wrong (on one row, two can coincide)
    shape, got, want, _, texts = wrong_cases[0]
    common = set.intersection(*(matched for _, _, _, matched, _ in wrong_cases))
    if common:
        raise ExerciseError(f"for shape {shape}, {texts[min(common)]}.")
    expect_close(f"dS for shape {shape}", got, want, atol=1e-9, rtol=1e-7)


def _attention_case(n_q, n_kv, d, lead, is_causal, scale, seed):
    g = _generator(seed)
    q, k, v = (_randn((*lead, n, d), g).requires_grad_(True) for n in (n_q, n_kv, n_kv))
    out, lse = naive_attention(q, k, v, is_causal=is_causal, scale=scale)
    do = _randn(out.shape, g)
    want = torch.autograd.grad(out, (q, k, v), do)
    return [t.detach() for t in (q, k, v, out)], do, lse.detach(), want


def check_attention_backward(attention_backward):
    """``attention_backward(q, k, v, o, do, lse, is_causal, scale) -> (dq, dk, dv)`` from the formulas,
    checked against torch.autograd in float64 (causal and not, N_q != N_kv, leading dims)."""
    cases = [  # n_q, n_kv, d, leading dims, causal, scale
        (7, 7, 4, (), False, 0.5), (9, 9, 8, (2,), True, None), (5, 11, 6, (1, 2), True, 0.3),
        (12, 4, 5, (2, 1), True, None), (6, 13, 3, (), False, 1.7), (1, 1, 2, (), True, None),
    ]
    for n, (n_q, n_kv, d, lead, causal, scale) in enumerate(cases):
        (q, k, v, o), do, lse, want = _attention_case(n_q, n_kv, d, lead, causal, scale, 200 + n)
        what = f"N_q={n_q}, N_kv={n_kv}, D={d}, leading dims {lead}, is_causal={causal}, scale={scale}"
        got = attempt(attention_backward, q.clone(), k.clone(), v.clone(), o.clone(), do.clone(), lse.clone(),
                      causal, scale, name="attention_backward")
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            raise ExerciseError("attention_backward must return a tuple (dq, dk, dv)")
        sc = 1.0 / d ** 0.5 if scale is None else scale
        for name, g_, w in zip(("dq", "dk", "dv"), got, want):
            if close(g_, w, atol=1e-9, rtol=1e-7):
                continue
            if name != "dv" and close(torch.as_tensor(g_) * sc, w, atol=1e-9, rtol=1e-7):
                raise ExerciseError(f"{name} is wrong ({what}): it is missing the factor scale: S = scale * Q K^T, "
                                    "so dQ = scale * dS K and dK = scale * dS^T Q.")
            if name != "dv" and close(torch.as_tensor(g_), w * sc, atol=1e-9, rtol=1e-7):
                raise ExerciseError(f"{name} is wrong ({what}): it carries the factor scale twice.")
            expect_close(f"{name} ({what})", g_, w, atol=1e-9, rtol=1e-7, heatmap=True)
    passed("attention_backward matches torch.autograd in float64 on 6 cases (causal, N_q != N_kv, leading dims)")


# --- Chapter 08 -----------------------------------------------------------------------------------

class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient passing back through it is multiplied by ``factor``."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _rule_impls():
    """A correct implementation and subtly wrong ones, all called as impl(q, k, v, is_causal=...)."""
    def flash(q, k, v, is_causal=False):
        return attention(q, k, v, is_causal=is_causal)

    def pytorch(q, k, v, is_causal=False):
        return naive_attention(q, k, v, is_causal=is_causal)[0]

    def scale_off(q, k, v, is_causal=False):
        return attention(q, k, v, is_causal=is_causal, scale=1.01 / q.shape[-1] ** 0.5)

    def dk_off(q, k, v, is_causal=False):
        return attention(q, _ScaleGrad.apply(k, 1.02), v, is_causal=is_causal)

    def last_row_off(q, k, v, is_causal=False):
        out = attention(q, k, v, is_causal=is_causal)
        bump = torch.ones(out.shape[-2], 1, dtype=out.dtype, device=out.device)
        bump[-1] = 1.004
        return out * bump

    def sees_next_key(q, k, v, is_causal=False):
        if not is_causal:
            return attention(q, k, v)
        n_q, n_kv = q.shape[-2], k.shape[-2]
        i = torch.arange(n_q, device=q.device)[:, None]
        j = torch.arange(n_kv, device=q.device)[None, :]
        mask = torch.zeros(n_q, n_kv, dtype=q.dtype, device=q.device).masked_fill(j > i + 1, float("-inf"))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    right = {"flashattn.attention": flash, "plain PyTorch in the same dtype": pytorch}
    wrong = {"the kernel with a scale 1% too large": scale_off,
             "the kernel with dK 2% too large (forward exact)": dk_off,
             "the kernel with only the last query row 0.4% off": last_row_off,
             "causal attention where query i also sees key i+1": sees_next_key}
    return right, wrong


def _verdict(verdict):
    if isinstance(verdict, torch.Tensor) and verdict.numel() == 1:
        verdict = bool(verdict)
    if not isinstance(verdict, (bool, np.bool_)):
        raise ExerciseError(f"rule_test must return True or False, got {type(verdict).__name__}")
    return bool(verdict)


def check_rule_test(rule_test):
    """``rule_test(impl, q, k, v, is_causal) -> bool`` applies the tolerance rule (error against a
    float64 reference at most 2x (out) or 3x (dq, dk, dv) plain PyTorch's error in the same dtype,
    plus the floor). It must accept correct implementations and reject subtly wrong ones."""
    right, wrong = _rule_impls()

    def inputs(n_q, n_kv, d, dtype, seed):
        g = _generator(500 + seed)
        return [torch.randn(1, 1, n, d, generator=g).to(dtype=dtype, device=DEVICE) for n in (n_q, n_kv, n_kv)]

    right_cases = [("flashattn.attention", (37, 37, 32, torch.float32, 0), True),
                   ("flashattn.attention", (37, 50, 40, torch.float16, 1), False),
                   ("flashattn.attention", (50, 23, 16, torch.bfloat16, 2), True),
                   ("plain PyTorch in the same dtype", (29, 29, 16, torch.float16, 3), True)]
    for label, shape, causal in right_cases:
        verdict = _verdict(attempt(rule_test, right[label], *inputs(*shape), is_causal=causal, name="rule_test"))
        if not verdict:
            raise ExerciseError(f"rule_test rejected a correct implementation ({label}) on N_q, N_kv, D = "
                                f"{shape[:3]}, {shape[3]}, is_causal={causal}: is the bound factor x "
                                "PyTorch's error + floor, with errors measured against float64?")
    for label, impl in wrong.items():
        verdict = _verdict(attempt(rule_test, impl, *inputs(33, 33, 32, torch.float32, 7), is_causal=True,
                                       name="rule_test"))
        if verdict:
            raise ExerciseError(f"rule_test accepted a wrong implementation: {label} (float32, causal). "
                                "Does it compare the gradients too, take the LARGEST error over all "
                                "elements, and use a bound relative to PyTorch's own error?")
    passed("rule_test accepts flashattn and PyTorch in fp32, fp16 and bf16, and rejects 4 subtly wrong "
           "implementations")


def check_row_lse_kernel(row_lse_kernel):
    """The fixed find-the-bug kernel: ``row_lse_kernel[(cdiv(n_rows, BLOCK_ROWS),)](X, LSE, n_rows,
    n_cols, stride_row, BLOCK_ROWS=..., BLOCK_COLS=...)`` writes logsumexp of each row of X."""
    cases = [(8, 64, 4, 16), (5, 17, 4, 16), (3, 1, 4, 16), (9, 69, 8, 32), (2, 100, 4, 32), (7, 48, 4, 32)]
    for n, (n_rows, n_cols, block_rows, block_cols) in enumerate(cases):
        g = _generator(600 + n)
        x = (torch.randn(n_rows, n_cols + 5, generator=g) * 3).to(DEVICE)[:, :n_cols]
        lse = torch.full((n_rows + block_rows,), -7.0, device=DEVICE)
        launch_learner_kernel(row_lse_kernel, (triton.cdiv(n_rows, block_rows),),
                              (x, lse, n_rows, n_cols, x.stride(0)),
                              dict(BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols), "row_lse_kernel",
                              row_lse_kernel)
        want = torch.logsumexp(x.double(), dim=-1)
        what = f"n_rows={n_rows}, n_cols={n_cols}, BLOCK_ROWS={block_rows}, BLOCK_COLS={block_cols}"
        if not (lse[n_rows:].cpu() == -7.0).all():
            raise ExerciseError(f"{what}: the kernel wrote past the end of LSE: mask the store with rows < n_rows.")
        if close(lse[:n_rows], want, atol=1e-5, rtol=1e-5):
            continue
        if n_cols % block_cols and n > 0:  # case 0 (n_cols a multiple of the block) passed
            raise ExerciseError(f"{what}: wrong when n_cols is not a multiple of BLOCK_COLS (right when it is). "
                                "The padded columns of the last block still count: their scores must be "
                                "-inf (probability 0), not 0.")
        expect_close(f"LSE ({what})", lse[:n_rows], want, atol=1e-5, rtol=1e-5)
    passed("row_lse_kernel is right on aligned and ragged column counts (1, 17, 69, 100)")


# --- Chapter 08: the autograd Function ------------------------------------------------------------

#: (batch, heads, N_q, N_kv, D, is_causal, dtype, scale, views): odd sizes, causal and not, the
#: default scale and a given one, float32 and float16, an upstream gradient and inputs that are views.
FUNCTION_CASES = [(1, 2, 19, 27, 24, False, torch.float32, None, False),
                  (1, 2, 19, 27, 24, True, torch.float32, 0.3, False),
                  (2, 1, 27, 19, 24, True, torch.float32, None, True),
                  (1, 2, 19, 27, 24, True, torch.float16, None, False)]


def _function_inputs(batch, heads, n_q, n_kv, d, dtype, views, gen):
    if views:  # (B, N, H, D) memory seen as (B, H, N, D); dO a strided view as well
        q, k, v = (_randn((batch, n, heads, d), gen, torch.float32).to(dtype).transpose(1, 2)
                   for n in (n_q, n_kv, n_kv))
        do = _randn((batch, heads, n_q, 2 * d), gen, torch.float32).to(dtype)[..., ::2]
    else:
        q, k, v, do = (_randn((batch, heads, n, d), gen, torch.float32).to(dtype) for n in (n_q, n_kv, n_kv, n_q))
    return q, k, v, do


def _backward_of(out, leaves, do, name):
    """The gradients autograd gives through the learner's Function, with its typical errors named."""
    try:
        return torch.autograd.grad(out, leaves, do)
    except NotImplementedError:
        raise ExerciseError(f"{name}: MyAttention.backward is not implemented yet: replace "
                            "`raise NotImplementedError()` with your code, then run this check again.") from None
    except RuntimeError as error:
        text = str(error)
        if "incorrect number of gradients" in text:
            raise ExerciseError(f"MyAttention.backward {text.split('returned ')[-1]}: return one gradient per "
                                "argument of forward, in order: dq, dk, dv, then None for is_causal and None "
                                "for scale.") from None
        if "invalid gradient at index" in text:
            raise ExerciseError(f"MyAttention.backward returned a gradient that does not fit its input "
                                f"({text.splitlines()[0][:200]}): return dq, dk, dv in the order of forward's "
                                "arguments q, k, v.") from None
        from .common import crashed
        raise crashed("MyAttention.backward", error) from None
    except Exception as error:
        from .common import crashed
        raise crashed("MyAttention.backward", error) from None


def _saved_tensors_said(node, q, k, v, o, lse2):
    """What is wrong with what the Function saved (None if q, k, v, o and lse2 are all there)."""
    try:
        saved = list(node.saved_tensors)
    except RuntimeError:
        return None  # freed already: nothing to say
    def holds(t, atol=0.0):
        return any(s.shape == t.shape and close(s, t, atol=atol, rtol=atol) for s in saved)
    if holds(lse2 * 0.6931471805599453, 1e-6) and not holds(lse2, 1e-6):
        return ("it saved the natural-log LSE; the backward kernels rebuild P = 2**(s * scale * log2 e - lse2) "
                "and need the base-2 lse2 the forward returned")
    missing = [n for n, t in (("q", q), ("k", k), ("v", v), ("o", o)) if not holds(t)]
    if not holds(lse2, 1e-6):
        missing.append("lse2")
    if missing:
        return (f"ctx.save_for_backward did not save {', '.join(missing)}: save q, k, v, the output o and "
                "lse2 (O for Delta = rowsum(dO * O), lse2 to rebuild P)")
    return None


def check_my_attention(MyAttention, my_attention):
    """``MyAttention``, a torch.autograd.Function whose forward(ctx, q, k, v, is_causal, scale)
    calls ``my_attention_forward``, saves q, k, v, o, lse2 and returns o, and whose backward calls
    ``my_attention_backward``; and ``my_attention(q, k, v, is_causal=False, scale=None)``, which
    applies it. Output and gradients are compared with float64 autograd under the rule on odd
    sizes (causal and not, float32 and float16, views, the default scale and a given one); the
    gradients also against finite differences of the learner's own forward, in float32 (the
    kernels take no float64, so torch.autograd.gradcheck cannot run them). Names the wrong tensors
    saved, the wrong number or order of gradients, scale's default forgotten, and is_causal or
    scale lost between forward and backward."""
    from ...kernels.forward import attention_forward
    from ...testing.reference import default_scale
    from ...testing.rule import judge
    from .common import check_references

    name = "my_attention"
    if not (isinstance(MyAttention, type) and issubclass(MyAttention, torch.autograd.Function)):
        raise ExerciseError("MyAttention should be a class deriving from torch.autograd.Function")
    allow = ("flashattn.kernels.forward.attention_forward", "flashattn.kernels.backward.attention_backward")
    for method in ("forward", "backward"):
        check_references(getattr(MyAttention, method), f"MyAttention.{method}", ("flashattn", "sdpa"), allow)
    for n, (batch, heads, n_q, n_kv, d, causal, dtype, scale, views) in enumerate(FUNCTION_CASES):
        gen = _generator(1200 + n)
        q, k, v, do = _function_inputs(batch, heads, n_q, n_kv, d, dtype, views, gen)
        s = default_scale(d, scale)
        what = (f"B={batch}, H={heads}, N_q={n_q}, N_kv={n_kv}, D={d}, is_causal={causal}, {str(dtype)[6:]}, "
                f"scale={scale}{', views' if views else ''}")
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        extra = {} if scale is None else {"scale": scale}
        try:
            out = attempt(my_attention, *leaves, name=name, forbid=("flashattn", "sdpa"), allow=allow,
                          is_causal=causal, **extra)
        except ExerciseError as error:
            if scale is None and "NotImplementedError" not in str(error) and "not implemented" not in str(error):
                raise ExerciseError(f"{error} (with scale=None, {what}): scale's default is 1/sqrt(D); set it "
                                    "before the launchers see it") from None
            raise
        if isinstance(out, (tuple, list)):
            raise ExerciseError(f"{name} returned a {type(out).__name__}; it should return the output o alone")
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(q.shape):
            raise ExerciseError(f"{name} should return o, a tensor shaped like q {tuple(q.shape)}")
        node = out.grad_fn
        if node is None or type(node).__name__ != f"{MyAttention.__name__}Backward":
            raise ExerciseError(f"{name}'s output does not come from MyAttention ({what}): call "
                                "MyAttention.apply(q, k, v, is_causal, scale), never MyAttention.forward directly")
        o_want, lse2 = attention_forward(q, k, v, causal, s)
        said = _saved_tensors_said(node, *(t.detach() for t in leaves), out.detach(), lse2)
        leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
        out64 = naive_attention(*leaves64, is_causal=causal, scale=s)[0]
        base = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out_pt = naive_attention(*base, is_causal=causal, scale=s)[0]
        grads = _backward_of(out, leaves, do, name)
        ref = torch.autograd.grad(out64, leaves64, do.double())
        pytorch = torch.autograd.grad(out_pt, base, do)
        names = ("out", "dq", "dk", "dv")
        checks = judge(dict(zip(names, (out, *grads))), dict(zip(names, (out64, *ref))),
                       dict(zip(names, (out_pt, *pytorch))), dtype, upstream=do.abs().max().item())
        if all(c.ok for c in checks):
            continue
        if checks[0].ok and said:
            raise ExerciseError(f"the gradients are wrong ({what}): {said}.")
        if not checks[0].ok:
            if scale is None and close(out, naive_attention(q.double(), k.double(), v.double(), is_causal=causal,
                                                            scale=1.0)[0], atol=1e-2, rtol=1e-2):
                raise ExerciseError(f"the output is that of scale 1 ({what}): scale's default is 1/sqrt(D)")
            raise ExerciseError(f"the output is wrong ({what}): {checks[0]}")
        from ...kernels.backward import attention_backward
        for wrong, text in (((not causal, s), "the backward used is_causal={}: keep the forward's is_causal on ctx "
                                              "and pass it to the backward launcher".format(not causal)),
                            ((causal, 1.0), "the backward used scale=1: keep the forward's scale (its default "
                                            "resolved) on ctx and pass it to the backward launcher"),
                            ((causal, None), None)):
            if wrong[1] is None:
                continue
            model = attention_backward(q, k, v, o_want, lse2, do, *wrong)
            if all(close(g, m, atol=1e-3, rtol=1e-3) for g, m in zip(grads, model)):
                raise ExerciseError(f"the gradients are wrong ({what}): {text}.")
        worst = max((c for c in checks if not c.ok), key=lambda c: c.error / max(c.bound, 1e-30))
        raise ExerciseError(f"{worst.name} is wrong ({what}): {worst}")
    _finite_differences(my_attention, name)
    passed("MyAttention and my_attention: output and gradients pass the rule against float64 (odd sizes, causal "
           "and not, float32 and float16, views, default scale), and the gradients match finite differences")


def _finite_differences(my_attention, name, n_q=11, n_kv=13, d=16, h=1e-2):
    """The gradient along a random direction against a central difference of the learner's own
    forward, f(x) = sum(o(x) * dO), in float32: a backward that is not the derivative of the
    forward fails, whatever the reference says."""
    gen = _generator(1300)
    q, k, v, do = (_randn((1, 1, n, d), gen, torch.float32) for n in (n_q, n_kv, n_kv, n_q))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad(my_attention(*leaves, is_causal=True), leaves, do)
    for i, label in enumerate(("q", "k", "v")):
        u = _randn(q.shape if i == 0 else k.shape, gen, torch.float32)
        moved = [[t.clone() for t in (q, k, v)] for _ in range(2)]
        moved[0][i] += h * u
        moved[1][i] -= h * u
        with torch.no_grad():
            f = [(my_attention(*m, is_causal=True).double() * do.double()).sum().item() for m in moved]
        numeric = (f[0] - f[1]) / (2 * h)
        analytic = (grads[i].double() * u.double()).sum().item()
        if not abs(numeric - analytic) <= 2e-2 * (1 + abs(numeric)):
            raise ExerciseError(f"{name}: the gradient for {label} along a random direction is {analytic:.5g}, but "
                                f"a finite difference of your forward gives {numeric:.5g}: backward is not the "
                                "derivative of forward")


# --- Chapter 06: predicting the base-2 slips ------------------------------------------------------

SLIP_KEYS = ("dk_without_ln2", "dv_without_ln2", "dq_with_qk_scale_in_loop")


def check_slip_factors(slip_factors):
    """``slip_factors(scale) -> {"dk_without_ln2": ..., "dv_without_ln2": ..., "dq_with_qk_scale_in_loop": ...}``:
    the factor by which each gradient comes out too large (1: unchanged) when a base-2 backward
    differentiates 2**x as 2**x (no ln 2), or multiplies dS by qk_scale inside the loop as well as
    dQ by scale at the end. Checked for several scales; names the likely confusions."""
    from ...kernels.tiles import LN2, LOG2E

    name = "slip_factors"
    for scale in (0.125, 0.3, 1 / 24 ** 0.5, 2.0):
        got = attempt(slip_factors, scale, name=name)
        if not isinstance(got, dict) or set(got) != set(SLIP_KEYS):
            raise ExerciseError(f"{name} should return a dict with the keys {', '.join(SLIP_KEYS)}")
        want = {"dk_without_ln2": LOG2E, "dv_without_ln2": 1.0, "dq_with_qk_scale_in_loop": scale * LOG2E}
        for key in SLIP_KEYS:
            try:
                value = float(got[key])
            except (TypeError, ValueError):
                raise ExerciseError(f"{name}(scale={scale})[{key!r}] should be a number") from None
            if abs(value - want[key]) <= 1e-9 * abs(want[key]):
                continue
            hints = {("dk_without_ln2", LN2): "ln 2 is the factor that goes missing, so the gradient is "
                                               "multiplied by its inverse",
                     ("dk_without_ln2", scale * LOG2E): "scale is still applied once at the end; only the ln 2 of "
                                                        "d(2**x)/dx is missing",
                     ("dk_without_ln2", 1.0): "the ln 2 of d(2**x)/dx does not cancel by itself: it cancels the "
                                              "log2(e) inside qk_scale",
                     ("dq_with_qk_scale_in_loop", scale): "qk_scale is scale * log2(e), not scale",
                     ("dq_with_qk_scale_in_loop", LOG2E): "the extra factor inside the loop is all of qk_scale, "
                                                          "scale included"}
            hint = next((h for (k, v), h in hints.items() if k == key and abs(value - v) <= 1e-9 * abs(v)), None)
            if key == "dv_without_ln2":
                hint = "dV = P^T dO takes no derivative of 2**x: P is rebuilt the same way either way"
            raise ExerciseError(f"{name}(scale={scale})[{key!r}] = {value:.6g} is not the factor"
                                + (f": {hint}." if hint else "."))
    passed("slip_factors predicts what a missing ln 2 and a qk_scale inside the loop do to dK, dV and dQ")
