"""The elementwise math of the Gluon kernels' score tiles: a softcap's tanh, ALiBi's biases, and
exp2 on the FMA units.

``modified_scores`` is the Gluon twin of ``flashattn.kernels.tiles.modified_scores`` (the forward and
both backward kernels of ``flashattn.hopper`` call it); ``exp2_fma`` is the forward's ``EXP2_FMA``
path. Like the rest of the package, nothing here is defined for the interpreter: it is imported
with the kernels (``flashattn.hopper.load``).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def exp2_fma(x):
    """2**x for x <= 0 without the special-function unit: 2**n * 2**f, n = round(x), f in [-0.5, 0.5].

    exp2 normally runs on the special-function unit (MUFU), which does 16 per clock and SM where
    the FMA units do 128; at head dim 64 a tile has as many exponentials as at 128 for half the
    matmul work, so MUFU can become the bottleneck (FlashAttention-4 moves part of them to FMAs).
    ``floor`` and a float-to-int conversion would run on that same 16-per-clock unit, so n comes
    from adding 1.5 * 2**23, which leaves round(x) in the sum's low mantissa bits, shifted into the
    exponent field of 2**f by one integer add. 2**f is a degree-4 polynomial (relative error 3e-6,
    far below P's 16-bit rounding). x = -inf is clamped to -127: n = -127, f = 0, the result 0."""
    x = gl.maximum(x, -127.0)
    j = x + 12582912.0  # 1.5 * 2**23: j's mantissa ends in round(x), two's complement
    f = x - (j - 12582912.0)
    p = f * 0.00960045028 + 0.0559169091
    p = p * f + 0.240237176
    p = p * f + 0.69312197
    p = p * f + 1.0
    bits = p.to(gl.int32, bitcast=True) + (j.to(gl.int32, bitcast=True) << 23)
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def tanh(x, APPROX: gl.constexpr):
    """tanh in float32: with APPROX (:data:`TANH_APPROX`) ``tanh.approx.f32``, else within a few ulps
    (``tiles.tanh``'s formula, with an approximate division, ``div.full``: 2 ulps)."""
    if APPROX:
        return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32,
                                         is_pure=True, pack=1)
    ax = gl.abs(x)
    e = gl.exp2(ax * -2.8853900817779268)  # exp(-2|x|)
    big = gl.fdiv(1.0 - e, 1.0 + e)
    x2 = x * x
    small = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
        -0.05396825396825397 + x2 * 0.021869488536155203))))
    t = gl.where(ax < 0.25, small, big)
    return gl.where(x < 0, -t, t)


@gluon.jit
def capped(s, qk_scale, softcap, TANH_APPROX: gl.constexpr):
    """The softcap's ``tanh(scale * s / softcap)``: base-2 scores are it times ``softcap * log2(e)``."""
    return tanh(s * (qk_scale * 0.6931471805599453 / softcap), TANH_APPROX)


@gluon.jit
def modified_scores(s, rows, cols, qk_scale, softcap, slope, shift, SOFTCAP: gl.constexpr,
                    ALIBI: gl.constexpr, TANH_APPROX: gl.constexpr):
    """``(S2, dcap)``: raw scores ``s`` turned into base-2 scores, ``log2(e) * (softcap(scale * s)
    - slope * |i + shift - j|)``, and the softcap's factor on dS (``1 - tanh**2``, 1 without it),
    as ``flashattn.kernels.tiles.modified_scores`` computes them (``rows``/``cols`` broadcast to
    the tile either way round)."""
    if SOFTCAP:
        t = capped(s, qk_scale, softcap, TANH_APPROX)
        s2 = t * (softcap * 1.4426950408889634)
        dcap = 1.0 - t * t
    else:
        s2 = s * qk_scale
        dcap = 1.0
    if ALIBI:  # rows and columns converted once, not every pair's integer distance (exact < 2**24)
        s2 = s2 - (slope * 1.4426950408889634) * gl.abs((rows + shift).to(gl.float32) - cols.to(gl.float32))
    return s2, dcap
