"""The checker of chapter 12 fails plausible mistakes (each one the solution with a named edit) with
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
        ex.check_ring_slot(solutions("12", edits).ring_slot)


Q_TILES = "q_tiles = consumers * block_m * head_dim"
KV_RINGS = "kv_rings = 2 * stages * block_kv * head_dim"
TOTAL = "return (q_tiles + kv_rings) * elem_bytes"


@pytest.mark.parametrize("edits, message", [
    pytest.param([(TOTAL, "return q_tiles + kv_rings")], "elements, not bytes", id="elements"),
    pytest.param([(KV_RINGS, "kv_rings = stages * block_kv * head_dim")], "one ring each", id="one ring for K and V"),
    pytest.param([(Q_TILES, "q_tiles = block_m * head_dim")], "each consumer has its own", id="one Q tile"),
    pytest.param([(TOTAL, "return kv_rings * elem_bytes")], "left out the Q tiles", id="no Q"),
    pytest.param([(TOTAL, "return (2 * q_tiles + kv_rings) * elem_bytes")], "a buffer for O", id="an O buffer"),
    pytest.param([(KV_RINGS, "kv_rings = 2 * (stages + 1) * block_kv * head_dim")], "stages + 1",
                 id="one tile too many per ring"),
    pytest.param([(TOTAL, "return (q_tiles + kv_rings) * elem_bytes + 4096")], "expected", id="anything else"),
])
def test_smem_bytes_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=re.escape(message)):
        ex.check_smem_bytes(solutions("12", edits).smem_bytes)


@pytest.mark.slow
def test_the_compiled_shared_memory_the_checker_holds_is_the_compilers():
    """The checker's table of compiled shared memory against this Triton's compiler: the tiles,
    plus under 1 KB."""
    from flashattn.course.exercises.ch12 import COMPILED_SMEM, _tile_bytes
    from flashattn.measure import compiled

    picked = [(128, 64, 128, 3, 2, 2), (128, 64, 128, 2, 3, 2)]
    configs = [{"STAGES": 3}, {"STAGES": 2, "CONSUMERS": 3}]
    try:
        rows = compiled.in_child("flashattn.measure.compiled:gluon_report", kernel="fwd", head_dims=[128],
                                 dtypes=["fp16"], causal=[True], configs=configs)
    except compiled.CannotCompile as reason:
        pytest.skip(str(reason))
    for key, row in zip(picked, rows):
        assert _tile_bytes(*key) <= row["smem"] < _tile_bytes(*key) + 1024, (key, row["smem"])
        assert _tile_bytes(*key) <= COMPILED_SMEM[key] < _tile_bytes(*key) + 1024
