"""The checker of chapter 11 fails plausible mistakes (each one the solution with a named edit) with
a message that names the mistake. (tests/test_exercise_checks.py runs the solution and the stub.)"""
import re

import pytest

from flashattn.course import exercises as ex

WEIGHTS = "w = torch.exp2(lse_parts - m)"
WEIGHED_SUM = "(w[..., None] * o_parts).sum(dim=-2)"
LSE = "(m + torch.log2(l))"


@pytest.mark.parametrize("edits, message", [pytest.param(edits, message, id=name) for name, edits, message in [
    ("no rescaling: a plain mean", [(WEIGHED_SUM + " / torch.where(l > 0, l, torch.ones_like(l))",
                                     "o_parts.mean(dim=-2)")], "must be weighed by that split's share"),
    ("natural exponentials", [(WEIGHTS, "w = torch.exp(lse_parts - m)")], "The LSE_s are in base 2"),
    ("natural log for the LSE", [(LSE, "(m + torch.log(l))")], "LSE is in natural log"),
    ("the LSE without its max", [(LSE, "torch.log2(l)")], "LSE is missing the max"),
    ("dividing twice", [(WEIGHED_SUM, "(w[..., None] / l[..., None] * o_parts).sum(dim=-2)")],
     "divided by the sum twice"),
    ("empty rows: -inf - (-inf)", [('m = torch.where(m == float("-inf"), torch.zeros_like(m), m)', "m = m")],
     "-inf - (-inf) = NaN"),
    ("empty rows: 0 / 0", [("/ torch.where(l > 0, l, torch.ones_like(l))", "/ l")], "-inf - (-inf) = NaN"),
    ("no max subtracted", [(WEIGHTS, "w = torch.exp2(lse_parts)"), (LSE, "torch.log2(l)")],
     "overflows float32"),
    ("the split dim kept", [(LSE + ".squeeze(-1)", LSE)], "the split dim S is merged away"),
    ("not a tuple", [("return o, " + LSE + ".squeeze(-1)", "return o")], "should return a tuple (o, lse)"),
]])
def test_mistakes_are_named(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=re.escape(message)):
        ex.check_merge_split_partials(solutions("11", edits).merge_split_partials)
