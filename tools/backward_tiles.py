"""Time tile configurations of the fused Gluon backward (flashattn.hopper.backward, DQ variant) on
a Hopper GPU: the kernel alone (with the zeroing of dQ's accumulator) and the whole
``attention_backward`` (with dQ's scaling and cast), bf16, B = 4, H = 32, N = 8192; with ``--fwd``,
the Gluon forward's variants at head dim 64 beside cuDNN's forward.

    python tools/backward_tiles.py '{"64": [{}, {"BLOCK_M": 128}], "128": [{}]}' [--fwd]
"""
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from flashattn.hopper import backward as hb  # noqa: E402
from flashattn.kernels.forward import attention_forward  # noqa: E402
from flashattn.measure.bench import attention_flops  # noqa: E402

plan = json.loads(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] != "--fwd" else {"64": [{}], "128": [{}]}
print("GPU", torch.cuda.get_device_name(), "| torch", torch.__version__, "| triton", triton.__version__, flush=True)
for head_dim, cfgs in ((int(d), c) for d, c in plan.items()):
    for causal in (False, True):
        B, H, N = 4, 32, 8192
        q, k, v, do = (torch.randn(B, H, N, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        o, lse2 = attention_forward(q, k, v, causal, head_dim ** -0.5)
        delta = (o.float() * do.float()).sum(-1)
        tf = attention_flops(B, H, N, N, head_dim, causal, "bwd") * 1e-9
        for cfg in cfgs:
            try:
                whole = triton.testing.do_bench(
                    lambda: hb.attention_backward(q, k, v, do, lse2, delta, causal, head_dim ** -0.5, cfg),
                    return_mode="median")
                acc = torch.zeros(q.shape, device="cuda")
                kernel = triton.testing.do_bench(
                    lambda: hb._launch(q, k, v, do, lse2, delta, causal, head_dim ** -0.5,
                                       hb.dq_config(head_dim, cfg), acc), return_mode="median")
                print(f"D{head_dim} causal={int(causal)} {json.dumps(cfg):40} whole {tf / whole:4.0f} TFLOPS, "
                      f"kernel {tf / kernel:4.0f}", flush=True)
            except Exception as e:  # a configuration that does not compile or fit
                print(f"D{head_dim} causal={int(causal)} {json.dumps(cfg):40} ERROR {str(e)[:300]}", flush=True)

# The forward's variants at head dim 64 (flashattn.hopper.forward overrides) beside cuDNN's forward.
if "--fwd" in sys.argv:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from flashattn.hopper import forward as hf
    for n in (4096, 8192):
        for causal in (False, True):
            B, H = 4, 32
            q, k, v = (torch.randn(B, H, n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            tf = attention_flops(B, H, n, n, 64, causal, "fwd") * 1e-9
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ref = triton.testing.do_bench(lambda: sdpa(q, k, v, is_causal=causal), return_mode="median")
            row = [f"fwd D64 N{n} causal={int(causal)} cudnn {tf / ref:4.0f}"]
            for cfg in ({}, {"EXP2_FMA": 2}, {"EXP2_FMA": 3}, {"STAGES": 3}, {"PINGPONG": True}, {"BLOCK_N": 64}):
                try:
                    ms = triton.testing.do_bench(lambda: hf.attention_forward(q, k, v, causal, 0.125, cfg),
                                                 return_mode="median")
                    row.append(f"{json.dumps(cfg)} {tf / ms:4.0f} ({ref / ms:.2f}x)")
                except Exception as e:
                    row.append(f"{json.dumps(cfg)} ERROR {str(e)[:80]}")
            print(" | ".join(row), flush=True)
