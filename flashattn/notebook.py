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
