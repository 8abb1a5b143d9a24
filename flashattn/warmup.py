"""On a GPU, the backward's kernels compile in the background while the forward's compile and run.

The first call at a new setting (dtype, head dim, masking) compiles every kernel it launches, a
second or so each: the forward kernel, then, when the gradient is asked for, the backward's three
(Delta, dK/dV, dQ), one after the other. When the inputs of the forward require a gradient,
:func:`start` compiles the backward's kernels at once, in a thread of its own, beside the forward's
compile (Triton's compiler releases the GIL for much of its work, in LLVM and ptxas), and :func:`wait`,
at the start of the backward, waits for it to finish. Nothing runs on the GPU in that thread:
inside ``tuning.compile_only`` the launches compile and load their kernels only. (Compiling the
three in three threads instead was measured no faster on an H200.)

A setting whose kernels are compiled already costs one dictionary lookup. What the thread cannot
foresee (a gradient whose layout differs from the forward's output) compiles at the backward, as it
would without this module.
"""
import concurrent.futures
import threading

import torch

from . import tuning
from .backward import attention_backward
from .runtime import INTERPRET

_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashattn-warmup")
_started = {}  # setting -> the Future of its compile
_lock = threading.Lock()


def start(q, k, v, is_causal, scale, window_size, sequences, lse_dtype):
    """Compile, in the background, the backward kernels of a forward about to run on ``q, k, v``
    (same arguments as ``flashattn.backward.attention_backward``; ``lse_dtype``: the forward's
    LSE dtype); only on a GPU, only if a gradient may be asked for, once per setting."""
    if INTERPRET or not any(t.requires_grad for t in (q, k, v)):
        return
    setting = (q.device, q.dtype, k.dtype, v.dtype, q.shape[-1], q.shape[1] == k.shape[1], bool(is_causal),
               tuple(window_size), sequences is None)
    if setting in _started:  # every call after the first: one lookup, nothing else
        return
    # Autotuning times the kernels at the backward; during a CUDA graph's capture no other thread
    # may load modules.
    if tuning.autotuning() or torch.cuda.is_current_stream_capturing():
        return
    with _lock:
        if setting not in _started:
            _started[setting] = _pool.submit(_compile_backward, q.detach(), k.detach(), v.detach(), is_causal,
                                             scale, window_size, sequences, lse_dtype)


def _compile_backward(q, k, v, is_causal, scale, window_size, sequences, lse_dtype):
    # O and dO have q's shape, dtype and layout (O is allocated like q): q stands in for both, as
    # nothing is launched. The LSE is (B, H, N_q), contiguous.
    lse2 = torch.empty(q.shape[:-1], device=q.device, dtype=lse_dtype)
    with torch.cuda.device(q.device), tuning.compile_only():
        attention_backward(q, k, v, q, lse2, q, is_causal, scale, window_size=window_size, sequences=sequences)


def wait():
    """Wait for the compiles :func:`start` began. A compile that failed is left for the backward
    itself to raise, with its own message."""
    for future in list(_started.values()):
        try:
            future.result()
        except Exception:  # noqa: BLE001 (the real launch reports it)
            pass
