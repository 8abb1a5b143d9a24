"""Benchmark ring attention (``flashattn.distributed.ring_attention``) forward + backward at long
sequences, against PyTorch's ``context_parallel`` with SDPA at the same sizes: tokens per second
per GPU, at 1, 2, 4 or more GPUs.

    torchrun --nproc-per-node 1 -m flashattn.measure.ring --out ring.csv    # the one-GPU baseline
    torchrun --nproc-per-node 4 -m flashattn.measure.ring --out ring.csv    # appends 4 GPUs' rows

Every rank builds the same whole q, k, v (seeded) for each sequence length ``N`` and times one
forward + backward of the whole sequence split over the ranks: ``ring`` takes its shard in the
layout asked for (``--layout``) and calls ``ring_attention``; ``context_parallel`` shards the
same tensors with PyTorch's context manager (its head-tail layout, the zigzag one) and calls
``F.scaled_dot_product_attention`` inside it, which PyTorch turns into its own ring
(``--cp-rotate`` picks its rotation, all-gather by default). Tokens per second per GPU is
``B * N / time / world``: flat when the scaling is perfect. Rank 0 appends one row per
(provider, N) to the CSV. Without a GPU it runs on gloo and Triton's interpreter at tiny sizes
(``--seq-lens 64``), where only ``ring`` exists (PyTorch's context_parallel SDPA needs CUDA).
"""
import argparse
import csv
import datetime
import os
import time

import torch
import torch.distributed as dist

FIELDS = ["gpu", "torch", "triton", "date", "world", "provider", "layout", "dtype", "causal", "batch", "heads",
          "kv_heads", "head_dim", "seq_len", "ms", "tokens_per_s_per_gpu", "peak_gib"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PROVIDERS = ("ring", "context_parallel")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 32768, 65536, 131072],
                        help="whole sequence lengths N (each a multiple of 2 x world for zigzag)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=None, help="K/V heads (default: --heads)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--no-causal", dest="causal", action="store_false", help="no causal mask")
    parser.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--cp-rotate", choices=["allgather", "alltoall"], default="allgather",
                        help="context_parallel's rotation of the K/V shards")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default="ring.csv", help="the CSV rank 0 appends to")
    args = parser.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    if args.heads % args.kv_heads:
        parser.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    return args


def tokens_per_s_per_gpu(batch, seq_len, ms, world):
    """Tokens of the whole sequence per second, per GPU: ``batch * seq_len / time / world``."""
    return batch * seq_len / (ms * 1e-3) / world


def write_rows(path, rows):
    """Append ``rows`` (dicts with the keys of FIELDS) to the CSV at ``path``, with a header if
    the file is new."""
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        writer.writerows(rows)


def machine():
    """gpu, torch and triton of the CSV's rows."""
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                date=datetime.date.today().isoformat())


def time_ms(step, warmup, repeats, device):
    """The median time of ``step()`` in ms over ``repeats`` runs after ``warmup``, every rank
    starting each run together (a barrier) and the slowest rank's time counted."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item() * 1e3)
    return sorted(times)[len(times) // 2]


def whole_inputs(args, n, device):
    g = torch.Generator(device=device).manual_seed(n)
    dtype = DTYPES[args.dtype]
    shape_q, shape_kv = (args.batch, args.heads, n, args.head_dim), (args.batch, args.kv_heads, n, args.head_dim)
    q = torch.randn(shape_q, generator=g, device=device).to(dtype)
    k, v = (torch.randn(shape_kv, generator=g, device=device).to(dtype) for _ in range(2))
    do = torch.randn(shape_q, generator=g, device=device).to(dtype)
    return q, k, v, do


def ring_step(args, n, device):
    """One forward + backward of ring_attention on this rank's shards (the whole tensors are
    dropped once cut, so that the memory measured is the shards' and the ring's)."""
    from ..distributed import ring_attention, shard

    whole = whole_inputs(args, n, device)
    local = [shard(t, layout=args.layout).requires_grad_() for t in whole[:3]]
    do_local = shard(whole[3], layout=args.layout)
    del whole

    def step():
        for t in local:
            t.grad = None
        out = ring_attention(*local, is_causal=args.causal, layout=args.layout,
                             enable_gqa=args.kv_heads != args.heads)
        out.backward(do_local)
    return step


def context_parallel_run(args, n, device, world):
    """Time one forward + backward of SDPA under PyTorch's context_parallel, which shards q, k, v
    and the upstream gradient in place (head-tail) while the context is open (their storage stays
    the whole tensors' size, which the peak memory then includes)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.functional import scaled_dot_product_attention

    try:
        from torch.distributed.tensor.experimental._attention import set_rotate_method
        set_rotate_method(args.cp_rotate)
    except ImportError:  # an older or newer PyTorch: its default rotation
        pass
    mesh = init_device_mesh(device.type, (world,))
    buffers = list(whole_inputs(args, n, device))
    gqa = dict(enable_gqa=True) if args.kv_heads != args.heads else {}  # passed only when needed
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(buffers)):
        local = [t.requires_grad_() for t in buffers[:3]]

        def step():
            for t in local:
                t.grad = None
            out = scaled_dot_product_attention(*local, is_causal=args.causal, **gqa)
            out.backward(buffers[3])
        return time_ms(step, args.warmup, args.repeats, device)


def main(argv=None):
    args = parse_args(argv)
    if not dist.is_initialized():  # torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    import flashattn

    device = flashattn.DEVICE if flashattn.DEVICE.type == "cpu" else torch.device("cuda", torch.cuda.current_device())
    rank, world = dist.get_rank(), dist.get_world_size()
    meta = dict(machine(), world=world, layout=args.layout, dtype=args.dtype, causal=int(args.causal),
                batch=args.batch, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim)
    rows = []
    for n in args.seq_lens:
        for provider in args.providers:
            if provider == "context_parallel" and device.type != "cuda":
                if rank == 0:
                    print(f"N = {n}: context_parallel skipped (its SDPA needs CUDA)")
                continue
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            if provider == "ring":
                step = ring_step(args, n, device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                ms = time_ms(step, args.warmup, args.repeats, device)
                del step
            else:
                ms = context_parallel_run(args, n, device, world)
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
            row = dict(meta, provider=provider, layout=args.layout if provider == "ring" else "head-tail",
                       seq_len=n, ms=f"{ms:.4f}", peak_gib=f"{peak:.2f}",
                       tokens_per_s_per_gpu=f"{tokens_per_s_per_gpu(args.batch, n, ms, world):.6g}")
            rows.append(row)
            if rank == 0:
                print(f"{provider:>16} world {world} N {n:7}: {ms:9.2f} ms, "
                      f"{float(row['tokens_per_s_per_gpu']):12.1f} tokens/s per GPU, peak {peak:.2f} GiB", flush=True)
    if rank == 0:
        write_rows(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
