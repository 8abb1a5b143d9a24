"""A 5-matmul backward whose dQ is added into memory by TMA reduce-adds (sm_90), against the
package's backward, cuDNN and FlashAttention-2 in SDPA, side by side. Needs a CUDA GPU of compute
capability 9.

    python experiments/bwd_tma_dq.py [--out results.csv] [--quick]

The package's backward computes dQ in a kernel of its own (7 tile matmuls per pair of blocks, each
output element written by one program: bit-identical from run to run). Here one program per key
block also computes its share dS·K of dQ (the fifth matmul) and adds the whole (BLOCK_Q, D) tile
into a float32 buffer with one bulk TMA reduction (``cp.reduce.async.bulk.tensor.add``, which
Triton emits for ``descriptor.atomic_add`` on sm_90), issued asynchronously. An earlier variant
added dQ element by element (``tl.atomic_add``) and was slower than the package's pair
(docs/performance.md, "Tried, measured, and left out"); this one asks whether the bulk reduction,
FlashAttention-3's way, changes that. The order of the additions varies from run to run, so dQ is
not bit-identical. Only the plain case: no window, mask, packed batch or grouped heads; N a
multiple of the tiles; 16-bit inputs; head dim 64 or 128.
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
def _key_block_step(dk, dv, k, v, Q, dO, LSE2, Delta, DQ, q_lo, q_hi, row0, stride_n, offs_kv, offs_d, HEAD_DIM,
                    qk_scale, scale, BLOCK_Q: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
    """dK, dV of one key block over the query blocks [q_lo, q_hi); dQ's shares reduce-added."""
    for q_start in range(q_lo, q_hi, BLOCK_Q):
        q_start = tl.multiple_of(q_start, BLOCK_Q)
        offs_q = q_start + tl.arange(0, BLOCK_Q)
        q = tl.load(Q + offs_q[:, None] * stride_n + offs_d[None, :])
        do = tl.load(dO + offs_q[:, None] * stride_n + offs_d[None, :])
        lse2 = tl.load(LSE2 + offs_q)
        delta = tl.load(Delta + offs_q)
        sT = tl.dot(k, tl.trans(q))                                   # S^T / scale
        pT = tl.exp2(sT * qk_scale - lse2[None, :])                   # P^T from the LSE
        if MASKED:  # the diagonal block: keys after the query get probability 0
            pT = tl.where(offs_q[None, :] >= offs_kv[:, None], pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv)                          # dV += P^T dO
        dpT = tl.dot(v, tl.trans(do))                                 # dP^T = V dO^T
        dsT = (pT * (dpT - delta[None, :])).to(q.dtype)               # dS^T
        dk = tl.dot(dsT, q, dk)                                       # dK += dS^T Q
        dq = tl.dot(tl.trans(dsT), k)                                 # this block's share of dQ / scale
        if TMA:
            DQ.atomic_add([row0 + q_start, 0], dq * scale)            # one bulk reduction
        else:  # element by element, where there is no TMA (Triton's interpreter, for checking)
            tl.atomic_add(DQ + (row0 + offs_q)[:, None] * HEAD_DIM + offs_d[None, :], dq * scale, sem="relaxed")
    return dk, dv


@triton.jit
def delta_kernel(O, dO, Delta, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """Delta_i = sum_d dO_id O_id for BLOCK rows of contiguous (rows, HEAD_DIM) tensors."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs = rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    o = tl.load(O + offs).to(tl.float32)
    do = tl.load(dO + offs).to(tl.float32)
    tl.store(Delta + rows, tl.sum(o * do, 1))


@triton.jit
def bwd_fused(Q, K, V, dO, LSE2, Delta, dK, dV, DQ, stride_b, stride_h, stride_n, n_heads, n, qk_scale, scale,
              HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, IS_CAUSAL: tl.constexpr,
              TMA: tl.constexpr):
    kv_block, head, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    base = batch.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h
    Q += base
    K += base
    V += base
    dO += base
    dK += base
    dV += base
    row0 = (batch * n_heads + head) * n                                # this head's rows of DQ, LSE
    LSE2 += row0
    Delta += row0
    kv_start = kv_block * BLOCK_KV
    offs_kv = kv_start + tl.arange(0, BLOCK_KV)
    offs_d = tl.arange(0, HEAD_DIM)
    k = tl.load(K + offs_kv[:, None] * stride_n + offs_d[None, :])
    v = tl.load(V + offs_kv[:, None] * stride_n + offs_d[None, :])
    dk = tl.zeros([BLOCK_KV, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_KV, HEAD_DIM], dtype=tl.float32)
    if IS_CAUSAL:  # queries before the block see none of it; the diagonal blocks are masked
        dk, dv = _key_block_step(dk, dv, k, v, Q, dO, LSE2, Delta, DQ, kv_start, kv_start + BLOCK_KV, row0,
                                 stride_n, offs_kv, offs_d, HEAD_DIM, qk_scale, scale, BLOCK_Q, True, TMA)
        q_lo = kv_start + BLOCK_KV
    else:
        q_lo = 0
    dk, dv = _key_block_step(dk, dv, k, v, Q, dO, LSE2, Delta, DQ, q_lo, n, row0,
                             stride_n, offs_kv, offs_d, HEAD_DIM, qk_scale, scale, BLOCK_Q, False, TMA)
    tl.store(dK + offs_kv[:, None] * stride_n + offs_d[None, :], (dk * scale).to(dK.dtype.element_ty))
    tl.store(dV + offs_kv[:, None] * stride_n + offs_d[None, :], dv.to(dV.dtype.element_ty))


def backward(q, k, v, o, lse, do, causal, config):
    """(dq, dk, dv) of contiguous (B, H, N, D) tensors; ``lse`` the forward's natural-log LSE."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    batch, heads, n, d = q.shape
    scale = 1.0 / math.sqrt(d)
    block_q, block_kv, warps, stages = config
    assert n % block_kv == 0 and n % block_q == 0 and block_kv % block_q == 0
    lse2 = (lse.float() * LOG2E).contiguous()
    delta = torch.empty(batch, heads, n, device=q.device, dtype=torch.float32)
    delta_kernel[(batch * heads * n // 64,)](o, do, delta, HEAD_DIM=d, BLOCK=64)
    dq32 = torch.zeros(batch * heads * n, d, device=q.device, dtype=torch.float32)
    tma = q.is_cuda  # Triton's interpreter has no TMA reduction: element-wise atomics there
    desc = TensorDescriptor.from_tensor(dq32, [block_q, d]) if tma else dq32
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    compiled = bwd_fused[(n // block_kv, heads, batch)](
        q, k, v, do, lse2, delta, dk, dv, desc, q.stride(0), q.stride(1), q.stride(2), heads, n,
        scale * LOG2E, scale, HEAD_DIM=d, BLOCK_Q=block_q, BLOCK_KV=block_kv, IS_CAUSAL=causal, TMA=tma,
        num_warps=warps, num_stages=stages)
    LAST["spills"] = getattr(compiled, "n_spills", None)
    return dq32.view(batch, heads, n, d).to(q.dtype), dk, dv


LAST = {}  # the spills of the last compiled kernel
CONFIGS = {64: [(64, 128, 8, 2), (32, 128, 4, 2), (64, 64, 4, 2), (64, 128, 4, 2), (32, 64, 4, 3)],
           128: [(64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2), (64, 128, 8, 3)]}


def flops(batch, heads, n, d, causal):
    return 4 * batch * heads * n * n * d * (0.5 if causal else 1.0) * 2.5


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bwd_tma_dq.csv")
    parser.add_argument("--quick", action="store_true", help="N 4096 and 8192 only")
    args = parser.parse_args(argv)
    import flashattn
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    gpu = torch.cuda.get_device_name()
    versions = f"torch {torch.__version__} triton {triton.__version__}"
    print(gpu, versions, flush=True)
    rows = []
    batch, heads = 4, 32
    for dtype in (torch.bfloat16,):
        for d in (64, 128):
            for causal in (True, False):
                for n in ((4096, 8192) if args.quick else (4096, 8192, 16384)):
                    torch.manual_seed(0)
                    q, k, v = (torch.randn(batch, heads, n, d, device="cuda", dtype=dtype, requires_grad=True)
                               for _ in range(3))
                    do = torch.randn_like(q)
                    out, lse = flashattn.attention(q, k, v, is_causal=causal, return_lse=True)
                    times = {}

                    def autograd_time(name, y):
                        torch.autograd.grad(y, (q, k, v), do, retain_graph=True)
                        times[name] = triton.testing.do_bench(
                            lambda: torch.autograd.grad(y, (q, k, v), do, retain_graph=True))
                    autograd_time("flashattn", out)
                    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                                          ("fa2", SDPBackend.FLASH_ATTENTION)):
                        with sdpa_kernel(backend):
                            autograd_time(name, sdpa(q, k, v, is_causal=causal))
                    # the package's gradients (deterministic) are the check: same inputs, same LSE
                    ref = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
                    best = None
                    for config in CONFIGS[d]:
                        try:
                            grads = backward(q.detach(), k.detach(), v.detach(), out.detach(), lse, do, causal, config)
                            ms = triton.testing.do_bench(lambda: backward(q.detach(), k.detach(), v.detach(),
                                                                          out.detach(), lse, do, causal, config))
                        except Exception as error:  # a configuration that does not compile or fit
                            print(f"  {config}: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
                            continue
                        err = max(float((g.float() - r.float()).abs().max() / r.float().abs().max())
                                  for g, r in zip(grads, ref))
                        print(f"  {config}: {ms:.3f} ms, {LAST.get('spills')} spills, largest difference to the "
                              f"package's gradients {err:.2e} of their largest element", flush=True)
                        if err < 2e-2 and (best is None or ms < best[0]):
                            best = (ms, config, err)
                    f = flops(batch, heads, n, d, causal)
                    row = dict(gpu=gpu, versions=versions, dtype="bf16", head_dim=d, causal=causal, n=n,
                               batch=batch, heads=heads,
                               **{f"{name}_ms": round(ms, 4) for name, ms in times.items()},
                               tma_dq_ms=round(best[0], 4) if best else "", tma_dq_config=best[1] if best else "",
                               tma_dq_rel_diff=f"{best[2]:.2e}" if best else "")
                    rows.append(row)
                    line = "  ".join(f"{name} {f / ms / 1e9:6.1f}" for name, ms in times.items())
                    # speed ratios (time of the other / time of the variant): above 1 is faster
                    tma = f"tma-dQ {f / best[0] / 1e9:6.1f} ({times['cudnn'] / best[0]:.2f}x cuDNN's speed, " \
                          f"{times['flashattn'] / best[0]:.2f}x the package's)" if best else "tma-dQ none"
                    print(f"D={d} causal={causal} N={n}: TFLOPS {line}  {tma}", flush=True)
                    del q, k, v, do, out, lse
    with open(args.out, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
