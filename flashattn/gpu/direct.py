"""Launching a compiled Triton kernel again without Triton's JIT in between.

Triton's JIT spends 5 to 12 us of Python per launch binding the arguments and working out their
specialization. A decoding step is tens of microseconds, so ``flashattn.kernels.decode`` launches
each kernel through the JIT once (which compiles it), keeps what the compiled kernel needs here,
and launches it directly from then on (:func:`launch`).
"""
from triton import knobs
from triton.compiler import CompiledKernel
from triton.knobs import HookChain


class Compiled:
    """A kernel Triton compiled at a first launch, and what its later launches need."""

    __slots__ = ("runner", "launcher", "function", "metadata", "grid", "constants", "constexprs",
                 "stream", "device")

    def __init__(self, fn, kernel, grid, n_args, constexprs):
        from triton.runtime import driver

        grid = (*grid, 1, 1)[:3]  # the compiled kernel takes a 3-D grid
        self.grid, self.constexprs = grid, constexprs
        # ... and every argument in order, the compile-time ones too
        self.constants = tuple(constexprs[name] for name in fn.arg_names[n_args:])
        self.runner = kernel[grid]  # CompiledKernel[grid]
        self.launcher, self.function, self.metadata = kernel.run, kernel.function, kernel.packed_metadata
        # what Triton's JIT launches on: the current device's current stream (the device is in
        # the plan's key)
        self.stream, self.device = driver.active.get_current_stream, driver.active.get_current_device()


def no_launch_hooks():
    """Whether no Triton launch hook is registered (they are chains, empty unless a profiler or
    the user adds one)."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and (type(hook) is not HookChain or hook.calls):
            return False
    return True


def launch(kernels, key, fn, grid, args, constexprs, how="launcher"):
    """``fn[grid](*args, **constexprs())``. The first launch for ``key`` goes through Triton's JIT,
    which binds the arguments, works out their specialization (dtypes, 16-byte alignment of the
    pointers, integers equal to 1, divisible by 16 or past 32 bits), finds or compiles the kernel
    and launches it: 5 to 12 us of Python per launch of these kernels. Later launches go as
    ``how`` says (``"jit"``, ``"compiled"`` or ``"launcher"``: ``flashattn.kernels.decode.HOST``); the direct ones are sound because nothing the specialization reads
    can change under the same key: the plan's key holds the inputs' shapes, strides, dtypes and
    alignment, ``key`` the split count and the lengths' alignment, and the outputs are fresh
    allocations (aligned to 512 bytes) or views at fixed offsets of one."""
    launch = kernels.get(key)
    if launch is None:
        constexprs = dict(constexprs(), enable_fp_fusion=True)  # as launcher.run launches
        kernel = fn[grid](*args, **constexprs)
        if isinstance(kernel, CompiledKernel):  # the interpreter returns no compiled kernel
            kernels[key] = Compiled(fn, kernel, grid, len(args), constexprs)
        return
    if how == "launcher" and no_launch_hooks():
        # Triton's JIT calls the launcher so, with launch metadata and hooks instead of the Nones
        launch.launcher(*launch.grid, launch.stream(launch.device), launch.function, launch.metadata,
                        None, None, None, *args, *launch.constants)
    elif how == "jit":
        fn[grid](*args, **launch.constexprs)
    else:
        launch.runner(*args, *launch.constants)
