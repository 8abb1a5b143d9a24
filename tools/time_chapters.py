"""Run every chapter cold, one at a time, and print each one's wall time (for a GPU machine).

    python tools/time_chapters.py                 # every chapter in notebooks/
    python tools/time_chapters.py 00 04 07        # some of them
    python tools/time_chapters.py --jobs 4        # four at a time, each in its own process

Each chapter runs top to bottom in a fresh process with an empty Triton cache (``TRITON_CACHE_DIR``)
and an empty flashattn cache (``FLASHATTN_CACHE_DIR``), nothing switched off, its working folder
``notebooks/``. With nbclient and ipykernel importable it runs as Jupyter would (a kernel of this
Python); without them, each code cell runs in order in a plain Python process, with IPython's display
functions if IPython is importable, else stand-ins that print (matplotlib draws off screen either
way). The table says which way each chapter ran. A chapter stops at its first error; the error is
printed. Exits 1 if any chapter failed. With ``--jobs N``, N chapters run at once (in plain Python,
each in its own process): they share the CPU and the GPU, so each time is an upper bound of the
chapter's time alone.
"""
import argparse
import concurrent.futures
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"

# Runs the code cells of one notebook in this process, in order, as a kernel would (the notebook's
# folder as the working directory; `display` and friends from IPython, or printing stand-ins).
PLAIN_RUNNER = r"""
import json, linecache, os, sys, types
path = sys.argv[1]
os.environ.setdefault("MPLBACKEND", "Agg")
try:
    import IPython.display  # noqa: F401
except ImportError:  # stand-ins, enough for the chapters: show what would be displayed as text
    def display(*objs, **kwargs):
        for obj in objs:
            print(getattr(obj, "data", obj))
    class _Shown:
        def __init__(self, data=None, *args, **kwargs):
            self.data = data
    ipython = types.ModuleType("IPython")
    ipython.get_ipython = lambda: None
    ipython.version_info = (9, 0)  # matplotlib reads it (>= 8.24: no GUI-backend fix to apply)
    shown = types.ModuleType("IPython.display")
    shown.display = display
    shown.HTML = shown.Markdown = shown.Image = shown.SVG = shown.Latex = shown.Math = _Shown
    ipython.display = shown
    sys.modules.update({"IPython": ipython, "IPython.display": shown})
from IPython.display import display
with open(path, encoding="utf8") as f:
    cells = [c for c in json.load(f)["cells"] if c["cell_type"] == "code"]
namespace = {"__name__": "__main__", "display": display}
for number, cell in enumerate(cells):
    source = "".join(cell["source"])
    if source.lstrip().startswith(("%", "!")):
        continue  # IPython magics and shell lines: none in the chapters today
    name = f"{os.path.basename(path)}, code cell {number}"
    # as IPython does: the cell's lines where inspect finds them (Triton's @jit reads its source)
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    code = compile(source, name, "exec")
    exec(code, namespace)
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")
"""


def run_with_nbclient(path, env):
    """Run the notebook through nbclient in a kernel of this Python; returns an error text or None."""
    sys.path.insert(0, str(ROOT))
    from flashattn.course.notebook import execute  # noqa: E402

    (result, _), = execute([path], cwd=path.parent, timeout=900, env=env).values()
    return None if not isinstance(result, Exception) else f"{type(result).__name__}: {str(result)[-1500:]}"


def run_plain(path, env):
    proc = subprocess.run([sys.executable, "-c", PLAIN_RUNNER, str(path)], cwd=path.parent, env=env,
                          capture_output=True, text=True, timeout=900)
    return None if proc.returncode == 0 else (proc.stdout + proc.stderr)[-1500:]


def run_cold(path, jupyter):
    """Run one chapter with empty caches; returns (seconds, error text or None)."""
    with tempfile.TemporaryDirectory() as triton_cache, tempfile.TemporaryDirectory() as own_cache:
        env = {**os.environ, "TRITON_CACHE_DIR": triton_cache, "FLASHATTN_CACHE_DIR": own_cache,
               "MPLBACKEND": "Agg",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        env.pop("FLASHATTN_AUTOTUNE", None)
        start = time.perf_counter()
        error = run_with_nbclient(path, env) if jupyter else run_plain(path, env)
        return time.perf_counter() - start, error


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("chapters", nargs="*", help="chapter numbers (default: all)")
    p.add_argument("--plain", action="store_true", help="run the cells in plain Python even if nbclient is there")
    p.add_argument("--jobs", type=int, default=1, help="chapters run at once (plain Python; default 1)")
    args = p.parse_args()
    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if args.chapters:
        paths = [path for path in paths if path.name[:2] in args.chapters]
    jupyter = (not args.plain and args.jobs == 1 and importlib.util.find_spec("nbclient") is not None
               and importlib.util.find_spec("ipykernel") is not None)
    try:
        import torch
        where = f"{torch.cuda.get_device_name()}" if torch.cuda.is_available() else "no GPU"
        from importlib.metadata import version
        versions = f"torch {torch.__version__}, triton {version('triton')}"
    except Exception as error:  # report, then time anyway
        where, versions = f"? ({error})", "?"
    at_once = "one at a time" if args.jobs == 1 else f"{args.jobs} at a time (each time an upper bound)"
    how = "nbclient" if jupyter else "plain Python"
    if not jupyter and not args.plain and args.jobs == 1:
        how += " (no nbclient or ipykernel)"
    print(f"# every chapter cold, {at_once}: {where}; {versions}; {how}", flush=True)
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:  # threads wait on processes
        runs = {pool.submit(run_cold, path, jupyter): path for path in paths}
        for run in concurrent.futures.as_completed(runs):
            path, (seconds, error) = runs[run], run.result()
            failed += error is not None
            print(f"{'ok  ' if error is None else 'FAIL'} {path.name:40} {seconds:6.1f} s"
                  f"{'  (over 90 s)' if seconds > 90 else ''}", flush=True)
            if error:
                print("     " + error.strip().replace("\n", "\n     "))
    print(json.dumps({"chapters": len(paths), "failed": failed}))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
