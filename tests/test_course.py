"""A chapter opened on its own: the first cell every chapter shares, where it finds flashattn, and a
chapter copied alone into an empty folder, run top to bottom.

flashattn/course/site.py says once where the course lives; the first cell of every notebook and the
README's Colab links are written from it by tools/sync_course.py, and these tests fail when they
drift from it.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import flashattn
from flashattn.course import site
from flashattn.course.notebook import execute

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_ROOT = str(Path(flashattn.__file__).resolve().parent.parent)  # the flashattn under test
ALONE = "01_online_softmax.ipynb"  # a chapter that runs in a few seconds on a CPU


def env_with_package(**extra):
    """This environment, with the flashattn under test importable (installed or not)."""
    path = os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def first_code_cell(path):
    return next(cell for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code")


@pytest.mark.parametrize("path", sorted(ROOT.glob("notebooks/*.ipynb")) + sorted(ROOT.glob("exercises/*.ipynb")),
                         ids=lambda path: f"{path.parent.name}/{path.stem}")
def test_first_code_cell_is_the_canonical_one(path):
    if first_code_cell(path).source != site.first_cell():
        pytest.fail(f"{path.parent.name}/{path.name}: its first code cell is not flashattn.course.site.first_cell(); "
                    "run `python tools/sync_course.py`", pytrace=False)


def test_first_cell_is_short():
    """Every chapter opens with it: a short set-up a reader takes in at a glance."""
    lines = site.first_cell().splitlines()
    assert len(lines) <= 12 and max(map(len, lines)) <= 120, site.first_cell()


def test_first_cell_and_colab_links_are_current():
    result = subprocess.run([sys.executable, "tools/sync_course.py", "--check"], cwd=ROOT, capture_output=True,
                            text=True, env=env_with_package())
    if result.returncode != 0:
        pytest.fail(result.stdout + result.stderr, pytrace=False)


def test_course_addresses():
    assert site.pip_source() == f"git+{site.REPOSITORY}@{site.BRANCH}"
    owner_name = site.REPOSITORY.removeprefix("https://github.com/")
    assert site.colab_url("notebooks/x.ipynb") == (
        f"https://colab.research.google.com/github/{owner_name}/blob/{site.BRANCH}/notebooks/x.ipynb")
    readme = (ROOT / "README.md").read_text(encoding="utf8")
    for path in sorted(ROOT.glob("notebooks/*.ipynb")):
        assert site.colab_url(f"notebooks/{path.name}") in readme, path.name
        assert site.colab_url(f"exercises/{path.name}") in readme, path.name


# The first cell's three ways, each run in a fresh interpreter that pretends flashattn is not
# installed. The pip install Colab would run is recorded, not run: it then puts the checkout on the
# path, as an installed package would be.
FIRST_CELL_SCENARIO = r"""
import importlib.util, json, os, subprocess, sys, types
real_find_spec = importlib.util.find_spec
def find_spec(name, *args):  # flashattn is found only in a folder on the path, as if not installed
    if name == "flashattn" and not any(os.path.isfile(os.path.join(p, "flashattn", "__init__.py")) for p in sys.path):
        return None
    return real_find_spec(name, *args)
importlib.util.find_spec = find_spec
scenario, package_root, cell = sys.argv[1], sys.argv[2], sys.stdin.read()
sys.path = [p for p in sys.path if p not in ("", package_root)]
pip = []
if scenario == "colab":
    sys.modules["google.colab"] = types.ModuleType("google.colab")
    def fake_run(command, **kwargs):
        pip.append(command)
        sys.path.append(package_root)
    subprocess.run = fake_run
scope = {}
try:
    exec(compile(cell, "first cell", "exec"), scope)
    outcome = "imported"
except ModuleNotFoundError as error:
    outcome = str(error)
print(json.dumps(dict(outcome=outcome, pip=pip, imported=getattr(scope.get("flashattn"), "__file__", None))))
"""


def run_first_cell(scenario, cwd):
    result = subprocess.run([sys.executable, "-c", FIRST_CELL_SCENARIO, scenario, PACKAGE_ROOT],
                            input=site.first_cell(), cwd=cwd, capture_output=True, text=True,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_first_cell_in_the_checkout_uses_it():
    seen = run_first_cell("checkout", ROOT / "notebooks")
    assert seen["outcome"] == "imported" and seen["pip"] == [], seen
    assert Path(seen["imported"]) == ROOT / "flashattn" / "__init__.py", seen


def test_first_cell_on_colab_installs_from_the_repository(tmp_path):
    seen = run_first_cell("colab", tmp_path)
    assert seen["outcome"] == "imported", seen
    assert seen["pip"] == [[sys.executable, "-m", "pip", "install", "--quiet", site.pip_source()]], seen


def test_first_cell_elsewhere_says_what_to_run(tmp_path):
    seen = run_first_cell("elsewhere", tmp_path)
    assert seen["pip"] == [], seen
    assert seen["outcome"] == (f"flashattn is not installed: run  pip install {site.pip_source()}  (without an "
                               "NVIDIA GPU, first  pip install torch --index-url https://download.pytorch.org/whl/cpu)"), seen


def test_first_cell_installs_the_course_as_colab_would(tmp_path):
    """Colab's way, for real: a fresh environment without flashattn (PyTorch and the rest already
    there, as on Colab), a notebook's folder far from any checkout, google.colab loaded, and the
    first cell's pip install run, from this checkout standing in for the repository's address."""
    from conftest import bare_venv

    python = bare_venv(tmp_path / "venv")
    (tmp_path / "content").mkdir()
    cell = site.first_cell(source=PACKAGE_ROOT)
    code = ("import sys, types\nsys.modules['google.colab'] = types.ModuleType('google.colab')\n" + cell
            + "\nprint('FROM', flashattn.__file__)")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["PIP_NO_BUILD_ISOLATION"] = "0"  # build with the setuptools already here: no download
    result = subprocess.run([str(python), "-c", code], cwd=tmp_path / "content", capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    installed = Path(result.stdout.split("FROM ")[-1].strip())
    assert installed.is_relative_to(tmp_path / "venv"), f"flashattn imported from {installed}, not installed"
    assert "flashattn runs" in result.stdout, result.stdout


def test_recorded_data_found_in_the_checkout_or_downloaded(tmp_path, monkeypatch):
    assert site.data_file("h200_bench.csv") == ROOT / "figures" / "data" / "h200_bench.csv"
    # away from a checkout: fetched from the repository's address once, then kept in the cache
    monkeypatch.setattr(site, "_checkouts", lambda: [tmp_path / "nowhere"])
    monkeypatch.setenv("FLASHATTN_CACHE_DIR", str(tmp_path / "cache"))
    fetched = []
    monkeypatch.setattr(site, "raw_url", lambda path: fetched.append(path) or (ROOT / path).as_uri())
    for _ in range(2):
        path = site.data_file("h200_ladder.csv")
        assert path.is_relative_to(tmp_path / "cache")
        assert path.read_bytes() == (ROOT / "figures" / "data" / "h200_ladder.csv").read_bytes()
    assert fetched == ["figures/data/h200_ladder.csv"]
    monkeypatch.setattr(site, "raw_url", lambda path: (tmp_path / "missing.csv").as_uri())
    with pytest.raises(FileNotFoundError, match="h200_memory.csv is not in a checkout"):
        site.data_file("h200_memory.csv")


@pytest.mark.slow
def test_a_chapter_copied_alone_runs_top_to_bottom(tmp_path):
    """A chapter copied into an empty folder, far from the checkout, with the package importable
    (here through PYTHONPATH: the flashattn under test, installed or not), runs to the end."""
    shutil.copy(ROOT / "notebooks" / ALONE, tmp_path / ALONE)
    assert sorted(p.name for p in tmp_path.iterdir()) == [ALONE]
    (result, seconds), = execute([tmp_path / ALONE], cwd=tmp_path, timeout=300,
                                 env=env_with_package(TRITON_INTERPRET="1")).values()
    if isinstance(result, Exception):
        pytest.fail(f"{ALONE}, copied alone, stopped: {type(result).__name__}: {str(result)[-3000:]}",
                    pytrace=False)
    first = next(cell for cell in result.cells if cell.cell_type == "code")
    assert "flashattn runs" in "".join(out.get("text", "") for out in first.outputs)


@pytest.mark.parametrize("ipython", ["installed", "missing"])
def test_the_chapter_timer_runs_a_chapter_without_jupyter(tmp_path, ipython):
    """tools/time_chapters.py (for GPU machines, where nbclient may be missing) runs a chapter's
    code cells in plain Python, with stand-ins for IPython's display if need be (matplotlib, which
    the chapter's figures use, reads the stand-in's version)."""
    env = env_with_package()
    if ipython == "missing":  # an IPython package that cannot be imported, first on the path
        (tmp_path / "IPython").mkdir()
        (tmp_path / "IPython" / "__init__.py").write_text('raise ImportError("hidden by the test")\n')
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    result = subprocess.run([sys.executable, "tools/time_chapters.py", ALONE[:2], "--plain"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"ok   {ALONE}" in result.stdout


# tools/first_call.py's --timeline hooks, run where no GPU is: flashattn defines its kernels for
# the compiler, and one kernel is compiled for sm_90 (nothing is launched).
TIMELINE_HOOKS = r"""
import json, os, sys, time, torch
torch.cuda.is_available = lambda: True
torch.cuda.get_device_name = lambda *args: "compile only"
torch.cuda.synchronize = lambda *args: None
sys.path.insert(0, "tools")
import first_call
exec(first_call.TIMELINE)
from flashattn.measure import compiled
compiled.compile_kernel("bwd_preprocess", "fp16", dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_Q=64))
print(json.dumps(sorted({label.split(" of ")[0].strip() for _, label, _, _ in EVENTS})))
"""


def test_the_first_call_timeline_hooks_fit_this_triton(tmp_path):
    """``tools/first_call.py --timeline`` (for GPU machines) wraps steps of Triton's compile by
    their names in Triton; a Triton that renamed one would break the tool there. Here the hooks time
    a compile for sm_90: the hash of Triton's files and each stage, ptx and cubin included."""
    env = {k: v for k, v in env_with_package(TRITON_CACHE_DIR=str(tmp_path)).items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", TIMELINE_HOOKS], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = json.loads(result.stdout.splitlines()[-1])
    for step in ("hash Triton's files (cache key)", "ttir", "llir", "ptx", "cubin"):
        assert step in steps, (step, steps)


TILE_SWEEP = r"""
import json, sys, torch
torch.cuda.is_available = lambda: True
torch.cuda.get_device_name = lambda *args: "compile only"
torch.cuda.get_device_capability = lambda *args: (9, 0)
sys.path.insert(0, "tools")
import tile_sweep
(key, configs), = tile_sweep.parse_only(["bwd_dq:16:32x16w4s1"]).items()
seconds, regs, spills = tile_sweep.compile_time(key[0], configs[0], key[1], True, "ieee")
print(json.dumps([key, configs[0].kwargs, configs[0].num_warps, configs[0].num_stages, regs, spills]))
"""


def test_the_tile_sweep_reads_its_configurations_and_compiles_one():
    """``tools/tile_sweep.py`` (for GPU machines) names configurations as KERNEL:D:BQxBKVwWsS and
    compiles each for the running GPU to time it and read its registers: here for sm_90."""
    env = {k: v for k, v in env_with_package().items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", TILE_SWEEP], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    key, tiles, warps, stages, regs, spills = json.loads(result.stdout.splitlines()[-1])
    assert (key, tiles, warps, stages, spills) == (["bwd_dq", 16], {"BLOCK_Q": 32, "BLOCK_KV": 16}, 4, 1, 0)
    assert 0 < regs <= 255
