"""Checkers of chapter 10's kernel exercises: grouped heads and a sliding window added to the
learner's own forward kernel (chapter 05) and backward kernels (chapter 07).

The two window pieces are run alone first, in small kernels given here, and compared with the
definition: ``my_in_window(i, j, win_left, win_right)`` (whether query i sees key j) and
``my_window_bounds(...)`` (the four key bounds of a query block). Then the whole kernels run on
grouped heads and windows and are judged against float64 under the course's rule. A wrong result
is compared with what the likely mistakes give (a K/V head dealt out round-robin, a group summed
over the wrong query heads, a window edge off by one, the window not turned around in the dK/dV
kernel, a row that has seen no key yet) so that the message names the mistake.

K and V (and dK, dV) are views of the first H_kv heads of a buffer with H_q heads whose other heads
hold NaN: a query head that reads a K/V head that does not exist shows, and reads no memory outside.
"""
import math

import torch
import triton
import triton.language as tl

from ..notebook import pick
from ...gpu.runtime import DEVICE
from ...kernels.tiles import LN2, LOG2E
from ...kernels.traversal import window_masking
from ...testing.reference import masked_attention, window_mask
from ...testing.rule import judge
from .common import ExerciseError, close, helpers_of, is_stub, launch_learner_kernel, not_implemented, passed

FORBID = ("flashattn", "softmax", "sdpa")
GPU_TOL = 1e-2  # on a GPU, tl.dot multiplies float32 tiles in TF32 unless told otherwise


def _cdiv(a, b):
    return -(-a // b)


# --- The two window pieces, alone ------------------------------------------------------------------

@triton.jit
def in_window_kernel(Out, win_left, win_right, PIECE: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``Out[i, j] = PIECE(i, j, win_left, win_right)`` for queries i < ROWS and keys j < COLS."""
    i = tl.arange(0, ROWS)
    j = tl.arange(0, COLS)
    seen = PIECE(i[:, None], j[None, :], win_left, win_right)
    tl.store(Out + i[:, None] * COLS + j[None, :], seen.to(tl.int32))


@triton.jit
def window_bounds_kernel(Out, n_kv, win_left, win_right, PIECE: tl.constexpr,
                         BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr):
    """The four bounds ``PIECE`` gives the query block of this program, in ``Out[block, 0:4]``."""
    block = tl.program_id(0)
    lo, full_lo, full_hi, hi = PIECE(block * BLOCK_Q, n_kv, win_left, win_right, BLOCK_Q, BLOCK_KV)
    tl.store(Out + 4 * block, lo)
    tl.store(Out + 4 * block + 1, full_lo)
    tl.store(Out + 4 * block + 2, full_hi)
    tl.store(Out + 4 * block + 3, hi)


#: The windows the pieces are tried on: (win_left, win_right), both >= 0.
PIECE_WINDOWS = [(3, 3), (0, 5), (6, 0), (7, 2), (0, 0), (2, 9)]

#: A wrong ``my_in_window``: what it computes (i, j, left, right) and what to say.
IN_WINDOW_SLIPS = [
    (lambda i, j, a, b: (j > i - a) & (j <= i + b),
     "the left edge is off by one: query i sees key i - win_left itself (j >= i - win_left)"),
    (lambda i, j, a, b: (j >= i - a - 1) & (j <= i + b),
     "one key too many on the left: query i sees keys from i - win_left on, not i - win_left - 1"),
    (lambda i, j, a, b: (j >= i - a) & (j < i + b),
     "the right edge is off by one: query i sees key i + win_right itself (j <= i + win_right)"),
    (lambda i, j, a, b: (j >= i - a) & (j <= i + b + 1),
     "one key too many on the right: query i sees keys up to i + win_right, not i + win_right + 1"),
    (lambda i, j, a, b: (j >= i - b) & (j <= i + a),
     "left and right are swapped: win_left counts the keys BEFORE the query (j >= i - win_left), "
     "win_right those after it (j <= i + win_right)"),
    (lambda i, j, a, b: j >= i - a, "the right edge is missing: j <= i + win_right"),
    (lambda i, j, a, b: j <= i + b, "the left edge is missing: j >= i - win_left"),
]


def _in_window_table(piece, left, right, rows=16, cols=32):
    out = torch.full((rows, cols), -1, dtype=torch.int32, device=DEVICE)
    launch_learner_kernel(in_window_kernel, (1,), (out, left, right), dict(PIECE=piece, ROWS=rows, COLS=cols),
                          "my_in_window", piece, forbid=FORBID)
    return out.cpu()


def check_in_window(my_in_window):
    """``my_in_window(i, j, win_left, win_right)`` against the definition on every pair of 16
    queries and 32 keys, for the windows of :data:`PIECE_WINDOWS`; names the slips it matches."""
    i, j = torch.arange(16)[:, None], torch.arange(32)[None, :]
    got = {w: _in_window_table(my_in_window, *w) for w in PIECE_WINDOWS}
    want = {w: ((j >= i - w[0]) & (j <= i + w[1])).int() for w in PIECE_WINDOWS}
    wrong = [w for w in PIECE_WINDOWS if not torch.equal(got[w], want[w])]
    if not wrong:
        return
    for slip, hint in IN_WINDOW_SLIPS:
        if all(torch.equal(got[w], slip(i, j, *w).int()) for w in PIECE_WINDOWS):
            raise ExerciseError(f"my_in_window is wrong: {hint}.")
    w = wrong[0]
    qi, kj = (int(x) for x in (got[w] != want[w]).nonzero()[0])
    raise ExerciseError(f"my_in_window(i={qi}, j={kj}, win_left={w[0]}, win_right={w[1]}) gives "
                        f"{bool(got[w][qi, kj])}, expected {bool(want[w][qi, kj])}: query i sees key j when "
                        "i - win_left <= j <= i + win_right")


#: (n_q, n_kv, win_left, win_right, BLOCK_Q, BLOCK_KV): every block sees some key (n_q <= n_kv).
BOUNDS_CASES = [(64, 64, 3, 3, 16, 16), (64, 80, 20, 5, 16, 16), (48, 64, 0, 40, 16, 32),
                (64, 64, 7, 0, 32, 16), (40, 64, 104, 3, 16, 16), (45, 45, 5, 9, 16, 16),
                (64, 64, 0, 0, 16, 16), (40, 64, 30, 30, 16, 32)]


def _want_bounds(q_start, n_kv, left, right, bq, bkv):
    """What the query block at ``q_start`` (rows q_start .. q_start + bq - 1) must get: kv_lo, the
    range of kv_hi accepted, and the whole tiles every row sees ((a, b), empty when a >= b)."""
    first, last = max(q_start - left, 0), min(q_start + bq - 1 + right, n_kv - 1)   # seen by some row
    lo = first // bkv * bkv
    hi_range = (last + 1, min(_cdiv(last + 1, bkv) * bkv, n_kv))
    all_first, all_last = max(q_start + bq - 1 - left, 0), min(q_start + right, n_kv - 1)   # by every row
    return lo, hi_range, (_cdiv(all_first, bkv) * bkv, (all_last + 1) // bkv * bkv), (all_first, all_last)


def _bounds_error(got, q_start, n_kv, left, right, bq, bkv):
    """The message for a wrong set of bounds of one query block, or None when they are right."""
    lo, full_lo, full_hi, hi = got
    want_lo, (hi_min, hi_max), (a, b), (all_first, all_last) = _want_bounds(q_start, n_kv, left, right, bq, bkv)
    if lo % bkv:
        return "kv_lo is not the start of a tile: round it down to a multiple of BLOCK_KV"
    if lo > want_lo:
        return (f"kv_lo = {lo} misses keys: the block's FIRST query, q_start, sees keys from "
                f"q_start - win_left = {q_start - left} on (never below 0), and kv_lo is the start of that key's tile")
    if lo < want_lo:
        return (f"kv_lo = {lo} starts before the first key the block sees ({max(q_start - left, 0)}): the tiles "
                "before it are loaded for nothing, which is what the window is there to avoid")
    if hi == hi_min - 1:
        return ("kv_hi is one key short: the block's LAST query, q_start + BLOCK_Q - 1, sees up to key "
                "q_start + BLOCK_Q - 1 + win_right, and kv_hi is one past it")
    if hi > n_kv:
        return f"kv_hi = {hi} is past the last key: clamp it at n_kv = {n_kv}"
    if hi < hi_min:
        return (f"kv_hi = {hi} stops before key {hi_min - 1}, which the block's LAST query, q_start + BLOCK_Q - 1, "
                "sees: kv_hi = q_start + BLOCK_Q + win_right (at most n_kv)")
    if hi > hi_max:
        return f"kv_hi = {hi} visits keys no query of the block sees (the last is {hi_min - 1})"
    if not lo <= full_lo <= full_hi <= hi:
        return (f"the ranges overlap or run backwards ({lo}, {full_lo}, {full_hi}, {hi}): keep "
                "kv_lo <= kv_full_lo <= kv_full_hi <= kv_hi, or a tile is visited twice")
    if full_hi > full_lo and not (all_first <= full_lo and full_hi <= all_last + 1):
        return (f"[kv_full_lo, kv_full_hi) = [{full_lo}, {full_hi}) runs without the mask, but not every query "
                f"of the block sees all of it (they all see keys {all_first} .. {all_last} only): every query "
                "sees from the LAST query's left edge, q_start + BLOCK_Q - 1 - win_left, to the FIRST "
                "query's right edge, q_start + win_right")
    if full_hi > full_lo and (full_lo % bkv or full_hi % bkv):
        return "[kv_full_lo, kv_full_hi) must hold whole tiles: both bounds multiples of BLOCK_KV"
    if a < b and (full_lo, full_hi) != (a, b):
        return (f"[kv_full_lo, kv_full_hi) = [{full_lo}, {full_hi}) leaves tiles that every query sees whole in "
                f"a masked range (all of [{a}, {b}) is seen by every query): right, but it pays for the mask "
                "where none is needed")
    return None


def check_window_bounds(my_window_bounds):
    """``my_window_bounds(q_start, n_kv, win_left, win_right, BLOCK_Q, BLOCK_KV)`` on every query
    block of the cases of :data:`BOUNDS_CASES`, against the pairs themselves."""
    for n_q, n_kv, left, right, bq, bkv in BOUNDS_CASES:
        blocks = _cdiv(n_q, bq)
        out = torch.full((blocks, 4), -99, dtype=torch.int32, device=DEVICE)
        launch_learner_kernel(window_bounds_kernel, (blocks,), (out, n_kv, left, right),
                              dict(PIECE=my_window_bounds, BLOCK_Q=bq, BLOCK_KV=bkv), "my_window_bounds",
                              my_window_bounds, forbid=FORBID)
        for block, got in enumerate(out.cpu().tolist()):
            error = _bounds_error(got, block * bq, n_kv, left, right, bq, bkv)
            if error:
                raise ExerciseError(f"my_window_bounds(q_start={block * bq}, n_kv={n_kv}, win_left={left}, "
                                    f"win_right={right}, BLOCK_Q={bq}, BLOCK_KV={bkv}) returned "
                                    f"{tuple(got)}: {error}.")


# --- The kernels' inputs and the float64 references ---------------------------------------------------

def _heads_buffer(batch, n_q_heads, n_kv_heads, n, d, values=None):
    """A (B, H_kv, N, D) view of the first H_kv heads of a (B, H_q, N, D) buffer holding NaN."""
    buffer = torch.full((batch, n_q_heads, n, d), float("nan"), device=DEVICE)
    view = buffer[:, :n_kv_heads]
    if values is not None:
        view.copy_(values)
    return view


def make_case(batch, hq, hkv, n_q, n_kv, d, seed):
    """q, do (B, H_q, N_q, D) and k, v (B, H_kv, N_kv, D) on DEVICE, float32, k and v as views of
    NaN-filled buffers with H_q heads."""
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(batch, hq, n_q, d, generator=g).to(DEVICE) for _ in range(2))
    k, v = (_heads_buffer(batch, hq, hkv, n_kv, d, torch.randn(batch, hkv, n_kv, d, generator=g)) for _ in range(2))
    return q, k, v, do


def _reference(q, k, v, do, is_causal, window, heads=None, backward=True):
    """{"out", "lse"[, "dq", "dk", "dv"]} of the formula in float64 and in float32 (PyTorch's own
    rounding), with grouped heads; ``heads`` (a query head -> K/V head map) replaces the groups."""
    results = []
    for dtype in (torch.float64, torch.float32):
        leaves = [t.detach().cpu().to(dtype).requires_grad_(backward) for t in (q, k, v)]
        kk, vv = leaves[1:]
        if heads is not None:
            kk, vv = kk.index_select(1, heads), vv.index_select(1, heads)
        out, lse = masked_attention(leaves[0], kk, vv, is_causal=is_causal, window_size=window, enable_gqa=True)
        result = dict(out=out.detach(), lse=lse.detach())
        if backward:
            result.update(zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, do.cpu().to(dtype))))
        results.append(result)
    return results


def _passes(got, ref64, pt, upstream):
    """Whether every output in ``got`` passes: the course's rule on the interpreter, TF32's
    tolerance on a GPU."""
    got = {name: t.detach().cpu() for name, t in got.items()}
    if pick(cpu=False, gpu=True):
        return all(close(got[n], ref64[n], GPU_TOL * max(1.0, ref64[n].abs().max().item()), GPU_TOL) for n in got)
    return all(c.ok for c in judge(got, {n: ref64[n] for n in got}, {n: pt[n] for n in got}, torch.float32,
                                   upstream))


def _what(batch, hq, hkv, n_q, n_kv, d, window, causal, bq, bkv):
    return (f"B={batch}, H_q={hq}, H_kv={hkv}, N_q={n_q}, N_kv={n_kv}, D={d}, window_size={window}, "
            f"is_causal={causal}, BLOCK_Q={bq}, BLOCK_KV={bkv}")


def _require(fns, exercise_of=None):
    """'not implemented yet' for the first stub among ``fns`` ({name: function}); ``exercise_of``
    says which exercise holds a function written earlier."""
    for name, fn in fns.items():
        if fn is None:
            raise ExerciseError(f"{name} is not defined: run the cell that defines it first")
        if is_stub(fn):
            if exercise_of and name in exercise_of:
                raise ExerciseError(f"{name} ({exercise_of[name]}) is not implemented yet: your kernels call "
                                    "it, so finish that exercise first.")
            raise not_implemented(name)


#: A query head's K/V head by a wrong rule, given (H_q, H_kv): (the map, what to say).
HEAD_SLIPS = [
    (lambda hq, hkv: torch.arange(hq) % hkv,
     "query heads were dealt out round-robin (head % H_kv): a group is n_group CONSECUTIVE query heads, "
     "so query head h reads K/V head h // n_group"),
    (lambda hq, hkv: torch.arange(hq) // hkv,
     "the head was divided by the number of K/V heads: query head h reads K/V head h // n_group, "
     "n_group = H_q / H_kv"),
]


def _head_slips(hq, hkv):
    """The maps of :data:`HEAD_SLIPS` for these head counts that differ from the right one and name
    K/V heads that exist."""
    right = torch.arange(hq) // (hq // hkv)
    return [(heads(hq, hkv), hint) for heads, hint in HEAD_SLIPS
            if heads(hq, hkv).max() < hkv and not torch.equal(heads(hq, hkv), right)]


def _nan_heads(name, got, hkv):
    """A message when NaN shows in the query heads past H_kv only: they read K/V heads that do not exist."""
    nan = torch.isnan(got.cpu()).flatten(2).any(-1).any(0)       # per query head
    if nan.any() and not nan[:hkv].any():
        first = int(nan.nonzero()[0])
        return (f"{name} has NaN from query head {first} on, which read K/V heads that do not exist (there "
                f"are {hkv}): move K and V to the K/V head of the query head's group, head // n_group")
    return None


# --- Exercise: the forward kernel ------------------------------------------------------------------------

#: (B, H_q, H_kv, N_q, N_kv, D, window_size, is_causal, BLOCK_Q, BLOCK_KV): grouped heads alone first
#: (chapter 05's stages), then windows, symmetric before lopsided.
FORWARD_CASES = [(1, 4, 2, 40, 40, 16, (-1, -1), False, 16, 16),
                 (2, 6, 2, 37, 45, 24, (-1, -1), True, 16, 16),
                 (1, 2, 1, 40, 40, 16, (3, 3), False, 16, 16),
                 (1, 4, 2, 45, 45, 16, (7, -1), True, 16, 32),
                 (1, 2, 1, 33, 50, 16, (5, 9), False, 16, 16),
                 (1, 2, 2, 40, 40, 16, (-1, 4), False, 32, 16)]


def run_forward(my_attn_fwd, q, k, v, is_causal, window, block_q, block_kv):
    """``(o, lse2)`` of the learner's forward kernel with grouped heads and a window, launched as
    flashattn's launcher would (grid (query blocks, H_q, B))."""
    batch, hq, n_q, d = q.shape
    hkv, n_kv = k.shape[1], k.shape[2]
    # as flashattn's launcher: no bound becomes one past every key, a causal window win_right = 0
    causal, windowed, left, right = window_masking(is_causal, window, n_q + n_kv)
    o = torch.full_like(q, float("nan"))
    lse2 = torch.full((batch, hq, n_q), float("nan"), device=DEVICE)
    launch_learner_kernel(my_attn_fwd, (triton.cdiv(n_q, block_q), hq, batch),
                          (q, k, v, o, lse2, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                           hq, n_q, n_kv, LOG2E / math.sqrt(d), hq // hkv, left, right),
                          dict(HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_Q=block_q,
                               BLOCK_KV=block_kv, IS_CAUSAL=causal, WINDOW=windowed),
                          "my_attn_fwd", my_attn_fwd, forbid=FORBID)
    return o, lse2


def check_gqa_window_forward(my_attn_fwd, my_window_bounds, my_in_window):
    """Chapter 10: the learner's chapter 05 kernel with grouped heads (``n_group`` query heads per K/V
    head) and, under ``WINDOW``, a sliding window (``win_left``, ``win_right``, both >= 0). The two
    window pieces are checked alone first; then the kernel, on :data:`FORWARD_CASES`, output and LSE
    against float64 under the course's rule."""
    _require({"my_attn_fwd": my_attn_fwd, **helpers_of(my_attn_fwd, "my_kv_tiles"),
              "my_window_bounds": my_window_bounds, "my_in_window": my_in_window})
    check_in_window(my_in_window)
    check_window_bounds(my_window_bounds)
    for n, (batch, hq, hkv, n_q, n_kv, d, window, causal, bq, bkv) in enumerate(FORWARD_CASES):
        q, k, v, do = make_case(batch, hq, hkv, n_q, n_kv, d, 1000 + n)
        o, lse2 = run_forward(my_attn_fwd, q, k, v, causal, window, bq, bkv)
        got = dict(out=o, lse=lse2.double() * LN2)
        ref64, pt = _reference(q, k, v, do, causal, window, backward=False)
        if _passes(got, ref64, pt, 1.0):
            continue
        what = _what(batch, hq, hkv, n_q, n_kv, d, window, causal, bq, bkv)
        said = _nan_heads("the output of my_attn_fwd", o, hkv)
        if said:
            raise ExerciseError(f"{said} ({what}).")
        if torch.isnan(o).any() and window != (-1, -1):
            raise ExerciseError(
                f"the output of my_attn_fwd has NaN ({what}): in a masked tile of the window a row may see no key "
                "at all, before any tile where it sees one; its M is still -inf, and exp2(-inf - (-inf)) is NaN. "
                "Subtract 0 instead of M for such a row (m_ref = tl.where(m_new == -inf, 0, m_new)), in p and "
                "in alpha.")
        for heads, hint in _head_slips(hq, hkv):
            wrong, _ = _reference(q, k, v, do, causal, window, heads, backward=False)
            if not close(wrong["out"], ref64["out"], 1e-3, 1e-3) and close(o, wrong["out"], 1e-3, 1e-3):
                raise ExerciseError(f"the output of my_attn_fwd is wrong ({what}): {hint}.")
        bad = ~torch.isclose(o.cpu().double(), ref64["out"], atol=1e-3, rtol=1e-3).all(-1)   # (B, H, N_q)
        b, h, row = (int(x) for x in bad.nonzero()[0]) if bad.any() else (0, 0, 0)
        where = f"first at row {row} of query head {h}, batch {b}"
        if window == (-1, -1):
            raise ExerciseError(f"the output of my_attn_fwd is wrong ({what}), {where}: without a window the "
                                "kernel is chapter 05's; check the K/V head and the three ranges' calls.")
        raise ExerciseError(f"the output of my_attn_fwd is wrong ({what}), {where}, though my_in_window and "
                            "my_window_bounds are right on their own: check how the kernel uses them (the block's "
                            "q_start, n_kv, win_left, win_right, BLOCK_Q, BLOCK_KV), and that the two ranges around "
                            "[kv_full_lo, kv_full_hi) run with MASKED=True.")
    passed(f"my_attn_fwd passes the rule against float64 in all {len(FORWARD_CASES)} cases: grouped heads "
           "(G = 2 and 3), causal and not, windows on both sides, one side, lopsided and causal; and both "
           "window pieces agree with the definition")


# --- Exercise: the backward kernels ---------------------------------------------------------------------

#: As FORWARD_CASES, with the dQ kernel's (BLOCK_Q, BLOCK_KV) and the dK/dV kernel's.
BACKWARD_CASES = [(2, 4, 2, 40, 40, 16, (-1, -1), False, (16, 16), (16, 32)),
                  (1, 6, 2, 37, 45, 24, (-1, -1), True, (16, 16), (16, 32)),
                  (1, 2, 1, 40, 40, 16, (3, 3), False, (16, 16), (16, 16)),
                  (1, 4, 2, 45, 45, 16, (7, -1), True, (32, 16), (16, 32)),
                  (1, 2, 1, 33, 50, 16, (5, 9), False, (16, 16), (16, 16))]


def run_backward(my_attn_bwd_dq, my_attn_bwd_dkdv, q, k, v, do, is_causal, window, dq_blocks, dkdv_blocks):
    """``(dq, dk, dv)`` of the learner's two backward kernels, from the float64 LSE and Delta."""
    batch, hq, n_q, d = q.shape
    hkv, n_kv = k.shape[1], k.shape[2]
    # as flashattn's launcher: no bound becomes one past every key, a causal window win_right = 0
    causal, windowed, left, right = window_masking(is_causal, window, n_q + n_kv)
    o64, lse64 = masked_attention(*(t.cpu().double() for t in (q, k, v)), is_causal=is_causal,
                                  window_size=window, enable_gqa=True)
    lse2 = (lse64 * LOG2E).float().contiguous().to(DEVICE)
    delta = (o64 * do.cpu().double()).sum(-1).float().contiguous().to(DEVICE)
    dq = torch.full_like(q, float("nan"))
    dk, dv = (_heads_buffer(batch, hq, hkv, n_kv, d) for _ in range(2))
    scale = 1.0 / math.sqrt(d)
    rest = (hq, n_q, n_kv, scale, scale * LOG2E, hq // hkv, left, right)
    flags = dict(HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), IS_CAUSAL=causal, WINDOW=windowed)
    bq, bkv = dq_blocks
    launch_learner_kernel(my_attn_bwd_dq, (triton.cdiv(n_q, bq), hq, batch),
                          (q, k, v, do, lse2, delta, dq,
                           *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), *rest),
                          dict(BLOCK_Q=bq, BLOCK_KV=bkv, **flags), "my_attn_bwd_dq", my_attn_bwd_dq, forbid=FORBID)
    bq, bkv = dkdv_blocks
    launch_learner_kernel(my_attn_bwd_dkdv, (triton.cdiv(n_kv, bkv), hkv, batch),
                          (q, k, v, do, lse2, delta, dk, dv, *q.stride(), *k.stride(), *v.stride(),
                           *do.stride(), *dk.stride(), *dv.stride(), *rest),
                          dict(BLOCK_Q=bq, BLOCK_KV=bkv, **flags), "my_attn_bwd_dkdv", my_attn_bwd_dkdv,
                          forbid=FORBID)
    return dq, dk, dv


def pair_grads(q, k, v, do, is_causal, window):
    """What a backward loop adds for every pair (query head h, K/V head g), in float64, with the LSE
    and Delta of the right forward (as the kernels get them): ``(dq, dk, dv)`` of shapes
    (B, H_q, H_kv, N_q, D), (B, H_q, H_kv, N_kv, D) twice. Query head h's true share is the pair
    (h, h // n_group); a kernel that pairs heads otherwise adds other pairs."""
    q, k, v, do = (t.detach().cpu().double() for t in (q, k, v, do))
    o, lse = masked_attention(q, k, v, is_causal=is_causal, window_size=window, enable_gqa=True)
    delta = (o * do).sum(-1)
    scale = 1.0 / math.sqrt(q.shape[-1])
    seen = window_mask(q.shape[2], k.shape[2], window, is_causal)
    qh, doh = q[:, :, None], do[:, :, None]                       # (B, H_q, 1, N_q, D)
    kg, vg = k[:, None], v[:, None]                               # (B, 1, H_kv, N_kv, D)
    p = torch.exp(qh @ kg.transpose(-2, -1) * scale - lse[:, :, None, :, None]) * seen
    ds = p * (doh @ vg.transpose(-2, -1) - delta[:, :, None, :, None])
    return scale * ds @ kg, scale * ds.transpose(-2, -1) @ qh, p.transpose(-2, -1) @ doh


def _group_slips(hq, hkv):
    """A wrong choice of the query heads a dK/dV program sums: ({K/V head: [query heads]}, what to say)."""
    group = hq // hkv
    return [
        ({g: [g + i * hkv for i in range(group)] for g in range(hkv)},
         "the query heads of a group are n_group CONSECUTIVE heads: K/V head g gathers query heads "
         "g * n_group .. g * n_group + n_group - 1, not every H_kv-th one"),
        ({g: [g * group] for g in range(hkv)},
         "only the first query head of each group was added: loop over all n_group query heads of the group, "
         "adding their shares into the same dk and dv"),
        ({g: [g * group + group - 1] for g in range(hkv)},
         "only the last query head of each group counts: dk and dv restart at 0 for each query head; set them "
         "to 0 once, before the loop over the group, and add every head's share"),
        ({g: [g] * group for g in range(hkv)},
         "the same query head was added n_group times: query head kv_head * n_group + g of the loop, "
         "not kv_head"),
    ]


def _name_group_slip(dk, dv, pairs, group):
    """What a wrong dK/dV loop over the group did, from the pairs' shares (:func:`pair_grads`)."""
    _, dk_pairs, dv_pairs = pairs
    hkv = dk_pairs.shape[2]
    for heads_of, hint in _group_slips(dk_pairs.shape[1], hkv):
        want_k = torch.stack([dk_pairs[:, heads_of[g], g].sum(1) for g in range(hkv)], 1)
        want_v = torch.stack([dv_pairs[:, heads_of[g], g].sum(1) for g in range(hkv)], 1)
        if close(dk, want_k, 1e-3, 1e-3) and close(dv, want_v, 1e-3, 1e-3):
            return hint
    own = [[g * group + i for i in range(group)] for g in range(hkv)]
    mean_k, mean_v = (torch.stack([t[:, own[g], g].mean(1) for g in range(hkv)], 1) for t in (dk_pairs, dv_pairs))
    if close(dk, mean_k, 1e-3, 1e-3) and close(dv, mean_v, 1e-3, 1e-3):
        return ("the shares of the group were averaged: a K/V head used by n_group query heads receives the "
                "SUM of their gradients (the chain rule through a copy)")
    return None


def check_gqa_window_backward(my_attn_bwd_dq, my_attn_bwd_dkdv):
    """Chapter 10: the learner's chapter 07 kernels with grouped heads (the dQ kernel reads its query
    head's K/V head; a dK/dV program of a K/V head adds the shares of the n_group query heads of its
    group) and windows (the dK/dV kernel's query range and mask turned around). dQ, dK and dV
    against float64 under the course's rule on :data:`BACKWARD_CASES`; the LSE and Delta are given."""
    _require({"my_attn_bwd_dq": my_attn_bwd_dq, "my_attn_bwd_dkdv": my_attn_bwd_dkdv,
              **helpers_of(my_attn_bwd_dq, "dq_inner"), **helpers_of(my_attn_bwd_dkdv, "dkdv_inner")})
    earlier = helpers_of(my_attn_bwd_dq, "my_window_bounds", "my_in_window")
    _require(earlier, exercise_of={name: "the forward's exercise" for name in earlier})
    try:  # the forward's exercise checks them; the backward kernels call them too
        check_in_window(earlier["my_in_window"])
        check_window_bounds(earlier["my_window_bounds"])
    except ExerciseError as error:
        raise ExerciseError(f"{error} (The forward's exercise wrote it; the backward kernels call it.)") from None
    symmetric_ok = False
    for n, (batch, hq, hkv, n_q, n_kv, d, window, causal, dq_blocks, dkdv_blocks) in enumerate(BACKWARD_CASES):
        q, k, v, do = make_case(batch, hq, hkv, n_q, n_kv, d, 1100 + n)
        dq, dk, dv = run_backward(my_attn_bwd_dq, my_attn_bwd_dkdv, q, k, v, do, causal, window, dq_blocks,
                                  dkdv_blocks)
        ref64, pt = _reference(q, k, v, do, causal, window)
        upstream = do.abs().max().item()
        dq_ok = _passes(dict(dq=dq), ref64, pt, upstream)
        dkdv_ok = _passes(dict(dk=dk, dv=dv), ref64, pt, upstream)
        if dq_ok and dkdv_ok:
            symmetric_ok = symmetric_ok or (window[0] == window[1] != -1)
            continue
        what = (f"B={batch}, H_q={hq}, H_kv={hkv}, N_q={n_q}, N_kv={n_kv}, D={d}, window_size={window}, "
                f"is_causal={causal}")
        if not dq_ok:
            said = _nan_heads("dQ", dq, hkv)
            if said:
                raise ExerciseError(f"my_attn_bwd_dq: {said} ({what}).")
            dq_pairs = pair_grads(q, k, v, do, causal, window)[0]
            for heads, hint in _head_slips(hq, hkv):
                if close(dq, dq_pairs[:, torch.arange(hq), heads], 1e-3, 1e-3):
                    raise ExerciseError(f"dQ of my_attn_bwd_dq is wrong ({what}): {hint}.")
            raise ExerciseError(f"dQ of my_attn_bwd_dq is wrong ({what}, BLOCK_Q, BLOCK_KV = {dq_blocks}): "
                                + ("it is chapter 07's dQ kernel with the K/V head of its query head."
                                   if window == (-1, -1) else
                                   "under the window it visits the same tiles as the forward, with the same "
                                   "bounds and the same mask."))
        where = f"({what}, BLOCK_Q, BLOCK_KV = {dkdv_blocks})"
        if torch.isnan(dk.cpu()).any() or torch.isnan(dv.cpu()).any():
            raise ExerciseError(f"dK or dV of my_attn_bwd_dkdv has NaN {where}: each program stores its key block "
                                "of its K/V head (grid axis 1), rows < n_kv and columns < HEAD_DIM, and every load of "
                                "Q, dO, the LSE and Delta needs its mask.")
        said = _name_group_slip(dk, dv, pair_grads(q, k, v, do, causal, window), hq // hkv)
        if said:
            raise ExerciseError(f"dK and dV of my_attn_bwd_dkdv are wrong {where}: {said}.")
        if window != (-1, -1) and symmetric_ok and window[0] != window[1]:
            raise ExerciseError(
                f"dK and dV of my_attn_bwd_dkdv are wrong {where}, and right under a symmetric window: seen from "
                "key j, the window turns around, queries j - win_right .. j + win_left see it. So the dK/dV "
                "program's query range is my_window_bounds(kv_start, n_q, win_right, win_left, BLOCK_KV, "
                "BLOCK_Q), and in the transposed tile my_in_window still takes (query, key): "
                "(queries[None, :], offs_kv[:, None]).")
        raise ExerciseError(f"dK and dV of my_attn_bwd_dkdv are wrong {where}: "
                            + ("it is chapter 07's dK/dV kernel with a loop over the query heads of the group."
                               if window == (-1, -1) else
                               "check its query range under the window and the transposed tile's mask."))
    passed(f"my_attn_bwd_dq and my_attn_bwd_dkdv pass the rule against float64 in all {len(BACKWARD_CASES)} "
           "cases: grouped heads summed over their group, causal and not, windows on both sides, lopsided and "
           "causal")
