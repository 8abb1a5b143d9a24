"""The checkers of chapter 07 fail plausible mistakes (each one the solution with a named edit) with
a message that names the mistake: for the two inner loops, every slip the checkers model alone, and
the likeliest pairs. (tests/test_exercise_checks.py runs every solution and stub.)"""
import re

import pytest

from flashattn.course import exercises as ex

from exercise_cases import mistakes  # tests/exercise_cases.py

LN2 = "0.6931471805599453"


@pytest.fixture(autouse=True)
def no_figures(monkeypatch):
    monkeypatch.setattr("matplotlib.pyplot.show", lambda *a, **k: None)


# --- Exercise 1: the Delta kernel -------------------------------------------------------------------

DO_LOAD = "do = tl.load(dO + rows[:, None] * stride_do + cols[None, :], mask=inside, other=0.0)"


@mistakes(
    ("store not masked", [("tl.store(Delta + rows, delta, mask=rows < n_rows)", "tl.store(Delta + rows, delta)")],
     "wrote past the end of Delta"),
    ("no column mask", [("inside = (rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM)",
                         "inside = rows[:, None] < n_rows")], "Delta .*wrong at|NaN"),
    ("summed in float16", [("tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)", "tl.sum(o * do, axis=1)")],
     "lost precision|wrong at"),
    ("O twice", [(DO_LOAD, "do = tl.load(O + rows[:, None] * stride_o + cols[None, :], mask=inside, other=0.0)")],
     re.escape("rowsum(O * O)")),
    ("dO twice", [("o = tl.load(O + rows[:, None] * stride_o", "o = tl.load(dO + rows[:, None] * stride_do")],
     re.escape("rowsum(dO * dO)")),
)
def test_delta_kernel_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_delta_kernel(solutions("07", edits).delta_kernel)


# --- Exercise 2: the dQ loop ------------------------------------------------------------------------

DS = "ds = p * (dp - delta[:, None])"
EXP2 = "p = tl.exp2(s * qk_scale - lse[:, None])"
MASK = 'keep = keep & (keys[None, :] <= offs_q[:, None])'


@mistakes(
    ("ln 2 inside the loop", [(DS, f"{DS} * {LN2}")], "dS multiplied by ln 2 inside the loop"),
    ("log2 e inside the loop", [(DS, f"{DS} / {LN2}")], re.escape("dS multiplied by log2(e)")),
    ("qk_scale inside the loop", [(DS, f"{DS} * qk_scale")], "dS multiplied by qk_scale"),
    ("no qk_scale", [(EXP2, "p = tl.exp2(s - lse[:, None])")], "without qk_scale"),
    ("scale without log2 e", [(EXP2, "p = tl.exp2(s * qk_scale * 0.6931471805599453 - lse[:, None])")],
     "with the softmax scale instead of qk_scale"),
    ("exp", [(EXP2, "p = tl.exp(s * qk_scale - lse[:, None])")], "exp instead of exp2"),
    ("no Delta", [(DS, "ds = p * dp")], "forgot Delta"),
    ("Delta of the tile", [(DS, "ds = p * (dp - tl.sum(p * dp, 1)[:, None])")], "Delta summed over this tile"),
    ("LSE and Delta swapped", [(EXP2, "p = tl.exp2(s * qk_scale - delta[:, None])"),
                               (DS, "ds = p * (dp - lse[:, None])")], "LSE and Delta swapped"),
    ("no mask", [('s = tl.where(keep, s, float("-inf"))', "s = s")], "no causal mask"),
    ("mask the wrong way round", [(MASK, MASK.replace("<=", ">="))], "the wrong way round"),
    ("mask drops the diagonal", [(MASK, MASK.replace("<=", "<"))], "drops the diagonal"),
    ("ln 2 and no mask", [(DS, f"{DS} * {LN2}"), ('s = tl.where(keep, s, float("-inf"))', "s = s")],
     "two mistakes at once: dS multiplied by ln 2 .*AND no causal mask"),
    ("exp and no Delta", [(EXP2, "p = tl.exp(s * qk_scale - lse[:, None])"), (DS, "ds = p * dp")],
     "two mistakes at once: exp instead of exp2.*AND forgot Delta"),
)
def test_dq_inner_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_dq_inner(solutions("07", edits).dq_inner)


# --- Exercise 3: the transposed dK/dV loop ----------------------------------------------------------

DST = "dsT = pT * (dpT - delta[None, :])"
EXP2T = "pT = tl.exp2(sT * qk_scale - lse[None, :])"
MASKT = "keep = keep & (queries[None, :] >= offs_kv[:, None])"
Q_LOAD = "q = tl.load(Q + queries[:, None] * stride_qn + offs_d[None, :], mask=in_range, other=0.0)"


@mistakes(
    ("ln 2 inside the loop", [(DST, f"{DST} * {LN2}")], "dK is wrong .*dS multiplied by ln 2 inside the loop"),
    ("log2 e inside the loop", [(DST, f"{DST} / {LN2}")], re.escape("dS multiplied by log2(e)")),
    ("qk_scale inside the loop", [(DST, f"{DST} * qk_scale")], "dS multiplied by qk_scale"),
    ("no qk_scale", [(EXP2T, "pT = tl.exp2(sT - lse[None, :])")], "dK and dV are wrong .*without qk_scale"),
    ("exp", [(EXP2T, "pT = tl.exp(sT * qk_scale - lse[None, :])")], "exp instead of exp2"),
    ("no Delta", [(DST, "dsT = pT * dpT")], "forgot Delta"),
    ("Delta of the tile", [(DST, "dsT = pT * (dpT - tl.sum(pT * dpT, 0)[None, :])")],
     "Delta summed over this tile"),
    ("LSE and Delta swapped", [("lse = tl.load(LSE + queries", "lse = tl.load(Delta + queries"),
                               ("delta = tl.load(Delta + queries", "delta = tl.load(LSE + queries")],
     "LSE and Delta swapped"),
    ("no mask", [(MASKT, "keep = keep")], "no causal mask"),
    ("mask the wrong way round", [(MASKT, MASKT.replace(">=", "<="))], "the wrong way round"),
    ("mask drops the diagonal", [(MASKT, MASKT.replace(">=", ">"))], "drops the diagonal"),
    ("ln 2 and the mask the wrong way round", [(DST, f"{DST} * {LN2}"), (MASKT, MASKT.replace(">=", "<="))],
     "two mistakes at once: dS multiplied by ln 2 .*AND the causal mask the wrong way round"),
    ("load past the last query", [(Q_LOAD, Q_LOAD.replace(", mask=in_range, other=0.0", ""))],
     "dK has NaN .*without a mask"),
    ("dV slightly off", [("dv += tl.dot(pT, do)", "dv += tl.dot(pT * 1.01, do)")], "dV .*is wrong at"),
)
def test_dkdv_inner_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_dkdv_inner(solutions("07", edits).dkdv_inner)


# --- Exercise 4: the launcher -------------------------------------------------------------------------

PRE = "backward.attn_bwd_preprocess[(triton.cdiv(n_q, BLOCK_ROWS), heads, batch)]("
DKDV_ARGS = "*q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), *rest"


@mistakes(
    ("Delta missing", [("delta = torch.empty(", "delta = torch.zeros("), (PRE, "(lambda *args, **kwargs: None)(")],
     "Delta is missing"),
    ("Delta from O twice", [("o, do, delta, *o.stride(), *do.stride()", "o, o, delta, *o.stride(), *o.stride()")],
     re.escape("Delta is rowsum(O * O)")),
    ("dK/dV grid over query blocks", [("attn_bwd_dkdv[(triton.cdiv(n_kv, BLOCK_KV)", "attn_bwd_dkdv[(triton.cdiv(n_q, BLOCK_KV)")],
     "dK and dV are right for positions 0..31 and wrong from 32 on .*one program per key block"),
    ("dQ grid over key blocks", [("attn_bwd_dq[(triton.cdiv(n_q, BLOCK_Q)", "attn_bwd_dq[(triton.cdiv(n_kv, BLOCK_Q)")],
     "dQ is right for positions 0..31 and wrong from 32 on .*one program per query block"),
    ("scale twice", [("return dq, dk, dv", "return dq * scale, dk * scale, dv")], "the scale is applied twice"),
    ("qk_scale without log2 e", [("scale * LOG2E, 1, 0, 0", "scale, 1, 0, 0")], "the exponent factor is `scale`"),
    ("scale's default forgotten", [("scale = 1.0 / math.sqrt(head_dim) if scale is None else scale",
                                    "scale = 1.0 if scale is None else scale")], "the default scale is 1/sqrt"),
    ("V's strides taken from K", [(DKDV_ARGS, DKDV_ARGS.replace("*v.stride()", "*k.stride()"))],
     "right on contiguous tensors, wrong on non-contiguous views"),
    ("dQ in float32", [("dq, dk, dv = torch.empty_like(q),", "dq, dk, dv = torch.empty_like(q, dtype=torch.float32),")],
     "dq is torch.float32 for torch.float16 inputs"),
    ("the package's launcher", [("    return dq, dk, dv\n", "    return backward.attention_backward(q, k, v, o, lse2, do, is_causal, scale)\n")],
     "uses flashattn.kernels.backward.attention_backward"),
)
def test_backward_launcher_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_my_attention_backward(solutions("07", edits).my_attention_backward)
