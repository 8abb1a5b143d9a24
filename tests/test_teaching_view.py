"""The teaching view (``show_source(kernel, only={...})``) is the real kernel with branches removed
exactly as the compiler removes them: its text runs, on the interpreter, to the same output as the
kernel it came from, and it never hides a branch the flags leave open."""
import ast
import importlib.util
import sys

import pytest
import torch

import flashattn
from flashattn.course import notebook, teaching_view
from flashattn.kernels import backward, forward


def sample(x, A=False, B=True):
    y = x
    if A:  # A's comment goes with A
        y = y + 1
        if B:
            y = y * 2
    else:
        # only without A
        y = y - 1
    if A and not B:
        y = y + 100
    elif B:
        y = y + 10
    if B or x > 3:
        y = -y
    return y


def _load(text, name, namespace):
    code = compile(text, f"<pruned {name}>", "exec")
    scope = dict(namespace)
    exec(code, scope)
    return scope[name]


@pytest.mark.parametrize("a", [False, True])
@pytest.mark.parametrize("b", [False, True])
def test_pruned_python_computes_what_the_original_does(a, b):
    text, first, hidden, _ = teaching_view.pruned_source(sample, {"A": a, "B": b})
    pruned = _load(text, "sample", globals())
    for x in range(-2, 6):
        assert pruned(x, a, b) == sample(x, a, b)
    assert first == sample.__code__.co_firstlineno and hidden > 0
    assert ("A's comment" in text) is False  # the `if A:` line is gone either way
    assert ("only without A" in text) == (not a)


def test_a_flag_left_open_keeps_its_branch_and_loses_the_decided_part():
    text, _, _, _ = teaching_view.pruned_source(sample, {"A": False})
    assert "elif" not in text and "    if B:\n" in text  # `elif B:` took the place of `if A and not B:`
    assert "if B or x > 3:" in text and "A and" not in text
    pruned = _load(text, "sample", globals())
    assert all(pruned(x, False, b) == sample(x, False, b) for x in range(-2, 6) for b in (False, True))


def chained(x, A=False, B=True, C=True):
    if A:
        x = x + 1
    elif B and not C:
        x = x * 3
    return x


def test_an_elif_left_partly_open_becomes_an_if():
    text, _, _, _ = teaching_view.pruned_source(chained, {"A": False, "C": False})
    assert "    if B:\n        x = x * 3\n" in text and "elif" not in text
    pruned = _load(text, "chained", globals())
    assert all(pruned(x, False, b, False) == chained(x, False, b, False) for x in range(3) for b in (False, True))


def test_unknown_flags_are_refused_by_name_unless_another_is_used():
    with pytest.raises(ValueError, match=r"\['WINDOWS'\], none of which attn_fwd uses"):
        teaching_view.pruned_source(forward.attn_fwd, {"WINDOWS": False})
    *_, used = teaching_view.pruned_source(forward.fwd_inner, {"VARLEN": False, "WINDOW": False})
    assert used == {"WINDOW": False}  # fwd_inner has no VARLEN: a preset may name it


@pytest.mark.parametrize("kernel, flags", [
    (forward.attn_fwd, {"WINDOW": False, "VARLEN": False}),
    (forward.fwd_inner, {"WINDOW": False}),
    (backward.attn_bwd_dq, {"WINDOW": False, "VARLEN": False}),
    (backward.attn_bwd_dkdv, {"WINDOW": False, "VARLEN": False}),
])
def test_the_package_kernels_pruned_are_python_without_those_flags(kernel, flags):
    text, _, hidden, _ = teaching_view.pruned_source(kernel, flags)
    tests = [node.test for node in ast.walk(ast.parse(text)) if isinstance(node, ast.If)]
    decided = {name.id for test in tests for name in ast.walk(test) if isinstance(name, ast.Name)} & set(flags)
    assert hidden > 0 and decided == set()


def test_the_pruned_forward_kernel_runs_to_the_same_output(tmp_path, monkeypatch):
    """The teaching view of the forward kernel and its inner loop, written to a module and run by
    the launcher in place of the real ones, gives the real kernel's output bit for bit."""
    source = ["from flashattn.kernels.forward import *\n",
              "from flashattn.kernels.forward import triton, tl\n\n\n",
              teaching_view.pruned_source(forward.fwd_inner, notebook.LATER)[0], "\n\n",
              teaching_view.pruned_source(forward.attn_fwd, notebook.LATER)[0]]
    path = tmp_path / "pruned_forward.py"
    path.write_text("".join(source))
    spec = importlib.util.spec_from_file_location("pruned_forward", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["pruned_forward"] = module
    try:
        spec.loader.exec_module(module)
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 2, n, 24) for n in (19, 27, 27))
        for causal in (False, True):
            expected = flashattn.attention(q, k, v, is_causal=causal)
            monkeypatch.setattr(forward, "attn_fwd", module.attn_fwd)
            got = flashattn.attention(q, k, v, is_causal=causal)
            monkeypatch.undo()
            assert torch.equal(got, expected)
    finally:
        del sys.modules["pruned_forward"]


def test_show_source_says_what_it_hid(capsys):
    notebook.show_source(forward.fwd_inner, only={"WINDOW": False}, note="windows: chapter 10")
    shown = capsys.readouterr().out
    assert shown.startswith("# teaching view: ") and "WINDOW=False hidden; windows: chapter 10" in shown
    assert "if WINDOW" not in shown and "if MASKED and" not in shown and "if MASKED:" in shown
    html = notebook.source_html(forward.fwd_inner, only={"WINDOW": False})
    assert "teaching view" in html and "flashattn/kernels/forward.py" in html
