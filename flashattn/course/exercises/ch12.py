"""The checker of chapter 12 (the Gluon kernels for Hopper): the ring of shared-memory buffers and
the mbarrier parities its producer and consumers wait for."""
from .common import ExerciseError, attempt, passed


class _Barrier:
    """An mbarrier reduced to what the ring uses: the number of phases completed. ``wait(parity)``
    returns once the phase of that parity has completed: at first (no phase completed) a wait for
    parity 1 passes at once, as if the phase before phase 0 had just completed."""

    def __init__(self):
        self.completed = 0

    def passes(self, parity):
        return self.completed % 2 == (parity ^ 1)


def _simulate(ring_slot, stages, n_tiles, producer_lead):
    """Run a producer and one consumer over ``n_tiles`` tiles through a ring of ``stages`` slots,
    using the learner's ``ring_slot`` for the slot and the parities; the producer runs as far ahead
    as its waits let it, up to ``producer_lead`` tiles. Returns None or what went wrong."""
    ready = [_Barrier() for _ in range(stages)]
    empty = [_Barrier() for _ in range(stages)]
    content = [None] * stages  # the tile each slot holds, None once consumed
    produced = consumed = 0
    while consumed < n_tiles:
        moved = False
        while produced < n_tiles and produced - consumed < producer_lead:
            slot, _, empty_parity = ring_slot(produced, stages)
            if not empty[slot].passes(empty_parity):
                break
            if content[slot] is not None:
                return (f"the producer overwrote tile {content[slot]} in slot {slot} with tile {produced} "
                        "before the consumer had used it: its wait on empty[slot] passed too early")
            content[slot] = produced
            ready[slot].completed += 1  # the copy engine's bytes have landed
            produced += 1
            moved = True
        slot, ready_parity, _ = ring_slot(consumed, stages)
        if ready[slot].passes(ready_parity):
            if content[slot] != consumed:
                held = "nothing yet" if content[slot] is None else f"tile {content[slot]}"
                return (f"the consumer read tile {consumed} from slot {slot}, which holds {held}: its wait "
                        "on ready[slot] passed before the tile had landed")
            content[slot] = None
            empty[slot].completed += 1  # the consumer releases the slot
            consumed += 1
            moved = True
        if not moved:
            return (f"deadlock after {consumed} tiles consumed and {produced} produced: the producer waits "
                    f"for parity {ring_slot(produced, stages)[2] if produced < n_tiles else '-'} on an empty "
                    f"barrier and the consumer for parity {ring_slot(consumed, stages)[1]} on a ready barrier, "
                    "and neither phase can complete")
    return None


def check_ring_slot(ring_slot):
    """Chapter 12: ``ring_slot(j, stages)`` must return ``(slot, ready_parity, empty_parity)`` for
    tile j of a ring of ``stages`` shared-memory buffers: the slot the tile goes to, the parity the
    consumer waits for on ``ready[slot]`` and the parity the producer waits for on ``empty[slot]``
    before copying tile j. Checked by running a producer and a consumer through the ring."""
    name = getattr(ring_slot, "__name__", "ring_slot")
    for stages in (1, 2, 3, 4):
        for j in range(3 * stages + 2):
            got = attempt(ring_slot, j, stages, name=name)
            if not (isinstance(got, tuple) and len(got) == 3):
                raise ExerciseError(f"{name}({j}, {stages}) should return a tuple (slot, ready_parity, "
                                    f"empty_parity), got {got!r}")
            slot, ready_parity, empty_parity = got
            if not 0 <= slot < stages:
                raise ExerciseError(f"{name}({j}, {stages}) returned slot {slot}: a ring of {stages} buffers has "
                                    f"slots 0 to {stages - 1}; consecutive tiles take consecutive slots")
            if ready_parity not in (0, 1) or empty_parity not in (0, 1):
                raise ExerciseError(f"{name}({j}, {stages}) returned parities {ready_parity}, {empty_parity}: "
                                    "an mbarrier parity is 0 or 1")
    for stages in (1, 2, 3, 4):
        if [ring_slot(j, stages)[0] for j in range(2 * stages)] != [j % stages for j in range(2 * stages)]:
            raise ExerciseError(f"with {stages} buffers, tiles 0..{2 * stages - 1} went to slots "
                                f"{[ring_slot(j, stages)[0] for j in range(2 * stages)]}: the ring takes "
                                "consecutive slots and wraps around")
        for lead in (1, stages, 10 * stages):
            problem = _simulate(ring_slot, stages, 4 * stages + 3, lead)
            if problem:
                raise ExerciseError(f"with {stages} buffer(s): {problem}. Each slot's barriers complete one phase "
                                    "per round through the ring, so the parity changes every `stages` tiles; and "
                                    "an mbarrier starts as if its phase of parity 1 had just completed.")
    passed(f"{name}: a producer and a consumer went through rings of 1 to 4 buffers without deadlock, "
           "without overwriting a tile in use and without reading one before it landed")


# ---------------------------------------------------------------------------- shared memory

#: Shared memory the compiler gave the Gluon forward, for sm_90 (``compiled.gluon_report``), per
#: (head dim, BLOCK_M, BLOCK_KV, STAGES, CONSUMERS, bytes per element): the tiles the program keeps
#: there, plus under 1 KB of mbarriers and the compiler's own scratch. tests/test_exercises_ch12.py
#: compiles one of them again and checks its row.
COMPILED_SMEM = {
    (128, 64, 128, 3, 2, 2): 229800,   # the default at head dim 128, causal
    (128, 64, 128, 2, 2, 2): 164200,   # the default at head dim 128 without the mask
    (128, 64, 128, 2, 3, 2): 180620,   # three consumers
    (64, 64, 128, 4, 2, 2): 147848,    # the default at head dim 64
}
def _tile_bytes(head_dim, block_m, block_kv, stages, consumers, elem_bytes):
    return (consumers * block_m + 2 * stages * block_kv) * head_dim * elem_bytes


def check_smem_bytes(smem_bytes):
    """Chapter 12: ``smem_bytes(head_dim, block_m, block_kv, stages, consumers, elem_bytes)`` must
    return the bytes of the tiles the Gluon forward keeps in shared memory: one Q tile of
    ``block_m`` rows per consumer (O is written back through it) and a ring of ``stages`` tiles of
    ``block_kv`` rows for K and another for V, ``head_dim`` columns each. Checked against the
    formula on many configurations and against what the compiler reported for real ones."""
    name = getattr(smem_bytes, "__name__", "smem_bytes")
    configs = [(d, m, n, s, c, e) for d in (64, 128) for m in (64,) for n in (64, 128) for s in (1, 2, 3, 4)
               for c in (2, 3) for e in (2, 4)]
    first_wrong = None
    for config in configs:
        got = attempt(smem_bytes, *config, name=name)
        want = _tile_bytes(*config)
        if got == want:
            continue
        d, m, n, s, c, e = config
        call = f"{name}(head_dim={d}, block_m={m}, block_kv={n}, stages={s}, consumers={c}, elem_bytes={e})"
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            raise ExerciseError(f"{call} should return a number of bytes, got {got!r}")
        diagnoses = [
            (want // e, "counted elements, not bytes: multiply by elem_bytes"),
            ((c * m + s * n) * d * e, "K and V share one ring of `stages` buffers: they have one ring each"),
            ((m + 2 * s * n) * d * e, "counted one Q tile for the program: each consumer has its own"),
            (2 * s * n * d * e, "left out the Q tiles: they stay in shared memory for the whole loop"),
            (want + c * m * d * e, "added a buffer for O: the output is written back through the Q tile, "
                                   "which is no longer read by then"),
            ((c * m + 2 * (s + 1) * n) * d * e, "counted stages + 1 tiles per ring: a ring of `stages` buffers "
                                                "holds `stages` tiles"),
        ]
        named = {why for value, why in diagnoses if got == value}
        if len(named) == 1:
            raise ExerciseError(f"{call} returned {got}, expected {want}: {named.pop()}")
        first_wrong = first_wrong or f"{call} returned {got}, expected {want} bytes"
        if not named:  # no mistake this course knows of; two that give the same number: look further
            raise ExerciseError(first_wrong)
    if first_wrong:
        raise ExerciseError(first_wrong)
    for (d, m, n, s, c, e), smem in COMPILED_SMEM.items():
        got = attempt(smem_bytes, d, m, n, s, c, e, name=name)
        if not got <= smem < got + 1024:
            raise ExerciseError(f"for head dim {d}, BLOCK_M {m}, BLOCK_KV {n}, {s} stages, {c} consumers the compiler "
                                f"reserved {smem} bytes, and {name} says {got}")
    passed(f"{name}: the tiles' bytes of {len(configs)} configurations; on the {len(COMPILED_SMEM)} compiled for sm_90, "
           "within 1 KB below the compiler's figure (the rest: mbarriers and the compiler's scratch)")
