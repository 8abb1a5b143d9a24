"""Which (query block, key block) tiles a kernel visits, and which of them need a mask.

The kernels compute these ranges themselves, on the device; these plain-Python twins use the very
same formulas so that the reference code, the pictures and the tests can talk about the traversal
without running a kernel. The tests check the twins against brute force, and the
references built on them against the kernels.

Causal masking is top-left aligned, like ``scaled_dot_product_attention``: query ``i`` sees keys
``0..i``. A tile is

* **full**    when every query in it sees every key in it: no mask, the fast path;
* **masked**  when some pairs are hidden (the causal diagonal) or fall past the end of the
  sequence (a ragged last block): the kernel applies an element-wise mask;
* **skipped** when no query in it sees any key in it: the kernel never loads it.
"""
import numpy as np

SKIPPED, MASKED, FULL = 0, 1, 2


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of size ``b`` cover ``a`` elements."""
    return -(-a // b)


def kv_ranges(q_start: int, block_q: int, block_kv: int, n_kv: int, is_causal: bool):
    """Keys visited by the query block starting at ``q_start`` (forward and dQ kernels).

    Returns ``(full_end, end)``: keys ``[0, full_end)`` come in whole blocks that need no mask;
    keys ``[full_end, end)`` need the mask; keys from ``end`` on are skipped.
    """
    if is_causal:
        end = min(q_start + block_q, n_kv)              # the last query of the block sees key q_start+block_q-1
        full_end = min(q_start, n_kv) // block_kv * block_kv  # every query of the block sees keys < q_start
    else:
        end = n_kv
        full_end = n_kv // block_kv * block_kv         # only a ragged last block needs a mask
    return full_end, end


def q_ranges(kv_start: int, block_kv: int, block_q: int, n_q: int, is_causal: bool):
    """Queries visited by the key block starting at ``kv_start`` (dK/dV kernel).

    Returns ``(start, full_start, full_end, end)``: queries ``[start, full_start)`` cross the causal
    diagonal (masked), ``[full_start, full_end)`` are whole blocks with no mask, ``[full_end, end)``
    is a ragged last block (masked). Queries before ``start`` see none of these keys.
    """
    if is_causal:
        start = kv_start
        full_start = kv_start + cdiv(block_kv, block_q) * block_q
    else:
        start = full_start = 0
    full_end = full_start + max(n_q - full_start, 0) // block_q * block_q
    return min(start, n_q), min(full_start, n_q), min(full_end, n_q), n_q


def classify_blocks(n_q: int, n_kv: int, block_q: int, block_kv: int, is_causal: bool) -> np.ndarray:
    """The forward kernel's map of tiles: an int array of shape (query blocks, key blocks) holding
    ``FULL``, ``MASKED`` or ``SKIPPED`` (see the module docstring)."""
    kinds = np.full((cdiv(n_q, block_q), cdiv(n_kv, block_kv)), SKIPPED, dtype=np.int8)
    for qb in range(kinds.shape[0]):
        full_end, end = kv_ranges(qb * block_q, block_q, block_kv, n_kv, is_causal)
        kinds[qb, : full_end // block_kv] = FULL
        kinds[qb, full_end // block_kv: cdiv(end, block_kv)] = MASKED
    return kinds


def classify_blocks_dkdv(n_q: int, n_kv: int, block_q: int, block_kv: int, is_causal: bool) -> np.ndarray:
    """The dK/dV kernel's map of tiles, from :func:`q_ranges`: an int array of shape (query
    blocks, key blocks) holding ``FULL``, ``MASKED`` or ``SKIPPED``.

    Each key block (a column) walks down the query blocks: the ones that cross the causal diagonal
    and a ragged last block are masked, the ones in between are full, those above are skipped.
    Under the causal mask the tiles must be ones the kernel takes (``configs.dkdv_steps_fit``)."""
    kinds = np.full((cdiv(n_q, block_q), cdiv(n_kv, block_kv)), SKIPPED, dtype=np.int8)
    for kb in range(kinds.shape[1]):
        start, full_start, full_end, end = q_ranges(kb * block_kv, block_kv, block_q, n_q, is_causal)
        for lo, hi, kind in ((start, full_start, MASKED), (full_start, full_end, FULL),
                             (full_end, end, MASKED)):
            kinds[lo // block_q: cdiv(hi, block_q), kb] = kind
    return kinds


def work_fraction(kinds: np.ndarray) -> float:
    """Fraction of all tiles that the kernel computes (full or masked)."""
    return float((kinds != SKIPPED).mean()) if kinds.size else 0.0


def decode_split_bounds(n_kv: int, n_q: int, num_splits: int, block_kv: int, causal: bool = True):
    """The keys each split of the decode kernel (``flashattn.decode``) reads, for a sequence whose
    cache holds ``n_kv`` keys, the last ``n_q`` of them new: a list of ``(lo, hi)``, one per split.

    Keys ``[0, n_seen)``, ``n_seen = n_kv - n_q + 1`` (causal; every key when not), are seen by
    every new token. They are cut into ``num_splits`` runs of whole tiles of ``block_kv`` keys;
    the last run that starts inside them also takes the keys only later tokens see, ``[n_seen,
    n_kv)``. So every split that has keys starts with a key all its rows see, and the splits past
    the end get none (``lo == hi``). With fewer keys than new tokens, the tokens before key 0 see
    none: the kernel masks them as if they sat at key 0, so ``n_seen`` is 1 and the first split
    takes every key.
    """
    n_seen = min(max(n_kv - n_q + 1, 1), n_kv) if causal else n_kv
    span = cdiv(cdiv(n_seen, block_kv), num_splits) * block_kv
    bounds = []
    for split in range(num_splits):
        lo = split * span
        hi = (lo + span if lo + span < n_seen else n_kv) if lo < n_seen else lo
        bounds.append((lo, hi))
    return bounds


# -- Sliding windows (``window_size``) ---------------------------------------------------------
# Query i sees key j iff j >= i - left (when left >= 0) and j <= i + right (when right >= 0), top-left
# aligned like the causal mask; is_causal adds j <= i. The kernels take both bounds as numbers >= 0:
# an unbounded side becomes a bound past every key.

def window_masking(is_causal: bool, window_size, span: int, bottom_right: bool = False):
    """How the kernels run ``is_causal`` with ``window_size = (left, right)``.

    Returns ``(causal, window, left, right)``: the kernels' IS_CAUSAL and WINDOW switches and the
    two bounds, both >= 0 (``span``, a number at least the longest distance between a query and a
    key, stands for "unbounded"). No bound at all is the dense path (``window`` False); a window
    that is just the causal mask takes the causal path; any other window sets ``window`` and folds
    is_causal into ``right = min(right, 0)``.

    ``bottom_right``: positions aligned bottom-right (query ``i`` at key position
    ``i + N_kv - N_q``). The kernels then shift both bounds by ``N_kv - N_q`` themselves
    (``BOTTOM_RIGHT``; per sequence for packed ones, :func:`aligned_bounds` in Python), so any
    bound at all takes the window path, whose tile ranges skip what the shifted window hides.
    """
    left, right = window_size
    if is_causal:
        right = 0
    if left < 0 and right < 0:
        return False, False, span, span
    if bottom_right:
        return False, True, (span if left < 0 else left), (span if right < 0 else right)
    if left < 0 and right == 0:
        return True, False, span, 0
    return False, True, (span if left < 0 else left), (span if right < 0 else right)


def aligned_bounds(left: int, right: int, n_q: int, n_kv: int):
    """The kernels' window bounds (from :func:`window_masking`) moved to the bottom-right
    alignment of a sequence of ``n_q`` queries and ``n_kv`` keys, as ``BOTTOM_RIGHT`` does in the
    kernels: query ``i`` sees key ``j`` iff ``i + shift - left <= j <= i + shift + right``,
    ``shift = n_kv - n_q``. The results may be negative; the ranges below take them."""
    shift = n_kv - n_q
    return left - shift, right + shift


def every_block_sees_keys(n_q: int, n_kv: int, left: int, right: int, block_q: int) -> bool:
    """Whether every block of ``block_q`` queries sees at least one key, query ``i`` seeing keys
    ``i - left .. i + right`` of ``0 .. n_kv - 1`` (bounds as the kernels take them: moved by
    :func:`aligned_bounds`, so either may be negative). The first block needs a key at or before
    ``block_q - 1 + right``, the last one a key at or after its first query minus ``left``; a
    block between sees a range as wide, moved between theirs, so it does too."""
    last_start = (n_q - 1) // block_q * block_q
    return n_kv > 0 and left + right >= 0 and block_q - 1 + right >= 0 and last_start - left <= n_kv - 1


def kv_window_ranges(q_start: int, block_q: int, block_kv: int, n_kv: int, left: int, right: int):
    """Keys visited by the query block starting at ``q_start`` under a window whose bounds
    ``left, right`` are >= 0 (the kernels' ``tiles.kv_window_bounds``, in plain Python).

    Returns ``(lo, full_lo, full_hi, hi)``: ``[lo, full_lo)`` and ``[full_hi, hi)`` are masked,
    ``[full_lo, full_hi)`` are whole tiles every query of the block sees, the rest are skipped.
    """
    lo = max(q_start - left, 0) // block_kv * block_kv
    hi = min(q_start + block_q + right, n_kv)
    full_lo = max(q_start + block_q - 1 - left + block_kv - 1, 0) // block_kv * block_kv
    full_hi = min(q_start + right + 1, n_kv) // block_kv * block_kv
    hi = max(hi, lo)  # a bound may be negative aligned bottom-right: an empty range, as the kernels
    full_lo = min(max(full_lo, lo), hi)
    return lo, full_lo, max(full_hi, full_lo), hi


def q_window_ranges(kv_start: int, block_kv: int, block_q: int, n_q: int, left: int, right: int):
    """Queries visited by the key block starting at ``kv_start`` under a window (the dK/dV kernel's
    ``tiles.q_window_bounds`` in plain Python). Returns ``(lo, full_lo, full_hi, hi)`` as
    :func:`kv_window_ranges` does, along the queries: the same ranges with the roles of queries and
    keys exchanged, the window reaching ``right`` queries back and ``left`` forward."""
    return kv_window_ranges(kv_start, block_kv, block_q, n_q, right, left)


def classify_blocks_window(n_q: int, n_kv: int, block_q: int, block_kv: int, left: int, right: int,
                           dkdv: bool = False) -> np.ndarray:
    """The map of tiles under a window (bounds >= 0, as :func:`window_masking` gives them): an int
    array of shape (query blocks, key blocks) holding ``FULL``, ``MASKED`` or ``SKIPPED``, for the
    forward and dQ kernels, or with ``dkdv`` for the dK/dV kernel."""
    kinds = np.full((cdiv(n_q, block_q), cdiv(n_kv, block_kv)), SKIPPED, dtype=np.int8)
    if dkdv:
        for kb in range(kinds.shape[1]):
            lo, full_lo, full_hi, hi = q_window_ranges(kb * block_kv, block_kv, block_q, n_q, left, right)
            for a, b, kind in ((lo, full_lo, MASKED), (full_lo, full_hi, FULL), (full_hi, hi, MASKED)):
                if b > a:
                    kinds[a // block_q: cdiv(b, block_q), kb] = kind
        return kinds
    for qb in range(kinds.shape[0]):
        lo, full_lo, full_hi, hi = kv_window_ranges(qb * block_q, block_q, block_kv, n_kv, left, right)
        for a, b, kind in ((lo, full_lo, MASKED), (full_lo, full_hi, FULL), (full_hi, hi, MASKED)):
            if b > a:
                kinds[qb, a // block_kv: cdiv(b, block_kv)] = kind
    return kinds
