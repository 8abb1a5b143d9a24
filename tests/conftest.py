"""What the tests share: GPU-only tests (marked ``gpu``) are skipped without a CUDA GPU, the
exercises' solutions are read from the chapter notebooks, and the chapters nbval executed are kept
for the HTML edition."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


def pytest_collection_modifyitems(config, items):
    import torch

    items.sort(key=lambda item: item.get_closest_marker("after_notebooks") is not None)  # stable
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `python -m pytest -m gpu` on a machine with one)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


def pytest_report_header(config):
    """The PyTorch and Triton the tests run with, at the top of every run's log."""
    import flashattn  # noqa: F401  (before triton: on a CPU it picks the interpreter)
    import torch
    import triton

    return f"torch {torch.__version__}, triton {triton.__version__} ({triton.__file__})"


def bare_venv(folder):
    """A fresh virtual environment in ``folder`` that sees this environment's packages (PyTorch,
    Triton, Jupyter: through a path file, so nothing is downloaded) but not its flashattn, whose
    editable install hooks stay behind. Returns its Python."""
    import site
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = Path(folder) / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # a plain path line: the .pth files of those folders (flashattn's editable finder) do not run
    Path(purelib, "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


@pytest.fixture(scope="session")
def solutions():
    """``solutions(chapter, edits=(), stub=None)``: every solution cell of notebooks/<chapter>_*.ipynb
    as one module (``flashattn.course.exercises.solutions.load``), e.g. ``solutions("05").fwd_inner``;
    ``edits`` writes a deliberate mistake into it, ``stub`` stubs one exercise (a grade_id)."""
    from flashattn.course.exercises.solutions import load

    def get(chapter, edits=(), stub=None):
        (path,) = NOTEBOOKS.glob(f"{chapter}_*.ipynb")
        return load(path, edits, stub)

    return get


# --- Chapters executed by nbval, kept for the HTML edition ---------------------------------------------
# nbval runs every chapter (testpaths include notebooks/) and keeps each cell's outputs on its test
# item. tests/test_html_edition.py builds the edition from those executions instead of running every
# chapter a second time; tests marked `after_notebooks` therefore run after the notebooks.

EXECUTED = pytest.StashKey()


class KeepNotebookOutputs:
    """Collects, per notebook, the outputs nbval saw for each code cell and whether all passed."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        outputs = getattr(item, "test_outputs", None)
        if call.when != "call" or outputs is None or not hasattr(item, "cell"):
            return
        runs = item.config.stash.setdefault(EXECUTED, {})
        nb = item.parent.nb
        entry = runs.setdefault(str(item.parent.path), dict(nb=nb, outputs={}, failed=False))
        index = next(i for i, cell in enumerate(nb.cells) if cell is item.cell)
        entry["outputs"][index] = list(outputs)
        entry["failed"] |= not report.get_result().passed


def pytest_configure(config):
    config.pluginmanager.register(KeepNotebookOutputs(), "keep-notebook-outputs")


def executed_notebooks(config):
    """{notebook path: the notebook with the outputs nbval recorded}, for every notebook nbval ran
    completely and without a failure in this test run."""
    import nbformat

    done = {}
    for path, entry in config.stash.get(EXECUTED, {}).items():
        code = [i for i, cell in enumerate(entry["nb"].cells) if cell.cell_type == "code"]
        if entry["failed"] or set(code) - set(entry["outputs"]):
            continue
        nb = nbformat.from_dict(entry["nb"])  # a deep copy
        for count, index in enumerate(code, start=1):
            nb.cells[index].outputs = [nbformat.from_dict(output) for output in entry["outputs"][index]]
            nb.cells[index].execution_count = count
            for output in nb.cells[index].outputs:
                if output.output_type == "execute_result":
                    output.execution_count = count
        done[path] = nb
    return done


# --- Buffers a kernel must write in full ----------------------------------------------------------------

@pytest.fixture
def nan_buffers(monkeypatch):
    """While a test runs, the forward and backward launchers' ``torch.empty``/``torch.empty_like``
    return floating-point tensors filled with NaN instead of whatever memory held: an output element
    a kernel leaves unwritten (on a GPU, garbage) then shows as NaN on the CPU too."""
    import torch

    from flashattn.kernels import backward, forward

    def filled(make):
        def make_filled(*args, **kwargs):
            t = make(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        return make_filled

    class TorchWithNaNBuffers:
        empty = staticmethod(filled(torch.empty))
        empty_like = staticmethod(filled(torch.empty_like))

        def __getattr__(self, name):
            return getattr(torch, name)

    for module in (forward, backward):
        monkeypatch.setattr(module, "torch", TorchWithNaNBuffers())
