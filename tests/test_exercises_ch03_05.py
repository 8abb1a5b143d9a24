"""The checkers of chapters 03 (tiling and causal blocks), 04 (Triton from scratch) and 05 (the
forward kernel) fail plausible mistakes (each one the solution with a named edit, kernels included)
with a message that names the problem. (tests/test_exercise_checks.py runs every solution and stub.)"""
import numpy as np
import pytest

from flashattn.course import exercises as ex
from flashattn.kernels import traversal
from flashattn.course.exercises import ch03_05

from exercise_cases import mistakes  # tests/exercise_cases.py

@pytest.fixture(autouse=True)
def no_figures(monkeypatch):
    monkeypatch.setattr("matplotlib.pyplot.show", lambda *a, **k: None)


def test_definition_is_the_kernels_map():
    """The checker's brute-force definition and flashattn.kernels.traversal agree on every case it uses."""
    for n_q, n_kv, bq, bkv, causal in ch03_05._classify_cases():
        want, _ = ch03_05._tile_kinds_by_definition(n_q, n_kv, bq, bkv, causal)
        np.testing.assert_array_equal(traversal.classify_blocks(n_q, n_kv, bq, bkv, causal), want)


# --- Chapter 03 -------------------------------------------------------------------------------------

@mistakes(
    ("ragged end forgotten", [("inside = last_k < n_kv", "inside = True")], "past the end"),
    # only the real query rows of the last block considered (the kernel computes all BLOCK_Q rows)
    ("padding rows ignored", [("last_q = b * block_q, b * block_q + block_q - 1",
                               "last_q = b * block_q, min(b * block_q + block_q, n_q) - 1")], "padding row"),
    ("causal ignored", [("if is_causal:\n                every", "if False:\n                every")], "is wrong at"),
    ("a row short", [("return kinds", "return kinds[:-1]")], "returned shape"),
    ("other values", [("return kinds", "return kinds * 2")], "use only 0"),
)
def test_classify_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_classify_tiles(solutions("03", edits).classify)


@mistakes(
    ("no alpha", [("acc = acc * alpha[:, None] + p @ v[cols]", "acc = acc + p @ v[cols]")],
     "not rescaled by alpha"),
    ("alpha on neither", [("acc = acc * alpha[:, None] + p @ v[cols]", "acc = acc + p @ v[cols]"),
                          ("l = l * alpha + p.sum(dim=1)", "l = l + p.sum(dim=1)")],
     "alpha is missing on both L and the accumulator"),
    ("causal off by one", [("s = s.masked_fill(cols[None, :] > rows[:, None], float(\"-inf\"))",
                            "s = s.masked_fill(cols[None, :] > rows[:, None] + 1, float(\"-inf\"))")],
     "off by one"),
    ("no mask", [("if kinds[b, c] == MASKED and is_causal:", "if False:")], "causal mask is missing"),
    ("skipped tiles computed", [("if kinds[b, c] == SKIPPED:", "if False:"),
                                ("if kinds[b, c] == MASKED and is_causal:", "if kinds[b, c] != FULL and is_causal:")],
     "n_tiles is"),
    ("LSE in base 2", [("lse[rows] = m + torch.log(l)", "lse[rows] = (m + torch.log(l)) / math.log(2)")], "lse"),
    ("the course's own", [("    return out, lse, n_tiles", "    out, lse = reference.tiled_forward(q, k, v, is_causal, "
                           "block_q=block_q, block_kv=block_kv)\n    return out, lse, n_tiles")],
     "uses flashattn.testing.reference.tiled_forward"),
)
def test_tiled_attention_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_tiled_attention(solutions("03", edits).tiled_attention)


@mistakes(
    ("every tile counted", [("kv_end = min(q_start + block_q, n_kv)      #", "kv_end = n_kv      #")], "above the diagonal are skipped"),
    ("first query of the block", [("kv_end = min(q_start + block_q, n_kv)      #", "kv_end = min(q_start + 1, n_kv)      #")],
     "its last query"),
    ("keys past the end", [("kv_end = min(q_start + block_q, n_kv)      #", "kv_end = q_start + block_q      #")], "do not exist"),
    ("the course's own map", [("    return total\n", "    return int((traversal.classify_blocks(n_q, n_kv, block_q, block_kv, True) > 0).sum())\n")],
     "uses flashattn.kernels.traversal.classify_blocks"),
)
def test_causal_tiles_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_causal_tiles(solutions("03", edits).causal_tiles)


# --- Chapter 04: the Triton ladder -----------------------------------------------------------------

MASK_ROWS = "rows = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)"
MASK_KEYS = "keys = tl.program_id(1) * BLOCK_KV + tl.arange(0, BLOCK_KV)"
MASK_INSIDE = "inside = (rows[:, None] < n_q) & (keys[None, :] < n_kv)"
MASK_FUTURE = "future = keys[None, :] > rows[:, None]"
MASK_ADDRESS = "S + rows[:, None] * stride_q + keys[None, :] * stride_k"


@mistakes(
    ("diagonal hidden", [(MASK_FUTURE, "future = keys[None, :] >= rows[:, None]")], "diagonal was hidden"),
    ("wrong triangle", [(MASK_FUTURE, "future = keys[None, :] < rows[:, None]")], "wrong triangle"),
    ("positions in the tile", [(MASK_FUTURE, "future = tl.arange(0, BLOCK_KV)[None, :] > tl.arange(0, BLOCK_Q)[:, None]")],
     "inside the tile"),
    ("rows do not move", [(MASK_ROWS, "rows = tl.arange(0, BLOCK_Q)")], "first block of rows"),
    ("keys do not move", [(MASK_KEYS, "keys = tl.arange(0, BLOCK_KV)")], "first block of keys"),
    ("axes swapped", [(MASK_ROWS, MASK_ROWS.replace("program_id(0)", "program_id(1)")),
                      (MASK_KEYS, MASK_KEYS.replace("program_id(1)", "program_id(0)"))], "axes were swapped"),
    ("no row mask", [(MASK_INSIDE, "inside = keys[None, :] < n_kv")], "past the last row"),
    ("no column mask", [(MASK_INSIDE, "inside = rows[:, None] < n_q")], "past the end of a row"),
    ("no mask", [(MASK_INSIDE, "inside = True")], "past the last row and past the end"),
    ("contiguous assumed", [(MASK_ADDRESS, "S + rows[:, None] * n_kv + keys[None, :]")], "i \\* n_kv \\+ j"),
    ("stride_k ignored", [(MASK_ADDRESS, "S + rows[:, None] * stride_q + keys[None, :]")], "as if stride_k were 1"),
    ("0 for -inf", [('minus_inf = tl.full([BLOCK_Q, BLOCK_KV], float("-inf")', 'minus_inf = tl.full([BLOCK_Q, BLOCK_KV], 0.0')], "0 was written"),
    ("visible entries changed", [("mask=inside & future)", "mask=inside)")], "leave that score as it is"),
    ("nothing written", [("mask=inside & future)", "mask=inside & future & (rows[:, None] < 0))")], "must be -inf"),
    ("the course's own code", [("@triton.jit\ndef causal_mask_kernel", "from flashattn.kernels import tiles\n\n\n"
                                "@triton.jit\ndef causal_mask_kernel"),  # chapter 04 does not import it
                               (MASK_FUTURE, MASK_FUTURE + "\n    tiles.store_tile")], "uses flashattn.kernels.tiles.store_tile"),
)
def test_causal_mask_kernel_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_causal_mask_kernel(solutions("04", edits).causal_mask_kernel)


SOFTMAX_LOAD = 'x = tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=float("-inf"))'
SOFTMAX_STORE = "tl.store(Y + row * stride_y + cols, p / tl.sum(p, axis=0), mask=cols < n_cols)"


@mistakes(
    ("load without a mask", [(SOFTMAX_LOAD, "x = tl.load(X + row * stride_x + cols)")], "read past its end"),
    ("other=0", [(SOFTMAX_LOAD, SOFTMAX_LOAD.replace('float("-inf")', "0.0"))], "read as 0"),
    ("max not subtracted", [("p = tl.exp(x - tl.max(x, axis=0))", "p = tl.exp(x)")], "inf or NaN"),
    ("not divided", [(SOFTMAX_STORE, SOFTMAX_STORE.replace("p / tl.sum(p, axis=0)", "p"))], "not divided"),
    ("store without a mask", [(SOFTMAX_STORE, SOFTMAX_STORE.replace(", mask=cols < n_cols", ""))], "wrote past the end"),
    ("rows n_cols apart", [(SOFTMAX_LOAD, SOFTMAX_LOAD.replace("row * stride_x", "row * n_cols"))], "stride_x"),
    ("tl.softmax", [("p = tl.exp(x - tl.max(x, axis=0))", "p = tl.softmax(x)")], "calls triton.language.softmax"),
)
def test_row_softmax_kernel_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_row_softmax_kernel(solutions("04", edits).row_softmax_kernel)


TILE_HIDE = 's = tl.where(keys[None, :] < n_kv, s, float("-inf"))    # padding keys'
TILE_M = "m = tl.max(s, axis=1) * qk_scale                        # along each row: axis 1; base 2"
TILE_P = "p = tl.exp2(s * qk_scale - m[:, None])                  # the scale folded into exp2's argument"
TILE_O = "o = tl.dot(p, v) / tl.sum(p, axis=1)[:, None]"
TILE_STORE = "tl.store(O + rows[:, None] * D + cols[None, :], o, mask=rows[:, None] < n_q)"


@mistakes(
    ("padding keys not hidden", [(TILE_HIDE, "# " + TILE_HIDE)], "keys past N_kv were not hidden"),
    ("wrong axis", [(TILE_M, "m = tl.max(s, axis=0) * qk_scale"), (TILE_P, "p = tl.exp2(s * qk_scale - m[None, :])"),
                    (TILE_O, "o = tl.dot(p / tl.sum(p, axis=0)[None, :], v)")], "axis 0"),
    ("no scale", [(TILE_M, "m = tl.max(s, axis=1)"), (TILE_P, "p = tl.exp2(s - m[:, None])")],
     "not multiplied by qk_scale"),
    ("exp for exp2", [(TILE_P, TILE_P.replace("tl.exp2", "tl.exp"))], "tl.exp was used"),
    ("not divided", [(TILE_O, "o = tl.dot(p, v)")], "not divided"),
    ("max not subtracted", [(TILE_P, "p = tl.exp2(s * qk_scale)")], "inf or NaN"),
    ("V without a mask", [("    v = tl.load(V + keys[:, None] * D + cols[None, :], mask=keys[:, None] < n_kv, other=0.0)\n    s",
                           "    v = tl.load(V + keys[:, None] * D + cols[None, :])\n    s")], "V's rows past N_kv"),
    ("store without a mask", [(TILE_STORE, "tl.store(O + rows[:, None] * D + cols[None, :], o)")], "rows past N_q"),
)
def test_attention_tile_kernel_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_attention_tile_kernel(solutions("04", edits).attention_tile_kernel)


STREAM_ACC = "acc = acc * alpha[:, None] + tl.dot(p, v)\n        m_i = m_new\n    tl.store"
STREAM_L = "l_i = l_i * alpha + tl.sum(p, axis=1)"


@mistakes(
    ("no alpha on acc", [(STREAM_ACC, STREAM_ACC.replace("acc * alpha[:, None] + ", "acc + "))], "accumulated output"),
    ("no alpha on L", [(STREAM_L, STREAM_L.replace("l_i * alpha + ", "l_i + "))], "running sum L is not rescaled"),
    ("no alpha at all", [(STREAM_ACC, STREAM_ACC.replace("acc * alpha[:, None] + ", "acc + ")),
                         (STREAM_L, STREAM_L.replace("l_i * alpha + ", "l_i + "))], "missing on both"),
    ("padding keys not hidden", [('        s = tl.where(keys[None, :] < n_kv, s, float("-inf"))\n        m_new', "        m_new")],
     "not hidden"),
    ("state not carried", [("        m_i = m_new\n    tl.store", "    tl.store")], "only the last block"),
    ("no scale", [("m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)\n        p = tl.exp2(s * qk_scale - m_new[:, None])\n        alpha = tl.exp2(m_i - m_new)\n        l_i = l_i",
                   "m_new = tl.maximum(m_i, tl.max(s, axis=1))\n        p = tl.exp2(s - m_new[:, None])\n        alpha = tl.exp2(m_i - m_new)\n        l_i = l_i")],
     "not multiplied by qk_scale"),
    ("normalised per tile", [("acc = acc * alpha[:, None] + tl.dot(p, v)", "acc = acc * alpha[:, None] + tl.dot(p / tl.sum(p, axis=1)[:, None], v)"),
                             (STREAM_L, "l_i = l_i * alpha + 1.0")], "normalised on their own"),
    ("last tile dropped", [("for start in range(0, n_kv, BLOCK_KV):", "for start in range(0, n_kv // BLOCK_KV * BLOCK_KV, BLOCK_KV):")],
     "last, shorter tile"),
    ("V without a mask", [("v = tl.load(V + keys[:, None] * D + cols[None, :], mask=keys[:, None] < n_kv, other=0.0)\n        s = tl.dot",
                           "v = tl.load(V + keys[:, None] * D + cols[None, :])\n        s = tl.dot")], "V's rows past N_kv"),
    ("max not subtracted", [("p = tl.exp2(s * qk_scale - m_new[:, None])\n        alpha = tl.exp2(m_i - m_new)\n        " + STREAM_L,
                             "p = tl.exp2(s * qk_scale)\n        alpha = tl.exp2(m_i - m_i)\n        " + STREAM_L)], "inf or NaN"),
)
def test_stream_kv_kernel_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_stream_kv_kernel(solutions("04", edits).stream_kv_kernel)


MATMUL_A = "a = tl.load(A + rows[:, None] * stride_am + ks[None, :] * stride_ak,\n                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)"
MATMUL_B = "b = tl.load(B + ks[:, None] * stride_bk + cols[None, :] * stride_bn,\n                    mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)"


@mistakes(
    ("K unmasked", [(MATMUL_A, "a = tl.load(A + rows[:, None] * stride_am + ks[None, :] * stride_ak,\n                    mask=rows[:, None] < M, other=0.0)"),
                    (MATMUL_B, "b = tl.load(B + ks[:, None] * stride_bk + cols[None, :] * stride_bn,\n                    mask=cols[None, :] < N, other=0.0)")],
     "read past the end of A and B"),
    ("accumulator not carried", [("acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)      # carried through the loop\n    for k0 in range(0, K, BLOCK_K):",
                                  "for k0 in range(0, K, BLOCK_K):\n        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)")],
     "only the last tile of K counts"),
    ("ragged K tile dropped", [("for k0 in range(0, K, BLOCK_K):", "for k0 in range(0, K // BLOCK_K * BLOCK_K, BLOCK_K):")],
     "ragged last tile of K was left out"),
    ("offsets do not move", [("ks = k0 + tl.arange(0, BLOCK_K)", "ks = tl.arange(0, BLOCK_K)")], "first tile of K again"),
    ("store unmasked", [("acc,\n             mask=(rows[:, None] < M) & (cols[None, :] < N))", "acc)")], "wrote outside C"),
    ("rows of program 1 on block 0", [("rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)", "rows = tl.arange(0, BLOCK_M)")],
     "unwritten"),
)
def test_matmul_kernel_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_matmul_kernel(solutions("04", edits).matmul_kernel)


# --- Chapter 05: the forward kernel -----------------------------------------------------------------


CAUSAL_FULL_END = "kv_full_end = min(q_start, n_kv) // block_kv * block_kv"
FULL_END = "kv_full_end = n_kv // block_kv * block_kv"


@mistakes(
    ("causal keys not skipped", [("kv_end = min(q_start + block_q, n_kv)", "kv_end = n_kv")], "kv_end"),
    ("past the end", [("kv_end = min(q_start + block_q, n_kv)", "kv_end = q_start + block_q")], "do not exist"),
    ("not whole tiles", [(CAUSAL_FULL_END, "kv_full_end = min(q_start, n_kv)"), (FULL_END, "kv_full_end = n_kv")],
     "multiple of BLOCK_KV"),
    ("everything masked", [(CAUSAL_FULL_END, "kv_full_end = 0"), (FULL_END, "kv_full_end = 0")],
     "masks more than needed"),
    ("diagonal unmasked", [(CAUSAL_FULL_END, "kv_full_end = (q_start + block_q) // block_kv * block_kv")],
     "needs a mask"),
)
def test_kv_stage_bounds_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_kv_stage_bounds(solutions("05", edits).kv_stage_bounds)


@mistakes(
    ("no alpha", [("acc = acc * alpha[:, None] + tl.dot(p.to(", "acc = acc + tl.dot(p.to(")], "not rescaled by alpha"),
    ("keys past the end not hidden", [("visible = offs_kv[None, :] < n_kv", "visible = offs_kv[None, :] >= 0")],
     "past the end"),
    ("the course's own loader", [("k = tl.load(k_ptrs)\n", "k = tiles.load_tile(k_ptrs)\n")], "uses flashattn.kernels.tiles.load_tile"),
    ("tl.softmax", [("p = tl.exp2(s * qk_scale - m_new[:, None])          # scale",
                     "p = tl.softmax(s)          # scale")],
     "calls triton.language.softmax"),
    ("no causal mask", [("visible = visible & (offs_q[:, None] >= offs_kv[None, :])", "visible = visible")],
     "causal mask is missing"),
)
def test_fwd_inner_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_fwd_inner(solutions("05", edits).fwd_inner)


FWD_STAGE2 = "kv_full_end, kv_end, n_kv, qk_scale, HEAD_DIM, BLOCK_KV, True, IS_CAUSAL)"
FWD_LSE = "tl.store(LSE2 + offs_q, m_i + tl.log2(l_i), mask=offs_q < n_q)"


@mistakes(
    ("stage 2 without its mask", [(FWD_STAGE2, FWD_STAGE2.replace("True", "False"))], "without the causal mask"),
    ("acc not rescaled", [("acc = alpha[:, None] * acc + tl.dot(", "acc = acc + tl.dot(")], "acc is not rescaled"),
    ("L not rescaled", [("l_i = alpha * l_i + tl.sum(p, axis=1)", "l_i = l_i + tl.sum(p, axis=1)")],
     "L is not rescaled"),
    ("neither rescaled", [("acc = alpha[:, None] * acc + tl.dot(", "acc = acc + tl.dot("),
                          ("l_i = alpha * l_i + tl.sum(p, axis=1)", "l_i = l_i + tl.sum(p, axis=1)")], "alpha is missing"),
    ("LSE in natural log", [(FWD_LSE, FWD_LSE.replace("m_i + tl.log2(l_i)", "(m_i + tl.log2(l_i)) * 0.6931471805599453"))],
     "stored in natural log"),
    ("LSE with tl.log", [(FWD_LSE, FWD_LSE.replace("tl.log2(l_i)", "tl.log(l_i)"))], "mixes two bases"),
    ("scale missing", [("m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)\n        p = tl.exp2(s * qk_scale - m_new[:, None])\n        alpha = tl.exp2(m_i - m_new)\n        l_i = alpha",
                        "m_new = tl.maximum(m_i, tl.max(s, axis=1))\n        p = tl.exp2(s - m_new[:, None])\n        alpha = tl.exp2(m_i - m_new)\n        l_i = alpha")],
     "not multiplied by qk_scale"),
    ("column strides assumed 1", [("k = tl.load(K + offs_kv[:, None] * stride_kn + offs_d[None, :] * stride_kd,", "k = tl.load(K + offs_kv[:, None] * stride_kn + offs_d[None, :],"),
                                  ("v = tl.load(V + offs_kv[:, None] * stride_vn + offs_d[None, :] * stride_vd,", "v = tl.load(V + offs_kv[:, None] * stride_vn + offs_d[None, :],")],
     "columns are 2 elements apart"),
    ("head strides assumed contiguous", [("Q += batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh",
                                          "Q += (batch.to(tl.int64) * n_heads + head) * n_q * HEAD_DIM")],
     "right for a contiguous one"),
    ("causal start at the diagonal", [("offs_q, offs_d, 0, kv_full_end, n_kv", "offs_q, offs_d, kv_full_end, kv_full_end, n_kv")],
     "first stage still starts at key 0"),
    ("reversed block off by one", [("q_block = tl.num_programs(0) - 1 - q_block", "q_block = tl.num_programs(0) - q_block")],
     "unwritten"),
    ("no column mask", [("load_ok = offs_d[None, :] < HEAD_DIM               #", "load_ok = offs_d[None, :] >= 0               #")],
     "column mask"),
    ("store unmasked", [("acc.to(O.dtype.element_ty),\n             mask=in_tile)", "acc.to(O.dtype.element_ty))")], "wrote outside O"),
    ("the course's own bounds", [("    if IS_CAUSAL:                                        # query i sees keys 0..i\n        kv_end = tl.minimum(q_start + BLOCK_Q, n_kv)\n        kv_full_end = tl.minimum(q_start, n_kv) // BLOCK_KV * BLOCK_KV\n    else:\n        kv_end = n_kv\n        kv_full_end = n_kv // BLOCK_KV * BLOCK_KV\n",
                                  "    kv_full_end, kv_end = tiles.kv_stage_bounds(q_start, n_kv, BLOCK_Q, BLOCK_KV, IS_CAUSAL)\n")],
     "uses flashattn.kernels.tiles.kv_stage_bounds"),
)
def test_my_attn_fwd_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_my_attn_fwd(solutions("05", edits).my_attn_fwd)


@mistakes(
    ("natural-log scale", [("scale * math.log2(math.e)", "scale")], "lacks log2 e"),
    ("scale missing", [("scale * math.log2(math.e)", "math.log2(math.e)")], "softmax scale is missing"),
    ("scale ignored", [("scale = 1.0 / math.sqrt(head_dim) if scale is None else scale", "scale = 1.0 / math.sqrt(head_dim)")],
     "scale argument was ignored"),
    ("lse2 in natural log", [("    return o, lse2\n", "    return o, lse2 * math.log(2)\n")], "natural log"),
    ("strides assumed contiguous", [("*q.stride(), *k.stride(), *v.stride(), *o.stride()",
                                     "*q.contiguous().stride(), *k.contiguous().stride(), *v.contiguous().stride(), *o.stride()")],
     "right for contiguous inputs"),
    ("grid one block short", [("grid = (triton.cdiv(n_q, BLOCK_Q), heads, batch)", "grid = (n_q // BLOCK_Q, heads, batch)")],
     "cover the ragged last block"),
    ("is_causal not passed", [("IS_CAUSAL=bool(is_causal))", "IS_CAUSAL=False)")], "is not causal"),
    ("the course's own launcher", [("    return o, lse2\n", "    o, lse2 = forward.attention_forward(q, k, v, is_causal, scale)\n    return o, lse2\n")],
     "uses flashattn.kernels.forward.attention_forward"),
    ("the kernel never launched", [("    my_attn_fwd[grid](", "    (lambda *args, **kwargs: None)(")],
     "never launches my_attn_fwd"),
    ("the kernel launched only sometimes", [("    my_attn_fwd[grid](", "    if n_q < 0:\n        my_attn_fwd[grid](")],
     "did not launch my_attn_fwd"),
)
def test_my_attention_forward_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_my_attention_forward(solutions("05", edits).my_attention_forward)


def test_my_attention_forward_says_when_the_kernel_is_missing(solutions):
    with pytest.raises(ex.ExerciseError, match="launches my_attn_fwd, which is not implemented yet"):
        ex.check_my_attention_forward(solutions("05", stub="ch05-my-attn-fwd").my_attention_forward)
    # a launcher that does not launch the kernel is told so, not that the kernel is missing
    without = [("    my_attn_fwd[grid](", "    (lambda *args, **kwargs: None)(")]
    with pytest.raises(ex.ExerciseError, match="never launches my_attn_fwd"):
        ex.check_my_attention_forward(solutions("05", without, stub="ch05-my-attn-fwd").my_attention_forward)
