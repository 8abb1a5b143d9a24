"""Running a function on ``world`` local processes that form a process group, and gathering what
each returns: what torchrun does for a script, for one function, from a notebook or a test.

    results = launch(my_function, 4, x, y)   # my_function(x, y) runs on ranks 0..3; a list back

The function must be importable by its module and name (defined in a module, not in a notebook
cell), and so must its arguments and results. Each process joins the group before calling it
(``torch.distributed`` is initialised, ``dist.get_rank()`` says which rank it is) and leaves it
after. On the CPU the group uses gloo and the kernels Triton's interpreter; with a GPU per rank,
NCCL and rank ``r`` on GPU ``r``.

The processes are forked from a server process (Python's "forkserver") that, on the CPU, has
already imported flashattn, so that a launch costs a fraction of a second after the first. If
any rank raises, or dies, the others are stopped and the error of the rank that failed first is
raised here with its traceback: a launch never hangs past its ``timeout``.
"""
import datetime
import io
import multiprocessing
import multiprocessing.connection
import sys
import time
import traceback

import torch
import torch.distributed as dist

from ..gpu.runtime import INTERPRET


def default_backend(world):
    """``"nccl"`` where the kernels run on GPUs and there is one for each of ``world`` ranks, else
    ``"gloo"``; a ValueError when GPUs run the kernels but there are fewer than ``world``."""
    if INTERPRET:
        return "gloo"
    if torch.cuda.device_count() < world:
        raise ValueError(f"world={world} ranks need {world} GPUs (one each) but this machine has "
                         f"{torch.cuda.device_count()}; launch fewer, or run on the CPU with "
                         "TRITON_INTERPRET=1")
    return "nccl"


def _context():
    """The forkserver context; on the interpreter its server imports flashattn once, so that every
    process forked from it starts with the package (and Triton) loaded. With GPUs nothing is
    loaded there: a process forked after CUDA was initialised could not use it."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["flashattn"] if INTERPRET else ["torch"])
    return context


def _serialised(value):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _child(fn, rank, world, backend, port, timeout, args, kwargs, connection):
    """One rank: join the group, run ``fn``, send back ``(status, payload, when)``. An error is sent
    as soon as it is caught, with the time it was, before the rank leaves the group (leaving makes
    the ranks still waiting for it fail too, later)."""
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(1)  # several ranks share the CPU's cores
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        try:
            outcome = ("ok", _serialised(fn(*args, **kwargs)), time.time())
        except BaseException:
            outcome = ("error", traceback.format_exc(), time.time())
        connection.send(outcome)
        dist.destroy_process_group()
    except BaseException:
        connection.send(("error", traceback.format_exc(), time.time()))
    finally:
        connection.close()


def launch(fn, world, *args, backend=None, timeout=300, **kwargs):
    """Run ``fn(*args, **kwargs)`` on ``world`` new local processes forming a process group of
    ``backend`` (by default :func:`default_backend`), and return the list of their results, rank
    by rank. Raises RuntimeError with the traceback of the rank that failed first, and
    TimeoutError when they are not all done within ``timeout`` seconds (they are stopped then).
    A function of a notebook cell is refused: the processes could not import it."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    if getattr(fn, "__module__", None) == "__main__" and not hasattr(sys.modules["__main__"], "__file__"):
        raise ValueError(f"launch runs {getattr(fn, '__name__', fn)!r} in other processes, which import it by "
                         "its module and name: define it in a module (a .py file) and import it from there, "
                         "not in a notebook cell or an interactive session")
    backend = backend or default_backend(world)
    context = _context()
    # The parent holds the rendezvous (a TCP store on a free port); the ranks connect to it.
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    pipes, processes, done = [], [], False
    try:
        for rank in range(world):
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=_child, daemon=True, name=f"flashattn-rank-{rank}",
                                      args=(fn, rank, world, backend, store.port, timeout, args, kwargs, send))
            process.start()
            send.close()
            pipes.append(receive)
            processes.append(process)
        results = _gather(pipes, processes, timeout)
        done = True
        return results
    finally:
        for process in processes:  # done: each leaves its group and ends; else stopped at once
            process.join(10 if done else 0)
            if process.is_alive():
                process.kill()
                process.join(5)
        del store


def _gather(pipes, processes, timeout, grace=2.0):
    """The results, rank by rank; or, once a rank has failed, the error of the rank that failed
    first (the others often fail because of it: a peer that left), after waiting ``grace``
    seconds for their reports."""
    results, failed = [None] * len(pipes), []
    deadline = time.monotonic() + timeout
    waiting = dict(enumerate(pipes))
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            if failed:
                break
            raise TimeoutError(f"ranks {sorted(waiting)} were not done after {timeout} s; stopped them")
        ready = multiprocessing.connection.wait(
            list(waiting.values()) + [processes[r].sentinel for r in waiting], timeout=left)
        for rank in [r for r, pipe in waiting.items() if pipe in ready]:
            try:
                status, payload, when = waiting.pop(rank).recv()
            except EOFError:
                status, payload, when = "error", f"it ended without a result (exit code {processes[rank].exitcode})", \
                    time.time()
            if status == "error":
                failed.append((when, rank, payload))
                deadline = min(deadline, time.monotonic() + grace)
            else:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        for rank in [r for r in waiting if processes[r].sentinel in ready and not waiting[r].poll()]:
            waiting.pop(rank)
            failed.append((time.time(), rank, f"it died (exit code {processes[rank].exitcode}) without a result"))
            deadline = min(deadline, time.monotonic() + grace)
    if failed:
        _, rank, payload = min(failed)
        others = sorted(r for _, r, _ in failed if r != rank)
        after = f"\n(ranks {others} failed after it)" if others else ""
        raise RuntimeError(f"rank {rank} of {len(pipes)} failed:\n{payload}{after}")
    return results
