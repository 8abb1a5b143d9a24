"""Checkers of chapter 14 (changing the score inside the loop): a softcap piece in Triton with its
derivative factor, run inside a small kernel given here; the ALiBi bias of a (query, key) pair under
either alignment; a key-padding mask as the kernels read it."""
import numpy as np
import torch
import triton
import triton.language as tl

from ...gpu.runtime import DEVICE
from .common import ExerciseError, attempt, close, launch_learner_kernel, passed


# --- Exercise 1: a softcap piece ------------------------------------------------------------------

@triton.jit
def softcap_exercise_kernel(S, Capped, Dcap, n, softcap, PIECE: tl.constexpr, BLOCK: tl.constexpr):
    """One block of scores through the learner's piece ``PIECE(s, softcap) -> (capped, dcap)`` (a
    @triton.jit function passed as a compile-time argument), as the forward and backward kernels call
    theirs: the capped scores and the factor the backward puts on dS."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(S + offs, mask=offs < n, other=0.0)
    capped, dcap = PIECE(s, softcap)
    tl.store(Capped + offs, capped, mask=offs < n)
    tl.store(Dcap + offs, dcap, mask=offs < n)


def run_softcap_piece(piece, s, softcap, block=64, name="my_softcap", forbid=("flashattn",)):
    """``(capped, dcap)`` of the 1-D tensor ``s`` through the learner's ``piece``, in ``s``'s dtype
    (``forbid``: what the piece may not call; by default flashattn's own functions), run on the
    kernels' device and returned on the CPU."""
    s = s.to(DEVICE)
    capped, dcap = torch.empty_like(s), torch.empty_like(s)
    launch_learner_kernel(softcap_exercise_kernel, (triton.cdiv(s.numel(), block),),
                          (s, capped, dcap, s.numel(), float(softcap)), dict(PIECE=piece, BLOCK=block),
                          name, piece, forbid=forbid)
    return capped.cpu(), dcap.cpu()


def _near(got, want, atol, rtol):
    """Quietly: is the tensor ``got`` close to the NumPy array ``want``?"""
    return close(got, torch.from_numpy(np.asarray(want, dtype=np.float64)), atol, rtol)


#: Known mistakes of the capped score: (what it computes, what to say).
CAPPED_MISTAKES = [
    (lambda s, c: c * np.tanh(s), "tanh of the unscaled score: the cap is softcap * tanh(s / softcap), "
                                  "s divided by softcap inside the tanh"),
    (lambda s, c: np.tanh(s / c), "the outer multiply by softcap is missing: these values lie in (-1, 1), "
                                  "the capped scores in (-softcap, softcap)"),
    (lambda s, c: c * np.tanh(s * c), "s is multiplied by softcap inside the tanh: it must be divided, "
                                      "softcap * tanh(s / softcap)"),
    (lambda s, c: np.tanh(s), "tanh(s) alone: both the division inside and the multiply outside are missing"),
    (lambda s, c: s, "the scores came back unchanged"),
]

#: Known mistakes of the derivative factor, given t = tanh(s / softcap).
DCAP_MISTAKES = [
    (lambda t, c: 1 - t, "the factor is 1 - tanh, not 1 - tanh**2: d tanh(x) / dx = 1 - tanh(x)**2"),
    (lambda t, c: t * t, "tanh**2 alone: the derivative is 1 - tanh**2"),
    (lambda t, c: 1 - (c * t) ** 2, "1 - capped**2 squares the capped score: the derivative is "
                                     "1 - tanh(s / softcap)**2, the square of tanh itself"),
    (lambda t, c: c * (1 - t * t), "an extra factor softcap: the softcap outside and the 1 / softcap inside "
                                   "cancel, leaving 1 - tanh**2"),
    (lambda t, c: (1 - t * t) / c, "an extra factor 1 / softcap: the softcap outside and the 1 / softcap "
                                   "inside cancel, leaving 1 - tanh**2"),
    (lambda t, c: np.ones_like(t), "the factor is 1: that is the derivative without a softcap"),
]

SOFTCAP_CASES = [(2.0, 0.0, 3.0), (5.0, 1.0, 20.0), (30.0, 0.0, 100.0), (50.0, -40.0, 5.0)]


def check_softcap_piece(my_softcap):
    """Chapter 14: ``my_softcap(s, softcap)``, a @triton.jit function, must return
    ``(softcap * tanh(s / softcap), 1 - tanh(s / softcap)**2)`` for a block of scores ``s``; it runs
    in a small kernel (``softcap_exercise_kernel``) on float64 scores, small, large and far beyond
    the cap, and is compared with the formula in float64."""
    name = getattr(getattr(my_softcap, "fn", my_softcap), "__name__", "my_softcap")
    g = torch.Generator().manual_seed(13)
    for cap, centre, spread in SOFTCAP_CASES:
        s = (centre + spread * torch.randn(300, generator=g, dtype=torch.float64))
        # 0, tiny, far past the cap, and so far that exp(s / softcap) overflows float64
        s[:6] = torch.tensor([0.0, 1e-3, -10 * cap, 10 * cap, -1000 * cap, 1000 * cap], dtype=torch.float64)
        capped, dcap = run_softcap_piece(my_softcap, s, cap, name=name)
        x = s.numpy()
        t = np.tanh(x / cap)
        where = f"{name}(s, softcap={cap}) on scores around {centre} (spread {spread})"
        if torch.isnan(capped).any() or torch.isnan(dcap).any():
            bad = float(s[torch.isnan(capped) | torch.isnan(dcap)][0])
            raise ExerciseError(f"{where} gives NaN at s = {bad:g}: a tanh written as (e**x - e**-x) / (e**x + e**-x) "
                                "overflows to inf / inf for large |x|; write it so that it tends to +-1, e.g. "
                                "1 - 2 / (exp(2x) + 1)")
        if not _near(capped, cap * t, atol=1e-9 * cap, rtol=1e-9):
            for mistake, hint in CAPPED_MISTAKES:
                if _near(capped, mistake(x, cap), atol=1e-9 * cap, rtol=1e-9):
                    raise ExerciseError(f"{where}: the capped score is wrong: {hint}.")
            i = int((capped - torch.from_numpy(cap * t)).abs().argmax())
            raise ExerciseError(f"{where}: the capped score at s = {x[i]:g} is {float(capped[i]):g}, expected "
                                f"softcap * tanh(s / softcap) = {cap * t[i]:g}")
        if not _near(dcap, 1 - t * t, atol=1e-9, rtol=1e-9):
            for mistake, hint in DCAP_MISTAKES:
                if _near(dcap, mistake(t, cap), atol=1e-9, rtol=1e-9):
                    raise ExerciseError(f"{where}: the derivative factor is wrong: {hint}.")
            i = int((dcap - torch.from_numpy(1 - t * t)).abs().argmax())
            raise ExerciseError(f"{where}: the derivative factor at s = {x[i]:g} is {float(dcap[i]):g}, expected "
                                f"1 - tanh(s / softcap)**2 = {1 - t[i] ** 2:g}")
    passed(f"{name} caps the scores and gives the factor on dS, 1 - tanh**2, for {len(SOFTCAP_CASES)} caps "
           "(2 to 50), in float64 against the formula")


# --- Exercise 2: the ALiBi bias of one pair ----------------------------------------------------------

#: (i, j, n_q, n_kv, slope): pairs before, on and after the query's position, with n_q <, = and > n_kv.
ALIBI_CASES = [(0, 0, 4, 4, 0.5), (3, 1, 4, 4, 0.5), (1, 3, 4, 4, 0.25), (0, 5, 1, 6, 0.5), (0, 0, 1, 6, 0.125),
               (2, 7, 3, 8, 1.0), (1, 2, 3, 8, 0.5), (5, 2, 6, 4, 0.5), (0, 3, 6, 4, 0.25), (4, 4, 6, 4, 0.5)]

ALIBI_MISTAKES = [
    (lambda i, j, nq, nk, m, br: m * abs(i + (nk - nq if br else 0) - j),
     "the sign: ALiBi subtracts slope * distance, so that farther keys get lower scores"),
    (lambda i, j, nq, nk, m, br: -m * abs(i - j),
     "bottom-right alignment must shift the query's position by n_kv - n_q (the last query sits at the last "
     "key); here the query's position is i under both alignments"),
    (lambda i, j, nq, nk, m, br: -m * abs(i + (nq - nk if br else 0) - j),
     "the shift is backwards: bottom-right moves query i to position i + n_kv - n_q, not i + n_q - n_kv"),
    (lambda i, j, nq, nk, m, br: -m * abs(i + nk - nq - j),
     "the shift applies under both alignments: top-left puts query i at position i, only bottom-right "
     "moves it to i + n_kv - n_q"),
    (lambda i, j, nq, nk, m, br: -m * (i + (nk - nq if br else 0) - j),
     "the distance must be absolute, |pos(i) - j|: a key after the query is as far as one before"),
    (lambda i, j, nq, nk, m, br: -abs(i + (nk - nq if br else 0) - j),
     "the slope is missing: the bias is slope * distance"),
]


def check_alibi_bias(alibi_bias):
    """Chapter 14: ``alibi_bias(i, j, n_q, n_kv, slope, alignment)`` must return the number ALiBi adds
    to the score of query ``i`` and key ``j`` (``alignment`` "top_left" or "bottom_right")."""
    name = getattr(alibi_bias, "__name__", "alibi_bias")
    cases = [(*case, alignment) for case in ALIBI_CASES for alignment in ("top_left", "bottom_right")]
    got = []
    for i, j, nq, nk, m, alignment in cases:
        value = attempt(alibi_bias, i, j, nq, nk, m, alignment, name=name, forbid=("flashattn",))
        try:
            got.append(float(value))
        except (TypeError, ValueError):
            raise ExerciseError(f"{_where(name, i, j, nq, nk, m, alignment)} should return a number, got "
                                f"{type(value).__name__}") from None

    def values(rule):
        return [rule(i, j, nq, nk, m, alignment == "bottom_right") for i, j, nq, nk, m, alignment in cases]

    want = [w + 0.0 for w in values(lambda i, j, nq, nk, m, br: -m * abs(i + (nk - nq if br else 0) - j))]
    wrong = [c for c, (a, b) in enumerate(zip(got, want)) if abs(a - b) > 1e-9]
    if wrong:
        # the first case the answer gets wrong, and the mistake that explains every case, if one does
        first = wrong[0]
        where = f"{_where(name, *cases[first])} returned {got[first]:g}, expected {want[first]:g}"
        for mistake, hint in ALIBI_MISTAKES:
            if all(abs(a - b) <= 1e-9 for a, b in zip(got, values(mistake))):
                raise ExerciseError(f"{where}: {hint}.")
        raise ExerciseError(where)
    passed(f"{name} gives the bias of {len(ALIBI_CASES)} pairs under both alignments, n_q below, equal to "
           "and above n_kv")


def _where(name, i, j, nq, nk, m, alignment):
    return f"{name}({i}, {j}, n_q={nq}, n_kv={nk}, slope={m}, alignment={alignment!r})"


# --- Exercise 3: a key-padding mask as the kernels read it --------------------------------------------

MASK_CASES = [([3, 5], 5), ([1, 4, 2], 6), ([7], 7), ([0, 2], 4)]


def check_key_padding_mask(key_padding_mask):
    """Chapter 14: ``key_padding_mask(lengths, n_kv)`` must return the bool mask ``(B, 1, 1, n_kv)``,
    True for the first ``lengths[b]`` keys of sequence ``b`` (its tokens) and False for its padding,
    which the kernels read with stride 0 on the heads and the queries."""
    name = getattr(key_padding_mask, "__name__", "key_padding_mask")
    for lengths, n in MASK_CASES:
        where = f"{name}({lengths}, n_kv={n})"
        got = attempt(key_padding_mask, list(lengths), n, name=name, forbid=("flashattn",))
        if not isinstance(got, torch.Tensor):
            raise ExerciseError(f"{where} should return a tensor, got {type(got).__name__}")
        want = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
        batch = len(lengths)
        if got.dtype != torch.bool:
            raise ExerciseError(f"{where} has dtype {got.dtype}: a key-padding mask is bool, True where a key "
                                "is seen (a float mask is added to the scores instead: 0 and -inf)")
        if tuple(got.shape) == (batch, n):
            raise ExerciseError(f"{where} has shape {tuple(got.shape)}: attn_mask is 4-D, (B, heads, N_q, N_kv); "
                                "a dim of size 1 for the heads and the queries, (B, 1, 1, N_kv), broadcasts")
        if got.dim() == 4 and got.shape[0] == batch and got.shape[3] == n and tuple(got.shape[1:3]) != (1, 1):
            raise ExerciseError(f"{where} has shape {tuple(got.shape)}: the mask is the same for every head and "
                                "every query, so those dims have size 1, (B, 1, 1, N_kv): the kernels read them "
                                "with stride 0 and nothing N_q x N_kv is ever made")
        if tuple(got.shape) != (batch, 1, 1, n):
            raise ExerciseError(f"{where} has shape {tuple(got.shape)}, expected {(batch, 1, 1, n)}")
        got2 = got[:, 0, 0]
        if torch.equal(got2, want):
            continue
        if torch.equal(got2, ~want):
            raise ExerciseError(f"{where} is inverted: True marks a key that is seen (a token), False its padding")
        if torch.equal(got2, torch.arange(n)[None, :] <= torch.tensor(lengths)[:, None]):
            raise ExerciseError(f"{where} lets each sequence see one key too many: keys 0 .. length - 1 are its "
                                "tokens, key `length` is the first padding")
        if torch.equal(got2, torch.arange(n)[None, :] >= n - torch.tensor(lengths)[:, None]):
            raise ExerciseError(f"{where} pads on the left: here the tokens come first, the padding after them")
        raise ExerciseError(f"{where} is {got2.int().tolist()}, expected {want.int().tolist()} (1: seen)")
    passed(f"{name} builds the (B, 1, 1, N_kv) mask of {len(MASK_CASES)} batches, read with stride 0 on "
           "heads and queries")
