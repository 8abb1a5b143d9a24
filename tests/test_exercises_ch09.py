"""The checkers of chapter 09 fail plausible mistakes (each one the solution with a named edit) with
a message that names the mistake. (tests/test_exercise_checks.py runs every solution and stub.)"""
import re

import pytest

from flashattn.course import exercises as ex

from exercise_cases import mistakes  # tests/exercise_cases.py

# --- Exercise 1: FLOPs and minimal bytes ------------------------------------------------------------

COST = "return flops, batch * heads * (tensor_bytes + 4 * n_q)"


@mistakes(
    ("causal not halved", [("flops *= 0.5", "flops *= 1")], "WITHOUT the causal halving"),
    ("backward not 2.5x", [("flops *= 2.5", "flops *= 1")], "2.5x the forward"),
    ("a multiply-add as 1 FLOP", [("flops = 4 * batch", "flops = 2 * batch")], "each multiply-add is 2 FLOPs"),
    ("causal bytes halved", [(COST, COST + " / (2 if causal else 1)")], "halves the FLOPs, not the bytes"),
    ("4 bytes per element", [("e = torch.empty((), dtype=dtype).element_size()", "e = 4")],
     "assumes 4 bytes per element"),
    ("no LSE", [("(tensor_bytes + 4 * n_q)", "(tensor_bytes)")], "the LSE is missing"),
    ("backward as forward", [("tensor_bytes = (4 * n_q + 4 * n_kv)", "tensor_bytes = (2 * n_q + 2 * n_kv)")],
     "forward's traffic"),
    ("not a tuple", [(COST, "return 1.0")], "should return a tuple"),
    ("hard-coded", [(COST, "return 2.2e12, 1.07e9")], "FLOPs"),  # the reference setting only
)
def test_attention_cost_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=re.escape(message)):
        ex.check_attention_cost(solutions("09", edits).attention_cost)


# --- Exercise 2: the resources of a configuration ---------------------------------------------------

def test_estimate_resources_names_what_does_not_fit(solutions, capsys):
    ex.check_estimate_resources(solutions("09").estimate_resources)
    assert "over the register limit" in capsys.readouterr().out


RESOURCES = "return values / (num_warps * 32), smem"


@mistakes(
    ("head dim not padded", [("block_d = max(16, 1 << (head_dim - 1).bit_length())", "block_d = head_dim")],
     "the kernels pad the head dim"),
    ("dK/dV resident swapped", [("resident, streamed = block_kv, block_q", "resident, streamed = block_q, block_kv")],
     "the KEY tile is resident"),
    ("one accumulator", [('"bwd_dkdv": (2, 2), "bwd_dq": (1, 2)', '"bwd_dkdv": (1, 1), "bwd_dq": (1, 1)')],
     "accumulates two tiles"),
    ("per warp", [(RESOURCES, "return values / num_warps, smem")], "that is per warp"),
    ("one tile per stage", [("num_stages * 2 * streamed", "num_stages * streamed")], "TWO streamed tiles"),
    ("float32 tiles", [("* block_d * element_size", "* block_d * 4")], "stored in the input dtype"),
    ("hard-coded", [(RESOURCES, "return 96.0, 131072")], "expected"),  # the tuned forward at D 128, bf16
)
def test_estimate_resources_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=re.escape(message)):
        ex.check_estimate_resources(solutions("09", edits).estimate_resources)


# --- Exercise 3: choosing a configuration -----------------------------------------------------------

def test_choose_config_picks_the_measured_winner(solutions):
    # For 16-bit inputs at head dim 128 the rule picks the forward's measured winner on the H200.
    choose_config = solutions("09").choose_config
    assert choose_config("fwd", 128, 2) == dict(BLOCK_Q=128, BLOCK_KV=64, num_warps=8, num_stages=3)


def fixed(config):
    """choose_config returning ``config`` (source text) whatever it is asked."""
    return [("return best[1]", f"return {config}")]


@mistakes(
    ("too much shared memory", fixed("dict(BLOCK_Q=128, BLOCK_KV=64, num_warps=8, num_stages=3)"), "shared memory"),
    ("too many registers", fixed("dict(BLOCK_Q=128, BLOCK_KV=128, num_warps=4, num_stages=1)"), "registers"),
    ("too small", fixed("dict(BLOCK_Q=16, BLOCK_KV=16, num_warps=4, num_stages=2)"), "only 16 x 16"),
    ("dK/dV steps do not fit", fixed('dict(BLOCK_Q=128, BLOCK_KV=64, num_warps=4, num_stages=2) '
                                     'if kernel == "bwd_dkdv" else best[1]'), "BLOCK_Q must divide BLOCK_KV"),
    ("not a power of two", fixed("dict(BLOCK_Q=100, BLOCK_KV=64, num_warps=4, num_stages=2)"), "powers of two"),
    ("6 warps", fixed("dict(BLOCK_Q=64, BLOCK_KV=64, num_warps=6, num_stages=2)"), "num_warps must be 4 or 8"),
    ("keys missing", fixed("dict(BLOCK_Q=64, BLOCK_KV=64)"), "missing"),
    ("a tuple", fixed("(64, 64, 4, 2)"), "should return a dict"),
)
def test_choose_config_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=re.escape(message)):
        ex.check_choose_config(solutions("09", edits).choose_config)


# --- Exercise 2: two tile sizes, predicted from the compiled code ----------------------------------------

PER_SCORE = 'return row["num_warps"] * row["loop"] / (row["BLOCK_Q"] * row["BLOCK_KV"])'


@mistakes(
    ("inverted", [("return per_score(small) / per_score(large)", "return per_score(large) / per_score(small)")],
     "it is the large tiles' time over the small tiles'"),
    ("no warps", [(PER_SCORE, 'return row["loop"] / (row["BLOCK_Q"] * row["BLOCK_KV"])')], "the warps are missing"),
    ("no tile", [(PER_SCORE, 'return row["num_warps"] * row["loop"]')], "the tiles' sizes are missing"),
    ("rows only", [(PER_SCORE, 'return row["num_warps"] * row["loop"] / row["BLOCK_Q"]')], "only BLOCK_Q counts here"),
    ("keys only", [(PER_SCORE, 'return row["num_warps"] * row["loop"] / row["BLOCK_KV"]')], "only BLOCK_KV counts here"),
    ("matrix instructions", [(PER_SCORE, 'return row["num_warps"] * (row["HMMA"] + row["HGMMA"]) / '
                                         '(row["BLOCK_Q"] * row["BLOCK_KV"])')], "counts the matrix instructions only"),
    ("a constant", [("return per_score(small) / per_score(large)", "return 6.0")], "expected 1.467"),
    ("not a number", [("return per_score(small) / per_score(large)", "return 'six'")], "should be a number"),
)
def test_tile_ratio_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=re.escape(message)):
        ex.check_tile_ratio(solutions("09", edits).predict_ratio)
