"""Compile the kernels for NVIDIA GPUs without one (sm_75, sm_80, sm_86, sm_89, sm_90) and report
registers, spills and shared memory.

Triton compiles to a GPU binary on any machine: this catches compile errors the interpreter cannot
(it ignores layouts, shared memory and registers) and shows, per configuration, the registers per
thread, the spilled bytes and the shared memory. The decode kernels are compiled for
sm_90 as ``flashattn.decode`` launches them (query tiles of 16, 32 and 64 rows, plain and with every
variant on: a paged cache, ALiBi, softcap, a window; ``--all`` adds
every candidate the decode benchmark times); a decode configuration that spills fails the check.

    python tools/compile_check.py                   # every default configuration, every architecture
    python tools/compile_check.py --arch 86 --arch 90 --jobs 4
    python tools/compile_check.py --triton 3.6.0 --triton 3.7.1 --triton 3.8.0   # under each release too
    python tools/compile_check.py --candidates --arch 80 [--dtype bf16] [--head-dim 128] [--kernel fwd] [--all]
    python tools/compile_check.py --write-defaults --triton 3.6.0 --triton 3.7.1 --triton 3.8.0
                                                    # choose flashattn/gpu/defaults.py again (15 minutes or more)

The first form compiles what the package runs without timing (``configs.default_config``) for each
kernel, input dtype and dot precision, and head-dim class, and exits 1 if one fails to compile,
spills or needs more shared memory than the architecture gives a block (tests/test_compiled_archs.py
runs it). Spills fail under the Triton releases the defaults were chosen with
(``flashattn.gpu.defaults.TRITONS``), beyond the few that ``defaults.SPILLS`` records; under a newer
release they are shown and reported. ``--triton VERSION`` installs that release of Triton into
``.tritons/VERSION`` (pip, no other package) and runs the same under it as well. ``--candidates``
compiles the autotuning candidates that ``configs.fits`` keeps instead (``--all``: the pruned ones
too), and only reports. ``--write-defaults`` chooses the defaults: for each entry, today's if it
compiles cleanly under this Triton and every ``--triton`` release, else the first of
``compiled.default_candidates`` that does (Triton's cache keeps what was compiled before: a second
run is much faster).
"""
import argparse
import concurrent.futures
import itertools
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton

# flashattn defines its kernels for the compiler only where it sees a GPU: say there is one (nothing
# below launches a kernel), before flashattn is imported.
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DISABLE_LINE_INFO", "1")  # the same registers and spills, a faster ptxas
torch.cuda.is_available = lambda: True
torch.cuda.get_device_name = lambda *args: "compile only"

from flashattn.gpu import archs, configs
from flashattn.gpu.defaults import TRITONS as TRITONS_CHOSEN_WITH
from flashattn.measure import compiled  # noqa: E402
from flashattn.measure.compiled import (DECODE_KERNELS, SMEM_PER_BLOCK, TORCH_DTYPES, compile_kernel,
                                        decode_launches, decode_merge_launch, resources)
from flashattn.kernels.decode import MAX_SPLITS, max_block_r  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
ROOT = Path(__file__).resolve().parent.parent
#: Where ``--triton VERSION`` installs another Triton release (pip install --target), a folder each:
#: put first on PYTHONPATH, it is imported instead of the environment's.
TRITONS = ROOT / ".tritons"


def _check(job):
    capability, item = job
    start = time.perf_counter()
    try:
        regs, spill, smem, problem = compiled.check(archs.ARCHS[capability], item)
    except Exception as error:  # report and go on: one bad config should not hide the others
        regs = spill = smem = -1
        first_line = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        problem = f"does not compile: {first_line}"
    return capability, item, regs, spill, smem, problem, time.perf_counter() - start


def triton_folder(version):
    """The folder holding Triton ``version`` (installed there with pip on first use)."""
    folder = TRITONS / version
    if not (folder / "triton" / "__init__.py").is_file():
        print(f"installing triton=={version} into {folder.relative_to(ROOT)}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(folder),
                        f"triton=={version}"], check=True)
    return folder


def under(version, argv, **kwargs):
    """Run this tool with ``argv`` in a child process that imports Triton ``version``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(triton_folder(version)), str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, __file__, *argv], env=env, **kwargs)


def compile_all(work, jobs, version=None):
    """Compile each (capability, item) of ``work`` under Triton ``version`` (default: the one imported
    here): a list of ``(registers, spilled bytes, shared memory, problem)``, problem None or the
    compile error (the choosing judges spills itself)."""
    if version not in (None, triton.__version__):
        result = under(version, ["--compile-json", "--jobs", str(jobs)], input=json.dumps(work), text=True,
                       capture_output=True)
        if result.returncode != 0:
            sys.exit(f"compiling under triton {version} failed:\n{result.stdout[-2000:]}{result.stderr[-3000:]}")
        return [tuple(row) for row in json.loads(result.stdout.strip().splitlines()[-1])]
    work = [(capability, (*item[:4], tuple(map(tuple, item[4])), *item[5:])) for capability, item in work]
    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        rows = list(pool.map(_check, work))
    return [(regs, spill, smem, problem if problem and problem.startswith("does not") else None)
            for _, _, regs, spill, smem, problem, _ in rows]


def describe(item):
    name, dtype, block_d, precision, tiles, warps, stages = item
    config = " ".join(f"{k}={v}" for k, v in tiles) + f" w{warps} s{stages}"
    dtype += f"/{precision}" if precision and dtype == "fp32" else ""
    return f"{name:15} {dtype:12} {block_d:4} {config:34}"


def check_defaults(capabilities, jobs):
    work = [(capability, item) for capability in capabilities for item in compiled.choosable(archs.ARCHS[capability])]
    # the slow ones (wide head dims) first, so that the workers finish together
    work.sort(key=lambda job: -job[1][2])
    print(f"{len(work)} compilations ({', '.join(f'sm_{c}' for c in capabilities)}), {jobs} at a time", flush=True)
    print(f"{'arch':6} {'kernel':15} {'dtype':12} {'D':>4} {'config':34} {'regs':>4} {'spill':>5} {'smem':>6}")
    failures, start = [], time.perf_counter()
    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        for capability, item, regs, spill, smem, problem, _ in pool.map(_check, work):
            line = f"sm_{capability:<3} {describe(item)} {regs:4} {spill:5} {smem // 1024:5}K"
            print(line + (f"  <- {problem}" if problem else ""), flush=True)
            if problem:
                failures.append(f"sm_{capability} {describe(item)}: {problem}")
    if ".".join(map(str, compiled.triton_release())) not in TRITONS_CHOSEN_WITH:
        print(f"\nTriton {triton.__version__}: the defaults were chosen with " + ", ".join(TRITONS_CHOSEN_WITH)
              + "; spills are shown in the table, not failed (--write-defaults --triton ... chooses them again)")
    print(f"\n{len(work)} compiled in {time.perf_counter() - start:.0f} s; "
          + (f"{len(failures)} FAILED:\n  " + "\n  ".join(failures) if failures
             else "none fails, spills or overflows"))
    return 1 if failures else 0


def _clean(arch, row):
    regs, spill, smem, error = row
    return error is None and spill == 0 and smem <= arch.smem_per_block


def write_defaults(capabilities, jobs, versions):
    """Choose the defaults of ``capabilities`` again: for each entry, the first of
    ``compiled.default_candidates`` that compiles cleanly (no spill, within shared memory) under this
    Triton and under each of ``versions``, trying today's default first (so a new release changes
    only the entries it spills). A configuration an H200 measured (``configs.MEASURED_DEFAULTS``)
    is tried next and kept wherever it compiles under every release within shared memory, its
    spills recorded: it ran faster than the candidates that do not spill. Candidates are compiled in
    rounds, the next candidate of every entry still open in each round, under one release after the
    other."""
    from flashattn.gpu.defaults import DEFAULTS as TODAY

    here = ".".join(map(str, compiled.triton_release()))  # without a local suffix (3.9.0+git...)
    versions = [here] + [v for v in versions if v != here]
    keys = [(capability, key) for capability in capabilities for key in compiled.table_keys(archs.ARCHS[capability])]
    keys.sort(key=lambda job: -job[1][3])

    def candidates(capability, key):
        items = [(key[0], key[1], key[3], key[2], tuple(sorted(c.kwargs.items())), c.num_warps, c.num_stages)
                 for c in compiled.default_candidates(archs.ARCHS[capability], *key)]
        first = [item for item in items if spec(item) in (measured(capability, key), spec_of_today(capability, key))]
        first.sort(key=lambda item: spec(item) != spec_of_today(capability, key))  # today's, then the measured
        return first + [item for item in items if item not in first]

    def spec(item):  # (BLOCK_Q, BLOCK_KV, num_warps, num_stages), as the table writes it
        return (dict(item[4])["BLOCK_Q"], dict(item[4]).get("BLOCK_KV", 0), *item[5:])

    def spec_of_today(capability, key):
        today = TODAY.get(capability, {}).get(key[:3], {}).get(key[3])
        return tuple(today) if today else None

    def measured(capability, key):
        name, dtype, precision, block_d = key
        kind = configs.dot_kind(TORCH_DTYPES[dtype].itemsize, precision, archs.ARCHS[capability])
        config = configs.MEASURED_DEFAULTS.get((capability, name, kind, block_d))
        return None if config is None else (config.kwargs["BLOCK_Q"], config.kwargs.get("BLOCK_KV", 0),
                                            config.num_warps, config.num_stages)

    def compiles(arch, row):  # compiled, within shared memory (a spill aside)
        return row[3] is None and row[1] >= 0 and row[2] <= arch.smem_per_block

    order = {(capability, key): candidates(capability, key) for capability, key in keys}
    print(f"choosing {len(keys)} defaults ({', '.join(f'sm_{c}' for c in capabilities)}) under triton "
          f"{', '.join(versions)}, {jobs} compilations at a time", flush=True)
    tried, chosen, start = {job: [] for job in keys}, {}, time.perf_counter()
    for round_ in itertools.count(1):
        pending = [job for job in keys if job not in chosen and len(tried[job]) < len(order[job])]
        if not pending:
            break
        work = [(job[0], order[job][len(tried[job])]) for job in pending]
        seen = [compile_all(work, jobs, version) for version in versions]
        for i, job in enumerate(pending):
            rows = [by_version[i] for by_version in seen]
            tried[job].append((work[i][1], rows))
            arch = archs.ARCHS[job[0]]
            if all(_clean(arch, row) for row in rows) or (
                    spec(work[i][1]) == measured(*job) and all(compiles(arch, row) for row in rows)):
                chosen[job] = len(tried[job]) - 1
        print(f"round {round_}: {len(pending)} candidates compiled, {len(chosen)} of {len(keys)} entries chosen "
              f"({time.perf_counter() - start:.0f} s)", flush=True)

    from flashattn.gpu.defaults import SPILLS  # the architectures not chosen again are kept
    table = {capability: {key: {d: spec for d, spec in by_dim.items() if (*key, d) in kept}
                          for key, by_dim in entries.items()}
             for capability, entries in TODAY.items() if capability not in capabilities
             for kept in [set(compiled.table_keys(archs.ARCHS[capability]))]}
    spills = {version: {key: spill for key, spill in by_key.items() if key[0] not in capabilities}
              for version, by_key in SPILLS.items() if version in versions}
    failures = []
    print(f"\n{'arch':6} {'kernel':15} {'dtype':12} {'D':>4} {'config':34} {'spilled under ' + ', '.join(versions)}")
    for job in keys:
        capability, (name, dtype, precision, block_d) = job
        arch = archs.ARCHS[capability]
        # where no candidate is clean under every release: the one clean under most, spilling least
        item, rows = tried[job][chosen[job]] if job in chosen else max(tried[job], key=lambda t: (
            sum(_clean(arch, row) for row in t[1]), -sum(row[1] if compiles(arch, row) else 1 << 30 for row in t[1])))
        # no tile compiles cleanly under any release (on sm_75 at head dim 256): refused with a clear error
        refused = job not in chosen and not any(_clean(arch, row) for _, t in tried[job] for row in t) and all(
            row[3] is None for _, t in tried[job] for row in t)
        note = "" if job in chosen else "  <- no tile fits: refused with a clear error" if refused else ""
        for version, (regs, spill, smem, error) in zip(versions, rows):
            if refused or _clean(arch, (regs, spill, smem, error)):
                continue
            if compiles(arch, (regs, spill, smem, error)):  # measured faster, or no candidate avoids it
                spills.setdefault(version, {})[(capability, name, dtype, precision, block_d)] = spill
                note += f"  <- spills {spill} bytes under {version}" + (
                    ", measured faster" if spec(item) == measured(*job) else ", as every candidate does")
            else:
                failures.append(f"sm_{capability} {describe(item)} under triton {version}: {error or 'shared memory'}")
                note += f"  <- {error or f'{smem} bytes of shared memory'} under {version}"
        print(f"sm_{capability:<3} {describe(item)} {'/'.join(str(row[1]) for row in rows):>14}  "
              f"({len(tried[job])} tried){note}", flush=True)
        tiles = dict(item[4])
        table.setdefault(capability, {}).setdefault((name, dtype, precision), {})[block_d] = None if refused else (
            tiles["BLOCK_Q"], tiles.get("BLOCK_KV", 0), item[5], item[6])
    path = ROOT / "flashattn" / "gpu" / "defaults.py"
    releases = f"TRITONS = {tuple(sorted(versions, key=lambda v: tuple(map(int, v.split('.')))))!r}\n"
    recorded = "SPILLS = {" + "".join(f"\n    {version!r}: {{" + "".join(
        f"\n        {key!r}: {spill}," for key, spill in sorted(by_key.items(), key=lambda kv: (str(kv[0][:4]), kv[0][4])))
        + "\n    }," for version, by_key in sorted(spills.items()) if by_key) + ("\n}\n" if any(spills.values()) else "}\n")
    with open(path, "w", encoding="utf8") as f:
        f.write(DEFAULTS_HEADER + releases + recorded)
        f.write("DEFAULTS = {\n")
        for capability in sorted(table):
            f.write(f"    {capability}: {{  # {archs.ARCHS[capability].gpus}\n")
            for key in sorted(table[capability], key=str):
                by_dim = ", ".join(f"{d}: {v}" for d, v in sorted(table[capability][key].items()))
                f.write(f"        {key!r}: {{{by_dim}}},\n")
            f.write("    },\n")
        f.write("}\n")
    print(f"\nwrote {path.relative_to(ROOT)} in {time.perf_counter() - start:.0f} s"
          + (f"; {len(failures)} entries fail to compile or overflow:\n  " + "\n  ".join(failures) if failures else ""))
    return 1 if failures else 0


DEFAULTS_HEADER = '''"""The configuration each kernel runs with when nothing is timed, per GPU architecture.

Generated by ``python tools/compile_check.py --write-defaults``: do not edit by hand. For each
architecture, kernel, input dtype with its dot precision (float32: "ieee" as 'highest' asks and
without tensor cores, "tf32" as 'high' asks, "tf32x3" under the experimental FLASHATTN_TF32X3=1) and
head-dim class (BLOCK_D), the first configuration of ``flashattn.measure.compiled.default_candidates``
that compiles for that architecture without spilling and within the shared memory a block may
use, under every Triton release of ``TRITONS`` (those PyTorch's CUDA builds pin, and the newest);
choosing again for a new release keeps each entry that still compiles cleanly. Where no candidate
avoids a spill under some release, the entry is the one clean under most releases, spilling
least, and ``SPILLS`` records the bytes per thread it spills there:
``{release: {(capability, kernel, dtype, dot precision, BLOCK_D): bytes}}`` (tests/test_compiled_archs.py
fails a spill beyond it). On sm_90 the candidates start with the defaults an H200 measured
(``configs.MEASURED_DEFAULTS``), then follow the order it measured them in; for sm_75, sm_80, sm_86
and sm_89 the same order, pruned by each architecture's shared memory, gives reasoned defaults:
compiled, not measured on such a GPU. tests/test_compiled_archs.py compiles every entry again.

    {capability: {(kernel, dtype, dot precision): {BLOCK_D: (BLOCK_Q, BLOCK_KV, num_warps, num_stages)}}}

BLOCK_KV is 0 for the Delta kernel, which has no key tile; None marks an entry for which no tile
compiles without spilling or overflowing shared memory (the kernel then refuses with a ValueError
naming the GPU). Before sm_80 there are no tensor cores
(Triton multiplies every dtype with fused multiply-adds) and bfloat16 runs as float32.
"""
'''


def check_candidates(args):
    failures = 0
    print(f"{'arch':6} {'kernel':15} {'dtype':5} {'D':>4} {'config':44} {'regs':>4} {'spill':>5} {'smem':>6}")
    for capability, name, dtype, head_dim in itertools.product(
            args.arch, [k for k in args.kernel or compiled.ATTENTION_KERNELS if k in compiled.ATTENTION_KERNELS],
            args.dtype or ["bf16"], args.head_dim or [64, 128]):
        arch = archs.ARCHS[capability]
        precision = "tf32" if dtype == "fp32" and arch.tensor_cores else "ieee"
        for config in configs.candidates(name, DTYPES[dtype], precision, arch):
            const = dict(config.kwargs, HEAD_DIM=head_dim, BLOCK_D=configs.block_d(head_dim))
            if name != "bwd_preprocess":
                const.update(IS_CAUSAL=True, DOT_PRECISION=precision)
                size = DTYPES[dtype].itemsize
                if not (args.all or configs.fits(name, config, const["BLOCK_D"], size, precision, arch)):
                    continue
            label = f"{config.kwargs} w{config.num_warps} s{config.num_stages}"
            try:
                kernel = compiled.compile_kernel(name, dtype, const, num_warps=config.num_warps,
                                                 num_stages=config.num_stages, target=compiled.target(capability))
                regs, spill, smem = compiled.resources(kernel)
                print(f"sm_{capability:<3} {name:15} {dtype:5} {head_dim:4} {label:44} {regs:4} {spill:5} "
                      f"{smem // 1024:5}K", flush=True)
            except Exception as e:
                failures += 1
                print(f"sm_{capability:<3} {name:15} {dtype:5} {head_dim:4} {label:44} FAILED: "
                      f"{str(e).splitlines()[0][:200]}", flush=True)
    return 1 if failures else 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, choices=list(archs.ARCHS), action="append",
                   help="compute capability (default: all of them)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compilations at once (default: CPUs)")
    p.add_argument("--candidates", action="store_true", help="the autotuning candidates instead of the defaults")
    p.add_argument("--kernel", choices=list(compiled.KERNELS), action="append")
    p.add_argument("--dtype", choices=list(DTYPES), action="append")
    p.add_argument("--head-dim", type=int, action="append")
    p.add_argument("--all", action="store_true", help="with --candidates: also those configs.fits prunes")
    p.add_argument("--write-defaults", action="store_true", help="choose the defaults, write flashattn/gpu/defaults.py")
    p.add_argument("--triton", action="append", default=[], metavar="VERSION",
                   help="also under this Triton release (installed with pip into .tritons/VERSION on first "
                        "use): --write-defaults chooses what compiles cleanly under all; a check runs under each")
    p.add_argument("--compile-json", action="store_true", help=argparse.SUPPRESS)  # compile_all's child
    args = p.parse_args()
    args.arch = args.arch or list(archs.ARCHS)
    if args.compile_json:
        print(json.dumps(compile_all(json.load(sys.stdin), max(1, args.jobs))))
        return
    if args.write_defaults:
        sys.exit(write_defaults(args.arch, max(1, args.jobs), args.triton))
    status = 0
    for version in args.triton:  # the same check under each other release, one child each
        argv, rest = [], iter(sys.argv[1:])
        for a in rest:  # the other --triton VERSION pairs out
            if a == "--triton":
                next(rest, None)
            elif not a.startswith("--triton="):
                argv.append(a)
        print(f"=== triton {version}", flush=True)
        status |= under(version, argv).returncode
    if args.triton:
        print(f"=== triton {triton.__version__} (this environment's)", flush=True)
    failures = check_candidates(args) if args.candidates else check_defaults(args.arch, max(1, args.jobs))
    if 90 in args.arch:
        kernels = args.kernel or list(DECODE_KERNELS)
        print(f"\nthe decode kernels, sm_90\n{'kernel':15} {'dtype':5} {'D':>4} {'causal':6} {'config':44} "
              f"{'regs':>4} {'spill':>5} {'smem':>6}")
        for dtype, head_dim in itertools.product(args.dtype or ["bf16"], args.head_dim or [64, 128]):
            failures += check_decode(kernels, dtype, head_dim, args.all)
    sys.exit(1 if failures or status else 0)


def check_decode(kernels, dtype, head_dim, everything):
    """Compile the decode kernels of ``kernels`` for one dtype and head dim, print a line each (no
    causal flag: the new tokens always see the cache up to themselves); return the failures."""
    launches = []
    for precision in ["ieee", "tf32"] if dtype == "fp32" else ["ieee"]:
        fma = dtype == "fp32" and precision == "ieee"  # one configuration, whatever the candidate
        rows = [r for r in (16, 32, 64) if r <= max_block_r(TORCH_DTYPES[dtype])]
        for block_r, candidate in itertools.product(rows, configs.DECODE_CANDIDATES
                                                    if everything and not fma else [None]):
            launches += [(f"{precision} BLOCK_R={block_r}", launch)
                         for launch in decode_launches(dtype, head_dim, precision, block_r, candidate)]
            # every variant on: a paged cache, ALiBi, softcap, a window (their own binaries)
            launches += [(f"{precision} BLOCK_R={block_r} paged+mods", launch)
                         for launch in decode_launches(dtype, head_dim, precision, block_r, candidate,
                                                       variants=compiled.DECODE_ALL_VARIANTS)]
    launches += [(f"{splits} splits", decode_merge_launch(head_dim, splits)) for splits in (2, MAX_SPLITS)]
    failures, seen = 0, set()
    for what, (name, const, options) in launches:
        key = (name, tuple(sorted(const.items())), tuple(sorted(options.items())))
        if name not in kernels or key in seen:  # tall tiles can cut two candidates to one
            continue
        seen.add(key)
        shown = {k: v for k, v in const.items() if k in ("BLOCK_KV", "BLOCK_S")}
        label = f"{what} {shown} w{options['num_warps']} s{options['num_stages']}"
        try:
            regs, spill, smem = resources(compile_kernel(name, dtype, const, **options))
        except Exception as e:  # report and go on
            failures += 1
            print(f"{name:15} {dtype:5} {head_dim:4} {'-':>6} {label:44} FAILED: {str(e).splitlines()[0][:200]}")
            continue
        bad = (spill != 0 and ".".join(map(str, compiled.triton_release())) in TRITONS_CHOSEN_WITH) or smem > SMEM_PER_BLOCK
        failures += bad
        print(f"{name:15} {dtype:5} {head_dim:4} {'-':>6} {label:44} {regs:4} {spill:5} {smem // 1024:5}K"
              + ("  <- spills or too much shared memory" if bad else ""), flush=True)
    return failures


if __name__ == "__main__":
    main()
