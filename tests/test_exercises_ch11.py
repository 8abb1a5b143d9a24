"""The checkers of chapter 11 fail plausible mistakes (each one the solution with a named edit) with
a message that names the mistake. (tests/test_exercise_checks.py runs the solution and the stub.)"""
import re

import pytest

from exercise_cases import mistakes
from flashattn.course import exercises as ex

WANTED = "wanted = round(2 * n_sm / programs)"
TILES = "tiles = -(-n_seen // block_kv)"
LIMITS = "return max(1, min(wanted, tiles // 4, 64))"


@mistakes(
    ("rounding up", [(WANTED, "wanted = -(-2 * n_sm // programs)")], "rounded the aim of 4.125 splits up, to 5"),
    ("the partial tile forgotten", [(TILES, "tiles = n_seen // block_kv")], "the last, partial tile is a tile too"),
    ("no tile limit", [(LIMITS, "return max(1, min(wanted, 64))")], "a split must get at least 4 whole tiles"),
    ("no cap", [(LIMITS, "return max(1, min(wanted, tiles // 4))")], "at most 64"),
    ("0 splits", [(LIMITS, "return min(wanted, tiles // 4, 64)")], "returned 0 splits"),
    ("nothing to split", [("        return 1                                   # nothing to split",
                           "        return 0")], "with nothing to split (no program or no key), the answer is 1"),
    ("a float", [(LIMITS, "return 2 * n_sm / programs")], "should return a whole number of splits"),
)
def test_choose_num_splits_mistakes_are_named(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=re.escape(message)):
        ex.check_choose_num_splits(solutions("11", edits).choose_num_splits)


LSE_LOAD = 'mask=offs_s < num_splits, other=float("-inf"))'
SAFE_M = 'm = tl.where(m == float("-inf"), 0.0, m)'
WEIGHTS = "w = tl.exp2(lse_s - m)"
O = "o = tl.sum(o_s * w[:, None], 0) / tl.where(l > 0, l, 1.0)"
LSE = "tl.store(LSE + row, m + tl.log2(l))"
ROW = "O_PART + row * num_splits * HEAD_DIM + offs_s[:, None]"
STORE = "tl.store(O + row * HEAD_DIM + offs_d, o, mask=offs_d < HEAD_DIM)"


@mistakes(
    ("splits past num_splits read as 0", [(LSE_LOAD, "mask=offs_s < num_splits, other=0.0)")],
     "the splits past num_splits (BLOCK_S is the next power of two) were read as LSE_s = 0"),
    ("a plain mean", [(O, "o = tl.sum(o_s, 0) / num_splits")], "must be weighed by that split's share"),
    ("natural exponentials", [(WEIGHTS, "w = tl.exp(lse_s - m)"), (LSE, "tl.store(LSE + row, m + tl.log(l))")],
     "the weights use e**x"),
    ("natural log for the LSE", [(LSE, "tl.store(LSE + row, m + tl.log(l))")], "LSE is in natural log"),
    ("the LSE without its max", [(LSE, "tl.store(LSE + row, tl.log2(l))")], "LSE is missing the max"),
    ("dividing twice", [(O, O + " / tl.where(l > 0, l, 1.0)")], "divided by the sum twice"),
    ("empty rows: -inf - (-inf)", [(SAFE_M, "m = m")], "-inf - (-inf) = NaN"),
    ("empty rows: 0 / 0", [(O, "o = tl.sum(o_s * w[:, None], 0) / l")], "-inf - (-inf) = NaN"),
    ("no max subtracted", [(WEIGHTS, "w = tl.exp2(lse_s)"), (LSE, "tl.store(LSE + row, tl.log2(l))")],
     "overflows float32"),
    ("every row reads row 0's states", [(ROW, "O_PART + row * HEAD_DIM + offs_s[:, None]")],
     "O is right in row 0 and wrong in the rows after it"),
    ("the store unmasked", [(STORE, "tl.store(O + row * HEAD_DIM + offs_d, o)")], "wrote past the end of O"),
    ("the splits of O_PART unmasked", [("mask=in_tile, other=0.0)", "mask=offs_d[None, :] < HEAD_DIM, other=0.0)")],
     "were read from memory that is not this row's"),
)
def test_merge_splits_mistakes_are_named(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=re.escape(message)):
        ex.check_merge_splits(solutions("11", edits).merge_splits)
