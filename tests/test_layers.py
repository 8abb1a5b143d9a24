"""The package's layers: every import points down ``flashattn.LAYERS``, no module imports itself
back through others, no module reaches into another's private names, and modules stay small.

The imports are read from the source (top level and inside functions alike), not from a running
interpreter, so an import that runs only on a GPU, or only in one branch, counts too.
"""
import ast
import pathlib

import pytest

import flashattn

PACKAGE = pathlib.Path(flashattn.__file__).resolve().parent
MAX_LINES = 600


def module_name(path):
    parts = ["flashattn", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name):
    relative = pathlib.Path(*name.split(".")[1:])
    return (PACKAGE / relative).with_suffix(".py").is_file() or (PACKAGE / relative / "__init__.py").is_file()


def imports_of(path, name=None):
    """``[(line, target module, imported names)]`` of every import of a flashattn module in
    ``path`` (the module ``name``, by default the one at that path); ``from a import b`` counts as
    an import of ``a.b`` when that is a module."""
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, ()) for a in node.names if a.name.split(".")[0] == "flashattn"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "flashattn":
                continue
            plain = []
            for alias in node.names:
                if is_module(f"{source}.{alias.name}"):
                    found.append((node.lineno, f"{source}.{alias.name}", ()))
                else:
                    plain.append(alias.name)
            if plain:
                found.append((node.lineno, source, tuple(plain)))
    return found


def private_attributes(path, name=None):
    """``[(line, "alias._name")]``: private names read from flashattn modules bound by an import."""
    tree = ast.parse(path.read_text())
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            aliases |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            aliases |= {(a.asname or a.name).split(".")[0] for a in node.names}
    modules = {a for a in aliases if a in {"flashattn"} or any(
        is_module(m) and m.endswith("." + a) for _, m, _ in imports_of(path, name))}
    return [(node.lineno, f"{node.value.id}.{node.attr}") for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id in modules and node.attr.startswith("_") and not node.attr.startswith("__")]


def layer(name):
    """The rank of module ``name`` in flashattn.LAYERS; the package's root sits just above the
    public ops it re-exports."""
    parts = name.split(".")
    if len(parts) == 1:
        return flashattn.LAYERS.index("ops") + 0.5
    return flashattn.LAYERS.index(parts[1])


def upward(edges):
    """The imports in ``edges`` (``(importer, imported)``) that point up the layers."""
    return [(a, b) for a, b in edges if layer(b) > layer(a)]


def cycle(graph):
    """One import cycle of ``graph`` (module -> modules it imports) as a list, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None
    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


SOURCES = sorted(PACKAGE.rglob("*.py"))
GRAPH = {module_name(p): {target for _, target, _ in imports_of(p)} - {module_name(p)} for p in SOURCES}


def test_every_subpackage_is_a_layer_with_a_docstring():
    folders = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    assert folders == sorted(flashattn.LAYERS)
    for name in flashattn.LAYERS:
        doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text()))
        assert doc and len(doc) > 80, f"flashattn.{name} needs a docstring that says what the layer is for"
    assert not [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"], \
        "every module lives in a layer's folder"


def test_imports_point_down_the_layers():
    edges = [(a, b) for a, targets in GRAPH.items() for b in targets]
    assert upward(edges) == []


def test_no_import_cycles():
    assert cycle(GRAPH) is None


def test_no_module_imports_another_modules_private_names():
    found = []
    for path in SOURCES:
        here = module_name(path)
        for line, target, names in imports_of(path):
            found += [f"{here}:{line} imports {target}.{n}" for n in names
                      if n.startswith("_") and not n.startswith("__") and target != here]
        found += [f"{here}:{line} reads {attr}" for line, attr in private_attributes(path)]
    assert found == []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_stay_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines; split it where its jobs split"


def test_the_checks_catch_what_they_look_for():
    """The checks above fail on a cycle, an upward import and a private name."""
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert upward([("flashattn.kernels.forward", "flashattn.ops.autograd")]) == [
        ("flashattn.kernels.forward", "flashattn.ops.autograd")]
    assert upward([("flashattn.ops.autograd", "flashattn.kernels.forward"),
                   ("flashattn.measure.bench", "flashattn")]) == []
    assert upward([("flashattn.kernels.forward", "flashattn")]) == [("flashattn.kernels.forward", "flashattn")]


def test_private_names_are_found(tmp_path):
    """Both ways of reaching a private name are found: importing it, and reading it off a module."""
    probe = tmp_path / "probe.py"
    probe.write_text("from ..kernels.decode import _cdiv\nfrom ..kernels import decode\n\n"
                     "def f():\n    return decode._cdiv(1, 2)\n")
    name = "flashattn.ops.probe"
    assert [(t, n) for _, t, n in imports_of(probe, name) if n] == [("flashattn.kernels.decode", ("_cdiv",))]
    assert private_attributes(probe, name) == [(5, "decode._cdiv")]
