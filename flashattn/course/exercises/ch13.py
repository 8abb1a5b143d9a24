"""Checkers of chapter 13 (context parallelism): one step of the ring's merge of partial states,
which positions a rank holds in the zigzag layout, and which parts of a ring step a rank computes
under the causal mask."""
import numpy as np
import torch

from ...distributed.layout import positions
from ...distributed.schedule import Block, covered, visible
from .common import ExerciseError, attempt, close, expect_close, passed

#: (world, n) of the sequences the positions are checked on.
POSITION_CASES = [(1, 4), (2, 8), (2, 12), (3, 18), (4, 32), (8, 48)]


def _zigzag_variant(rank, world, n, variant):
    """The positions rank ``rank`` holds by a known mistake, to name it when a learner makes it."""
    chunk = n // (2 * world)
    first, second = rank, 2 * world - 1 - rank
    if variant == "off by one":
        second = 2 * world - rank
    elif variant == "contiguous":
        return list(range(rank * (n // world), (rank + 1) * (n // world)))
    elif variant == "chunks of n / world":
        chunk = n // world
    spans = [range(c * chunk, (c + 1) * chunk) for c in (first, second)]
    if variant == "later chunk first":
        spans = spans[::-1]
    if variant == "one chunk":
        spans = spans[:1]
    return [p for span in spans for p in span]


POSITION_HINTS = {
    "off by one": "the second chunk is one too far: of the 2 * world chunks, numbered 0 to 2 * world - 1, "
                  "the one that mirrors chunk r from the end is 2 * world - 1 - r.",
    "contiguous": "these are the positions of the contiguous layout (chunk r of world chunks). Zigzag cuts the "
                  "sequence into 2 * world chunks and gives rank r chunks r and 2 * world - 1 - r.",
    "chunks of n / world": "the chunks are too long: there are 2 * world of them, n // (2 * world) positions each.",
    "later chunk first": "the chunks are in the wrong order: a shard holds its chunks in increasing position, "
                         "chunk r first, then chunk 2 * world - 1 - r.",
    "one chunk": "only chunk r: a zigzag shard also holds the chunk that mirrors it from the end, "
                 "2 * world - 1 - r.",
}


def check_zigzag_positions(zigzag_positions):
    """Chapter 13: ``zigzag_positions(rank, world, n)`` must return the positions of a sequence of
    ``n`` that rank ``rank`` of ``world`` holds in the zigzag layout, in the order of its shard (a
    1-D tensor or a list of ints)."""
    name = getattr(zigzag_positions, "__name__", "zigzag_positions")
    for world, n in POSITION_CASES:
        for rank in range(world):
            where = f"{name}(rank={rank}, world={world}, n={n})"
            got = attempt(zigzag_positions, rank, world, n, name=name, forbid=("flashattn",))
            try:
                got = [int(p) for p in (got.tolist() if isinstance(got, torch.Tensor) else got)]
            except (TypeError, ValueError):
                raise ExerciseError(f"{where} should return a 1-D tensor or a list of ints, got "
                                    f"{type(got).__name__}") from None
            want = positions(rank, world, n).tolist()
            if got == want:
                continue
            for variant, hint in POSITION_HINTS.items():
                if got == _zigzag_variant(rank, world, n, variant) != want:
                    raise ExerciseError(f"{where} returned {_short(got)}: {hint}")
            if len(got) != n // world:
                raise ExerciseError(f"{where} returned {len(got)} positions: each of the {world} rank(s) holds "
                                    f"n / world = {n // world} of them")
            raise ExerciseError(f"{where} returned {_short(got)}, expected {_short(want)}")
    passed(f"{name} gives every rank its two chunks, r and 2 * world - 1 - r, for {len(POSITION_CASES)} "
           "sequences on 1 to 8 ranks")


def _short(values, most=12):
    if len(values) <= most:
        return str(values)
    return f"[{', '.join(map(str, values[:most]))}, ...] ({len(values)} in all)"


# --- Exercise 2: the blocks of a ring step -----------------------------------------------------------

CASE_HINTS = {
    "own": "At step 0 (source == rank) the rank holds its own K/V: the same positions as its queries, in "
           "increasing order, so the causal mask on the shard's own positions is the causal mask of the "
           "whole sequence (one call with causal=True on everything).",
    "before": "When the source comes first (source < rank), its chunk `source` lies before both of this "
              "rank's chunks and its chunk 2w - 1 - source after both: every query sees all of the first "
              "half of the keys and none of the second.",
    "after": "When the source comes later (source > rank), both of its chunks lie after this rank's chunk "
             "`rank` and before its chunk 2w - 1 - rank: the second half of the queries sees every key, the "
             "first half none.",
}


def _blocks(got, where):
    """The learner's list of (q_chunks, kv_chunks, causal) as Blocks, or a clear error."""
    shape = ("should return a list of (q_chunks, kv_chunks, causal) with q_chunks and kv_chunks pairs "
             "(lo, hi) of chunk indices 0, 1 or 2 of the shards, lo < hi")
    if not isinstance(got, (list, tuple)):
        raise ExerciseError(f"{where} {shape}; got {type(got).__name__}")
    blocks = []
    for item in got:
        try:
            (q_lo, q_hi), (kv_lo, kv_hi), causal = item
            q_lo, q_hi, kv_lo, kv_hi = (int(x) for x in (q_lo, q_hi, kv_lo, kv_hi))
        except (TypeError, ValueError):
            raise ExerciseError(f"{where} {shape}; got {got!r}") from None
        if not (0 <= q_lo < q_hi <= 2 and 0 <= kv_lo < kv_hi <= 2):
            raise ExerciseError(f"{where} returned the block {item!r}: {shape}")
        if not isinstance(causal, (bool, np.bool_)):
            raise ExerciseError(f"{where} returned the block {item!r}: causal must be True or False")
        blocks.append(Block((q_lo, q_hi), (kv_lo, kv_hi), bool(causal)))
    return blocks


def check_zigzag_blocks(zigzag_blocks):
    """Chapter 13: ``zigzag_blocks(rank, source, world)`` must return the kernel calls that rank
    ``rank`` makes under the causal mask against the K/V shard of rank ``source``, with the zigzag
    layout: a list of ``(q_chunks, kv_chunks, causal)``, each ``(lo, hi)`` a range of the two chunks
    of a shard (0 and 1), ``causal`` for the kernel's top-left causal mask. Together they must
    compute every score the causal mask of the whole sequence shows, once, and nothing else."""
    name = getattr(zigzag_blocks, "__name__", "zigzag_blocks")
    chunk, calls = 3, 0
    for world in range(1, 6):
        for rank in range(world):
            for source in range(world):
                where = f"{name}(rank={rank}, source={source}, world={world})"
                blocks = _blocks(attempt(zigzag_blocks, rank, source, world, name=name, forbid=("flashattn",)),
                                 where)
                calls += len(blocks)
                got = covered(blocks, 2 * chunk, chunk)
                want = visible(rank, source, world, "zigzag", chunk).astype(np.int64)
                if np.array_equal(got, want):
                    continue
                hint = CASE_HINTS["own" if source == rank else "before" if source < rank else "after"]
                q_pos = positions(rank, world, 2 * world * chunk).tolist()
                k_pos = positions(source, world, 2 * world * chunk).tolist()
                for kind, mask in (("computes a score the causal mask hides", (got > 0) & (want == 0)),
                                   ("computes a score twice", got > 1),
                                   ("never computes a score the query sees", (got == 0) & (want == 1))):
                    if mask.any():
                        i, j = (int(x) for x in np.argwhere(mask)[0])
                        raise ExerciseError(
                            f"{where} {kind}: query position {q_pos[i]} against key position {k_pos[j]} (with "
                            f"chunks of {chunk} positions: query {i} of the rank's shard, key {j} of the held "
                            f"one). {hint}")
    passed(f"{name} computes every visible score once and nothing else, for every rank and source on 1 to 5 "
           f"ranks ({calls} kernel calls in all)")


# --- Exercise 1: one step of the ring's merge --------------------------------------------------------

LN2 = float(np.log(2.0))


def _block_states(g, rows, sizes, head_dim, shift, hidden=()):
    """The partial states of ``rows`` rows whose keys are cut into blocks of ``sizes`` keys, as a
    kernel call returns them: ``O_t`` (divided by its own sum) and ``LSE_t`` (base 2), float32; a
    block in ``hidden`` is hidden from the even rows (``LSE_t = -inf``, ``O_t = 0``), as the causal
    mask hides a later block. Also the whole rows' ``(o, lse)`` in float64, from every key at once."""
    scores = [torch.randn(rows, n, generator=g, dtype=torch.float64) * 2 + shift
              + 3 * torch.randn((), generator=g, dtype=torch.float64) for n in sizes]
    values = [torch.randn(rows, n, head_dim, generator=g, dtype=torch.float64) for n in sizes]
    for t in hidden:
        scores[t][0::2] = float("-inf")
    states = []
    for s, v in zip(scores, values):
        lse = torch.logsumexp(s, -1)
        o = torch.where(torch.isfinite(lse)[:, None], (torch.softmax(s, -1)[..., None] * v).sum(-2), 0.0)
        states.append((o.float(), (lse / LN2).float()))
    s, v = torch.cat(scores, -1), torch.cat(values, -2)
    lse = torch.logsumexp(s, -1)
    whole = torch.where(torch.isfinite(lse)[:, None], (torch.softmax(s, -1)[..., None] * v).sum(-2), 0.0)
    return states, (whole, lse / LN2)


def _merge_step64(o, lse, o_t, lse_t, variant=None):
    """One step of the merge in float64 (the reference), or with a known mistake (``variant``)."""
    o, lse, o_t, lse_t = o.double(), lse.double(), o_t.double(), lse_t.double()
    m = torch.maximum(lse, lse_t)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    exp = torch.exp if variant == "natural exp" else torch.exp2
    w, w_t = exp(lse - m), exp(lse_t - m)
    if variant == "weights swapped":
        w, w_t = w_t, w
    total = w + w_t
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = (w / safe)[..., None] * o + (w_t / safe)[..., None] * o_t
    if variant == "no weights":
        out = (o + o_t) / 2
    log = torch.log if variant in ("natural exp", "natural log") else torch.log2
    new = torch.where(total > 0, m + log(safe), torch.full_like(m, float("-inf")))
    if variant == "lse without M":
        new = torch.where(total > 0, torch.log2(safe), torch.full_like(m, float("-inf")))
    elif variant == "lse is the max":
        new = torch.where(total > 0, m, torch.full_like(m, float("-inf")))
    return out, new


STEP_HINTS = {
    "no weights": "the new O is the plain mean of O and O_t. Each is the average over its own keys only: "
                  "weigh them by their shares of the whole sum, 2**(LSE - LSE') and 2**(LSE_t - LSE').",
    "weights swapped": "the two weights are swapped: the running O is weighed by 2**(LSE - LSE') (its own "
                       "sum's share), the block's O_t by 2**(LSE_t - LSE').",
    "natural exp": "the weights use e**x. The LSE are in base 2 (the kernels work with exp2): weigh with "
                   "2**(LSE - M) (torch.exp2) and take log2 of the sum.",
    "natural log": "LSE' is in natural log. The inputs are base 2 and so is the result: "
                   "LSE' = M + log2(2**(LSE - M) + 2**(LSE_t - M)) (torch.log2, not torch.log).",
    "lse without M": "LSE' is missing the max: the sum was taken relative to M = max(LSE, LSE_t), so "
                     "LSE' = M + log2(2**(LSE - M) + 2**(LSE_t - M)).",
    "lse is the max": "LSE' is the larger of the two LSE: it must also count the smaller state's sum, "
                      "LSE' = M + log2(2**(LSE - M) + 2**(LSE_t - M)).",
}

#: The cases of the check: (what, rows, block sizes, head dim, shift of the scores, blocks hidden
#: from the even rows, O_t's dtype).
STEP_CASES = [
    ("two blocks", 5, (7, 9), 8, 0.0, (), torch.float32),
    ("a ring of four blocks folded into the empty state", 6, (4, 4, 4, 4), 16, 0.0, (), torch.float32),
    ("blocks the causal mask hides from some rows (LSE_t = -inf, O_t = 0)", 6, (5, 6, 7), 8, 0.0, (1, 2),
     torch.float32),
    ("scores near +300 (2**300 overflows float32)", 4, (5, 9, 4), 8, 300 * LN2, (), torch.float32),
    ("scores near -300 (2**-300 is 0 in float32)", 4, (5, 9, 4), 8, -300 * LN2, (), torch.float32),
    ("O_t in bfloat16, as a bf16 kernel returns it", 4, (6, 6, 6), 8, 0.0, (), torch.bfloat16),
    ("a row that no block shows a key (every LSE_t = -inf)", 4, (3, 5), 8, 0.0, (0, 1), torch.float32),
]


def _fold(merge, states, rows, head_dim, dtype):
    """The running state after folding ``states`` into the empty one with ``merge``."""
    o = torch.zeros(rows, head_dim)
    lse = torch.full((rows,), float("-inf"))
    for o_t, lse_t in states:
        o, lse = merge(o, lse, o_t.to(dtype), lse_t)
    return o, lse


def check_merge_step(merge_step):
    """Chapter 13: ``merge_step(o, lse, o_t, lse_t)`` must merge the running state ``(o, lse)``
    (float32, base 2) with a block's partial state ``(o_t, lse_t)`` (o_t in the kernel's dtype)
    into the new running state, o in float32: the ring's merge, step by step."""
    name = getattr(merge_step, "__name__", "merge_step")
    g = torch.Generator().manual_seed(13)
    for stage, rows, sizes, head_dim, shift, hidden, dtype in STEP_CASES:
        states, (want_o, want_lse) = _block_states(g, rows, sizes, head_dim, shift, hidden)
        where = f" (case: {stage}; {len(sizes)} block(s) folded in turn into the empty state, O = 0, LSE = -inf)"

        def learner(o, lse, o_t, lse_t):
            out = attempt(merge_step, o.clone(), lse.clone(), o_t.clone(), lse_t.clone(), name=name,
                          forbid=("flashattn", "softmax"))
            if not isinstance(out, (tuple, list)) or len(out) != 2:
                raise ExerciseError(f"{name} should return a tuple (o, lse), got {type(out).__name__}"
                                    + (f" of {len(out)} items" if isinstance(out, (tuple, list)) else ""))
            o_new, lse_new = (torch.as_tensor(x) for x in out)
            if tuple(o_new.shape) != tuple(o.shape) or tuple(lse_new.shape) != tuple(lse.shape):
                raise ExerciseError(f"{name} returned o of shape {tuple(o_new.shape)} and lse of shape "
                                    f"{tuple(lse_new.shape)}; expected those of the running state, "
                                    f"{tuple(o.shape)} and {tuple(lse.shape)}{where}")
            if o_new.dtype != torch.float32:
                raise ExerciseError(f"{name} returned o in {o_new.dtype}{where}: keep the running O in "
                                    "float32, whatever the block's dtype (o_t.float()). In bfloat16 every "
                                    "step would round it again, W roundings in all.")
            return o_new, lse_new

        o, lse = _fold(learner, states, rows, head_dim, dtype)
        if torch.isnan(o).any() or torch.isnan(lse).any():
            raise ExerciseError(
                f"{name} returns NaN{where}. When both states are empty (a row that has seen no key yet meets a "
                "block hidden from it), M = max(LSE, LSE_t) = -inf and LSE - M = -inf - (-inf) = NaN, and "
                "2**(LSE - M) + 2**(LSE_t - M) = 0 makes a 0/0. "
                "Use a finite stand-in for M when it is -inf (torch.where(M == -inf, 0, M)) and divide by 1 "
                "where the sum is 0: a row without keys stays O = 0, LSE = -inf.")
        if abs(shift) > 100 and not (torch.isfinite(o).all() and torch.isfinite(lse).all()):
            raise ExerciseError(
                f"{name} returns inf{where}. 2**LSE overflows float32 above 2**128 and is 0 below 2**-149: "
                "subtract M = max(LSE, LSE_t) first and weigh with 2**(LSE - M) and 2**(LSE_t - M), each at most 1.")
        for what, got, want, index, atol in (("o", o, want_o, 0, 3e-5 if dtype == torch.float32 else 1e-2),
                                             ("lse", lse, want_lse, 1, 1e-5)):
            if close(got, want, atol, 1e-4):
                continue
            for variant, hint in STEP_HINTS.items():
                wrong = _fold(lambda *a: _merge_step64(*a, variant=variant), states, rows, head_dim, dtype)[index]
                if not close(wrong, want, atol, 1e-4) and close(got, wrong, atol, 1e-4):
                    raise ExerciseError(f"{name}: {what} is wrong{where}: {hint}")
            try:
                expect_close(f"{name}: {what}", got, want, atol=atol, rtol=1e-4)
            except ExerciseError as error:
                raise ExerciseError(f"{error}{where}") from None
    passed(f"{name} folds the blocks of a ring into the exact rows in {len(STEP_CASES)} cases: hidden blocks, "
           "rows without keys, LSE far beyond float32's range of 2**x, blocks in bfloat16")
