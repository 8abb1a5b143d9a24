"""Where the course lives, said in one place: the repository, its branch, and what follows from them.

A chapter opened on its own (from a repository link on Colab, or copied anywhere) starts with a
cell that must install flashattn before anything can import it, so that cell cannot import this
module: ``tools/sync_course.py`` writes the cell from :func:`first_cell`, and the README's
"Open in Colab" links from :func:`colab_url`, and a test fails when either drifts from here.
"""
import os
import pathlib
import re
import urllib.request

from ..gpu.runtime import cache_dir

#: The course's public repository and the branch learners get. An instructor who publishes the
#: course elsewhere sets FLASHATTN_COURSE_REPOSITORY (and FLASHATTN_COURSE_BRANCH) and runs
#: ``python tools/sync_course.py``, which rewrites every chapter's first cell and the Colab links.
REPOSITORY = os.environ.get("FLASHATTN_COURSE_REPOSITORY", "https://github.com/flashattn-course/flashattn-triton")
BRANCH = os.environ.get("FLASHATTN_COURSE_BRANCH", "main")


def pip_source() -> str:
    """What ``pip install`` takes to install the package straight from the repository."""
    return f"git+{REPOSITORY}@{BRANCH}"


def _owner_and_name():
    match = re.fullmatch(r"https://github\.com/([^/]+)/([^/]+?)(?:\.git)?/?", REPOSITORY)
    if not match:
        raise ValueError(f"REPOSITORY must be a https://github.com/OWNER/NAME address, got {REPOSITORY!r}")
    return match.groups()


def colab_url(path: str) -> str:
    """The address that opens the notebook at ``path`` (relative to the repository's root) in Colab."""
    owner, name = _owner_and_name()
    return f"https://colab.research.google.com/github/{owner}/{name}/blob/{BRANCH}/{path}"


def blob_url(path: str) -> str:
    """The address of the file at ``path`` (relative to the repository's root) on its web page."""
    return f"{REPOSITORY.rstrip('/')}/blob/{BRANCH}/{path}"


def raw_url(path: str) -> str:
    """The address of the file at ``path`` (relative to the repository's root), as plain bytes."""
    owner, name = _owner_and_name()
    return f"https://raw.githubusercontent.com/{owner}/{name}/{BRANCH}/{path}"


# The first code cell of every chapter, at most 12 lines. It tries, in order: flashattn installed;
# the checkout the notebook sits in (appended to the path, so an installed flashattn still wins;
# no network, and the package matches the notebook); on Colab, pip from the repository; else it
# stops with the commands to run. (Jupyter puts the notebook's own folder on the path already.)
_FIRST_CELL = '''\
# Every chapter starts here: import flashattn (installed, else from the checkout around this notebook, else on Colab)
import importlib.util, pathlib, subprocess, sys
COURSE = "{source}"
sys.path += [str(p) for p in pathlib.Path.cwd().parents if (p / "flashattn" / "__init__.py").is_file()]
if importlib.util.find_spec("flashattn") is None and "google.colab" in sys.modules:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", COURSE], check=True)
    importlib.invalidate_caches()
elif importlib.util.find_spec("flashattn") is None:
    raise ModuleNotFoundError(f"flashattn is not installed: run  pip install {{COURSE}}  (without an NVIDIA GPU, "
                              "first  pip install torch --index-url https://download.pytorch.org/whl/cpu)")
import flashattn
print(flashattn.describe())'''


def first_cell(source=None) -> str:
    """The source of the first code cell of every chapter notebook; ``source`` (what its pip
    installs on Colab) defaults to :func:`pip_source`."""
    return _FIRST_CELL.format(source=source or pip_source())


# --- The recorded GPU data, for a chapter opened away from the checkout -------------------------------

def _checkouts():
    """Folders that may hold the course's checkout: the one the package was installed from
    (editable), and the one above the notebook's folder."""
    return [pathlib.Path(__file__).resolve().parents[2], pathlib.Path.cwd().parent, pathlib.Path.cwd()]


def data_file(name: str) -> pathlib.Path:
    """The recorded measurement ``figures/data/<name>`` (or, for a ``name`` with a folder in it, that
    path in the repository, e.g. ``docs/gpu-record/...``): from the checkout when there is one, else
    downloaded once from the repository (a chapter opened on its own, on Colab)."""
    relative = name if "/" in name else f"figures/data/{name}"
    for root in _checkouts():
        if (root / relative).is_file():
            return root / relative
    target = cache_dir() / "course" / BRANCH / relative
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(target.suffix + ".part")
        try:
            urllib.request.urlretrieve(raw_url(relative), partial)
        except OSError as error:
            raise FileNotFoundError(f"{relative} is not in a checkout here and could not be downloaded from "
                                    f"{raw_url(relative)}: {error}") from error
        partial.replace(target)
    return target
