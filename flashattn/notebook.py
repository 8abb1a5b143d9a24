"""Small helpers for the chapter notebooks: showing the package's real source, picking sizes."""
import inspect

from .runtime import INTERPRET


def show_source(obj):
    """Display the source of a function (a kernel included) from the package itself, highlighted.

    Notebooks never paste kernel code: they show it from here, so what a learner reads is what
    runs. Falls back to plain text outside Jupyter.
    """
    fn = getattr(obj, "fn", obj)  # a @triton.jit function keeps the Python function in .fn
    source = inspect.getsource(fn)
    try:
        from IPython import get_ipython
        from IPython.display import HTML, display
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import PythonLexer
    except ImportError:
        print(source)
        return
    if get_ipython() is None:
        print(source)
        return
    formatter = HtmlFormatter(style="friendly", noclasses=True)
    location = f"{inspect.getsourcefile(fn).split('flashattn')[-1].lstrip('/')}"
    display(HTML(f"<p><code>flashattn/{location}</code>, line "
                 f"{inspect.getsourcelines(fn)[1]}</p>" + highlight(source, PythonLexer(), formatter)))


def pick(cpu, gpu):
    """``cpu`` on the interpreter, ``gpu`` on a GPU: one code path, sizes that fit the runtime."""
    return cpu if INTERPRET else gpu


# --- Running whole chapters (the tests, tools/build_html.py, tools/time_chapters.py) ------------------

def _this_python():
    """A kernel manager class that starts kernels with this very interpreter (like nbval's
    --nbval-current-env), whatever kernelspec 'python3' points to on this machine."""
    import sys

    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import default

    class ThisPython(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                              display_name="Python 3 (this environment)", language="python")

    class Manager(AsyncKernelManager):
        @default("kernel_spec_manager")
        def _kernel_spec_manager_default(self):
            return ThisPython()

    return Manager


def execute(paths, cwd=None, workers=1, timeout=600, allow_errors=False, env=None):
    """Run notebooks top to bottom, each in a fresh kernel of this Python, ``workers`` at a time.

    Returns ``{path: (the executed notebook, or the exception that stopped it; seconds)}``. Each
    kernel starts in ``cwd`` (default: the notebook's own folder), with the environment variables
    ``env`` (default: this process's). With ``allow_errors`` a cell that raises is recorded in its
    outputs and the rest still runs.
    """
    import asyncio
    import time
    from pathlib import Path

    import nbformat
    from nbclient import NotebookClient

    manager = _this_python()

    async def run(path, limit):
        nb = nbformat.read(path, as_version=4)
        async with limit:
            start = time.perf_counter()
            client = NotebookClient(nb, timeout=timeout, allow_errors=allow_errors, kernel_name="python3",
                                    kernel_manager_class=manager,
                                    resources={"metadata": {"path": str(cwd or Path(path).parent)}})
            try:
                await client.async_execute(**({"env": env} if env is not None else {}))
            except Exception as error:  # a cell raised, the kernel died or a cell timed out
                return path, (error, time.perf_counter() - start)
        return path, (nb, time.perf_counter() - start)

    async def run_all():
        limit = asyncio.Semaphore(max(1, workers))
        return dict(await asyncio.gather(*(run(path, limit) for path in paths)))

    return asyncio.run(run_all())
