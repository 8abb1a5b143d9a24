"""Checkers of chapter 11: how many splits a decoding step's cache is cut into (the wave model of
``flashattn.kernels.decode.choose_num_splits``), and the merge of the splits' partial states, a
Triton kernel (what ``flashattn.decode``'s merge kernel does).
"""
import math

import torch
import triton

from ...gpu.runtime import DEVICE
from ...kernels.decode import MAX_SPLITS, MIN_TILES_PER_SPLIT, PROGRAMS_PER_SM
from .common import ExerciseError, attempt, close, expect_close, launch_learner_kernel, passed

LN2 = math.log(2.0)

# --- Exercise 1: how many splits -----------------------------------------------------------------


def _num_splits(programs, n_seen, block_kv, n_sm, variant=None):
    """The split count of the wave model (the reference), or by a known mistake (``variant``)."""
    if programs <= 0 or n_seen <= 0:
        return 1
    aim = PROGRAMS_PER_SM * n_sm / programs
    wanted = math.ceil(aim) if variant == "ceiling" else round(aim)
    tiles = n_seen // block_kv if variant == "floor tiles" else -(-n_seen // block_kv)
    most = tiles // MIN_TILES_PER_SPLIT
    if variant == "no tile limit":
        most = wanted
    count = min(wanted, most) if variant == "no cap" else min(wanted, most, MAX_SPLITS)
    return count if variant == "zero" else max(1, count)


#: (programs, keys seen, tile of keys, SMs): the benchmark's setting and around it.
SPLIT_CASES = [(64, 16384, 64, 132), (64, 4096, 64, 132), (64, 65536, 64, 132), (8, 65536, 64, 132),
               (512, 16384, 64, 132), (600, 16384, 64, 132), (64, 300, 64, 132), (16, 100, 64, 132),
               (64, 1000, 64, 132), (64, 16384, 64, 108), (48, 16384, 64, 132), (40, 16384, 64, 132),
               (96, 1000, 64, 132), (1, 1 << 20, 64, 132), (1, 1 << 20, 16, 8), (2, 200, 16, 8),
               (2, 260, 64, 8), (16, 0, 64, 132), (0, 4096, 64, 132), (4, 2000, 32, 20), (3, 100, 16, 8),
               (300, 65536, 128, 132), (132, 8192, 64, 132)]

SPLIT_HINTS = {
    "ceiling": "rounded the aim of {aim:.3f} splits up, to {got}: then {got} x {p} = {total} programs on {n_sm} "
               "SMs, and the last wave is only partly full. The wave model says what a partial wave costs: "
               "the SMs without a program in it wait. Take the whole number nearest to the aim.",
    "floor tiles": "counted the tiles of {n_seen} keys as {n_seen} // {block_kv}: the last, partial tile is a "
                   "tile too (ceil({n_seen} / {block_kv}) = {tiles}), so the limit is {tiles} // {min_tiles}.",
    "no tile limit": "gives {got} splits for {tiles} tile(s) of keys: a split must get at least {min_tiles} whole "
                     "tiles (at most {tiles} // {min_tiles} splits), or its partial state costs more than it saves.",
    "no cap": "gives {got} splits: at most {most} (the merge reads all the partial states of a row as one tile).",
    "zero": "returned 0 splits: every sequence needs at least one split (1 means no merge at all).",
}


def check_choose_num_splits(choose_num_splits):
    """Chapter 11: ``choose_num_splits(programs, n_seen, block_kv, n_sm)`` must give the whole number
    of splits nearest to PROGRAMS_PER_SM programs per SM, at most the tiles of keys over
    MIN_TILES_PER_SPLIT and at most MAX_SPLITS, at least 1 (1 when there is nothing to split)."""
    name = getattr(choose_num_splits, "__name__", "choose_num_splits")
    for programs, n_seen, block_kv, n_sm in SPLIT_CASES:
        where = f"{name}(programs={programs}, n_seen={n_seen}, block_kv={block_kv}, n_sm={n_sm})"
        got = attempt(choose_num_splits, programs, n_seen, block_kv, n_sm, name=name, forbid=("flashattn",))
        if isinstance(got, float) and got.is_integer():
            got = int(got)
        if not isinstance(got, int) or isinstance(got, bool):
            raise ExerciseError(f"{where} should return a whole number of splits (an int), got {got!r}")
        want = _num_splits(programs, n_seen, block_kv, n_sm)
        if got == want:
            continue
        tiles = -(-n_seen // block_kv)
        facts = dict(aim=PROGRAMS_PER_SM * n_sm / max(programs, 1), got=got, p=programs, total=got * programs,
                     n_sm=n_sm, n_seen=n_seen, block_kv=block_kv, tiles=tiles, min_tiles=MIN_TILES_PER_SPLIT,
                     most=MAX_SPLITS)
        for variant, hint in SPLIT_HINTS.items():
            if got == _num_splits(programs, n_seen, block_kv, n_sm, variant):
                raise ExerciseError(f"{where} {hint.format(**facts)}")
        if programs <= 0 or n_seen <= 0:
            raise ExerciseError(f"{where} returned {got}: with nothing to split (no program or no key), "
                                "the answer is 1 split, no merge.")
        raise ExerciseError(f"{where} returned {got}, expected {want}: the nearest whole number to "
                            f"{PROGRAMS_PER_SM} x {n_sm} / {programs} = {facts['aim']:.3f}, but at most "
                            f"{tiles} tile(s) // {MIN_TILES_PER_SPLIT} and at most {MAX_SPLITS}, at least 1.")
    passed(f"{name} picks the split count of the wave model in {len(SPLIT_CASES)} settings: whole waves of about "
           f"{PROGRAMS_PER_SM} programs per SM, at least {MIN_TILES_PER_SPLIT} tiles a split, short caches and "
           "full GPUs unsplit")


# --- Exercise 2: the merge kernel ----------------------------------------------------------------

UNTOUCHED = -7.0  # what the output's buffer holds past the output, where nothing may be written


def _partials(g, rows, sizes, head_dim, spread, shift):
    """Partial states of ``rows`` rows whose keys are cut into splits of ``sizes`` keys (0: a
    split without keys): ``O_s`` (each divided by its own sum) and ``LSE_s`` (base 2, -inf for an
    empty split), float32, as the split kernel writes them. Each split's scores get their own
    offset, so that the splits' LSE differ, and ``shift`` moves them all."""
    o_parts = torch.zeros(rows, len(sizes), head_dim, dtype=torch.float64)
    lse_parts = torch.full((rows, len(sizes)), float("-inf"), dtype=torch.float64)
    for split, size in enumerate(sizes):
        if size == 0:
            continue
        s = torch.randn(rows, size, generator=g, dtype=torch.float64) * spread
        s = s + shift + 4 * torch.randn((), generator=g, dtype=torch.float64)
        v = torch.randn(rows, size, head_dim, generator=g, dtype=torch.float64)
        lse_parts[:, split] = torch.logsumexp(s, -1) / LN2
        o_parts[:, split, :] = (torch.softmax(s, -1)[..., None] * v).sum(-2)
    return o_parts.float(), lse_parts.float()


def _merge64(o_parts, lse_parts, variant=None):
    """The merge in float64 (the reference), or with a known mistake (``variant``) so that a wrong
    answer can be named. ``"padding weighs"``: the splits past num_splits, up to the next power of
    two, read as LSE_s = 0 and O_s = 0."""
    o_parts, lse_parts = o_parts.double(), lse_parts.double()
    if variant == "padding weighs":
        pad = triton.next_power_of_2(lse_parts.shape[-1]) - lse_parts.shape[-1]
        lse_parts = torch.cat([lse_parts, torch.zeros(*lse_parts.shape[:-1], pad, dtype=torch.float64)], -1)
        o_parts = torch.cat([o_parts, torch.zeros(*o_parts.shape[:-2], pad, o_parts.shape[-1],
                                                  dtype=torch.float64)], -2)
    m = lse_parts.max(-1, keepdim=True).values
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    exp = torch.exp if variant == "natural exp" else torch.exp2
    w = exp(lse_parts - m_safe)
    l = w.sum(-1, keepdim=True)
    l_safe = torch.where(l > 0, l, torch.ones_like(l))
    o = (w[..., None] * o_parts).sum(-2) / l_safe
    if variant == "no weights":
        o = o_parts.mean(-2)
    elif variant == "divided twice":
        o = o / l_safe
    log = torch.log if variant in ("natural exp", "natural log") else torch.log2
    lse = torch.where(l > 0, m_safe + log(l_safe), torch.full_like(l, float("-inf"))).squeeze(-1)
    if variant == "lse without M":
        lse = torch.where(l > 0, torch.log2(l_safe), torch.full_like(l, float("-inf"))).squeeze(-1)
    return o, lse


MERGE_HINTS = {
    "padding weighs": "the splits past num_splits (BLOCK_S is the next power of two) were read as LSE_s = 0, so "
                      "they weigh 2**(0 - M). Load the LSE_s with mask=offs_s < num_splits and "
                      "other=float(\"-inf\"): a split that does not exist weighs 2**-inf = 0.",
    "no weights": "O is the plain mean of the O_s. Each O_s is the average over its own split's keys "
                  "only, so it must be weighed by that split's share of the whole sum, "
                  "2**(LSE_s - LSE): a split whose scores are larger counts for more.",
    "divided twice": "O looks divided by the sum twice. The weights 2**(LSE_s - M) / L already sum to 1 "
                     "and each O_s is already divided by its own sum: divide sum_s w_s O_s by "
                     "L = sum_s w_s once, and nothing else.",
    "natural exp": "the weights use e**x. The LSE_s are in base 2 (the kernel works with exp2): weigh "
                   "with 2**(LSE_s - M) (tl.exp2) and take log2 of the sum.",
    "natural log": "LSE is in natural log. The inputs are base 2 and so is the result: "
                   "LSE = M + log2(sum_s 2**(LSE_s - M)) (tl.log2, not tl.log).",
    "lse without M": "LSE is missing the max: the sum was taken relative to M = max_s LSE_s, so "
                     "LSE = M + log2(sum_s 2**(LSE_s - M)).",
}


def run_merge_kernel(kernel, o_parts, lse_parts, name="merge_splits"):
    """Launch the learner's merge ``kernel`` on (rows, S, D) partial states, one program per row,
    with BLOCK_S and BLOCK_D the next powers of two. The inputs lie in buffers whose tail holds NaN
    (a read past the last row shows), O in a buffer whose tail holds UNTOUCHED (a store past the
    last row shows). Returns ``(o, lse, o's buffer)``."""
    rows, splits, head_dim = o_parts.shape
    guard = 64
    o_in = torch.full((rows * splits * head_dim + guard,), float("nan"), device=DEVICE)
    o_in[:rows * splits * head_dim] = o_parts.reshape(-1).to(DEVICE)
    lse_in = torch.full((rows * splits + guard,), float("nan"), device=DEVICE)
    lse_in[:rows * splits] = lse_parts.reshape(-1).to(DEVICE)
    o_buffer = torch.full((rows * head_dim + guard,), UNTOUCHED, device=DEVICE)
    o = o_buffer[:rows * head_dim]
    o.fill_(float("nan"))
    lse = torch.full((rows,), float("nan"), device=DEVICE)
    launch_learner_kernel(kernel, (rows,), (o_in, lse_in, o, lse, splits),
                          dict(HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
                               BLOCK_S=triton.next_power_of_2(splits)), name, kernel)
    return o.view(rows, head_dim).cpu(), lse.cpu(), o_buffer.cpu()


def check_merge_splits(merge_splits):
    """Chapter 11: the @triton.jit ``merge_splits(O_PART, LSE_PART, O, LSE, num_splits, HEAD_DIM,
    BLOCK_D, BLOCK_S)``, one program per row, must merge the row's ``num_splits`` partial states
    (O_PART (rows, S, D) and LSE_PART (rows, S), float32, LSE_s in base 2) into O (rows, D) and LSE
    (rows,) in base 2: o = sum_s 2**(LSE_s - LSE) O_s, lse = log2 sum_s 2**LSE_s, and o = 0,
    lse = -inf for a row whose splits are all empty."""
    name = getattr(getattr(merge_splits, "fn", merge_splits), "__name__", "merge_splits")
    g = torch.Generator().manual_seed(10)
    stages = [  # (what, rows, split sizes, head dim, spread of scores, shift)
        ("two splits", 5, (7, 9), 16, 1.0, 0.0),
        ("one split", 3, (13,), 16, 2.0, 0.0),
        ("four splits, ragged", 6, (16, 16, 16, 5), 32, 3.0, 0.0),
        ("three splits (BLOCK_S = 4: one split past num_splits)", 4, (6, 6, 6), 16, 5.0, 0.0),
        ("head dim 24 (BLOCK_D = 32: columns past HEAD_DIM)", 4, (5, 8), 24, 1.0, 0.0),
        ("an empty split between two (LSE_s = -inf, O_s = 0)", 4, (8, 0, 5), 16, 1.0, 0.0),
        ("large scores (LSE_s above 200: 2**200 overflows float32)", 3, (5, 9, 4), 16, 1.0, 150.0),
        ("very negative scores (LSE_s below -200: 2**-200 is 0 in float32)", 3, (5, 9, 4), 16, 1.0, -150.0),
        ("every split empty (a sequence of length 0)", 3, (0, 0, 0), 16, 1.0, 0.0),
    ]
    for stage, rows, sizes, head_dim, spread, shift in stages:
        o_parts, lse_parts = _partials(g, rows, sizes, head_dim, spread, shift)
        want_o, want_lse = _merge64(o_parts, lse_parts)
        where = f" (case: {stage}; O_PART of shape {tuple(o_parts.shape)})"
        o, lse, buffer = run_merge_kernel(merge_splits, o_parts, lse_parts, name)
        if (buffer[rows * head_dim:] != UNTOUCHED).any():
            raise ExerciseError(
                f"{name} wrote past the end of O{where}: a row has HEAD_DIM = {head_dim} columns, the tile "
                f"BLOCK_D = {triton.next_power_of_2(head_dim)}. Mask the store with offs_d < HEAD_DIM.")
        if sum(sizes) == 0 and (torch.isnan(o).any() or torch.isnan(lse).any()):
            raise ExerciseError(
                f"{name} stores NaN{where}. With every LSE_s = -inf, M = -inf and LSE_s - M = "
                "-inf - (-inf) = NaN; and L = 0 makes sum_s w_s O_s / L = 0/0. Use a finite stand-in "
                "for M when it is -inf (tl.where(m == float(\"-inf\"), 0.0, m)) and divide by 1 where "
                "L = 0, so that the row gets o = 0 and lse = -inf, the empty sum.")
        if abs(shift) > 100 and not (torch.isfinite(o).all() and torch.isfinite(lse).all()):
            raise ExerciseError(
                f"{name} stores inf or NaN{where}. 2**LSE_s overflows float32 above 2**128 and is 0 "
                "below 2**-149: subtract the largest LSE_s first, M = max_s LSE_s, and weigh with "
                "2**(LSE_s - M), which is at most 1 (chapter 01's merge, in base 2).")
        if torch.isnan(o).any() and not torch.isnan(want_o).any():
            raise ExerciseError(
                f"{name} stores NaN{where}. The splits past num_splits (up to BLOCK_S) or the columns past "
                "HEAD_DIM were read from memory that is not this row's (NaN here): mask the loads of O_PART "
                "with offs_s < num_splits and offs_d < HEAD_DIM, other=0.0.")
        for what, got, want, index, atol, rtol in (("O", o, want_o, 0, 1e-5, 1e-4),
                                                    ("LSE", lse, want_lse, 1, 1e-5, 1e-5)):
            if close(got, want, atol, rtol):
                continue
            for variant, hint in MERGE_HINTS.items():
                wrong = _merge64(o_parts, lse_parts, variant)[index]
                if not close(wrong, want, atol, rtol) and close(got, wrong, atol, rtol):
                    raise ExerciseError(f"{name}: {what} is wrong{where}: {hint}")
            if index == 0 and rows > 1 and len(sizes) > 1 and close(got[:1], want[:1], atol, rtol):
                raise ExerciseError(
                    f"{name}: O is right in row 0 and wrong in the rows after it{where}. Row r's partial "
                    "outputs start r * num_splits * HEAD_DIM elements into O_PART (each row has num_splits "
                    "of them), its LSE_s r * num_splits elements into LSE_PART.")
            try:
                expect_close(f"{name}: {what}", got, want, atol=atol, rtol=rtol)
            except ExerciseError as error:
                raise ExerciseError(f"{error}{where}") from None
    passed(f"{name} merges split partial states in {len(stages)} cases: one to four splits, splits and columns "
           "past the tile's, empty splits, rows without keys, and LSE_s far beyond float32's range of 2**x")
