"""Checkers of chapter 07: the Delta kernel, and the inner loops of the dK/dV and dQ stages in Triton,
with the small kernels that run a learner's loop (``dkdv_exercise_kernel``, ``dq_exercise_kernel``).

A wrong gradient is compared with what the likely slips produce, alone and two at a time, so that
the message names the mistake: an ln 2 or log2 e too many, a missing ``qk_scale``, ``exp`` for
``exp2``, Delta left out or summed over one tile, LSE and Delta swapped, the causal mask left out,
turned the wrong way round or dropping the diagonal. The slips are modelled in float64 by
:func:`loop_model`, which follows the kernels' tile ranges (``flashattn.kernels.traversal``).
"""
import itertools
import math

import torch
import triton
import triton.language as tl

from ...kernels import traversal
from ..notebook import pick
from ...testing.reference import naive_attention
from ...gpu.runtime import DEVICE
from ...kernels.tiles import LN2, LOG2E, kv_stage_bounds
from .common import ExerciseError, attempt, close, expect_close, launch_learner_kernel, passed


def _generator(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


# --- Exercise 1: the Delta kernel -------------------------------------------------------------------

def check_delta_kernel(delta_kernel):
    """The Delta preprocess as a Triton kernel, launched as
    ``delta_kernel[(cdiv(n_rows, BLOCK_ROWS),)](O, dO, Delta, n_rows, stride_o, stride_do,
    HEAD_DIM=..., BLOCK_ROWS=..., BLOCK_D=...)`` on (n_rows, HEAD_DIM) matrices whose rows are
    ``stride_o``/``stride_do`` elements apart (columns contiguous). Checks ragged row counts, head dims
    that need padding, float16 inputs (which must be multiplied and summed in float32) and that
    nothing is written past the end of Delta; names Delta taken from the wrong tensors."""
    cases = [(1, 16, 16, torch.float32), (17, 40, 16, torch.float32), (69, 64, 32, torch.float32),
             (130, 24, 64, torch.float32), (69, 64, 16, torch.float16), (33, 40, 32, torch.float16)]
    for n, (n_rows, d, block_rows, dtype) in enumerate(cases):
        g = _generator(300 + n)
        block_d = max(16, triton.next_power_of_2(d))
        pad = block_rows + 1  # rows past the end hold NaN: a load there is harmless only if masked
        o_buf = torch.full((n_rows + pad, d + 8), float("nan"), dtype=dtype)
        do_buf = torch.full((n_rows + pad, d + 3), float("nan"), dtype=dtype)
        o_buf[:n_rows, :d] = torch.randn(n_rows, d, generator=g) * 2
        do_buf[:n_rows, :d] = torch.randn(n_rows, d, generator=g) * 2
        o_buf, do_buf = o_buf.to(DEVICE), do_buf.to(DEVICE)
        o, do = o_buf[:n_rows, :d], do_buf[:n_rows, :d]
        o[:, 0], do[:, 0] = 30.0, 30.0  # a large common term: float16 sums lose the small ones
        delta_buf = torch.full((n_rows + pad,), -7.0, dtype=torch.float32, device=DEVICE)
        launch_learner_kernel(delta_kernel, (triton.cdiv(n_rows, block_rows),),
                              (o, do, delta_buf, n_rows, o.stride(0), do.stride(0)),
                              dict(HEAD_DIM=d, BLOCK_ROWS=block_rows, BLOCK_D=block_d), "delta_kernel",
                              delta_kernel)
        what = f"n_rows={n_rows}, HEAD_DIM={d}, BLOCK_ROWS={block_rows}, BLOCK_D={block_d}, {dtype}"
        if not (delta_buf[n_rows:].cpu() == -7.0).all():
            raise ExerciseError(f"{what}: your kernel wrote past the end of Delta (rows >= n_rows): "
                                "mask the store with `rows < n_rows`.")
        want = (o.double() * do.double()).sum(-1)
        got = delta_buf[:n_rows]
        if torch.isnan(got).any():
            raise ExerciseError(f"{what}: Delta has NaN: some loads read outside the {n_rows} x {d} matrix "
                                "(the padded columns d >= HEAD_DIM or the rows >= n_rows need a mask, "
                                "with other=0.0).")
        for wrong, tensors in (((o.double() ** 2).sum(-1), "O * O"), ((do.double() ** 2).sum(-1), "dO * dO")):
            if close(got, wrong, atol=1e-2, rtol=5e-3):
                raise ExerciseError(f"{what}: your Delta is rowsum({tensors}); Delta multiplies the two "
                                    "different tensors, rowsum(dO * O) (is one of the loads reading the "
                                    "wrong pointer or stride?).")
        if dtype == torch.float16 and not close(got, want, atol=2e-4, rtol=2e-5) \
                and close(got, want, atol=1e-2, rtol=5e-3):  # close, but not float32-close
            raise ExerciseError(f"{what}: Delta lost precision: convert O and dO to float32 before "
                                "multiplying (`.to(tl.float32)`), as the package's preprocess does.")
        expect_close(f"Delta ({what})", got, want, atol=2e-4, rtol=2e-5)
    passed("delta_kernel computes Delta = rowsum(dO * O) for ragged rows, padded head dims and float16")


# --- The slips of a backward loop, modelled in float64 ------------------------------------------------

#: What a learner's loop may get wrong, one field each: ``{field: {value: what it means}}``. The
#: right value of each field is None.
SLIPS = {
    "exponent": {
        "exp": "exp instead of exp2 (the LSE and qk_scale are in base 2: P = exp2(s * qk_scale - LSE2))",
        "no scale": "P rebuilt without qk_scale, as exp2(s - LSE2): the raw score s = q.k still needs "
                    "scale * log2(e)",
        "scale": "P rebuilt with the softmax scale instead of qk_scale = scale * log2(e): in base 2 the "
                 "exponent needs the log2(e) too",
    },
    "factor": {
        "ln2": "dS multiplied by ln 2 inside the loop. That factor belongs to a loop over a K (or Q) "
               "pre-scaled by scale * log2(e), whose exponent has no qk_scale; here qk_scale sits in the "
               "exp2 argument, the ln 2 of d(2**x)/dx cancels its log2(e), and dS = P * (dP - Delta) "
               "needs no constant (chapter 06, sections 8-9)",
        "log2e": "dS multiplied by log2(e) (or divided by ln 2) inside the loop: the ln 2 of d(2**x)/dx and "
                 "the log2(e) folded into qk_scale cancel, so dS needs no constant",
        "qk_scale": "dS multiplied by qk_scale inside the loop: the kernel multiplies by scale once, after "
                    "the loop, and the log2(e) cancels with the ln 2 of d(2**x)/dx",
    },
    "delta": {
        "none": "forgot Delta (dS = P * dP instead of P * (dP - Delta))",
        "tile": "Delta summed over this tile only (sum of P * dP over the tile's keys): the row sum runs "
                "over ALL keys, which is why Delta is computed beforehand as rowsum(dO * O)",
        "swapped": "LSE and Delta swapped (P rebuilt from Delta, Delta taken from the LSE)",
    },
    "mask": {
        "none": "no causal mask on the diagonal tiles",
        "reversed": "the causal mask the wrong way round (it keeps key >= query; query i sees keys j <= i)",
        "strict": "the causal mask drops the diagonal (key < query; query i also sees key i)",
    },
}

NAMES = {"dq": "dQ", "dk": "dK", "dv": "dV"}


def _stage_pairs(n_q, n_kv, block_q, block_kv, is_causal, stage):
    """``(visited, masked)``: boolean (n_q, n_kv) maps of the pairs in the tiles a stage computes, and
    of those it computes with MASKED=True. ``stage`` is "dq" (a program per query block, keys in
    ``kv_ranges``) or "dkdv" (a program per key block, queries in ``q_ranges``)."""
    visited = torch.zeros(n_q, n_kv, dtype=torch.bool)
    masked = torch.zeros(n_q, n_kv, dtype=torch.bool)
    if stage == "dq":
        for q0 in range(0, n_q, block_q):
            full_end, end = traversal.kv_ranges(q0, block_q, block_kv, n_kv, is_causal)
            visited[q0:q0 + block_q, :end] = True
            masked[q0:q0 + block_q, full_end:end] = True
    else:
        for k0 in range(0, n_kv, block_kv):
            lo, full_lo, full_hi, hi = traversal.q_ranges(k0, block_kv, block_q, n_q, is_causal)
            visited[lo:hi, k0:k0 + block_kv] = True
            masked[lo:full_lo, k0:k0 + block_kv] = True
            masked[full_hi:hi, k0:k0 + block_kv] = True
    return visited, masked


def loop_model(q, k, v, do, is_causal, scale, stage, block_q, block_kv, slips=None):
    """dQ, dK, dV in float64 as a loop of ``stage`` ("dq" or "dkdv") computes them with ``slips``
    (``{field: value}`` from :data:`SLIPS`; none: the right gradients), on (heads, N, D) tensors.

    Returns ``{"dq": (value, size), "dk": ..., "dv": ...}``; ``size`` is the sum of the magnitudes
    of the terms a kernel adds up for each element (e.g. ``scale * |dS| @ |K|`` for dQ): a kernel's
    rounding error grows with it, not with the sum itself."""
    slips = slips or {}
    q, k, v, do = (t.double().cpu() for t in (q, k, v, do))
    n_q, n_kv = q.shape[-2], k.shape[-2]
    o, lse = naive_attention(q, k, v, is_causal=is_causal, scale=scale)
    lse2, delta = lse * LOG2E, (do * o).sum(-1)
    if slips.get("delta") == "swapped":
        lse2, delta = delta, lse2
    s = q @ k.transpose(-2, -1)
    exponent = slips.get("exponent")
    c = {"no scale": 1.0, "scale": scale}.get(exponent, scale * LOG2E)
    p = (torch.exp if exponent == "exp" else torch.exp2)(s * c - lse2[..., None])
    visited, masked = _stage_pairs(n_q, n_kv, block_q, block_kv, is_causal, stage)
    i, j = torch.arange(n_q)[:, None], torch.arange(n_kv)[None, :]
    rule = {None: j <= i, "none": j >= 0, "reversed": j >= i, "strict": j < i}[slips.get("mask")]
    visible = visited & (~masked | rule) if is_causal else visited
    p = p * visible
    dp = do @ v.transpose(-2, -1)
    if slips.get("delta") == "none":
        delta = torch.zeros_like(delta)[..., None]
    elif slips.get("delta") == "tile":  # per key tile of BLOCK_KV: the dQ loop's step, the dK/dV program's block
        tile = j[0] // block_kv
        sums = torch.zeros(*p.shape[:-1], int(tile.max()) + 1, dtype=p.dtype).index_add_(-1, tile, p * dp)
        delta = sums[..., tile]
    else:
        delta = delta[..., None]
    factor = {"ln2": LN2, "log2e": LOG2E, "qk_scale": scale * LOG2E}.get(slips.get("factor"), 1.0)
    ds = p * (dp - delta) * factor
    return {"dq": (scale * ds @ k, scale * ds.abs() @ k.abs()),
            "dk": (scale * ds.transpose(-2, -1) @ q, scale * ds.abs().transpose(-2, -1) @ q.abs()),
            "dv": (p.transpose(-2, -1) @ do, p.transpose(-2, -1) @ do.abs())}


def _slip_sets():
    """Every single slip, then every pair of slips of different fields."""
    singles = [((field, value),) for field in SLIPS for value in SLIPS[field]]
    pairs = [a + b for a, b in itertools.combinations(singles, 2) if a[0][0] != b[0][0]]
    return singles + pairs


def name_the_slips(got, inputs, is_causal, scale, stage, block_q, block_kv, tol):
    """The description of the slip (or pair of slips) whose float64 model matches every output in
    ``got`` (``{"dq": tensor}`` or ``{"dk": ..., "dv": ...}``), or None.

    An output matches a model within ``tol`` x (1 + the size of its terms): without the causal mask,
    terms of size ~100 may cancel to a few units, and on a GPU, TF32 products leave errors well
    above ``tol`` x |dQ| there. A model that equals the right gradients on these inputs (a mask
    slip on a case that is not causal) says nothing, and is skipped."""
    got = {name: torch.as_tensor(t).detach().double().cpu() for name, t in got.items()}
    model = lambda slips: loop_model(*inputs, is_causal, scale, stage, block_q, block_kv, slips)  # noqa: E731
    right = model(None)

    def matches(a, b):
        return all(a[name][0].shape == b[name][0].shape and
                   ((a[name][0] - b[name][0]).abs() <= tol * (1 + b[name][1])).all() for name in got)

    for slips in _slip_sets():
        wrong = model(dict(slips))
        if matches(right, wrong):
            continue  # this slip changes nothing here
        if matches({name: (g, None) for name, g in got.items()}, wrong):
            said = [SLIPS[field][value] for field, value in slips]
            if len(said) == 1:
                return f"it equals what you get with this mistake: {said[0]}."
            return f"it equals what you get with two mistakes at once: {said[0]}; AND {said[1]}."
    return None


# --- Exercise 3: the dK/dV stage's inner loop ---------------------------------------------------------

@triton.jit
def dkdv_exercise_kernel(Q, K, V, dO, LSE, Delta, dK, dV,
                         stride_qh, stride_qn, stride_kh, stride_kn, stride_lh,
                         n_q, n_kv, scale, qk_scale, INNER: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
                         BLOCK_KV: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """The dK/dV stage of chapter 07's exercise, around the learner's inner loop ``INNER`` (a
    @triton.jit function passed as a compile-time constant, and called like flashattn's dkdv_inner).

    One program per (key block, head) of (heads, N, D) tensors whose columns are contiguous; Q and
    dO share their strides, and so do K, V, dK and dV; LSE and Delta are (heads, N_q) rows
    ``stride_lh`` apart. It loads the resident K and V tiles, then calls INNER three times with the
    query ranges of flashattn.kernels.traversal.q_ranges: the diagonal (MASKED=True, causal only), the whole
    unmasked blocks (MASKED=False), and the ragged last block (MASKED=True). BLOCK_Q divides BLOCK_KV."""
    kv_block, head = tl.program_id(0), tl.program_id(1)
    Q += head * stride_qh
    dO += head * stride_qh
    K += head * stride_kh
    V += head * stride_kh
    dK += head * stride_kh
    dV += head * stride_kh
    LSE += head * stride_lh
    Delta += head * stride_lh
    kv_start = kv_block * BLOCK_KV
    offs_kv = kv_start + tl.arange(0, BLOCK_KV)
    offs_d = tl.arange(0, BLOCK_D)
    inside = (offs_kv[:, None] < n_kv) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + offs_kv[:, None] * stride_kn + offs_d[None, :], mask=inside, other=0.0)
    v = tl.load(V + offs_kv[:, None] * stride_kn + offs_d[None, :], mask=inside, other=0.0)
    dk = tl.zeros([BLOCK_KV, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_KV, BLOCK_D], dtype=tl.float32)
    if IS_CAUSAL:  # queries before kv_start see none of these keys
        q_lo = kv_start
        q_full_lo = kv_start + BLOCK_KV
    else:
        q_lo = 0
        q_full_lo = 0
    q_full_hi = q_full_lo + tl.maximum(n_q - q_full_lo, 0) // BLOCK_Q * BLOCK_Q
    dk, dv = INNER(dk, dv, k, v, Q, dO, LSE, Delta, stride_qn, offs_kv, offs_d, q_lo, tl.minimum(q_full_lo, n_q),
                   n_q, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_Q, True, IS_CAUSAL)
    dk, dv = INNER(dk, dv, k, v, Q, dO, LSE, Delta, stride_qn, offs_kv, offs_d, q_full_lo, q_full_hi,
                   n_q, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_Q, False, IS_CAUSAL)
    dk, dv = INNER(dk, dv, k, v, Q, dO, LSE, Delta, stride_qn, offs_kv, offs_d, q_full_hi, n_q,
                   n_q, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_Q, True, IS_CAUSAL)
    dk *= scale
    tl.store(dK + offs_kv[:, None] * stride_kn + offs_d[None, :], dk, mask=inside)
    tl.store(dV + offs_kv[:, None] * stride_kn + offs_d[None, :], dv, mask=inside)


def _rows_of(lse64, delta64, n_q, pad):
    """The rows' base-2 LSE and Delta in float32, with ``pad`` NaN entries after each head's rows."""
    heads = lse64.shape[0]
    lse2, delta = (torch.full((heads, n_q + pad), float("nan")) for _ in range(2))
    lse2[:, :n_q], delta[:, :n_q] = lse64 * LOG2E, delta64
    return lse2.to(DEVICE), delta.to(DEVICE)


def run_dkdv_inner(dkdv_inner, q, k, v, do, is_causal=False, scale=None, block_q=16, block_kv=32):
    """Run the dK/dV stage built around ``dkdv_inner`` on float32 (heads, N, D) tensors; the LSE and
    Delta come from a float64 reference. Q, dO, the LSE and Delta are stored with NaN after their
    last row and (Q, dO) past their last column, so that a load there that is not masked shows.
    Returns (dK, dV) in float32."""
    heads, n_q, d = q.shape
    n_kv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    o64, lse64 = naive_attention(q.double(), k.double(), v.double(), is_causal=is_causal, scale=scale)
    delta64 = (o64 * do.double()).sum(-1)
    pad = block_q + 1
    q_buf, do_buf = (torch.full((heads, n_q + pad, d + 5), float("nan")) for _ in range(2))
    q_buf[:, :n_q, :d], do_buf[:, :n_q, :d] = q.float().cpu(), do.float().cpu()
    q_buf, do_buf = q_buf.to(DEVICE), do_buf.to(DEVICE)
    k, v = (t.float().contiguous() for t in (k, v))
    lse2, delta = _rows_of(lse64.cpu(), delta64.cpu(), n_q, pad)
    dk, dv = (torch.full_like(k, float("nan")) for _ in range(2))
    launch_learner_kernel(dkdv_exercise_kernel, (triton.cdiv(n_kv, block_kv), heads),
                          (q_buf, k, v, do_buf, lse2, delta, dk, dv, q_buf.stride(0), q_buf.stride(1),
                           k.stride(0), k.stride(1), lse2.stride(0), n_q, n_kv, scale, scale * LOG2E, dkdv_inner),
                          dict(HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_Q=block_q,
                               BLOCK_KV=block_kv, IS_CAUSAL=bool(is_causal)), "dkdv_inner", dkdv_inner)
    return dk, dv


def _check_loop(stage, run, cases, seed):
    """Run a learner's loop of ``stage`` on ``cases`` and compare it with the float64 model; name
    the slips when it is wrong."""
    tol = pick(cpu=2e-5, gpu=1e-2)  # a GPU multiplies float32 tiles in TF32 by default
    # Slips such as a missing qk_scale make P large and its rounding error with it: a slip is
    # recognised within a looser bound than the one the right answer must meet.
    name_tol = pick(cpu=2e-4, gpu=1e-2)
    outputs = ("dq",) if stage == "dq" else ("dk", "dv")
    for n, (heads, n_q, n_kv, d, causal, block_q, block_kv) in enumerate(cases):
        g = _generator(seed + n)
        q, k, v, do = (torch.randn(heads, m, d, generator=g).to(DEVICE) for m in (n_q, n_kv, n_kv, n_q))
        scale = 1.0 / d ** 0.5
        got = dict(zip(outputs, run(q, k, v, do, causal, scale, block_q, block_kv)))
        want = loop_model(q, k, v, do, causal, scale, stage, block_q, block_kv)
        what = (f"heads={heads}, N_q={n_q}, N_kv={n_kv}, D={d}, is_causal={causal}, "
                f"BLOCK_Q={block_q}, BLOCK_KV={block_kv}")
        atol = {name: tol * max(1.0, want[name][0].abs().max().item()) for name in outputs}
        if all(close(got[name], want[name][0], atol=atol[name], rtol=tol) for name in outputs):
            continue
        for name in outputs:
            if torch.isnan(torch.as_tensor(got[name]).cpu()).any():
                where = ("past the last query (the rows of Q, dO, LSE and Delta) or past HEAD_DIM"
                         if stage == "dkdv" else "past HEAD_DIM or the last key")
                raise ExerciseError(f"{NAMES[name]} has NaN ({what}): a load read {where} without a mask. Mask "
                                    "every load with the rows and columns that exist (other=0.0).")
        said = name_the_slips(got, (q, k, v, do), causal, scale, stage, block_q, block_kv, name_tol)
        wrong = [name for name in outputs if not close(got[name], want[name][0], atol=atol[name], rtol=tol)]
        if said:
            names = " and ".join(NAMES[name] for name in wrong)
            raise ExerciseError(f"{names} {'are' if len(wrong) > 1 else 'is'} wrong ({what}); {said}")
        for name in wrong:
            expect_close(f"{NAMES[name]} ({what})", got[name], want[name][0], atol=atol[name], rtol=tol, heatmap=True)


def check_dkdv_inner(dkdv_inner):
    """The dK/dV stage's inner loop in Triton (keys along the rows of every tile), run inside a given
    kernel on tiny inputs (ragged lengths, causal and not, N_q != N_kv, a padded head dim, BLOCK_Q
    smaller than BLOCK_KV and equal to it) and compared with a float64 reference."""
    cases = [(2, 69, 69, 32, True, 16, 32), (2, 69, 69, 32, False, 16, 32), (1, 70, 45, 32, True, 16, 32),
             (1, 45, 70, 40, True, 16, 16), (2, 17, 33, 16, False, 16, 32), (1, 1, 1, 16, True, 16, 16)]

    def run(q, k, v, do, causal, scale, block_q, block_kv):
        return run_dkdv_inner(dkdv_inner, q, k, v, do, causal, scale, block_q, block_kv)

    _check_loop("dkdv", run, cases, seed=700)
    passed("dkdv_inner gives the right dK and dV for ragged lengths, causal and not, N_q != N_kv and a "
           "padded head dim")


# --- Exercise 2: the dQ stage's inner loop ------------------------------------------------------------

@triton.jit
def dq_exercise_kernel(Q, K, V, dO, LSE, Delta, dQ,
                       stride_qh, stride_qn, stride_kh, stride_kn, stride_dqh, stride_dqn,
                       n_q, n_kv, scale, qk_scale, INNER: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
                       BLOCK_KV: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """The dQ stage of chapter 07's exercise, around the learner's inner loop ``INNER`` (a
    @triton.jit function passed as a compile-time constant, and called like flashattn's dq_inner).

    One program per (query block, head) of (heads, N, D) tensors whose columns are contiguous; K and
    V share their strides, and so do Q and dO. It loads the resident tiles (q, do, and the rows' LSE2
    and Delta), then calls INNER twice with the key ranges of flashattn.kernels.traversal.kv_ranges: the
    whole unmasked tiles (MASKED=False), then the diagonal and ragged tiles (MASKED=True)."""
    q_block, head = tl.program_id(0), tl.program_id(1)
    Q += head * stride_qh
    dO += head * stride_qh
    K += head * stride_kh
    V += head * stride_kh
    dQ += head * stride_dqh
    LSE += head * n_q
    Delta += head * n_q
    q_start = q_block * BLOCK_Q
    offs_q = q_start + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    inside = (offs_q[:, None] < n_q) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + offs_q[:, None] * stride_qn + offs_d[None, :], mask=inside, other=0.0)
    do = tl.load(dO + offs_q[:, None] * stride_qn + offs_d[None, :], mask=inside, other=0.0)
    lse = tl.load(LSE + offs_q, mask=offs_q < n_q, other=0.0)
    delta = tl.load(Delta + offs_q, mask=offs_q < n_q, other=0.0)
    dq = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    kv_full_end, kv_end = kv_stage_bounds(q_start, n_kv, BLOCK_Q, BLOCK_KV, IS_CAUSAL)
    dq = INNER(dq, q, do, lse, delta, K, V, stride_kn, offs_q, offs_d, 0, kv_full_end, n_kv, qk_scale,
               HEAD_DIM, BLOCK_D, BLOCK_KV, False, IS_CAUSAL)
    dq = INNER(dq, q, do, lse, delta, K, V, stride_kn, offs_q, offs_d, kv_full_end, kv_end, n_kv, qk_scale,
               HEAD_DIM, BLOCK_D, BLOCK_KV, True, IS_CAUSAL)
    dq *= scale
    tl.store(dQ + offs_q[:, None] * stride_dqn + offs_d[None, :], dq, mask=inside)


def run_dq_inner(dq_inner, q, k, v, do, is_causal=False, scale=None, block_q=32, block_kv=16):
    """Run the dQ stage built around ``dq_inner`` on float32 (heads, N, D) tensors; the LSE and
    Delta come from a float64 reference. Returns dQ (float32)."""
    heads, n_q, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q, k, v, do = (t.float().contiguous() for t in (q, k, v, do))
    o64, lse64 = naive_attention(q.double(), k.double(), v.double(), is_causal=is_causal, scale=scale)
    lse2 = (lse64 * LOG2E).float().contiguous()
    delta = (o64 * do.double()).sum(-1).float().contiguous()
    dq = torch.full_like(q, float("nan"))
    launch_learner_kernel(dq_exercise_kernel, (triton.cdiv(n_q, block_q), heads),
                          (q, k, v, do, lse2, delta, dq, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                          dq.stride(0), dq.stride(1), n_q, k.shape[1], scale, scale * LOG2E, dq_inner),
                          dict(HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_Q=block_q,
                               BLOCK_KV=block_kv, IS_CAUSAL=bool(is_causal)), "dq_inner", dq_inner)
    return dq


def check_dq_inner(dq_inner):
    """The dQ stage's inner loop in Triton, run inside a given kernel on tiny inputs (ragged lengths,
    causal and not, N_q != N_kv, a padded head dim) and compared with a float64 reference."""
    cases = [(2, 69, 69, 32, True, 32, 16), (2, 69, 69, 32, False, 32, 16), (1, 45, 70, 32, True, 32, 16),
             (1, 70, 45, 40, True, 32, 16), (2, 33, 17, 16, False, 32, 16), (1, 1, 1, 16, True, 32, 16)]

    def run(q, k, v, do, causal, scale, block_q, block_kv):
        return (run_dq_inner(dq_inner, q, k, v, do, causal, scale, block_q, block_kv),)

    _check_loop("dq", run, cases, seed=400)
    passed("dq_inner gives the right dQ for ragged lengths, causal and not, N_q != N_kv and a padded head dim")


# --- Exercise 4: the launcher -------------------------------------------------------------------------

#: What the launcher may call of flashattn: the three kernels, and the two rules of the tile shapes.
LAUNCHER_ALLOWS = ("flashattn.kernels.backward.attn_bwd_preprocess", "flashattn.kernels.backward.attn_bwd_dkdv",
                   "flashattn.kernels.backward.attn_bwd_dq", "flashattn.gpu.configs.block_d",
                   "flashattn.gpu.configs.dot_precision")

#: (batch, heads, N_q, N_kv, D, is_causal, dtype, views, scale): odd sizes; non-contiguous views
#: (Q transposed from (B, N, H, D), K a slice of wider rows, V with its head dim strided, dO and O
#: views too); N_kv far above N_q and the reverse, where a grid over the wrong blocks misses some.
LAUNCHER_CASES = [(1, 2, 19, 27, 24, False, torch.float32, False, None),
                  (1, 2, 19, 27, 24, True, torch.float32, False, 0.3),
                  (2, 3, 19, 27, 24, True, torch.float32, True, None),
                  (1, 2, 27, 19, 24, False, torch.float32, True, 0.2),
                  (1, 1, 5, 70, 16, False, torch.float32, False, None),
                  (1, 1, 70, 5, 16, False, torch.float32, False, None),
                  (1, 2, 19, 27, 24, True, torch.float16, True, None)]


def _views(batch, heads, n_q, n_kv, d, dtype, g):
    """q, k, v, do as non-contiguous views (each with strides of its own), values from ``g``."""
    q = torch.randn(batch, n_q, heads, d, generator=g).to(DEVICE, dtype).transpose(1, 2)
    k = torch.randn(batch, heads, n_kv, d + 8, generator=g).to(DEVICE, dtype)[..., :d]
    v = torch.randn(batch, heads, d, n_kv, generator=g).to(DEVICE, dtype).transpose(-1, -2)
    do = torch.randn(batch, heads, 2 * n_q, d, generator=g).to(DEVICE, dtype)[:, :, ::2]
    return q, k, v, do


def _strided_copy(t):
    """``t`` copied into a view whose rows are not contiguous: (B, N, H, D) memory, seen as (B, H, N, D)."""
    buf = torch.empty(t.shape[0], t.shape[2], t.shape[1], t.shape[3], dtype=t.dtype, device=t.device)
    view = buf.transpose(1, 2)
    view.copy_(t)
    return view


def backward_model(q, k, v, do, is_causal, scale, c=None, grad_scale=None, delta="dO * O"):
    """dQ, dK, dV in float64 as a launcher computes them when it passes the exponent factor ``c``
    (right: scale * log2 e) and the final factor ``grad_scale`` (right: scale) to the kernels, and
    Delta as ``delta``: "dO * O" (right), "none" (zeros), "O * O", "dO * dO"."""
    q, k, v, do = (t.double().cpu() for t in (q, k, v, do))
    o, lse = naive_attention(q, k, v, is_causal=is_causal, scale=scale)
    c = scale * LOG2E if c is None else c
    grad_scale = scale if grad_scale is None else grad_scale
    s = q @ k.transpose(-2, -1)
    p = torch.exp2(s * c - (lse * LOG2E)[..., None])
    if is_causal:
        p = p * naive_mask(q.shape[-2], k.shape[-2])
    rows = {"dO * O": do * o, "none": 0 * o, "O * O": o * o, "dO * dO": do * do}[delta]
    ds = p * (do @ v.transpose(-2, -1) - rows.sum(-1)[..., None])
    return grad_scale * ds @ k, grad_scale * ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ do


def naive_mask(n_q, n_kv):
    return (torch.arange(n_kv)[None, :] <= torch.arange(n_q)[:, None]).double()


#: The launcher's likely mistakes, as arguments of backward_model (a function of scale) and what
#: the message says.
LAUNCHER_MISTAKES = [
    (lambda s: dict(delta="none"), "Delta is missing (dS = P * dP): launch attn_bwd_preprocess before the "
     "two gradient kernels, and pass them its Delta"),
    (lambda s: dict(delta="O * O"), "Delta is rowsum(O * O): the preprocess kernel takes O and dO, each "
     "with its own strides"),
    (lambda s: dict(delta="dO * dO"), "Delta is rowsum(dO * dO): the preprocess kernel takes O and dO, "
     "each with its own strides"),
    (lambda s: dict(grad_scale=s * s), "the scale is applied twice: the kernels multiply dQ and dK by "
     "`scale` once, at the end; do not multiply again (nor pre-scale Q)"),
    (lambda s: dict(grad_scale=1.0), "the scale is missing from dQ and dK: the kernels' `scale` argument "
     "is the softmax scale, which they apply once at the end"),
    (lambda s: dict(c=s), "the exponent factor is `scale`: the kernels rebuild P with exp2, so their "
     "`qk_scale` argument is scale * log2(e)"),
    (lambda s: dict(c=LOG2E, grad_scale=1.0), "with scale=None the gradients are those of scale 1: "
     "the default scale is 1/sqrt(D), as in the forward"),
]


def check_my_attention_backward(my_attention_backward):
    """The backward's launcher ``my_attention_backward(q, k, v, o, lse2, do, is_causal=False,
    scale=None) -> (dq, dk, dv)``: the Delta preprocess, the dK/dV kernel over key blocks and the
    dQ kernel over query blocks, on odd sizes (N_q = 19, N_kv = 27, D = 24, and lengths far apart),
    causal and not, contiguous and not, float32 and float16, compared with float64 autograd under
    the tolerance rule (flashattn.testing.rule). Names Delta missing or taken from the wrong tensors,
    a grid over the wrong blocks, the scale applied twice or not at all (or its default forgotten),
    qk_scale without log2 e, strides assumed contiguous, and gradients returned in the wrong dtype."""
    from ...kernels.forward import attention_forward
    from ...testing.rule import judge

    name = "my_attention_backward"
    for n, (batch, heads, n_q, n_kv, d, causal, dtype, views, scale) in enumerate(LAUNCHER_CASES):
        g = _generator(900 + n)
        if views:
            q, k, v, do = _views(batch, heads, n_q, n_kv, d, dtype, g)
        else:
            q, k, v, do = (torch.randn(batch, heads, m, d, generator=g).to(DEVICE, dtype)
                           for m in (n_q, n_kv, n_kv, n_q))
        s = 1.0 / math.sqrt(d) if scale is None else scale
        o, lse2 = attention_forward(q, k, v, causal, s)
        if views:
            o = _strided_copy(o)
        what = (f"B={batch}, H={heads}, N_q={n_q}, N_kv={n_kv}, D={d}, is_causal={causal}, {str(dtype)[6:]}, "
                f"{'non-contiguous views' if views else 'contiguous'}, scale={scale}")

        def run(*tensors):
            extra = {} if scale is None else {"scale": scale}
            out = attempt(my_attention_backward, *tensors, name=name, forbid=("flashattn", "sdpa"),
                          allow=LAUNCHER_ALLOWS, is_causal=causal, **extra)
            if not isinstance(out, (tuple, list)) or len(out) != 3:
                raise ExerciseError(f"{name} should return (dq, dk, dv), got {type(out).__name__}")
            return out

        try:
            got = run(q, k, v, o, lse2, do)
        except ExerciseError as error:
            # wrong strides can read past a view's memory: the interpreter then fails on the garbage
            if views:
                run(*(t.contiguous() for t in (q, k, v, o, lse2, do)))  # raises again if not the views
                raise ExerciseError(f"right on contiguous tensors, wrong on non-contiguous views ({what}): on the "
                                    f"views it failed ({error}). Pass each tensor's own strides (*x.stride()) for "
                                    "every pointer a kernel gets, never another tensor's or strides computed from "
                                    "the shape.") from None
            raise
        for grad, like, label in zip(got, (q, k, v), ("dq", "dk", "dv")):
            if not isinstance(grad, torch.Tensor) or tuple(grad.shape) != tuple(like.shape):
                shape = tuple(grad.shape) if isinstance(grad, torch.Tensor) else type(grad).__name__
                raise ExerciseError(f"{label} has shape {shape} ({what}); expected {tuple(like.shape)}, "
                                    f"the shape of {label[1:]}")
            if grad.dtype != like.dtype:
                raise ExerciseError(f"{label} is {grad.dtype} for {like.dtype} inputs ({what}): return each "
                                    f"gradient in its input's dtype. The kernels accumulate in float32 on chip and "
                                    f"each tile is written once, so allocating {label} like {label[1:]} loses nothing.")
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = torch.autograd.grad(naive_attention(*leaves, is_causal=causal, scale=s)[0], leaves, do.double())
        base = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        pytorch = torch.autograd.grad(naive_attention(*base, is_causal=causal, scale=s)[0], base, do)
        names = ("dq", "dk", "dv")
        checks = judge(dict(zip(names, got)), dict(zip(names, ref)), dict(zip(names, pytorch)), dtype,
                       upstream=do.abs().max().item())
        if all(c.ok for c in checks):
            continue
        _name_launcher_mistake(run, got, (q, k, v, o, lse2, do), ref, causal, s, scale, what, checks)
    passed("my_attention_backward launches Delta, dK/dV over key blocks and dQ over query blocks, and its "
           "gradients pass the rule for odd sizes, causal and not, views, float32 and float16")


def _name_launcher_mistake(run, got, tensors, ref, causal, s, scale, what, checks):
    """Raise the ExerciseError that names what the launcher got wrong on this case."""
    q, k, v, o, lse2, do = tensors
    if not all(t.is_contiguous() for t in (q, k, v, o, do)):
        again = run(*(t.contiguous() for t in tensors))
        if all(close(a, r, atol=3e-3 * (1 + r.abs().max().item()), rtol=1e-2) for a, r in zip(again, ref)):
            raise ExerciseError(f"right on contiguous tensors, wrong on non-contiguous views ({what}): pass each "
                                "tensor's own strides (*x.stride()) for every pointer a kernel gets, never "
                                "another tensor's or strides computed from the shape.")
    # rows right up to a block boundary, wrong from there on: a grid that stops early (the rows past
    # it hold whatever the allocation held, which may be right by chance in places)
    for label, grad, want, n, blocks in (("dK and dV", got[1], ref[1], k.shape[2], "key block (cdiv(N_kv, BLOCK_KV) programs)"),
                                        ("dQ", got[0], ref[0], q.shape[2], "query block (cdiv(N_q, BLOCK_Q) programs)")):
        bad = ~((grad.double().cpu() - want.cpu()).abs() <= 3e-3 * (1 + want.abs().max().item())).all(-1)
        rows = bad.reshape(-1, n).any(0)
        first = int(rows.nonzero()[0]) if rows.any() else 0
        if first > 0 and first % 16 == 0:  # whole blocks right, then not one row right past them
            raise ExerciseError(f"{label} {'is' if label == 'dQ' else 'are'} right for positions 0..{first - 1} and wrong from {first} on "
                                f"({what}): the grid of its kernel stops early. It needs one program per "
                                f"{blocks}, on axis 0 (then heads, then batch).")
    for label, grad in zip(("dQ", "dK", "dV"), got):
        if torch.isnan(grad.float()).any():
            raise ExerciseError(f"{label} has NaN ({what}): check the tensors and strides each kernel gets.")
    flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v, do)]
    for args, said in LAUNCHER_MISTAKES:
        if scale is not None and "scale=None" in said:
            continue
        model = backward_model(*flat, causal, s, **args(s))
        if all(close(a.reshape(m.shape), m, atol=3e-3 * (1 + m.abs().max().item()), rtol=1e-2)
               for a, m in zip(got, model)):
            raise ExerciseError(f"the gradients are wrong ({what}): {said}.")
    worst = max((c for c in checks if not c.ok), key=lambda c: c.error / max(c.bound, 1e-30))
    raise ExerciseError(f"{worst.name} is wrong ({what}): error {worst.error:.2e} against float64, above the "
                        f"rule's bound {worst.bound:.2e} (3 x PyTorch's {worst.baseline:.2e} + floor).")
