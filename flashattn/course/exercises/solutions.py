"""The exercises' solutions as the chapter notebooks hold them, loaded as a module.

A solution cell holds the function a learner completes, with the answer between nbgrader's markers
``### BEGIN SOLUTION`` and ``### END SOLUTION``. The tests check the checkers against these very
cells, never against a copy: :func:`load` turns every solution cell of a notebook into one module
(written to a file and imported, because Triton needs real source for a ``@triton.jit`` function).
A deliberately wrong answer is the solution with a textual edit applied, and a stub is the solution
region replaced by nbgrader's stub, exactly as the student version reads.
"""
import ast
import atexit
import hashlib
import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
#: nbgrader's default code stub for Python, which the student notebooks get in place of a solution.
CODE_STUB = "# YOUR CODE HERE\nraise NotImplementedError()"

_directory = None


def cells(notebook):
    """``(cell, its source as one string)`` for every cell of the notebook at ``notebook``."""
    with open(notebook, encoding="utf8") as f:
        notebook_cells = json.load(f)["cells"]
    for cell in notebook_cells:
        source = cell["source"]
        yield cell, "".join(source) if isinstance(source, list) else source


def grade_id(cell):
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def is_solution(cell):
    return bool(cell.get("metadata", {}).get("nbgrader", {}).get("solution"))


def stubbed(source):
    """A solution cell as the student version reads: each marked region replaced by the stub,
    indented like its BEGIN marker; every other line kept (signature, docstring)."""
    out, inside = [], False
    for line in source.split("\n"):
        if line.strip() == BEGIN:
            indent = line[:len(line) - len(line.lstrip())]
            out += [indent + stub_line for stub_line in CODE_STUB.split("\n")]
            inside = True
        elif line.strip() == END:
            inside = False
        elif not inside:
            out.append(line)
    return "\n".join(out)


def _imports(source):
    """The top-level import statements of a code cell (none if it is not plain Python)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # an IPython magic: not needed by any solution
        return []
    return [ast.unparse(node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]


def source(notebook, edits=(), stub=None):
    """The module :func:`load` imports: the notebook's top-level imports, then its solution cells
    in order, with ``edits`` applied and the exercise ``stub`` (a grade_id) stubbed."""
    imports, solutions, found = [], [], set()
    for cell, text in cells(notebook):
        if cell["cell_type"] != "code":
            continue
        if is_solution(cell):
            found.add(grade_id(cell))
            solutions.append(stubbed(text) if grade_id(cell) == stub else text)
        else:
            imports += [line for line in _imports(text) if line not in imports]
    if stub is not None and stub not in found:
        raise ValueError(f"{notebook} has no solution cell {stub!r} (it has {sorted(found)})")
    text = "\n".join(imports) + "\n\n\n" + "\n\n\n".join(solutions) + "\n"
    for old, new in edits:
        count = text.count(old)
        if count != 1:  # a mistake that silently vanished would make its test pass for nothing
            raise ValueError(f"the edit {old!r} -> {new!r} must match the solutions of {notebook} "
                             f"exactly once; it matches {count} times")
        text = text.replace(old, new)
    return text


def load(notebook, edits=(), stub=None):
    """Every solution cell of ``notebook`` (a path) as one module, whose attributes are the
    functions the learner writes.

    ``edits`` is a sequence of ``(old, new)`` replacements, each of which must match the solutions'
    source exactly once: a deliberately wrong answer. ``stub`` is the grade_id of an exercise to
    load as the student version has it (its solution replaced by ``raise NotImplementedError()``).
    """
    global _directory
    if _directory is None:
        _directory = Path(tempfile.mkdtemp(prefix="flashattn-solutions-"))
        atexit.register(shutil.rmtree, _directory, ignore_errors=True)
    text = source(notebook, tuple(edits), stub)
    name = f"solutions_{Path(notebook).stem}_{hashlib.sha1(text.encode()).hexdigest()[:12]}"
    path = _directory / f"{name}.py"
    path.write_text(text, encoding="utf8")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
