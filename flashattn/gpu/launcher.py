"""Launching a kernel with a configuration: the given one, the default, or the one autotuning chose.

On a GPU each kernel runs its **default configuration** (``flashattn.gpu.configs.default_config``):
nothing is timed, so a first call compiles one configuration per kernel; should the compiler refuse
it for its resources (the rules that pick it are estimates), the next that fits runs instead.

``FLASHATTN_AUTOTUNE=1`` turns on autotuning: the first call with a new key times every candidate
that fits and keeps the fastest, and the choice is kept on disk (:func:`autotune_cache_path`), so
later processes on the same GPU go straight to it. The key is the GPU, Triton's version, the kernel,
the dtype, the head dim, the masking mode, the dot precision, plus a *bucket* of the sequence length
(the next power of two, between 128 and 16384): a new length re-uses the choice made for its bucket
(and the kernels take lengths as run-time arguments, so a new length compiles nothing either).
``FLASHATTN_AUTOTUNE=0``, or unset, times nothing.

On the interpreter nothing is timed either (``num_warps`` and ``num_stages`` mean nothing there and
every tile costs Python time): each kernel gets one fixed configuration.

:func:`defer_compiles` and :func:`compile_job` let ``flashattn.ops.warmup`` compile a launch's
kernels in other threads without running them.
"""
import contextlib
import json
import os
import threading

import torch
import triton

from .configs import (FALLBACK_CONFIGS, INTERPRETER_CONFIGS, as_dict, candidates, default_config, fits, ranked,
                      tile_block_d)
from .runtime import INTERPRET, INTERPRETER_LOCK, cache_dir


def _prune(name):
    def prune(configs, named_args, **kwargs):  # Triton passes the constexprs in kwargs
        size, block_d = named_args["Q"].element_size(), tile_block_d(kwargs)
        precision = kwargs.get("DOT_PRECISION")
        return ([c for c in configs if fits(name, c, block_d, size, precision)]
                or [FALLBACK_CONFIGS[name]])
    return prune


_tuners = {}
#: The constexprs a tuned choice depends on (besides dtypes), where the kernel takes them.
TUNING_KEY = ("HEAD_DIM", "HEAD_DIM_V", "IS_CAUSAL", "DOT_PRECISION")


def seq_bucket(seq_len: int) -> int:
    """The autotuning bucket of a sequence length: the next power of two, in [128, 16384]."""
    return min(max(triton.next_power_of_2(seq_len), 128), 16384)


def _quick_bench(fn, quantiles):
    # Shorter than do_bench's defaults (25 ms warm-up, 100 ms of runs): enough to rank candidates
    # that differ by a few percent, and four times less waiting on a first call.
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


def _tuner(name, kernel, bucket, configs):
    key = (name, bucket, id(configs))  # one tuner per candidate list
    if key not in _tuners:
        _tuners[key] = triton.autotune(
            configs=configs,
            # dtypes are added by Triton itself; a kernel is keyed only on the names it takes (Triton
            # >= 3.8 refuses others): the Delta kernel has one head dim (v's, as HEAD_DIM) and no mask
            key=[n for n in TUNING_KEY if n in kernel.arg_names],
            prune_configs_by=None if name == "bwd_preprocess" else {"early_config_prune": _prune(name)},
            do_bench=_quick_bench,
        )(kernel)
    return _tuners[key]


def autotuning() -> bool:
    """Whether FLASHATTN_AUTOTUNE asks for autotuning (any value but "" and "0")."""
    return os.environ.get("FLASHATTN_AUTOTUNE", "0") not in ("", "0")


def fixed_config(name, dtype, constexprs):
    """The tiles kernel ``name`` runs with when they must be known before the launch (a launch
    table or a mask's tile lists depend on them), as a dict: the interpreter's, or the GPU's
    default (not autotuned)."""
    if INTERPRET:
        return dict(INTERPRETER_CONFIGS[name])
    return as_dict(default_config(name, dtype, constexprs["DOT_PRECISION"], tile_block_d(constexprs)))


def launch(name, kernel, grid, args, constexprs, seq_len, config=None):
    """Run ``kernel`` with ``config`` if given (the fixed one on the interpreter), autotuned under
    FLASHATTN_AUTOTUNE=1, else with the default configuration. Returns the configuration that ran,
    as a dict."""
    if INTERPRET:
        with INTERPRETER_LOCK:  # the interpreter is not thread-safe
            config = INTERPRETER_CONFIGS[name] if config is None else config
            kernel[grid](*args, **constexprs, **config)
        return dict(config)
    if config is not None:
        run(kernel, grid, *args, **constexprs, **config)
        return dict(config)
    jobs = getattr(_deferring, "jobs", None)
    if jobs is not None:  # the default is chosen where it is compiled: see defer_compiles
        jobs.append(lambda: _default(name, kernel, grid, args, constexprs))
        return None
    if autotuning():
        with _choosing:  # an autotuner times one candidate at a time and keeps its state
            return _autotuned(name, kernel, grid, args, constexprs, seq_len)
    return _default(name, kernel, grid, args, constexprs)


_deferring = threading.local()  # .jobs: the list of compile jobs, inside defer_compiles
_compiling_only = threading.local()  # .on: True while compile_job runs one


@contextlib.contextmanager
def defer_compiles():
    """Inside, this thread's launches (:func:`run`, and :func:`launch` with a default
    configuration) run nothing: each is recorded as a job. Yields the list of jobs, which
    :func:`compile_job` runs, in any thread, each compiling and loading its kernel without launching
    it (``flashattn.warmup`` spreads them over threads). A default configuration is chosen inside
    its job, as the launch would choose it: the first that compiles and loads."""
    _deferring.jobs = []
    try:
        yield _deferring.jobs
    finally:
        _deferring.jobs = None


def compile_job(job):
    """Run one job of :func:`defer_compiles` in this thread: compile and load, launch nothing."""
    _compiling_only.on = True
    try:
        job()
    finally:
        _compiling_only.on = False


def run(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``; inside :func:`defer_compiles`, a job for that launch;
    inside :func:`compile_job`, the same compile without the launch: Triton's ``warmup``, then
    loading the binary on the GPU (which builds its launcher, and raises OutOfResources where a
    launch would). Multiplies and adds fuse into fma, as the kernels were measured with, whatever
    Triton's default (Triton 3.10 turns it off; 3.9 warns that it will)."""
    kwargs.setdefault("enable_fp_fusion", True)
    jobs = getattr(_deferring, "jobs", None)
    if jobs is not None:
        jobs.append(lambda: run(kernel, grid, *args, **kwargs))
    elif getattr(_compiling_only, "on", False):
        kernel.warmup(*args, grid=grid, **kwargs)._init_handles()
    else:
        return kernel[grid](*args, **kwargs)


#: Held while autotuning times candidates, so that threads launching at once do not time
#: candidates against each other or race on the autotuner's state.
_choosing = threading.RLock()


_defaults = {}  # (kernel, dtype, dot precision, BLOCK_D, device) -> the configuration that ran
_default_locks = {}  # the same keys -> a lock held while the first launch picks the configuration


def _default(name, kernel, grid, args, constexprs):
    """The default configuration; should the compiler refuse it for its resources (the rules are
    estimates), the next that fits, and so on."""
    precision, bd = constexprs.get("DOT_PRECISION"), tile_block_d(constexprs)
    key = (name, args[0].dtype, precision, bd, args[0].device.index)
    if key not in _defaults:
        # One thread picks each key's configuration; the others wait for it (not for other keys:
        # flashattn.warmup compiles the backward's kernels while the forward's compile).
        with _default_locks.setdefault(key, threading.Lock()):
            if key not in _defaults:
                return _first_default(name, kernel, grid, args, constexprs, key)
    chosen = _defaults[key]
    run(kernel, grid, *args, **constexprs, **chosen)
    return dict(chosen)


def _first_default(name, kernel, grid, args, constexprs, key):
    precision, bd = constexprs.get("DOT_PRECISION"), tile_block_d(constexprs)
    first = default_config(name, args[0].dtype, precision, bd)
    configs = [first] + [c for c in ranked(name, args[0].dtype, precision, bd) if as_dict(c) != as_dict(first)]
    for i, c in enumerate(configs):
        try:
            run(kernel, grid, *args, **constexprs, **as_dict(c))
        except triton.runtime.errors.OutOfResources:
            if i == len(configs) - 1:
                raise
            continue
        _defaults[key] = as_dict(c)
        return as_dict(c)


# -- Autotuning, kept on disk -------------------------------------------------------------------

def autotune_cache_path():
    """The file that keeps autotuning's choices across processes."""
    return cache_dir() / "autotune.json"


_tuned = None  # the choices: {key: configuration dict}, read from disk on first use


def autotune_key(name, kernel, dtype, constexprs, bucket, device_name):
    """What an autotuning choice is kept under: the GPU, Triton's version, the kernel (and its source),
    the dtype, the head dim, the masking mode, the dot precision and the length bucket."""
    source = getattr(kernel, "cache_key", "")[:16]
    return (f"{device_name} | triton {triton.__version__} | {name} {source} | {dtype} | "
            f"D={constexprs.get('HEAD_DIM')}{_v_dim(constexprs)} | causal={constexprs.get('IS_CAUSAL')} | "
            f"{constexprs.get('DOT_PRECISION')} | N<={bucket}")


def _v_dim(constexprs):
    """v's head dim in an autotuning key, where it differs from q's and k's (keys of equal head
    dims stay what they were)."""
    dv = constexprs.get("HEAD_DIM_V", constexprs.get("HEAD_DIM"))
    return "" if dv == constexprs.get("HEAD_DIM") else f"/{dv}"


def _read_tuned():
    try:
        with open(autotune_cache_path(), encoding="utf8") as f:
            entries = json.load(f)
        return {k: v for k, v in entries.items() if isinstance(v, dict)} if isinstance(entries, dict) else {}
    except (OSError, ValueError):
        return {}


def _remember(key, config):
    """Keep a choice in memory and on disk (merged with what other processes wrote meanwhile)."""
    _tuned[key] = config
    path = autotune_cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = {**_read_tuned(), key: config}
        partial = path.with_name(f"{path.name}.{os.getpid()}.part")
        partial.write_text(json.dumps(entries, indent=1, sort_keys=True), encoding="utf8")
        os.replace(partial, path)
    except OSError:  # a read-only home: the choice lasts this process
        pass


def _autotuned(name, kernel, grid, args, constexprs, seq_len):
    """The kept choice for this key if there is one (and it is still a candidate), else autotune:
    time every candidate that fits and keep the fastest."""
    global _tuned
    if _tuned is None:
        _tuned = _read_tuned()
    # refuses, naming the GPU, what no tile can run well on it
    default_config(name, args[0].dtype, constexprs.get("DOT_PRECISION"), tile_block_d(constexprs))
    configs = candidates(name, args[0].dtype, constexprs.get("DOT_PRECISION"))
    bucket = seq_bucket(seq_len)
    device_name = torch.cuda.get_device_name(args[0].device)
    key = autotune_key(name, kernel, args[0].dtype, constexprs, bucket, device_name)
    kept = _tuned.get(key)
    if kept is not None and kept in [as_dict(c) for c in configs + [FALLBACK_CONFIGS[name]]]:
        run(kernel, grid, *args, **constexprs, **kept)
        return dict(kept)
    tuner = _tuner(name, kernel, bucket, configs)
    tuner[grid](*args, **constexprs, enable_fp_fusion=True)  # as run() launches
    chosen = as_dict(tuner.best_config)
    _remember(key, chosen)
    return chosen
