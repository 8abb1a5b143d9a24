"""The checker of chapter 11 fails plausible mistakes (each one the solution with a named edit) with
a message that names the mistake. (tests/test_exercise_checks.py runs the solution and the stub.)"""
import re

import pytest

from flashattn.course import exercises as ex


RETURN = "return j % stages, ready_parity, ready_parity ^ 1"


@pytest.mark.parametrize("edits, message", [
    pytest.param([(RETURN, "return j % stages, ready_parity, ready_parity")], "deadlock", id="producer waits for parity 0"),
    pytest.param([("ready_parity = rounds & 1", "ready_parity = j & 1")], "before the tile had landed",
                 id="parity flips every tile"),
    pytest.param([(RETURN, "return j % stages, ready_parity ^ 1, ready_parity")], "before the tile had landed",
                 id="parities swapped"),
    pytest.param([(RETURN, "return rounds % stages, ready_parity, ready_parity ^ 1")], "consecutive slots",
                 id="slot by round"),
    pytest.param([(RETURN, "return j % stages, ready_parity")], "should return a tuple", id="two values"),
])
def test_ring_slot_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=re.escape(message)):
        ex.check_ring_slot(solutions("11", edits).ring_slot)
