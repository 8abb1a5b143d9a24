"""The checkers of chapter 13 fail plausible mistakes (each one the solution with a named edit) with
a message that names the mistake. (tests/test_exercise_checks.py runs the solution and the stub.)"""
import re

import pytest

from exercise_cases import mistakes
from flashattn.course import exercises as ex

MIRROR = "first, second = rank, 2 * world - 1 - rank"
CHUNKS = """    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk),
                      torch.arange(second * chunk, (second + 1) * chunk)])"""


@mistakes(
    ("the mirror chunk off by one", [(MIRROR, "first, second = rank, 2 * world - rank")], "one too far"),
    ("the contiguous layout", [(CHUNKS, "    return torch.arange(rank * (n // world), (rank + 1) * (n // world))")],
     "positions of the contiguous layout"),
    ("chunks of n / world", [("chunk = n // (2 * world)", "chunk = n // world")], "the chunks are too long"),
    ("the later chunk first", [(CHUNKS, """    return torch.cat([torch.arange(second * chunk, (second + 1) * chunk),
                      torch.arange(first * chunk, (first + 1) * chunk)])""")], "in the wrong order"),
    ("one chunk only", [(CHUNKS, "    return torch.arange(first * chunk, (first + 1) * chunk)")], "only chunk r"),
    ("a number, not positions", [(CHUNKS, "    return chunk")], "should return a 1-D tensor or a list of ints"),
    ("positions off by one",
     [(CHUNKS, CHUNKS.replace("torch.arange(first * chunk,", "torch.arange(first * chunk + 1,"))],
     "returned 3 positions: each of the 1 rank(s) holds n / world = 4"),
)
def test_zigzag_positions_mistakes_are_named(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=re.escape(message)):
        ex.check_zigzag_positions(solutions("13", edits).zigzag_positions)


OWN = "return [((0, 2), (0, 2), True)]"
BEFORE = "return [((0, 2), (0, 1), False)]"
AFTER = "return [((1, 2), (0, 2), False)]"


@mistakes(
    ("step 0 without the mask", [(OWN, "return [((0, 2), (0, 2), False)]")],
     "computes a score the causal mask hides: query position 0 against key position 1 (with chunks of 3 "
     "positions: query 0 of the rank's shard, key 1 of the held one). At step 0 (source == rank)"),
    ("the two cases swapped", [(BEFORE, AFTER + "  # swapped"),
                               (AFTER + "   # both", BEFORE + "   # both")],
     "computes a score the causal mask hides: query position 0 against key position 3"),
    ("every key when the source comes first", [(BEFORE, "return [((0, 2), (0, 2), False)]")],
     "computes a score the causal mask hides"),
    ("every query when the source comes later", [(AFTER, "return [((0, 2), (0, 2), False)]")],
     "When the source comes later (source > rank)"),
    ("half the keys when the source comes later", [(AFTER, "return [((1, 2), (0, 1), False)]")],
     "never computes a score the query sees"),
    ("skipping later sources, as contiguous", [(AFTER, "return []")], "never computes a score the query sees"),
    ("a block twice", [(AFTER, "return [((1, 2), (0, 2), False), ((1, 2), (1, 2), False)]")],
     "computes a score twice"),
    ("causal on a block that needs none", [(BEFORE, "return [((0, 2), (0, 1), True)]")],
     "never computes a score the query sees"),
    ("chunk indices past the shard", [(AFTER, "return [((2, 4), (0, 2), False)]")],
     "returned the block ((2, 4), (0, 2), False)"),
    ("not a list of triples", [(OWN, "return (0, 2)")], "should return a list of (q_chunks, kv_chunks, causal)"),
)
def test_zigzag_blocks_mistakes_are_named(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=re.escape(message)):
        ex.check_zigzag_blocks(solutions("13", edits).zigzag_blocks)


WEIGHTS = "w, w_t = torch.exp2(lse - m), torch.exp2(lse_t - m)"
O_NEW = "o_new = (w / safe)[..., None] * o + (w_t / safe)[..., None] * o_t.float()"
LSE_NEW = "return o_new, m + torch.log2(total)"


@mistakes(
    ("a plain mean", [(O_NEW, "o_new = (o + o_t.float()) / 2")], "weigh them by their shares"),
    ("the weights swapped", [(O_NEW, "o_new = (w_t / safe)[..., None] * o + (w / safe)[..., None] * o_t.float()")],
     "the two weights are swapped"),
    ("natural exponentials", [(WEIGHTS, "w, w_t = torch.exp(lse - m), torch.exp(lse_t - m)"),
                              (LSE_NEW, "return o_new, m + torch.log(total)")], "the weights use e**x"),
    ("natural log for the LSE", [(LSE_NEW, "return o_new, m + torch.log(total)")], "LSE' is in natural log"),
    ("the LSE without its max", [(LSE_NEW, "return o_new, torch.log2(total)")], "LSE' is missing the max"),
    ("the LSE is the max", [(LSE_NEW, "return o_new, torch.where(total > 0, m, lse)")], "the larger of the two LSE"),
    ("empty rows: -inf - (-inf)", [('m = torch.where(m == float("-inf"), torch.zeros_like(m), m)', "m = m")],
     "-inf - (-inf) = NaN"),
    ("empty rows: 0 / 0", [("safe = torch.where(total > 0, total, torch.ones_like(total))", "safe = total")],
     "-inf - (-inf) = NaN"),
    ("no max subtracted", [(WEIGHTS, "w, w_t = torch.exp2(lse), torch.exp2(lse_t)"),
                           (LSE_NEW, "return o_new, torch.log2(total)")], "overflows float32"),
    ("the running O in the block's dtype", [(LSE_NEW, "return o_new.to(o_t.dtype), m + torch.log2(total)")],
     "keep the running O in float32"),
    ("not a tuple", [(LSE_NEW, "return o_new")], "should return a tuple (o, lse)"),
    ("the lse of the block only", [(LSE_NEW, "return o_new, lse_t")], "lse is wrong"),
)
def test_merge_step_mistakes_are_named(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=re.escape(message)):
        ex.check_merge_step(solutions("13", edits).merge_step)
