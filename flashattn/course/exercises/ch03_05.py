"""Checkers of chapters 03 and 05: classifying the tiles and the tiled forward in PyTorch (03), the
stage boundaries and the forward kernel's inner loop in Triton (05), with the kernel that runs a
learner's inner loop (``fwd_exercise_kernel``). Chapter 04's Triton ladder is checked in ``ch04_ladder``.
"""
import math

import numpy as np
import torch
import triton
import triton.language as tl

from ..notebook import pick
from ...testing.reference import naive_attention
from ...gpu.runtime import DEVICE
from ...kernels.tiles import LN2, LOG2E, kv_stage_bounds
from ...kernels.traversal import FULL, MASKED, SKIPPED, cdiv, classify_blocks, kv_ranges
from .common import (ExerciseError, attempt, check_references, close, expect_close, is_stub,
                     launch_learner_kernel, passed)


def _tile_kinds_by_definition(n_q, n_kv, block_q, block_kv, is_causal):
    """Tile kinds from the definition, pair by pair. A tile holds the BLOCK_Q query rows of its
    block (the kernel computes all of them, even past n_q, and stores only the real ones) and the
    BLOCK_KV key columns of its block; a pair (i, j) exists when key j is inside the sequence
    (j < n_kv) and, if causal, j <= i. Full: every pair exists; skipped: none; masked: some."""
    nqb, nkb = cdiv(n_q, block_q), cdiv(n_kv, block_kv)
    i = np.arange(nqb * block_q)[:, None]
    j = np.arange(nkb * block_kv)[None, :]
    exists = (j < n_kv) & ((j <= i) | (not is_causal))
    tiles = exists.reshape(nqb, block_q, nkb, block_kv)
    every, some = tiles.all(axis=(1, 3)), tiles.any(axis=(1, 3))
    return np.where(every, FULL, np.where(some, MASKED, SKIPPED)).astype(np.int8), exists


def _classify_cases():
    """(n_q, n_kv, block_q, block_kv, is_causal): aligned, ragged, N_q != N_kv, BLOCK_Q != BLOCK_KV,
    one-element sequences, and random ones (fixed seed)."""
    cases = [(64, 64, 16, 16), (69, 69, 32, 16), (69, 69, 16, 32), (17, 113, 32, 32), (113, 17, 32, 16),
             (40, 100, 16, 16), (100, 40, 8, 16), (1, 1, 16, 16), (5, 70, 4, 8), (200, 130, 64, 16),
             (128, 128, 64, 64), (96, 33, 32, 64), (33, 96, 64, 32)]
    rng = np.random.default_rng(3)
    for _ in range(40):
        cases.append((int(rng.integers(1, 160)), int(rng.integers(1, 160)),
                      int(2 ** rng.integers(2, 7)), int(2 ** rng.integers(2, 7))))
    return [(*c, causal) for c in cases for causal in (True, False)]


def _why_tile(kind, want, qb, kb, exists, n_q, n_kv, block_q, block_kv):
    """One pair of the tile that shows why its kind is ``want``, in words."""
    rows = range(qb * block_q, (qb + 1) * block_q)
    cols = range(kb * block_kv, (kb + 1) * block_kv)
    tile = exists[qb * block_q:(qb + 1) * block_q, kb * block_kv:(kb + 1) * block_kv]
    def row(i):
        return f"query {i}" + (" (a padding row of the last block)" if i >= n_q else "")
    if want == FULL or (kind == FULL and tile.any()):
        if want == FULL:
            return f"every query {rows.start}..{rows.stop - 1} sees every key {cols.start}..{cols.stop - 1}"
        r, c = np.argwhere(~tile)[0]
        i, j = rows.start + r, cols.start + c
        why = f"key {j} is past the end (n_kv = {n_kv})" if j >= n_kv else f"{row(i)} does not see key {j} (j > i)"
        return f"not every pair exists: {why}"
    if tile.any():
        r, c = np.argwhere(tile)[0]
        return f"some pairs exist: {row(rows.start + r)} sees key {cols.start + c}"
    return (f"no pair exists: the last row of the block, {rows.stop - 1}, sees keys up to {rows.stop - 1}, "
            f"and this tile starts at key {cols.start}" if cols.start < n_kv else
            f"no pair exists: key {cols.start} is past the end (n_kv = {n_kv})")


def check_classify_tiles(classify):
    """Chapter 03: ``classify(n_q, n_kv, block_q, block_kv, is_causal)`` must return the forward
    kernel's tile map, an integer array of shape (query blocks, key blocks) holding 2 (full),
    1 (masked) or 0 (skipped). Compared with the definition on about a hundred cases."""
    from ...plotting import TILE_NAMES

    cases = _classify_cases()
    for n_q, n_kv, block_q, block_kv, causal in cases:
        call = f"classify({n_q}, {n_kv}, {block_q}, {block_kv}, is_causal={causal})"
        want, exists = _tile_kinds_by_definition(n_q, n_kv, block_q, block_kv, causal)
        got = attempt(classify, n_q, n_kv, block_q, block_kv, causal, name="classify", forbid=("flashattn",))
        try:
            got = np.asarray(got)
        except Exception:
            raise ExerciseError(f"{call} should return an array, got {type(got).__name__}") from None
        if got.shape != want.shape:
            raise ExerciseError(f"{call} returned shape {got.shape}; expected {want.shape} = "
                                f"(cdiv({n_q}, {block_q}), cdiv({n_kv}, {block_kv})): one entry per tile, "
                                "a ragged last block counts as a whole block")
        if not np.isin(got, (0, 1, 2)).all():
            raise ExerciseError(f"{call} returned values {sorted(set(got.ravel().tolist()))}; "
                                "use only 0 (skipped), 1 (masked) and 2 (full)")
        wrong = got != want
        if not wrong.any():
            continue
        qb, kb = (int(x) for x in np.argwhere(wrong)[0])
        message = (f"{call} is wrong at {int(wrong.sum())} of {want.size} tiles. First: tile "
                   f"(query block {qb}, key block {kb}), queries {qb * block_q}..{(qb + 1) * block_q - 1}, "
                   f"keys {kb * block_kv}..{(kb + 1) * block_kv - 1}: you said {TILE_NAMES.get(int(got[qb, kb]))!r}, "
                   f"it is {TILE_NAMES[int(want[qb, kb])]!r} because "
                   + _why_tile(int(got[qb, kb]), int(want[qb, kb]), qb, kb, exists, n_q, n_kv, block_q, block_kv)
                   + ". The wrong tiles are outlined in red on the left.")
        import matplotlib.pyplot as plt

        from ...plotting import tile_kinds_map

        fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
        tile_kinds_map(got, n_q, n_kv, block_q, block_kv, causal, ax=axes[0], wrong=wrong, title="yours")
        tile_kinds_map(want, n_q, n_kv, block_q, block_kv, causal, ax=axes[1], title="expected")
        fig.suptitle(call, fontsize=10)
        fig.tight_layout()
        plt.show()
        raise ExerciseError(message)
    passed(f"classify gives the right tile map in all {len(cases)} cases (ragged, N_q != N_kv, "
           "BLOCK_Q != BLOCK_KV, causal and not)")


def tiled_forward_with_mistake(q, k, v, is_causal, block_q, block_kv, scale=None, mistake=None):
    """The forward kernel's tile loop in float64, exactly as flashattn runs it (keys padded to
    whole tiles), optionally with one classic mistake, named as in :data:`FORWARD_MISTAKES`.
    Returns ``(out, natural lse, tiles computed)``. The checkers recognise a learner's mistake by
    running these very variants on the same inputs; chapter 05 draws their error heatmaps."""
    if mistake is not None and mistake not in FORWARD_MISTAKES:
        raise ValueError(f"mistake must be one of {sorted(FORWARD_MISTAKES)} or None, got {mistake!r}")
    q, k, v = q.double(), k.double(), v.double()
    n_q, n_kv = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    pad = cdiv(n_kv, block_kv) * block_kv - n_kv
    kp = torch.cat([k, k.new_zeros(*k.shape[:-2], pad, k.shape[-1])], -2)
    vp = torch.cat([v, v.new_zeros(*v.shape[:-2], pad, v.shape[-1])], -2)
    qk_scale = {"no_scale": 1.0, "scale_one": LOG2E}.get(mistake, scale * LOG2E)
    exp = torch.exp if mistake == "exp" else torch.exp2
    no_alpha_l, no_alpha_acc = mistake in ("alpha_l", "alpha"), mistake in ("alpha_acc", "alpha")
    out = torch.zeros_like(q)
    lse = q.new_zeros(q.shape[:-1])
    tiles = 0
    for q_start in range(0, n_q, block_q):
        rows = torch.arange(q_start, min(q_start + block_q, n_q))
        m = q.new_full((*q.shape[:-2], len(rows)), float("-inf"))
        l = q.new_zeros(m.shape)
        acc = q.new_zeros((*m.shape, q.shape[-1]))
        full_end, end = kv_ranges(q_start, block_q, block_kv, n_kv, is_causal)
        if mistake == "drop_tail":
            end = n_kv // block_kv * block_kv
        for kv_start in range(0, end, block_kv):
            tiles += 1
            cols = torch.arange(kv_start, kv_start + block_kv)
            s = q[..., rows, :] @ kp[..., cols, :].transpose(-2, -1)
            visible = torch.ones(len(rows), block_kv, dtype=torch.bool)
            if mistake != "ragged":
                visible &= cols[None, :] < n_kv
            if is_causal and mistake == "causal_off_by_one":
                visible &= cols[None, :] <= rows[:, None] + 1
            elif is_causal and mistake != "causal":
                visible &= cols[None, :] <= rows[:, None]
            s = s.masked_fill(~visible, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1) * qk_scale)
            p = exp(s * qk_scale - m_new[..., None]).nan_to_num(0.0)
            alpha = exp(m - m_new).nan_to_num(0.0)
            if mistake == "per_tile":
                p = p / p.sum(-1, keepdim=True).clamp_min(1e-300)
            l = (l if no_alpha_l else l * alpha) + p.sum(-1)
            acc = (acc if no_alpha_acc else acc * alpha[..., None]) + p @ vp[..., cols, :]
            m = m_new
        out[..., rows, :] = acc / l[..., None]
        lse[..., rows] = (m + torch.log2(l)) / LOG2E
    return out, lse, tiles


#: The classic mistakes of the forward loop, and what a checker tells a learner whose output equals
#: the loop with that mistake.
FORWARD_MISTAKES = {
    "alpha": "alpha is missing on both L and the accumulator: when the running max grows, both must "
             "be rescaled by alpha = 2^(M_old - M_new) (e^(M_old - M_new) in natural base): "
             "L = L * alpha + rowsum(P) and acc = acc * alpha + P V",
    "alpha_acc": "the accumulated output is not rescaled by alpha = exp(M_old - M_new) (2**(M_old - "
                 "M_new) in base 2) when the running max grows: acc = acc * alpha + P V",
    "alpha_l": "the running sum L is not rescaled by alpha when the running max grows "
               "(L = L * alpha + rowsum(P))",
    "causal": "the causal mask is missing on the diagonal tiles: query i must not see keys j > i",
    "causal_off_by_one": "the causal mask is off by one: query i also sees key i + 1 (keep key j "
                         "where j <= i)",
    "ragged": "keys past the end of the sequence are not hidden: they score 0 instead of -inf, "
              "so they still get probability",
    "exp": "exp is used where exp2 belongs (the scores were multiplied by log2(e): use exp2, or "
           "leave out the log2(e))",
    "no_scale": "the scores were not multiplied by qk_scale (= scale * log2e, the softmax scale in base 2)",
    "scale_one": "the softmax scale is missing: the scores are q . k * scale, with scale = 1/sqrt(D)",
    "per_tile": "each tile's probabilities are normalised on their own; divide by L once, at the end",
    "drop_tail": "the last, shorter tile of keys was left out: loop over range(0, n_kv, BLOCK_KV), "
                 "masking the keys past n_kv",
}


def name_forward_mistake(got, q, k, v, is_causal, block_q, block_kv, scale, want, atol, rtol,
                         mistakes=FORWARD_MISTAKES):
    """The hint of the first of ``mistakes`` whose loop gives ``got`` (and not ``want``), or None."""
    for mistake in mistakes:
        wrong = tiled_forward_with_mistake(q, k, v, is_causal, block_q, block_kv, scale, mistake)[0]
        if not close(wrong, want, atol, rtol) and close(got, wrong, atol, rtol):
            return FORWARD_MISTAKES[mistake]
    return None


def check_tiled_attention(tiled_attention):
    """Chapter 03: ``tiled_attention(q, k, v, is_causal, block_q, block_kv) -> (out, lse, n_tiles)``
    for one head, q (N_q, D), k and v (N_kv, D) in float64, scale 1/sqrt(D): the kernel's loop in
    PyTorch with the online softmax in natural base; ``lse`` in natural log; ``n_tiles`` the number
    of tiles whose scores were computed (the skipped ones must not be)."""
    cases = [(64, 64, 16, 32, 16, False), (69, 69, 24, 32, 16, False), (69, 69, 24, 32, 16, True),
             (69, 69, 16, 16, 32, True), (17, 113, 8, 32, 32, True), (113, 17, 8, 32, 16, True),
             (40, 100, 16, 16, 16, False), (1, 1, 4, 16, 16, True), (50, 50, 16, 8, 8, True)]
    g = torch.Generator().manual_seed(33)
    for n, (n_q, n_kv, d, block_q, block_kv, causal) in enumerate(cases):
        spread = 6.0 if n % 3 == 2 else 1.0  # large scores: a missing max subtraction overflows
        q = torch.randn(n_q, d, generator=g, dtype=torch.float64) * spread
        k = torch.randn(n_kv, d, generator=g, dtype=torch.float64) * spread
        v = torch.randn(n_kv, d, generator=g, dtype=torch.float64)
        what = (f" (N_q={n_q}, N_kv={n_kv}, D={d}, block_q={block_q}, block_kv={block_kv}, "
                f"is_causal={causal})")
        result = attempt(tiled_attention, q.clone(), k.clone(), v.clone(), causal, block_q, block_kv,
                         name="tiled_attention", forbid=("softmax", "sdpa", "flashattn"),
                         allow=("flashattn.kernels.traversal.classify_blocks", "flashattn.kernels.traversal.cdiv",
                                "flashattn.kernels.traversal.kv_ranges"))
        if not isinstance(result, (tuple, list)) or len(result) != 3:
            raise ExerciseError("tiled_attention should return a tuple (out, lse, n_tiles), got "
                                f"{type(result).__name__}")
        out, lse, n_tiles = result
        out_ref, lse_ref = naive_attention(q, k, v, is_causal=causal)
        scale = 1.0 / d ** 0.5
        hint = None if close(out, out_ref, 1e-9, 1e-9) else name_forward_mistake(
            out, q, k, v, causal, block_q, block_kv, scale, out_ref, 1e-9, 1e-9)
        if hint:
            raise ExerciseError(f"out is wrong{what}: it equals what you get when {hint}.")
        expect_close(f"out{what}", out, out_ref, atol=1e-9, rtol=1e-9, heatmap=True)
        expect_close(f"lse{what}", lse, lse_ref, atol=1e-9, rtol=1e-9)
        kinds = classify_blocks(n_q, n_kv, block_q, block_kv, causal)
        computed = int((kinds != SKIPPED).sum())
        try:
            n_tiles = int(n_tiles)
        except Exception:
            raise ExerciseError(f"n_tiles should be an int, got {type(n_tiles).__name__}") from None
        if n_tiles != computed:
            raise ExerciseError(f"n_tiles is {n_tiles}{what}, but the kernel computes {computed} of the "
                                f"{kinds.size} tiles ({int((kinds == SKIPPED).sum())} are skipped). "
                                "Count each (query block, key block) whose scores you compute, and "
                                "compute only the tiles that are not skipped.")
    passed(f"tiled_attention matches the float64 reference in {len(cases)} cases and computes "
           "exactly the tiles that are not skipped")


def check_kv_stage_bounds(kv_stage_bounds):
    """Chapter 05: ``kv_stage_bounds(q_start, block_q, block_kv, n_kv, is_causal)`` must return
    ``(kv_full_end, kv_end)`` for the query block starting at ``q_start``: keys [0, kv_full_end)
    in whole tiles that need no mask, keys [kv_full_end, kv_end) with the mask, none after."""
    count = 0
    for n_kv in (1, 15, 16, 17, 64, 69, 100, 113, 128):
        for n_q in (1, 40, 69, 128):
            for block_q, block_kv in ((16, 16), (32, 16), (16, 32), (64, 32), (32, 64), (128, 64)):
                for causal in (True, False):
                    for q_start in range(0, n_q, block_q):
                        count += 1
                        call = (f"kv_stage_bounds(q_start={q_start}, block_q={block_q}, "
                                f"block_kv={block_kv}, n_kv={n_kv}, is_causal={causal})")
                        got = attempt(kv_stage_bounds, q_start, block_q, block_kv, n_kv, causal,
                                      name="kv_stage_bounds", forbid=("flashattn",))
                        try:
                            full_end, end = (int(x) for x in got)
                        except Exception:
                            raise ExerciseError(f"{call} should return two ints (kv_full_end, kv_end), "
                                                f"got {got!r}") from None
                        want_full, want_end = kv_ranges(q_start, block_q, block_kv, n_kv, causal)
                        if (full_end, end) == (want_full, want_end):
                            continue
                        last = q_start + block_q - 1
                        if end != want_end:
                            if end > n_kv:
                                why = f"keys from n_kv = {n_kv} on do not exist"
                            elif causal and end > want_end:
                                why = (f"the last query of the block, {last}, sees keys up to {last}: "
                                       f"keys from {want_end} on are skipped, never loaded")
                            else:
                                why = (f"key {end} is seen by some query of the block "
                                       f"{q_start}..{last}, so it must be visited")
                            raise ExerciseError(f"{call} returned kv_end = {end}; expected {want_end}: {why}.")
                        if full_end % block_kv:
                            why = (f"stage 1 loads whole tiles with no mask, so kv_full_end must be a "
                                   f"multiple of BLOCK_KV = {block_kv}")
                        elif full_end > want_full:
                            j = full_end - 1
                            why = (f"the tile ending at key {j} needs a mask: "
                                   + (f"key {j} is past the end" if j >= n_kv else
                                      f"query {q_start} (the first of the block) does not see key {j}"))
                        else:
                            why = (f"keys {full_end}..{want_full - 1} are seen by every query of the "
                                   "block, in whole tiles, so they belong to the fast stage without a mask "
                                   "(masking them gives the same numbers, only slower: yours masks more "
                                   "than needed)")
                        raise ExerciseError(f"{call} returned kv_full_end = {full_end}; expected {want_full}: {why}.")
    passed(f"kv_stage_bounds gives the kernel's two stages in all {count} cases")


@triton.jit
def fwd_exercise_kernel(Q, K, V, O, LSE,
                        stride_qh, stride_qn, stride_kh, stride_kn, stride_kd,
                        stride_vh, stride_vn, stride_vd, stride_oh, stride_on,
                        n_q, n_kv, qk_scale, INNER: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """flashattn's forward kernel, simplified, around a learner's inner loop ``INNER`` (a
    @triton.jit function passed as a compile-time argument). Tensors are (heads, N, D) with a head
    dim that is a power of two >= 16 (so no column mask), Q and O with contiguous columns."""
    q_block, head = tl.program_id(0), tl.program_id(1)     # grid: (query blocks, heads)
    Q += head * stride_qh                                  # move to this head's (N, D) matrices
    K += head * stride_kh
    V += head * stride_vh
    O += head * stride_oh
    LSE += head * n_q
    q_start = q_block * BLOCK_Q
    offs_q = q_start + tl.arange(0, BLOCK_Q)               # the query positions of this block
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + offs_q[:, None] * stride_qn + offs_d[None, :], mask=offs_q[:, None] < n_q, other=0.0)
    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)   # running max M (base 2, scaled)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)                 # running sum L
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], dtype=tl.float32)       # unnormalised output
    kv_full_end, kv_end = kv_stage_bounds(q_start, n_kv, BLOCK_Q, BLOCK_KV, IS_CAUSAL)  # flashattn's own
    # stage 1: full tiles, no mask (MASKED=False); stage 2: masked tiles (MASKED=True)
    acc, m_i, l_i = INNER(acc, m_i, l_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                          offs_q, offs_d, 0, kv_full_end, n_kv, qk_scale, BLOCK_KV, False, IS_CAUSAL)
    acc, m_i, l_i = INNER(acc, m_i, l_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                          offs_q, offs_d, kv_full_end, kv_end, n_kv, qk_scale, BLOCK_KV, True, IS_CAUSAL)
    acc = acc / l_i[:, None]
    tl.store(LSE + offs_q, m_i + tl.log2(l_i), mask=offs_q < n_q)   # base-2 LSE
    tl.store(O + offs_q[:, None] * stride_on + offs_d[None, :], acc.to(O.dtype.element_ty),
             mask=offs_q[:, None] < n_q)


def run_fwd_inner(fwd_inner, q, k, v, is_causal=False, scale=None, block_q=32, block_kv=16):
    """Run the forward kernel built around the learner's ``fwd_inner`` on (heads, N, D) tensors
    (any strides). Returns ``(o, lse2)``: the output like ``q`` and the base-2 LSE (float32)."""
    heads, n_q, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if q.stride(-1) != 1:
        q = q.contiguous()
    o = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    lse2 = torch.full((heads, n_q), float("nan"), device=q.device, dtype=torch.float32)
    launch_learner_kernel(fwd_exercise_kernel, (triton.cdiv(n_q, block_q), heads),
                          (q, k, v, o, lse2, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
                          v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1),
                          n_q, k.shape[1], scale * LOG2E, fwd_inner),
                          dict(HEAD_DIM=d, BLOCK_Q=block_q, BLOCK_KV=block_kv, IS_CAUSAL=bool(is_causal)),
                          "fwd_inner", fwd_inner)
    return o, lse2


def check_fwd_inner(fwd_inner):
    """Chapter 05: the forward kernel's inner loop in Triton, run inside flashattn's kernel (given
    in this module) through the interpreter on tiny inputs: aligned and ragged lengths, causal and
    not, N_q != N_kv, strided keys and values, float16; output and LSE against float64. It may not
    call flashattn's own functions, nor tl.softmax."""
    if not is_stub(fwd_inner):
        check_references(fwd_inner, "fwd_inner", forbid=("flashattn", "softmax"))
    # (heads, n_q, n_kv, D, causal, dtype, layout, block_q, block_kv)
    cases = [(2, 64, 64, 32, False, torch.float32, "contiguous", 32, 16),
             (2, 69, 69, 32, False, torch.float32, "contiguous", 32, 16),
             (2, 69, 69, 32, True, torch.float32, "contiguous", 32, 16),
             (1, 40, 69, 16, True, torch.float32, "contiguous", 32, 16),
             (1, 69, 23, 16, True, torch.float32, "contiguous", 16, 32),
             (2, 33, 47, 16, True, torch.float32, "strided", 32, 16),
             (2, 69, 69, 32, True, torch.float16, "contiguous", 32, 16)]
    for n, (heads, n_q, n_kv, d, causal, dtype, layout, block_q, block_kv) in enumerate(cases):
        g = torch.Generator().manual_seed(440 + n)
        q = torch.randn(heads, n_q, d, generator=g).to(dtype)
        if layout == "strided":  # keys and values as (N, H, 2D) storage: row and column strides != D, 1
            k = torch.randn(n_kv, heads, 2 * d, generator=g).to(dtype).transpose(0, 1)[..., ::2]
            v = torch.randn(n_kv, heads, 2 * d, generator=g).to(dtype).transpose(0, 1)[..., 1::2]
        else:
            k, v = (torch.randn(heads, n_kv, d, generator=g).to(dtype) for _ in range(2))
        q, k, v = (t.to(DEVICE) for t in (q, k, v))
        scale = 1.0 / math.sqrt(d)
        o, lse2 = run_fwd_inner(fwd_inner, q, k, v, is_causal=causal, scale=scale,
                                block_q=block_q, block_kv=block_kv)
        o_ref, lse_ref = naive_attention(q.double(), k.double(), v.double(), is_causal=causal, scale=scale)
        what = (f" (heads={heads}, N_q={n_q}, N_kv={n_kv}, D={d}, is_causal={causal}, {dtype}, "
                f"{layout} K/V, BLOCK_Q={block_q}, BLOCK_KV={block_kv})")
        if dtype == torch.float16:
            atol = 4e-3
        else:  # on a GPU, tl.dot multiplies float32 tiles in TF32 unless told input_precision="ieee"
            atol = pick(cpu=2e-5, gpu=5e-3)
        if not close(o, o_ref, atol, atol):
            hint = name_forward_mistake(o.cpu(), q.cpu(), k.cpu(), v.cpu(), causal, block_q, block_kv, scale,
                                     o_ref.cpu(), atol, atol)
            if hint:
                raise ExerciseError(f"the output O is wrong{what}: it equals what you get when {hint}.")
        expect_close(f"output O{what}", o, o_ref, atol=atol, rtol=atol, heatmap=True)
        expect_close(f"LSE{what} (natural log: LSE2 * ln 2)", lse2.double() * LN2, lse_ref,
                     atol=atol, rtol=atol)
    passed(f"fwd_inner gives the right O and LSE in all {len(cases)} cases (ragged, causal, "
           "N_q != N_kv, strided K/V, float16)")


def check_causal_tiles(causal_tiles):
    """Chapter 03: ``causal_tiles(n_q, n_kv, block_q, block_kv) -> int``, the number of tiles a causal
    forward computes (full or masked, not skipped), derived rather than counted tile by tile."""
    cases = [(64, 64, 16, 16), (1024, 1024, 64, 64), (69, 69, 32, 16), (69, 69, 16, 32), (17, 113, 32, 32),
             (113, 17, 32, 16), (1, 1, 16, 16), (200, 130, 64, 16), (4096, 4096, 128, 64)]
    for n_q, n_kv, block_q, block_kv in cases:
        call = f"causal_tiles({n_q}, {n_kv}, {block_q}, {block_kv})"
        got = attempt(causal_tiles, n_q, n_kv, block_q, block_kv, name="causal_tiles", forbid=("flashattn",))
        try:
            got = int(got)
        except Exception:
            raise ExerciseError(f"{call} should return an int, got {type(got).__name__}") from None
        kinds = classify_blocks(n_q, n_kv, block_q, block_kv, True)
        want = int((kinds != SKIPPED).sum())
        if got == want:
            continue
        blocks = [(q, min(q + block_q, n_kv)) for q in range(0, n_q, block_q)]
        if got == kinds.size:
            why = "that is every tile: the tiles above the diagonal are skipped, never computed"
        elif got == sum(cdiv(min(q + 1, n_kv), block_kv) for q, _ in blocks):
            why = ("each query block was counted up to its first query; its last query, q_start + BLOCK_Q - 1, "
                   "sees the most keys, and the block computes every tile that query needs")
        elif got == sum(cdiv(q + block_q, block_kv) for q, _ in blocks):
            why = f"keys past N_kv = {n_kv} do not exist: a block needs keys up to min(q_start + BLOCK_Q, N_kv)"
        elif n_q == n_kv and block_q == block_kv and got == (n_q // block_q) * (n_q // block_q + 1) // 2:
            why = "the closed form n(n + 1)/2 holds for aligned lengths only: count the ragged last blocks too"
        else:
            why = ("query block b computes the key tiles 0 .. cdiv(min((b + 1) * BLOCK_Q, N_kv), BLOCK_KV) - 1; "
                   "sum that over the blocks")
        raise ExerciseError(f"{call} returned {got}; the causal forward computes {want} of the "
                            f"{kinds.size} tiles: {why}.")
    passed(f"causal_tiles gives the number of tiles computed in all {len(cases)} cases (aligned, ragged, "
           "N_q != N_kv, BLOCK_Q != BLOCK_KV)")
