"""flashattn.distributed: ring attention on 1, 2 and 4 gloo processes (Triton's interpreter on the
CPU) against attention over the whole sequence in one process, under the rule of
flashattn.testing.rule; the layouts; the schedule against brute force; the errors; and the work
each rank does under the causal mask, counted.

The ranks run in processes started by flashattn.distributed.launch, one group per world size for
many cases (a launch forks from a server that has imported flashattn already); each case draws
its whole inputs from a seed, on every rank and here alike, and every rank returns its shards.
"""
import math
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist

import flashattn
from flashattn.distributed import join_shards, launch, positions, rank_chunks, ring_attention, shard, split_shards
from flashattn.distributed import ring as ring_module
from flashattn.distributed import schedule
from flashattn.distributed.merge import merge_partials
from flashattn.testing.reference import masked_attention
from flashattn.testing.rule import baseline_inputs, judge, max_error

D = 16


# -- What every rank runs ---------------------------------------------------------------------

def make_inputs(case):
    """The whole q, k, v and the upstream gradients of a case (the same on every process)."""
    g = torch.Generator().manual_seed(case["seed"])
    n, heads, kv_heads, dtype = case["n"], case["heads"], case["kv_heads"], case["dtype"]
    q = torch.randn(1, heads, n, D, generator=g).to(dtype)
    k, v = (torch.randn(1, kv_heads, n, D, generator=g).to(dtype) for _ in range(2))
    do = torch.randn(1, heads, n, D, generator=g).to(dtype).double()  # rounded to the dtype first
    dlse = torch.randn(1, heads, n, generator=g).double()
    return q, k, v, do, dlse


def loss_of(out, lse, do, dlse):
    lse = lse.double()
    return (out.double() * do).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse).sum()


class Recorder:
    """Wraps the ring's kernel launcher and transfers to record what a rank did, in order."""

    def __init__(self):
        self.events, self.calls = [], []
        self.saved = (ring_module.attention_forward, ring_module.attention_backward,
                      ring_module.Ring.start, ring_module.Transfer.wait)

    def __enter__(self):
        forward, backward, start, wait = self.saved
        recorder = self

        def recorded_forward(q, k, *args, **kwargs):
            recorder.events.append("kernel")
            recorder.calls.append((q.shape[2], k.shape[2], bool(args[1])))
            return forward(q, k, *args, **kwargs)

        def recorded_backward(*args, **kwargs):
            recorder.events.append("kernel")
            return backward(*args, **kwargs)

        def recorded_start(ring, tensors):
            recorder.events.append("post")
            return start(ring, tensors)

        def recorded_wait(transfer):
            recorder.events.append("wait")
            return wait(transfer)

        ring_module.attention_forward, ring_module.attention_backward = recorded_forward, recorded_backward
        ring_module.Ring.start, ring_module.Transfer.wait = recorded_start, recorded_wait
        return self

    def __exit__(self, *exc):
        (ring_module.attention_forward, ring_module.attention_backward,
         ring_module.Ring.start, ring_module.Transfer.wait) = self.saved


def wrong_merge(o_a, lse_a, o_b, lse_b):
    """A plausible mistake: the partial outputs averaged, without their LSE weights."""
    _, lse = merge_partials(o_a, lse_a, o_b, lse_b)
    o = torch.where((lse_a == float("-inf"))[..., None], o_b.float(), (o_a.float() + o_b.float()) / 2)
    return o, lse


def run_case(case):
    """This rank's shards of out, lse, dq, dk, dv for ``case``, and what it recorded."""
    q, k, v, do, dlse = make_inputs(case)
    layout = case["layout"]
    local = [shard(t, layout=layout).requires_grad_() for t in (q, k, v)]
    with Recorder() as recorder:
        if case.get("wrong_merge"):
            ring_module.merge_partials = wrong_merge
        try:
            out, lse = ring_attention(*local, is_causal=case["causal"], layout=layout,
                                      enable_gqa=case["kv_heads"] != case["heads"], return_lse=True)
            loss_of(out, lse, shard(do, layout=layout), shard(dlse, layout=layout, dim=-1)).backward()
        finally:
            ring_module.merge_partials = merge_partials
    return dict(out=out.detach(), lse=lse.detach(), dq=local[0].grad, dk=local[1].grad, dv=local[2].grad,
                calls=recorder.calls, events=recorder.events, world=dist.get_world_size())


def bad_calls():
    """Each bad call by name, as every rank makes it: ``rank -> (args, kwargs)`` of ring_attention."""
    x = torch.randn(1, 2, 8, D)
    return {
        "q and k of different lengths": lambda r: ((x, x[:, :, :4], x[:, :, :4]), {}),
        "an odd shard in zigzag": lambda r: ((x[:, :, :3], x[:, :, :3], x[:, :, :3]), {}),
        "float64": lambda r: ((x.double(), x.double(), x.double()), {}),
        "a 3-D shard": lambda r: ((x[0], x[0], x[0]), {}),
        "an unknown layout": lambda r: ((x, x, x), dict(layout="striped")),
        "heads without enable_gqa": lambda r: ((x, x[:, :1], x[:, :1]), {}),
        "v of another head dim": lambda r: ((x, x, x[..., :8]), {}),
        "a group that is not one": lambda r: ((x, x, x), dict(group="world")),
        "shards of different sizes on the ranks": lambda r: ((x[:, :, :8 - 2 * r],) * 3, {}),
        "float64 on rank 1 only": lambda r: ((x.double(),) * 3 if r == 1 else (x,) * 3, {}),
        "is_causal on rank 0 only": lambda r: ((x, x, x), dict(is_causal=r == 0)),
    }


def run_bad_calls():
    """``{name: (error type, message)}`` of every bad call on this rank, and then of shard and
    unshard's bad calls: a rank that returns at all did not hang."""
    rank, found = dist.get_rank(), {}
    for name, call in bad_calls().items():
        args, kwargs = call(rank)
        try:
            ring_attention(*args, **kwargs)
            found[name] = (None, "no error")
        except Exception as error:  # noqa: BLE001 (the test reads the type)
            found[name] = (type(error).__name__, str(error))
    calls = {"shard of a sequence not cut in 2 x world": lambda: shard(torch.randn(1, 1, 6, 2)),
             "unshard of different sizes": lambda: flashattn.distributed.unshard(torch.randn(1, 1, 2 + 2 * rank, 2))}
    for name, fn in calls.items():
        try:
            fn()
            found[name] = (None, "no error")
        except Exception as error:  # noqa: BLE001
            found[name] = (type(error).__name__, str(error))
    return found


def group_work(cases, with_errors=False):
    results = [run_case(case) for case in cases]
    return dict(results=results, errors=run_bad_calls() if with_errors else None,
                unshard=flashattn.distributed.unshard(shard(make_inputs(cases[0])[0], layout="zigzag")))


# -- The cases ----------------------------------------------------------------------------------

def case(world, n, causal, layout, dtype=torch.float32, heads=2, kv_heads=2, seed=0, **extra):
    return dict(world=world, n=n, causal=causal, layout=layout, dtype=dtype, heads=heads, kv_heads=kv_heads,
                seed=seed, **extra)


CASES = {
    2: [case(2, 16, causal, layout, seed=i) for i, (causal, layout) in enumerate(
            (c, l) for c in (False, True) for l in ("zigzag", "contiguous"))]
       + [case(2, 24, True, "zigzag", torch.bfloat16, heads=4, kv_heads=2, seed=10),
          case(2, 16, True, "contiguous", torch.float16, heads=2, kv_heads=1, seed=11),
          case(2, 16, False, "zigzag", torch.bfloat16, seed=12),
          case(2, 16, True, "zigzag", seed=13, wrong_merge=True)],
    4: [case(4, 32, True, "zigzag", heads=2, kv_heads=1, seed=20),
        case(4, 32, True, "contiguous", heads=2, kv_heads=1, seed=21),
        case(4, 48, False, "zigzag", torch.bfloat16, seed=22)],
    1: [case(1, 12, True, "zigzag", seed=30), case(1, 5, True, "contiguous", torch.float16, seed=31)],
}


@pytest.fixture(scope="module")
def runs():
    """Every world size's group, launched once: {world: what its ranks returned}."""
    return {world: launch(group_work, world, cases, with_errors=world == 2, timeout=600)
            for world, cases in CASES.items()}


def joined(ranks, index, name, layout):
    dim = -1 if name == "lse" else -2
    return join_shards([r["results"][index][name] for r in ranks], layout, dim=dim)


def whole_sequence(c):
    """ours (the ring), flashattn.attention over the whole sequence, plain PyTorch in the dtype and
    float64, as dicts name -> tensor."""
    q, k, v, do, dlse = make_inputs(c)
    gqa = c["kv_heads"] != c["heads"]
    found = {}
    for label, inputs, fn in (
            ("flashattn", (q, k, v), lambda *t: flashattn.attention(*t, is_causal=c["causal"], enable_gqa=gqa,
                                                                     return_lse=True)),
            ("pytorch", baseline_inputs(q, k, v), lambda *t: masked_attention(*t, c["causal"], enable_gqa=gqa)),
            ("float64", [t.double() for t in (q, k, v)],
             lambda *t: masked_attention(*t, c["causal"], enable_gqa=gqa))):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        out, lse = fn(*leaves)
        grads = torch.autograd.grad(loss_of(out, lse, do, dlse), leaves)
        found[label] = dict(out=out.detach(), lse=lse.detach(), **dict(zip(("dq", "dk", "dv"), grads)))
    return found, max_error(do, torch.zeros_like(do))


def checked(runs, world, index):
    ranks, c = runs[world], CASES[world][index]
    ours = {name: joined(ranks, index, name, c["layout"]) for name in ("out", "lse", "dq", "dk", "dv")}
    found, upstream = whole_sequence(c)
    checks = judge(ours, found["float64"], found["pytorch"], c["dtype"], upstream)
    return c, ours, found, checks


ALL = [(w, i) for w, cases in CASES.items() for i, c in enumerate(cases) if not c.get("wrong_merge")]


@pytest.mark.parametrize("world, index", ALL, ids=[
    f"world{w}-{CASES[w][i]['layout']}-{'causal' if CASES[w][i]['causal'] else 'full'}-"
    f"{str(CASES[w][i]['dtype']).removeprefix('torch.')}-h{CASES[w][i]['heads']}kv{CASES[w][i]['kv_heads']}"
    for w, i in ALL])
def test_ring_matches_the_whole_sequence(runs, world, index):
    c, ours, found, checks = checked(runs, world, index)
    print("\n".join(map(str, checks)))
    assert all(check.ok for check in checks), "\n".join(map(str, checks))
    # ... and agrees with flashattn.attention over the whole sequence within the same bounds
    for check in checks:
        difference = max_error(ours[check.name], found["flashattn"][check.name])
        assert difference <= check.bound, (check.name, difference, check.bound)
    for name in ("out", "dq", "dk", "dv"):
        assert ours[name].dtype == c["dtype"]
    assert ours["lse"].dtype == torch.float32


def test_a_wrong_merge_is_caught(runs):
    index = next(i for i, c in enumerate(CASES[2]) if c.get("wrong_merge"))
    _, _, _, checks = checked(runs, 2, index)
    failed = {check.name for check in checks if not check.ok}
    assert "out" in failed, "\n".join(map(str, checks))


def test_every_transfer_overlaps_a_kernel(runs):
    """Each step posts the next transfer before its kernels and waits for it after them."""
    for world in (2, 4):
        events = runs[world][1]["results"][0]["events"]
        text = " ".join(events)
        forward_step = "post kernel wait"
        # forward: (world - 1) steps that overlap, the last without a transfer
        assert text.startswith(" ".join([forward_step] * (world - 1) + ["kernel"])), text
        # backward: each step posts K/V, computes, waits for the dK/dV arriving, posts them, waits for K/V
        assert text.count("post") == (world - 1) + (world - 1) + world, text


def test_unshard_gives_back_the_whole_tensor(runs):
    for world in (1, 2, 4):
        q = make_inputs(CASES[world][0])[0]
        for r in runs[world]:
            assert torch.equal(r["unshard"], q)


# -- The work per rank, counted -------------------------------------------------------------------

def recorded_tiles(results, block):
    return sum(schedule.call_tiles(n_q, n_kv, causal, block, block) for n_q, n_kv, causal in results["calls"])


def test_zigzag_balances_the_causal_work(runs):
    """Under is_causal the tiles (4 x 4) each of 4 ranks computes, counted from the kernel calls
    the ring made: contiguous gives the last rank 5x the first's; zigzag the same to every rank."""
    block = 4
    counted = {}
    for index, layout in ((0, "zigzag"), (1, "contiguous")):
        assert CASES[4][index]["layout"] == layout and CASES[4][index]["causal"]
        counted[layout] = [recorded_tiles(r["results"][index], block) for r in runs[4]]
        assert counted[layout] == schedule.rank_tiles(4, 32, layout, True, block, block)
    print(counted)
    assert counted["contiguous"] == [3, 7, 11, 15]
    assert counted["zigzag"] == [9, 9, 9, 9]
    assert sum(counted["zigzag"]) == sum(counted["contiguous"])   # the same work, spread evenly


def test_balance_at_scale():
    """At 8 ranks and long sequences the busiest rank of the zigzag layout does about half the
    tiles of the contiguous layout's busiest (whose time sets the ring's), and every rank the same."""
    n, world, block = 8192, 8, 128
    zigzag, contiguous = (schedule.rank_tiles(world, n, layout, True, block, block)
                          for layout in ("zigzag", "contiguous"))
    assert max(zigzag) == min(zigzag) and sum(zigzag) == sum(contiguous)
    assert 1.8 < max(contiguous) / max(zigzag) < 2.0
    full = schedule.rank_tiles(world, n, "zigzag", False, block, block)
    assert full == [(n // world // block) ** 2 * world] * world


# -- The schedule and the layouts, in one process ---------------------------------------------

@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("is_causal", [True, False])
def test_the_blocks_compute_every_visible_score_once(layout, is_causal):
    chunk = 3
    for world in range(1, 7):
        n_local = chunk * (2 if layout == "zigzag" else 1)
        for rank in range(world):
            for source in range(world):
                blocks = schedule.ring_blocks(rank, source, world, layout, is_causal)
                want = schedule.visible(rank, source, world, layout, chunk, is_causal)
                assert np.array_equal(schedule.covered(blocks, n_local, chunk), want.astype(np.int64)), \
                    (world, rank, source)


def test_a_wrong_plan_is_caught():
    """Swapping the zigzag's two cases (source before or after the rank) computes the wrong scores."""
    world, chunk, rank, source = 4, 3, 2, 1
    wrong = schedule.ring_blocks(rank, 3, world, "zigzag", True)  # the blocks of a later source
    want = schedule.visible(rank, source, world, "zigzag", chunk)
    assert not np.array_equal(schedule.covered(wrong, 2 * chunk, chunk), want.astype(np.int64))


def test_layouts():
    assert [rank_chunks(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [rank_chunks(r, 4, "contiguous") for r in range(4)] == [(0,), (1,), (2,), (3,)]
    assert positions(1, 2, 8).tolist() == [2, 3, 4, 5]
    assert positions(0, 2, 8).tolist() == [0, 1, 6, 7]
    x = torch.arange(2 * 24 * 3).reshape(2, 24, 3)
    for world in (1, 2, 3, 4):
        for layout in ("zigzag", "contiguous"):
            shards = split_shards(x, world, layout, dim=1)
            assert torch.equal(join_shards(shards, layout, dim=1), x)
            for r, s in enumerate(shards):
                assert torch.equal(s, x[:, positions(r, world, 24, layout)])


def test_the_merge_is_exact_and_handles_rows_without_keys():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 10, generator=g, dtype=torch.float64) * 5
    v = torch.randn(10, 4, generator=g, dtype=torch.float64)
    parts = [(torch.softmax(s[:, a:b], -1) @ v[a:b], torch.logsumexp(s[:, a:b], -1) / math.log(2))
             for a, b in ((0, 4), (4, 10))]
    o, lse = merge_partials(*parts[0], *parts[1])
    assert max_error(o, torch.softmax(s, -1) @ v) < 1e-6
    assert max_error(lse, torch.logsumexp(s, -1) / math.log(2)) < 1e-12
    empty = (torch.zeros(3, 4), torch.full((3,), float("-inf"), dtype=torch.float64))
    o, lse = merge_partials(*parts[0], *empty)
    assert torch.equal(o, parts[0][0].float()) and torch.equal(lse, parts[0][1])
    o, lse = merge_partials(*empty, *empty)
    assert torch.equal(o, torch.zeros(3, 4)) and (lse == float("-inf")).all()


# -- Errors --------------------------------------------------------------------------------------

ERRORS = {
    "q and k of different lengths": ("ValueError", "q holds 8 positions but k holds 4"),
    "an odd shard in zigzag": ("ValueError", "q holds 3 positions: layout='zigzag' gives each rank 2 equal chunk(s)"),
    "float64": ("TypeError", "q has dtype torch.float64; expected torch.float16, torch.bfloat16 or torch.float32"),
    "a 3-D shard": ("ValueError", "q must be a (B, H, N_local, D) shard, 4 dims; got shape (2, 8, 16)"),
    "an unknown layout": ("ValueError", "layout must be 'zigzag' or 'contiguous', got 'striped'"),
    "heads without enable_gqa": ("ValueError", "pass enable_gqa=True for grouped-query attention"),
    "v of another head dim": ("ValueError", "v has head dim 8 but q has 16: ring_attention needs them equal"),
    "a group that is not one": ("TypeError", "group must be a torch.distributed.ProcessGroup or None, got str"),
    "shards of different sizes on the ranks": ("ValueError", "q's shape differs between the ranks (rank 0: (1, 2, 8, 16), "
                                                             "rank 1: (1, 2, 6, 16))"),
    "is_causal on rank 0 only": ("ValueError", "is_causal differs between the ranks (rank 0: 1, rank 1: 0)"),
    "shard of a sequence not cut in 2 x world": ("ValueError", "x (dim 2) has 6 positions, which layout='zigzag' cannot "
                                                               "cut for 2 rank(s): it needs 4 equal chunks"),
    "unshard of different sizes": ("ValueError", "x_local's shape differs between the ranks"),
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_bad_arguments_raise_on_every_rank(runs, name):
    kind, message = ERRORS[name]
    for r in runs[2]:
        got_kind, got = r["errors"][name]
        assert got_kind == kind and message in got, (r["errors"][name], kind, message)


def test_a_rank_with_bad_arguments_is_named_on_the_others(runs):
    rank0, rank1 = (r["errors"]["float64 on rank 1 only"] for r in runs[2])
    assert rank1[0] == "TypeError" and "q has dtype torch.float64" in rank1[1]
    assert rank0 == ("ValueError", "rank(s) [1] of 2 refused their arguments (see the error there); every rank "
                                   "must call with valid arguments")


def test_errors_without_a_process_group():
    assert not dist.is_initialized()
    x = torch.randn(1, 1, 4, D)
    with pytest.raises(RuntimeError, match=re.escape("needs a torch.distributed process group")):
        ring_attention(x, x, x)
    with pytest.raises(RuntimeError, match=re.escape("needs a torch.distributed process group")):
        shard(x)
    with pytest.raises(ValueError, match=re.escape("world must be an int >= 1, got 0")):
        launch(run_case, 0)


def test_a_function_of_a_notebook_cell_is_refused(monkeypatch):
    import types

    def in_a_cell():
        return 1
    in_a_cell.__module__ = "__main__"
    monkeypatch.setitem(__import__("sys").modules, "__main__", types.ModuleType("__main__"))  # no __file__
    with pytest.raises(ValueError, match="define it in a module"):
        launch(in_a_cell, 2)


def test_a_failing_rank_is_reported_and_does_not_hang():
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed:(.|\n)*only rank 1 raises"):
        launch(fail_on_rank_one, 2, timeout=120)


def fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("only rank 1 raises")
    dist.barrier()  # rank 0 waits for rank 1, which never comes: launch must stop it


# -- The benchmark (python -m flashattn.measure.ring), at tiny sizes on the CPU ----------------

def test_the_benchmark_parses_times_and_writes_its_csv(tmp_path):
    import csv

    from flashattn.measure import ring as bench_ring

    args = bench_ring.parse_args([])
    assert (args.seq_lens, args.heads, args.kv_heads, args.dtype, args.causal, args.layout) == (
        [16384, 32768, 65536, 131072], 32, 32, "bf16", True, "zigzag")
    assert args.providers == ["ring", "context_parallel"]
    with pytest.raises(SystemExit):
        bench_ring.parse_args(["--heads", "6", "--kv-heads", "4"])
    assert bench_ring.tokens_per_s_per_gpu(2, 65536, 500.0, 4) == 2 * 65536 / 0.5 / 4

    out = tmp_path / "ring.csv"
    argv = ["--seq-lens", "16", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--dtype", "fp32",
            "--warmup", "0", "--repeats", "1", "--out", str(out)]
    for world in (1, 2):
        rows = launch(bench_ring.main, world, argv, timeout=300)
        assert [r["provider"] for r in rows[0]] == ["ring"]  # context_parallel's SDPA needs CUDA
    with open(out, newline="") as f:
        written = list(csv.DictReader(f))
    assert [(r["world"], r["provider"], r["seq_len"], r["layout"]) for r in written] == [
        ("1", "ring", "16", "zigzag"), ("2", "ring", "16", "zigzag")]
    for r in written:
        assert set(r) == set(bench_ring.FIELDS) and float(r["ms"]) > 0
        assert float(r["tokens_per_s_per_gpu"]) == pytest.approx(
            bench_ring.tokens_per_s_per_gpu(1, 16, float(r["ms"]), int(r["world"])), rel=1e-3)
