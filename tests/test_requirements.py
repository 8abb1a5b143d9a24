"""requirements.txt, pyproject.toml and the README's two commands tell one story: what a learner
installs is the package's dependencies plus the ``course`` extra, and the commands install exactly
those files."""
import re
from pathlib import Path

from packaging.requirements import Requirement

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
FIRST_CHAPTER = "exercises/00_attention_and_memory.ipynb"  # where the README's command opens JupyterLab


def requirement_lines(path):
    lines = []
    for line in path.read_text(encoding="utf8").splitlines():
        line = line.split("#")[0].strip()
        if line:
            lines.append(line)
    return lines


def canonical(requirements):
    return {Requirement(r).name.lower(): str(Requirement(r).specifier) for r in requirements}


def test_requirements_txt_is_the_package_plus_the_course_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf8"))["project"]
    lines = requirement_lines(ROOT / "requirements.txt")
    assert lines[0] == "-e .", "requirements.txt installs the package from this folder first"
    listed = canonical(lines[1:])
    expected = canonical(project["dependencies"] + project["optional-dependencies"]["course"])
    assert listed == expected, f"requirements.txt {listed} and pyproject.toml {expected} disagree"


def test_the_test_extra_covers_what_the_suite_imports():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf8"))["project"]
    test = canonical(project["optional-dependencies"]["test"])
    for name in ("pytest", "nbval", "nbclient", "ipykernel", "nbgrader", "nbconvert", "latex2mathml"):
        assert name in test, f"the test extra lacks {name}"


def test_the_readme_commands_install_these_files():
    readme = (ROOT / "README.md").read_text(encoding="utf8")
    commands = re.findall(r"```bash\n(python3 -m venv[^\n]*)\n```", readme)
    assert len(commands) == 2, "the README gives exactly two set-up commands"
    course, tests = commands
    for command in commands:
        # on a machine without an NVIDIA GPU, PyTorch's CPU build comes first
        cpu = "(nvidia-smi -L >/dev/null 2>&1 || pip install torch --index-url https://download.pytorch.org/whl/cpu)"
        assert cpu in command and command.index(cpu) < command.index("pip install -", command.index(cpu) + len(cpu))
    assert "pip install -r requirements.txt" in course and course.endswith("jupyter lab --allow-root --ServerApp.root_dir=. " + FIRST_CHAPTER)
    assert (ROOT / FIRST_CHAPTER).is_file(), "JupyterLab opens on the first student chapter, at the root"
    assert 'pip install -e ".[test]"' in tests and tests.endswith("python -m pytest")
    assert tests in (ROOT / ".ci" / "run").read_text(encoding="utf8"), "CI runs the README's test command"
