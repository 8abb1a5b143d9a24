"""Checkers of chapter 10: the grouped-query index map, the key range of a query block under a
sliding window, and the program table of a packed variable-length batch.

Each draws its own cases, compares with the definition, and when an answer is wrong names the slip
it matches on every case (a model of each slip is computed here), or says where it first differs.
"""
import torch

from .common import ExerciseError, attempt, passed

# --- Exercise 1: which KV head a query head reads --------------------------------------------------


def _kv_heads(n_q_heads, n_kv_heads, slip=None):
    h = torch.arange(n_q_heads)
    if slip == "modulo":
        return h % n_kv_heads
    if slip == "by kv heads":
        return h // n_kv_heads
    return h // (n_q_heads // n_kv_heads)


KV_MAP_SLIPS = {
    "modulo": "query heads are dealt out round-robin (h % H_kv), but a group is G = H_q / H_kv "
              "CONSECUTIVE query heads, as repeat_interleave and SDPA's enable_gqa lay them out",
    "by kv heads": "divided by H_kv, the number of KV heads; divide by the group size G = H_q / H_kv",
}


def check_kv_head_map(kv_head_map):
    """``kv_head_map(n_q_heads, n_kv_heads)`` must return an integer tensor of length ``n_q_heads``
    whose entry h is the KV head that query head h reads, h // (n_q_heads // n_kv_heads), and raise
    ValueError when n_kv_heads does not divide n_q_heads."""
    name = getattr(kv_head_map, "__name__", "kv_head_map")
    cases = [(8, 8), (32, 8), (8, 1), (12, 4), (6, 2), (1, 1), (16, 2)]
    for n_q, n_kv in cases:
        out = attempt(kv_head_map, n_q, n_kv, name=name, forbid=("flashattn",))
        try:
            got = torch.as_tensor(out)
        except Exception:
            raise ExerciseError(f"{name}({n_q}, {n_kv}) returned {type(out).__name__}, not a tensor of "
                                "integers") from None
        if got.dtype.is_floating_point or got.dtype == torch.bool:
            raise ExerciseError(f"{name}({n_q}, {n_kv}) returned {got.dtype} values: head indices are "
                                "integers (torch.long), usable with index_select")
        if tuple(got.shape) != (n_q,):
            raise ExerciseError(f"{name}({n_q}, {n_kv}) returned shape {tuple(got.shape)}; expected ({n_q},): "
                                "one KV head per query head")
        want = _kv_heads(n_q, n_kv)
        if torch.equal(got.long(), want):
            continue
        for slip, hint in KV_MAP_SLIPS.items():
            wrong = _kv_heads(n_q, n_kv, slip)
            if torch.equal(got.long(), wrong):
                raise ExerciseError(f"{name}({n_q}, {n_kv}) is wrong: {hint}.")
        h = int((got.long() != want).nonzero()[0])
        raise ExerciseError(f"{name}({n_q}, {n_kv}): query head {h} gets KV head {int(got[h])}, which is not "
                            f"the KV head of its group of {n_q // n_kv} consecutive query heads.")
    for n_q, n_kv in [(6, 4), (8, 3), (4, 8)]:
        try:
            out = kv_head_map(n_q, n_kv)
        except ValueError:
            continue
        except NotImplementedError:
            raise ExerciseError(f"{name} is not implemented yet") from None
        except Exception as error:
            raise ExerciseError(f"{name}({n_q}, {n_kv}) raised {type(error).__name__}: raise ValueError "
                                "(naming the head counts) when H_kv does not divide H_q") from None
        raise ExerciseError(f"{name}({n_q}, {n_kv}) returned a map: with {n_kv} KV heads for {n_q} query "
                            "heads the groups cannot be equal; raise ValueError when H_q % H_kv != 0.")
    passed(f"{name} maps query head h to KV head h // (H_q / H_kv) for {len(cases)} head counts, and "
           "refuses head counts that do not divide")


# --- Exercise 2: the key range of a query block under a sliding window -----------------------------

WINDOW_SLIPS = {
    "left off by one": "the left edge is off by one: query i sees key i - left itself "
                       "(j >= i - left, inclusive)",
    "right off by one": "hi is one key short: the last query of the block, q_start + block_q - 1, "
                        "sees key q_start + block_q - 1 + right itself, so hi is one past it",
    "lo from last query": "lo is computed from the LAST query of the block; the FIRST one, q_start, "
                          "reaches furthest to the left",
    "hi from first query": "hi is computed from the FIRST query of the block; the LAST one, "
                           "q_start + block_q - 1, reaches furthest to the right",
    "no causal": "the causal mask is forgotten: with is_causal no query sees a key after itself, so "
                 "hi is at most q_start + block_q, whatever the window's right edge",
    "swapped": "left and right are swapped: window_size = (left, right), left bounds the keys BEFORE "
               "the query (j >= i - left), right those AFTER it (j <= i + right)",
    "minus one": "-1 is taken as a number: window_size -1 means no bound on that side",
    "minus one left": "-1 is taken as a number for left: window_size -1 means no bound on that side",
    "minus one right": "-1 is taken as a number for right: window_size -1 means no bound on that side",
    "not aligned": "lo is not the start of a key block: round it down to a multiple of block_kv "
                   "(the kernel loads whole tiles and masks the keys outside the window)",
    "not clamped": "the range runs outside the keys: clamp lo at 0 and hi at n_kv",
}


def _window_range(q_start, block_q, block_kv, n_kv, window_size, is_causal, slip=None):
    """(lo, hi) keys, as the definition gives them (``slip`` None) or as a slip computes them."""
    left, right = window_size
    if slip == "swapped":
        left, right = right, left
    first, last = q_start, q_start + block_q - 1
    if slip == "lo from last query":
        first = last
    if slip == "hi from first query":
        last = first
    lo = 0 if (left < 0 and slip not in ("minus one", "minus one left")) else first - left + (slip == "left off by one")
    reach = n_kv if (right < 0 and slip not in ("minus one", "minus one right")) else right
    if is_causal and slip != "no causal":
        reach = min(reach, 0)
    hi = last + reach + 1 - (slip == "right off by one")
    if slip != "not clamped":
        lo, hi = max(lo, 0), min(hi, n_kv)
    if lo >= hi:
        return lo, hi  # no query of the block sees a key: nothing to visit
    if slip != "not aligned":
        lo = lo // block_kv * block_kv
    return lo, hi


def _window_cases():
    cases = []
    windows = [(-1, -1), (-1, 0), (8, 0), (20, 0), (0, 0), (16, 16), (5, 30), (30, 5), (0, -1), (-1, 7),
               (100, 3), (33, 0)]
    for n_q, n_kv in [(64, 64), (100, 100), (37, 90), (90, 37)]:
        for block_q, block_kv in [(16, 16), (32, 16), (16, 32), (64, 16)]:
            for window in windows:
                for causal in (False, True):
                    for q_start in range(0, n_q, block_q):
                        cases.append((q_start, block_q, block_kv, n_kv, window, causal))
    return cases


def _blocks(lo, hi, block_kv):
    """The key blocks a loop ``for start in range(lo, hi, block_kv)`` visits, as (first, end)."""
    return None if hi <= lo else (lo // block_kv, -(-hi // block_kv))


def _describe(case):
    q_start, block_q, block_kv, n_kv, window, causal = case
    return (f"q_start={q_start}, block_q={block_q}, block_kv={block_kv}, n_kv={n_kv}, window_size={window}, "
            f"is_causal={causal}")


def check_window_kv_range(window_kv_range):
    """``window_kv_range(q_start, block_q, block_kv, n_kv, window_size, is_causal)`` must return the
    keys ``(lo, hi)`` the program of the query block starting at ``q_start`` loops over: lo the
    first key of the first key block holding a key some query of the block sees, hi one past the
    last such key (or any point in the last visited block, not past n_kv); lo >= hi when the block
    sees no key. Every query of the block counts, padding rows included (chapter 03)."""
    name = getattr(window_kv_range, "__name__", "window_kv_range")
    cases = _window_cases()
    got = []
    for case in cases:
        out = attempt(window_kv_range, *case, name=name, forbid=("flashattn",))
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ExerciseError(f"{name} should return a pair (lo, hi), got {type(out).__name__} ({_describe(case)})")
        try:
            lo, hi = (int(x) for x in out)
        except Exception:
            raise ExerciseError(f"{name} should return two integers (lo, hi), got {out!r}") from None
        got.append((lo, hi))
    wrong = [n for n, (case, (lo, hi)) in enumerate(zip(cases, got))
             if not _ok(lo, hi, case)]
    if not wrong:
        passed(f"{name} gives the tightest key range on {len(cases)} query blocks: windows bounded on one "
               "side, both or neither, causal or not, ragged lengths, N_q != N_kv")
        return
    for slip, hint in WINDOW_SLIPS.items():
        models = [_window_range(*case, slip=slip) for case in cases]
        if all(_same(g, m, case) for g, m, case in zip(got, models, cases)) and \
                any(not _ok(*m, case) for m, case in zip(models, cases)):
            case = cases[wrong[0]]
            raise ExerciseError(f"{name} is wrong: {hint} (e.g. {_describe(case)}: you return {got[wrong[0]]}).")
    n = wrong[0]
    case, (lo, hi) = cases[n], got[n]
    want = _window_range(*case)
    block_kv, n_kv = case[2], case[3]
    if hi > lo and (lo < 0 or hi > n_kv):
        raise ExerciseError(f"{name}: ({lo}, {hi}) runs outside the keys 0..{n_kv - 1} ({_describe(case)}).")
    if hi > lo and lo % block_kv:
        raise ExerciseError(f"{name}: lo = {lo} is not the start of a key block of {block_kv} "
                            f"({_describe(case)}).")
    if want[1] <= want[0]:
        raise ExerciseError(f"{name}: no query of this block sees any key, so nothing should be visited "
                            f"(lo >= hi); you return ({lo}, {hi}) ({_describe(case)}).")
    if hi <= lo:
        raise ExerciseError(f"{name}: you visit nothing, but some queries of the block see keys "
                            f"({_describe(case)}).")
    mine, right = _blocks(lo, hi, block_kv), _blocks(*want, block_kv)
    if mine[0] > right[0] or mine[1] < right[1]:
        raise ExerciseError(f"{name}: key blocks {right[0]}..{right[1] - 1} hold keys the block sees; you visit "
                            f"{mine[0]}..{mine[1] - 1} ({_describe(case)}).")
    raise ExerciseError(f"{name}: you visit key blocks {mine[0]}..{mine[1] - 1}, but only {right[0]}..{right[1] - 1} "
                        f"hold keys the block sees: the others should be skipped ({_describe(case)}).")


def _ok(lo, hi, case):
    """Is (lo, hi) a right answer: lo exact, hi anywhere in the last visited block, not past n_kv."""
    want = _window_range(*case)
    block_kv, n_kv = case[2], case[3]
    if want[1] <= want[0]:
        return hi <= lo
    return lo == want[0] and want[1] <= hi <= min(n_kv, -(-want[1] // block_kv) * block_kv)


def _same(got, model, case):
    """Does the learner's (lo, hi) visit what the slip's model visits (the same lo, and the same
    key blocks; both empty counts as the same)?"""
    block_kv = case[2]
    if got[1] <= got[0] or model[1] <= model[0]:
        return (got[1] <= got[0]) == (model[1] <= model[0])
    return got[0] == model[0] and _blocks(*got, block_kv) == _blocks(*model, block_kv) and \
        (got[1] <= case[3]) == (model[1] <= case[3])


# --- Exercise 3: the program table of a packed batch ----------------------------------------------

def _programs(cu_seqlens, block_q, slip=None):
    cu = [int(x) for x in cu_seqlens]
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    if slip == "packed":
        return [(max(b for b in range(len(lengths)) if cu[b] <= start), start)
                for start in range(0, cu[-1], block_q)]
    rows = []
    for b, n in enumerate(lengths):
        blocks = {"floor": n // block_q, "empty": max(1, -(-n // block_q)),
                  "padded": -(-max(lengths) // block_q)}.get(slip, -(-n // block_q))
        base = {"relative": 0, "next": cu[b + 1]}.get(slip, cu[b])
        rows += [(b, base + k * block_q) for k in range(blocks)]
    return rows


VARLEN_SLIPS = {
    "packed": "the packed rows are cut into blocks as one long sequence, so a block crosses from one "
              "sequence into the next: cut each sequence on its own, from cu_seqlens[b]",
    "floor": "the ragged last block of a sequence is missing: sequence b needs "
             "cdiv(length_b, block_q) blocks, not length_b // block_q",
    "empty": "an empty sequence (length 0) got a program: it has no query block",
    "padded": "every sequence gets as many blocks as the LONGEST one: that is the padded grid; "
              "sequence b needs only cdiv(length_b, block_q)",
    "relative": "the row offsets count from the start of each sequence; the table holds packed rows, "
                "cu_seqlens[b] + k * block_q",
    "next": "sequence b's rows start at cu_seqlens[b], not cu_seqlens[b + 1]",
}


def _varlen_cases():
    g = torch.Generator().manual_seed(9)
    cases = [([5], 16), ([16, 16], 16), ([3, 17, 0, 70, 1], 16), ([0, 0, 9], 32), ([64, 1, 33, 129], 32),
             ([100], 64), ([7, 0], 16)]
    for seed in range(3):
        lengths = torch.randint(0, 150, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        cases.append((lengths, (16, 32, 64)[seed]))
    out = []
    for lengths, block_q in cases:
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
        out.append((cu, block_q))
    return out


def check_varlen_programs(varlen_programs):
    """``varlen_programs(cu_seqlens, block_q)`` must return an int32 tensor of shape (programs, 2):
    one row ``(b, start)`` per query block of each sequence, sequences in order and blocks in order,
    ``start = cu_seqlens[b] + k * block_q`` the block's first packed row, for k < cdiv(length_b,
    block_q); an empty sequence gets no row."""
    name = getattr(varlen_programs, "__name__", "varlen_programs")
    cases = _varlen_cases()
    for cu, block_q in cases:
        where = f"cu_seqlens={cu.tolist()}, block_q={block_q}"
        out = attempt(varlen_programs, cu.clone(), block_q, name=name, forbid=("flashattn",))
        if not isinstance(out, torch.Tensor):
            raise ExerciseError(f"{name} should return a torch.Tensor, got {type(out).__name__} ({where})")
        if out.dtype != torch.int32:
            raise ExerciseError(f"{name} returned {out.dtype}; the table is int32, as cu_seqlens is and as "
                                f"the kernel reads it ({where})")
        want = _programs(cu, block_q)
        if out.dim() != 2 or out.shape[1] != 2:
            raise ExerciseError(f"{name} returned shape {tuple(out.shape)}; expected ({len(want)}, 2): one row "
                                f"(sequence, first packed row) per program ({where})")
        got = [tuple(row) for row in out.tolist()]
        if got == want:
            continue
        for slip, hint in VARLEN_SLIPS.items():
            model = _programs(cu, block_q, slip)
            if model != want and got == model:
                raise ExerciseError(f"{name} is wrong: {hint} ({where}).")
        if sorted(got) == sorted(want):
            raise ExerciseError(f"{name}: the programs are right but out of order: sequence by sequence, and "
                                f"within a sequence its blocks in order ({where}).")
        extra = sorted(set(got) - set(want))
        missing = sorted(set(want) - set(got))
        if extra:
            raise ExerciseError(f"{name}: the program (sequence {extra[0][0]}, row {extra[0][1]}) is not a query "
                                f"block of that sequence ({where}).")
        raise ExerciseError(f"{name}: {len(missing)} query block(s) have no program, e.g. sequence "
                            f"{missing[0][0]} from row {missing[0][1]} ({where}).")
    passed(f"{name} builds the program table for {len(cases)} packed batches: ragged lengths, empty "
           "sequences, one sequence, block sizes 16 to 64")
