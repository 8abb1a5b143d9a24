"""The student bundle (tools/make_bundle.py), as a learner gets it: unpacked into an empty folder, it
holds what its README's command needs and no solutions, every link in it resolves inside it, and a
student chapter runs there against the bundle's own flashattn, installed as the README installs it."""
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest

from conftest import bare_venv

pytestmark = pytest.mark.slow  # whole chapters run: CI's fast part leaves them out

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = "00_attention_and_memory.ipynb"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("bundle")
    result = subprocess.run([sys.executable, "tools/make_bundle.py", "--out", str(out / "student.zip")], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    with zipfile.ZipFile(out / "student.zip") as z:
        z.extractall(out / "unpacked")
    (folder,) = (out / "unpacked").iterdir()
    return folder


def relative_links(text):
    return [link for link in re.findall(r"\]\(([^)\s]+)\)|src=\"([^\"]+)\"", text)
            for link in link if link and not re.match(r"(https?:|mailto:|#|data:)", link)]


def test_the_bundle_holds_the_exercises_and_no_solutions(bundle):
    names = {p.name for p in bundle.iterdir()}
    assert {"README.md", "requirements.txt", "pyproject.toml", "flashattn", "exercises", "figures"} <= names
    assert not {"notebooks", "tests", "tools"} & names, "the bundle must not carry the solutions"
    chapters = sorted(p.name for p in (bundle / "exercises").glob("[0-9][0-9]_*.ipynb"))
    assert chapters == sorted(p.name for p in (ROOT / "exercises").glob("[0-9][0-9]_*.ipynb"))
    for path in (bundle / "exercises").glob("*.ipynb"):
        assert "### BEGIN SOLUTION" not in path.read_text(encoding="utf8"), path.name


def test_every_link_in_the_bundle_resolves_inside_it(bundle):
    broken = []
    readme = (bundle / "README.md").read_text(encoding="utf8")
    broken += [f"README.md -> {link}" for link in relative_links(readme) if not (bundle / link.split("#")[0]).exists()]
    for path in (bundle / "exercises").glob("*.ipynb"):
        for cell in json.loads(path.read_text(encoding="utf8"))["cells"]:
            if cell["cell_type"] == "markdown":
                prose = re.sub(r"```.*?```|`[^`]*`", "", "".join(cell["source"]), flags=re.S)
                broken += [f"{path.name} -> {link}" for link in relative_links(prose)
                           if not (path.parent / link.split("#")[0]).exists()]
    assert not broken, broken


def test_the_exercises_readme_names_only_what_the_bundle_holds(bundle):
    """exercises/README.md (written by tools/make_student.py) travels in the bundle: every file or
    folder it names is there, next to it or at the bundle's root."""
    text = (bundle / "exercises" / "README.md").read_text(encoding="utf8")
    named = re.findall(r"[\w.-]*/[\w./-]*|[\w.-]+\.(?:py|ipynb|md)\b", text)
    missing = [name for name in named if not name.startswith(("http", "//"))
               and not ((bundle / "exercises" / name).exists() or (bundle / name).exists())]
    assert named and not missing, missing


def test_the_readme_command_is_the_course_command_and_its_files_are_here(bundle):
    readme = (bundle / "README.md").read_text(encoding="utf8")
    (command,) = re.findall(r"```bash\n([^\n]+)\n```", readme)
    assert command in (ROOT / "README.md").read_text(encoding="utf8")
    assert "pip install -r requirements.txt" in command and (bundle / "requirements.txt").is_file()
    assert (bundle / "requirements.txt").read_text() == (ROOT / "requirements.txt").read_text()


def test_a_student_chapter_runs_in_the_unpacked_bundle(bundle, tmp_path):
    """Installed as requirements.txt's first line installs it (the package from the bundle, editable;
    what it needs already here), the student version of chapter 00 runs to its end, failing only at
    its checks, with the bundle's flashattn."""
    python = bare_venv(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    install = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                              "-e", "."], cwd=bundle, capture_output=True, text=True, env=env, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    nb = nbformat.read(bundle / "exercises" / CHAPTER, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("print('FROM', flashattn.__file__)"))
    nbformat.write(nb, tmp_path / CHAPTER)
    run = ("import sys, nbformat\nfrom nbclient import NotebookClient\n"
           "nb = nbformat.read(sys.argv[1], as_version=4)\n"
           "NotebookClient(nb, timeout=300, allow_errors=True, resources={'metadata': {'path': sys.argv[2]}}).execute()\n"
           "nbformat.write(nb, sys.argv[1])\n")
    result = subprocess.run([str(python), "-c", run, str(tmp_path / CHAPTER), str(bundle / "exercises")],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    nb = nbformat.read(tmp_path / CHAPTER, as_version=4)
    errors = [cell for cell in nb.cells if any(o.get("output_type") == "error" for o in cell.get("outputs", []))]
    assert errors and all("raises-exception" in cell.metadata.get("tags", []) for cell in errors), \
        "the student chapter fails at its checks and nowhere else"
    printed = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    assert Path(printed.split("FROM ")[-1].strip()).is_relative_to(bundle), printed
