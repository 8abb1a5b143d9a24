"""What the ranks of chapter 13 run, and how the chapter checks what they return.

Each rank is a process that ``flashattn.distributed.launch`` starts, so what it runs must be a
function of a module (a notebook cell's function cannot be imported by another process): here.
A *case* is a dict (``n`` positions, ``heads``, ``kv_heads``, ``head_dim``, ``dtype``, ``causal``,
``layout``, ``seed``); every rank draws the same whole tensors from its seed, cuts its shard and
runs ring attention forward and backward on it, while the parent process draws them too and
computes attention over the whole sequence to compare with.
"""
import contextlib

import torch
import torch.distributed as dist

from ..distributed import join_shards, ring as ring_module, ring_attention, shard
from ..gpu.runtime import DEVICE
from ..ops.attention import attention
from ..testing.reference import masked_attention
from ..testing.rule import baseline_inputs, ieee_float32, judge, max_error


def case_inputs(case, device=DEVICE):
    """The whole q, k, v of a case, and the upstream gradients of its output and LSE (float64,
    the output's rounded to the dtype first): the same on every process."""
    g = torch.Generator().manual_seed(case["seed"])
    n, d, dtype = case["n"], case["head_dim"], case["dtype"]
    q = torch.randn(1, case["heads"], n, d, generator=g)
    k, v = (torch.randn(1, case["kv_heads"], n, d, generator=g) for _ in range(2))
    do = torch.randn(1, case["heads"], n, d, generator=g).to(dtype).double()
    dlse = torch.randn(1, case["heads"], n, generator=g).double()
    return [t.to(device) for t in (q.to(dtype), k.to(dtype), v.to(dtype), do, dlse)]


def loss_of(out, lse, do, dlse):
    """The scalar whose gradients every run compares: sum(O * dO) + sum(LSE * dLSE)."""
    lse = lse.double()
    return (out.double() * do).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse).sum()


class Recorder:
    """While open, records what the ring does on this rank, in order: ``events`` holds
    ``("post", bytes)`` for every transfer posted, ``("kernel", n_q, n_kv, causal)`` for every
    kernel call (forward or backward) and ``("wait",)`` for every wait on a transfer."""

    def __init__(self):
        self.events = []
        self.saved = (ring_module.attention_forward, ring_module.attention_backward,
                      ring_module.Ring.start, ring_module.Transfer.wait)

    def __enter__(self):
        forward, backward, start, wait = self.saved
        events = self.events

        def recorded_forward(q, k, v, causal, *args, **kwargs):
            events.append(("kernel", q.shape[2], k.shape[2], bool(causal)))
            return forward(q, k, v, causal, *args, **kwargs)

        def recorded_backward(q, k, v, o, lse, do, causal, *args, **kwargs):
            events.append(("kernel", q.shape[2], k.shape[2], bool(causal)))
            return backward(q, k, v, o, lse, do, causal, *args, **kwargs)

        def recorded_start(ring, tensors):
            if ring.world > 1:
                events.append(("post", sum(t.numel() * t.element_size() for t in tensors)))
            return start(ring, tensors)

        def recorded_wait(transfer):
            if transfer.requests:
                events.append(("wait",))
            return wait(transfer)

        ring_module.attention_forward, ring_module.attention_backward = recorded_forward, recorded_backward
        ring_module.Ring.start, ring_module.Transfer.wait = recorded_start, recorded_wait
        return self

    def __exit__(self, *exc):
        (ring_module.attention_forward, ring_module.attention_backward,
         ring_module.Ring.start, ring_module.Transfer.wait) = self.saved


def ring_case(case):
    """What one rank does for a case: cut its shards, run ring attention forward and backward, and
    return its shards of out, lse, dq, dk, dv and what it recorded in each (``forward`` and
    ``backward``: lists of :class:`Recorder` events)."""
    device = torch.device("cuda", torch.cuda.current_device()) if DEVICE.type == "cuda" else DEVICE
    q, k, v, do, dlse = case_inputs(case, device)
    layout = case["layout"]
    local = [shard(t, layout=layout).requires_grad_() for t in (q, k, v)]
    with Recorder() as recorder:
        out, lse = ring_attention(*local, is_causal=case["causal"], layout=layout,
                                  enable_gqa=case["kv_heads"] != case["heads"], return_lse=True)
        forward = list(recorder.events)
        loss_of(out, lse, shard(do, layout=layout), shard(dlse, layout=layout, dim=-1)).backward()
    found = dict(out=out, lse=lse, dq=local[0].grad, dk=local[1].grad, dv=local[2].grad)
    return {name: t.detach().cpu() for name, t in found.items()} | dict(
        forward=forward, backward=recorder.events[len(forward):])


def ring_cases(cases):
    """:func:`ring_case` for every case, one after the other (one launch, many cases)."""
    return [ring_case(case) for case in cases]


def joined(ranks, index, name, layout):
    """The whole tensor ``name`` of case ``index`` from what every rank returned."""
    return join_shards([r[index][name] for r in ranks], layout, dim=-1 if name == "lse" else -2)


def whole_sequence(case):
    """Attention over the whole sequence in this one process: ``{"flashattn": ..., "pytorch": ...,
    "float64": ...}``, each a dict of out, lse, dq, dk, dv (on the CPU), and the largest |dO|."""
    q, k, v, do, dlse = case_inputs(case)
    gqa = case["kv_heads"] != case["heads"]
    found = {}
    for label, inputs, fn in (
            ("flashattn", (q, k, v), lambda *t: attention(*t, is_causal=case["causal"], enable_gqa=gqa,
                                                          return_lse=True)),
            ("pytorch", baseline_inputs(q, k, v), lambda *t: masked_attention(*t, case["causal"], enable_gqa=gqa)),
            ("float64", [t.double() for t in (q, k, v)],
             lambda *t: masked_attention(*t, case["causal"], enable_gqa=gqa))):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        # the baseline's TF32 is its inputs' rounding (testing.rule); flashattn's follows the setting
        with ieee_float32() if label != "flashattn" else contextlib.nullcontext():
            out, lse = fn(*leaves)
            grads = torch.autograd.grad(loss_of(out, lse, do, dlse), leaves)
        found[label] = {name: t.detach().cpu() for name, t in
                        dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2]).items()}
    return found, max_error(do, torch.zeros_like(do))


def check_case(ranks, index, case):
    """The rule applied to the ring's result of case ``index`` (joined from every rank) against
    float64, with plain PyTorch's error as the baseline; and the largest difference of each
    quantity from flashattn.attention over the whole sequence. Returns ``(checks, differences)``."""
    ours = {name: joined(ranks, index, name, case["layout"]) for name in ("out", "lse", "dq", "dk", "dv")}
    found, upstream = whole_sequence(case)
    checks = judge(ours, found["float64"], found["pytorch"], case["dtype"], upstream)
    return checks, {name: max_error(ours[name], found["flashattn"][name]) for name in ours}


def context_parallel_shards(n):
    """What PyTorch's ``context_parallel`` does on this rank: the positions of a sequence of ``n``
    it leaves here (it shards its buffers in place), and what SDPA called inside it computes:
    ``("ran", difference from ring attention, difference from attention within this rank's shard
    alone)``, or ``(error type, message)`` if it raised."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.functional import scaled_dot_product_attention

    device = torch.device("cuda", torch.cuda.current_device()) if DEVICE.type == "cuda" else DEVICE
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    where = torch.arange(n, dtype=torch.float32, device=device).reshape(1, 1, n, 1)
    g = torch.Generator().manual_seed(0)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    q, k, v = (torch.randn(1, 2, n, 64, generator=g).to(device, dtype) for _ in range(3))
    local = [shard(t, layout="zigzag") for t in (q, k, v)]
    ours = ring_attention(*local, is_causal=True)
    alone = scaled_dot_product_attention(*local, is_causal=True)
    with context_parallel(mesh, buffers=[where, q, k, v], buffer_seq_dims=[2, 2, 2, 2],
                          no_restore_buffers={where, q, k, v}):
        positions = where.flatten().long().cpu().tolist()
        try:
            theirs = scaled_dot_product_attention(q, k, v, is_causal=True)
            outcome = ("ran", max_error(theirs, ours), max_error(theirs, alone))
        except Exception as error:  # noqa: BLE001 (what PyTorch says is the result)
            outcome = (type(error).__name__, str(error).strip().splitlines()[0])
    return positions, outcome
