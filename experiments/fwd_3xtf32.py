"""float32 attention forward on tensor cores with 3xTF32 split by hand, against the package's
IEEE float32 forward and SDPA's float32, side by side: speed, and error against float64 next to
SDPA's own. Needs a CUDA GPU with TF32 (sm_80 or newer).

    python experiments/fwd_3xtf32.py [--out results.csv]

TF32 keeps 10 of float32's 23 mantissa bits. 3xTF32 writes each operand as ``x = hi + lo``, ``hi``
being x with its 13 low mantissa bits cleared (exactly a TF32 number) and ``lo = x - hi`` (exact
in float32), and sums three tensor-core products ``hi·lo + lo·hi + hi·hi`` (``lo·lo``, about
2^-22 of the product, is left out). Triton can do this itself (``input_precision="tf32x3"``); with
Triton 3.6 on an H200 some of its tiles gave wrong gradients and others an illegal memory access
(docs/performance.md), so the package multiplies float32 in IEEE (fused multiply-adds, no tensor
cores) at 'highest'. This script asks what the split by hand, three plain TF32 dots, would give
the forward. Only the plain case: causal or not, N a multiple of the tiles, head dim 64 or 128.
"""
import argparse
import csv
import math
import sys

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def split_tf32(x):
    """``(hi, lo)`` with ``hi`` x's TF32 part (13 low mantissa bits cleared) and ``lo = x - hi``."""
    hi = (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def dot_3xtf32(a, b):
    """``a @ b`` of float32 tiles from three TF32 products, the small ones summed first."""
    a_hi, a_lo = split_tf32(a)
    b_hi, b_lo = split_tf32(b)
    small = tl.dot(a_lo, b_hi, tl.dot(a_hi, b_lo, input_precision="tf32"), input_precision="tf32")
    return tl.dot(a_hi, b_hi, small, input_precision="tf32")


@triton.jit
def _fwd_steps(acc, m, l, q, K, V, kv_lo, kv_hi, offs_q, offs_d, stride_n, qk_scale,
               BLOCK_KV: tl.constexpr, MASKED: tl.constexpr):
    for kv_start in range(kv_lo, kv_hi, BLOCK_KV):
        offs_kv = kv_start + tl.arange(0, BLOCK_KV)
        k = tl.load(K + offs_kv[:, None] * stride_n + offs_d[None, :])
        v = tl.load(V + offs_kv[:, None] * stride_n + offs_d[None, :])
        s = dot_3xtf32(q, tl.trans(k)) * qk_scale                      # base-2 scores
        if MASKED:
            s = tl.where(offs_q[:, None] >= offs_kv[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot_3xtf32(p, v)                 # the tile summed, then added
        m = m_new
    return acc, m, l


@triton.jit
def fwd_3xtf32(Q, K, V, O, stride_b, stride_h, stride_n, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, IS_CAUSAL: tl.constexpr):
    q_block, head, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if IS_CAUSAL:  # the last query blocks see the most keys: start them first
        q_block = tl.num_programs(0) - 1 - q_block
    base = batch.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h
    Q += base
    K += base
    V += base
    O += base
    q_start = q_block * BLOCK_Q
    offs_q = q_start + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + offs_q[:, None] * stride_n + offs_d[None, :])
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], dtype=tl.float32)
    m = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_Q], dtype=tl.float32)
    if IS_CAUSAL:  # whole tiles below the diagonal, then the diagonal's (BLOCK_KV divides BLOCK_Q)
        acc, m, l = _fwd_steps(acc, m, l, q, K, V, 0, q_start, offs_q, offs_d, stride_n, qk_scale,
                               BLOCK_KV, False)
        acc, m, l = _fwd_steps(acc, m, l, q, K, V, q_start, q_start + BLOCK_Q, offs_q, offs_d, stride_n,
                               qk_scale, BLOCK_KV, True)
    else:
        acc, m, l = _fwd_steps(acc, m, l, q, K, V, 0, tl.num_programs(0) * BLOCK_Q, offs_q, offs_d, stride_n,
                               qk_scale, BLOCK_KV, False)
    tl.store(O + offs_q[:, None] * stride_n + offs_d[None, :], acc / l[:, None])


def forward(q, k, v, causal, config):
    batch, heads, n, d = q.shape
    block_q, block_kv, warps, stages = config
    assert n % block_q == 0 and block_q % block_kv == 0
    o = torch.empty_like(q)
    compiled = fwd_3xtf32[(n // block_q, heads, batch)](
        q, k, v, o, q.stride(0), q.stride(1), q.stride(2), LOG2E / math.sqrt(d),
        HEAD_DIM=d, BLOCK_Q=block_q, BLOCK_KV=block_kv, IS_CAUSAL=causal, num_warps=warps, num_stages=stages)
    LAST["spills"] = getattr(compiled, "n_spills", None)
    return o


LAST = {}
CONFIGS = [(64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 8, 2), (128, 64, 8, 2), (64, 32, 4, 3), (32, 32, 4, 2)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="fwd_3xtf32.csv")
    args = parser.parse_args(argv)
    import flashattn
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    torch.set_float32_matmul_precision("highest")
    gpu, versions = torch.cuda.get_device_name(), f"torch {torch.__version__} triton {triton.__version__}"
    print(gpu, versions, flush=True)
    rows = []
    batch, heads, n = 1, 256, 4096
    for d in (64, 128):
        for causal in (True, False):
            torch.manual_seed(0)
            q, k, v = (torch.randn(batch, heads, n, d, device="cuda") for _ in range(3))
            flops = 4 * batch * heads * n * n * d * (0.5 if causal else 1.0)
            # error against float64 on the first 8 heads (a float64 reference of all 256 is slow)
            few = [t[:, :8].double() for t in (q, k, v)]
            ref = sdpa(*few, is_causal=causal)
            err = lambda o: float((o[:, :8].double() - ref).abs().max())  # noqa: E731
            results = {}
            for name, fn in (("sdpa", lambda: sdpa(q, k, v, is_causal=causal)),
                             ("flashattn-ieee", lambda: flashattn.attention(q, k, v, is_causal=causal))):
                out = fn()
                results[name] = (triton.testing.do_bench(fn), err(out), None)
            for config in CONFIGS:
                try:
                    out = forward(q, k, v, causal, config)
                    ms = triton.testing.do_bench(lambda: forward(q, k, v, causal, config))
                except Exception as error:  # a configuration that does not compile or fit
                    print(f"  {config}: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
                    continue
                results[f"3xtf32 {config}"] = (ms, err(out), LAST.get("spills"))
            for name, (ms, e, spills) in results.items():
                ratio = results["sdpa"][0] / ms
                print(f"D={d} causal={causal} N={n} heads={heads}  {name:28} {ms:8.3f} ms {flops / ms / 1e9:6.1f} "
                      f"TFLOPS  {ratio:4.2f}x SDPA's speed  max error {e:.2e} (SDPA's {results['sdpa'][1]:.2e})"
                      + (f"  {spills} spills" if spills is not None else ""), flush=True)
                rows.append(dict(gpu=gpu, versions=versions, head_dim=d, causal=causal, n=n, batch=batch,
                                 heads=heads, provider=name, ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1),
                                 max_error=f"{e:.3e}", sdpa_max_error=f"{results['sdpa'][1]:.3e}",
                                 spills=spills if spills is not None else ""))
            del q, k, v
    with open(args.out, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
