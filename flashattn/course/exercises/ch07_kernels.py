"""Checkers of chapter 07's whole kernels and launcher: ``my_attn_bwd_dq`` and ``my_attn_bwd_dkdv``
(exercises 2b and 3b, the programs around the learner's loops of exercises 2a and 3a) and
``my_attention_backward`` (exercise 4, the launcher of the learner's three kernels).

Each kernel is launched by the checker on odd sizes (N_q = 19, N_kv = 27, D = 24), (B, N, H, D)
tensors seen as (B, H, N, D), columns two elements apart, causal and not, float32 and float16, with
the LSE and Delta of a float64 reference, and judged under the course's rule
(``flashattn.testing.rule``). The tensors lie in NaN-filled buffers (a load that is not masked
shows), the gradients in buffers that show a store outside them or a row never written. A wrong
result that equals a known mistake, modelled in float64 (:func:`gradients_model`), is named: a
stage without its mask, a stage missing or starting late, the scale missing or applied twice,
IS_CAUSAL not followed, the wrong (batch, head) offsets, strides assumed contiguous.

The launcher must reach all five of the learner's functions (the three kernels and, through them,
the two loops): its check says which is missing or still a stub, so that it never passes while
the backward it launches is not entirely the learner's.
"""
import math

import torch
import triton

from ..notebook import pick
from ...gpu.runtime import DEVICE
from ...kernels.tiles import LOG2E
from ...kernels.traversal import kv_ranges, q_ranges
from ...testing.reference import naive_attention
from ...testing.rule import judge
from .ch07 import padded_view
from .common import (ExerciseError, attempt, close, expect_close, is_stub, launch_learner_kernel,
                     learner_functions, passed)

FORBID = ("flashattn", "softmax", "sdpa")
GPU_TOL = 5e-3  # on a GPU, tl.dot multiplies float32 tiles in TF32 unless told input_precision="ieee"
UNTOUCHED = -7.0
UNWRITTEN = 1234.0  # what a gradient holds before the kernel runs (exact in float16 too)

#: The learner's functions of chapter 07, and the exercise that writes each.
EXERCISES = {"delta_kernel": "exercise 1", "dq_inner": "exercise 2a", "my_attn_bwd_dq": "exercise 2b",
             "dkdv_inner": "exercise 3a", "my_attn_bwd_dkdv": "exercise 3b"}


def _generator(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


def _reaches(fn, name, needed):
    """Raise the ExerciseError for a learner's ``fn`` that does not reach each function of
    ``needed`` (names of :data:`EXERCISES`), or reaches one that is still a stub."""
    found = learner_functions(fn)
    stubs = [f"{want} ({EXERCISES.get(want, 'yours')})" for want, f in found.items() if is_stub(f)]
    if stubs:
        listed = stubs[0] if len(stubs) == 1 else ", ".join(stubs[:-1]) + " and " + stubs[-1]
        raise ExerciseError(f"{name} runs {listed}, which {'is' if len(stubs) == 1 else 'are'} not "
                            f"implemented yet: write {'it' if len(stubs) == 1 else 'them'} first, then run this "
                            "check again.")
    for want in needed:
        if want not in found:
            raise ExerciseError(f"{name} never runs your {want} ({EXERCISES[want]}): "
                                + ("launch your three kernels, delta_kernel, my_attn_bwd_dkdv and my_attn_bwd_dq, "
                                   "not the package's or PyTorch's." if name == "my_attention_backward" else
                                   f"call it for the loop over the {'key' if want == 'dq_inner' else 'query'} tiles."))


# --- The float64 model of a whole kernel, and its mistakes -----------------------------------------

def gradients_model(q, k, v, do, is_causal, scale, visible, factors=(None, None, 1.0)):
    """dQ, dK, dV in float64 of (B, H, N, D) tensors, as a kernel computes them that is given the
    right LSE and Delta but lets only the (N_q, N_kv) pairs ``visible`` contribute and multiplies
    its loops' sums by ``factors`` (dQ's, dK's, dV's; None stands for ``scale``)."""
    q, k, v, do = (t.detach().double().cpu() for t in (q, k, v, do))
    o, lse = naive_attention(q, k, v, is_causal=is_causal, scale=scale)
    p = torch.exp(q @ k.transpose(-2, -1) * scale - lse[..., None]) * visible
    ds = p * (do @ v.transpose(-2, -1) - (do * o).sum(-1, keepdim=True))
    f_q, f_k, f_v = (scale if f is None else f for f in factors)
    return f_q * ds @ k, f_k * ds.transpose(-2, -1) @ q, f_v * p.transpose(-2, -1) @ do


def _pairs(n_q, n_kv, causal):
    i, j = torch.arange(n_q)[:, None], torch.arange(n_kv)[None, :]
    return i, j, (j <= i) if causal else torch.ones(n_q, n_kv, dtype=torch.bool)


def kernel_mistakes(stage, n_q, n_kv, causal, scale, block_q, block_kv):
    """``[(visible, factors, what it means)]``: the likely mistakes of the kernel of ``stage``
    ("dq" or "dkdv") around a right loop, as arguments of :func:`gradients_model`."""
    i, j, right = _pairs(n_q, n_kv, causal)
    mistakes = [(_pairs(n_q, n_kv, not causal)[2], (None, None, 1.0),
                 f"the gradients are those of {'non-' if causal else ''}causal attention: follow IS_CAUSAL in the "
                 "ranges the loops cover and in the MASKED calls")]
    if stage == "dq":
        bounds = torch.tensor([kv_ranges(r // block_q * block_q, block_q, block_kv, n_kv, causal) for r in range(n_q)])
        full_end, end = bounds[:, :1], bounds[:, 1:]
        mistakes += [
            (j < end, (None, None, 1.0), "the diagonal tiles were computed without the causal mask: the second "
                                         "call, over [kv_full_end, kv_end), runs with MASKED=True and IS_CAUSAL"),
            (right & (j >= full_end), (None, None, 1.0), "the first call does not start at key 0: it covers "
                                                         "[0, kv_full_end), and only its end moves with the query block"),
            (right & (j < full_end), (None, None, 1.0), "the keys [kv_full_end, kv_end) are missing: the second call, "
                                                        "with MASKED=True, covers the diagonal and the ragged end"),
            (right, (1.0, None, 1.0), "dQ is missing the factor scale: multiply it by scale once, after both "
                                      "calls (the loop leaves it out, chapter 06, section 8)"),
            (right, (scale * scale, None, 1.0), "dQ carries the scale twice: the loop has none, and the kernel "
                                                "multiplies by scale once, at the end"),
            (right, (scale * LOG2E, None, 1.0), "dQ was multiplied by qk_scale at the end: the end factor is scale; "
                                                "the log2(e) cancelled inside the loop"),
        ]
        return mistakes
    ranges = torch.tensor([q_ranges(c // block_kv * block_kv, block_kv, block_q, n_q, causal) for c in range(n_kv)])
    full_lo, full_hi = ranges[:, 1][None, :], ranges[:, 2][None, :]
    kv_start = (torch.arange(n_kv) // block_kv * block_kv)[None, :]
    early = ("the diagonal tiles were computed without the causal mask: the first call, over [q_lo, q_full_lo), "
             "runs with MASKED=True and IS_CAUSAL" if causal else
             "without the causal mask the queries start at 0 for every key block (q_lo = q_full_lo = 0)")
    mistakes += [
        (i >= kv_start, (None, None, 1.0), early),
        (right & (i >= full_lo), (None, None, 1.0), "the diagonal queries [kv_start, kv_start + BLOCK_KV) are never "
                                                    "visited: the first call, with MASKED=True, covers them"),
        (right & (i < full_hi), (None, None, 1.0), "the ragged last query block is never visited: a third call "
                                                   "covers [q_full_hi, n_q) with MASKED=True"),
        (right, (None, 1.0, 1.0), "dK is missing the factor scale: multiply it by scale once, after the three "
                                  "calls (dV takes none)"),
        (right, (None, scale * scale, 1.0), "dK carries the scale twice: the loop has none, and the kernel "
                                            "multiplies by scale once, at the end"),
        (right, (None, None, scale), "dV was multiplied by scale: only dK carries it (S = scale * Q K^T; "
                                     "dV = P^T dO has no scale)"),
    ]
    return mistakes


# --- Exercises 2b and 3b: the whole dQ and dK/dV kernels ------------------------------------------------

#: Each kernel: its name, the loop it calls, its outputs and the tiles of each case below.
KERNELS = {"dq": dict(name="my_attn_bwd_dq", loop="dq_inner", outputs=("dq",), seed=480,
                      blocks=[(16, 16), (16, 16), (16, 16), (32, 16), (16, 16)]),
           "dkdv": dict(name="my_attn_bwd_dkdv", loop="dkdv_inner", outputs=("dk", "dv"), seed=490,
                        blocks=[(16, 16), (16, 16), (16, 32), (16, 32), (16, 32)])}

#: (B, H, N_q, N_kv, D, causal, layout, dtype): aligned and contiguous first (a mistake shows alone
#: there), then ragged lengths, a padded head dim, (B, N, H, D) views, strided columns, float16.
KERNEL_CASES = [(1, 2, 32, 32, 32, True, "contiguous", torch.float32),
                (2, 3, 19, 27, 24, False, "bnhd", torch.float32),
                (2, 3, 19, 27, 24, True, "bnhd", torch.float32),
                (1, 2, 27, 19, 24, True, "strided_d", torch.float32),
                (1, 2, 19, 27, 24, True, "bnhd", torch.float16)]


def _gradient_buffer(shape, dtype):
    """A gradient as a view holding UNWRITTEN, in a buffer whose other rows and columns hold
    UNTOUCHED (so a store outside it shows)."""
    *lead, n, d = shape
    buffer = torch.full((*lead, n + 17, d + 16), UNTOUCHED, dtype=dtype, device=DEVICE)
    view = buffer[..., :n, :d]
    view.fill_(UNWRITTEN)
    return view, buffer


def _rows(values):
    """A contiguous float32 (B, H, N_q) tensor of ``values`` followed in memory by NaN."""
    buffer = torch.full((values.numel() + 64,), float("nan"), device=DEVICE)
    view = buffer[:values.numel()].view(values.shape)
    view.copy_(values)
    return view


def backward_case(case, seed):
    """The tensors of one case: q, k, v, do (views of ``layout``, in ``dtype``), the base-2 LSE and
    Delta (float32, from float64), the float64 gradients and plain PyTorch's in ``dtype``."""
    batch, heads, n_q, n_kv, d, causal, layout, dtype = case
    g = _generator(seed)
    values = [torch.randn(batch, heads, n, d, generator=g) for n in (n_q, n_kv, n_kv, n_q)]
    tensors = [(t.to(DEVICE, dtype) if layout == "contiguous" else padded_view(t.shape, layout, dtype, t))
               for t in values]
    scale = 1.0 / math.sqrt(d)
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in tensors[:3])
    do64 = tensors[3].double().cpu()
    o64, lse64 = naive_attention(q64, k64, v64, is_causal=causal, scale=scale)
    ref = torch.autograd.grad(o64, (q64, k64, v64), do64)
    base = [t.detach().clone().requires_grad_() for t in tensors[:3]]
    pytorch = torch.autograd.grad(naive_attention(*base, is_causal=causal, scale=scale)[0], base, tensors[3])
    lse2 = _rows((lse64.detach() * LOG2E).float())
    delta = _rows((o64.detach() * do64).sum(-1).float())
    return dict(tensors=tensors, lse2=lse2, delta=delta, ref=ref, pytorch=pytorch, scale=scale)


def passes(got, ref, pytorch, dtype, upstream):
    """Whether the gradients ``got`` (a dict: dq, dk, dv, any of them) pass: the rule on the
    interpreter and for 16-bit inputs; TF32's tolerance for float32 on a GPU (the learner's
    tl.dot multiplies float32 tiles in TF32 there)."""
    got, ref, pytorch = ({n: t[n].detach().cpu() for n in got} for t in (got, ref, pytorch))
    if dtype == torch.float32 and pick(cpu=False, gpu=True):
        return all(close(got[n], ref[n], GPU_TOL * (1 + ref[n].abs().max().item()), GPU_TOL) for n in got)
    return all(c.ok for c in judge(got, ref, pytorch, dtype, upstream=upstream))


def _launch_kernel(stage, kernel, data, case, blocks):
    """Launch the learner's kernel of ``stage`` on one case; returns ({output: view}, {output: buffer})."""
    batch, heads, n_q, n_kv, d, causal, layout, dtype = case
    q, k, v, do = data["tensors"]
    block_q, block_kv = blocks
    scale = data["scale"]
    outputs = KERNELS[stage]["outputs"]
    made = {name: _gradient_buffer(like.shape, dtype) for name, like in zip(outputs, (q,) if stage == "dq" else (k, v))}
    grads = [made[name][0] for name in outputs]
    grid = (triton.cdiv(n_q if stage == "dq" else n_kv, block_q if stage == "dq" else block_kv), heads, batch)
    launch_learner_kernel(kernel, grid,
                          (q, k, v, do, data["lse2"], data["delta"], *grads, *q.stride(), *k.stride(), *v.stride(),
                           *do.stride(), *(s for t in grads for s in t.stride()), heads, n_q, n_kv, scale,
                           scale * LOG2E),
                          dict(HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_Q=block_q,
                               BLOCK_KV=block_kv, IS_CAUSAL=causal),
                          KERNELS[stage]["name"], kernel, forbid=FORBID)
    return {name: made[name][0] for name in outputs}, {name: made[name][1] for name in outputs}


def _check_kernel(stage, kernel):
    """Run the learner's whole kernel of ``stage`` on :data:`KERNEL_CASES`; name what is wrong."""
    spec = KERNELS[stage]
    name = spec["name"]
    if is_stub(kernel):
        raise ExerciseError(f"{name} is not implemented yet: replace `raise NotImplementedError()` with your "
                            "code, then run this check again.")
    _reaches(kernel, name, (spec["loop"],))
    contiguous_ok = False
    for n, (case, blocks) in enumerate(zip(KERNEL_CASES, spec["blocks"])):
        batch, heads, n_q, n_kv, d, causal, layout, dtype = case
        data = backward_case(case, spec["seed"] + n)
        got, buffers = _launch_kernel(stage, kernel, data, case, blocks)
        what = (f" (B={batch}, H={heads}, N_q={n_q}, N_kv={n_kv}, D={d}, is_causal={causal}, {layout} inputs, "
                f"{str(dtype)[6:]}, BLOCK_Q={blocks[0]}, BLOCK_KV={blocks[1]})")
        labels = {"dq": "dQ", "dk": "dK", "dv": "dV"}
        for out, buffer in buffers.items():
            outside = buffer.cpu().clone()
            outside[..., :got[out].shape[-2], :d] = UNTOUCHED
            if (outside != UNTOUCHED).any():
                raise ExerciseError(f"{name} wrote outside {labels[out]}{what}: mask the store with the rows that "
                                    "exist and the columns < HEAD_DIM (the tile has BLOCK_D >= HEAD_DIM columns)")
        for out, grad in got.items():
            unwritten = (grad.cpu() == UNWRITTEN).all(-1)
            if unwritten.any():
                b, h, row = (int(x) for x in unwritten.nonzero()[0])
                hint = (f"each program computes {'query' if stage == 'dq' else 'key'} block tl.program_id(0) of head "
                        "tl.program_id(1) of batch tl.program_id(2)")
                if causal and stage == "dq":
                    hint += (" (under IS_CAUSAL in reverse order, so the longest programs start first: "
                             "q_block = tl.num_programs(0) - 1 - tl.program_id(0))")
                raise ExerciseError(f"{name} left row {row} of head {h}, batch {b} of {labels[out]} unwritten{what}: "
                                    f"{hint}")
        names = dict(zip(("dq", "dk", "dv"), data["ref"]))
        ref = {out: names[out] for out in got}
        pytorch = {out: dict(zip(("dq", "dk", "dv"), data["pytorch"]))[out] for out in got}
        upstream = data["tensors"][3].abs().max().item()
        if passes(got, ref, pytorch, dtype, upstream):
            contiguous_ok = contiguous_ok or layout == "contiguous"
            continue
        for out, grad in got.items():
            if torch.isnan(grad.float()).any():
                raise ExerciseError(f"{labels[out]} of {name} has NaN{what}: a load read outside a tensor (the memory "
                                    "around them holds NaN in this check): load the resident tiles with their row "
                                    "and column masks (other=0.0), and the LSE and Delta with the row mask.")
        _name_kernel_mistake(stage, name, got, data, case, blocks, what, contiguous_ok)
    passed(f"{name} passes the rule against float64 in all {len(KERNEL_CASES)} cases (N_q = 19, N_kv = 27, "
           "D = 24, (B, N, H, D) views, strided columns, causal and not, float32 and float16)")


def _name_kernel_mistake(stage, name, got, data, case, blocks, what, contiguous_ok):
    """Raise the ExerciseError that names what the kernel got wrong on this case."""
    batch, heads, n_q, n_kv, d, causal, layout, dtype = case
    labels = {"dq": "dQ", "dk": "dK", "dv": "dV"}
    tol = pick(cpu=1e-4, gpu=GPU_TOL) if dtype == torch.float32 else 1e-2
    got64 = {out: grad.detach().double().cpu() for out, grad in got.items()}
    ref = dict(zip(("dq", "dk", "dv"), data["ref"]))
    scale = data["scale"]

    def same(model):
        return all(close(got64[out], model[out], tol * (1 + model[out].abs().max().item()), tol) for out in got64)

    tensors = data["tensors"]
    for visible, factors, said in kernel_mistakes(stage, n_q, n_kv, causal, scale, *blocks):
        model = dict(zip(("dq", "dk", "dv"), gradients_model(*tensors, causal, scale, visible, factors)))
        if not same({out: ref[out] for out in got64}) and same(model):
            raise ExerciseError(f"the gradients of {name} are wrong{what}: {said}.")
    right = torch.stack([torch.isclose(got64[out], ref[out].double(), atol=tol * (1 + ref[out].abs().max().item()),
                                       rtol=tol).all(-1).all(-1) for out in got64]).all(0)
    if right[0, 0] and not right.all():
        b, h = (int(x) for x in (~right).nonzero()[0])
        raise ExerciseError(f"head {h} of batch {b} of {name}'s gradients is wrong{what}, head 0 of batch 0 right: each "
                            "program moves every tensor to its (batch, head), X + batch * stride_xb + head * stride_xh "
                            "(in 64-bit), and LSE2 and Delta to (batch * n_heads + head) * n_q.")
    if layout != "contiguous" and contiguous_ok:
        raise ExerciseError(f"the gradients of {name} are wrong{what}, and were right for contiguous inputs: use each "
                            "tensor's own strides, rows and columns (stride_xn, stride_xd), for every load and store.")
    for out in got64:
        expect_close(f"{labels[out]} of {name}{what}", got64[out], ref[out].double(), atol=tol, rtol=tol, heatmap=True)


def check_my_attn_bwd_dq(my_attn_bwd_dq):
    """``my_attn_bwd_dq[(cdiv(N_q, BLOCK_Q), H, B)](Q, K, V, dO, LSE2, Delta, dQ, <20 strides>,
    n_heads, n_q, n_kv, scale, qk_scale, HEAD_DIM=..., BLOCK_D=..., BLOCK_Q=..., BLOCK_KV=...,
    IS_CAUSAL=...)``: each program writes BLOCK_Q rows of dQ of one (batch, head), calling the
    learner's ``dq_inner`` for the two stages of keys."""
    _check_kernel("dq", my_attn_bwd_dq)


def check_my_attn_bwd_dkdv(my_attn_bwd_dkdv):
    """``my_attn_bwd_dkdv[(cdiv(N_kv, BLOCK_KV), H, B)](Q, K, V, dO, LSE2, Delta, dK, dV, <24
    strides>, n_heads, n_q, n_kv, scale, qk_scale, HEAD_DIM=..., BLOCK_D=..., BLOCK_Q=...,
    BLOCK_KV=..., IS_CAUSAL=...)``: each program writes BLOCK_KV rows of dK and dV of one (batch,
    head), calling the learner's ``dkdv_inner`` for the three ranges of queries."""
    _check_kernel("dkdv", my_attn_bwd_dkdv)


# --- Exercise 4: the launcher -------------------------------------------------------------------------

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
    p = torch.exp2(q @ k.transpose(-2, -1) * c - (lse * LOG2E)[..., None]) * _pairs(q.shape[-2], k.shape[-2], is_causal)[2]
    rows = {"dO * O": do * o, "none": 0 * o, "O * O": o * o, "dO * dO": do * do}[delta]
    ds = p * (do @ v.transpose(-2, -1) - rows.sum(-1)[..., None])
    return grad_scale * ds @ k, grad_scale * ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ do


#: The launcher's likely mistakes, as arguments of backward_model (a function of scale) and what
#: the message says.
LAUNCHER_MISTAKES = [
    (lambda s: dict(delta="none"), "Delta is missing (dS = P * dP): launch delta_kernel before the two "
     "gradient kernels, and pass them its Delta"),
    (lambda s: dict(delta="O * O"), "Delta is rowsum(O * O): delta_kernel takes O and dO, each with its own "
     "strides"),
    (lambda s: dict(delta="dO * dO"), "Delta is rowsum(dO * dO): delta_kernel takes O and dO, each with its "
     "own strides"),
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
    scale=None) -> (dq, dk, dv)``, launching the learner's three kernels: delta_kernel, then
    my_attn_bwd_dkdv over key blocks and my_attn_bwd_dq over query blocks. It fails, saying which,
    while any of them or of the loops they call is not written or not run. On odd sizes (N_q = 19,
    N_kv = 27, D = 24, and lengths far apart), causal and not, contiguous and not, float32 and
    float16, compared with float64 autograd under the tolerance rule (flashattn.testing.rule).
    Names Delta missing or taken from the wrong tensors, a grid over the wrong blocks, the scale
    applied twice or not at all (or its default forgotten), qk_scale without log2 e, strides
    assumed contiguous, and gradients returned in the wrong dtype."""
    from ...kernels.forward import attention_forward

    name = "my_attention_backward"
    if is_stub(my_attention_backward):
        raise ExerciseError(f"{name} is not implemented yet: replace `raise NotImplementedError()` with your code, "
                            "then run this check again.")
    _reaches(my_attention_backward, name, ("delta_kernel", "my_attn_bwd_dkdv", "dkdv_inner", "my_attn_bwd_dq",
                                           "dq_inner"))
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
            out = attempt(my_attention_backward, *tensors, name=name, forbid=FORBID, is_causal=causal, **extra)
            if not isinstance(out, (tuple, list)) or len(out) != 3:
                raise ExerciseError(f"{name} should return (dq, dk, dv), got {type(out).__name__}")
            return out

        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = torch.autograd.grad(naive_attention(*leaves, is_causal=causal, scale=s)[0], leaves, do.double())
        try:
            got = run(q, k, v, o, lse2, do)
        except ExerciseError as error:
            # wrong strides can read past a view's memory: the interpreter then fails on the garbage
            if not views:
                raise
            tensors = tuple(t.contiguous() for t in (q, k, v, o, lse2, do))
            again = run(*tensors)  # raises again if not the views
            _check_returned(again, (q, k, v), what)
            if _right(again, ref):
                raise ExerciseError(f"right on contiguous tensors, wrong on non-contiguous views ({what}): on the "
                                    f"views it failed ({error}). Pass each tensor's own strides (*x.stride()) for "
                                    "every pointer a kernel gets, never another tensor's or strides computed from "
                                    "the shape.") from None
            # it runs on contiguous copies of the views, and is wrong there too: name that mistake first
            _name_launcher_mistake(run, again, tensors, ref, causal, s, scale,
                                   what.replace("non-contiguous views", "contiguous copies of the views"))
        _check_returned(got, (q, k, v), what)
        base = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        pytorch = torch.autograd.grad(naive_attention(*base, is_causal=causal, scale=s)[0], base, do)
        names = ("dq", "dk", "dv")
        if passes(dict(zip(names, got)), dict(zip(names, ref)), dict(zip(names, pytorch)), dtype,
                  do.abs().max().item()):
            continue
        _name_launcher_mistake(run, got, (q, k, v, o, lse2, do), ref, causal, s, scale, what)
    passed("my_attention_backward launches your Delta kernel, your dK/dV kernel over key blocks and your dQ kernel "
           "over query blocks, and its gradients pass the rule for odd sizes, causal and not, views, float32 and "
           "float16")


def _check_returned(got, inputs, what):
    """Raise the ExerciseError for gradients ``got`` not of the shapes and dtypes of ``inputs`` (q, k, v)."""
    for grad, like, label in zip(got, inputs, ("dq", "dk", "dv")):
        if not isinstance(grad, torch.Tensor) or tuple(grad.shape) != tuple(like.shape):
            shape = tuple(grad.shape) if isinstance(grad, torch.Tensor) else type(grad).__name__
            raise ExerciseError(f"{label} has shape {shape} ({what}); expected {tuple(like.shape)}, "
                                f"the shape of {label[1:]}")
        if grad.dtype != like.dtype:
            raise ExerciseError(f"{label} is {grad.dtype} for {like.dtype} inputs ({what}): return each "
                                f"gradient in its input's dtype. The kernels accumulate in float32 on chip and "
                                f"each tile is written once, so allocating {label} like {label[1:]} loses nothing.")


def _right(got, ref):
    """Whether the gradients ``got`` are within the launcher check's tolerance of ``ref``, the float64 ones."""
    return all(close(a, r, atol=3e-3 * (1 + r.abs().max().item()), rtol=1e-2) for a, r in zip(got, ref))


def _grid_stops_at(grad, want, n):
    """Where a grid that stops one block or more early leaves the gradient ``grad`` of a
    (B, H, n, D) tensor: the first position wrong against ``want`` (in some batch and head), if it
    is past 0 and a multiple of 16 (the smallest block) and every position from it on is wrong too;
    else None. The rows past the grid hold whatever the allocation held, so a row that is 0 in
    ``want`` (a key no query sees) may be right by chance and is not asked to be wrong."""
    want = want.cpu()
    tol = 3e-3 * (1 + want.abs().max().item())
    wrong = (~((grad.double().cpu() - want).abs() <= tol).all(-1)).reshape(-1, n).any(0)
    zero = (want.abs() <= tol).all(-1).reshape(-1, n).all(0)
    if not wrong.any():
        return None
    first = int(wrong.nonzero()[0])
    if first > 0 and first % 16 == 0 and (wrong | zero)[first:].all():
        return first
    return None


def _name_launcher_mistake(run, got, tensors, ref, causal, s, scale, what):
    """Raise the ExerciseError that names what the launcher got wrong on this case."""
    q, k, v, o, lse2, do = tensors
    if not all(t.is_contiguous() for t in (q, k, v, o, do)):
        again = run(*(t.contiguous() for t in tensors))
        if _right(again, ref):
            raise ExerciseError(f"right on contiguous tensors, wrong on non-contiguous views ({what}): pass each "
                                "tensor's own strides (*x.stride()) for every pointer a kernel gets, never "
                                "another tensor's or strides computed from the shape.")
    for label, grad, want, n, blocks in (("dK and dV", got[1], ref[1], k.shape[2], "key block (cdiv(N_kv, BLOCK_KV) programs)"),
                                        ("dQ", got[0], ref[0], q.shape[2], "query block (cdiv(N_q, BLOCK_Q) programs)")):
        first = _grid_stops_at(grad, want, n)
        if first is not None:
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
    for label, a, r in zip(("dQ", "dK", "dV"), got, ref):
        expect_close(f"{label} of {what}", a, r, atol=3e-3 * (1 + r.abs().max().item()), rtol=1e-2, heatmap=True)
    raise ExerciseError(f"the gradients are wrong ({what}): they fail the rule against float64.")
