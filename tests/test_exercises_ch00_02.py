"""The checkers of chapters 00-02 fail typical mistakes (each one the solution with a named edit)
with a message that names the mistake. (tests/test_exercise_checks.py runs every solution and stub.)"""
import pytest

from flashattn.course import exercises as ex

from exercise_cases import mistakes  # tests/exercise_cases.py

# --- chapter 00 -----------------------------------------------------------------------------------

@mistakes(
    ("no mask", [('s.masked_fill(hidden, float("-inf"))', "s")], "WITHOUT the causal mask"),
    ("bottom-right", [("> torch.arange(n_q, device=s.device)[:, None]",
                       "> torch.arange(n_q, device=s.device)[:, None] + n_kv - n_q")], "bottom-right"),
    ("fixed scale", [("s = q @ k.transpose(-2, -1) * scale", "s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5")],
     "use the `scale` argument"),
    ("zero fill", [('s.masked_fill(hidden, float("-inf"))', "s.masked_fill(hidden, 0.0)")],
     "-inf before the softmax, not 0"),
    ("strict mask", [("[None, :] > torch.arange(n_q", "[None, :] >= torch.arange(n_q")], "NaN in query row 0"),
    ("a tuple", [("return p @ v", "return p @ v, None")], "return only the output"),
    ("SDPA", [("return p @ v", "return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, "
                               "scale=scale)")], "calls torch.nn.functional.scaled_dot_product_attention"),
)
def test_naive_causal_attention_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_naive_causal_attention(solutions("00", edits).naive_causal_attention)


PER_PAIR = "per_pair = 2 * batch * heads * element"
ROOT = "return math.isqrt(memory_bytes // per_pair)"


@mistakes(
    ("one matrix", [(PER_PAIR, "per_pair = batch * heads * element")], "ONE N x N matrix"),
    ("batch and heads forgotten", [(PER_PAIR, "per_pair = 2 * element")], "every sequence of the batch and every head"),
    ("4 bytes", [("element = torch.empty((), dtype=dtype).element_size()", "element = 4")], "4 bytes per element"),
    ("1 byte", [("element = torch.empty((), dtype=dtype).element_size()", "element = 1")], "1 byte per element"),
    ("bits", [("element = torch.empty((), dtype=dtype).element_size()",
               "element = torch.empty((), dtype=dtype).element_size() * 8")], "bits"),
    ("not squared", [(ROOT, "return memory_bytes // per_pair")], "square root"),
    ("rounded up", [(ROOT, "return math.ceil(math.sqrt(memory_bytes / per_pair))")], "rounded down"),
    ("one short", [(ROOT, "return math.isqrt(memory_bytes // per_pair) - 1")], "fits too"),
    ("strict", [(ROOT, "return math.isqrt(memory_bytes // per_pair - 1)")], "fill the memory exactly"),
    ("a float", [(ROOT, "return math.sqrt(memory_bytes / per_pair)")], "whole number of positions"),
    ("not a number", [(ROOT, 'return "long"')], "return a number"),
)
def test_max_context_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_max_context(solutions("00", edits).max_context)


# --- chapter 01 -----------------------------------------------------------------------------------

@mistakes(
    ("L not rescaled", [("l = l * torch.exp(m - m_new) + ", "l = l + ")], "never rescaled"),
    ("no max subtracted", [("l = l * torch.exp(m - m_new) + torch.exp(xb - m_new[:, None])",
                            "l = l + torch.exp(xb)"),
                           ("return torch.exp(x - m[:, None]) / l[:, None]",
                            "return torch.exp(x) / l[:, None]")], "inf or NaN"),
    # the shortcuts the exercise rules out
    ("torch.softmax", [("return torch.exp(x - m[:, None]) / l[:, None]", "return torch.softmax(x, dim=-1)")],
     "calls torch.softmax"),
    ("Tensor.softmax", [("return torch.exp(x - m[:, None]) / l[:, None]", "return x.softmax(-1)")],
     "calls Tensor.softmax"),
    ("F.softmax", [("return torch.exp(x - m[:, None]) / l[:, None]",
                    "return torch.nn.functional.softmax(x, dim=-1)")], "calls torch.nn.functional.softmax"),
    ("an alias of torch.softmax", [("def online_softmax(x, block):", "from torch import softmax as sm\n\n\n"
                                    "def online_softmax(x, block):"),
                                   ("return torch.exp(x - m[:, None]) / l[:, None]", "return sm(x, -1)")],
     "calls torch.softmax"),
    ("flashattn's own", [("return torch.exp(x - m[:, None]) / l[:, None]",
                          "import flashattn.testing.reference as r\n    return r.online_softmax(x, block)")],
     "flashattn.testing.reference.online_softmax"),
    ("two passes", [("for start in range(0, x.shape[-1], block):",
                     "m = x.max(dim=-1).values\n    for start in range(0, 0, block):"),
                    ("return torch.exp(x - m[:, None]) / l[:, None]",
                     "return torch.exp(x - m[:, None]) / torch.exp(x - m[:, None]).sum(-1, keepdim=True)")],
     "columns at once"),
    ("last block dropped", [("for start in range(0, x.shape[-1], block):",
                             "for start in range(0, x.shape[-1] - x.shape[-1] % block if x.shape[-1] > block "
                             "else x.shape[-1], block):"),
                            ("return torch.exp(x - m[:, None]) / l[:, None]",
                             "return (torch.exp(x - m[:, None]) / l[:, None]).masked_fill("
                             "torch.arange(x.shape[-1]) >= start + block, 0.0)")], "last, shorter block"),
)
def test_online_softmax_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_online_softmax(solutions("01", edits).online_softmax)


MERGED_L = "return m, l_a * torch.exp(m_a - m_safe) + l_b * torch.exp(m_b - m_safe)"


@mistakes(
    ("sums added", [(MERGED_L, "return m, l_a + l_b")], r"l_a \+ l_b"),
    ("only l_b rescaled", [("l_a * torch.exp(m_a - m_safe) + ", "l_a + ")], "only l_b"),
    ("smaller max", [("m = torch.maximum(m_a, m_b)", "m = torch.minimum(m_a, m_b)")], "LARGER"),
    ("m only", [(MERGED_L, "return m")], "tuple of 2"),
    ("no guard", [('torch.where(m == float("-inf"), torch.zeros_like(m), m)', "m")], "both pieces are empty"),
    # (l_a e^(m_a - m_b) + l_b) e^(m_b - m) is right on paper, but overflows when the maxima are far apart
    ("factored", [(MERGED_L, "return m, (l_a * torch.exp(m_a - m_b) + l_b) * torch.exp(m_b - m)")], "overflows"),
    ("NaN for one empty piece", [('torch.where(m == float("-inf"), torch.zeros_like(m), m)',
                                  'torch.where(torch.isinf(m_a) | torch.isinf(m_b), float("nan"), m)')],
     "one piece is empty"),
)
def test_merge_softmax_states_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_merge_softmax_states(solutions("01", edits).merge_softmax_states)


@mistakes(
    ("O not rescaled", [("acc = acc * alpha[:, None] + p @ vb", "acc = acc + p @ vb")],
     "accumulator O was not rescaled"),
    ("L not rescaled", [("l = l * alpha + p.sum(dim=-1)", "l = l + p.sum(dim=-1)")], "L was not rescaled"),
    ("neither rescaled", [("acc = acc * alpha[:, None] + p @ vb", "acc = acc + p @ vb"),
                          ("l = l * alpha + p.sum(dim=-1)", "l = l + p.sum(dim=-1)")], "neither L nor O"),
    ("softmax of the whole row", [("return acc / l[:, None]", "return torch.softmax(s, -1) @ v")],
     "calls torch.softmax"),
    ("P V of the whole row", [("return acc / l[:, None]", "return torch.exp(s - m[:, None]) / l[:, None] @ v")],
     "multiplied"),
    ("no max subtracted", [("m_new = torch.maximum(m, sb.max(dim=-1).values)", "m_new = torch.zeros_like(m)")],
     "inf or NaN"),
)
def test_online_softmax_weighted_sum_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_online_softmax_weighted_sum(solutions("01", edits).online_softmax_weighted_sum)


# --- chapter 02 -----------------------------------------------------------------------------------

LSE = "return (m2 + torch.log2(l)) * math.log(2.0)"


@mistakes(
    ("base 2", [(LSE, "return m2 + torch.log2(l)")], "base-2 value"),
    ("natural log of l", [(LSE, "return m2 + torch.log(l)")], r"m2 \+ ln\(l\)"),
    ("divided", [(LSE, "return (m2 + torch.log2(l)) / math.log(2.0)")], "MULTIPLY"),
    ("m2 alone converted", [(LSE, "return m2 * math.log(2.0) + torch.log2(l)")], "whole sum"),
)
def test_lse_from_state_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_lse_from_state(solutions("02", edits).lse_from_state)


EXP = '"tl.exp(x)":          {"ex2": 1, "mul": 1, "fma": 0, "add": 0}'
EXP2 = '"tl.exp2(x)":         {"ex2": 1, "mul": 0, "fma": 0, "add": 0}'
FMA = '"tl.exp2(x * c - m)": {"ex2": 1, "mul": 0, "fma": 1, "add": 0}'


@mistakes(
    ("e^x native", [(EXP, EXP.replace('"mul": 1', '"mul": 0'))], "has no e\\^x, so tl.exp\\(x\\) is computed as 2\\^"),
    ("exp2 with a multiply", [(EXP2, EXP2.replace('"mul": 0', '"mul": 1'))], "the hardware's own exponential"),
    ("not fused", [(FMA, FMA.replace('"mul": 0, "fma": 1, "add": 0', '"mul": 1, "fma": 0, "add": 1'))],
     "fuses the multiply and the subtraction"),
    ("fused and multiplied", [(FMA, FMA.replace('"mul": 0', '"mul": 1'))], "multiplies x by c itself"),
    ("fused and subtracted", [(FMA, FMA.replace('"add": 0', '"add": 1'))], "happens inside the fma"),
    ("two exponentials", [(EXP, EXP.replace('"ex2": 1', '"ex2": 2'))], "one exponential per element"),
    ("a form missing", [(FMA + "}", "}")], "one entry per form"),
    ("an instruction missing", [(EXP2, EXP2.replace(', "add": 0', ""))], "a dict of numbers with the keys"),
)
def test_ptx_prediction_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_ptx_prediction(solutions("02", edits).predicted_instructions)


def test_ptx_prediction_counts_what_the_compiler_emits():
    """The counts the check compares with are the compiler's own (the explanations describe them)."""
    from flashattn.course.exercises import ch00_02

    assert ch00_02.instruction_counts(ex.exp_forms_ptx()) == ch00_02.EXPECTED_COUNTS


def test_ptx_prediction_holds_whatever_triton_fuses_by_default(monkeypatch):
    """The check compiles with FP fusion on, so the fma form's answer does not change with Triton's
    default (Triton 3.10 turns it off): here the default is off, as TRITON_DEFAULT_FP_FUSION=0 sets
    it, and the counts are the same; a job that leaves the option to the default does not fuse."""
    from flashattn.course.exercises import ch00_02
    from flashattn.measure.compiled import ptx_of_many

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")  # the compiling child inherits it
    assert ch00_02.instruction_counts(ch00_02.exp_forms_ptx.__wrapped__()) == ch00_02.EXPECTED_COUNTS
    form = ch00_02.EXP_FORMS["fma"]
    (unfused,) = ptx_of_many([dict(kernel=ch00_02.exp_forms, pointers=dict(X="fp32", Y="fp32"), floats=("c", "m"),
                                   constexprs=dict(FORM="fma", BLOCK=ch00_02.EXP_BLOCK),
                                   num_warps=ch00_02.EXP_WARPS, arch=90)])
    assert ch00_02.instruction_counts({form: unfused})[form]["fma"] == 0  # the default was off: the test can fail


def test_shortcuts_are_put_back(solutions):
    """The shortcuts a checker forbids while the learner's code runs work again afterwards."""
    import torch

    with pytest.raises(ex.ExerciseError, match="calls Tensor.softmax"):
        ex.check_online_softmax(solutions("01", [("return torch.exp(x - m[:, None]) / l[:, None]",
                                                  "return x.softmax(-1)")]).online_softmax)
    x = torch.randn(3, 5)
    assert torch.allclose(x.softmax(-1), torch.softmax(x, -1)) and torch.allclose((x @ x.T).sum(-1), x @ x.sum(0), atol=1e-5)
    assert torch.max(x, -1).values.shape == (3,)


@mistakes(
    ("first alpha 1", [("    alphas, m = [], float(\"-inf\")\n", "    alphas, m = [], float(\"-inf\")\n    first = True\n"),
                       ("        alphas.append(math.exp(m - m_new))        #", "        alphas.append(1.0 if first else math.exp(m - m_new))        #"),
                       ("        m = m_new\n    return alphas", "        m, first = m_new, False\n    return alphas")],
     "nothing before it to rescale"),
    ("sign flipped", [("alphas.append(math.exp(m - m_new))", "alphas.append(0.0 if m == float('-inf') else math.exp(m_new - m))")],
     "sign flipped"),
    ("previous block's max", [("        m_new = max(m, block_max)\n", "        m_new = block_max\n")], "running max"),
    ("the course's own", [("    return alphas\n", "    reference.online_softmax_trace\n    return alphas\n")],
     "uses flashattn.testing.reference.online_softmax_trace"),
)
def test_block_alphas_catches(solutions, edits, message):
    with pytest.raises(ex.ExerciseError, match=message):
        ex.check_block_alphas(solutions("01", edits).block_alphas)
