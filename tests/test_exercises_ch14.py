"""The checkers of chapter 14 fail plausible mistakes (each one the solution with a named edit) with
a message that names the mistake. (tests/test_exercise_checks.py runs the solution and the stub.)"""
import re

import pytest

from exercise_cases import mistakes
from flashattn.course import exercises as ex

TANH = "t = 1.0 - 2.0 / (tl.exp(2.0 * (s / softcap)) + 1.0)"
CAPPED = "capped = softcap * t"
DCAP = "dcap = 1.0 - t * t"


@mistakes(
    ("tanh of the unscaled score", [("tl.exp(2.0 * (s / softcap))", "tl.exp(2.0 * s)")],
     "tanh of the unscaled score"),
    ("no outer multiply", [(CAPPED, "capped = t")], "the outer multiply by softcap is missing"),
    ("multiplied inside", [("tl.exp(2.0 * (s / softcap))", "tl.exp(2.0 * (s * softcap))")],
     "s is multiplied by softcap inside the tanh"),
    ("the scores unchanged", [(CAPPED, "capped = s")], "the scores came back unchanged"),
    ("another wrong cap", [(CAPPED, "capped = softcap * t + 1.0")],
     "the capped score at s ="),
    ("a tanh that overflows", [(TANH, "e = tl.exp(s / softcap)\n    t = (e - 1.0 / e) / (e + 1.0 / e)")],
     "gives NaN at s = -2000"),
    ("derivative 1 - tanh", [(DCAP, "dcap = 1.0 - t")], "the factor is 1 - tanh, not 1 - tanh**2"),
    ("derivative tanh squared", [(DCAP, "dcap = t * t")], "tanh**2 alone"),
    ("derivative of the capped score squared", [(DCAP, "dcap = 1.0 - capped * capped")],
     "squares the capped score"),
    ("derivative times softcap", [(DCAP, "dcap = softcap * (1.0 - t * t)")], "an extra factor softcap"),
    ("derivative over softcap", [(DCAP, "dcap = (1.0 - t * t) / softcap")], "an extra factor 1 / softcap"),
    ("derivative 1", [(DCAP, "dcap = 1.0 + 0.0 * t")], "the factor is 1: that is the derivative without a softcap"),
    ("another wrong derivative", [(DCAP, "dcap = 0.5 - t * t")], "the derivative factor at s ="),
)
def test_softcap_piece_mistakes_are_named(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=re.escape(message)):
        ex.check_softcap_piece(solutions("14", edits).my_softcap)


SHIFT = 'shift = n_kv - n_q if alignment == "bottom_right" else 0'
BIAS = "return -slope * abs(i + shift - j)"


@mistakes(
    ("the sign", [(BIAS, "return slope * abs(i + shift - j)")], "the sign: ALiBi subtracts slope * distance"),
    ("no shift", [(SHIFT, "shift = 0")], "bottom-right alignment must shift the query's position by n_kv - n_q"),
    ("the shift backwards", [(SHIFT, SHIFT.replace("n_kv - n_q", "n_q - n_kv"))], "the shift is backwards"),
    ("the shift under both alignments", [(SHIFT, "shift = n_kv - n_q")], "the shift applies under both alignments"),
    ("no absolute value", [(BIAS, "return -slope * (i + shift - j)")], "the distance must be absolute"),
    ("no slope", [(BIAS, "return -abs(i + shift - j)")], "the slope is missing"),
    ("not a number", [(BIAS, "return None")], "should return a number, got NoneType"),
    ("another wrong bias", [(BIAS, "return -slope * abs(i + shift - j) - 1")], "returned -1, expected 0"),
)
def test_alibi_bias_mistakes_are_named(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=re.escape(message)):
        ex.check_alibi_bias(solutions("14", edits).alibi_bias)


TOKENS = "tokens = torch.arange(n_kv)[None, :] < torch.tensor(lengths)[:, None]"
RETURN = "return tokens[:, None, None, :]"


@mistakes(
    ("inverted", [(RETURN, "return ~tokens[:, None, None, :]")], "is inverted: True marks a key that is seen"),
    ("2-D", [(RETURN, "return tokens")], "has shape (2, 5): attn_mask is 4-D"),
    ("a row per query", [(RETURN, "return tokens[:, None, None, :].expand(-1, 1, n_kv, -1)")],
     "has shape (2, 1, 5, 5): the mask is the same for every head and every query"),
    ("float", [(RETURN, "return tokens[:, None, None, :].float()")], "has dtype torch.float32"),
    ("one key too many", [(TOKENS, TOKENS.replace("] < torch", "] <= torch"))], "one key too many"),
    ("padded on the left", [(TOKENS, "tokens = torch.arange(n_kv)[None, :] >= n_kv - torch.tensor(lengths)[:, None]")],
     "pads on the left"),
    ("not a tensor", [(RETURN, "return tokens.tolist()")], "should return a tensor, got list"),
    ("another shape", [(RETURN, "return tokens[None]")], "has shape (1, 2, 5), expected (2, 1, 1, 5)"),
)
def test_key_padding_mask_mistakes_are_named(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=re.escape(message)):
        ex.check_key_padding_mask(solutions("14", edits).key_padding_mask)


# --- Exercise 4: a softcap and a mask in the learner's three loops ------------------------------------

STRIDES = "return tuple(0 if size == 1 else stride for size, stride in zip(mask.shape, mask.stride()))"
CAP = "capped, dcap = my_softcap(s * (qk_scale * 0.6931471805599453), softcap)"
TO_BASE2 = "s2 = capped * 1.4426950408889634 "
UPDATE = "m_new = tl.maximum(m_i, tl.max(s, 1))        # qk_scale is in s already\n        p = tl.exp2(s - m_new[:, None])"
DQ_DS = "ds = p * (dp - delta[:, None]) * dcap "
DKDV_DS = "dsT = pT * (dpT - delta[None, :]) * dcapT "
KEEP = 's2 = tl.where(keep != 0, s2, float("-inf"))'
READ = "keep = tl.load(Mask + rows * stride_mq + cols * stride_mk, mask=inside, other=0)"
DKDV_SCORES = "sT, dcapT = my_scores(sT, queries[None, :], offs_kv[:, None],"
OWN_STRIDES = "read each tensor through its own strides, as chapter 07's loops do"
FWD_V = "v_ptrs = V + offs_kv[:, None] * stride_vn + offs_d[None, :] * stride_vd"
DQ_V = "V + keys[:, None] * stride_vn + offs_d[None, :] * stride_vd"
DQ_K = "K + keys[:, None] * stride_kn + offs_d[None, :] * stride_kd"
DKDV_DO = "dO + queries[:, None] * stride_don + offs_d[None, :] * stride_dod"


@mistakes(
    ("strides as they are", [(STRIDES, "return tuple(mask.stride())")],
     "a dim of size 1 is broadcast, so the kernels read it with stride 0"),
    ("stride 0 where the stride is 1", [(STRIDES, "return tuple(0 if stride == 1 else stride for stride in mask.stride())")],
     "the SIZE says whether a dim is broadcast"),
    ("the cap on the base-2 score", [(CAP, "capped, dcap = my_softcap(s * qk_scale, softcap)")],
     "the cap was applied to the base-2 score s * qk_scale"),
    ("the cap on the raw score", [(CAP, "capped, dcap = my_softcap(s, softcap)")],
     "the cap was applied to the raw score q . k"),
    ("the capped score in natural units", [(TO_BASE2, "s2 = capped ")], "the capped score went to exp2 as it is"),
    ("qk_scale twice in the forward", [(UPDATE, "m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)\n"
                                                "        p = tl.exp2(s * qk_scale - m_new[:, None])")],
     "O and the LSE of my_fwd_tiles are wrong (B=1, H=2, N_q=40, N_kv=40, is_causal=False, softcap=2.0, no mask): "
     "qk_scale was applied twice"),
    ("qk_scale twice in the dQ loop", [("p = tl.exp2(s - lse[:, None]) ", "p = tl.exp2(s * qk_scale - lse[:, None]) ")],
     "dQ of my_dq_tiles is wrong (B=1, H=2, N_q=40, N_kv=40, is_causal=False, softcap=2.0, no mask): qk_scale was "
     "applied twice"),
    ("no 1 - tanh**2 in the dQ loop", [(DQ_DS, "ds = p * (dp - delta[:, None]) ")],
     "dQ of my_dq_tiles is wrong (B=1, H=2, N_q=40, N_kv=40, is_causal=False, softcap=2.0, no mask): the softcap's "
     "factor is missing from dS"),
    ("no 1 - tanh**2 in the dK/dV loop", [(DKDV_DS, "dsT = pT * (dpT - delta[None, :]) ")],
     "dK and dV of my_dkdv_tiles are wrong (B=1, H=2, N_q=40, N_kv=40, is_causal=False, softcap=2.0, no mask): the "
     "softcap's factor is missing from dS"),
    ("1 - tanh**2 on dP", [(DQ_DS, "ds = p * (dp * dcap - delta[:, None]) ")], "the softcap's factor went on dP"),
    ("the mask inverted", [(KEEP, 's2 = tl.where(keep == 0, s2, float("-inf"))')], "is the mask inverted?"),
    ("the mask read untransposed in the dK/dV loop",
     [(DKDV_SCORES, "sT, dcapT = my_scores(sT, offs_kv[:, None], queries[None, :],")],
     "the mask was read with keys and queries swapped"),
    ("the mask's rows not read through stride_mq", [(READ, READ.replace("rows * stride_mq + ", ""))],
     "though right with key-padding masks, whose rows are all the same"),
    ("a wrong softcap piece", [("dcap = 1.0 - t * t", "dcap = 1.0 - t")],
     "the factor is 1 - tanh, not 1 - tanh**2: d tanh(x) / dx = 1 - tanh(x)**2. (Exercise 1's piece"),
    # the loops as chapter 07 writes them: each tensor through its own strides, 16-bit tiles into tl.dot
    ("V read with K's strides in the forward", [(FWD_V, FWD_V.replace("_v", "_k"))],
     "O and the LSE of my_fwd_tiles are wrong (B=1, H=2, N_q=40, N_kv=40, is_causal=False, softcap=2.0, no mask), "
     "where Q, K, V and dO each have strides of their own, and right on contiguous copies of them: " + OWN_STRIDES),
    ("V read with K's strides in the dQ loop", [(DQ_V, DQ_V.replace("_v", "_k"))], "dQ of my_dq_tiles is wrong (B=1"),
    ("K's column stride taken as 1 in the dQ loop", [(DQ_K, DQ_K.replace(" * stride_kd", ""))],
     "dQ of my_dq_tiles is wrong (B=1, H=2, N_q=40, N_kv=40, is_causal=False, softcap=2.0, no mask), where Q, K, V "
     "and dO each have strides of their own, and right on contiguous copies of them: " + OWN_STRIDES),
    ("dO read with Q's strides in the dK/dV loop", [(DKDV_DO, DKDV_DO.replace("_do", "_q"))],
     "dK and dV of my_dkdv_tiles are wrong (B=1, H=2, N_q=40, N_kv=40, is_causal=False, softcap=2.0, no mask), "
     "where Q, K, V and dO each have strides of their own, and right on contiguous copies of them: " + OWN_STRIDES),
    ("dS not converted in the dQ loop", [("dq += tl.dot(ds.to(k.dtype), k)", "dq += tl.dot(ds, k)")],
     "my_dq_tiles failed on float16 inputs (B=2, H=2, N_q=37, N_kv=45, is_causal=True, softcap=5.0, a key-padding "
     "mask of lengths [45, 20], float16): tl.dot got a float32 tile and a float16 one"),
    ("P^T not converted in the dK/dV loop", [("dv += tl.dot(pT.to(do.dtype), do)", "dv += tl.dot(pT, do)")],
     "my_dkdv_tiles failed on float16 inputs"),
    ("dS^T not converted in the dK/dV loop", [("dk += tl.dot(dsT.to(q.dtype), q)", "dk += tl.dot(dsT, q)")],
     "my_dkdv_tiles failed on float16 inputs"),
)
def test_score_loops_mistakes_are_named(solutions, edits, message):
    module = solutions("14", edits)
    with pytest.raises(ex.ExerciseError, match=re.escape(message)):
        ex.check_score_loops(module.my_fwd_tiles, module.my_dq_tiles, module.my_dkdv_tiles, module.mask_strides)


def test_score_loops_need_the_softcap_piece(solutions):
    module = solutions("14", stub="ch14-softcap-piece")
    with pytest.raises(ex.ExerciseError, match=re.escape("my_softcap (Exercise 1) is not implemented yet")):
        ex.check_score_loops(module.my_fwd_tiles, module.my_dq_tiles, module.my_dkdv_tiles, module.mask_strides)
