"""Every exercise of every chapter, found in the notebooks themselves: its check cell, run as the
notebook runs it, passes the notebook's solution and says "not implemented yet" for the student
stub. (What each checker says of typical mistakes is in the test_exercises_ch*.py files.)"""
from pathlib import Path

import pytest

import flashattn
from flashattn.course import exercises as ex
from flashattn.course.exercises.solutions import cells, grade_id

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def check_cells():
    """(chapter, grade_id of the exercise, source of its check cell), in notebook order."""
    found = []
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        for cell, text in cells(path):
            gid = grade_id(cell) or ""
            if cell["cell_type"] == "code" and gid.endswith("-check"):
                found.append((path.name[:2], gid.removesuffix("-check"), text))
    return found


CHECKS = check_cells()


@pytest.fixture(autouse=True)
def no_figures(monkeypatch):
    monkeypatch.setattr("matplotlib.pyplot.show", lambda *a, **k: None)


def run_check(module, check):
    exec(check, {"flashattn": flashattn, **vars(module)})


def test_every_chapter_has_exercises():
    assert len(CHECKS) >= 30 and {chapter for chapter, _, _ in CHECKS} == {f"{n:02d}" for n in range(15)}


@pytest.mark.parametrize("chapter, exercise, check", CHECKS, ids=[c[1] for c in CHECKS])
def test_solution_passes(solutions, capsys, chapter, exercise, check):
    run_check(solutions(chapter), check)
    assert "PASSED" in capsys.readouterr().out


@pytest.mark.parametrize("chapter, exercise, check", CHECKS, ids=[c[1] for c in CHECKS])
def test_stub_is_not_implemented(solutions, chapter, exercise, check):
    with pytest.raises(ex.ExerciseError, match="not implemented yet"):
        run_check(solutions(chapter, stub=exercise), check)
