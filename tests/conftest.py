"""What the tests share: GPU-only tests (marked ``gpu``) are skipped without a CUDA GPU, and the
exercises' solutions are read from the chapter notebooks."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `python -m pytest -m gpu` on a machine with one)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def solutions():
    """``solutions(chapter, edits=(), stub=None)``: every solution cell of notebooks/<chapter>_*.ipynb
    as one module (``flashattn.exercises.solutions.load``), e.g. ``solutions("04").fwd_inner``;
    ``edits`` writes a deliberate mistake into it, ``stub`` stubs one exercise (a grade_id)."""
    from flashattn.exercises.solutions import load

    def get(chapter, edits=(), stub=None):
        (path,) = NOTEBOOKS.glob(f"{chapter}_*.ipynb")
        return load(path, edits, stub)

    return get
