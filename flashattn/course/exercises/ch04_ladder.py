"""Checkers of chapter 04's Triton ladder: five small kernels, one idea each, before the forward
kernel's inner loop. A causal mask written in place by a 2-D grid of tiles with ragged edges
(``causal_mask_kernel``), a softmax with one program per row (``row_softmax_kernel``), a tiled
matrix product with a loop over K (``matmul_kernel``), one tile of attention
(``attention_tile_kernel``), and one query block streaming its key blocks with the online softmax
(``stream_kv_kernel``).

Each checker launches the learner's kernel on inputs it draws itself, inside larger buffers whose
extra elements hold sentinels: a load past the end reads them (and the result shows it), a store
past the end overwrites them (and the checker sees it). A wrong result that equals a known mistake
is named: a missing mask, a wrong ``other=``, a condition on the tile's own positions instead of the
sequence's, the max not subtracted, the wrong axis, a missing alpha, ...
"""
import torch
import triton

from ..notebook import pick
from ...gpu.runtime import DEVICE
from ...testing.rule import round_to_tf32
from ...kernels.tiles import LN2, LOG2E
from .ch03_05 import name_forward_mistake, tiled_forward_with_mistake
from .common import ExerciseError, close, expect_close, launch_learner_kernel, passed

SOFTMAX = ("flashattn", "softmax")  # what none of these kernels may call
PAST_THE_END = 99.0                 # what a buffer holds past the end of the tensor in it
# on a GPU, tl.dot multiplies float32 tiles in TF32 unless told input_precision="ieee"
DOT_TOL = dict(cpu=2e-5, gpu=5e-3)
UNTOUCHED = -7.0                    # what an output buffer holds where nothing may be written


def _generator(seed):
    return torch.Generator().manual_seed(seed)


def _in_buffer(values, extra_rows=0, extra_cols=0, fill=PAST_THE_END):
    """``values`` (1-D or 2-D, float32) as a view into a larger buffer on DEVICE whose extra rows
    and columns hold ``fill``; returns (view, buffer)."""
    if values.dim() == 1:
        buffer = torch.full((values.shape[0] + extra_rows,), fill)
        buffer[:values.shape[0]] = values
        buffer = buffer.to(DEVICE)
        return buffer[:values.shape[0]], buffer
    rows, cols = values.shape
    buffer = torch.full((rows + extra_rows, cols + extra_cols), fill)
    buffer[:rows, :cols] = values
    buffer = buffer.to(DEVICE)
    return buffer[:rows, :cols], buffer


def _wrote_outside(buffer, rows, cols=None):
    """Whether anything outside the first ``rows`` (x ``cols``) of ``buffer`` changed."""
    b = buffer.cpu()
    if cols is None:
        return bool((b[rows:] != UNTOUCHED).any())
    return bool((b[rows:] != UNTOUCHED).any() or (b[:rows, cols:] != UNTOUCHED).any())


def _named(got, want, mistakes, atol=1e-5, rtol=1e-5):
    """The hint of the first ``(hint, tensor)`` of ``mistakes`` that ``got`` equals (and ``want``
    does not); None if there is none."""
    for hint, wrong in mistakes:
        if wrong is None:
            continue
        w = wrong.double().cpu()
        if not torch.isfinite(w).all():  # a NaN result is named by what caused it, not matched
            continue
        g = got.detach().double().cpu()
        same = g.shape == w.shape and torch.isclose(g, w, atol=atol, rtol=rtol).all()
        differs = not torch.isclose(want.double().cpu(), w, atol=atol, rtol=rtol).all()
        if same and differs:
            return hint
    return None


# --- 1. A causal mask, one program per tile of a 2-D grid -------------------------------------------

def _masked_storage(storage, n_q, n_kv, bq, bkv, strides, hide="future", move=(True, True), swap=False,
                    edges=(True, True), address=None, fill=float("-inf")):
    """What ``storage`` (the flat buffer around S) holds after a causal-mask kernel ran on the grid
    (cdiv(n_q, bq), cdiv(n_kv, bkv)), written with or without a given mistake: the condition that
    hides (``hide``), program offsets that move with the program ids (``move``), the grid's axes
    swapped (``swap``), the row and column masks (``edges``), an address (``address(i, j)``,
    default i * stride_q + j * stride_k) and the value written. None where such a kernel would
    write outside the buffer (that mistake is then not the one the learner made)."""
    out = storage.clone()
    grid = (triton.cdiv(n_q, bq), triton.cdiv(n_kv, bkv))
    local_i, local_j = torch.arange(bq)[:, None], torch.arange(bkv)[None, :]
    for pid0 in range(grid[0]):
        for pid1 in range(grid[1]):
            b, c = (pid1, pid0) if swap else (pid0, pid1)
            i = b * bq * move[0] + local_i
            j = c * bkv * move[1] + local_j
            hidden = {"future": j > i, "diagonal": j >= i, "past": j < i, "tile": local_j > local_i}[hide]
            mask = hidden & ((i < n_q) if edges[0] else True) & ((j < n_kv) if edges[1] else True)
            where = address(i, j) if address else i * strides[0] + j * strides[1]
            where = where.expand(bq, bkv)[mask]
            if where.numel() and (where.min() < 0 or where.max() >= out.numel()):
                return None
            out[where] = fill
    return out


def check_causal_mask_kernel(causal_mask_kernel):
    """``causal_mask_kernel[(cdiv(n_q, BLOCK_Q), cdiv(n_kv, BLOCK_KV))](S, n_q, n_kv, stride_q,
    stride_k, BLOCK_Q=..., BLOCK_KV=...)`` must set S[i, j] = -inf wherever j > i, in place, leave
    every other entry of the n_q x n_kv matrix S (a view, entry (i, j) at i * stride_q + j * stride_k)
    as it was, and write nothing outside it."""
    name = "causal_mask_kernel"
    cases = [(16, 16, 16, 16, False), (69, 69, 32, 16, False), (40, 100, 16, 32, False),
             (100, 40, 32, 16, True), (1, 1, 16, 16, False), (37, 45, 16, 16, False)]
    for n, (n_q, n_kv, bq, bkv, transposed) in enumerate(cases):
        g = _generator(400 + n)
        # S inside a buffer large enough for any grid's tiles (even with the axes swapped), its other
        # elements holding UNTOUCHED: a store past the last row or the end of a row shows there
        reach = max(triton.cdiv(n_q, bq), triton.cdiv(n_kv, bkv))
        rows, cols = reach * bq + bq, reach * bkv + bkv
        values = torch.randn(n_q, n_kv, generator=g)
        if transposed:  # S as the transpose of a (n_kv, n_q) matrix: stride_q = 1, stride_k = rows
            buffer = torch.full((cols, rows), UNTOUCHED)
            buffer[:n_kv, :n_q] = values.T
        else:
            buffer = torch.full((rows, cols), UNTOUCHED)
            buffer[:n_q, :n_kv] = values
        storage = buffer.flatten().clone()  # as it was before the kernel ran
        on_device = buffer.to(DEVICE, copy=True)
        s = (on_device.T if transposed else on_device)[:n_q, :n_kv]
        strides = s.stride()
        launch_learner_kernel(causal_mask_kernel, (triton.cdiv(n_q, bq), triton.cdiv(n_kv, bkv)),
                              (s, n_q, n_kv, *strides), dict(BLOCK_Q=bq, BLOCK_KV=bkv), name, causal_mask_kernel)
        got = on_device.cpu().flatten()
        what = (f" (n_q = {n_q}, n_kv = {n_kv}, BLOCK_Q = {bq}, BLOCK_KV = {bkv}"
                + (", S a transposed view: stride_q = 1)" if transposed else ")"))
        want = _masked_storage(storage, n_q, n_kv, bq, bkv, strides)
        if torch.equal(got, want):
            continue
        mistakes = [
            ("the diagonal was hidden too: query i sees key i, so hide j > i, not j >= i",
             dict(hide="diagonal")),
            ("the wrong triangle was hidden: a query sees the keys before it (j <= i) and not those after "
             "it, so set S[i, j] = -inf where j > i", dict(hide="past")),
            ("the condition compared positions inside the tile (tl.arange alone): compare the positions in "
             "the sequence, i = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q) and likewise j",
             dict(hide="tile")),
            ("every program worked on the first block of rows: the rows of program (b, c) start at "
             "b * BLOCK_Q, with b = tl.program_id(0)", dict(move=(False, True))),
            ("every program worked on the first block of keys: the keys of program (b, c) start at "
             "c * BLOCK_KV, with c = tl.program_id(1)", dict(move=(True, False))),
            ("the grid's axes were swapped: axis 0 numbers the query blocks (tl.program_id(0) for the rows) "
             "and axis 1 the key blocks (tl.program_id(1) for the columns)", dict(swap=True)),
            ("the store went past the last row of S (rows i >= n_q of the last tiles): mask it with "
             "rows[:, None] < n_q too", dict(edges=(False, True))),
            ("the store went past the end of a row of S (keys j >= n_kv of the last tiles), into memory that "
             "is not S's: mask it with keys[None, :] < n_kv too", dict(edges=(True, False))),
            ("the store went past the last row and past the end of the rows of S: mask it with "
             "(rows[:, None] < n_q) & (keys[None, :] < n_kv)", dict(edges=(False, False))),
            ("entry (i, j) was addressed at i * n_kv + j, as if S were contiguous: it lives at "
             "i * stride_q + j * stride_k", dict(address=lambda i, j: i * n_kv + j)),
            ("entry (i, j) was addressed at i * stride_q + j, as if stride_k were 1: it lives at "
             "i * stride_q + j * stride_k", dict(address=lambda i, j: i * strides[0] + j)),
            ("0 was written where -inf belongs: a hidden score is -inf, so that its probability is "
             "2^-inf = 0", dict(fill=0.0)),
        ]
        for hint, mistake in mistakes:
            wrong = _masked_storage(storage, n_q, n_kv, bq, bkv, strides, **mistake)
            if wrong is not None and not torch.equal(wrong, want) and torch.equal(got, wrong):
                raise ExerciseError(f"{name} is wrong{what}: {hint}.")
        got_big = got.view(buffer.shape).T if transposed else got.view(buffer.shape)
        want_big = want.view(buffer.shape).T if transposed else want.view(buffer.shape)
        outside = torch.ones_like(got_big, dtype=torch.bool)
        outside[:n_q, :n_kv] = False
        changed = (got_big != want_big) & outside
        if changed.any():
            i, j = (int(x) for x in changed.nonzero()[0])
            where = "past the last row" if i >= n_q else "past the end of row " + str(i)
            raise ExerciseError(f"{name} wrote outside S{what}, at ({i}, {j}), {where}: mask the store with "
                                "(rows[:, None] < n_q) & (keys[None, :] < n_kv)")
        i, j = (int(x) for x in (got_big != want_big).nonzero()[0])
        if j > i:
            raise ExerciseError(f"{name} left S[{i}, {j}] = {got_big[i, j].item():.4g}{what}: key {j} comes "
                                f"after query {i}, so the entry must be -inf.")
        raise ExerciseError(f"{name} changed S[{i}, {j}] from {want_big[i, j].item():.4g} to "
                            f"{got_big[i, j].item():.4g}{what}: query {i} sees key {j}, leave that score as it is.")
    passed(f"{name} hides exactly the keys after each query on {len(cases)} matrices (ragged tiles, "
           "N_q != N_kv, a transposed view) and writes nothing outside S")


# --- 2. A softmax kernel, one program per row --------------------------------------------------------

def check_row_softmax_kernel(row_softmax_kernel):
    """``row_softmax_kernel[(n_rows,)](X, Y, stride_x, stride_y, n_cols, BLOCK=...)`` must write the
    softmax of each row of X (rows ``stride_x`` elements apart) into Y, with BLOCK =
    triton.next_power_of_2(n_cols) >= n_cols, and nothing past the row's n_cols entries."""
    name = "row_softmax_kernel"
    cases = [(4, 16, 1.0), (3, 13, 1.0), (5, 1, 1.0), (2, 100, 4.0), (6, 33, 40.0), (3, 64, 1.0)]
    for n, (rows, cols, spread) in enumerate(cases):
        g = _generator(420 + n)
        block = triton.next_power_of_2(cols)
        values = torch.randn(rows, cols, generator=g) * spread
        x, x_buffer = _in_buffer(values, extra_rows=1, extra_cols=5)
        y, y_buffer = _in_buffer(torch.full((rows, cols), float("nan")), extra_rows=1, extra_cols=3, fill=UNTOUCHED)
        launch_learner_kernel(row_softmax_kernel, (rows,), (x, y, x.stride(0), y.stride(0), cols),
                              dict(BLOCK=block), name, row_softmax_kernel, forbid=SOFTMAX)
        what = f" ({rows} rows of {cols}, BLOCK = {block}, scores of size about {spread:g})"
        if _wrote_outside(y_buffer, rows, cols):
            raise ExerciseError(f"{name} wrote past the end of a row of Y{what}: mask the store with "
                                "cols < n_cols")
        got = y.cpu()
        want = torch.softmax(values.double(), -1)
        if torch.isnan(got).all(dim=-1).any() and not torch.isnan(got).all():
            row = int(torch.isnan(got).all(dim=-1).nonzero()[0])
            raise ExerciseError(f"{name} left row {row} of Y unwritten{what}: program i handles row i, "
                                "tl.program_id(0)")
        flat_buffer = x_buffer.cpu().flatten().double()
        stride = x.stride(0)
        read = torch.stack([flat_buffer[r * stride:r * stride + block] for r in range(rows)])  # unmasked
        zero_padded = torch.cat([values.double(), torch.zeros(rows, block - cols, dtype=torch.float64)], -1)
        e = torch.exp(values.double() - values.double().max(-1, keepdim=True).values)
        flat = flat_buffer[:rows * cols].view(rows, cols)  # rows read n_cols apart
        hint = _named(got, want, [
            ("each row read past its end (the memory there holds other values): load with "
             "mask=cols < n_cols", torch.softmax(read, -1)[:, :cols] if block > cols else None),
            ("the padding columns were read as 0 (other=0.0), so they get probability e^(0 - max): "
             "the neutral element here is other=float(\"-inf\"), whose e^x is 0",
             torch.softmax(zero_padded, -1)[:, :cols] if block > cols else None),
            ("the probabilities were not divided by their sum: p / tl.sum(p, axis=0)", e),
            ("row i was read at X + i * n_cols: rows are stride_x elements apart, X + i * stride_x",
             torch.softmax(flat, -1)),
        ], atol=1e-6, rtol=1e-5)
        if hint:
            raise ExerciseError(f"{name} is wrong{what}: {hint}.")
        if not torch.isfinite(got).all():
            raise ExerciseError(f"{name} returned inf or NaN{what}: e^x overflows float32 above 88.7; "
                                "subtract the row's max before tl.exp")
        expect_close(f"Y{what}", got, want, atol=1e-6, rtol=1e-5)
    passed(f"{name} equals torch.softmax on {len(cases)} cases (ragged rows, strided rows, one column, "
           "scores up to about 100)")


# --- 3. One tile of attention (Exercise 4) ------------------------------------------------------------

def _not_finite(name, what, ragged):
    """The message for an output with inf or NaN. The checks put NaN in the memory past the end of
    V: a tile that reads it without a mask multiplies it by a probability of 0, and 0 * NaN = NaN.
    An aligned case reads nothing past the end, so there the NaN comes from an overflow."""
    if ragged:
        return ExerciseError(f"{name} returned NaN{what}: V's rows past N_kv were read without a mask (the "
                             "memory there holds NaN in this check, and 0 * NaN = NaN); load V with "
                             "mask=keys < n_kv, other=0.0")
    return ExerciseError(f"{name} returned inf or NaN{what}: 2^x overflows float32 above x = 128; subtract "
                         "each row's (running) max before tl.exp2")


def _attention_inputs(g, n_q, n_kv, d, spread, block_q, block_kv, growing=False):
    q = torch.randn(n_q, d, generator=g) * spread
    k = torch.randn(n_kv, d, generator=g) * spread
    if growing:  # keys that grow along the sequence: the running max rises at several blocks
        k = k * torch.linspace(0.3, 1.5, n_kv)[:, None]
    v = torch.randn(n_kv, d, generator=g)
    # Values TF32 holds exactly: on a GPU, tl.dot multiplies float32 tiles in TF32 unless told
    # input_precision="ieee", and rounding q and k would move scores near 100 by more than the
    # tolerance. So only P is rounded (relative error 2**-11), and the check judges the algorithm.
    q, k, v = (round_to_tf32(t) for t in (q, k, v))
    q_dev, _ = _in_buffer(q, extra_rows=block_q, fill=0.0)
    k_dev, _ = _in_buffer(k, extra_rows=block_kv, fill=0.0)
    v_dev, _ = _in_buffer(v, extra_rows=block_kv, fill=float("nan"))
    return (q, k, v), (q_dev, k_dev, v_dev)


def check_attention_tile_kernel(attention_tile_kernel):
    """``attention_tile_kernel[(1,)](Q, K, V, O, n_q, n_kv, qk_scale, BLOCK_Q=..., BLOCK_KV=...,
    D=...)``: Q (n_q, D), K and V (n_kv, D), O (n_q, D), rows D elements apart, n_q <= BLOCK_Q and
    n_kv <= BLOCK_KV; one program computes O = softmax(Q K^T * scale) V with exp2 and qk_scale =
    scale * log2e, and writes nothing past row n_q."""
    name = "attention_tile_kernel"
    tol = pick(**DOT_TOL)
    cases = [(16, 16, 16, 16, 16, 1.0), (13, 9, 16, 16, 16, 1.0), (30, 20, 32, 32, 32, 1.0),
             (32, 32, 32, 32, 16, 6.0), (1, 1, 16, 16, 16, 1.0), (20, 64, 32, 64, 32, 1.0)]
    for n, (n_q, n_kv, block_q, block_kv, d, spread) in enumerate(cases):
        (q, k, v), inputs = _attention_inputs(_generator(430 + n), n_q, n_kv, d, spread, block_q, block_kv)
        scale = d ** -0.5
        o, o_buffer = _in_buffer(torch.full((n_q, d), float("nan")), extra_rows=block_q, fill=UNTOUCHED)
        launch_learner_kernel(attention_tile_kernel, (1,), (*inputs, o, n_q, n_kv, scale * LOG2E),
                              dict(BLOCK_Q=block_q, BLOCK_KV=block_kv, D=d), name, attention_tile_kernel,
                              forbid=SOFTMAX)
        what = f" (N_q = {n_q}, N_kv = {n_kv}, D = {d}, BLOCK_Q = {block_q}, BLOCK_KV = {block_kv})"
        if _wrote_outside(o_buffer, n_q):
            raise ExerciseError(f"{name} wrote rows past N_q = {n_q} into O{what}: mask the store with "
                                "rows < n_q")
        got = o.cpu()
        want = torch.softmax(q.double() @ k.double().T * scale, -1) @ v.double()
        # the whole tile as the kernel holds it: padding rows of Q, K and V read as 0
        q_pad, k_pad, v_pad = (torch.cat([t.double(), torch.zeros(block - t.shape[0], d, dtype=torch.float64)])
                               for t, block in ((q, block_q), (k, block_kv), (v, block_kv)))

        def tile(hide=True, axis=-1, s_scale=scale, base_e=False, divide=True):
            st = q_pad @ k_pad.T * s_scale
            if hide:
                st[:, n_kv:] = float("-inf")
            if base_e:  # e^x where 2^x belongs, on scores that carry log2e
                st = st * LOG2E
            p = torch.exp(st - st.max(axis, keepdim=True).values)
            if divide:
                p = p / p.sum(axis, keepdim=True)
            return (p @ v_pad)[:n_q]

        hint = _named(got, want, [
            ("keys past N_kv were not hidden: loaded with other=0, they score 0, not -inf, and get "
             "probability; set their scores to -inf, tl.where(keys[None, :] < n_kv, s, float(\"-inf\"))",
             tile(hide=False) if n_kv < block_kv else None),
            ("the softmax ran down the columns (axis 0, over the queries): normalise each row over the "
             "keys, tl.max(s, axis=1) and tl.sum(p, axis=1)", tile(axis=0)),
            ("the scores were not multiplied by qk_scale (= scale * log2e): the exponent of tl.exp2 is "
             "s * qk_scale - max", tile(s_scale=LN2)),  # 2^s = e^(s ln 2)
            ("tl.exp was used where tl.exp2 belongs: qk_scale already holds log2e, for 2^x",
             tile(base_e=True)),
            ("P was not divided by its row sum L (divide P, or P V, by tl.sum(p, axis=1))", tile(divide=False)),
        ], atol=tol, rtol=tol)
        if hint:
            raise ExerciseError(f"{name} is wrong{what}: {hint}.")
        if not torch.isfinite(got).all():
            raise _not_finite(name, what, ragged=n_kv < block_kv)
        expect_close(f"O{what}", got, want, atol=tol, rtol=tol, heatmap=True)
    passed(f"{name} equals float64 attention on {len(cases)} tiles (ragged N_q and N_kv, one query and "
           "one key, large scores)")


# --- 4. One query block streaming its key blocks (Exercise 5) -----------------------------------------

#: The mistakes check_stream_kv_kernel names, in the order it tries them (FORWARD_MISTAKES' names).
STREAM_MISTAKES = ("alpha", "alpha_acc", "alpha_l", "ragged", "no_scale", "exp", "per_tile", "drop_tail")


def check_stream_kv_kernel(stream_kv_kernel):
    """``stream_kv_kernel[(1,)](Q, K, V, O, n_kv, qk_scale, BLOCK_Q=..., BLOCK_KV=..., D=...)``: Q
    and O (BLOCK_Q, D), K and V (n_kv, D), rows D elements apart; one program walks the key blocks
    with the online softmax (running M, L, acc rescaled by alpha) and writes O = acc / L."""
    name = "stream_kv_kernel"
    tol = pick(**DOT_TOL)
    cases = [(16, 64, 16, 16, 1.0), (16, 69, 16, 16, 1.0), (32, 100, 16, 32, 2.0), (16, 1, 16, 16, 1.0),
             (32, 64, 16, 16, 12.0), (16, 47, 32, 16, 1.0)]
    for n, (block_q, n_kv, block_kv, d, spread) in enumerate(cases):
        (q, k, v), inputs = _attention_inputs(_generator(440 + n), block_q, n_kv, d, spread, block_q, block_kv,
                                              growing=True)
        scale = d ** -0.5
        o = torch.full((block_q, d), float("nan"), device=DEVICE)
        launch_learner_kernel(stream_kv_kernel, (1,), (*inputs, o, n_kv, scale * LOG2E),
                              dict(BLOCK_Q=block_q, BLOCK_KV=block_kv, D=d), name, stream_kv_kernel,
                              forbid=SOFTMAX)
        what = f" (N_kv = {n_kv}, BLOCK_Q = {block_q}, BLOCK_KV = {block_kv}, D = {d})"
        got = o.cpu()
        want = torch.softmax(q.double() @ k.double().T * scale, -1) @ v.double()
        if close(got, want, tol, tol):
            continue
        hint = name_forward_mistake(got, q, k, v, False, block_q, block_kv, scale, want, tol, tol,
                                    mistakes=STREAM_MISTAKES)
        start = (n_kv - 1) // block_kv * block_kv
        last_only = torch.softmax(q.double() @ k[start:].double().T * scale, -1) @ v[start:].double()
        if hint is None and start > 0 and close(got, last_only, tol, tol):
            hint = ("only the last block of keys counts: the state must carry from block to block "
                    "(m_i = m_new after each update)")
        if hint:
            raise ExerciseError(f"{name} is wrong{what}: {hint}.")
        if not torch.isfinite(got).all():
            raise _not_finite(name, what, ragged=n_kv % block_kv != 0)
        expect_close(f"O{what}", got, want, atol=tol, rtol=tol, heatmap=True)
    passed(f"{name} equals float64 attention on {len(cases)} cases (1 to 100 keys, ragged last blocks, "
           "maxima that rise along the keys)")


# --- 5. A tiled matrix product with a loop over K (Exercise 3) ----------------------------------------

def check_matmul_kernel(matmul_kernel):
    """``matmul_kernel[(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))](A, B, C, M, N, K, stride_am, stride_ak,
    stride_bk, stride_bn, stride_cm, stride_cn, BLOCK_M=..., BLOCK_N=..., BLOCK_K=...)``: program
    (i, j) writes the tile (i, j) of C = A @ B, summing over K in tiles of BLOCK_K, and nothing
    outside C's M x N entries. A, B and C may have any strides."""
    name = "matmul_kernel"
    tol = pick(**DOT_TOL)
    # (M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, B stored transposed)
    cases = [(32, 32, 64, 16, 16, 16, False), (37, 29, 45, 16, 16, 16, False), (20, 45, 70, 16, 32, 32, True),
             (1, 1, 1, 16, 16, 16, False), (50, 17, 16, 32, 16, 16, True)]
    for n, (m, n_cols, k, bm, bn, bk, transposed) in enumerate(cases):
        g = _generator(450 + n)
        a_values = round_to_tf32(torch.randn(m, k, generator=g))
        b_values = round_to_tf32(torch.randn(k, n_cols, generator=g))
        a, _ = _in_buffer(a_values, extra_rows=bm, extra_cols=bk)
        if transposed:  # B as the transpose of an (N, K) matrix: column stride K + BLOCK_K, row stride 1
            b_t, _ = _in_buffer(b_values.T.contiguous(), extra_rows=bn, extra_cols=bk)
            b = b_t.T
        else:
            b, _ = _in_buffer(b_values, extra_rows=bk, extra_cols=bn)
        c, c_buffer = _in_buffer(torch.full((m, n_cols), float("nan")), extra_rows=bm, extra_cols=bn, fill=UNTOUCHED)
        launch_learner_kernel(matmul_kernel, (triton.cdiv(m, bm), triton.cdiv(n_cols, bn)),
                              (a, b, c, m, n_cols, k, *a.stride(), *b.stride(), *c.stride()),
                              dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk), name, matmul_kernel, forbid=("flashattn",))
        what = (f" (M = {m}, N = {n_cols}, K = {k}, BLOCK_M = {bm}, BLOCK_N = {bn}, BLOCK_K = {bk}"
                + (", B a transposed view)" if transposed else ")"))
        if _wrote_outside(c_buffer, m, n_cols):
            raise ExerciseError(f"{name} wrote outside C's {m} x {n_cols} entries{what}: mask the store with "
                                "(rows[:, None] < M) & (cols[None, :] < N)")
        got = c.cpu()
        if torch.isnan(got).any():
            i, j = (int(x) for x in torch.isnan(got).nonzero()[0])
            raise ExerciseError(f"{name} left C[{i}, {j}] unwritten{what}: program (i, j) = (tl.program_id(0), "
                                "tl.program_id(1)) owns rows i * BLOCK_M + tl.arange(0, BLOCK_M) and columns "
                                "j * BLOCK_N + tl.arange(0, BLOCK_N)")
        a64, b64 = a_values.double(), b_values.double()
        want = a64 @ b64
        tiles = range(0, k, bk)
        last = tiles[-1]
        full = k // bk * bk
        padded = torch.full((m, len(tiles) * bk), PAST_THE_END, dtype=torch.float64)
        padded[:, :k] = a64
        padded_b = torch.full((len(tiles) * bk, n_cols), PAST_THE_END, dtype=torch.float64)
        padded_b[:k] = b64
        hint = _named(got, want, [
            ("the last tile of K read past the end of A and B (the memory there holds 99 in this check): "
             "mask the loads with the K index, (ks[None, :] < K) for A and (ks[:, None] < K) for B, other=0.0",
             padded @ padded_b if k % bk else None),
            ("only the last tile of K counts: create the accumulator once, before the loop, and add each "
             "tile's product to it, acc += tl.dot(a, b)", a64[:, last:] @ b64[last:] if last else None),
            ("the ragged last tile of K was left out: loop over range(0, K, BLOCK_K) and mask it",
             a64[:, :full] @ b64[:full] if k % bk and full else None),
            ("every iteration multiplied the first tile of K again: move the K offsets with the loop "
             "variable, ks = k0 + tl.arange(0, BLOCK_K)", len(tiles) * (a64[:, :bk] @ b64[:bk]) if len(tiles) > 1 else None),
        ], atol=tol * 4, rtol=tol)
        if hint:
            raise ExerciseError(f"{name} is wrong{what}: {hint}.")
        if not torch.isfinite(got).all():
            raise ExerciseError(f"{name} returned inf or NaN{what}: a load read memory outside A or B; mask "
                                "every load (rows < M or cols < N, and the K index < K)")
        expect_close(f"C{what}", got, want, atol=tol * 4, rtol=tol, heatmap=True)
    passed(f"{name} equals float64 A @ B on {len(cases)} cases (ragged M, N and K, one element, a "
           "transposed B)")
