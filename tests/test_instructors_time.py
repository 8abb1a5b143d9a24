"""INSTRUCTORS.md's learner time per chapter is one computation of tools/make_student.py over the
notebooks: every exercise has a kind (and so its minutes), and `--check` finds the table stale as soon
as a count or a kind's minutes change."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import make_student  # noqa: E402  (tools/make_student.py)


@pytest.fixture(scope="module")
def notebooks():
    return [(path, make_student.read(path)) for path in make_student.chapter_notebooks()]


def generated(notebooks):
    text = make_student.INSTRUCTORS.read_text(encoding="utf8")
    return text, make_student.with_generated_section(text, make_student.tables(notebooks))


def test_every_exercise_has_a_kind(notebooks):
    assert make_student.kind_problems(notebooks) == []


def test_the_table_is_fresh(notebooks):
    text, expected = generated(notebooks)
    assert text == expected, "INSTRUCTORS.md is stale: run `python tools/make_student.py`"


def test_a_kind_without_its_exercise_and_an_exercise_without_its_kind_are_refused(notebooks, monkeypatch):
    kinds = dict(make_student.EXERCISE_KINDS)
    del kinds["ch07-dq-kernel"]
    kinds["ch99-gone"] = "function"
    monkeypatch.setattr(make_student, "EXERCISE_KINDS", kinds)
    problems = "\n".join(make_student.kind_problems(notebooks))
    assert "exercise ch07-dq-kernel has no kind" in problems
    assert "EXERCISE_KINDS names ch99-gone, which no notebook holds" in problems


@pytest.mark.parametrize("change", ["minutes", "words"])
def test_a_change_makes_the_table_stale(notebooks, monkeypatch, change):
    if change == "minutes":   # one kind's minutes: the chapters' times, the totals and the sentence move
        monkeypatch.setitem(make_student.KINDS, "kernel", (61, make_student.KINDS["kernel"][1]))
    else:                     # one more word in a chapter
        path, nb = notebooks[0]
        nb = make_student.nbformat.from_dict(nb)
        next(c for c in nb.cells if c.cell_type == "markdown").source += " more"
        notebooks = [(path, nb), *notebooks[1:]]
    text, expected = generated(notebooks)
    assert text != expected
