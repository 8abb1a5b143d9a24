"""Checkers of chapter 07's first exercises: the Delta kernel (exercise 1) and the inner loops of
the dQ and dK/dV stages (exercises 2a and 3a) in Triton, with the small kernels that run a
learner's loop on its own (``dq_exercise_kernel``, ``dkdv_exercise_kernel``). The whole dQ and
dK/dV kernels and the launcher are checked in ``ch07_kernels``.

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
from .common import ExerciseError, close, expect_close, launch_learner_kernel, passed


def _generator(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


def padded_view(shape, layout, dtype, values=None):
    """A view of ``shape`` (..., N, D) inside a larger NaN-filled buffer on DEVICE, so that a load
    outside it that is not masked shows as NaN. ``layout``: "padded" (rows further apart than D),
    "bnhd" (a (B, N, H, D) buffer seen as (B, H, N, D); 4-D shapes only), "strided_d" (columns two
    elements apart, the elements between them 0, so that a column stride taken as 1 reads wrong
    numbers rather than NaN), "transposed" (the head dim outermost: rows 1 element apart, columns N + 19).
    ``values`` (a tensor of ``shape``) fills the view."""
    *lead, n, d = shape
    full = dict(dtype=dtype, device=DEVICE)
    if layout == "bnhd":
        b, h = lead
        view = torch.full((b, n + 19, h, d + 3), float("nan"), **full).transpose(1, 2)[..., :n, :d]
    elif layout == "strided_d":
        buf = torch.full((*lead, n + 19, 2 * d + 10), float("nan"), **full)
        buf[..., :n, 1:2 * d:2] = 0
        view = buf[..., :n, 0:2 * d:2]
    elif layout == "transposed":
        view = torch.full((*lead, d + 5, n + 19), float("nan"), **full).transpose(-1, -2)[..., :n, :d]
    else:
        view = torch.full((*lead, n + 19, d + 8), float("nan"), **full)[..., :n, :d]
    if values is not None:
        view.copy_(values)
    return view


# --- Exercise 1: the Delta kernel -------------------------------------------------------------------

#: (B, H, N_q, D, BLOCK_Q, dtype, O's layout, dO's layout): ragged row counts, head dims that need
#: padding, O and dO with strides of their own, float16 (which must be multiplied in float32).
DELTA_CASES = [(1, 1, 1, 16, 16, torch.float32, "padded", "padded"),
               (1, 2, 17, 40, 16, torch.float32, "padded", "padded"),
               (2, 3, 69, 64, 32, torch.float32, "bnhd", "padded"),
               (1, 2, 130, 24, 64, torch.float32, "padded", "strided_d"),
               (2, 2, 69, 64, 16, torch.float16, "bnhd", "bnhd"),
               (1, 3, 33, 40, 32, torch.float16, "strided_d", "padded")]


def check_delta_kernel(delta_kernel):
    """The Delta preprocess as a Triton kernel, launched as ``delta_kernel[(cdiv(N_q, BLOCK_Q), H,
    B)](O, dO, Delta, *o.stride(), *do.stride(), H, N_q, HEAD_DIM=..., BLOCK_D=..., BLOCK_Q=...)``
    on (B, H, N_q, D) tensors O and dO of any strides, Delta a contiguous float32 (B, H, N_q) tensor.
    Checks ragged row counts, head dims that need padding, O and dO laid out differently, float16
    inputs (multiplied and summed in float32), and that nothing is written past the end of Delta;
    names Delta taken from the wrong tensors, the wrong (batch, head) offsets and strides assumed
    alike."""
    alike_ok = False
    for n, (batch, heads, n_q, d, block_q, dtype, o_layout, do_layout) in enumerate(DELTA_CASES):
        g = _generator(300 + n)
        values = [torch.randn(batch, heads, n_q, d, generator=g) * 2 for _ in range(2)]
        for t in values:
            t[..., 0] = 30.0  # a large common term: float16 sums lose the small ones
        o = padded_view(values[0].shape, o_layout, dtype, values[0])
        do = padded_view(values[1].shape, do_layout, dtype, values[1])
        size = batch * heads * n_q
        delta_buf = torch.full((size + block_q + 1,), -7.0, dtype=torch.float32, device=DEVICE)
        delta = delta_buf[:size].view(batch, heads, n_q)
        block_d = max(16, triton.next_power_of_2(d))
        launch_learner_kernel(delta_kernel, (triton.cdiv(n_q, block_q), heads, batch),
                              (o, do, delta, *o.stride(), *do.stride(), heads, n_q),
                              dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_Q=block_q), "delta_kernel", delta_kernel)
        what = (f"B={batch}, H={heads}, N_q={n_q}, HEAD_DIM={d}, BLOCK_Q={block_q}, {str(dtype)[6:]}, "
                f"O {o_layout}, dO {do_layout}")
        if not (delta_buf[size:].cpu() == -7.0).all():
            raise ExerciseError(f"{what}: your kernel wrote past the end of Delta (rows >= n_q of the last head): "
                                "mask the store with `rows < n_q`.")
        got = delta.cpu().double()
        if (got == -7.0).any():
            b, h, row = (int(x) for x in (got == -7.0).nonzero()[0])
            raise ExerciseError(f"{what}: row {row} of head {h}, batch {b} of Delta was never written: each program writes "
                                "the BLOCK_Q rows of query block tl.program_id(0) of head tl.program_id(1) of batch "
                                "tl.program_id(2), at Delta + (batch * n_heads + head) * n_q.")
        o64, do64 = (t.double() for t in (o.cpu(), do.cpu()))
        want = (o64 * do64).sum(-1)
        if close(got, want, atol=2e-4, rtol=2e-5):
            alike_ok = alike_ok or o_layout == do_layout == "padded"
            continue
        right = torch.isclose(got, want, atol=1e-2, rtol=5e-3).all(-1)  # float16's tolerance: offsets, not rounding
        if right[0, 0] and not right.all():
            b, h = (int(x) for x in (~right).nonzero()[0])
            raise ExerciseError(f"{what}: Delta is right for head 0 of batch 0 and wrong for head {h} of batch {b}: "
                                "each program moves O and dO to its (batch, head), O + batch * stride_ob + "
                                "head * stride_oh (dO with its own strides), and Delta to "
                                "(batch * n_heads + head) * n_q, in 64-bit.")
        if alike_ok and o_layout != do_layout:
            raise ExerciseError(f"{what}: Delta is wrong here and right where O and dO were laid out alike with "
                                "contiguous columns: read each through its own four strides (stride_on, stride_od "
                                "for O; stride_don, stride_dod for dO).")
        if torch.isnan(got).any():
            raise ExerciseError(f"{what}: Delta has NaN: some loads read outside the N_q x HEAD_DIM rows of a head "
                                "(the memory around them holds NaN in this check): mask the columns d >= HEAD_DIM "
                                "and the rows >= n_q, with other=0.0.")
        for wrong, tensors in (((o64 ** 2).sum(-1), "O * O"), ((do64 ** 2).sum(-1), "dO * dO")):
            if close(got, wrong, atol=1e-2, rtol=5e-3):
                raise ExerciseError(f"{what}: your Delta is rowsum({tensors}); Delta multiplies the two "
                                    "different tensors, rowsum(dO * O) (is one of the loads reading the "
                                    "wrong pointer or strides?).")
        if dtype == torch.float16 and close(got, want, atol=1e-2, rtol=5e-3):  # close, but not float32-close
            raise ExerciseError(f"{what}: Delta lost precision: convert O and dO to float32 before "
                                "multiplying (`.to(tl.float32)`), as the package's preprocess does.")
        expect_close(f"Delta ({what})", got, want, atol=2e-4, rtol=2e-5)
    passed("delta_kernel computes Delta = rowsum(dO * O) for ragged rows, padded head dims, any strides and float16")


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



# --- Exercises 2a and 3a: the two inner loops, each run inside a small kernel of the course's ----------

@triton.jit
def dq_exercise_kernel(Q, K, V, dO, LSE, Delta, dQ,
                       stride_kh, stride_kn, stride_kd, stride_vh, stride_vn, stride_vd, stride_lh,
                       n_q, n_kv, scale, qk_scale, INNER: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
                       BLOCK_KV: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """The dQ stage around the learner's inner loop ``INNER`` (a @triton.jit function passed as a
    compile-time constant, called as chapter 07's exercise 2a describes).

    One program per (query block, head). Q, dO and dQ are contiguous (heads, N_q, HEAD_DIM)
    tensors, LSE and Delta (heads, N_q) rows ``stride_lh`` apart; K and V have strides of their
    own, which INNER gets. It loads the resident tiles, then calls INNER twice with the key ranges of
    flashattn.kernels.traversal.kv_ranges: the whole unmasked tiles (MASKED=False), then the
    diagonal and ragged tiles (MASKED=True), and multiplies dQ by ``scale``."""
    q_block, head = tl.program_id(0), tl.program_id(1)
    Q += head * n_q * HEAD_DIM
    dO += head * n_q * HEAD_DIM
    dQ += head * n_q * HEAD_DIM
    K += head * stride_kh
    V += head * stride_vh
    LSE += head * stride_lh
    Delta += head * stride_lh
    q_start = q_block * BLOCK_Q
    offs_q = q_start + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    inside = (offs_q[:, None] < n_q) & (offs_d[None, :] < HEAD_DIM)
    rows = offs_q[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(Q + rows, mask=inside, other=0.0)
    do = tl.load(dO + rows, mask=inside, other=0.0)
    lse = tl.load(LSE + offs_q, mask=offs_q < n_q, other=0.0)
    delta = tl.load(Delta + offs_q, mask=offs_q < n_q, other=0.0)
    dq = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    kv_full_end, kv_end = kv_stage_bounds(q_start, n_kv, BLOCK_Q, BLOCK_KV, IS_CAUSAL)
    dq = INNER(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
               offs_q, offs_d, 0, kv_full_end, n_kv, qk_scale, HEAD_DIM, BLOCK_KV, False, IS_CAUSAL)
    dq = INNER(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
               offs_q, offs_d, kv_full_end, kv_end, n_kv, qk_scale, HEAD_DIM, BLOCK_KV, True, IS_CAUSAL)
    tl.store(dQ + rows, dq * scale, mask=inside)


@triton.jit
def dkdv_exercise_kernel(Q, K, V, dO, LSE, Delta, dK, dV,
                         stride_qh, stride_qn, stride_qd, stride_doh, stride_don, stride_dod, stride_lh,
                         n_q, n_kv, scale, qk_scale, INNER: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
                         BLOCK_KV: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """The dK/dV stage around the learner's inner loop ``INNER`` (as in :func:`dq_exercise_kernel`;
    chapter 07's exercise 3a).

    One program per (key block, head). K, V, dK and dV are contiguous (heads, N_kv, HEAD_DIM)
    tensors; Q and dO have strides of their own, and LSE, Delta are (heads, N_q) rows
    ``stride_lh`` apart, which INNER gets. It loads the resident K and V tiles, then calls INNER
    three times with the query ranges of flashattn.kernels.traversal.q_ranges: the diagonal
    (MASKED=True, causal only), the whole unmasked blocks (MASKED=False), and the ragged last block
    (MASKED=True); dK is multiplied by ``scale``. BLOCK_Q divides BLOCK_KV."""
    kv_block, head = tl.program_id(0), tl.program_id(1)
    Q += head * stride_qh
    dO += head * stride_doh
    K += head * n_kv * HEAD_DIM
    V += head * n_kv * HEAD_DIM
    dK += head * n_kv * HEAD_DIM
    dV += head * n_kv * HEAD_DIM
    LSE += head * stride_lh
    Delta += head * stride_lh
    kv_start = kv_block * BLOCK_KV
    offs_kv = kv_start + tl.arange(0, BLOCK_KV)
    offs_d = tl.arange(0, BLOCK_D)
    inside = (offs_kv[:, None] < n_kv) & (offs_d[None, :] < HEAD_DIM)
    rows = offs_kv[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(K + rows, mask=inside, other=0.0)
    v = tl.load(V + rows, mask=inside, other=0.0)
    dk = tl.zeros([BLOCK_KV, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_KV, BLOCK_D], dtype=tl.float32)
    if IS_CAUSAL:  # queries before kv_start see none of these keys
        q_lo = kv_start
        q_full_lo = kv_start + BLOCK_KV
    else:
        q_lo = 0
        q_full_lo = 0
    q_full_hi = q_full_lo + tl.maximum(n_q - q_full_lo, 0) // BLOCK_Q * BLOCK_Q
    dk, dv = INNER(dk, dv, k, v, Q, dO, LSE, Delta, stride_qn, stride_qd, stride_don, stride_dod, offs_kv, offs_d,
                   q_lo, tl.minimum(q_full_lo, n_q), n_q, qk_scale, HEAD_DIM, BLOCK_Q, True, IS_CAUSAL)
    dk, dv = INNER(dk, dv, k, v, Q, dO, LSE, Delta, stride_qn, stride_qd, stride_don, stride_dod, offs_kv, offs_d,
                   q_full_lo, q_full_hi, n_q, qk_scale, HEAD_DIM, BLOCK_Q, False, IS_CAUSAL)
    dk, dv = INNER(dk, dv, k, v, Q, dO, LSE, Delta, stride_qn, stride_qd, stride_don, stride_dod, offs_kv, offs_d,
                   q_full_hi, n_q, n_q, qk_scale, HEAD_DIM, BLOCK_Q, True, IS_CAUSAL)
    tl.store(dK + rows, dk * scale, mask=inside)
    tl.store(dV + rows, dv, mask=inside)


def run_loop(stage, inner, q, k, v, do, is_causal=False, scale=None, block_q=32, block_kv=16, layout="same"):
    """Run the learner's inner loop ``inner`` of ``stage`` ("dq": exercise 2a, "dkdv": exercise 3a)
    inside the course's kernel of that stage, on (heads, N, D) tensors (float32 or float16); the
    LSE and Delta come from a float64 reference. The streamed tensors (K and V for "dq", Q and dO
    for "dkdv") are views with NaN around them, so that an unmasked load shows; with ``layout``
    "apart" the second of them (V, or dO) has strides unlike the first's. Returns ``(dq,)`` or
    ``(dk, dv)`` in float32."""
    heads, n_q, d = q.shape
    n_kv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    o64, lse64 = naive_attention(q.double(), k.double(), v.double(), is_causal=is_causal, scale=scale)
    rows = torch.full((2, heads, n_q + block_q + 1), float("nan"), device=DEVICE)  # NaN past each head's rows
    rows[0, :, :n_q], rows[1, :, :n_q] = lse64 * LOG2E, (o64 * do.double()).sum(-1)
    lse2, delta = rows[0], rows[1]
    second = {"same": "padded", "apart": "strided_d" if stage == "dkdv" else "transposed"}[layout]
    constexprs = dict(HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_Q=block_q, BLOCK_KV=block_kv,
                      IS_CAUSAL=bool(is_causal))
    name = f"{stage}_inner"
    if stage == "dq":
        k_view, v_view = padded_view(k.shape, "padded", k.dtype, k), padded_view(v.shape, second, v.dtype, v)
        q, do = q.contiguous(), do.contiguous()
        dq = torch.full(q.shape, float("nan"), device=DEVICE)
        launch_learner_kernel(dq_exercise_kernel, (triton.cdiv(n_q, block_q), heads),
                              (q, k_view, v_view, do, lse2, delta, dq, *k_view.stride(), *v_view.stride(),
                               lse2.stride(0), n_q, n_kv, scale, scale * LOG2E, inner), constexprs, name, inner)
        return (dq,)
    q_view, do_view = padded_view(q.shape, "padded", q.dtype, q), padded_view(do.shape, second, do.dtype, do)
    k, v = k.contiguous(), v.contiguous()
    dk, dv = (torch.full(k.shape, float("nan"), device=DEVICE) for _ in range(2))
    launch_learner_kernel(dkdv_exercise_kernel, (triton.cdiv(n_kv, block_kv), heads),
                          (q_view, k, v, do_view, lse2, delta, dk, dv, *q_view.stride(), *do_view.stride(),
                           lse2.stride(0), n_q, n_kv, scale, scale * LOG2E, inner), constexprs, name, inner)
    return dk, dv


#: Each loop's outputs, what it streams, and its cases: (heads, N_q, N_kv, D, causal, BLOCK_Q,
#: BLOCK_KV, dtype, layout). Float32 first (a slip is named there), ragged, N_q != N_kv both ways,
#: a padded head dim, the second streamed tensor with strides of its own, then float16.
LOOPS = {
    "dq": dict(outputs=("dq",), streamed=("K", "V"), seed=400, cases=[
        (2, 69, 69, 32, True, 32, 16, torch.float32, "same"), (2, 69, 69, 32, False, 32, 16, torch.float32, "same"),
        (1, 45, 70, 40, True, 32, 16, torch.float32, "same"), (1, 70, 45, 40, True, 32, 16, torch.float32, "apart"),
        (2, 33, 17, 16, False, 32, 16, torch.float32, "apart"), (1, 1, 1, 16, True, 32, 16, torch.float32, "same"),
        (2, 45, 70, 40, True, 32, 16, torch.float16, "apart")]),
    "dkdv": dict(outputs=("dk", "dv"), streamed=("Q", "dO"), seed=700, cases=[
        (2, 69, 69, 32, True, 16, 32, torch.float32, "same"), (2, 69, 69, 32, False, 16, 32, torch.float32, "same"),
        (1, 70, 45, 40, True, 16, 32, torch.float32, "same"), (1, 45, 70, 40, True, 16, 16, torch.float32, "apart"),
        (2, 17, 33, 16, False, 16, 32, torch.float32, "apart"), (1, 1, 1, 16, True, 16, 16, torch.float32, "same"),
        (2, 70, 45, 40, True, 16, 32, torch.float16, "apart")]),
}


def _check_loop(stage, inner):
    """Run a learner's loop of ``stage`` on the cases of :data:`LOOPS` and compare it with the
    float64 model; name the slips when it is wrong."""
    loop = LOOPS[stage]
    outputs, (first, second) = loop["outputs"], loop["streamed"]
    tol = pick(cpu=2e-5, gpu=1e-2)  # a GPU multiplies float32 tiles in TF32 by default
    # Slips such as a missing qk_scale make P large and its rounding error with it: a slip is
    # recognised within a looser bound than the one the right answer must meet.
    name_tol = pick(cpu=2e-4, gpu=1e-2)
    apart_ok = False
    for n, (heads, n_q, n_kv, d, causal, block_q, block_kv, dtype, layout) in enumerate(loop["cases"]):
        g = _generator(loop["seed"] + n)
        q, k, v, do = (torch.randn(heads, m, d, generator=g).to(DEVICE, dtype) for m in (n_q, n_kv, n_kv, n_q))
        scale = 1.0 / d ** 0.5
        what = (f"heads={heads}, N_q={n_q}, N_kv={n_kv}, D={d}, is_causal={causal}, "
                f"BLOCK_Q={block_q}, BLOCK_KV={block_kv}, {str(dtype)[6:]}")
        try:
            got = dict(zip(outputs, run_loop(stage, inner, q, k, v, do, causal, scale, block_q, block_kv, layout)))
        except ExerciseError as error:
            if "same dtype" in str(error):
                raise ExerciseError(f"{stage}_inner failed on float16 inputs ({what}): tl.dot got a float32 tile "
                                    "and a float16 one. Convert the float32 tile to the other's dtype before the "
                                    "product (dS to K's for dQ; P^T to dO's for dV, dS^T to Q's for dK), as with "
                                    "p.to(v.dtype) in chapter 05: 16-bit tiles multiply on the tensor cores.") from None
            raise
        want = loop_model(q, k, v, do, causal, scale, stage, block_q, block_kv)
        right_tol = tol if dtype == torch.float32 else 5e-3
        atol = {name: right_tol * max(1.0, want[name][0].abs().max().item()) for name in outputs}
        wrong = [name for name in outputs if not close(got[name], want[name][0], atol=atol[name], rtol=right_tol)]
        if not wrong:
            apart_ok = apart_ok or layout == "apart"
            continue
        names = " and ".join(NAMES[name] for name in wrong)
        verb = "are" if len(wrong) > 1 else "is"
        if layout == "apart" and not apart_ok and n > 0:  # every case before it passed
            raise ExerciseError(f"{names} {verb} wrong ({what}) where {first} and {second} have strides unlike each "
                                f"other's, and right where they were laid out alike: read {second} with its own "
                                f"strides ({'stride_vn, stride_vd' if stage == 'dq' else 'stride_don, stride_dod'}), "
                                "rows and columns.")
        for name in outputs:
            if torch.isnan(got[name].cpu()).any():
                where = "past the last query or past HEAD_DIM" if stage == "dkdv" else "past the last key or past HEAD_DIM"
                raise ExerciseError(f"{NAMES[name]} has NaN ({what}): a load read {where} without a mask (the memory "
                                    "there holds NaN in this check). Mask every load with the rows and columns that "
                                    "exist (other=0.0).")
        if dtype == torch.float32:
            said = name_the_slips(got, (q, k, v, do), causal, scale, stage, block_q, block_kv, name_tol)
            if said:
                raise ExerciseError(f"{names} {verb} wrong ({what}); {said}")
        for name in wrong:
            expect_close(f"{NAMES[name]} ({what})", got[name], want[name][0], atol=atol[name], rtol=right_tol,
                         heatmap=True)


def check_dq_inner(dq_inner):
    """The dQ stage's inner loop in Triton, run inside :func:`dq_exercise_kernel` on tiny inputs
    (ragged lengths, causal and not, N_q != N_kv, a padded head dim, V's strides unlike K's,
    float16) and compared with a float64 model that names the likely slips."""
    _check_loop("dq", dq_inner)
    passed("dq_inner gives the right dQ for ragged lengths, causal and not, N_q != N_kv, a padded head dim, "
           "strided V and float16")


def check_dkdv_inner(dkdv_inner):
    """The dK/dV stage's inner loop in Triton (keys along the rows of every tile), run inside
    :func:`dkdv_exercise_kernel` like :func:`check_dq_inner` (BLOCK_Q smaller than BLOCK_KV and
    equal to it; dO's strides unlike Q's)."""
    _check_loop("dkdv", dkdv_inner)
    passed("dkdv_inner gives the right dK and dV for ragged lengths, causal and not, N_q != N_kv, a padded "
           "head dim, strided dO and float16")
