"""The checkers of chapters 06 and 08 fail plausible mistakes (each one the solution with a named
edit, kernels included) with a message that names the mistake. (tests/test_exercise_checks.py runs
every solution and stub.)"""
import re

import pytest

from flashattn.course import exercises as ex

from exercise_cases import mistakes  # tests/exercise_cases.py

@pytest.fixture(autouse=True)
def no_figures(monkeypatch):
    monkeypatch.setattr("matplotlib.pyplot.show", lambda *a, **k: None)


# --- Chapter 06 -------------------------------------------------------------------------------------

DS = "return p * (dp - (p * dp).sum(dim=-1, keepdim=True))"


@mistakes(
    ("the delta term alone", [(DS, "return p * dp")], "delta_jk term of the sum alone"),
    ("the diagonal alone", [(DS, "return p * (1 - p) * dp")], "only the Jacobian's diagonal"),
    ("wrong dimension", [("(p * dp).sum(dim=-1", "(p * dp).sum(dim=-2")], "wrong dimension"),
    ("unweighted row sum", [("(p * dp).sum(dim=-1", "dp.sum(dim=-1")], re.escape("rowsum(P * dP)")),
    ("sign", [(DS, "return p * (dp + (p * dp).sum(dim=-1, keepdim=True))")], "minus sign"),
    ("no factor in front", [(DS, "return dp - (p * dp).sum(dim=-1, keepdim=True)")], "factor P_ik in front"),
    ("slightly off", [(DS, DS + " * 1.001")], "wrong at"),
    ("the Jacobian built", [(DS, "jacobian = torch.diag_embed(p) - p[..., :, None] * p[..., None, :]\n"
                                 "    return (jacobian.transpose(-1, -2) @ dp[..., None])[..., 0]")], "calls torch.diag_embed"),
    ("the Jacobian built, as a method", [(DS, "jacobian = p.diag_embed() - p[..., :, None] * p[..., None, :]\n"
                                              "    return (jacobian @ dp[..., None])[..., 0]")], "calls Tensor.diag_embed"),
    ("autograd asked", [(DS, "s = torch.log(p).requires_grad_()\n"
                             "    return torch.autograd.grad(torch.softmax(s, -1), s, dp)[0]")], "calls torch.autograd.grad"),
)
def test_softmax_backward_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_softmax_backward(solutions("06", edits).softmax_backward)


@mistakes(
    ("dQ without the scale", [("return scale * ds @ k,", "return ds @ k,")], "missing the factor scale"),
    ("no causal mask", [("    if is_causal:\n        p = p.masked_fill(", "    if False:\n        p = p.masked_fill(")],
     "dq .*is_causal=True"),
    ("no Delta", [("ds = p * (dp - delta)", "ds = p * dp")], "dq .*wrong at"),
)
def test_attention_backward_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_attention_backward(solutions("06", edits).attention_backward)


# --- Chapter 08 -------------------------------------------------------------------------------------

BOUND = "bound = factor * baseline + 8 * eps * max(r.abs().max().item(), 1.0)"


@mistakes(
    ("output only", [("quantities += [(3.0, grads[0][n], grads[1][n], grads[2][n]) for n in range(3)]", "")],
     "accepted a wrong implementation: the kernel with dK"),
    ("fixed tolerance", [(BOUND, "bound = 1e-2")], "accepted a wrong implementation"),
    ("exact", [(BOUND, "bound = 0.0")], "rejected a correct implementation"),
    ("not a bool", [("    return True\n", '    return "yes"\n')], "must return True or False"),
)
def test_rule_test_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_rule_test(solutions("08", edits).rule_test)


def test_row_lse_kernel_catches_the_bug(solutions):
    """The bug the exercise asks to find: padded columns count as scores of 0."""
    buggy = solutions("08", [('        x = tl.where(cols[None, :] < n_cols, x, float("-inf"))\n', "")])
    with pytest.raises(ex.ExerciseError, match="not a multiple of BLOCK_COLS"):
        ex.check_row_lse_kernel(buggy.row_lse_kernel)


# --- Chapter 08: the autograd Function ------------------------------------------------------------

SAVE = "ctx.save_for_backward(q, k, v, o, lse2)"
RETURN = "return dq, dk, dv, None, None"
DEFAULT = "scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale"
CALL = "my_attention_backward(q, k, v, o, lse2, do, ctx.is_causal, ctx.scale)"


@mistakes(
    ("natural-log LSE saved", [(SAVE, "ctx.save_for_backward(q, k, v, o, lse2 * 0.6931471805599453)")],
     "saved the natural-log LSE"),
    ("the input saved for the output", [(SAVE, "ctx.save_for_backward(q, k, v, q, lse2)")],
     "did not save o"),
    ("three gradients", [(RETURN, "return dq, dk, dv")], "expected 5, got 3.*one gradient per argument"),
    ("gradients out of order", [(RETURN, "return dk, dq, dv, None, None")], "in the order of forward's arguments"),
    ("scale's default forgotten", [(DEFAULT, "pass")], "scale's default is 1/sqrt"),
    ("is_causal lost", [(CALL, CALL.replace("ctx.is_causal", "False"))], "the backward used is_causal=False"),
    ("scale lost", [(CALL, CALL.replace("ctx.scale", "1.0"))], "the backward used scale=1"),
    ("forward called directly", [("return MyAttention.apply(q, k, v, is_causal, scale)",
                                  "return MyAttention.forward(None, q, k, v, is_causal, scale)")],
     "call MyAttention.apply|raised"),
)
def test_my_attention_catches(solutions, edits, message):
    module = solutions("08", edits)
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_my_attention(module.MyAttention, module.my_attention)


# --- Chapter 06: predicting the base-2 slips ------------------------------------------------------

@mistakes(
    ("ln 2 for its inverse", [('"dk_without_ln2": 1 / LN2,', '"dk_without_ln2": LN2,')], "goes missing"),
    ("no change without ln 2", [('"dk_without_ln2": 1 / LN2,', '"dk_without_ln2": 1.0,')], "does not cancel by itself"),
    ("dV changed too", [('"dv_without_ln2": 1.0,', '"dv_without_ln2": 1 / LN2,')], "takes no derivative"),
    ("scale for qk_scale", [('"dq_with_qk_scale_in_loop": scale * LOG2E,', '"dq_with_qk_scale_in_loop": scale,')],
     re.escape("qk_scale is scale * log2(e)")),
    ("a key missing", [('        "dv_without_ln2": 1.0,', '')], "should return a dict with the keys"),
)
def test_slip_factors_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_slip_factors(solutions("06", edits).slip_factors)


# --- Chapter 08's capstone: attention that is entirely the learner's -------------------------------

def test_capstone_runs_the_learners_kernels_only(solutions):
    """The capstone binds chapter 05's and chapter 07's launchers to chapter 08's Function: with the
    notebooks' solutions, every kernel it runs is the learner's, and output and gradients pass the rule."""
    import torch

    import flashattn
    from flashattn.testing.reference import naive_attention
    from flashattn.testing.rule import judge

    forward, backward = solutions("05").my_attention_forward, solutions("07").my_attention_backward
    assert not ex.unwritten(forward) and not ex.unwritten(backward)
    assert "my_attn_fwd" in ex.learner_functions(forward)
    assert set(ex.learner_functions(backward)) == {"delta_kernel", "my_attn_bwd_dkdv", "dkdv_inner",
                                                   "my_attn_bwd_dq", "dq_inner"}
    chapter08 = solutions("08")
    chapter08.my_attention_forward, chapter08.my_attention_backward = forward, backward  # as the capstone binds them
    # on a GPU the learner's tl.dot multiplies float32 in TF32, which the float32 rule does not allow
    dtype = torch.float32 if flashattn.INTERPRET else torch.float16
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 19, 3, 24, generator=g).to(flashattn.DEVICE, dtype).transpose(1, 2)
    k, v = (torch.randn(2, 3, 27, 24, generator=g).to(flashattn.DEVICE, dtype) for _ in range(2))
    do = torch.randn(2, 3, 19, 24, generator=g).to(flashattn.DEVICE, dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = chapter08.my_attention(*leaves, is_causal=True)
    ours = dict(zip(("out", "dq", "dk", "dv"), (out, *torch.autograd.grad(out, leaves, do))))
    ref64 = [t.double().requires_grad_() for t in (q, k, v)]
    out64 = naive_attention(*ref64, is_causal=True)[0]
    ref = dict(zip(ours, (out64, *torch.autograd.grad(out64, ref64, do.double()))))
    base = [t.clone().requires_grad_() for t in (q, k, v)]
    out_pt = naive_attention(*base, is_causal=True)[0]
    pytorch = dict(zip(ours, (out_pt, *torch.autograd.grad(out_pt, base, do))))
    checks = judge(ours, ref, pytorch, dtype, upstream=do.abs().max().item())
    assert all(c.ok for c in checks), "\n".join(map(str, checks))
