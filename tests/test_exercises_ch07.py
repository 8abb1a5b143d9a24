"""The checkers of chapter 07 fail plausible mistakes (each one the solution with a named edit) with
a message that names the mistake: for the Delta kernel; for the two inner loops, every slip the
checkers model alone and the likeliest pairs, each written into both loops; for the two whole
kernels around them, each mistake their models name; for the launcher, its mistakes, and any of
exercises 1 to 3 left a stub. (tests/test_exercise_checks.py runs every solution and stub.)"""
import re
from types import SimpleNamespace

import pytest

from flashattn.course import exercises as ex

from exercise_cases import mistakes  # tests/exercise_cases.py

LN2 = "0.6931471805599453"


@pytest.fixture(autouse=True)
def no_figures(monkeypatch):
    monkeypatch.setattr("matplotlib.pyplot.show", lambda *a, **k: None)


# --- Exercise 1: the Delta kernel -------------------------------------------------------------------

DO_LOAD = "do = tl.load(dO + rows[:, None] * stride_don + cols[None, :] * stride_dod, mask=inside, other=0.0)"


@mistakes(
    ("store not masked", [("tl.store(Delta + rows, delta, mask=rows < n_q)", "tl.store(Delta + rows, delta)")],
     "wrote past the end of Delta"),
    ("no column mask", [("inside = (rows[:, None] < n_q) & (cols[None, :] < HEAD_DIM)", "inside = rows[:, None] < n_q")],
     "Delta has NaN"),
    ("summed in float16", [("tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)", "tl.sum(o * do, axis=1)")],
     "lost precision"),
    ("O twice", [(DO_LOAD, DO_LOAD.replace("dO + rows[:, None] * stride_don + cols[None, :] * stride_dod",
                                           "O + rows[:, None] * stride_on + cols[None, :] * stride_od"))],
     re.escape("rowsum(O * O)")),
    ("dO twice", [("o = tl.load(O + rows[:, None] * stride_on + cols[None, :] * stride_od",
                   "o = tl.load(dO + rows[:, None] * stride_don + cols[None, :] * stride_dod")],
     re.escape("rowsum(dO * dO)")),
    ("O's strides for dO", [(DO_LOAD, DO_LOAD.replace("stride_don", "stride_on").replace("stride_dod", "stride_od"))],
     "its own four strides"),
    ("no head offset", [("O += batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh",
                         "O += batch.to(tl.int64) * stride_ob")], "right for head 0 of batch 0 and wrong for head 1"),
    ("Delta without the batch", [("    Delta += (batch.to(tl.int64) * n_heads + head) * n_q\n    rows",
                                  "    Delta += head * n_q\n    rows")], "batch 1 of Delta was never written"),
)
def test_delta_kernel_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_delta_kernel(solutions("07", edits).delta_kernel)


# --- Exercises 2a and 3a: the two loops, one table of slips ------------------------------------------

#: The lines of each loop that the slips below rewrite, and what each becomes.
LOOPS = {
    "dq": SimpleNamespace(
        check=lambda m: ex.check_dq_inner(m.dq_inner),
        ds="ds = p * (dp - delta[:, None])", no_delta="ds = p * dp", tile_delta="ds = p * (dp - tl.sum(p * dp, 1)[:, None])",
        exp2="p = tl.exp2(s * qk_scale - lse[:, None])",
        where='s = tl.where(keep, s, float("-inf"))', no_mask="s = s",
        mask="keep = keep & (keys[None, :] <= offs_q[:, None])", reversed=">=", strict="<",
        swapped=[("p = tl.exp2(s * qk_scale - lse[:, None])", "p = tl.exp2(s * qk_scale - delta[:, None])"),
                 ("ds = p * (dp - delta[:, None])", "ds = p * (dp - lse[:, None])")],
        load=("k = tl.load(K + keys[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=in_range, other=0.0)",
              "k = tl.load(K + keys[:, None] * stride_kn + offs_d[None, :] * stride_kd)"),
        strides=("V + keys[:, None] * stride_vn + offs_d[None, :] * stride_vd",
                 "V + keys[:, None] * stride_kn + offs_d[None, :] * stride_kd"),
        cast=("dq += tl.dot(ds.to(k.dtype), k)", "dq += tl.dot(ds, k)"),
        off=("dq += tl.dot(ds.to(k.dtype), k)", "dq += tl.dot((ds * 1.01).to(k.dtype), k)"), off_message="dQ .*is wrong at"),
    "dkdv": SimpleNamespace(
        check=lambda m: ex.check_dkdv_inner(m.dkdv_inner),
        ds="dsT = pT * (dpT - delta[None, :])", no_delta="dsT = pT * dpT",
        tile_delta="dsT = pT * (dpT - tl.sum(pT * dpT, 0)[None, :])",
        exp2="pT = tl.exp2(sT * qk_scale - lse[None, :])",
        where='sT = tl.where(keep, sT, float("-inf"))', no_mask="sT = sT",
        mask="keep = keep & (queries[None, :] >= offs_kv[:, None])", reversed="<=", strict=">",
        swapped=[("lse = tl.load(LSE + queries", "lse = tl.load(Delta + queries"),
                 ("delta = tl.load(Delta + queries", "delta = tl.load(LSE + queries")],
        load=("q = tl.load(Q + queries[:, None] * stride_qn + offs_d[None, :] * stride_qd, mask=in_range, other=0.0)",
              "q = tl.load(Q + queries[:, None] * stride_qn + offs_d[None, :] * stride_qd)"),
        strides=("dO + queries[:, None] * stride_don + offs_d[None, :] * stride_dod",
                 "dO + queries[:, None] * stride_qn + offs_d[None, :] * stride_qd"),
        cast=("dk += tl.dot(dsT.to(q.dtype), q)", "dk += tl.dot(dsT, q)"),
        off=("dv += tl.dot(pT.to(do.dtype), do)", "dv += tl.dot((pT * 1.01).to(do.dtype), do)"),
        off_message="dV .*is wrong at"),
}


def _mask(L, op):
    return [(L.mask, L.mask.replace(" <= " if " <= " in L.mask else " >= ", f" {op} "))]


#: (name, the edits of a loop's lines, the message: None for the loop's own), written into both loops.
SLIPS = [
    ("ln 2 inside the loop", lambda L: [(L.ds, f"{L.ds} * {LN2}")], "dS multiplied by ln 2 inside the loop"),
    ("log2 e inside the loop", lambda L: [(L.ds, f"{L.ds} / {LN2}")], re.escape("dS multiplied by log2(e)")),
    ("qk_scale inside the loop", lambda L: [(L.ds, f"{L.ds} * qk_scale")], "dS multiplied by qk_scale"),
    ("no qk_scale", lambda L: [(L.exp2, L.exp2.replace(" * qk_scale", ""))], "without qk_scale"),
    ("scale without log2 e", lambda L: [(L.exp2, L.exp2.replace("qk_scale", f"qk_scale * {LN2}"))],
     "with the softmax scale instead of qk_scale"),
    ("exp", lambda L: [(L.exp2, L.exp2.replace("tl.exp2", "tl.exp"))], "exp instead of exp2"),
    ("no Delta", lambda L: [(L.ds, L.no_delta)], "forgot Delta"),
    ("Delta of the tile", lambda L: [(L.ds, L.tile_delta)], "Delta summed over this tile"),
    ("LSE and Delta swapped", lambda L: L.swapped, "LSE and Delta swapped"),
    ("no mask", lambda L: [(L.where, L.no_mask)], "no causal mask"),
    ("mask the wrong way round", lambda L: _mask(L, L.reversed), "the wrong way round"),
    ("mask drops the diagonal", lambda L: _mask(L, L.strict), "drops the diagonal"),
    ("ln 2 and no mask", lambda L: [(L.ds, f"{L.ds} * {LN2}"), (L.where, L.no_mask)],
     "two mistakes at once: dS multiplied by ln 2 .*AND no causal mask"),
    ("exp and no Delta", lambda L: [(L.exp2, L.exp2.replace("tl.exp2", "tl.exp")), (L.ds, L.no_delta)],
     "two mistakes at once: exp instead of exp2.*AND forgot Delta"),
    ("load past the end", lambda L: [L.load], "has NaN .*without a mask"),
    ("the first tensor's strides for the second", lambda L: [L.strides], "strides unlike each other's"),
    ("float32 into tl.dot", lambda L: [L.cast], "float16 inputs .*tl.dot got a float32 tile"),
    ("slightly off", lambda L: [L.off], None),
]


@pytest.mark.parametrize("loop, edits, message", [
    pytest.param(name, edit(L), message or L.off_message, id=f"{name}-{slip}")
    for name, L in LOOPS.items() for slip, edit, message in SLIPS])
def test_loops_catch(solutions, loop, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        LOOPS[loop].check(solutions("07", edits))


# --- Exercises 2b and 3b: the kernels around the loops ------------------------------------------------

DQ_CALL = "dq = dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,\n                  "
DQ_FIRST = DQ_CALL + "offs_q, offs_d, 0, kv_full_end, n_kv, qk_scale, HEAD_DIM, BLOCK_KV, False, IS_CAUSAL)"
DQ_SECOND = DQ_CALL + "offs_q, offs_d, kv_full_end, kv_end, n_kv, qk_scale, HEAD_DIM, BLOCK_KV, True, IS_CAUSAL)"
DKDV_CALL = ("dk, dv = dkdv_inner(dk, dv, k, v, Q, dO, LSE2, Delta, stride_qn, stride_qd, stride_don, stride_dod,\n"
             "                        offs_kv, offs_d, ")
DKDV_DIAGONAL = DKDV_CALL + "q_lo, tl.minimum(q_full_lo, n_q), n_q, qk_scale,\n                        HEAD_DIM, BLOCK_Q, True, IS_CAUSAL)"
DKDV_FULL = DKDV_CALL + "q_full_lo, q_full_hi, n_q, qk_scale, HEAD_DIM, BLOCK_Q, False, IS_CAUSAL)"
DKDV_TAIL = DKDV_CALL + "q_full_hi, n_q, n_q, qk_scale, HEAD_DIM, BLOCK_Q, True, IS_CAUSAL)"
DK_SCALE = "    dk *= scale                                          # dK carries the scale once; dV none"
ONE_LSE = "    LSE2 += (batch.to(tl.int64) * n_heads + head) * n_q"


@pytest.mark.parametrize("kernel, edits, message", [pytest.param(*case[1:], id=case[0]) for case in [
    ("dq-never calls the loop", "dq", [(DQ_FIRST, "pass"), (DQ_SECOND, "pass")], "never runs your dq_inner"),
    ("dq-second stage unmasked", "dq", [(DQ_SECOND, DQ_SECOND.replace("True, IS_CAUSAL", "False, IS_CAUSAL"))],
     "diagonal tiles were computed without the causal mask"),
    ("dq-first stage late", "dq", [(DQ_FIRST, DQ_FIRST.replace("offs_d, 0, kv_full_end", "offs_d, kv_full_end, kv_full_end"))],
     "does not start at key 0"),
    ("dq-second stage missing", "dq", [(DQ_SECOND, DQ_SECOND.replace("kv_full_end, kv_end", "kv_end, kv_end"))],
     re.escape("the keys [kv_full_end, kv_end) are missing")),
    ("dq-no scale", "dq", [("    dq *= scale ", "    dq *= 1.0 ")], "dQ is missing the factor scale"),
    ("dq-scale twice", "dq", [("    dq *= scale ", "    dq *= scale * scale ")], "dQ carries the scale twice"),
    ("dq-always causal", "dq", [("    if IS_CAUSAL:                                        # query i sees",
                                 "    if True:                                        # query i sees"),
                                (DQ_FIRST, DQ_FIRST.replace("False, IS_CAUSAL", "False, True")),
                                (DQ_SECOND, DQ_SECOND.replace("True, IS_CAUSAL", "True, True"))],
     "those of causal attention: follow IS_CAUSAL"),
    ("dq-causal order off by one", "dq", [("q_block = tl.num_programs(0) - 1 - q_block",
                                           "q_block = tl.num_programs(0) - q_block")],
     "left row 0 of head 0, batch 0 of dQ unwritten.*reverse order"),
    ("dq-store not masked", "dq", [("dq.to(dQ.dtype.element_ty),\n             mask=in_tile)",
                                    "dq.to(dQ.dtype.element_ty))")], "wrote outside dQ"),
    ("dq-no column mask", "dq", [("* stride_qd, mask=in_tile, other=0.0)",
                                  "* stride_qd, mask=offs_q[:, None] < n_q, other=0.0)")], "dQ of my_attn_bwd_dq has NaN"),
    ("dq-LSE without the batch", "dq", [("stride_dqh\n" + ONE_LSE, "stride_dqh\n    LSE2 += head * n_q")],
     "head 0 of batch 1 .*head 0 of batch 0 right"),
    ("dq-column strides ignored", "dq", [("Q + offs_q[:, None] * stride_qn + offs_d[None, :] * stride_qd",
                                          "Q + offs_q[:, None] * stride_qn + offs_d[None, :]")],
     "were right for contiguous inputs: use each tensor's own strides"),
    ("dkdv-never calls the loop", "dkdv", [(DKDV_DIAGONAL, "pass"), (DKDV_FULL, "pass"), (DKDV_TAIL, "pass")],
     "never runs your dkdv_inner"),
    ("dkdv-diagonal unmasked", "dkdv", [(DKDV_DIAGONAL, DKDV_DIAGONAL.replace("True, IS_CAUSAL", "False, IS_CAUSAL"))],
     "diagonal tiles were computed without the causal mask"),
    ("dkdv-diagonal never visited", "dkdv", [(DKDV_DIAGONAL, DKDV_DIAGONAL.replace("q_lo, tl.minimum", "tl.minimum(q_full_lo, n_q), tl.minimum"))],
     "diagonal queries .* are never visited"),
    ("dkdv-tail never visited", "dkdv", [(DKDV_TAIL, DKDV_TAIL.replace("q_full_hi, n_q, n_q", "q_full_hi, q_full_hi, n_q"))],
     "the ragged last query block is never visited"),
    ("dkdv-queries skipped without the mask", "dkdv", [("        q_lo = 0\n        q_full_lo = 0",
                                                       "        q_lo = kv_start\n        q_full_lo = kv_start")],
     "queries start at 0 for every key block"),
    ("dkdv-no scale", "dkdv", [(DK_SCALE, "    dk *= 1.0")], "dK is missing the factor scale"),
    ("dkdv-dV scaled", "dkdv", [(DK_SCALE, "    dk *= scale\n    dv *= scale")], "dV was multiplied by scale"),
    ("dkdv-key block off by one", "dkdv", [("kv_start = kv_block * BLOCK_KV", "kv_start = (kv_block + 1) * BLOCK_KV")],
     "left row 0 of head 0, batch 0 of dK unwritten"),
    ("dkdv-store not masked", "dkdv", [("dv.to(dV.dtype.element_ty),\n             mask=in_tile)",
                                        "dv.to(dV.dtype.element_ty))")], "wrote outside dV"),
    ("dkdv-Delta without the head", "dkdv", [("stride_dvh\n" + ONE_LSE + "\n    Delta += (batch.to(tl.int64) * n_heads + head) * n_q",
                                              "stride_dvh\n" + ONE_LSE + "\n    Delta += batch.to(tl.int64) * n_heads * n_q")],
     "head 1 of batch 0 .*head 0 of batch 0 right"),
    ("dkdv-column strides ignored", "dkdv", [("V + offs_kv[:, None] * stride_vn + offs_d[None, :] * stride_vd",
                                              "V + offs_kv[:, None] * stride_vn + offs_d[None, :]")],
     "were right for contiguous inputs: use each tensor's own strides"),
]])
def test_kernels_catch(solutions, kernel, edits, message):
    module = solutions("07", edits)
    with pytest.raises(ex.ExerciseError, match=message):
        if kernel == "dq":
            ex.check_my_attn_bwd_dq(module.my_attn_bwd_dq)
        else:
            ex.check_my_attn_bwd_dkdv(module.my_attn_bwd_dkdv)


# --- Exercise 4: the launcher, and the exercises it runs ------------------------------------------------

DELTA_LAUNCH = "delta_kernel[(triton.cdiv(n_q, 64), heads, batch)]("
DKDV_ARGS = "*q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), *rest"


@mistakes(
    ("Delta never computed", [(DELTA_LAUNCH, "(lambda *args, **kwargs: None)(")], "never runs your delta_kernel"),
    ("Delta written elsewhere", [("delta = torch.empty(", "delta = torch.zeros("),
                                 ("o, do, delta, *o.stride()", "o, do, torch.empty_like(delta), *o.stride()")],
     "Delta is missing"),
    ("Delta from O twice", [("o, do, delta, *o.stride(), *do.stride()", "o, o, delta, *o.stride(), *o.stride()")],
     re.escape("Delta is rowsum(O * O)")),
    ("dK/dV grid over query blocks", [("my_attn_bwd_dkdv[(triton.cdiv(n_kv, 32)", "my_attn_bwd_dkdv[(triton.cdiv(n_q, 32)")],
     "dK and dV are right for positions 0..31 and wrong from 32 on .*one program per key block"),
    ("dQ grid over key blocks", [("my_attn_bwd_dq[(triton.cdiv(n_q, 32)", "my_attn_bwd_dq[(triton.cdiv(n_kv, 32)")],
     "dQ is right for positions 0..31 and wrong from 32 on .*one program per query block"),
    ("scale twice", [("return dq, dk, dv", "return dq * scale, dk * scale, dv")], "the scale is applied twice"),
    ("qk_scale without log2 e", [("scale * math.log2(math.e))", "scale)")], "the exponent factor is `scale`"),
    ("scale's default forgotten", [("scale = 1.0 / math.sqrt(head_dim) if scale is None else scale",
                                    "scale = 1.0 if scale is None else scale")], "the default scale is 1/sqrt"),
    ("V's strides taken from K", [(DKDV_ARGS, DKDV_ARGS.replace("*v.stride()", "*k.stride()"))],
     "right on contiguous tensors, wrong on non-contiguous views"),
    ("dQ in float32", [("dq, dk, dv = torch.empty_like(q),", "dq, dk, dv = torch.empty_like(q, dtype=torch.float32),")],
     "dq is torch.float32 for torch.float16 inputs"),
    ("the package's dQ kernel", [("my_attn_bwd_dq[(triton.cdiv(n_q, 32), heads, batch)](",
                                  "backward.attn_bwd_dq[(triton.cdiv(n_q, 32), heads, batch)](")],
     "never runs your my_attn_bwd_dq .*not the package's"),
    ("the package's launcher", [("    return dq, dk, dv\n",
                                 "    return backward.attention_backward(q, k, v, o, lse2, do, is_causal, scale)\n")],
     "uses flashattn.kernels.backward.attention_backward"),
)
def test_backward_launcher_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_my_attention_backward(solutions("07", edits).my_attention_backward)


def test_backward_launcher_names_no_grid_error_for_a_row_wrong_at_a_block_boundary(solutions):
    """dK wrong at position 16 alone (a multiple of 16, the positions past it right) is not a grid
    that stops early, which leaves every position past its last block wrong."""
    edits = [("    return dq, dk, dv\n", "    dk[:, :, 16] += 1.0\n    return dq, dk, dv\n")]
    with pytest.raises(ex.ExerciseError) as error:
        ex.check_my_attention_backward(solutions("07", edits).my_attention_backward)
    said = str(error.value)
    assert "grid" not in said and "wrong from 16 on" not in said, said
    assert said.startswith("dK of B=1, H=2, N_q=19, N_kv=27"), said


def test_backward_launcher_compares_its_rerun_on_contiguous_tensors(solutions):
    """A launcher that fails on views and runs on contiguous copies of them, wrongly (its dQ grid has
    no batch axis: right for B = 1, wrong for B = 2), is not called right on contiguous tensors: the
    rerun's gradients are compared, and what is wrong with them is said."""
    edits = [("    delta = torch.empty(", "    q.view(-1)   # fails on a transposed view\n    delta = torch.empty("),
             ("my_attn_bwd_dq[(triton.cdiv(n_q, 32), heads, batch)](", "my_attn_bwd_dq[(triton.cdiv(n_q, 32), heads, 1)](")]
    with pytest.raises(ex.ExerciseError) as error:
        ex.check_my_attention_backward(solutions("07", edits).my_attention_backward)
    said = str(error.value)
    assert "right on contiguous tensors" not in said, said
    assert "B=2, H=3, N_q=19, N_kv=27" in said and "contiguous copies of the views" in said, said


@pytest.mark.parametrize("stub, said", [("ch07-delta-kernel", "delta_kernel (exercise 1)"),
                                        ("ch07-dq-inner", "dq_inner (exercise 2a)"),
                                        ("ch07-dq-kernel", "my_attn_bwd_dq (exercise 2b)"),
                                        ("ch07-dkdv-inner", "dkdv_inner (exercise 3a)"),
                                        ("ch07-dkdv-kernel", "my_attn_bwd_dkdv (exercise 3b)")])
def test_backward_launcher_fails_while_an_exercise_is_a_stub(solutions, stub, said):
    """The launcher runs the learner's whole backward: its check cannot pass while any piece is a stub."""
    module = solutions("07", stub=stub)
    with pytest.raises(ex.ExerciseError, match=re.escape(f"my_attention_backward runs {said}, which is not implemented")):
        ex.check_my_attention_backward(module.my_attention_backward)


@pytest.mark.parametrize("stub, check, said", [
    ("ch07-dq-inner", lambda m: ex.check_my_attn_bwd_dq(m.my_attn_bwd_dq), "my_attn_bwd_dq runs dq_inner (exercise 2a)"),
    ("ch07-dkdv-inner", lambda m: ex.check_my_attn_bwd_dkdv(m.my_attn_bwd_dkdv),
     "my_attn_bwd_dkdv runs dkdv_inner (exercise 3a)")], ids=["dq", "dkdv"])
def test_kernel_check_says_when_its_loop_is_a_stub(solutions, stub, check, said):
    with pytest.raises(ex.ExerciseError, match=re.escape(said + ", which is not implemented yet")):
        check(solutions("07", stub=stub))
