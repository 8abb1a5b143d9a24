"""The checkers of chapters 03 (tiling and causal blocks) and 04 (the forward kernel) pass the
notebooks' solutions, and fail the student stubs and plausible mistakes (each one the solution with a
named edit, kernels included) with a message that names the problem."""
import numpy as np
import pytest

from flashattn import exercises as ex
from flashattn import traversal
from flashattn.exercises import ch03_04

EXERCISES = [  # chapter, grade_id, the learner's function, its checker
    ("03", "ch03-classify", "classify", ex.check_classify_tiles),
    ("03", "ch03-tiled-attention", "tiled_attention", ex.check_tiled_attention),
    ("04", "ch04-kv-stage-bounds", "kv_stage_bounds", ex.check_kv_stage_bounds),
    ("04", "ch04-fwd-inner", "fwd_inner", ex.check_fwd_inner),
]


@pytest.fixture(autouse=True)
def no_figures(monkeypatch):
    monkeypatch.setattr("matplotlib.pyplot.show", lambda *a, **k: None)


@pytest.mark.parametrize("chapter, grade_id, name, check", EXERCISES, ids=[e[1] for e in EXERCISES])
def test_solution_passes(solutions, capsys, chapter, grade_id, name, check):
    check(getattr(solutions(chapter), name))
    assert "PASSED" in capsys.readouterr().out


@pytest.mark.parametrize("chapter, grade_id, name, check", EXERCISES, ids=[e[1] for e in EXERCISES])
def test_stub_is_not_implemented(solutions, chapter, grade_id, name, check):
    with pytest.raises(ex.ExerciseError, match="not implemented yet"):
        check(getattr(solutions(chapter, stub=grade_id), name))


def mistakes(*cases):
    """pytest parameters (edits, message), one per named mistake."""
    return pytest.mark.parametrize("edits, message", [pytest.param(edits, message, id=name)
                                                      for name, edits, message in cases])


def test_definition_is_the_kernels_map():
    """The checker's brute-force definition and flashattn.traversal agree on every case it uses."""
    for n_q, n_kv, bq, bkv, causal in ch03_04._classify_cases():
        want, _ = ch03_04._tile_kinds_by_definition(n_q, n_kv, bq, bkv, causal)
        np.testing.assert_array_equal(traversal.classify_blocks(n_q, n_kv, bq, bkv, causal), want)


# --- Chapter 03 -------------------------------------------------------------------------------------

@mistakes(
    ("ragged end forgotten", [("inside = last_k < n_kv", "inside = True")], "past the end"),
    # only the real query rows of the last block considered (the kernel computes all BLOCK_Q rows)
    ("padding rows ignored", [("last_q = b * block_q, b * block_q + block_q - 1",
                               "last_q = b * block_q, min(b * block_q + block_q, n_q) - 1")], "padding row"),
    ("causal ignored", [("if is_causal:\n                every", "if False:\n                every")], "is wrong at"),
    ("a row short", [("return kinds", "return kinds[:-1]")], "returned shape"),
    ("other values", [("return kinds", "return kinds * 2")], "use only 0"),
)
def test_classify_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_classify_tiles(solutions("03", edits).classify)


@mistakes(
    ("no alpha", [("acc = acc * alpha[:, None] + p @ v[cols]", "acc = acc + p @ v[cols]")],
     "not rescaled by alpha"),
    ("no mask", [("if kinds[b, c] == MASKED and is_causal:", "if False:")], "causal mask is missing"),
    ("skipped tiles computed", [("if kinds[b, c] == SKIPPED:", "if False:"),
                                ("if kinds[b, c] == MASKED and is_causal:", "if kinds[b, c] != FULL and is_causal:")],
     "n_tiles is"),
    ("LSE in base 2", [("lse[rows] = m + torch.log(l)", "lse[rows] = (m + torch.log(l)) / math.log(2)")], "lse"),
    ("the course's own", [("    return out, lse, n_tiles", "    out, lse = reference.tiled_forward(q, k, v, is_causal, "
                           "block_q=block_q, block_kv=block_kv)\n    return out, lse, n_tiles")],
     "uses flashattn.reference.tiled_forward"),
)
def test_tiled_attention_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_tiled_attention(solutions("03", edits).tiled_attention)


# --- Chapter 04 -------------------------------------------------------------------------------------

CAUSAL_FULL_END = "kv_full_end = min(q_start, n_kv) // block_kv * block_kv"
FULL_END = "kv_full_end = n_kv // block_kv * block_kv"


@mistakes(
    ("causal keys not skipped", [("kv_end = min(q_start + block_q, n_kv)", "kv_end = n_kv")], "kv_end"),
    ("past the end", [("kv_end = min(q_start + block_q, n_kv)", "kv_end = q_start + block_q")], "do not exist"),
    ("not whole tiles", [(CAUSAL_FULL_END, "kv_full_end = min(q_start, n_kv)"), (FULL_END, "kv_full_end = n_kv")],
     "multiple of BLOCK_KV"),
    ("everything masked", [(CAUSAL_FULL_END, "kv_full_end = 0"), (FULL_END, "kv_full_end = 0")],
     "masks more than needed"),
    ("diagonal unmasked", [(CAUSAL_FULL_END, "kv_full_end = (q_start + block_q) // block_kv * block_kv")],
     "needs a mask"),
)
def test_kv_stage_bounds_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_kv_stage_bounds(solutions("04", edits).kv_stage_bounds)


@mistakes(
    ("no alpha", [("acc = acc * alpha[:, None] + tl.dot(", "acc = acc + tl.dot(")], "not rescaled by alpha"),
    ("keys past the end not hidden", [("visible = offs_kv[None, :] < n_kv", "visible = offs_kv[None, :] >= 0")],
     "past the end"),
    ("the course's own loader", [("k = tl.load(k_ptrs)\n", "k = tiles.load_tile(k_ptrs)\n")], "uses flashattn.tiles.load_tile"),
    ("tl.softmax", [("p = tl.exp2(s - m_new[:, None])", "p = tl.softmax(s)")], "calls triton.language.softmax"),
    ("no causal mask", [("visible = visible & (offs_q[:, None] >= offs_kv[None, :])", "visible = visible")],
     "causal mask is missing"),
)
def test_fwd_inner_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_fwd_inner(solutions("04", edits).fwd_inner)
