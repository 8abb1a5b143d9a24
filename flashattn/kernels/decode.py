"""The decode kernels: attention of new tokens against a KV cache, split-KV (flash-decoding).

Generating text calls attention once per new token: N_q new queries per sequence (usually 1)
against the keys and values of everything generated so far, kept in a cache. There is almost no
arithmetic per byte of cache (2 x 2 FLOPs per query row and cached element), so a decoding step
runs at the speed of memory: the whole job is to read the cache once, with every SM pulling.

Two ideas get there:

* **Grouped heads in one tile.** The ``H_q / H_kv`` query heads that share a KV head (grouped-query
  attention) and the N_q new tokens are the rows of one query tile, so a KV head's cache is read
  once for all of them, not once per query head.
* **Split-KV.** One program per (batch, KV head) gives 64 programs at B = 8, H_kv = 8: half an
  H200's 132 SMs idle. So the keys of each sequence are split into ``num_splits`` runs, one
  program each; every program writes a partial state (O, LSE) of its rows, and a second small
  kernel merges the partial states with chapter 01's merge of softmax states. With one split
  the first kernel writes the final output itself.

A paged cache (``PAGED``, as vLLM's and FlashAttention's ``block_table``) keeps each sequence's keys
in pages of ``PAGE_SIZE`` rows anywhere in one pool: the inner loop gathers each tile's rows
through the sequence's row of the block table (``forward.fwd_inner``), everything else unchanged.

Both kernels work in base 2 like the forward kernel (LSE = M + log2 L, scale x log2e folded into
exp2); the public ``lse`` is natural log, like ``torch.logsumexp``.
"""
import functools
import math

import torch
import triton
import triton.language as tl

from ..gpu import configs, direct
from ..gpu.runtime import INTERPRET, kernel_dtype
from .forward import fwd_inner
from .mods import ScoreMods
from .tiles import load_tile, qk_scale, store_tile

MAX_BLOCK_R = 64          # query rows per tile; more rows (many heads per group) take more tiles
MAX_BLOCK_R_FP32 = 32     # float32 tiles of 64 rows spill (IEEE) or overflow shared memory (TF32)
LN2 = tl.constexpr(math.log(2.0))  # LSE in base 2 x ln 2 = natural log

#: The split heuristic. A memory-bound kernel needs many loads in flight on every SM: aim for
#: PROGRAMS_PER_SM programs per SM, but give each split at least MIN_TILES_PER_SPLIT key tiles
#: (a partial state costs a write and a read of its rows) and at most MAX_SPLITS (the merge reads
#: all partial states of a row as one tile). The interpreter pretends to have INTERPRETER_SMS SMs,
#: so that small caches in tests and notebooks are split as well.
PROGRAMS_PER_SM = 2
MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 64
INTERPRETER_SMS = 8


@triton.jit(do_not_specialize=["n_q", "group", "num_splits", "n_max", "win_left", "win_right"])  # one binary for every length
def decode_split(Q, K, V, LENS, O, LSE, Pages, Slopes, LeftPad, CacheRows,
                  stride_qb, stride_qh, stride_qn, stride_qd,
                  stride_kb, stride_kh, stride_kn, stride_kd,
                  stride_vb, stride_vh, stride_vn, stride_vd,
                  stride_pb, stride_sb, stride_sh,
                  n_q, group, num_splits, qk_scale, n_max, softcap, win_left, win_right, n_pages, n_cache,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_KV: tl.constexpr, FINAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  SOFTCAP: tl.constexpr = False, WINDOW: tl.constexpr = False, ALIBI: tl.constexpr = False,
                  PAGED: tl.constexpr = False, PAGE_SIZE: tl.constexpr = 16, CAUSAL: tl.constexpr = True,
                  LEFTPAD: tl.constexpr = False, CACHE_ROWS: tl.constexpr = False):
    # Grid: axis 0 = (row block, split), axis 1 = KV heads, axis 2 = batch.
    split = tl.program_id(0) % num_splits
    row_block = tl.program_id(0) // num_splits
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    # This sequence's valid keys are cache entries [start, end): end is its length L, start its
    # first valid key (LEFTPAD: a left-padded batch), both kept within the cache: values that were
    # not checked on the host (decode's max_seqlen mode) must not make the program read outside it.
    end = tl.minimum(tl.maximum(tl.load(LENS + batch).to(tl.int32), 0), n_max)
    if LEFTPAD:
        start = tl.minimum(tl.maximum(tl.load(LeftPad + batch).to(tl.int32), 0), end)
    else:
        start = 0
    # From here on keys are counted from start, as if the padding were not there: key j is cache
    # entry start + j, and the sequence has n_kv = end - start keys.
    n_kv = end - start

    # Row r of the tile is new token t = r % n_q of query head kv_head * group + r // n_q.
    n_rows = group * n_q
    offs_r = row_block * BLOCK_R + tl.arange(0, BLOCK_R)
    t = offs_r % n_q
    offs_d = tl.arange(0, BLOCK_D)
    Q += batch.to(tl.int64) * stride_qb + (kv_head * group).to(tl.int64) * stride_qh
    row_offsets = (offs_r // n_q) * stride_qh + t * stride_qn
    q_ptrs = Q + row_offsets[:, None] + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=(offs_r[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    # The new tokens are the last n_q of the keys: token t sits at position n_kv - n_q + t and, with
    # CAUSAL, sees keys 0 .. n_kv - n_q + t (bottom-right alignment); without, it sees every key.
    pos = n_kv - n_q + t
    if CAUSAL:
        # A token placed before key 0 (fewer keys than new tokens) sees none: it is masked as if it
        # sat at key 0 (so that every row sees key 0 and -inf masks stay safe) and written as a
        # row without keys at the end.
        pos = tl.maximum(pos, 0)

    # Keys [0, n_seen) are seen by every row. They are cut into num_splits runs of whole tiles,
    # and the last run also takes the keys only later tokens see, [n_seen, n_kv). So every split
    # starts with a key that all its rows see, and -inf masks stay safe as in the forward kernel
    # (under a window a row may first meet hidden keys: fwd_inner's guard for windows covers it).
    # Splits past the end (a short sequence, or no key) get no keys.
    if CAUSAL:
        n_seen = tl.minimum(tl.maximum(n_kv - n_q + 1, 1), n_kv)
    else:
        n_seen = n_kv
    # A sliding window of win_left keys before each token: the tiles before the first token's
    # window are never loaded, and the splits share the keys from there on.
    if WINDOW:
        first = tl.maximum(n_kv - n_q - win_left, 0) // BLOCK_KV * BLOCK_KV
    else:
        first = 0
    span = tl.cdiv(tl.cdiv(n_seen - first, BLOCK_KV), num_splits) * BLOCK_KV
    kv_lo = first + split * span
    kv_hi = tl.where(kv_lo + span < n_seen, kv_lo + span, n_kv)
    kv_hi = tl.where(kv_lo < n_seen, kv_hi, kv_lo)
    # Only the tiles from the last whole tile of [0, n_seen) on need the mask; under a window
    # every tile does (each token's window starts at its own key).
    kv_full_end = tl.minimum(tl.maximum(n_seen // BLOCK_KV * BLOCK_KV, kv_lo), kv_hi)
    if WINDOW:
        kv_full_end = kv_lo

    if CACHE_ROWS:  # the batch entry reads row CacheRows[batch] of the cache (clamped into it)
        cache_row = tl.minimum(tl.maximum(tl.load(CacheRows + batch), 0), n_cache - 1).to(tl.int64)
    else:
        cache_row = batch.to(tl.int64)
    if PAGED:
        # A paged cache (num_pages, PAGE_SIZE, H_kv, D): the sequence's keys lie in the pages its
        # row of the block table Pages names, stride_kb (stride_vb) apart; fwd_inner gathers them,
        # key j from cache entry start + j.
        Pages += batch.to(tl.int64) * stride_pb
    else:
        K += cache_row * stride_kb + start.to(tl.int64) * stride_kn
        V += cache_row * stride_vb + start.to(tl.int64) * stride_vn
    K += kv_head.to(tl.int64) * stride_kh
    V += kv_head.to(tl.int64) * stride_vh
    if ALIBI:
        # ALiBi: each row has the slope of its query head (stride_sb is 0 for one row of slopes)
        heads = kv_head * group + offs_r // n_q
        slope = tl.load(Slopes + batch.to(tl.int64) * stride_sb + heads * stride_sh,
                        mask=offs_r < n_rows, other=0.0)[:, None]
    else:
        slope = 0.0
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    # The forward kernel's inner loop, unchanged (V of q's head dim: offs_d and HEAD_DIM twice):
    # whole tiles without a mask, then the diagonal
    # (where keys past a row's position, and past n_kv, are hidden; keys >= n_kv are never loaded).
    # Softcap (Gemma 2), ALiBi and the window are the forward kernel's too: the rows' positions
    # pos are already the keys' (shift 0), so ALiBi's distance is |pos - j|.
    acc, m_i, l_i = fwd_inner(acc, m_i, l_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                               pos, offs_d, offs_d, kv_lo, kv_full_end, n_kv, qk_scale,
                               HEAD_DIM, BLOCK_D, HEAD_DIM, BLOCK_D, BLOCK_KV, False, CAUSAL, DOT_PRECISION,
                               WINDOW, win_left, win_right,
                               softcap=softcap, slope=slope, Pages=Pages, n_pages=n_pages,
                               stride_kp=stride_kb, stride_vp=stride_vb, page_shift=start,
                               SOFTCAP=SOFTCAP, ALIBI=ALIBI, PAGED=PAGED, PAGE_SIZE=PAGE_SIZE)
    acc, m_i, l_i = fwd_inner(acc, m_i, l_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                               pos, offs_d, offs_d, kv_full_end, kv_hi, n_kv, qk_scale,
                               HEAD_DIM, BLOCK_D, HEAD_DIM, BLOCK_D, BLOCK_KV, True, CAUSAL, DOT_PRECISION,
                               WINDOW, win_left, win_right,
                               softcap=softcap, slope=slope, Pages=Pages, n_pages=n_pages,
                               stride_kp=stride_kb, stride_vp=stride_vb, page_shift=start,
                               SOFTCAP=SOFTCAP, ALIBI=ALIBI, PAGED=PAGED, PAGE_SIZE=PAGE_SIZE)

    # A row that saw no key (a split without keys, no key at all, or a token before the first
    # key) has L = 0: it writes the neutral state O = 0, LSE = -inf, which weighs nothing in the
    # merge (and is the answer for a row without keys: an empty sum, like SDPA).
    has_keys = l_i > 0
    if CAUSAL:  # not a token before key 0 (recomputed here rather than held through the loop)
        has_keys = has_keys & (n_kv - n_q + offs_r % n_q >= 0)
    o = acc / tl.where(has_keys, l_i, float("inf"))[:, None]  # a row without keys divides by inf: O = 0
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    if FINAL:  # the only split: this is the answer, LSE in natural log
        lse = lse * LN2
    # Outputs are (B, H_q, N_q, num_splits, D), contiguous: this program's rows are rows
    # (batch * H_kv + kv_head) * n_rows + r of the (B * H_q * N_q) output rows.
    first_row = (batch.to(tl.int64) * tl.num_programs(1) + kv_head) * n_rows
    O += (first_row * num_splits + split) * HEAD_DIM
    LSE += first_row * num_splits + split
    store_tile(O, o, offs_r, offs_d, num_splits * HEAD_DIM, 1, n_rows, HEAD_DIM, HEAD_DIM < BLOCK_D)
    tl.store(LSE + offs_r * num_splits, lse, mask=offs_r < n_rows)


@triton.jit(do_not_specialize=["num_splits"])
def decode_merge(O_PART, LSE_PART, O, LSE, num_splits,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    # One program per output row: merge its num_splits partial states (O_s, LSE_s).
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    lse_s = tl.load(LSE_PART + row * num_splits + offs_s, mask=offs_s < num_splits,
                    other=float("-inf"))
    # Chapter 01's merge: bring every partial sum to the common max M, then add. Each O_s is
    # already divided by its own sum L_s = 2**(LSE_s - M_s), so it is weighed by 2**(LSE_s - M).
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # no split saw a key (L = 0): all weights 0
    w = tl.exp2(lse_s - m_safe)
    l = tl.sum(w, 0)
    o_s = load_tile(O_PART + row * num_splits * HEAD_DIM, offs_s, offs_d, HEAD_DIM, 1,
                    num_splits, HEAD_DIM, True, HEAD_DIM < BLOCK_D)
    l_safe = tl.where(l > 0, l, 1.0)
    o = tl.sum(o_s * w[:, None], 0) / l_safe
    lse = tl.where(l > 0, m_safe + tl.log2(l_safe), float("-inf"))
    tl.store(O + row * HEAD_DIM + offs_d, o.to(O.dtype.element_ty), mask=offs_d < HEAD_DIM)
    tl.store(LSE + row, lse * LN2)


def max_block_r(dtype) -> int:
    """The most query rows of one tile for inputs of ``dtype`` (at head dims up to 256, compiled
    for sm_90 without spilling: ``tests/test_decode_compile.py``)."""
    return MAX_BLOCK_R_FP32 if dtype == torch.float32 else MAX_BLOCK_R


@functools.lru_cache(maxsize=None)
def sm_count(device) -> int:
    """Streaming multiprocessors of ``device`` (INTERPRETER_SMS on the interpreter)."""
    if INTERPRET:
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _cdiv(a, b):
    return (a + b - 1) // b  # triton.cdiv in plain Python: it costs microseconds on the host


def choose_num_splits(programs, n_seen, block_kv, n_sm, programs_per_sm=PROGRAMS_PER_SM):
    """How many splits for ``programs`` unsplit programs (batch x KV heads x row blocks), when
    the longest sequence has ``n_seen`` keys seen by all its new tokens: the count nearest to
    ``programs_per_sm`` programs on each of the ``n_sm`` SMs (nearest rather than above, so that
    the programs come in whole waves and no SM is left with a lone extra one), but no more than
    gives each split MIN_TILES_PER_SPLIT tiles of ``block_kv`` keys, and at most MAX_SPLITS. So 1
    (no merge) when the programs already fill the GPU or the cache is short."""
    if programs <= 0 or n_seen <= 0:
        return 1
    wanted = round(programs_per_sm * n_sm / programs)
    most = _cdiv(n_seen, block_kv) // MIN_TILES_PER_SPLIT
    return max(1, min(wanted, most, MAX_SPLITS))


def decode_forward(q, k_cache, v_cache, lengths, max_len, scale, num_splits=None, config=None,
                   partials=False, block_table=None, **options):
    """Launch the decode kernels on checked arguments: ``q`` (B, H_q, N_q, D), caches (B, H_kv,
    N_max, D) of any strides, ``lengths`` an int32/int64 tensor (B,) on the device, ``max_len``
    its largest value. ``num_splits`` and ``config`` (BLOCK_KV, num_warps, num_stages) default to
    the heuristic and configs.decode_config. Returns ``(out, lse)``, lse in natural log.

    With ``partials``, the merge is not run: returns the split kernel's partial states instead,
    ``o_part`` (B, H_q, N_q, num_splits, D) and ``lse_part`` (B, H_q, N_q, num_splits), float32,
    each O_s divided by its own sum and LSE_s in base 2 (-inf for a split without keys).
    With ``block_table`` the caches are paged, ``(num_pages, page_size, H_kv, D)``. ``options`` are
    :meth:`Plan.run`'s (``causal``, ``cache_leftpad``, ``window``, ...)."""
    plan = Plan(q, k_cache, v_cache, config, block_table)
    out, lse = plan.run(q, k_cache, v_cache, lengths, max_len, scale, num_splits, partials,
                        block_table=block_table, **options)
    return (out, lse) if partials else (out, lse.view(plan.rows))


#: How decode does the host work of every call. Not a user setting: the decode benchmark
#: (``python -m flashattn.bench decode --host-ab``) switches it to time the ways side by side.
#:
#: * ``launch``: the first launch of each kind goes through Triton's JIT (which compiles the
#:   kernel); later ones go through the JIT again (``"jit"``), through the compiled kernel as
#:   Triton offers it (``"compiled"``: ``CompiledKernel[grid](*args)``, which asks for the current
#:   device and stream and builds launch metadata for the launch hooks at every launch), or
#:   straight to the compiled kernel's launcher as the JIT calls it (``"launcher"``), without
#:   launch metadata while no launch hook is registered (a profiler such as proton registers one;
#:   then it goes through the compiled kernel).
#: * ``lengths``: lengths given on the CPU are copied to the GPU without waiting for its queued
#:   work, straight from ``"pageable"`` memory (CUDA stages so small a copy at once) or through
#:   ``"pinned"`` memory (one more step, a pinned block from PyTorch's pool).
#: * ``buffers``: with several splits, the partial states and the lse in ``"one"`` float32
#:   allocation, or each in its own (``"separate"``).
#:
#: The default is what an H200 measured fastest on the host (torch 2.11, triton 3.6, 2026-12-01:
#: 47 us per call at a 4k cache against 54 us for one buffer, 55-127 us for the other ways;
#: figures/data/h200_decode_host_ab.csv).
HOST = dict(launch="launcher", lengths="pageable", buffers="separate")
HOST_CHOICES = dict(launch=("jit", "compiled", "launcher"), lengths=("pinned", "pageable"),
                    buffers=("separate", "one"))


def set_host(**settings):
    """Change some of ``HOST`` (the benchmark's switch); returns the settings before."""
    for name, value in settings.items():
        if value not in HOST_CHOICES.get(name, ()):
            raise ValueError(f"decode's host setting {name}={value!r}: expected one of "
                             f"{HOST_CHOICES.get(name, ())} for one of {tuple(HOST_CHOICES)}")
    before = dict(HOST)
    HOST.update(settings)
    return before


def _round4(n):
    return (n + 3) // 4 * 4  # float32 elements to a multiple of 16 bytes


class Plan:
    """What decode decides from the shapes, strides and dtypes alone (tile sizes, configuration,
    the split heuristic's inputs, the kernels' fixed arguments), and the kernels compiled for
    them, launched directly after the first launch through Triton's JIT (``flashattn.gpu.direct``)."""

    def __init__(self, q, k_cache, v_cache, config=None, block_table=None):
        batch, n_heads, n_q, head_dim = q.shape
        self.batch, self.n_heads, self.n_q, self.head_dim = batch, n_heads, n_q, head_dim
        # A paged cache (num_pages, page_size, H_kv, D) holds at most max_blocks pages per sequence
        self.paged = block_table is not None
        if self.paged:
            self.n_pages, self.page_size, self.kv_heads = k_cache.shape[:3]
            self.n_max = block_table.shape[1] * self.page_size
            self.n_cache = 1
        else:
            self.n_pages, self.page_size = 1, 16
            self.kv_heads, self.n_max = k_cache.shape[1], k_cache.shape[2]
            self.n_cache = k_cache.shape[0]  # the cache's rows (B, or more with cache_batch_idx)
        self.group = n_heads // self.kv_heads
        self.rows = (batch, n_heads, n_q)
        self.n_rows = batch * n_heads * n_q
        self.out_shape = (batch, n_heads, n_q, head_dim)
        self.device, self.out_dtype = q.device, q.dtype
        # the dtype the kernels read and write: float32 for bfloat16 where runtime.kernel_dtype
        # says so (the interpreter, GPUs before sm_80)
        self.dtype = dtype = kernel_dtype(q)[0].dtype
        self.strides = self.kernel_strides(q, k_cache, v_cache)  # kept in the plan's key
        n_rows = self.group * n_q
        # tl.dot needs at least 16 rows
        self.block_r = min(max(16, triton.next_power_of_2(n_rows)), max_block_r(q.dtype))
        self.row_blocks = _cdiv(n_rows, self.block_r)
        self.precision = configs.decode_precision(dtype)
        self.block_d = configs.block_d(head_dim)
        self.config = dict(config or configs.decode_config(dtype, self.precision, self.block_r,
                                                          self.block_d, paged=self.paged))
        self.scale = 1.0 / math.sqrt(head_dim)
        self.empty = self.n_rows * head_dim == 0
        self.kernels = {}  # (kernel, num_splits, partials, lengths' alignment) -> direct.Compiled

    def kernel_strides(self, q, k_cache, v_cache):
        """q's and the caches' strides as the split kernel takes them: (batch, head, row, feature),
        and for a paged cache (page, head, row within the page, feature)."""
        if self.paged:
            return (*q.stride(), *(t.stride(i) for t in (k_cache, v_cache) for i in (0, 2, 1, 3)))
        return (*q.stride(), *k_cache.stride(), *v_cache.stride())

    def num_splits(self, max_len, causal=True):
        seen = max_len - self.n_q + 1 if causal else max_len  # keys every new token sees, at most
        return choose_num_splits(self.batch * self.kv_heads * self.row_blocks, seen,
                                 self.config["BLOCK_KV"], sm_count(self.device))

    def run(self, q, k_cache, v_cache, lengths, max_len, scale, num_splits=None, partials=False,
            keep_lse=True, softcap=0.0, window=-1, block_table=None, alibi_slopes=None, causal=True,
            window_right=-1, cache_leftpad=None, cache_batch_idx=None):
        """The launches, on arguments of this plan's shapes, dtypes, strides and alignment;
        ``softcap`` > 0 caps the scores, ``window`` >= 0 lets each token see only that many keys
        before it (and, not ``causal``, ``window_right`` >= 0 that many after it); ``block_table``
        (B, max_blocks) int32 names each sequence's pages of a paged cache (the plan's, if it was
        made for one); ``alibi_slopes`` (1 or B, H_q) float32 adds ``-slope * |pos - j|`` to the
        scores. ``causal`` False lets every new token see every key. ``cache_leftpad`` (B,) on the
        device: each sequence's first valid key (its keys are entries ``[leftpad, L)``);
        ``cache_batch_idx`` (B,) on the device: the cache row each sequence reads (a contiguous
        cache). ``lengths``, the two and the page indices are clamped into the cache by the kernel.
        Returns ``(out, lse)`` with lse flat (B * H_q * N_q,), or the partial states, shaped.
        Without ``keep_lse`` (the caller drops lse), lse may be a view of the partial states'
        buffer (it would hold that buffer's memory while it lives)."""
        strides = self.strides
        if self.dtype != self.out_dtype:
            q, k_cache, v_cache = kernel_dtype(q, k_cache, v_cache)
            strides = self.kernel_strides(q, k_cache, v_cache)  # a copy may be denser
        if partials and self.empty:
            raise ValueError("partials need at least one query row (q has shape "
                             f"{tuple(q.shape)})")
        if self.empty or (max_len == 0 and not partials):
            # no sequence has a key: an empty sum, like scaled_dot_product_attention
            return (torch.zeros(self.out_shape, device=self.device, dtype=self.out_dtype),
                    torch.full(self.rows, float("-inf"), device=self.device, dtype=torch.float32))
        if num_splits is None:
            num_splits = self.num_splits(max_len, causal)
        final = num_splits == 1 and not partials
        n_rows, f32 = self.n_rows, torch.float32
        one = HOST["buffers"] == "one"
        lse_in_work = one and not (final or partials or keep_lse)
        out = None if partials else torch.empty(self.out_shape, device=self.device, dtype=self.dtype)
        lse = None if partials or lse_in_work else torch.empty(n_rows, device=self.device, dtype=f32)
        if final:
            o_part, lse_part = out, lse
        elif one:
            # O_s, LSE_s (and lse) in one allocation, each from a multiple of 16 bytes, so that
            # every call's pointers align as the first call's (Triton specialized on them)
            size_o, size_l = _round4(n_rows * num_splits * self.head_dim), _round4(n_rows * num_splits)
            work = torch.empty(size_o + size_l + lse_in_work * n_rows, device=self.device, dtype=f32)
            o_part, lse_part = work[:size_o], work[size_o:size_o + size_l]
            if lse_in_work:
                lse = work[size_o + size_l:]
        else:
            o_part = torch.empty(n_rows * num_splits * self.head_dim, device=self.device, dtype=f32)
            lse_part = torch.empty(n_rows * num_splits, device=self.device, dtype=f32)
        key = (num_splits, partials, lengths.data_ptr() % 16)
        # A window bounds the keys before each token (window >= 0) or, not causal, after it; an
        # unbounded side of a window is a bound past every key.
        windowed = window >= 0 or (not causal and window_right >= 0)
        unbounded = self.n_max + self.n_q
        win_left = window if window >= 0 else unbounded
        win_right = 0 if causal else (window_right if window_right >= 0 else unbounded)
        capped = softcap > 0
        # What Triton specializes on besides the plan's key: the block table's alignment (its
        # shape and strides are in the plan's key), the slopes' alignment and strides, and the
        # alignment of the left padding and of the cache rows (their dtypes are in the plan's key).
        stride_pb = block_table.stride(0) if self.paged else 0
        split_key = key + (capped, windowed, causal, self.paged and block_table.data_ptr() % 16,
                           None if cache_leftpad is None else cache_leftpad.data_ptr() % 16,
                           None if cache_batch_idx is None else cache_batch_idx.data_ptr() % 16)
        if alibi_slopes is not None:
            slopes = ScoreMods(alibi_slopes=alibi_slopes).kernel_args(self.n_q, self.n_max, False)
            stride_sb, stride_sh = slopes["stride_sb"], slopes["stride_sh"]
            split_key += (alibi_slopes.data_ptr() % 16, stride_sb, stride_sh)
        else:
            stride_sb = stride_sh = 0
        direct.launch(self.kernels, ("split",) + split_key, decode_split,
                      (self.row_blocks * num_splits, self.kv_heads, self.batch),
                      (q, k_cache, v_cache, lengths, o_part, lse_part, block_table if self.paged else None,
                       alibi_slopes, cache_leftpad, cache_batch_idx, *strides, stride_pb, stride_sb, stride_sh,
                       self.n_q, self.group, num_splits, qk_scale(scale), self.n_max,
                       float(softcap), int(win_left), int(win_right), self.n_pages, self.n_cache),
                      lambda: dict(HEAD_DIM=self.head_dim, BLOCK_D=self.block_d, BLOCK_R=self.block_r,
                                   FINAL=final, DOT_PRECISION=self.precision, SOFTCAP=capped,
                                   WINDOW=windowed, ALIBI=alibi_slopes is not None, PAGED=self.paged,
                                   PAGE_SIZE=self.page_size, CAUSAL=bool(causal),
                                   LEFTPAD=cache_leftpad is not None, CACHE_ROWS=cache_batch_idx is not None,
                                   **self.config),
                      HOST["launch"])
        if partials:
            return (o_part[:n_rows * num_splits * self.head_dim].view(*self.rows, num_splits, self.head_dim),
                    lse_part[:n_rows * num_splits].view(*self.rows, num_splits))
        if not final:
            direct.launch(self.kernels, ("merge",) + key, decode_merge, (n_rows,),
                          (o_part, lse_part, out, lse, num_splits),
                          lambda: dict(HEAD_DIM=self.head_dim, BLOCK_D=self.block_d,
                                       BLOCK_S=triton.next_power_of_2(num_splits)),
                          HOST["launch"])
        return (out if out.dtype == self.out_dtype else out.to(self.out_dtype)), lse
