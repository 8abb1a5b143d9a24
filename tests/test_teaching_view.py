"""The teaching view (``show_source(kernel, only={...})``) is the real kernel with what the given
values switch off removed, exactly as far as the compiler removes it: its text compiles; run as
kernels in place of the real ones, the views give the real kernels' outputs bit for bit; and the
views of chapters 05 and 07 name no feature those chapters have not taught."""
import ast
import importlib.util
import inspect
import io
import re
import sys
import tokenize

import pytest
import torch

import flashattn
from flashattn.course import notebook, teaching_view
from flashattn.kernels import backward, decode, forward

LATER = notebook.LATER
CHAPTER_05_07 = [forward.attn_fwd, forward.fwd_inner, backward.attn_bwd_dq, backward.dq_inner,
                 backward.attn_bwd_dkdv, backward.dkdv_inner]

#: What chapters 05 and 07 have not taught, as the kernels name it: the flags, their parameters,
#: arguments, set-up names and aliases, and the words of their comments.
UNTAUGHT = (
    "WINDOW VARLEN EMPTY_ROWS SOFTCAP ALIBI MASK_KIND DROPOUT BOTTOM_RIGHT PAGED PAGE_SIZE "
    "win_left win_right kv_window_bounds q_window_bounds n_group kv_head Programs CuSeqQ CuSeqK "
    "sequence_of_program q_offset kv_offset n_rows score_mod_setup modified_scores softcap dcap dcapT "
    "Slopes slope stride_sb stride_sh shift Mask Mask_h stride_mb stride_mh stride_mq stride_mk "
    "dropout_keep seed p_drop drop_row0 drop_col0 keep keepT pT_kept Pages n_pages LISTED Tiles Lists "
    "tile_next listed n_full n_listed stride_lb stride_lh stride_lr "
    "stride_kp stride_vp s_scale m_ref lse_hi lse_lo row_factor finite").split()
UNTAUGHT_WORDS = ["window", "packed", "grouped", "dropout", "softcap", "alibi", "paged", "float64",
                  "score modification", "bottom-right"]


def untaught_in(text):
    """The untaught names in ``text``: in the code, and in comments and docstrings too where a name
    cannot be an English word (``Programs`` and ``keep`` can)."""
    code = {t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.NAME}
    names = [n for n in UNTAUGHT if n in code or (not re.fullmatch(r"[A-Z]?[a-z]+", n)
                                                  and re.search(rf"(?<!\w){n}(?!\w)", text))]
    return names + [w for w in UNTAUGHT_WORDS if re.search(rf"(?<!\w){w}", text, re.I)]


@pytest.mark.parametrize("kernel", CHAPTER_05_07, ids=lambda k: k.fn.__name__)
def test_the_views_of_chapters_05_and_07_name_nothing_untaught(kernel):
    shown = notebook.source_text(kernel, only=LATER)[0]
    assert untaught_in(shown) == []
    assert len(untaught_in(inspect.getsource(kernel.fn))) >= 5  # the real kernel names several: the test can fail


def test_the_views_keep_what_is_taught():
    """Nothing taught goes with the untaught: the stages, the masks, the LSE, the scale at the end."""
    fwd = notebook.source_text(forward.attn_fwd, only=LATER)[0]
    inner = notebook.source_text(forward.fwd_inner, only=LATER)[0]
    dq = notebook.source_text(backward.attn_bwd_dq, only=LATER)[0]
    for line in ("q_block = tl.num_programs(0) - 1 - q_block", "kv_full_end, kv_end = kv_stage_bounds(",
                 "# Stage 1: whole tiles every query of the block sees.", "acc = acc / l_i[:, None]",
                 "K += batch.to(tl.int64) * stride_kb + head.to(tl.int64) * stride_kh"):
        assert line in fwd, line
    for line in ("if IS_CAUSAL:\n                visible = visible & (offs_q[:, None] >= offs_kv[None, :])",
                 "m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)", "p = tl.exp2(s * qk_scale - m_new[:, None])",
                 "# -inf is safe: key 0 comes first", "MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr"):
        assert line in inner, line
    assert "dq *= scale\n" in dq and "lse = tl.load(LSE + offs_q, mask=offs_q < n_q, other=0.0)" in dq
    # each call of the inner loop passes exactly the parameters its view keeps, none by keyword
    kept = teaching_view.pruned_source(forward.fwd_inner, LATER, ()).params
    calls = [n for n in ast.walk(ast.parse(fwd)) if isinstance(n, ast.Call) and ast.unparse(n.func) == "fwd_inner"]
    assert len(calls) == 2 and all(len(c.args) == len(kept) and not c.keywords for c in calls)


def test_the_caption_says_what_was_hidden_and_where_it_is_taught():
    _, _, caption = notebook.source_text(backward.attn_bwd_dq, only=LATER)
    assert re.fullmatch(r"teaching view, \d+ of \d+ lines hidden: without sliding windows, packed sequences, "
                        r"grouped heads \(chapter 10\); softcap, ALiBi, attn_mask, dropout, the bottom-right "
                        r"alignment \(chapter 14\); the float64 LSE of float32 inputs \(see attention_forward\)",
                        caption), caption
    _, _, caption = notebook.source_text(forward.fwd_inner, only={"WINDOW": False}, note="more")
    assert caption.endswith("without sliding windows (chapter 10); more")


def sample(x, A=False, B=True, n=1, unused=0):
    y = x
    if A:  # A's comment goes with A
        y = y + 1
        if B:
            y = y * 2
    else:
        # only without the first branch
        y = y - 1
    if A and not B:
        y = y + 100
    elif B:
        y = y + 10
    if B or x > 3:
        y = -y
    z = y  # an alias the A branch needs
    if A:
        z = z + unused
    for g in range(0, n):
        y = y * n + g
    return y + z


def _load(text, name, namespace):
    scope = dict(namespace)
    exec(compile(text, f"<pruned {name}>", "exec"), scope)
    return scope[name]


@pytest.mark.parametrize("a", [False, True])
@pytest.mark.parametrize("b", [False, True])
def test_pruned_python_computes_what_the_original_does(a, b):
    view = teaching_view.pruned_source(sample, {"A": a, "B": b, "n": 1})
    pruned = _load(view.text, "sample", globals())
    kept = view.params
    for x in range(-2, 6):
        args = {"x": x, "A": a, "B": b, "n": 1, "unused": 0}
        assert pruned(**{k: v for k, v in args.items() if k in kept}) == sample(**args)
    assert view.first == sample.__code__.co_firstlineno and view.hidden > 0
    assert "A's comment" not in view.text and ("only without the first branch" in view.text) == (not a)
    assert "for g" not in view.text and "y = y" in view.text  # one trip: the loop's body, g = 0
    assert ("unused" in kept) == a and "n" not in kept and "A" not in kept
    assert ("z = y" in view.text) == a  # without the A branch the alias goes


def test_a_flag_left_open_keeps_its_branch_and_loses_the_decided_part():
    view = teaching_view.pruned_source(sample, {"A": False})
    assert "elif" not in view.text and "    if B:\n" in view.text  # `elif B:` took the place of `if A and not B:`
    assert "if B or x > 3:" in view.text and "A and" not in view.text
    pruned = _load(view.text, "sample", globals())
    assert all(pruned(x, B=b, n=n) == sample(x, False, b, n) for x in range(-2, 6) for b in (False, True)
               for n in (0, 1, 2))


def chained(x, A=False, B=True, C=True):
    if A:
        x = x + 1
    elif B and not C:
        x = x * 3
    return x


def test_an_elif_left_partly_open_becomes_an_if():
    view = teaching_view.pruned_source(chained, {"A": False, "C": False})
    assert "    if B:\n        x = x * 3\n" in view.text and "elif" not in view.text
    pruned = _load(view.text, "chained", globals())
    assert all(pruned(x, b) == chained(x, False, b, False) for x in range(3) for b in (False, True))


def test_unknown_flags_are_refused_by_name_unless_another_is_used():
    with pytest.raises(ValueError, match=r"\['WINDOWS'\], none of which attn_fwd uses"):
        teaching_view.pruned_source(forward.attn_fwd, {"WINDOWS": False})
    view = teaching_view.pruned_source(forward.fwd_inner, {"VARLEN": False, "WINDOW": False})
    assert view.flags == {"WINDOW": False}  # fwd_inner has no VARLEN: a preset may name it


@pytest.mark.parametrize("module", [forward, backward, decode], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_view_of_the_kernels_compiles_and_decides_every_flag(module):
    for name, kernel in kernels_of(module):
        for only in (LATER, {"WINDOW": False}, {"VARLEN": False, "PAGED": False}):
            try:
                view = notebook.view_of(kernel, only)[0]
            except ValueError:  # uses none of them
                continue
            tree = ast.parse(view.text)
            compile(tree, name, "exec")
            names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | set(view.params)
            assert not names & {k for k in view.flags if k.isidentifier()}, (name, only)


def kernels_of(module):
    return [(name, obj) for name, obj in vars(module).items()
            if hasattr(obj, "fn") and getattr(obj.fn, "__module__", None) == module.__name__]


def views_module(tmp_path, module, only):
    """A module holding the views of ``module``'s kernels (those that use a value of ``only``),
    everything else imported from the real one."""
    parts = [f"from {module.__name__} import *\nfrom {module.__name__} import triton, tl\n"]
    for name, kernel in kernels_of(module):
        try:
            parts.append("\n\n" + teaching_view.pruned_source(kernel, only, ()).text)
        except ValueError:
            continue
    path = tmp_path / f"views_of_{module.__name__.rsplit('.', 1)[-1]}.py"
    path.write_text("".join(parts))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    views = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = views
    spec.loader.exec_module(views)
    return views


class InPlaceOf:
    """Launched in place of a real kernel: checks that the arguments its view drops hold the values
    that switch their features off, then launches the view with the others."""

    def __init__(self, real, view, only):
        self.real, self.view, self.only, self.launches = real, view, only, 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            signature = inspect.signature(self.real.fn)
            options = {k: v for k, v in kwargs.items() if k not in signature.parameters}  # num_warps ...
            bound = signature.bind(*args, **{k: v for k, v in kwargs.items() if k in signature.parameters})
            bound.apply_defaults()
            kept = inspect.signature(self.view.fn).parameters
            for name, value in bound.arguments.items():
                if name not in kept and name in self.only:
                    assert value == self.only[name], f"{name} = {value!r}: the view assumes {self.only[name]!r}"
            self.launches += 1
            return self.view[grid](**{k: v for k, v in bound.arguments.items() if k in kept}, **options)
        return launch


def swap(monkeypatch, module, views, only, names):
    swapped = [InPlaceOf(getattr(module, n), getattr(views, n), only) for n in names]
    for n, s in zip(names, swapped):
        monkeypatch.setattr(module, n, s)
    return swapped


@pytest.mark.parametrize("only, mods", [(LATER, {}),
                                        ({"WINDOW": False, "VARLEN": False, "n_group": 1, "PAGED": False},
                                         {"softcap": 3.0})], ids=["LATER", "softcap-left-open"])
def test_the_forward_views_run_to_the_same_output(tmp_path, monkeypatch, only, mods):
    """attn_fwd and fwd_inner's views, run by the real launcher in place of the kernels, give the
    real kernel's output and LSE bit for bit."""
    views = views_module(tmp_path, forward, only)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 24) for n in (19, 27, 27))
    for causal in (False, True):
        expected = flashattn.attention(q, k, v, is_causal=causal, return_lse=True, **mods)
        (swapped,) = swap(monkeypatch, forward, views, only, ["attn_fwd"])
        got = flashattn.attention(q, k, v, is_causal=causal, return_lse=True, **mods)
        monkeypatch.undo()
        assert swapped.launches == 1 and all(torch.equal(g, e) for g, e in zip(got, expected))


def test_the_backward_views_run_to_the_same_gradients(tmp_path, monkeypatch):
    """attn_bwd_dkdv, attn_bwd_dq and their loops' views give the real kernels' dQ, dK, dV bit for
    bit (with the float32 LSE they assume)."""
    views = views_module(tmp_path, backward, LATER)
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 24) for n in (19, 27, 27))
    do = torch.randn_like(q)
    for causal in (False, True):
        o, lse2 = forward.attention_forward(q, k, v, causal, 24 ** -0.5)
        assert lse2.dtype == torch.float32
        expected = backward.attention_backward(q, k, v, o, lse2, do, causal, 24 ** -0.5)
        swapped = swap(monkeypatch, backward, views, LATER, ["attn_bwd_dkdv", "attn_bwd_dq"])
        got = backward.attention_backward(q, k, v, o, lse2, do, causal, 24 ** -0.5)
        monkeypatch.undo()
        assert [s.launches for s in swapped] == [1, 1]
        assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_a_view_that_assumes_the_wrong_value_is_caught(tmp_path, monkeypatch):
    """The swap refuses a launch whose dropped arguments do not hold the view's values: grouped heads
    (n_group = 2) through a view that assumes one query head per K/V head."""
    views = views_module(tmp_path, forward, LATER)
    q = torch.randn(1, 2, 5, 16)
    k, v = torch.randn(1, 1, 7, 16), torch.randn(1, 1, 7, 16)
    swap(monkeypatch, forward, views, LATER, ["attn_fwd"])
    with pytest.raises(AssertionError, match="n_group = 2: the view assumes 1"):
        flashattn.attention(q, k, v, enable_gqa=True)


def test_show_source_says_what_it_hid(capsys):
    notebook.show_source(forward.fwd_inner, only={"WINDOW": False, "PAGED": False}, note="windows: chapter 10")
    shown = capsys.readouterr().out
    assert shown.startswith("# teaching view, ") and "; windows: chapter 10\n" in shown
    assert "if WINDOW" not in shown and "win_left" not in shown and "if MASKED:" in shown and "SOFTCAP" in shown
    html = notebook.source_html(forward.fwd_inner, only={"WINDOW": False})
    assert "teaching view" in html and "flashattn/kernels/forward.py" in html
