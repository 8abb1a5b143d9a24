"""The checkers of chapter 10 fail plausible mistakes (each one the solution with a named edit) with
a message that names the mistake; the checkers' own model of the window's key range agrees with the
pairs, tile by tile. (tests/test_exercise_checks.py runs every solution and stub.)"""
import re

import numpy as np
import pytest

from flashattn.course import exercises as ex
from flashattn import plotting
from flashattn.course.exercises import ch10

from exercise_cases import mistakes  # tests/exercise_cases.py

# --- Exercise 1: the KV head of each query head -----------------------------------------------------

GROUPS = "return torch.arange(n_q_heads) // group"


@mistakes(
    ("round-robin", [(GROUPS, "return torch.arange(n_q_heads) % n_kv_heads")], "dealt out round-robin"),
    ("divided by H_kv", [(GROUPS, "return torch.arange(n_q_heads) // n_kv_heads")], "divided by H_kv"),
    ("float division", [(GROUPS, "return torch.arange(n_q_heads) / group")], "head indices are integers"),
    ("no ValueError", [("if n_q_heads % n_kv_heads != 0:", "if False:")], "raise ValueError when H_q % H_kv"),
    ("a list of one", [(GROUPS, "return torch.arange(n_q_heads)[:1] // group")], "one KV head per query head"),
)
def test_kv_head_map_mistakes(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=re.escape(message)):
        ex.check_kv_head_map(solutions("10", edits).kv_head_map)


def test_kv_head_map_refuses_flashattn(solutions):
    edits = [(GROUPS, "return torch.tensor(flashattn.course.exercises.ch10._kv_heads(n_q_heads, n_kv_heads))")]
    with pytest.raises(ex.ExerciseError, match="not to call the course's own code"):
        ex.check_kv_head_map(solutions("10", edits).kv_head_map)


# --- Exercise 2: the key range of a query block under a window ---------------------------------------

LO = "lo = 0 if left < 0 else max(first - left, 0)"
REACH = "reach = n_kv if right < 0 else right"
HI = "hi = min(last + reach + 1, n_kv)"


@mistakes(
    ("left edge off by one", [(LO, "lo = 0 if left < 0 else max(first - left + 1, 0)")], "left edge is off by one"),
    ("hi one short", [(HI, "hi = min(last + reach, n_kv)")], "hi is one key short"),
    ("lo from the last query", [(LO, "lo = 0 if left < 0 else max(last - left, 0)")],
     "lo is computed from the LAST query"),
    ("hi from the first query", [(HI, "hi = min(first + reach + 1, n_kv)")], "hi is computed from the FIRST query"),
    ("causal forgotten", [("reach = min(reach, 0)", "reach = reach")], "the causal mask is forgotten"),
    ("left and right swapped", [("left, right = window_size", "right, left = window_size")],
     "left and right are swapped"),
    ("-1 as a number", [(LO, "lo = max(first - left, 0)"), (REACH, "reach = right")], "-1 is taken as a number"),
    ("-1 as a number, left only", [(LO, "lo = max(first - left, 0)")], "-1 is taken as a number for left"),
    ("lo not on a tile", [("return lo // block_kv * block_kv, hi", "return lo, hi")],
     "lo is not the start of a key block"),
    ("not clamped", [(LO, "lo = 0 if left < 0 else first - left"), (HI, "hi = last + reach + 1")],
     "clamp lo at 0 and hi at n_kv"),
    ("always from key 0", [("return lo // block_kv * block_kv, hi", "return 0, hi")], "should be skipped"),
    ("an empty block visits a tile", [("        return lo, hi  ", "        return lo // block_kv * block_kv, hi  ")],
     "nothing should be visited"),
)
def test_window_kv_range_mistakes(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=re.escape(message)):
        ex.check_window_kv_range(solutions("10", edits).window_kv_range)


def test_window_model_is_the_tile_map():
    """The checker's right answer visits exactly the key blocks the pairs make visible, for every case
    it draws: a contiguous run from lo's block to hi's, and nothing when no pair exists."""
    for case in ch10._window_cases():
        q_start, block_q, block_kv, n_kv, window, causal = case
        kinds = plotting.window_tile_kinds(q_start + block_q, n_kv, block_q, block_kv, window, causal)[-1]
        visible = np.nonzero(kinds)[0]
        lo, hi = ch10._window_range(*case)
        if len(visible) == 0:
            assert hi <= lo, case
        else:
            assert lo % block_kv == 0 and hi <= n_kv, case
            assert list(range(lo // block_kv, -(-hi // block_kv))) == visible.tolist(), case


# --- Exercise 3: the program table of a packed batch ------------------------------------------------

LOOP = "for q0 in range(start, end, block_q):"
APPEND = "rows.append((b, q0))"


@mistakes(
    ("blocks cross sequences", [
        ("    for b in range(len(cu_seqlens) - 1):\n"
         "        start, end = int(cu_seqlens[b]), int(cu_seqlens[b + 1])   # sequence b's packed rows\n"
         "        for q0 in range(start, end, block_q):                     # cdiv(end - start, block_q) blocks\n"
         "            rows.append((b, q0))",
         "    for q0 in range(0, int(cu_seqlens[-1]), block_q):\n"
         "        rows.append((int((cu_seqlens <= q0).nonzero().max()), q0))")],
     "a block crosses from one sequence into the next"),
    ("ragged block missing", [(LOOP, "for q0 in range(start, end - (end - start) % block_q, block_q):")],
     "ragged last block"),
    ("empty sequence gets a program", [(LOOP, "for q0 in (range(start, end, block_q) or [start]):")],
     "an empty sequence (length 0) got a program"),
    ("padded grid", [(LOOP, "for q0 in range(start, start + int((cu_seqlens[1:] - cu_seqlens[:-1]).max()), block_q):")],
     "that is the padded grid"),
    ("offsets within the sequence", [(APPEND, "rows.append((b, q0 - start))")],
     "count from the start of each sequence"),
    ("starts at the next sequence", [(APPEND, "rows.append((b, q0 - start + end))")], "not cu_seqlens[b + 1]"),
    ("int64", [("dtype=torch.int32", "dtype=torch.int64")], "the table is int32"),
    ("out of order", [("return torch.tensor(rows,", "return torch.tensor(rows[::-1],")], "out of order"),
    ("not a tensor", [("return torch.tensor(rows, dtype=torch.int32).reshape(-1, 2)", "return rows")],
     "should return a torch.Tensor"),
)
def test_varlen_programs_mistakes(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=re.escape(message)):
        ex.check_varlen_programs(solutions("10", edits).varlen_programs)


# --- Exercise 4: grouped heads and a window in the learner's forward kernel -------------------------

IN_WINDOW = "return (j >= i - win_left) & (j <= i + win_right)"
KV_LO = "kv_lo = tl.maximum(q_start - win_left, 0) // BLOCK_KV * BLOCK_KV"
KV_HI = "kv_hi = tl.minimum(q_start + BLOCK_Q + win_right, n_kv) "
FULL_HI = "kv_full_hi = tl.minimum(q_start + win_right + 1, n_kv) // BLOCK_KV * BLOCK_KV"
FWD_HEAD = "kv_head = head // n_group                            # the K/V head of this query head's group"
FWD_MASK = ('my_in_window(offs_q[:, None], offs_kv[None, :], win_left, win_right)\n'
            '                ### END SOLUTION\n            s = tl.where(keep, s, float("-inf"))\n'
            '        ### BEGIN SOLUTION')


@mistakes(
    ("left edge off by one", [(IN_WINDOW, "return (j > i - win_left) & (j <= i + win_right)")],
     "my_in_window is wrong: the left edge is off by one"),
    ("right edge off by one", [(IN_WINDOW, "return (j >= i - win_left) & (j < i + win_right)")],
     "my_in_window is wrong: the right edge is off by one"),
    ("left and right swapped", [(IN_WINDOW, "return (j >= i - win_right) & (j <= i + win_left)")],
     "left and right are swapped"),
    ("kv_hi one short", [(KV_HI, "kv_hi = tl.minimum(q_start + BLOCK_Q + win_right - 1, n_kv) ")],
     "kv_hi is one key short"),
    ("kv_lo from the last query", [(KV_LO, "kv_lo = tl.maximum(q_start + BLOCK_Q - 1 - win_left, 0) // BLOCK_KV * BLOCK_KV")],
     "misses keys: the block's FIRST query"),
    ("kv_lo not on a tile", [(KV_LO, "kv_lo = tl.maximum(q_start - win_left, 0)")], "kv_lo is not the start of a tile"),
    ("full tiles to the last query's edge", [(FULL_HI, "kv_full_hi = tl.minimum(q_start + BLOCK_Q + win_right, n_kv) // BLOCK_KV * BLOCK_KV")],
     "runs without the mask, but not every query of the block sees all of it"),
    ("ranges not clamped", [("kv_full_lo = tl.minimum(kv_full_lo, kv_hi)", "kv_full_lo = kv_full_lo")],
     "the ranges overlap or run backwards"),
    ("every tile masked", [("kv_full_hi = tl.maximum(kv_full_hi, kv_full_lo)", "kv_full_hi = kv_full_lo")],
     "leaves tiles that every query sees whole in a masked range"),
    ("K/V heads round-robin", [(FWD_HEAD, "kv_head = head % (n_heads // n_group)")], "dealt out round-robin"),
    ("K/V head of the query head", [(FWD_HEAD, "kv_head = head")],
     "has NaN from query head 2 on, which read K/V heads that do not exist"),
    ("a row that has seen no key", [('m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)', "m_ref = m_new")],
     "exp2(-inf - (-inf)) is NaN"),
    ("no window mask in the loop", [(FWD_MASK, FWD_MASK.replace("my_in_window(offs_q[:, None], offs_kv[None, :], "
                                                                "win_left, win_right)", "(offs_q[:, None] >= 0)"))],
     "though my_in_window and my_window_bounds are right on their own"),
)
def test_gqa_window_forward_mistakes(solutions, edits, message):
    module = solutions("10", edits)
    with pytest.raises(ex.ExerciseError, match=re.escape(message)):
        ex.check_gqa_window_forward(module.my_attn_fwd, module.my_window_bounds, module.my_in_window)


# --- Exercise 5: grouped heads and a window in the learner's backward kernels ---------------------------

DQ_HEAD = "    kv_head = head // n_group\n"
DKDV_HEAD = "head = kv_head * n_group + g"
DKDV_BOUNDS = "my_window_bounds(kv_start, n_q, win_right, win_left,"
DKDV_MASK = "my_in_window(queries[None, :], offs_kv[:, None], win_left, win_right)"
DQ_MASK = ('my_in_window(offs_q[:, None], keys[None, :], win_left, win_right)\n'
           '                ### END SOLUTION\n            s = tl.where(keep, s, float("-inf"))\n'
           '        p = tl.exp2')


@mistakes(
    ("dQ: K/V heads round-robin", [(DQ_HEAD, "    kv_head = head % (n_heads // n_group)\n")], "dealt out round-robin"),
    ("dQ: K/V head of the query head", [(DQ_HEAD, "    kv_head = head\n")],
     "has NaN from query head 2 on, which read K/V heads that do not exist"),
    ("dQ: no window mask", [(DQ_MASK, DQ_MASK.replace("my_in_window(offs_q[:, None], keys[None, :], win_left, "
                                                      "win_right)", "(offs_q[:, None] >= 0)"))],
     "under the window it visits the same tiles as the forward"),
    ("dK/dV: group round-robin", [(DKDV_HEAD, "head = kv_head + g * (n_heads // n_group)")],
     "K/V head g gathers query heads g * n_group .. g * n_group + n_group - 1"),
    ("dK/dV: one query head", [("for g in range(0, n_group):", "for g in range(0, 1):")],
     "only the first query head of each group was added"),
    ("dK/dV: accumulators restarted", [(DKDV_HEAD, DKDV_HEAD + "\n        dk = tl.zeros([BLOCK_KV, BLOCK_D], dtype=tl.float32)"
                                                    "\n        dv = tl.zeros([BLOCK_KV, BLOCK_D], dtype=tl.float32)")],
     "only the last query head of each group counts"),
    ("dK/dV: the same head", [(DKDV_HEAD, "head = kv_head")], "the same query head was added n_group times"),
    ("dK/dV: averaged", [("    dk *= scale   ", "    dv = dv / n_group\n    dk *= scale / n_group   ")],
     "the shares of the group were averaged"),
    ("dK/dV: the window not turned around", [(DKDV_BOUNDS, "my_window_bounds(kv_start, n_q, win_left, win_right,")],
     "seen from key j, the window turns around"),
    ("dK/dV: the mask not transposed", [(DKDV_MASK, "my_in_window(offs_kv[:, None], queries[None, :], win_left, win_right)")],
     "seen from key j, the window turns around"),
    ("a wrong piece of the forward's exercise", [(IN_WINDOW, "return (j > i - win_left) & (j <= i + win_right)")],
     "the left edge is off by one: query i sees key i - win_left itself (j >= i - win_left). (The forward's exercise"),
)
def test_gqa_window_backward_mistakes(solutions, edits, message):
    module = solutions("10", edits)
    with pytest.raises(ex.ExerciseError, match=re.escape(message)):
        ex.check_gqa_window_backward(module.my_attn_bwd_dq, module.my_attn_bwd_dkdv)


def test_gqa_window_backward_needs_the_forward_pieces(solutions):
    module = solutions("10", stub="ch10-gqa-window-fwd")
    with pytest.raises(ex.ExerciseError, match=re.escape("(the forward's exercise) is not implemented yet")):
        ex.check_gqa_window_backward(module.my_attn_bwd_dq, module.my_attn_bwd_dkdv)
