"""The host's time per call of ``flashattn.decode`` as on a GPU, measured on any machine.

A decoding step at 4k tokens of cache takes about 50 us on an H200, so the Python that runs before
and between its launches matters. This script times that Python without a GPU: Triton's CUDA
driver is replaced by a stand-in (:func:`install`) with which the kernels compile for sm_90 and
each launch returns at once (recorded when asked), and ``torch.cuda`` answers as for one GPU with
132 SMs. The tensors stay on the CPU. What only a GPU can time is left out: Triton's C launcher
and the driver's launch (a few us per kernel), CUDA allocations instead of CPU ones, and copying
the lengths to the GPU (``python -m flashattn.measure.bench_decode --host-ab`` times those, and decode's
ways of launching and allocating side by side on a GPU).

    python tools/decode_host_time.py              # us per call, whole and by step
    python tools/decode_host_time.py --profile    # and cProfile's table of one call's functions

``tests/test_decode_compile.py`` uses the same stand-in to check decode's direct launches.
"""
import os
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's flashattn


class StandInDriver:
    """Triton's CUDA driver without a GPU: compiles for sm_90; a launch appends (launcher, grid,
    arguments) to ``log`` and its launch-enter hook to ``hooks`` when they are lists, and does
    nothing else."""

    def __init__(self):
        import torch
        from triton.backends.compiler import GPUTarget

        self.target, self.log, self.hooks, self.torch = GPUTarget("cuda", 90, 32), None, None, torch
        driver = self

        class Utils:
            def load_binary(self, name, kernel, shared, device):
                return 1, 1, 128, 0, 1024  # module, function, registers, spills, threads

            def get_device_properties(self, device):
                return {"max_shared_mem": 232448, "multiprocessor_count": 132}

        class Launcher:
            def __init__(self, src, metadata):
                self.name = src.fn.__name__

            def __call__(self, gx, gy, gz, stream, function, packed, launch_metadata, enter, exit, *args):
                if driver.log is not None:
                    driver.log.append((self, (gx, gy, gz), args))
                if driver.hooks is not None:
                    driver.hooks.append(enter)

        self.utils, self.launcher_cls = Utils(), Launcher

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_device_interface(self):
        return self.torch.cuda

    def get_active_torch_device(self):
        return self.torch.device("cpu")


def install():
    """Make this process see one sm_90 GPU, before flashattn is imported: ``torch.cuda`` answers
    as for one (so flashattn defines its kernels for the compiler), Triton's driver is the
    stand-in, and flashattn.decode takes CPU tensors. Returns the stand-in driver."""
    os.environ.pop("TRITON_INTERPRET", None)
    import torch

    if "flashattn" in sys.modules:
        raise RuntimeError("install() must run before flashattn is imported")
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_name = lambda *args: "sm_90, stand-in"
    torch.cuda.get_device_capability = lambda *args: (9, 0)
    # the whole of what flashattn reads of a device (gpu.archs, kernels.decode), as an H100/H200
    torch.cuda.get_device_properties = lambda *args: types.SimpleNamespace(
        name="sm_90, stand-in", major=9, minor=0, multi_processor_count=132,
        shared_memory_per_block_optin=227 * 1024, regs_per_multiprocessor=65536)
    torch.cuda.current_device = lambda: 0
    torch.cuda.is_current_stream_capturing = lambda: False
    from triton.runtime import driver

    stand_in = StandInDriver()
    driver.set_active(stand_in)
    import flashattn

    assert flashattn.RUNTIME == "gpu", flashattn.describe()
    sys.modules["flashattn.ops.decode"].DEVICE = torch.device("cpu")  # the stand-in GPU's tensors
    return stand_in


def per_call_us(fn, calls=2000, rounds=5):
    """Best of ``rounds``: the mean time of ``calls`` calls, in us."""
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main(argv):
    install()
    import torch

    import flashattn

    from flashattn.kernels import decode as kernel_decode
    from flashattn.ops import decode
    # The benchmark's setting at 4k tokens: B = 8, H_q = 32, H_kv = 8, N_q = 1, D = 128, bf16.
    q = torch.randn(8, 32, 1, 128).to(torch.bfloat16)
    k, v = (torch.randn(8, 8, 4096, 128).to(torch.bfloat16) for _ in range(2))
    lengths = torch.full((8,), 4096, dtype=torch.int32)
    start = time.perf_counter()
    flashattn.decode(q, k, v, lengths)
    print(f"first call (compiles or loads the kernels): {time.perf_counter() - start:.2f} s")
    whole = per_call_us(lambda: flashattn.decode(q, k, v, lengths))
    print(f"flashattn.decode, B=8 H_q=32 H_kv=8 D=128 bf16, 4k cache: {whole:6.1f} us per call "
          f"({kernel_decode.HOST['launch']} launches, {kernel_decode.HOST['buffers']} buffer(s))")
    default = dict(kernel_decode.HOST)
    for launch in kernel_decode.HOST_CHOICES["launch"]:  # decode's other ways (the lengths stay on the CPU here)
        for buffers in kernel_decode.HOST_CHOICES["buffers"]:
            if dict(default, launch=launch, buffers=buffers) != default:
                kernel_decode.set_host(launch=launch, buffers=buffers)
                label = f"{launch} launches, {buffers} buffer(s)"
                print(f"  {label:40} {per_call_us(lambda: flashattn.decode(q, k, v, lengths), calls=1000, rounds=3):6.1f} us")
    kernel_decode.set_host(**default)
    steps = {"plan lookup (plan_for)": lambda: decode.plan_for(q, k, v, lengths),
             "checks of every call (_check_call)": lambda: decode._check_call(q, k, v, None, False),
             "lengths checked (_lengths, no copy)": lambda: decode._lengths(lengths, 4096, 1, q.device),
             "plan.run (allocations, 2 launches)": lambda: decode.plan_for(q, k, v, lengths).run(
                 q, k, v, lengths, 4096, 0.1)}
    for name, fn in steps.items():
        print(f"  {name:40} {per_call_us(fn):6.1f} us")
    if "--profile" in argv:
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.enable()
        for _ in range(1000):
            flashattn.decode(q, k, v, lengths)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main(sys.argv[1:])
