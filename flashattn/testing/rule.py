"""How the course decides that a kernel is right: the tolerance rule shared by tests and notebooks.

A kernel in float16 cannot match a float64 reference exactly, and a fixed ``atol`` is either too
loose for small values or too tight for large ones. The rule used by the most trusted attention
libraries is relative to what PyTorch itself achieves:

    error(ours vs float64)  <=  factor * error(plain PyTorch in the same dtype vs float64) + floor

with ``factor = 2`` for the output and the LSE and ``3`` for the gradients, and a small ``floor``
(a few units of the dtype's rounding at the size of the values) so that a case where PyTorch is
exact by luck does not demand the impossible. Errors are the largest absolute difference.

For the gradients the floor is taken at least at the size of the upstream gradient dO, of which
they are a linear function. They pass through ``dP - Delta``, where FlashAttention computes
``Delta = rowsum(dO * O)`` and PyTorch's autograd ``rowsum(P * dP)``: equal in exact arithmetic,
but summed differently. Where a row sees a single key the difference is exactly 0, so PyTorch's
dQ and dK are exact, while flashattn's carry roundings at the size of dO.
"""
import contextlib
from dataclasses import dataclass

import torch

from ..ops.attention import attention
from .reference import naive_attention
from ..gpu.configs import dot_precision

FACTORS = {"out": 2.0, "lse": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}
#: Unit roundoff of each dtype.
EPS = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}
#: Unit roundoff of float32 inputs by how the kernels multiply them (``configs.dot_precision``).
#: TF32 ('high', 'medium') keeps 10 of float32's 23 mantissa bits in every matmul operand, so the
#: kernels' float32 error is TF32's, not float32's. PyTorch's own float32 attention is no fair
#: baseline then: cuBLAS picks TF32 only for some shapes (on an H200, not for the short sequences
#: of the test grid, where its error stays at float32's size and the kernels' missed 2x of it by
#: 100-3000x). So with TF32 the baseline is PyTorch on inputs rounded to TF32 (what a TF32 matmul
#: does to its operands), and the floor is at TF32's unit roundoff. IEEE float32 ('highest') and
#: the experimental 3xTF32 (FLASHATTN_TF32X3=1) are held to float32's rule.
DOT_EPS = {"tf32": 2.0 ** -11}
FLOOR_UNITS = 8  # the floor, in units of the unit roundoff times the largest reference magnitude


def unit_roundoff(dtype: torch.dtype) -> float:
    """The unit roundoff the rule uses for inputs of ``dtype``: the dtype's own, or TF32's for
    float32 where the kernels' matmuls use TF32 (see DOT_EPS)."""
    if dtype == torch.float32:
        return DOT_EPS.get(dot_precision(dtype), EPS[dtype])
    return EPS[dtype]


def round_to_tf32(t: torch.Tensor) -> torch.Tensor:
    """float32 ``t`` rounded to TF32 (10 mantissa bits, to nearest, ties away from zero), the
    precision a TF32 tensor core reads its operands in."""
    bits = t.contiguous().view(torch.int32)
    return ((bits + 0x1000) & -0x2000).view(torch.float32).view_as(t)


def baseline_inputs(*tensors):
    """The inputs of the plain-PyTorch baseline: as given, or rounded to TF32 where the kernels'
    float32 matmuls use TF32 (see DOT_EPS)."""
    if tensors and tensors[0].dtype == torch.float32 and unit_roundoff(torch.float32) == DOT_EPS["tf32"]:
        return [round_to_tf32(t) for t in tensors]
    return list(tensors)


@contextlib.contextmanager
def ieee_float32():
    """PyTorch's float32 matmuls in IEEE float32 within the block. The baseline's TF32 is the
    rounding of its inputs (:func:`baseline_inputs`), not what a backend makes of 'high' or
    'medium': on a CPU with bfloat16 matrix units (AMX), 'medium' multiplies float32 in bfloat16,
    whose error would let a kernel 1% off pass."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def max_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference, computed in float64; NaN anywhere gives NaN. Equal infinities
    (the lse -inf of a row that sees no key) count as exact; an infinity against anything else
    gives inf."""
    if x.numel() == 0:
        return 0.0
    x, ref = x.double(), ref.double()
    return (x - ref).abs().masked_fill(x == ref, 0.0).max().item()


def floor(ref: torch.Tensor, dtype: torch.dtype, at_least: float = 1.0) -> float:
    """The rule's floor: FLOOR_UNITS roundings (``unit_roundoff(dtype)``) at the magnitude of
    ``ref`` (or ``at_least``, if larger)."""
    finite = ref[torch.isfinite(ref)]  # an lse of -inf (a row without keys) sets no scale
    scale = finite.abs().max().item() if finite.numel() else 0.0
    return FLOOR_UNITS * unit_roundoff(dtype) * max(scale, at_least)


@dataclass
class Check:
    """One quantity compared under the rule."""
    name: str
    error: float        # ours against float64
    baseline: float     # plain PyTorch in the same dtype against float64
    bound: float        # factor * baseline + floor

    @property
    def ok(self) -> bool:
        return self.error <= self.bound  # False for NaN

    def __str__(self):
        verdict = "ok " if self.ok else "FAIL"
        return (f"{verdict} {self.name:>3}: error {self.error:.2e} <= {FACTORS[self.name]:.0f} x "
                f"PyTorch's {self.baseline:.2e} + floor = {self.bound:.2e}")


def _grads(out, lse, inputs, do, dlse):
    lse = lse.double()
    lse = torch.where(torch.isfinite(lse), lse, 0.0)  # an lse of -inf is a constant: no gradient
    loss = (out.double() * do).sum() + (lse * dlse).sum()
    return torch.autograd.grad(loss, inputs)


def compare_with_reference(q, k, v, is_causal=False, scale=None, backward=True, seed=0,
                           impl=attention, reference=naive_attention):
    """Run ``impl`` (flashattn.attention by default) and plain PyTorch on ``q, k, v`` (in their
    dtype), and a float64 reference.

    ``impl`` is called as ``impl(q, k, v, is_causal=..., scale=..., return_lse=True)``, and
    ``reference`` (the formula run in float64 and, as plain PyTorch, in the inputs' dtype) as
    ``reference(q, k, v, is_causal=..., scale=...)``; give both the same extra arguments (with
    ``functools.partial``) to check a variant such as ``enable_gqa`` or ``window_size``. Returns a
    list of :class:`Check` for out, lse and (with ``backward``) dq, dk, dv. The upstream gradients
    (for the output and for the LSE) are random, drawn from ``seed``.
    """
    dtype = q.dtype
    leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]
    ref64 = [t.detach().double().requires_grad_(backward) for t in (q, k, v)]
    base = [t.detach().clone().requires_grad_(backward) for t in baseline_inputs(q, k, v)]

    out, lse = impl(*leaves, is_causal=is_causal, scale=scale, return_lse=True)
    out_ref, lse_ref = reference(*ref64, is_causal=is_causal, scale=scale)
    with ieee_float32():
        out_pt, lse_pt = reference(*base, is_causal=is_causal, scale=scale)

    results = {"out": (out, out_ref, out_pt), "lse": (lse, lse_ref, lse_pt)}
    if backward:
        g = torch.Generator(device="cpu").manual_seed(seed)
        # Rounded to the dtype first, so that all three see exactly the same upstream gradients.
        do = torch.randn(out.shape, generator=g).to(dtype).double().to(q.device)
        dlse = torch.randn(lse.shape, generator=g).double().to(q.device)
        upstream = max_error(do, torch.zeros_like(do))  # the largest |dO|
        ours = _grads(out, lse, leaves, do, dlse)
        ref = _grads(out_ref, lse_ref, ref64, do, dlse)
        with ieee_float32():
            pt = _grads(out_pt, lse_pt, base, do, dlse)
        for i, name in enumerate(("dq", "dk", "dv")):
            results[name] = (ours[i], ref[i], pt[i])

    return judge({n: r[0] for n, r in results.items()}, {n: r[1] for n, r in results.items()},
                 {n: r[2] for n, r in results.items()}, dtype, upstream if backward else 1.0)


def judge(ours, ref64, pytorch, dtype, upstream=1.0):
    """The rule applied to dicts ``name -> tensor`` (names out, lse, dq, dk, dv): ours and plain
    PyTorch in ``dtype``, both against the float64 reference; ``upstream`` is the largest |dO|.
    Returns a list of :class:`Check`."""
    checks = []
    for name in ours:
        baseline = max_error(pytorch[name], ref64[name])
        at_least = max(upstream, 1.0) if name in ("dq", "dk", "dv") else 1.0
        bound = FACTORS[name] * baseline + floor(ref64[name], dtype, at_least)
        checks.append(Check(name, max_error(ours[name], ref64[name]), baseline, bound))
    return checks
