"""The student notebooks in exercises/: fresh, complete, stubbed where the solutions were, and
failing exactly at the exercises' check cells (with "not implemented") while everything else runs:
Run All goes on past every check cell (they are tagged raises-exception) and each failing check
records one short line, the learner's message, with no traceback.

The student notebooks are made by tools/make_student.py; these tests read its output with their
own eyes (they do not trust the tool). Executing the student notebooks is the slow part: each
one runs once, in a fresh kernel with cwd = exercises/, several at a time (set
STUDENT_NOTEBOOK_WORKERS to change how many; default: the CPU count, at most 4).
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import flashattn
from flashattn.course.exercises.solutions import BEGIN, END, stubbed
from flashattn.course.notebook import execute

pytestmark = pytest.mark.slow  # whole chapters run: CI's fast part leaves them out

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
EXERCISES = ROOT / "exercises"
TOOL = ROOT / "tools" / "make_student.py"
CHAPTERS = 10               # 00 to 09
MIN_EXERCISES = 12          # across the course


def meta(cell):
    return cell.get("metadata", {}).get("nbgrader", {})


def is_solution(cell):
    return bool(meta(cell).get("solution"))


def is_check(cell):
    return bool(meta(cell).get("grade")) and not meta(cell).get("solution")


def chapter_notebooks():
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def with_exercises():
    return [path for path in chapter_notebooks()
            if any(is_solution(cell) for cell in nbformat.read(path, as_version=4).cells)]


# ---------------------------------------------------------------------------------------------
# (1) exercises/ is fresh, and regenerating it is deterministic
# ---------------------------------------------------------------------------------------------

def test_exercises_are_up_to_date():
    # the tool imports the flashattn this process tests, installed or not
    path = os.pathsep.join(filter(None, [str(Path(flashattn.__file__).parent.parent), os.environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, str(TOOL), "--check"], cwd=ROOT, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": path})
    if result.returncode != 0:
        pytest.fail(result.stdout + result.stderr, pytrace=False)


# ---------------------------------------------------------------------------------------------
# (2) every notebook with exercises has a student version, stubbed where the solution was
# ---------------------------------------------------------------------------------------------

def test_every_notebook_with_exercises_has_a_student_version():
    missing = [path.name for path in with_exercises() if not (EXERCISES / path.name).exists()]
    if missing:
        pytest.fail(f"no student version in exercises/ for: {', '.join(missing)} "
                    "(run `python tools/make_student.py`)", pytrace=False)


def solution_lines(source):
    """The code lines inside the solution regions that do not also appear outside them."""
    inside_lines, outside_lines, inside = [], set(), False
    for line in source.split("\n"):
        if line.strip() == BEGIN:
            inside = True
        elif line.strip() == END:
            inside = False
        elif inside:
            inside_lines.append(line.strip())
        else:
            outside_lines.add(line.strip())
    return [line for line in inside_lines if line and line not in outside_lines]


@pytest.mark.parametrize("path", chapter_notebooks(), ids=lambda path: path.stem)
def test_student_version_is_stubbed(path):
    source = nbformat.read(path, as_version=4)
    student_path = EXERCISES / path.name
    if not student_path.exists():
        pytest.fail(f"exercises/{path.name} is missing: run `python tools/make_student.py`", pytrace=False)
    student = nbformat.read(student_path, as_version=4)
    if len(student.cells) != len(source.cells):
        pytest.fail(f"exercises/{path.name} has {len(student.cells)} cells, notebooks/{path.name} has "
                    f"{len(source.cells)}: run `python tools/make_student.py`", pytrace=False)
    problems = []
    grade_ids = {meta(cell).get("grade_id") for cell in source.cells}
    for index, (cell, theirs) in enumerate(zip(source.cells, student.cells)):
        where = f"cell {index}" + (f" ({meta(cell)['grade_id']})" if meta(cell).get("grade_id") else "")
        if theirs.cell_type == "code" and (theirs.outputs or theirs.execution_count is not None):
            problems.append(f"{where}: the student version keeps outputs or an execution count")
        kept = {key: meta(theirs).get(key) for key in meta(cell)}
        added = set(meta(theirs)) - set(meta(cell))
        if kept != meta(cell) or added - {"checksum", "cell_type"}:  # nbgrader adds only these two
            problems.append(f"{where}: nbgrader metadata differs from the chapter notebook's")
        if is_solution(cell):
            lines = [line.strip() for line in cell.source.split("\n")]
            if BEGIN not in lines or END not in lines:
                problems.append(f"{where}: solution cell without '{BEGIN}' / '{END}'")
                continue
            if f"{meta(cell)['grade_id']}-check" not in grade_ids:
                problems.append(f"{where}: no check cell with grade_id '{meta(cell)['grade_id']}-check'")
            leaked = [line for line in solution_lines(cell.source) if line in
                      {x.strip() for x in theirs.source.split("\n")}]
            if leaked:
                problems.append(f"{where}: solution code left in the student version: {leaked}")
            if "SOLUTION" in theirs.source:
                problems.append(f"{where}: solution markers left in the student version")
            if theirs.source != stubbed(cell.source):
                problems.append(f"{where}: expected the student cell to read\n{stubbed(cell.source)}\n"
                                f"but it reads\n{theirs.source}")
            if theirs.metadata.get("deletable") is not False:
                problems.append(f"{where}: the solution cell should be undeletable (nbgrader's LockCells)")
        else:
            if theirs.source != cell.source:
                problems.append(f"{where}: a cell without a solution changed in the student version")
            if is_check(cell):
                if not re.search(r"\bcheck_\w+\s*\(", cell.source):
                    problems.append(f"{where}: a check cell should call flashattn.course.exercises.check_<name>(...)")
                if theirs.metadata.get("editable") is not False:
                    problems.append(f"{where}: the check cell should be read-only (nbgrader's LockCells)")
                if "raises-exception" not in theirs.metadata.get("tags", []):
                    problems.append(f"{where}: the check cell should be tagged raises-exception, so that "
                                    "Run All goes on past it")
    if problems:
        pytest.fail(f"exercises/{path.name}:\n  " + "\n  ".join(problems), pytrace=False)


# ---------------------------------------------------------------------------------------------
# (3) run each student notebook once: check cells fail with "not implemented", the rest runs
# ---------------------------------------------------------------------------------------------

class _Report:
    """A plugin that adds this module's lines to pytest's terminal summary."""

    def __init__(self):
        self.lines = []

    def pytest_terminal_summary(self, terminalreporter):
        for line in self.lines:
            terminalreporter.write_line(line)


def report(request, line):
    plugins = request.config.pluginmanager
    if plugins.get_plugin("student-notebooks-report") is None:
        plugins.register(_Report(), "student-notebooks-report")
    plugins.get_plugin("student-notebooks-report").lines.append(line)
    print(line)


@pytest.fixture(scope="session")
def executed(request):
    """{notebook name: the executed student notebook (or the exception that stopped it)}, for every
    notebook that the selected tests ask about: they all run together on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            wanted = {item.callspec.params["name"] for item in request.session.items
                      if getattr(item, "originalname", "") == "test_student_notebook_fails_only_at_checks"}
            todo = sorted((wanted | {name}) - set(cache))
            workers = int(os.environ.get("STUDENT_NOTEBOOK_WORKERS", min(4, os.cpu_count() or 1)))
            # allow_errors=False: only the cells tagged raises-exception (the check cells) may fail,
            # as in JupyterLab's Run All; any other error stops the run and fails the test
            results = execute([EXERCISES / n for n in todo], cwd=EXERCISES, workers=max(1, workers), timeout=300,
                              allow_errors=False)
            cache.update({path.name: nb for path, (nb, _) in results.items()})
            report(request, f"student notebooks run ({workers} at a time): " + ", ".join(
                f"{path.stem.split('_', 1)[0]} {seconds:.0f} s" for path, (_, seconds) in results.items()))
        return cache[name]

    return get


def _errors(cell):
    return [out for out in cell.get("outputs", []) if out.get("output_type") == "error"]


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def learner_functions(nb):
    """For each check cell (by index): the names of the functions its exercise asks for, and those
    of every other exercise of the notebook."""
    functions, check_of = {}, {}
    for index, cell in enumerate(nb.cells):
        if is_solution(cell):
            functions[meta(cell)["grade_id"]] = set(re.findall(r"^def (\w+)", cell.source, re.M))
        elif is_check(cell):
            check_of[index] = meta(cell)["grade_id"].removesuffix("-check")
    everything = set().union(*functions.values()) if functions else set()
    own = {index: functions.get(gid, set()) for index, gid in check_of.items()}
    return own, {index: everything - names for index, names in own.items()}


def short_message_problems(error, own, others):
    """What keeps a check cell's recorded error from being one short message for the learner: a
    traceback of several lines, checker source, a very long text, another exercise's name."""
    lines = [ANSI.sub("", line) for line in error.get("traceback", [])]
    text = "\n".join(lines)
    problems = []
    if len(lines) != 1 or "\n" in lines[0]:
        problems.append(f"the error output should be one line, got {len(text.splitlines())}:\n{text[:1500]}")
    if re.search(r"Traceback|File \"|Cell In\[|-+>|^\s*\d+ |\bdef \w+\(", text, re.M):
        problems.append(f"the error output shows a traceback or source lines:\n{text[:1500]}")
    if len(text) > 600:
        problems.append(f"the error output is {len(text)} characters long (at most 600): {text[:300]}...")
    if own and not any(re.search(rf"\b{name}\b", text) for name in own):
        problems.append(f"the message does not name the exercise's function ({', '.join(sorted(own))}): {text}")
    if any(re.search(rf"\b{name}\b", text) for name in others):
        problems.append(f"the message names another exercise's function: {text}")
    return problems


@pytest.mark.parametrize("name", [path.name for path in with_exercises()],
                         ids=lambda name: name.removesuffix(".ipynb"))
def test_student_notebook_fails_only_at_checks(name, executed):
    if not (EXERCISES / name).exists():
        pytest.fail(f"exercises/{name} is missing: run `python tools/make_student.py`", pytrace=False)
    nb = executed(name)
    if isinstance(nb, Exception):
        pytest.fail(f"exercises/{name} did not run to the end: {type(nb).__name__}: {nb}", pytrace=False)
    problems = []
    own, others = learner_functions(nb)
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        errors = _errors(cell)
        where = f"cell {index}" + (f" ({meta(cell)['grade_id']})" if meta(cell).get("grade_id") else "")
        if is_check(cell):
            if not errors:
                problems.append(f"{where}: the check passed on the untouched stub (it must fail)")
            elif errors[0]["ename"] != "ExerciseError" or "not implemented" not in errors[0]["evalue"].lower():
                problems.append(f"{where}: the check should fail with ExerciseError '... not implemented ...', "
                                f"got {errors[0]['ename']}: {errors[0]['evalue']}")
            else:
                problems += [f"{where}: {p}" for p in short_message_problems(errors[0], own[index], others[index])]
        elif errors:
            problems.append(f"{where}: raised {errors[0]['ename']}: {errors[0]['evalue']}\n"
                            f"    (every cell but the check cells must run on the student version; "
                            f"does it use a function the learner has not written yet?)\n"
                            + "\n".join("    " + line for line in cell.source.split("\n")))
    if problems:
        pytest.fail(f"exercises/{name}:\n  " + "\n  ".join(problems), pytrace=False)


# ---------------------------------------------------------------------------------------------
# (4) how many exercises the course has
# ---------------------------------------------------------------------------------------------

def test_enough_exercises(request):
    counts = {path.stem: sum(is_solution(cell) for cell in nbformat.read(path, as_version=4).cells)
              for path in chapter_notebooks()}
    total = sum(counts.values())
    summary = (f"student notebooks: {total} exercises in {len(counts)} chapter notebooks ("
               + ", ".join(f"{name.split('_', 1)[0]}: {n}" for name, n in counts.items()) + ")")
    report(request, summary)
    assert len(counts) >= CHAPTERS, f"{summary}: expected chapters 00 to 09"
    assert total >= MIN_EXERCISES, f"{summary}: the course needs at least {MIN_EXERCISES}"
