"""Small helpers for the chapter notebooks: showing the package's real source, picking sizes."""
import html
import inspect
import os

from ..gpu.runtime import INTERPRET
from . import teaching_view


#: How show_source draws code: Pygments' "default" style, whose colours all reach WCAG's 4.5:1
#: contrast on its own background, inside a bordered box whose background and text colours are
#: fixed on every element that holds text. JupyterLab's themes colour <pre> elements themselves
#: (dark in the dark theme), so a box that left them to the theme showed the style's dark-blue
#: function names on near-black.
SOURCE_STYLE = "default"
SOURCE_TEXT = "#1f2328"    # the text that has no colour of its own (names, operators)
SOURCE_MUTED = "#57606a"   # the file name and line above the code
SOURCE_BORDER = "#d0d7de"


def source_html(obj, only=None, note=None) -> str:
    """The source of a function (or a @triton.jit kernel) as a highlighted HTML box that reads the
    same in JupyterLab's light and dark themes; ``only`` and ``note`` as for :func:`show_source`."""
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import PythonLexer
    from pygments.styles import get_style_by_name

    fn = getattr(obj, "fn", obj)  # a @triton.jit function keeps the Python function in .fn
    text, first, caption = source_text(obj, only, note)
    path = os.path.abspath(inspect.getsourcefile(fn))
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    inside = path.startswith(package_parent + os.sep)
    where = os.path.relpath(path, package_parent) if inside else os.path.basename(path)
    background = get_style_by_name(SOURCE_STYLE).background_color
    code = highlight(text, PythonLexer(), HtmlFormatter(style=SOURCE_STYLE, noclasses=True, nowrap=True))
    box = (f"border: 1px solid {SOURCE_BORDER}; border-radius: 4px; background: {background}; "
           f"color: {SOURCE_TEXT}; margin: 0.4em 0")
    head = (f"background: {background}; color: {SOURCE_MUTED}; border-bottom: 1px solid {SOURCE_BORDER}; "
            "padding: 2px 8px; font-family: monospace; font-size: 85%")
    pre = (f"background: {background}; color: {SOURCE_TEXT}; margin: 0; padding: 6px 8px; border: 0; "
           "line-height: 125%; overflow-x: auto")
    title = f"{where.replace(os.sep, '/')}, line {first}" + (f" ({caption})" if caption else "")
    return (f'<div style="{box}"><div style="{head}">{html.escape(title)}</div>'
            f'<pre style="{pre}">{code}</pre></div>')


#: The values that switch off what the first chapters leave for later: chapter 10's windows, packed
#: sequences (EMPTY_ROWS: rows that see no key, which only they make) and grouped heads (one query
#: head per K/V head: ``n_group`` = 1), the score modifications (masks and the tile lists LISTED
#: walks for them, softcap, ALiBi, dropout, the bottom-right alignment), decode's paged cache
#: (PAGED, which the course does not teach) and the float64 LSE of float32 inputs (an accuracy
#: detail of flashattn.attention). ``show_source(kernel, only=LATER)`` shows a kernel as chapters
#: 05-09 teach it.
LSE64 = "LSE.dtype.element_ty == tl.float64"
LATER = {"WINDOW": False, "VARLEN": False, "EMPTY_ROWS": False, "n_group": 1, "SOFTCAP": False,
         "ALIBI": False, "MASK_KIND": 0, "LISTED": False, "DROPOUT": False, "BOTTOM_RIGHT": False,
         "PAGED": False, LSE64: False}

#: For each key of LATER: the feature it switches off, where the course teaches it, and the words
#: that name it in a kernel's comments (the teaching view drops the sentences that hold one).
FEATURES = {
    "n_group": ("grouped heads", "chapter 10", ("grouped", "GQA")),
    "WINDOW": ("sliding windows", "chapter 10", ("window",)),
    "VARLEN": ("packed sequences", "chapter 10", ("packed", "varlen")),
    "EMPTY_ROWS": ("rows that see no key", "chapter 10", ("saw no key", "sees no key")),
    "SOFTCAP": ("softcap", "chapter 14", ("softcap", "score modification")),
    "ALIBI": ("ALiBi", "chapter 14", ("alibi", "score modification")),
    "MASK_KIND": ("attn_mask", "chapter 14", ("attn_mask", "score modification")),
    "LISTED": ("an attn_mask's tile lists", "chapter 14", ("attn_mask", "tile list")),
    "DROPOUT": ("dropout", "chapter 14", ("dropout", "dropped")),
    "BOTTOM_RIGHT": ("the bottom-right alignment", "chapter 14", ("bottom-right", "bottom_right")),
    "PAGED": ("paged KV caches", "not taught", ("page",)),
    LSE64: ("the float64 LSE of float32 inputs", "see attention_forward", ("float64",)),
}


def view_of(obj, only):
    """``(view, caption)``: the :class:`flashattn.course.teaching_view.View` of ``obj`` with the
    values of ``only``, and the one line that says what it hides and where that is taught."""
    words = tuple(w for key in only if key in FEATURES for w in FEATURES[key][2])
    view = teaching_view.pruned_source(obj, only, words)
    where = {}
    for key in view.flags:
        if key == "LISTED" and "MASK_KIND" in view.flags:  # the lists go with the mask: one feature
            continue
        feature, chapter, _ = FEATURES.get(key, (key, None, ()))
        if feature not in where.setdefault(chapter, []):
            where[chapter].append(feature)
    parts = [", ".join(features) + (f" ({chapter})" if chapter else "") for chapter, features in where.items()]
    return view, f"teaching view, {view.hidden} of {view.lines} lines hidden: without " + "; ".join(parts)


def source_text(obj, only=None, note=None):
    """``(source, first line, caption)`` of ``obj``, pruned by ``only`` (see :func:`show_source`)."""
    if not only:
        lines, first = inspect.getsourcelines(getattr(obj, "fn", obj))
        return "".join(lines), first, note
    view, caption = view_of(obj, only)
    return view.text, view.first, caption + (f"; {note}" if note else "")


def show_source(obj, only=None, note=None):
    """Display the source of a function (a kernel included) from the package itself, highlighted.

    Notebooks never paste kernel code: they show it from here, so what a learner reads is what
    runs. Falls back to plain text outside Jupyter (or without Pygments).

    ``only``, a dict of constexpr flags and values (``LATER``, or ``{"WINDOW": False}``), shows the
    teaching view: the branches those values switch off are removed, as the compiler removes them,
    and so are the parameters, arguments, set-up lines, aliases and comments that only those
    branches use (``flashattn.course.teaching_view``); the title says in one line what was hidden
    and where it is taught. ``note`` adds a line of its own.
    """
    try:
        from IPython import get_ipython
        from IPython.display import HTML, display
        import pygments  # noqa: F401
    except ImportError:
        get_ipython = None
    if get_ipython is None or get_ipython() is None:
        text, first, caption = source_text(obj, only, note)
        print((f"# {caption}\n" if caption else "") + text)
        return
    display(HTML(source_html(obj, only, note)))


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
