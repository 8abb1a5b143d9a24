"""The Gluon kernels for Hopper (flashattn.hopper.forward, flashattn.hopper.backward), compiled for sm_90.

Gluon has no interpreter, so on a machine without a GPU compiling is all these kernels get. A
child process (flashattn.measure.compiled.in_child: it believes it has a GPU, nothing is launched)
compiles every configuration the package ships, for both 16-bit dtypes and both masking modes,
and the test checks what the compiler made of it: no spills, no wgmma wait that ptxas had to
inject (its note C7517), shared memory within the 227 KB an H100/H200 block may use, the warps split into partitions with their own register budgets
(setmaxnreg), asynchronous wgmma, TMA copies and mbarrier waits. Skipped where Triton cannot
compile Gluon for CUDA.
"""
import sys

import pytest

from flashattn.measure import compiled

SMEM_LIMIT = 227 * 1024


def _report(kernel, **kwargs):
    try:
        return compiled.in_child("flashattn.measure.compiled_gluon:gluon_report", kernel=kernel, **kwargs)
    except compiled.CannotCompile as reason:
        pytest.skip(str(reason))


#: Bytes of stack a kernel may keep. The fused backward (``bwd_dq``) is register-bound: ptxas keeps
#: a few values on the stack (16 bytes at head dim 128, 104-136 at 64 with its 128-query tiles,
#: Triton 3.9; the 64-query tile keeps none but ran 15 % slower on an H100: docs/performance.md).
#: More than this means a tile's accumulators went to local memory.
#: With every score modification at once (``-mods``: a softcap, ALiBi and a window), Triton 3.9
#: keeps up to 312 bytes in the fused backward at head dim 128 (head dim 64 takes 64-query tiles
#: there, and keeps none) and 8 in the dK/dV kernel at head dim 64 (where dispatch never runs it).
#: Older Tritons allocate these variants' registers less well: with all three on, the forward keeps
#: 360-488 bytes under 3.6 and 8 under 3.8, the dK/dV kernel at head dim 64 24 under 3.6 and 16
#: under 3.7.1. There the modified variants are compiled and checked for everything but their stack
#: (MODS_STACK_FROM), since the calls that run them (one modification at a time, as models use them)
#: were timed on the GPU with Triton 3.6 too (docs/performance.md, "On the Gluon kernels").
#: Dropout (``-dropout``) draws its Philox numbers in the loop: under Triton 3.9 the forward keeps
#: 232 bytes without the causal mask at head dim 128 (none with it, none at 64), the fused backward
#: 232-280 at head dim 128 and 0-24 at 64, the dK/dV kernel none (under 3.6 it keeps 0-8).
#: A key-padding mask (``bwd_dq-key_mask``, the fused backward only) adds a load per key and keeps
#: the plain kernel's stack (Triton 3.9).
STACK_ALLOWED = {"bwd_dq": 160, "bwd_dq-mods": 320, "bwd-mods": 8, "fwd-dropout": 240, "bwd_dq-dropout": 288,
                 "bwd_dq-key_mask": 160}
MODS = ("softcap", "alibi", "window")
MODS_STACK_FROM = (3, 9)


@pytest.mark.parametrize("kernel", ["fwd", "bwd", "fwd-window", "bwd_dq", "fwd-mods", "bwd-mods", "bwd_dq-mods",
                                    "fwd-dropout", "bwd-dropout", "bwd_dq-dropout", "bwd_dq-key_mask"])
def test_gluon_kernels_compile_for_sm90(kernel):
    """``bwd_dq`` is the fused backward, which needs Gluon's TMA reduce-add (Triton >= 3.8): skipped
    before. ``-mods``: with every score modification the kernels take but dropout, ``-dropout``
    with dropout, ``-key_mask`` with a key-padding mask, in bfloat16."""
    if kernel == "fwd-window":  # the forward's sliding window
        rows = _report("fwd", causal=("window",))
        assert len(rows) == 4 and {r["causal"] for r in rows} == {"window"}
    elif "-" in kernel:
        base, variant = kernel.split("-")
        mods = MODS if variant == "mods" else (variant,)
        rows = _report(base, dtypes=("bf16",), mods=mods)
        assert len(rows) == 4 and all(r["mods"] == list(mods) for r in rows)
    else:
        rows = _report(kernel)
        assert len(rows) == 8  # head dims 64 and 128, fp16 and bf16, causal or not
    problems = []
    for r in rows:
        label = f"{kernel} D={r['head_dim']} {r['dtype']} causal={r['causal']}"
        if "error" in r:
            problems.append(f"{label}: {r['error']}")
            continue
        stack_checked = kernel in ("fwd", "bwd", "fwd-window", "bwd_dq") \
            or compiled.triton_release() >= MODS_STACK_FROM
        if stack_checked and r["spill"] > STACK_ALLOWED.get(kernel, 0):
            problems.append(f"{label}: {r['spill']} bytes of stack (spills)")
        for code, note in r["ptxas_notes"]:
            if code == "C7517":  # a wgmma wait the kernel did not ask for: matmuls meant to overlap do not
                problems.append(f"{label}: ptxas {code}: {note}")
        if r["smem"] > SMEM_LIMIT:
            problems.append(f"{label}: {r['smem']} bytes of shared memory")
        # Three consumers of 160 registers in the forward at head dim 64 (hopper.forward.CONFIGS),
        # two of 240 everywhere else (MODIFIED_CONFIGS: with a window or a score modification).
        consumer = 160 if kernel == "fwd" and r["head_dim"] == 64 else 240
        if consumer not in r["setmaxnreg"] or 24 not in r["setmaxnreg"]:
            problems.append(f"{label}: no setmaxnreg {consumer} (consumers) and 24 (producer): {r['setmaxnreg']}")
        if not (r["wgmma"] and r["wgmma_waits"] and r["tma_loads"] and r["tma_stores"] and r["mbarrier_waits"]):
            problems.append(f"{label}: wgmma, its waits, TMA loads and stores, mbarrier waits expected: {r}")
    assert not problems, "\n".join(problems)


def test_exponentials_on_the_fma_units_leave_the_special_function_unit():
    """``EXP2_FMA`` moves part of the forward's exponentials off the special-function unit (MUFU):
    fewer ``ex2`` instructions, and no rounding or float-to-integer conversion in their place (those
    run on the same 16-per-clock unit, so a polynomial that needs them gains nothing)."""
    two = {"CONSUMERS": 2}  # with three (the default at head dim 64) the polynomial spills
    rows = _report("fwd", head_dims=(64,), dtypes=("bf16",), causal=(True,), configs=(two, dict(two, EXP2_FMA=2)))
    assert [r.get("error") for r in rows] == [None, None], rows
    plain, fma = rows
    assert fma["exp2"] < plain["exp2"], (plain["exp2"], fma["exp2"])
    assert fma["roundings"] == plain["roundings"], (plain["roundings"], fma["roundings"])
    assert fma["spill"] == 0


def test_each_consumer_may_stop_at_its_own_last_tile():
    """``TRIM`` (the default): each consumer computes only the K/V tiles that hold
    pairs of its rows (under the causal mask, up to its own diagonal; rows past the end, the first
    tile only), and the producer releases the rest of the ring for it. At head dim 64 three
    consumers share 160 registers each: the bookkeeping must not spill, causal or not."""
    rows = _report("fwd", head_dims=(64,), dtypes=("bf16",), causal=(False, True), configs=({"TRIM": True},))
    assert len(rows) == 2 and all("error" not in r for r in rows), rows
    assert [r["spill"] for r in rows] == [0, 0], rows


def test_a_split_group_gives_each_program_a_slot_of_dk_and_dv(monkeypatch):
    """``HEAD_SPLIT``: the fused backward launches that many programs per (key block, K/V head,
    batch), each walking n_group / split query heads (the kernel reads ``head_split``) into a slot
    of its own, and adds the slots in float32. A split that does not divide the group shrinks to
    one that does (their greatest common divisor); without one, ``head_split`` chooses. Nothing is
    launched: the launcher's ``run`` records its arguments and writes each slot's number into it."""
    import inspect

    import torch
    from flashattn.hopper import backward as hopper_backward
    calls = []

    def run(kernel, grid, *args, **kwargs):
        calls.append((grid, args, kwargs))
        for desc in args[4:6]:  # desc_dk, desc_dv: slot s of every K/V head holds s + 1
            desc.base.copy_(torch.arange(desc.base.shape[1]).remainder(grid[1] // kv_heads).add(1)
                            .view(1, -1, 1, 1).expand_as(desc.base))
    monkeypatch.setattr(hopper_backward, "run", run)
    batch, kv_heads, n, d = 2, 2, 1000, 128
    k, v = (torch.randn(batch, kv_heads, n, d, dtype=torch.bfloat16) for _ in range(2))
    names = list(inspect.signature(hopper_backward.attn_bwd_sm90.fn).parameters)
    # (query heads, HEAD_SPLIT asked, dQ fused, split): unasked, groups of 8 or more walk two heads a
    # program where dQ is fused (hopper.backward.head_split), and the deterministic path never splits
    for heads, asked, fused, split in ((8, None, True, 1), (8, 2, True, 2), (8, 4, True, 4), (8, 3, True, 1),
                                      (8, 8, True, 4), (16, None, True, 4), (16, None, False, 1), (32, None, True, 8)):
        q, do = (torch.randn(batch, heads, n, d, dtype=torch.bfloat16) for _ in range(2))
        lse, delta = torch.randn(batch, heads, n), torch.randn(batch, heads, n)
        cfg = hopper_backward.dq_config(d, None if asked is None else {"HEAD_SPLIT": asked})
        blocks = -(-n // (2 * cfg["BLOCK_N"]))
        dk, dv = hopper_backward._launch(q, k, v, do, lse, delta, True, 0.1, cfg,
                                         dq_accum=torch.zeros(batch, heads, n, d) if fused else None)
        launched, args, _ = calls[-1]
        case = (heads, asked, fused)
        assert launched == (blocks, kv_heads * split, batch), case
        assert len(args) == names.index("HEAD_DIM") and args[names.index("head_split")] == split, case
        assert args[4].base.shape == (batch, kv_heads * split, n, d), case
        for grad in (dk, dv):  # the slots' sum, 1 + 2 + ... + split, in k's shape and dtype
            assert grad.shape == k.shape and grad.dtype == k.dtype, case
            assert torch.equal(grad, torch.full_like(k, split * (split + 1) // 2)), case


def test_the_interpreter_never_imports_gluon():
    """On the CPU the hooks in the forward and backward launchers must leave Gluon alone (checked in
    a fresh process: other tests, and the chapters' code, import the Gluon modules to read them)."""
    import os
    import subprocess

    import flashattn
    if not flashattn.gpu.runtime.INTERPRET:
        pytest.skip("a GPU runtime imports the Gluon kernels where they apply")
    code = ("import sys, torch, flashattn\n"
            "q = torch.randn(1, 1, 20, 64, dtype=torch.float16, requires_grad=True)\n"
            "flashattn.attention(q, q, q, is_causal=True).sum().backward()\n"
            "print(sorted(m for m in sys.modules if m in ('flashattn.hopper.forward', 'flashattn.hopper.backward')))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        os.path.dirname(os.path.dirname(flashattn.__file__)), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout
