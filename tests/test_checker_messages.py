"""What a learner sees when a check fails, in the programs that show it: one short line naming the
mistake (no traceback, no checker source, no hint meant for another mistake), in a Jupyter kernel as
JupyterLab and nbclient run it, in nbgrader's autograde (which still scores a wrong or missing
answer 0, and a right one full marks), in its Validate and in the feedback it generates.

The notebooks here are small scratch notebooks made of chapter 01's exercise cells (its markdown,
solution and check cells, with nbgrader's metadata), some with a deliberate mistake written into
the solution: real exercises, small enough to run in seconds.
"""
import os
import re
import sys
from pathlib import Path

import nbformat
import pytest

import flashattn

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = ROOT / "notebooks" / "01_online_softmax.ipynb"
ANSI = re.compile(r"\x1b\[[0-9;]*m")

# grade_id: (a deliberate mistake as an edit of the solution, what the message must say, hints of
# the checker's OTHER mistakes that the message must not contain)
MISTAKES = {
    "ch01-online-softmax": (("return torch.exp(x - m[:, None]) / l[:, None]", "return torch.softmax(x, dim=-1)"),
                            "calls torch.softmax", ["never rescaled", "shorter block", "inf or NaN"]),
    "ch01-merge-states": (("return m, l_a * torch.exp(m_a - m_safe) + l_b * torch.exp(m_b - m_safe)",
                           "return m, l_a + l_b"),
                          "l_a + l_b", ["only l_b", "only l_a", "LARGER", "wrong sign"]),
    "ch01-online-weighted-sum": (("acc = acc * alpha[:, None] + p @ vb", "acc = acc + p @ vb"),
                                 "accumulator O was not rescaled",
                                 ["L was not rescaled", "neither L nor O", "shorter block"]),
}


def _meta(cell):
    return cell.get("metadata", {}).get("nbgrader", {})


def scratch_notebook(mistakes=()):
    """Chapter 01's exercises as a notebook of their own: an import cell, then each exercise's
    cells (statement, solution, check), the grade_ids in ``mistakes`` with their mistake written
    in, then a last cell that says the run got there."""
    chapter = nbformat.read(CHAPTER, as_version=4)
    # the exercises sit where their topics are taught: keep each one's statement (the markdown cell
    # before its solution), solution and check, and none of the chapter's other cells
    keep = [i for i, c in enumerate(chapter.cells) if _meta(c).get("grade_id")]
    keep = sorted(set(keep) | {i - 1 for i in keep if _meta(chapter.cells[i]).get("solution")})
    cells = [nbformat.v4.new_code_cell("import math\n\nimport torch\n\nimport flashattn.course.exercises")]
    for cell in (chapter.cells[i] for i in keep):
        cell = nbformat.from_dict(cell)
        gid = _meta(cell).get("grade_id")
        if gid in mistakes:
            old, new = MISTAKES[gid][0]
            assert cell.source.count(old) == 1, (gid, old)
            cell.source = cell.source.replace(old, new)
        cells.append(cell)
    cells.append(nbformat.v4.new_code_cell('print("ran to the end")'))
    nb = nbformat.v4.new_notebook(cells=cells, metadata=chapter.metadata)
    return nb


def student(nb):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import make_student
    finally:
        sys.path.pop(0)
    return make_student.student_version(nb)


def env_with_flashattn():
    path = os.pathsep.join(filter(None, [str(Path(flashattn.__file__).parent.parent), os.environ.get("PYTHONPATH")]))
    return {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "PYTHONPATH": path}


def one_line(error):
    """The error output's text; fails unless it is one short line with no traceback or source."""
    lines = [ANSI.sub("", line) for line in error["traceback"]]
    assert len(lines) == 1 and "\n" not in lines[0], "\n".join(lines)
    text = lines[0]
    assert text.startswith("ExerciseError: ") and len(text) < 600, text
    assert not re.search(r"Traceback|File \"|Cell In\[|-+>|\bdef \w+\(", text), text
    return text


def test_a_kernel_shows_each_failing_check_as_one_line(tmp_path, monkeypatch):
    """Run All, as nbclient (and JupyterLab) runs it: the student notebook with every exercise
    answered wrongly goes on to the end, and each check records only its own mistake."""
    from nbclient import NotebookClient

    answered = scratch_notebook(MISTAKES)
    nb = student(answered)                 # the check cells tagged, as the learner has them...
    for mine, theirs in zip(nb.cells, answered.cells):
        if _meta(mine).get("solution"):     # ...with the learner's (wrong) answers in place of the stubs
            mine.source = theirs.source
    monkeypatch.setenv("PYTHONPATH", env_with_flashattn()["PYTHONPATH"])  # the kernel is a child of this process
    NotebookClient(nb, timeout=120, allow_errors=False, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert "ran to the end" in nb.cells[-1].outputs[0]["text"]
    seen = set()
    for cell in nb.cells:
        gid = _meta(cell).get("grade_id", "").removesuffix("-check")
        if not _meta(cell).get("grade") or gid not in MISTAKES:
            continue
        errors = [out for out in cell.outputs if out["output_type"] == "error"]
        assert len(errors) == 1, (gid, cell.outputs)
        text = one_line(errors[0])
        _, says, others = MISTAKES[gid]
        assert says in text, (gid, text)
        assert not [hint for hint in others if hint in text], (gid, text)
        seen.add(gid)
    assert seen == set(MISTAKES)


@pytest.fixture
def course(tmp_path, monkeypatch):
    """A scratch nbgrader course whose assignment "ps" is chapter 01's exercises, generated; returns
    its folder and nbgrader's API on it (what its command line runs, here in this process)."""
    pytest.importorskip("nbgrader", reason="nbgrader is not installed (pip install -e '.[instructor]')")
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory
    from traitlets.config import Config

    monkeypatch.setenv("PYTHONPATH", env_with_flashattn()["PYTHONPATH"])  # for the kernels it starts
    (tmp_path / "source" / "ps").mkdir(parents=True)
    nbformat.write(scratch_notebook(), tmp_path / "source" / "ps" / "ps.ipynb")
    config = Config()
    config.CourseDirectory.root = str(tmp_path)
    config.CourseDirectory.course_id = "scratch"
    config.Execute.timeout = 120
    api = NbGraderAPI(coursedir=CourseDirectory(config=config), config=config)

    def run(what, *args):
        result = getattr(api, what)(*args)
        assert result["success"], result.get("error", "") + result.get("log", "")

    run("generate_assignment", "ps")
    return tmp_path, run


@pytest.mark.slow
# nbgrader 0.9.6 with SQLAlchemy 2.1 warns while it records a submission (the grades are right);
# pytest.ini turns RuntimeWarnings, which SAWarning is, into errors
@pytest.mark.filterwarnings("ignore:Object of type <Submitted")
def test_nbgrader_scores_a_stub_0_and_the_solution_full_marks(course):
    root, run = course
    release = nbformat.read(root / "release" / "ps" / "ps.ipynb", as_version=4)
    submissions = {"stub": student(scratch_notebook()),       # what the learner got, untouched
                   "wrong": student(scratch_notebook()),      # one exercise answered wrongly
                   "solved": scratch_notebook()}              # the chapter's solutions
    wrong_gid = "ch01-merge-states"         # answered wrongly; the other three right
    for mine, theirs in zip(submissions["wrong"].cells, scratch_notebook({wrong_gid}).cells):
        if _meta(mine).get("solution"):
            mine.source = theirs.source
    assert [c.source for c in release.cells] == [c.source for c in submissions["stub"].cells]
    from nbgrader.api import Gradebook

    for name, nb in submissions.items():
        (root / "submitted" / name / "ps").mkdir(parents=True)
        nbformat.write(nb, root / "submitted" / name / "ps" / "ps.ipynb")
        with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gradebook:
            gradebook.add_student(name)  # as `nbgrader db student add` does
        run("autograde", "ps", name)
    run("generate_feedback", "ps", "wrong")

    with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gradebook:
        scores = {name: (gradebook.find_submission("ps", name).score,
                         gradebook.find_submission("ps", name).max_score) for name in submissions}
    assert scores == {"stub": (0, 4), "wrong": (3, 4), "solved": (4, 4)}, scores  # chapter 01's four exercises

    graded = nbformat.read(root / "autograded" / "wrong" / "ps" / "ps.ipynb", as_version=4)
    (check,) = [c for c in graded.cells if _meta(c).get("grade_id") == f"{wrong_gid}-check"]
    (error,) = [out for out in check.outputs if out["output_type"] == "error"]
    message = one_line(error)
    assert MISTAKES[wrong_gid][1] in message
    # nbgrader's Validate (the learner's button): the one failing check, and its one-line message
    from nbgrader.validator import Validator

    failed = Validator().validate(str(root / "submitted" / "wrong" / "ps" / "ps.ipynb"))["failed"]
    assert [f["source"] for f in failed] == ["flashattn.course.exercises.check_merge_softmax_states(merge_softmax_states)"]
    assert one_line({"traceback": [failed[0]["raw_error"]]}) == message

    (feedback,) = (root / "feedback" / "wrong" / "ps").glob("*.html")
    html = feedback.read_text(encoding="utf8")
    assert "l_a + l_b" in html and "Traceback (most recent call last)" not in html and "_diagnose" not in html
