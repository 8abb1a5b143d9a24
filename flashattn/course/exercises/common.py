"""What every checker shares: the error it raises, calling the learner's function (a stub becomes
"not implemented yet", a forbidden shortcut or a crash a one-line message), comparing an output with
the reference, and launching a learner's kernel.

A checker either prints a line starting with "PASSED" or raises :class:`ExerciseError` whose
message says which output is wrong, where, and by how much (with an error heatmap where a picture
helps). It never passes silently: every checker compares against a reference on inputs it draws
itself, and an unimplemented exercise (the student stub raises NotImplementedError) fails with
"not implemented yet".

In a notebook a failing check shows that one message and nothing else: no traceback, so no
checker source and none of the hints meant for the other mistakes. IPython (JupyterLab, nbclient,
nbgrader's Validate and autograde) asks an exception for ``_render_traceback_`` before it formats
one; :class:`ExerciseError` answers with its message alone, which is also the whole error output
nbgrader records and shows in its feedback.
"""
import ast
import builtins
import inspect
import re
import sys
import traceback
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch


class ExerciseError(AssertionError):
    """Raised by a checker: the message is meant for the learner.

    In IPython the error shows as one line, ``ExerciseError: <message>``, without a traceback."""

    def _render_traceback_(self):
        return [f"\x1b[1;31m{type(self).__name__}\x1b[0m: {self}"]


def not_implemented(name):
    """The error for an exercise whose stub has not been replaced yet."""
    return ExerciseError(f"{name} is not implemented yet: replace `raise NotImplementedError()` "
                         "with your code, then run this check again.")


def attempt(fn, *args, name=None, forbid=(), allow=(), row_block=None, **kwargs):
    """Call the learner's ``fn`` and return its result, turning what goes wrong into one message.

    The stub's NotImplementedError becomes "not implemented yet"; any other exception raised by the
    learner's code becomes an ExerciseError naming it and the learner's line where it happened.
    ``forbid`` names the shortcuts the exercise rules out (see :func:`forbidden`); ``allow`` the
    flashattn functions it permits; ``row_block`` (an int) also rejects reductions over more than
    that many columns at once, for exercises that must stream over blocks of columns.
    """
    name = name or getattr(fn, "__name__", "your function")
    check_references(fn, name, forbid, allow)
    try:
        with forbidden(name, forbid, row_block) as calls:
            out = fn(*args, **kwargs)
    except NotImplementedError:
        raise not_implemented(name) from None
    except ExerciseError:
        raise
    except Exception as error:
        raise crashed(name, error) from None
    if calls:
        raise calls[0]
    return out


def crashed(name, error):
    """The ExerciseError for an exception the learner's code raised: its type, its message and the
    learner's own line where it happened (the last frame outside flashattn and the libraries)."""
    where = _learner_frame(error.__traceback__)
    line = f" at `{where}`" if where else ""
    text = str(error).strip().splitlines()
    text = text[-1] if text else ""
    return ExerciseError(f"{name} raised {type(error).__name__}{line}: {text[:300]}")


def _learner_frame(tb):
    library = [Path(torch.__file__).parent.parent, Path(__file__).parents[2]]
    found = None
    for frame, lineno in traceback.walk_tb(tb):
        path = frame.f_code.co_filename
        if not any(path.startswith(str(root)) for root in library):
            found = (frame, lineno)
    if found is None:
        return None
    frame, lineno = found
    import linecache

    line = linecache.getline(frame.f_code.co_filename, lineno, frame.f_globals).strip()
    return line[:120] or None


# --- Shortcuts an exercise forbids -----------------------------------------------------------------

#: The shortcuts, by kind: (module, attribute) pairs. "softmax" is every function that returns a
#: softmax, its log, or the log-sum-exp of a row; "sdpa" is PyTorch's attention.
SHORTCUTS = {
    "softmax": [("torch", "softmax"), ("torch", "log_softmax"), ("torch", "logsumexp"),
                ("torch.nn.functional", "softmax"), ("torch.nn.functional", "log_softmax"),
                ("torch.special", "softmax"), ("torch.special", "log_softmax"), ("torch.special", "logsumexp"),
                ("torch.Tensor", "softmax"), ("torch.Tensor", "log_softmax"), ("torch.Tensor", "logsumexp"),
                ("triton.language", "softmax")],
    "sdpa": [("torch.nn.functional", "scaled_dot_product_attention")],
    # what builds a row's N x N softmax Jacobian, or asks autograd for the gradient instead
    "jacobian": [("torch", "diag_embed"), ("torch", "diag"), ("torch", "outer"), ("torch", "ger"),
                 ("torch.Tensor", "diag_embed"), ("torch.Tensor", "diag"), ("torch.Tensor", "outer"),
                 ("torch.autograd", "grad"), ("torch.autograd", "backward"), ("torch.Tensor", "backward"),
                 ("torch.autograd.functional", "jacobian"), ("torch.autograd.functional", "vjp"),
                 ("torch.func", "jacrev"), ("torch.func", "jacfwd"), ("torch.func", "vjp"), ("torch.func", "grad")],
}
_WHY = {"softmax": "this exercise asks you to compute the softmax yourself",
        "sdpa": "this exercise asks you to compute attention yourself",
        "jacobian": "this exercise asks you to derive dS without building any row's Jacobian or asking autograd",
        "flashattn": "this exercise asks you to write it yourself, not to call the course's own code"}


def _shortcut_objects(kinds):
    """{id(object): (dotted name, kind)} for the shortcuts of ``kinds`` that exist here."""
    found = {}
    for kind in kinds:
        for module, attr in SHORTCUTS.get(kind, ()):
            owner = _resolve(module)
            obj = getattr(owner, attr, None) if owner is not None else None
            if obj is not None:
                found[id(obj)] = (f"{module}.{attr}".replace("torch.Tensor.", "Tensor."), kind)
    return found


def _resolve(dotted):
    obj = sys.modules.get(dotted.split(".")[0])
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part, None)
    return obj


def _is_flashattn(obj):
    if inspect.ismodule(obj):
        return obj.__name__ == "flashattn" or obj.__name__.startswith("flashattn.")
    module = getattr(getattr(obj, "fn", obj), "__module__", None) or ""  # a @triton.jit one: its .fn
    if not callable(obj) or not (module == "flashattn" or module.startswith("flashattn.")):
        return False
    return not module.startswith("flashattn.course.exercises.solutions")


def _imported(tree):
    """{name: object} for the import statements inside a function (``import x.y as z``, ``from x
    import y``), resolved now, as they will be when it runs."""
    import importlib

    found = {}
    for node in ast.walk(tree):
        try:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    module = importlib.import_module(alias.name)
                    found[alias.asname or alias.name.split(".")[0]] = (
                        module if alias.asname else sys.modules[alias.name.split(".")[0]])
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                module = importlib.import_module(node.module)
                for alias in node.names:
                    found[alias.asname or alias.name] = getattr(module, alias.name, None)
        except Exception:  # an import that fails will fail when the learner's code runs, and say so
            continue
    return found


def _chains(tree):
    """Every dotted name ``a.b.c`` read in a function's AST, longest chains only, except those
    starting with a name assigned inside it (parameters included), which are not globals."""
    local, chains = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg):
            local.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            local.add(node.id)
    inner = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            parts, cur = [], node
            while isinstance(cur, ast.Attribute):
                parts.append(cur.attr)
                inner.add(id(cur.value))
                cur = cur.value
            if isinstance(cur, ast.Name):
                chains.append([cur.id] + parts[::-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and id(node) not in inner:
            chains.append([node.id])
    return [c for c in chains if c[0] not in local]


def check_references(fn, name, forbid=(), allow=(), _seen=None):
    """Raise ExerciseError if the source of ``fn`` (a @triton.jit function included) names a
    forbidden shortcut, directly or through an alias (``from torch import softmax``), or, with
    "flashattn" in ``forbid``, any of flashattn's functions or modules other than those in
    ``allow`` (dotted names such as "flashattn.kernels.traversal.classify_blocks"). Plain functions of the
    learner's own that ``fn`` calls are read too."""
    if not forbid:
        return
    key = (getattr(fn, "fn", fn), tuple(forbid), tuple(allow))
    if _seen is None and key in _CLEARED:  # checkers call the learner's function many times
        return
    top, _seen = _seen is None, set() if _seen is None else _seen
    python_fn = getattr(fn, "fn", fn)
    if id(python_fn) in _seen or not inspect.isfunction(python_fn):
        return
    _seen.add(id(python_fn))
    try:
        tree = ast.parse(_dedent(inspect.getsource(python_fn)))
    except (OSError, TypeError, SyntaxError):
        return
    shortcuts = _shortcut_objects(forbid)
    scope = {**vars(builtins), **python_fn.__globals__, **_imported(tree)}
    for chain in _chains(tree):
        obj = scope.get(chain[0], None)
        for depth, part in enumerate(chain[1:] + [None]):
            if obj is None:
                break
            if id(obj) in shortcuts:
                what, kind = shortcuts[id(obj)]
                raise ExerciseError(f"{name} calls {what}, but {_WHY[kind]}.")
            if "flashattn" in forbid and _is_flashattn(obj) and not inspect.ismodule(obj):
                inner = getattr(obj, "fn", obj)
                dotted = f"{inner.__module__}.{getattr(inner, '__name__', chain[depth])}"
                if dotted not in allow:
                    raise ExerciseError(f"{name} uses {dotted}: {_WHY['flashattn']}.")
            if (inspect.isfunction(getattr(obj, "fn", obj)) and not _is_flashattn(obj)
                    and getattr(getattr(obj, "fn", obj), "__module__", None) == python_fn.__module__):
                check_references(obj, name, forbid, allow, _seen)  # a helper of the learner's own
            if part is None:
                break
            obj = getattr(obj, part, None)
    if top:
        _CLEARED.add(key)


_CLEARED = set()  # (function, forbid, allow) already read and found clean


def _dedent(source):
    lines = source.splitlines()
    indent = min((len(l) - len(l.lstrip()) for l in lines if l.strip()), default=0)
    return "\n".join(l[indent:] for l in lines)


_REDUCTIONS = [("torch", "max"), ("torch", "amax"), ("torch", "sum"), ("torch", "matmul"),
               ("torch.Tensor", "max"), ("torch.Tensor", "amax"), ("torch.Tensor", "sum"),
               ("torch.Tensor", "matmul"), ("torch.Tensor", "__matmul__")]


def _reduced_columns(attr, args, kwargs):
    """How many columns (entries of the last dim) one call of a reduction reads at once, for the
    calls that reduce over the last dim; 0 for any other call (an element-wise torch.max(a, b))."""
    if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() == 0:
        return 0
    x, rest = args[0], list(args[1:])
    if attr in ("matmul", "__matmul__"):
        return x.shape[-1]
    dim = kwargs.get("dim", rest[0] if rest else None)
    if isinstance(dim, torch.Tensor):
        return 0  # torch.max(a, b): element-wise
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        return x.shape[-1]
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    return x.shape[-1] if any(isinstance(d, int) and d % x.dim() == x.dim() - 1 for d in dims) else 0


@contextmanager
def forbidden(name, forbid=(), row_block=None):
    """While the learner's code runs: every shortcut of the kinds in ``forbid`` (keys of
    :data:`SHORTCUTS`) raises ExerciseError, and with ``row_block`` so does a max, sum or matrix
    product over more than ``row_block`` columns at once. Yields the list of errors raised, so that
    a learner's ``try``/``except`` cannot hide one."""
    calls, saved = [], []

    def guard(owner, attr, original, message):
        def refuse(*args, **kwargs):
            calls.append(ExerciseError(message))
            raise calls[-1]
        return refuse

    def watch(owner, attr, original):
        def reduction(*args, **kwargs):
            columns = _reduced_columns(attr, args, kwargs)
            if columns > row_block:
                what = "multiplied" if "matmul" in attr else "reduced"
                calls.append(ExerciseError(
                    f"{name} {what} {columns} columns at once ({attr}), more than one block of "
                    f"{row_block}: stream over the blocks, keeping a running M and L."))
                raise calls[-1]
            return original(*args, **kwargs)
        return reduction

    patches = []
    for kind in forbid:
        for module, attr in SHORTCUTS.get(kind, ()):
            owner = _resolve(module)
            if owner is not None and hasattr(owner, attr):
                dotted = f"{module}.{attr}".replace("torch.Tensor.", "Tensor.")
                patches.append((owner, attr, lambda o, a, f, d=dotted, k=kind: guard(
                    o, a, f, f"{name} calls {d}, but {_WHY[k]}.")))
    if row_block is not None:
        for module, attr in _REDUCTIONS:
            patches.append((_resolve(module), attr, watch))
    try:
        for owner, attr, make in patches:
            had = attr in vars(owner)
            original = getattr(owner, attr)
            saved.append((owner, attr, had, vars(owner).get(attr)))
            setattr(owner, attr, make(owner, attr, original))
        yield calls
    finally:
        for owner, attr, had, value in reversed(saved):
            if had:
                setattr(owner, attr, value)
            else:
                delattr(owner, attr)


def passed(what):
    print(f"PASSED: {what}")


def close(got, want, atol, rtol):
    """Quietly: is ``got`` close to ``want`` (same shape, NaN where want is NaN, equal infinities)?
    Used to recognise a known mistake, so that the message can name it."""
    try:
        g = torch.as_tensor(got).detach().double().cpu()
    except Exception:
        return False
    w = want.detach().double().cpu()
    if g.shape != w.shape:
        return False
    return bool(torch.isclose(g, w, atol=atol, rtol=rtol, equal_nan=True).all())


def expect_close(name, got, want, atol=1e-6, rtol=1e-6, heatmap=False):
    """Compare one output of the learner with the reference; raise with a precise message if not
    close. ``got`` may be any array-like; ``want`` is a tensor. With ``heatmap``, a failing 2-D
    (or batched 2-D) output also shows where the error is."""
    if not isinstance(got, torch.Tensor):
        try:
            got = torch.as_tensor(got)
        except Exception:
            raise ExerciseError(f"{name} should be a tensor, got {type(got).__name__}") from None
    if tuple(got.shape) != tuple(want.shape):
        raise ExerciseError(f"{name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    bad_nan = torch.isnan(g) & ~torch.isnan(w)
    if bad_nan.any():
        idx = tuple(int(i) for i in bad_nan.nonzero()[0])
        raise ExerciseError(f"{name} has {int(bad_nan.sum())} NaN value(s), the first at index {idx} "
                            f"(expected {w[idx].item():.6g}). A NaN often comes from inf - inf or 0/0.")
    err = (g - w).abs()
    err = torch.where(torch.isnan(w) & torch.isnan(g), torch.zeros_like(err), err)
    err = torch.where(torch.isinf(w) & (g == w), torch.zeros_like(err), err)
    allowed = atol + rtol * w.abs().nan_to_num(posinf=0, neginf=0)
    if (err <= allowed).all():
        return
    worst = tuple(int(i) for i in np.unravel_index(int((err - allowed).flatten().argmax()), err.shape))
    count = int((err > allowed).sum())
    message = (f"{name} is wrong at {count} of {err.numel()} positions. Worst at index {worst}: "
               f"got {g[worst].item():.6g}, expected {w[worst].item():.6g} "
               f"(error {err[worst].item():.2e}, allowed {allowed[worst].item():.2e}).")
    if heatmap and g.dim() >= 2:
        import matplotlib.pyplot as plt

        from ...plotting import error_heatmap

        error_heatmap(g.reshape(-1, *g.shape[-2:])[0], w.reshape(-1, *w.shape[-2:])[0],
                      title=f"where {name} is wrong (first matrix)")
        plt.show()
    raise ExerciseError(message)


# --- The learner's @triton.jit functions ------------------------------------------------------------

def is_stub(fn):
    """Whether the source of the learner's function (a @triton.jit one included) still holds the
    stub's ``raise NotImplementedError``."""
    try:
        source = inspect.getsource(getattr(fn, "fn", fn))
    except (OSError, TypeError):
        return False
    return re.search(r"^\s*raise NotImplementedError", source, re.M) is not None


def learner_functions(fn):
    """``{name: function}`` for the learner's own functions (@triton.jit ones included) that
    ``fn`` names, and those they name, in the order first met: the functions of ``fn``'s module
    (the notebook's, or the module of solutions the tests load) read as globals, not its own
    parameters and variables. A launcher reaches its kernels this way, and a kernel the loops it
    calls."""
    root = getattr(fn, "fn", fn)
    found, todo = {}, [fn]
    while todo:
        item = todo.pop(0)
        python_fn = getattr(item, "fn", item)
        try:
            tree = ast.parse(_dedent(inspect.getsource(python_fn)))
        except (OSError, TypeError, SyntaxError):
            continue
        local = {node.arg for node in ast.walk(tree) if isinstance(node, ast.arg)} | {
            node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)) or node.id in found or node.id in local:
                continue
            obj = python_fn.__globals__.get(node.id)
            inner = getattr(obj, "fn", obj)
            if inspect.isfunction(inner) and inner is not root and inner.__module__ == root.__module__:
                found[node.id] = obj
                todo.append(obj)
    return found


def helpers_of(fn, *names):
    """``{name: object or None}``: what each of ``names`` is in the module of the learner's ``fn``
    (a @triton.jit function included), the notebook's or the module of solutions the tests load. A
    checker finds this way the helpers a learner's kernel calls by name."""
    scope = getattr(getattr(fn, "fn", fn), "__globals__", {})
    return {name: scope.get(name) for name in names}


def unwritten(fn):
    """The names of the functions still stubs among ``fn`` and the learner's functions it reaches
    (:func:`learner_functions`): empty when everything it runs is written."""
    return [name for name, f in [(getattr(fn, "__name__", "it"), fn), *learner_functions(fn).items()]
            if is_stub(f)]


def _error_chain(error):
    chain, cause = [], error
    while cause is not None and len(chain) < 10:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    return chain


def _stub_raised(error):
    """Whether a launch failed because a stub's ``raise NotImplementedError()`` was reached.

    The interpreter runs the stub, so the NotImplementedError itself is in the chain of errors. A
    GPU compiles it instead, and the compiler refuses any ``raise``: its error is an
    UnsupportedLanguageConstruct whose AST node is the raise statement, and when the learner's
    function is called by the exercise's kernel it is the *cause* of the error the launch reports
    (whose own text only shows the calling line)."""
    for cause in _error_chain(error):
        if isinstance(cause, NotImplementedError) and not str(cause):
            return True
        node = getattr(cause, "node", None)  # Triton's CompilationError keeps the AST node
        if isinstance(node, ast.Raise) and node.exc is not None and "NotImplementedError" in ast.unparse(node.exc):
            return True
    return False


def launch_error(error, name, constexprs):
    """The ExerciseError for a failed launch (or compilation) of a kernel around the learner's
    function ``name``."""
    if _stub_raised(error):
        return not_implemented(name)
    chain = _error_chain(error)
    deepest = chain[-1]  # the interpreter and the compiler wrap the error raised inside
    lines = [line.strip() for line in str(deepest).splitlines() if line.strip()]
    where = next((w for w in (_learner_frame(c.__traceback__) for c in reversed(chain)) if w), None)
    shown = {k: v for k, v in constexprs.items() if not callable(v)}  # not the learner's function
    return ExerciseError(f"{name} failed when its kernel ran with {shown}: {type(deepest).__name__}"
                         + (f" at `{where}`" if where else "") + f": {(lines[-1] if lines else '')[:300]}")


def launch_learner_kernel(kernel, grid, args, constexprs, name, learner, forbid=("flashattn",), allow=()):
    """Launch ``kernel`` (the learner's @triton.jit ``learner`` itself, or a kernel that calls it),
    the same way on both runtimes: a stub (its source still raises NotImplementedError; or, should
    that check miss, the error of the launch says so) becomes 'not implemented yet', any other
    failure a readable ExerciseError that keeps the original error as its cause. The learner's
    source may not name the shortcuts in ``forbid`` (:func:`check_references`; by default any of
    flashattn's own functions)."""
    if is_stub(learner):
        raise not_implemented(name)
    check_references(learner, name, forbid, allow)
    try:
        # the interpreter computes with NumPy, which warns where a wrong kernel overflows (e^x of a
        # large score): the checker judges the result itself, and says it in one message
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)
            kernel[grid](*args, **constexprs)
    except Exception as error:  # the interpreter and the compiler wrap errors raised inside
        raise launch_error(error, name, constexprs) from error
