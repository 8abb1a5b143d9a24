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
        rows = compiled.in_child("flashattn.measure.compiled_gluon:gluon_report", kernel="fwd", head_dims=[128],
                                 dtypes=["fp16"], causal=[True], configs=configs)
    except compiled.CannotCompile as reason:
        pytest.skip(str(reason))
    for key, row in zip(picked, rows):
        assert _tile_bytes(*key) <= row["smem"] < _tile_bytes(*key) + 1024, (key, row["smem"])
        assert _tile_bytes(*key) <= COMPILED_SMEM[key] < _tile_bytes(*key) + 1024


WAIT = "mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)"
EXPECT = "mbarrier.expect(ready.index(slot), desc.block_type.nbytes)"
LOAD = "tma_load(desc, [j * BLOCK, 0], ready.index(slot), x_smem.index(slot))"
LOOP = "for j in range(n_tiles):\n        slot = j % STAGES"


@pytest.mark.parametrize("edits, message", [
    pytest.param([(WAIT, "mbarrier.wait(empty.index(slot), (j // STAGES) & 1)")],
                 "deadlock before the first round is done: the producer waits for parity 0 on empty[0]",
                 id="the first round waits for parity 0"),
    pytest.param([(WAIT, "mbarrier.wait(empty.index(slot), (j & 1) ^ 1)")], "deadlock", id="parity flips every tile"),
    pytest.param([(WAIT, "pass")], "overwrites tile 0 in slot 0 with tile 1", id="no wait on empty"),
    pytest.param([(WAIT, "mbarrier.wait(ready.index(slot), ((j // STAGES) & 1) ^ 1)")], "the producer waits on ready",
                 id="waits on ready"),
    pytest.param([(EXPECT, "pass")], "no mbarrier.expect(ready[slot], desc.block_type.nbytes) announced the copy",
                 id="no expect"),
    pytest.param([(EXPECT, "mbarrier.arrive(ready.index(slot))")], "it arrives on ready[0]", id="arrive, not expect"),
    pytest.param([(EXPECT, "mbarrier.expect(ready.index(slot), BLOCK * 64)")],
                 "expect announced 4096 bytes and the copy brought 8192", id="elements, not bytes"),
    pytest.param([(LOAD, "tma_load(desc, [j, 0], ready.index(slot), x_smem.index(slot))")],
                 "copy number 1 reads rows from 1", id="tile j at row j"),
    pytest.param([(LOAD, "tma_load(desc, [j * BLOCK, 0], empty.index(slot), x_smem.index(slot))")],
                 "the copy signals empty[0]", id="the copy signals empty"),
    pytest.param([(LOAD, "tma_load(desc, [j * BLOCK, 0], ready.index(slot), x_smem)")],
                 "the copy's destination (fourth argument) is x_smem", id="the whole ring as destination"),
    pytest.param([(LOOP, LOOP.replace("j % STAGES", "j"))], "empty.index(1): the ring has 1 buffer(s)",
                 id="slot j"),
    pytest.param([(LOOP, LOOP.replace("range(n_tiles)", "range(n_tiles - 1)"))],
                 "the producer has finished after 0 copies", id="one tile short"),
    pytest.param([(LOOP, LOOP.replace("range(n_tiles)", "gl.static_range(n_tiles)"))],
                 "does not compile for sm_90: at `for j in gl.static_range(n_tiles):`: AssertionError",
                 id="a loop the compiler refuses"),
])
def test_ring_producer_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=re.escape(message)):
        ex.check_ring_producer(solutions("12", edits).ring_producer)
