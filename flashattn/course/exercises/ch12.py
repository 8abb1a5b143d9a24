"""The checkers of chapter 12 (the Gluon kernels for Hopper): the ring of shared-memory buffers and
the mbarrier parities its producer and consumers wait for, the producer's loop in Gluon, and the
shared memory of a configuration."""
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

#: Shared memory the compiler gave the Gluon forward, for sm_90 (``compiled_gluon.gluon_report``), per
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


# ---------------------------------------------------------------------------- the producer's loop

#: (n_tiles, STAGES) of the rings the learner's producer is recorded and played through.
PRODUCER_RINGS = [(1, 1), (5, 1), (6, 2), (7, 3), (2, 3), (9, 4)]
#: Seconds a run of the learner's kernel on a GPU may take before it is called a deadlock.
GPU_TIMEOUT = 90


class _Ring:
    """``ready``, ``empty`` or ``x_smem`` as the learner's loop sees them in the recorded run."""

    def __init__(self, name, stages):
        self.name, self.stages = name, stages

    def __repr__(self):
        return self.name

    def index(self, i):
        i = int(i)
        if not 0 <= i < self.stages:
            raise ExerciseError(f"{self.name}.index({i}): the ring has {self.stages} buffer(s), slots 0 to "
                                f"{self.stages - 1}; tile j goes to slot j % STAGES")
        return (self.name, i)


class _Recorder:
    """The Gluon calls a producer may make, recorded instead of compiled: ``events`` lists them in
    order, ``(kind, barrier or None, slot, detail)``."""

    def __init__(self, nbytes):
        self.events, self.nbytes = [], nbytes

    def wait(self, bar, phase, *args, **kwargs):
        self.events.append(("wait", *self._bar(bar, "mbarrier.wait"), int(phase)))

    def expect(self, bar, nbytes, *args, **kwargs):
        self.events.append(("expect", *self._bar(bar, "mbarrier.expect"), int(nbytes)))

    def arrive(self, bar, *args, **kwargs):
        self.events.append(("arrive", *self._bar(bar, "mbarrier.arrive"), None))

    def load(self, desc, coords, bar, smem, *args, **kwargs):
        name, slot = self._bar(bar, "the copy's barrier (third argument)")
        if not (isinstance(smem, tuple) and smem[0] == "x_smem"):
            raise ExerciseError(f"the copy's destination (fourth argument) is {smem!r}: a slot of the ring, "
                                "x_smem.index(slot)")
        self.events.append(("load", name, slot, (tuple(int(c) for c in coords), smem[1])))

    @staticmethod
    def _bar(bar, what):
        if not (isinstance(bar, tuple) and bar[0] in ("ready", "empty")):
            raise ExerciseError(f"{what} was given {bar!r}: an mbarrier, ready.index(slot) or empty.index(slot)")
        return bar


class _Namespace:
    """A module as the recorded run offers it: the names given, and a clear error for any other."""

    def __init__(self, what, **names):
        self.__dict__.update(names)
        self._what = what

    def __getattr__(self, name):
        raise ExerciseError(f"the producer uses {self._what}.{name}: its loop needs only mbarrier.wait, "
                            "mbarrier.expect, tma_load and the rings' .index(slot)")


def _record(producer, n_tiles, stages, block, nbytes):
    """The events of the learner's @gluon.jit ``producer`` run as plain Python (its Gluon calls
    recorded by :class:`_Recorder`) for one ring."""
    import types

    fn = getattr(producer, "fn", producer)
    recorder = _Recorder(nbytes)
    gl = _Namespace("gl", static_range=range, constexpr=lambda x: x)
    names = dict(fn.__globals__, gl=gl, tl=gl, mbarrier=_Namespace("mbarrier", wait=recorder.wait,
                 expect=recorder.expect, arrive=recorder.arrive), tma_load=recorder.load,
                 tma=_Namespace("tma", async_load=recorder.load, async_copy_global_to_shared=recorder.load))
    desc = types.SimpleNamespace(block_type=types.SimpleNamespace(nbytes=nbytes, shape=[block, 64]),
                                 block_shape=[block, 64], nbytes=nbytes)
    run = types.FunctionType(fn.__code__, names, fn.__name__, fn.__defaults__, fn.__closure__)
    try:
        run(desc, _Ring("x_smem", stages), _Ring("ready", stages), _Ring("empty", stages), n_tiles, block, stages)
    except ExerciseError:
        raise
    except Exception as error:
        raise ExerciseError(f"the producer's loop, run as plain Python for {n_tiles} tiles and {stages} buffer(s), "
                            f"raised {type(error).__name__}: {error}") from None
    return recorder.events


def _play(events, n_tiles, stages, block, nbytes):
    """Play the producer's recorded ``events`` against the consumer of ``gluon_ring`` through the
    ring's mbarriers; None, or what went wrong. The producer runs ahead as far as its waits let it
    (the schedule that finds an overwrite), the consumer reads a tile once its ready phase completed
    and releases the slot. A barrier completes a phase when its one arrival came and the bytes
    announced by expect have all landed (a copy lands as it is issued). A wait for parity P passes
    once the phase of parity P has completed: at first, as if the phase before phase 0 had."""
    completed = {(b, s): 0 for b in ("ready", "empty") for s in range(stages)}
    arrivals = dict.fromkeys(completed, 0)
    tx = dict.fromkeys(completed, 0)
    content = [None] * stages        # the tile a slot holds, until the consumer has read it
    loads = p = c = 0                # copies issued, the producer's next event, the consumer's next tile

    def passes(bar, parity):
        return completed[bar] % 2 == parity ^ 1

    def settle(bar):
        if arrivals[bar] >= 1 and tx[bar] == 0:
            completed[bar] += 1
            arrivals[bar] = 0

    while True:
        moved = False
        while p < len(events):
            kind, name, slot, detail = events[p]
            bar = (name, slot)
            if kind == "wait":
                if name != "empty":
                    return (f"the producer waits on {name}[{slot}]: it waits on empty[slot], for the consumer's "
                            "release; ready is the consumer's to wait on")
                if detail not in (0, 1):
                    return f"it waits for parity {detail} on empty[{slot}]: a parity is 0 or 1 ((j // STAGES) & 1)"
                if not passes(bar, detail):
                    break
            elif kind == "expect":
                if name != "ready":
                    return (f"it announces the copy's bytes on {name}[{slot}]: mbarrier.expect goes on ready[slot], "
                            "where the consumer waits for the tile")
                arrivals[bar] += 1
                tx[bar] += detail
                settle(bar)
            elif kind == "arrive":
                return (f"it arrives on {name}[{slot}]: the producer only waits on empty and announces the bytes "
                        "on ready with mbarrier.expect (which is also ready's arrival); the consumer arrives on empty")
            else:
                (row, col), smem_slot = detail
                if name != "ready":
                    return (f"the copy signals {name}[{slot}]: its bytes must count down on ready[slot] (the "
                            "copy's third argument), where the consumer waits")
                if col != 0 or row != loads * block:
                    return (f"copy number {loads} reads rows from {row} (coordinates [{row}, {col}]): tile j is rows "
                            f"j * BLOCK to j * BLOCK + BLOCK - 1, so its coordinates are [j * BLOCK, 0]")
                if loads >= n_tiles:
                    return f"it copies more than the n_tiles = {n_tiles} tiles"
                if content[smem_slot] is not None:
                    return (f"it overwrites tile {content[smem_slot]} in slot {smem_slot} with tile {loads} before "
                            "the consumer has read it: wait on empty[slot] before each copy, for the parity of "
                            "exercise 1 (the consumer releases a slot once per round)")
                content[smem_slot] = loads
                tx[bar] -= nbytes        # the copy engine counts its bytes down on the barrier it was given
                settle(bar)
                loads += 1
            p += 1
            moved = True
        if c < n_tiles and passes(("ready", c % stages), (c // stages) & 1):
            slot = c % stages
            if content[slot] != c:
                held = "nothing" if content[slot] is None else f"tile {content[slot]}"
                return (f"the consumer reads tile {c} from slot {slot}, which holds {held}: tile j goes to "
                        "slot j % STAGES, and ready[slot] must complete only once it has landed there")
            content[slot] = None
            completed[("empty", slot)] += 1
            c += 1
            moved = True
        if not moved:
            break
    if c == n_tiles and p == len(events):
        return None if loads == n_tiles else f"it copies {loads} tiles, and n_tiles = {n_tiles}"
    if c == n_tiles:
        return f"after the consumer's last tile the producer still waits on empty[{events[p][2]}]"
    slot = c % stages
    ready = ("ready", slot)
    if content[slot] == c and arrivals[ready] == 0:
        return (f"deadlock: tile {c} has landed in slot {slot} but ready[{slot}] never completes its phase: no "
                "mbarrier.expect(ready[slot], desc.block_type.nbytes) announced the copy (the expect is also the "
                "one arrival the barrier waits for)")
    if content[slot] == c:
        return (f"deadlock: ready[{slot}] never completes its phase for tile {c}: expect announced "
                f"{tx[ready] + nbytes} bytes and the copy brought {nbytes} (desc.block_type.nbytes, the bytes of "
                "one tile)")
    if p == len(events):
        return (f"deadlock: the consumer waits for tile {c}, and the producer has finished after {loads} copies: "
                "copy every tile 0 .. n_tiles - 1")
    _, _, wait_slot, parity = events[p]
    if loads < stages:
        return (f"deadlock before the first round is done: the producer waits for parity {parity} on "
                f"empty[{wait_slot}] before copying tile {loads}, and that phase completes only when the "
                "consumer releases a tile it has not received. A fresh mbarrier counts as if its phase of parity 1 "
                "had just completed: the first round waits for parity 1 (exercise 1: the empty parity is the "
                "ready parity ^ 1)")
    return (f"deadlock: the producer waits for parity {parity} on empty[{wait_slot}] before copying tile {loads}, "
            f"while the consumer waits for tile {c} on ready[{slot}]: the producer's parity for tile j is "
            "((j // STAGES) & 1) ^ 1, on empty[j % STAGES]")


def _in_child(job, source, name, **kwargs):
    """``flashattn.course.gluon_ring``'s ``job`` in a child process, on a file holding the learner's
    producer (``source``) after the imports the chapter gives it. (Triton's interpreter, once it has
    run in a process, leaves Gluon's compiler unusable there.)"""
    import os
    import tempfile

    from ...measure import compiled
    from .. import gluon_ring

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "producer.py")
        with open(path, "w", encoding="utf8") as f:
            f.write(gluon_ring.HEADER + "\n\n" + source)
        return compiled.in_child(f"flashattn.course.gluon_ring:{job}", path=path, name=name, **kwargs)


def check_ring_producer(ring_producer):
    """Chapter 12: the @gluon.jit ``ring_producer(desc, x_smem, ready, empty, n_tiles, BLOCK,
    STAGES)`` must copy tiles 0 .. n_tiles - 1 of ``desc`` (rows j * BLOCK on) with TMA into slot
    j % STAGES of ``x_smem``, each once its slot is free (a wait on ``empty[slot]`` for the parity
    of exercise 1) and announced on ``ready[slot]`` (``mbarrier.expect``). Gluon has no
    interpreter: the loop is run as plain Python with its Gluon calls recorded and played against
    the consumer through a model of the mbarriers; the kernel around it (``gluon_ring.ring_sum``)
    is compiled for sm_90 and its PTX read; on an H100/H200 it also runs."""
    import torch

    from .common import check_references, is_stub, not_implemented

    name = getattr(getattr(ring_producer, "fn", ring_producer), "__name__", "ring_producer")
    if is_stub(ring_producer):
        raise not_implemented(name)
    check_references(ring_producer, name, ("flashattn",))
    block, nbytes = 64, 64 * 64 * 2
    for n_tiles, stages in PRODUCER_RINGS:
        events = _record(ring_producer, n_tiles, stages, block, nbytes)
        problem = _play(events, n_tiles, stages, block, nbytes)
        if problem:
            raise ExerciseError(f"{name}, recorded for {n_tiles} tile(s) through {stages} buffer(s): {problem}.")
    import inspect
    import subprocess

    fn = getattr(ring_producer, "fn", ring_producer)
    source = inspect.getsource(fn)
    try:
        facts = _in_child("compile_source", source, fn.__name__)
    except RuntimeError as error:  # no Gluon, no CUDA backend: this Triton cannot compile for sm_90
        lines = [line for line in str(error).splitlines() if line.strip()]
        passed(f"{name}: the recorded loop went through {len(PRODUCER_RINGS)} rings without deadlock, overwrite or "
               f"misplaced tile (this Triton cannot compile it for sm_90: {lines[-1][:200] if lines else error})")
        return
    if "error" in facts:
        raise ExerciseError(f"{name} does not compile for sm_90: {facts['error']}")
    if facts["tma_loads"] != 1 or facts["expects"] != 1 or facts["waits"] != 2:
        raise ExerciseError(f"{name} compiled, but its PTX holds {facts['tma_loads']} TMA copies, "
                            f"{facts['expects']} mbarrier.arrive.expect_tx and {facts['waits']} waits (the consumer's "
                            "one included): the loop needs one of each, and one wait of its own")
    where = "compiled for sm_90 here"
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        try:
            errors = _in_child("run_source", source, fn.__name__, timeout=GPU_TIMEOUT,
                               cases=[list(ring) for ring in PRODUCER_RINGS])
        except subprocess.TimeoutExpired:
            raise ExerciseError(f"{name}: the kernel ran on this GPU for {GPU_TIMEOUT} s without finishing: a "
                                "deadlock the recorded run did not foresee") from None
        except RuntimeError as error:
            raise ExerciseError(f"{name}: the kernel failed on this GPU: "
                                f"{str(error).strip().splitlines()[-1]}") from None
        if max(errors) > 1e-2:
            raise ExerciseError(f"{name}: on this GPU the sums of the tiles were wrong by up to {max(errors):.3g} "
                                f"(rings {PRODUCER_RINGS}): a tile was overwritten or read before it landed")
        where = f"and run on {torch.cuda.get_device_name()}, sums within {max(errors):.1e}"
    passed(f"{name}: the recorded loop went through {len(PRODUCER_RINGS)} rings without deadlock, overwrite or "
           f"misplaced tile; {where} (one TMA copy, one expect and one wait per tile in its PTX)")
