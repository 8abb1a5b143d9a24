"""On a GPU, the backward's kernels compile in the background while the forward's compile and run.

The first call at a new setting (dtype, head dim, masking) compiles every kernel it launches, one
to three seconds each on an H200 machine: the forward kernel, then, when the gradient is asked for,
the backward's three (Delta, dK/dV, dQ). When the inputs of the forward require a gradient,
:func:`start` has the backward's kernels compiled at once, each in a thread of its own, beside the
forward's compile: Triton spends most of a compile in LLVM, in ptxas and in the C compiler that
builds each kernel's launcher, where other threads may run. :func:`wait`, at the start of the
backward, waits for them. Nothing runs on the GPU in those threads: ``launcher.defer_compiles``
records what the backward would launch, and ``launcher.compile_job`` compiles and loads each kernel
without launching it.

A setting whose kernels are compiled already costs one dictionary lookup. What the threads cannot
foresee (a gradient whose layout differs from the forward's output) compiles at the backward, as it
would without this module.
"""
import concurrent.futures
import importlib
import threading

import torch
import triton

from ..gpu import launcher
from ..gpu.runtime import INTERPRET
from ..kernels.forward import empty_output
from .dispatch import attention_backward

# Per setting, one thread collects the backward's kernels (Delta, dK/dV, dQ), then each compiles in
# a thread of its own.
_pool = concurrent.futures.ThreadPoolExecutor(max_workers=3, thread_name_prefix="flashattn-warmup")
_started = {}  # setting -> a Future whose result is the list of its kernels' compile Futures
_lock = threading.Lock()


def start(q, k, v, is_causal, scale, window_size, sequences, lse_dtype, deterministic=False):
    """Compile, in the background, the backward kernels of a forward about to run on ``q, k, v``
    (same arguments as ``flashattn.ops.dispatch.attention_backward``; ``lse_dtype``: the forward's
    LSE dtype; ``deterministic``: the call's, which picks the backward's kernels); only on a GPU,
    only if a gradient may be asked for, once per setting."""
    if INTERPRET or not any(t.requires_grad for t in (q, k, v)):
        return
    deterministic = bool(deterministic) or torch.are_deterministic_algorithms_enabled()  # as dispatch reads it
    setting = (q.device, q.dtype, k.dtype, v.dtype, q.shape[-1], v.shape[-1], q.shape[1] == k.shape[1], bool(is_causal),
               tuple(window_size), sequences is None, deterministic)
    if setting in _started:  # every call after the first: one lookup, nothing else
        return
    # Autotuning times the kernels at the backward; during a CUDA graph's capture no other thread
    # may load modules.
    if launcher.autotuning() or torch.cuda.is_current_stream_capturing():
        return
    with _lock:
        if setting not in _started:
            if not _started:
                _prepare_triton()
            _started[setting] = _pool.submit(_compile_backward, q.detach(), k.detach(), v.detach(), is_causal,
                                             scale, window_size, sequences, lse_dtype, deterministic)


def _prepare_triton():
    """The set-up the first call of a process needs before anything compiles, done at once, three
    jobs side by side: the hash of Triton's own files (part of every kernel's cache key; Python
    reading and hashing), the C module Triton's CUDA driver builds (the C compiler runs in a
    process of its own) and, for torch's sake, ``torch.fx.experimental.symbolic_shapes`` (sympy),
    which torch's autograd imports the first time a gradient tensor is passed to ``backward`` or
    ``torch.autograd.grad``. None of them imports a module the others import, and they are done
    before the compile threads start, as is the import of Triton's Gluon package: four threads each
    hashing the same files at once took 2.6 s, against 0.5 s for one, and two threads importing the
    same package can stop on Python's import deadlock error (both measured on an H200 machine)."""
    helpers = [threading.Thread(target=_quietly, args=(job,), name=f"flashattn-prepare-{i}")
               for i, job in enumerate((triton.runtime.cache.triton_key, _import_symbolic_shapes))]
    for helper in helpers:
        helper.start()
    _quietly(_load_driver)
    _quietly(_import_gluon)
    for helper in helpers:
        helper.join()


def _load_driver():
    triton.runtime.driver.active.utils  # noqa: B018 (builds and loads the module)


def _import_gluon():
    # Triton's code generator imports its Gluon package during a compile, and the Gluon forward
    # imports it too: done here, in the main thread, before any compile thread starts, so that no
    # two threads import it at once (that met Python's import deadlock error on an H200 machine).
    importlib.import_module("triton.experimental.gluon")


def _import_symbolic_shapes():
    importlib.import_module("torch.fx.experimental.symbolic_shapes")


def _quietly(job):
    try:
        job()
    except Exception:  # noqa: BLE001 (what fails here fails again in the launch, which reports it)
        pass


def _compile_backward(q, k, v, is_causal, scale, window_size, sequences, lse_dtype, deterministic=False):
    """In a thread of the pool: collect the backward's launches and hand each kernel's compile to a
    thread; returns their Futures."""
    # O and dO are allocated as the forward allocates O (like q where v has q's head dim): one
    # tensor stands in for both, as nothing is launched. The LSE is (B, H, N_q), contiguous.
    o = empty_output(q, v.shape[-1])
    lse2 = torch.empty(q.shape[:-1], device=q.device, dtype=lse_dtype)
    with torch.cuda.device(q.device), launcher.defer_compiles() as jobs:
        attention_backward(q, k, v, o, lse2, o, is_causal, scale, window_size=window_size, sequences=sequences,
                           deterministic=deterministic)
    return [_pool.submit(_compile, q.device, job) for job in jobs]


def _compile(device, job):
    with torch.cuda.device(device):
        launcher.compile_job(job)


def wait():
    """Wait for the compiles :func:`start` began. A compile that failed is left for the backward
    itself to raise, with its own message."""
    for started in list(_started.values()):
        try:
            for future in started.result():
                future.exception()  # waits; the launch reports a failure itself
        except Exception:  # noqa: BLE001 (the real launch reports it)
            pass
