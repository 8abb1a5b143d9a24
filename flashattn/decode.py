"""``flashattn.decode``: attention of new tokens against a KV cache, split-KV (flash-decoding).

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

Both kernels work in base 2 like the forward kernel (LSE = M + log2 L, scale x log2e folded into
exp2); the public ``lse`` is natural log, like ``torch.logsumexp``.
"""
import functools
import math
import numbers

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.compiler import CompiledKernel
from triton.knobs import HookChain

from . import tuning
from .tiles import qk_scale
from .forward import _fwd_inner
from .runtime import DEVICE, INTERPRET, RUNTIME, kernel_dtype
from .tiles import load_tile, store_tile

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LENGTH_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256
MAX_GRID_DIM = 65535      # CUDA's limit on grid axes 1 and 2 (KV heads, batch)
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


@triton.jit(do_not_specialize=["n_q", "group", "num_splits"])  # one binary for every length
def _decode_split(Q, K, V, LENS, O, LSE,
                  stride_qb, stride_qh, stride_qn, stride_qd,
                  stride_kb, stride_kh, stride_kn, stride_kd,
                  stride_vb, stride_vh, stride_vn, stride_vd,
                  n_q, group, num_splits, qk_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_KV: tl.constexpr, FINAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Grid: axis 0 = (row block, split), axis 1 = KV heads, axis 2 = batch.
    split = tl.program_id(0) % num_splits
    row_block = tl.program_id(0) // num_splits
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    n_kv = tl.load(LENS + batch).to(tl.int32)  # this sequence's cache length L

    # Row r of the tile is new token t = r % n_q of query head kv_head * group + r // n_q.
    n_rows = group * n_q
    offs_r = row_block * BLOCK_R + tl.arange(0, BLOCK_R)
    t = offs_r % n_q
    offs_d = tl.arange(0, BLOCK_D)
    Q += batch.to(tl.int64) * stride_qb + (kv_head * group).to(tl.int64) * stride_qh
    row_offsets = (offs_r // n_q) * stride_qh + t * stride_qn
    q_ptrs = Q + row_offsets[:, None] + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=(offs_r[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    # The new tokens are the last n_q of the cache: token t sits at position L - n_q + t and sees
    # keys 0 .. L - n_q + t (bottom-right alignment), the causal mask of the forward kernel.
    pos = n_kv - n_q + t

    # Keys [0, n_seen) are seen by every row. They are cut into num_splits runs of whole tiles,
    # and the last run also takes the keys only later tokens see, [n_seen, L). So every split
    # starts with a key that all its rows see, and -inf masks stay safe as in the forward kernel.
    # Splits past the end (a short sequence, or L = 0) get no keys.
    n_seen = tl.maximum(n_kv - n_q + 1, 0)
    span = tl.cdiv(tl.cdiv(n_seen, BLOCK_KV), num_splits) * BLOCK_KV
    kv_lo = split * span
    kv_hi = tl.where(kv_lo + span < n_seen, kv_lo + span, n_kv)
    kv_hi = tl.where(kv_lo < n_seen, kv_hi, kv_lo)
    # Only the tiles from the last whole tile of [0, n_seen) on need the mask.
    kv_full_end = tl.minimum(tl.maximum(n_seen // BLOCK_KV * BLOCK_KV, kv_lo), kv_hi)

    K += batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    V += batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    # The forward kernel's inner loop, unchanged: whole tiles without a mask, then the diagonal
    # (where keys past a row's position, and past L, are hidden; keys >= L are never loaded).
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                               pos, offs_d, kv_lo, kv_full_end, n_kv, qk_scale,
                               HEAD_DIM, BLOCK_D, BLOCK_KV, False, True, DOT_PRECISION)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                               pos, offs_d, kv_full_end, kv_hi, n_kv, qk_scale,
                               HEAD_DIM, BLOCK_D, BLOCK_KV, True, True, DOT_PRECISION)

    # A split without keys has L = 0: it writes the neutral state O = 0, LSE = -inf, which
    # weighs nothing in the merge (and is the answer for L = 0: an empty sum, like SDPA).
    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
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
def _decode_merge(O_PART, LSE_PART, O, LSE, num_splits,
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
                   partials=False):
    """Launch the decode kernels on checked arguments: ``q`` (B, H_q, N_q, D), caches (B, H_kv,
    N_max, D) of any strides, ``lengths`` an int32/int64 tensor (B,) on the device, ``max_len``
    its largest value. ``num_splits`` and ``config`` (BLOCK_KV, num_warps, num_stages) default to
    the heuristic and tuning.decode_config. Returns ``(out, lse)``, lse in natural log.

    With ``partials``, the merge is not run: returns the split kernel's partial states instead,
    ``o_part`` (B, H_q, N_q, num_splits, D) and ``lse_part`` (B, H_q, N_q, num_splits), float32,
    each O_s divided by its own sum and LSE_s in base 2 (-inf for a split without keys)."""
    plan = _Plan(q, k_cache, v_cache, config)
    out, lse = plan.run(q, k_cache, v_cache, lengths, max_len, scale, num_splits, partials)
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
_HOST = dict(launch="launcher", lengths="pageable", buffers="separate")
HOST_CHOICES = dict(launch=("jit", "compiled", "launcher"), lengths=("pinned", "pageable"),
                    buffers=("separate", "one"))


def _set_host(**settings):
    """Change some of ``_HOST`` (the benchmark's switch); returns the settings before."""
    for name, value in settings.items():
        if value not in HOST_CHOICES.get(name, ()):
            raise ValueError(f"decode's host setting {name}={value!r}: expected one of "
                             f"{HOST_CHOICES.get(name, ())} for one of {tuple(HOST_CHOICES)}")
    before = dict(_HOST)
    _HOST.update(settings)
    return before


def _round4(n):
    return (n + 3) // 4 * 4  # float32 elements to a multiple of 16 bytes


class _Plan:
    """What decode decides from the shapes, strides and dtypes alone (tile sizes, configuration,
    the split heuristic's inputs, the kernels' fixed arguments), and the kernels compiled for
    them, launched directly after the first launch through Triton's JIT (see ``_launch``)."""

    def __init__(self, q, k_cache, v_cache, config=None):
        batch, n_heads, n_q, head_dim = q.shape
        self.batch, self.n_heads, self.n_q, self.head_dim = batch, n_heads, n_q, head_dim
        self.kv_heads, self.n_max = k_cache.shape[1], k_cache.shape[2]
        self.group = n_heads // self.kv_heads
        self.rows = (batch, n_heads, n_q)
        self.n_rows = batch * n_heads * n_q
        self.out_shape = (batch, n_heads, n_q, head_dim)
        self.device, self.out_dtype = q.device, q.dtype
        # the dtype the kernels read and write: float32 for bfloat16 where runtime.kernel_dtype
        # says so (the interpreter, GPUs before sm_80)
        self.dtype = dtype = kernel_dtype(q)[0].dtype
        self.strides = (*q.stride(), *k_cache.stride(), *v_cache.stride())  # kept in the plan's key
        n_rows = self.group * n_q
        # tl.dot needs at least 16 rows
        self.block_r = min(max(16, triton.next_power_of_2(n_rows)), max_block_r(q.dtype))
        self.row_blocks = _cdiv(n_rows, self.block_r)
        self.precision = tuning.decode_precision(dtype)
        self.block_d = tuning.block_d(head_dim)
        self.config = dict(config or tuning.decode_config(dtype, self.precision, self.block_r,
                                                          self.block_d))
        self.scale = 1.0 / math.sqrt(head_dim)
        self.empty = self.n_rows * head_dim == 0
        self.kernels = {}  # (kernel, num_splits, partials, lengths' alignment) -> _Compiled

    def num_splits(self, max_len):
        return choose_num_splits(self.batch * self.kv_heads * self.row_blocks, max_len - self.n_q + 1,
                                 self.config["BLOCK_KV"], sm_count(self.device))

    def run(self, q, k_cache, v_cache, lengths, max_len, scale, num_splits=None, partials=False,
            keep_lse=True):
        """The launches, on arguments of this plan's shapes, dtypes, strides and alignment.
        Returns ``(out, lse)`` with lse flat (B * H_q * N_q,), or the partial states, shaped.
        Without ``keep_lse`` (the caller drops lse), lse may be a view of the partial states'
        buffer (it would hold that buffer's memory while it lives)."""
        strides = self.strides
        if self.dtype != self.out_dtype:
            q, k_cache, v_cache = kernel_dtype(q, k_cache, v_cache)
            strides = (*q.stride(), *k_cache.stride(), *v_cache.stride())  # a copy may be denser
        if partials and self.empty:
            raise ValueError("partials need at least one query row (q has shape "
                             f"{tuple(q.shape)})")
        if self.empty or (max_len == 0 and not partials):
            # no sequence has a key: an empty sum, like scaled_dot_product_attention
            return (torch.zeros(self.out_shape, device=self.device, dtype=self.out_dtype),
                    torch.full(self.rows, float("-inf"), device=self.device, dtype=torch.float32))
        if num_splits is None:
            num_splits = self.num_splits(max_len)
        final = num_splits == 1 and not partials
        n_rows, f32 = self.n_rows, torch.float32
        one = _HOST["buffers"] == "one"
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
        _launch(self.kernels, ("split",) + key, _decode_split,
                (self.row_blocks * num_splits, self.kv_heads, self.batch),
                (q, k_cache, v_cache, lengths, o_part, lse_part, *strides,
                 self.n_q, self.group, num_splits, qk_scale(scale)),
                lambda: dict(HEAD_DIM=self.head_dim, BLOCK_D=self.block_d, BLOCK_R=self.block_r,
                             FINAL=final, DOT_PRECISION=self.precision, **self.config))
        if partials:
            return (o_part[:n_rows * num_splits * self.head_dim].view(*self.rows, num_splits, self.head_dim),
                    lse_part[:n_rows * num_splits].view(*self.rows, num_splits))
        if not final:
            _launch(self.kernels, ("merge",) + key, _decode_merge, (n_rows,),
                    (o_part, lse_part, out, lse, num_splits),
                    lambda: dict(HEAD_DIM=self.head_dim, BLOCK_D=self.block_d,
                                 BLOCK_S=triton.next_power_of_2(num_splits)))
        return (out if out.dtype == self.out_dtype else out.to(self.out_dtype)), lse


class _Compiled:
    """A kernel Triton compiled at a first launch, and what its later launches need."""

    __slots__ = ("runner", "launcher", "function", "metadata", "grid", "constants", "constexprs",
                 "stream", "device")

    def __init__(self, fn, kernel, grid, n_args, constexprs):
        from triton.runtime import driver

        grid = (*grid, 1, 1)[:3]  # the compiled kernel takes a 3-D grid
        self.grid, self.constexprs = grid, constexprs
        # ... and every argument in order, the compile-time ones too
        self.constants = tuple(constexprs[name] for name in fn.arg_names[n_args:])
        self.runner = kernel[grid]  # CompiledKernel[grid]
        self.launcher, self.function, self.metadata = kernel.run, kernel.function, kernel.packed_metadata
        # what Triton's JIT launches on: the current device's current stream (the device is in
        # the plan's key)
        self.stream, self.device = driver.active.get_current_stream, driver.active.get_current_device()


def _no_launch_hooks():
    """Whether no Triton launch hook is registered (they are chains, empty unless a profiler or
    the user adds one)."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and (type(hook) is not HookChain or hook.calls):
            return False
    return True


def _launch(kernels, key, fn, grid, args, constexprs):
    """``fn[grid](*args, **constexprs())``. The first launch for ``key`` goes through Triton's JIT,
    which binds the arguments, works out their specialization (dtypes, 16-byte alignment of the
    pointers, integers equal to 1, divisible by 16 or past 32 bits), finds or compiles the kernel
    and launches it: 5 to 12 us of Python per launch of these kernels. Later launches go as
    ``_HOST["launch"]`` says; the direct ones are sound because nothing the specialization reads
    can change under the same key: the plan's key holds the inputs' shapes, strides, dtypes and
    alignment, ``key`` the split count and the lengths' alignment, and the outputs are fresh
    allocations (aligned to 512 bytes) or views at fixed offsets of one."""
    launch = kernels.get(key)
    if launch is None:
        constexprs = constexprs()
        kernel = fn[grid](*args, **constexprs)
        if isinstance(kernel, CompiledKernel):  # the interpreter returns no compiled kernel
            kernels[key] = _Compiled(fn, kernel, grid, len(args), constexprs)
        return
    how = _HOST["launch"]
    if how == "launcher" and _no_launch_hooks():
        # Triton's JIT calls the launcher so, with launch metadata and hooks instead of the Nones
        launch.launcher(*launch.grid, launch.stream(launch.device), launch.function, launch.metadata,
                        None, None, None, *args, *launch.constants)
    elif how == "jit":
        fn[grid](*args, **launch.constexprs)
    else:
        launch.runner(*args, *launch.constants)


#: decode's plans: (the arguments' shapes, strides, dtypes, devices, alignment) -> _Plan. An entry
#: means the checks that read nothing else (``_check_tensors``) passed for such arguments.
_PLANS = {}
MAX_PLANS = 64  # a loop that changes shapes every step starts afresh now and then


def decode(q, k_cache, v_cache, cache_seqlens, scale=None, return_lse=False):
    """Attention of the newest ``N_q`` tokens of each sequence against its KV cache.

    Args:
        q: the new tokens' queries, ``(B, H_q, N_q, D)``; N_q is usually 1.
        k_cache, v_cache: ``(B, H_kv, N_max, D)``, any strides (a ``(B, N_max, H_kv, D)`` cache
            transposed works as is). ``H_q`` must be a multiple of ``H_kv``: query head ``h``
            uses KV head ``h // (H_q / H_kv)`` (grouped-query attention, as SDPA's enable_gqa).
        cache_seqlens: integer tensor ``(B,)`` (int32 or int64) of valid lengths ``L``, with
            ``N_q <= L <= N_max``, or ``L = 0`` for an empty sequence (its output is 0 and its
            lse -inf, the empty sum, like SDPA with no keys). Entries at or past ``L`` are never
            read: they may hold anything, NaN included.
        scale: the factor applied to ``q @ k^T``; defaults to ``1 / sqrt(D)``.
        return_lse: also return the log-sum-exp of each row of scaled scores.

    The new tokens are the last ``N_q`` entries of each valid cache, so token ``t`` sees keys
    ``0 .. L - N_q + t`` (aligned bottom-right, as in decoding and speculative decoding).

    Returns:
        ``out`` of shape ``(B, H_q, N_q, D)`` in q's dtype, or ``(out, lse)`` with ``lse`` of shape
        ``(B, H_q, N_q)``, float32, natural log.

    Checking the lengths reads them on the host. Pass ``cache_seqlens`` on the CPU (generation
    loops usually know the lengths there): it is checked there and copied to the GPU without
    waiting. On the GPU, checking costs one synchronisation per call. Either way the lengths are
    read anew at every call, so decode cannot be captured in a CUDA graph (it says so).

    A decoding step is short (tens of microseconds on a GPU), so decode keeps its host work
    small: what depends only on the arguments' shapes, dtypes, strides and devices (their checks,
    the tile sizes, the compiled kernels) is worked out at their first call and remembered.

    decode is forward only: it has no backward. Rather than return a result that silently cuts
    the autograd graph, it raises a ValueError when gradients are enabled and an input requires
    grad. Under ``torch.no_grad()`` or ``torch.inference_mode()``, as generation runs, the same
    inputs are fine and the result does not require grad.
    """
    key = _plan_key(q, k_cache, v_cache, cache_seqlens)
    plan = _PLANS.get(key)
    if plan is None:  # the first call with such arguments: check them, then plan
        _check_tensors(q, k_cache, v_cache, cache_seqlens)
        plan = _Plan(q, k_cache, v_cache)
        if key is not None:
            if len(_PLANS) >= MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
    _check_call(q, k_cache, v_cache, scale, return_lse)
    if not INTERPRET and torch.cuda.is_current_stream_capturing():
        raise ValueError("flashattn.decode reads cache_seqlens on the host at every call, so it "
                         "cannot be captured in a CUDA graph (the graph would replay the lengths "
                         "of the capture)")
    lengths, max_len = _lengths(cache_seqlens, plan.n_max, plan.n_q, plan.device)
    out, lse = plan.run(q, k_cache, v_cache, lengths, max_len,
                        plan.scale if scale is None else float(scale), keep_lse=return_lse)
    return (out, lse.view(plan.rows)) if return_lse else out


def _plan_key(q, k_cache, v_cache, cache_seqlens):
    """Everything ``_check_tensors`` and ``_Plan`` read, and everything Triton specializes the
    kernels on (pointer alignment, strides), besides the length values. None (never a plan's key)
    for arguments that are not all tensors with memory: the checks then run and say what is wrong."""
    if not (isinstance(q, torch.Tensor) and isinstance(k_cache, torch.Tensor)
            and isinstance(v_cache, torch.Tensor) and isinstance(cache_seqlens, torch.Tensor)):
        return None
    try:
        return (q.shape, q.stride(), q.dtype, q.device, q.data_ptr() % 16,
                k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device, k_cache.data_ptr() % 16,
                v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device, v_cache.data_ptr() % 16,
                cache_seqlens.shape, cache_seqlens.dtype, cache_seqlens.device,
                torch.get_float32_matmul_precision(),  # float32's dot precision (TF32 or not)
                None if INTERPRET else torch.cuda.current_device())  # where the kernels are loaded
    except RuntimeError:  # a tensor without memory (data_ptr() refuses)
        return None


def _lengths(cache_seqlens, n_max, n_q, device):
    """Check the length values on the host; return the lengths on ``device`` and the largest."""
    on_host = cache_seqlens.is_cpu
    host = cache_seqlens if on_host else cache_seqlens.cpu()  # the one synchronisation
    count = host.numel()
    if count == 0:
        return cache_seqlens, 0
    if count <= 64:  # a few lengths: quicker as a list than through torch.aminmax
        values = host.tolist()
        low, high = min(values), max(values)
    else:
        low, high = (int(x) for x in torch.aminmax(host))
    if low < 0 or high > n_max or (n_q > 1 and low < n_q and ((host > 0) & (host < n_q)).any()):
        bad = ((host < 0) | (host > n_max) | ((host > 0) & (host < n_q))).nonzero()[0, 0].item()
        raise ValueError(f"cache_seqlens[{bad}] is {host[bad].item()}; each length must be 0 (an "
                         f"empty sequence) or from N_q = {n_q} (the new tokens are the last N_q "
                         f"entries of the cache) to N_max = {n_max} (the caches' dim 2)")
    if on_host and device.type == "cuda":
        # non_blocking: the copy does not wait for the GPU's queued work (from pageable memory,
        # CUDA stages the few bytes before the call returns; see _HOST)
        host = host.contiguous()
        if _HOST["lengths"] == "pinned":
            host = host.pin_memory()
        return host.to(device, non_blocking=True), high
    return cache_seqlens.contiguous(), high


def _check_tensors(q, k_cache, v_cache, cache_seqlens):
    """Raise TypeError or ValueError naming the argument and what was expected: the checks that
    read only the tensors' types, dtypes, shapes, strides and devices (what ``_plan_key`` holds)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; expected torch.float16, torch.bfloat16 "
                            "or torch.float32")
        if t.dim() != 4:
            shape = "(B, H_q, N_q, D)" if name == "q" else "(B, H_kv, N_max, D)"
            raise ValueError(f"{name} must have 4 dims {shape}; got shape {tuple(t.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; all three must match")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all three must be "
                             "on the same device")
    if q.device.type != DEVICE.type:
        where = "a CUDA GPU" if DEVICE.type == "cuda" else "the CPU (Triton's interpreter)"
        raise ValueError(f"q is on {q.device}, but flashattn runs on {where} here: pass tensors "
                         f"on {DEVICE.type} (flashattn.RUNTIME is {RUNTIME!r})")
    batch, n_heads, _, head_dim = q.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)} but k_cache has "
                         f"{tuple(k_cache.shape)}; they must be equal")
    if k_cache.shape[0] != batch:
        raise ValueError(f"k_cache has batch {k_cache.shape[0]} but q has {batch}; "
                         "they must be equal")
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache has head dim {k_cache.shape[3]} but q has {head_dim}; "
                         "they must be equal")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim (last dim of q and the caches) is {head_dim}; expected 1 to "
                         f"{MAX_HEAD_DIM}")
    kv_heads = k_cache.shape[1]
    if kv_heads == 0 or n_heads % kv_heads:
        raise ValueError(f"q has {n_heads} heads and k_cache {kv_heads}; the query heads must be "
                         "a multiple of the KV heads (each KV head serves H_q / H_kv query heads)")
    if batch > MAX_GRID_DIM or kv_heads > MAX_GRID_DIM:
        raise ValueError(f"batch {batch} and KV heads {kv_heads} must each be at most "
                         f"{MAX_GRID_DIM} (CUDA's grid limit)")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        span = (t.shape[2] - 1) * abs(t.stride(2)) + (head_dim - 1) * abs(t.stride(3))
        if t.shape[2] and span >= 2**31:
            raise ValueError(f"{name}: one (batch, head) spans 2**31 elements or more (strides "
                             f"{t.stride()}); the kernel indexes within a head in 32 bits")
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be a torch.Tensor of int32 or int64, got "
                        f"{type(cache_seqlens).__name__}")
    if cache_seqlens.dtype not in LENGTH_DTYPES:
        raise TypeError(f"cache_seqlens has dtype {cache_seqlens.dtype}; expected torch.int32 or "
                        "torch.int64")
    if cache_seqlens.shape != (batch,):
        raise ValueError(f"cache_seqlens has shape {tuple(cache_seqlens.shape)}; expected "
                         f"({batch},), one length per sequence of q")
    if cache_seqlens.device not in (q.device, torch.device("cpu")):
        raise ValueError(f"cache_seqlens is on {cache_seqlens.device}; expected {q.device} (like "
                         "q) or the CPU")


def _check_call(q, k_cache, v_cache, scale, return_lse):
    """The checks of every call: the grad mode, ``scale`` and ``return_lse``."""
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad):
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if t.requires_grad:
                raise ValueError(f"{name} requires grad, but decode is forward only (no backward): "
                                 "call it under torch.no_grad() or torch.inference_mode(), or pass "
                                 f"{name}.detach()")
    if return_lse is not True and return_lse is not False:
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale must be a finite positive number, got {scale}")
