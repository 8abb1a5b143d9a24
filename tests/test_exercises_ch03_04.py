"""The checkers of chapters 03 (tiling and causal blocks) and 04 (the forward kernel): each passes
the notebook's solution and fails, with a message that names the problem, on a stub and on
plausible wrong solutions."""
import math

import flashattn  # noqa: F401  (first: it picks the runtime before triton.language is imported)
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from flashattn import exercises, traversal
from flashattn.exercises import ExerciseError


# --- Chapter 03: classify the tiles ----------------------------------------------------------------

def classify(n_q, n_kv, block_q, block_kv, is_causal):
    """The notebook's solution: decide each tile from its first and last query and key."""
    n_qb, n_kb = -(-n_q // block_q), -(-n_kv // block_kv)
    kinds = np.zeros((n_qb, n_kb), dtype=np.int8)
    for qb in range(n_qb):
        first_q, last_q = qb * block_q, qb * block_q + block_q - 1
        for kb in range(n_kb):
            first_k, last_k = kb * block_kv, kb * block_kv + block_kv - 1
            inside = last_k < n_kv
            if is_causal:
                every, some = inside and last_k <= first_q, first_k <= last_q
            else:
                every, some = inside, True
            kinds[qb, kb] = 2 if every else 1 if some else 0
    return kinds


def test_definition_is_the_kernels_map():
    """The checker's brute-force definition and flashattn.traversal agree on every case it uses."""
    for n_q, n_kv, bq, bkv, causal in exercises._classify_cases():
        want, _ = exercises._tile_kinds_by_definition(n_q, n_kv, bq, bkv, causal)
        np.testing.assert_array_equal(traversal.classify_blocks(n_q, n_kv, bq, bkv, causal), want)


def test_classify_passes(capsys):
    exercises.check_classify_tiles(classify)
    assert "PASSED" in capsys.readouterr().out


def stub(*args, **kwargs):
    raise NotImplementedError()


@pytest.mark.parametrize("wrong, message", [
    (stub, "not implemented yet"),
    # the ragged end forgotten: keys counted as if the last tile were whole
    (lambda n_q, n_kv, bq, bkv, c: classify(n_q, -(-n_kv // bkv) * bkv, bq, bkv, c), "past the end"),
    # only real query rows considered in the last block (the kernel computes all BLOCK_Q rows)
    (lambda n_q, n_kv, bq, bkv, c: exercises._tile_kinds_by_definition(n_q, n_kv, bq, bkv, c)[0]
     if not c else _real_rows_only(n_q, n_kv, bq, bkv), "padding row"),
    # causal masks ignored: every tile full or ragged
    (lambda n_q, n_kv, bq, bkv, c: classify(n_q, n_kv, bq, bkv, False), "is wrong at"),
    (lambda n_q, n_kv, bq, bkv, c: classify(n_q, n_kv, bq, bkv, c)[:-1], "returned shape"),
    (lambda n_q, n_kv, bq, bkv, c: classify(n_q, n_kv, bq, bkv, c) * 2, "use only 0"),
])
def test_classify_catches(wrong, message, monkeypatch):
    monkeypatch.setattr("matplotlib.pyplot.show", lambda *a, **k: None)
    with pytest.raises(ExerciseError, match=message):
        exercises.check_classify_tiles(wrong)


def _real_rows_only(n_q, n_kv, block_q, block_kv):
    """A plausible mistake: decide the causal tiles from the real query rows only."""
    n_qb, n_kb = -(-n_q // block_q), -(-n_kv // block_kv)
    i = np.arange(n_q)[:, None]
    j = np.arange(n_kb * block_kv)[None, :]
    exists = (j < n_kv) & (j <= i)
    kinds = np.zeros((n_qb, n_kb), dtype=np.int8)
    for qb in range(n_qb):
        for kb in range(n_kb):
            tile = exists[qb * block_q:(qb + 1) * block_q, kb * block_kv:(kb + 1) * block_kv]
            kinds[qb, kb] = 2 if tile.all() else 1 if tile.any() else 0
    return kinds


# --- Chapter 03: the tiled forward in PyTorch -----------------------------------------------------

def tiled_attention(q, k, v, is_causal, block_q, block_kv, mistake=None):
    """The notebook's solution (natural base), with optional mistakes for the tests below."""
    n_q, n_kv, d = q.shape[0], k.shape[0], q.shape[1]
    scale = 1.0 / math.sqrt(d)
    kinds = classify(n_q, n_kv, block_q, block_kv, is_causal)
    out = torch.empty_like(q)
    lse = torch.empty(n_q, dtype=q.dtype)
    n_tiles = 0
    for qb in range(kinds.shape[0]):
        rows = torch.arange(qb * block_q, min((qb + 1) * block_q, n_q))
        m = torch.full((len(rows),), float("-inf"), dtype=q.dtype)
        l = torch.zeros(len(rows), dtype=q.dtype)
        acc = torch.zeros(len(rows), d, dtype=q.dtype)
        for kb in range(kinds.shape[1]):
            if kinds[qb, kb] == 0 and mistake != "all_tiles":
                continue
            n_tiles += 1
            cols = torch.arange(kb * block_kv, min((kb + 1) * block_kv, n_kv))
            s = q[rows] @ k[cols].T * scale
            if kinds[qb, kb] != 2 and is_causal and mistake != "no_mask":
                s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(1))
            p = torch.exp(s - m_new[:, None]).nan_to_num(0.0)
            alpha = torch.exp(m - m_new).nan_to_num(0.0)
            l = l * alpha + p.sum(1)
            acc = (acc if mistake == "no_alpha" else acc * alpha[:, None]) + p @ v[cols]
            m = m_new
        out[rows] = acc / l[:, None]
        lse[rows] = m + torch.log(l) if mistake != "lse_base2" else (m + torch.log(l)) / math.log(2)
    return out, lse, n_tiles


def test_tiled_attention_passes(capsys):
    exercises.check_tiled_attention(tiled_attention)
    assert "PASSED" in capsys.readouterr().out


@pytest.mark.parametrize("mistake, message", [
    ("no_alpha", "not rescaled by alpha"),
    ("no_mask", "causal mask is missing"),
    ("all_tiles", "n_tiles is"),
    ("lse_base2", "lse"),
])
def test_tiled_attention_catches(mistake, message, monkeypatch):
    monkeypatch.setattr("matplotlib.pyplot.show", lambda *a, **k: None)
    with pytest.raises(ExerciseError, match=message):
        exercises.check_tiled_attention(lambda *a: tiled_attention(*a, mistake=mistake))
    with pytest.raises(ExerciseError, match="not implemented yet"):
        exercises.check_tiled_attention(stub)


# --- Chapter 04: the stage boundaries ---------------------------------------------------------------

def kv_stage_bounds(q_start, block_q, block_kv, n_kv, is_causal):
    if is_causal:
        kv_end = min(q_start + block_q, n_kv)
        kv_full_end = min(q_start, n_kv) // block_kv * block_kv
    else:
        kv_end = n_kv
        kv_full_end = n_kv // block_kv * block_kv
    return kv_full_end, kv_end


def test_kv_stage_bounds_passes(capsys):
    exercises.check_kv_stage_bounds(kv_stage_bounds)
    assert "PASSED" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (stub, "not implemented yet"),
    (lambda qs, bq, bkv, n, c: (kv_stage_bounds(qs, bq, bkv, n, c)[0], n), "kv_end"),  # causal: no skipping
    (lambda qs, bq, bkv, n, c: (kv_stage_bounds(qs, bq, bkv, n, c)[0], qs + bq if c else n), "do not exist"),
    (lambda qs, bq, bkv, n, c: (min(qs, n) if c else n, kv_stage_bounds(qs, bq, bkv, n, c)[1]), "multiple of BLOCK_KV"),
    (lambda qs, bq, bkv, n, c: (0, kv_stage_bounds(qs, bq, bkv, n, c)[1]), "masks more than needed"),
    (lambda qs, bq, bkv, n, c: ((qs + bq) // bkv * bkv if c else n // bkv * bkv,
                                kv_stage_bounds(qs, bq, bkv, n, c)[1]), "needs a mask"),
])
def test_kv_stage_bounds_catches(wrong, message):
    with pytest.raises(ExerciseError, match=message):
        exercises.check_kv_stage_bounds(wrong)


# --- Chapter 04: the inner loop in Triton ------------------------------------------------------------

@triton.jit
def fwd_inner(acc, m_i, l_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
              offs_q, offs_d, kv_lo, kv_hi, n_kv, qk_scale,
              BLOCK_KV: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr):
    for kv_start in range(kv_lo, kv_hi, BLOCK_KV):
        offs_kv = kv_start + tl.arange(0, BLOCK_KV)
        k_ptrs = K + offs_kv[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = V + offs_kv[:, None] * stride_vn + offs_d[None, :] * stride_vd
        if MASKED:
            k = tl.load(k_ptrs, mask=offs_kv[:, None] < n_kv, other=0.0)
            v = tl.load(v_ptrs, mask=offs_kv[:, None] < n_kv, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            visible = offs_kv[None, :] < n_kv
            if IS_CAUSAL:
                visible = visible & (offs_q[:, None] >= offs_kv[None, :])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def fwd_inner_stub(acc, m_i, l_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                   offs_q, offs_d, kv_lo, kv_hi, n_kv, qk_scale,
                   BLOCK_KV: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr):
    # YOUR CODE HERE
    raise NotImplementedError()
    return acc, m_i, l_i


@triton.jit
def fwd_inner_no_alpha(acc, m_i, l_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                       offs_q, offs_d, kv_lo, kv_hi, n_kv, qk_scale,
                       BLOCK_KV: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr):
    for kv_start in range(kv_lo, kv_hi, BLOCK_KV):
        offs_kv = kv_start + tl.arange(0, BLOCK_KV)
        kv_ok = offs_kv[:, None] < n_kv
        k = tl.load(K + offs_kv[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_ok, other=0.0)
        v = tl.load(V + offs_kv[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            visible = offs_kv[None, :] < n_kv
            if IS_CAUSAL:
                visible = visible & (offs_q[:, None] >= offs_kv[None, :])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc + tl.dot(p.to(v.dtype), v)  # the mistake: acc not rescaled
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def fwd_inner_load_mask_only(acc, m_i, l_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                             offs_q, offs_d, kv_lo, kv_hi, n_kv, qk_scale,
                             BLOCK_KV: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr):
    for kv_start in range(kv_lo, kv_hi, BLOCK_KV):
        offs_kv = kv_start + tl.arange(0, BLOCK_KV)
        kv_ok = offs_kv[:, None] < n_kv
        k = tl.load(K + offs_kv[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_ok, other=0.0)
        v = tl.load(V + offs_kv[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            if IS_CAUSAL:  # the mistake: keys past n_kv are not hidden (they score 0)
                s = tl.where(offs_q[:, None] >= offs_kv[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def fwd_inner_no_causal(acc, m_i, l_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                        offs_q, offs_d, kv_lo, kv_hi, n_kv, qk_scale,
                        BLOCK_KV: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr):
    for kv_start in range(kv_lo, kv_hi, BLOCK_KV):
        offs_kv = kv_start + tl.arange(0, BLOCK_KV)
        kv_ok = offs_kv[:, None] < n_kv
        k = tl.load(K + offs_kv[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_ok, other=0.0)
        v = tl.load(V + offs_kv[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:  # the mistake: the causal mask is forgotten
            s = tl.where(offs_kv[None, :] < n_kv, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


def test_fwd_inner_passes(capsys):
    exercises.check_fwd_inner(fwd_inner)
    assert "PASSED" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (fwd_inner_stub, "not implemented yet"),
    (fwd_inner_no_alpha, "not rescaled by alpha"),
    (fwd_inner_load_mask_only, "past the end"),
    (fwd_inner_no_causal, "causal mask is missing"),
])
def test_fwd_inner_catches(wrong, message, monkeypatch):
    monkeypatch.setattr("matplotlib.pyplot.show", lambda *a, **k: None)
    with pytest.raises(ExerciseError, match=message):
        exercises.check_fwd_inner(wrong)
