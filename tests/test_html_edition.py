"""The static HTML edition (tools/build_html.py): built into a temporary folder, an index that links
every chapter in order, and a page per chapter with its figures embedded and, where a chapter was
recorded on a GPU, those outputs.

The chapters are not executed a second time when nbval ran them earlier in the same test run (the full
suite: tests/conftest.py keeps its outputs); run alone, this test executes them all (a few minutes).
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import flashattn

from conftest import executed_notebooks

pytestmark = pytest.mark.slow  # whole chapters run: CI's fast part leaves them out

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


VERBATIM = re.compile(r"<(pre|code|script|style|math)\b.*?</\1>", re.S)


def offline_problems(page):
    """What keeps ``page`` from reading offline: scripts or modules fetched from elsewhere, formulas
    left as TeX in the prose (outside code, outputs and MathML), images without alternative text."""
    problems = []
    remote = re.findall(r'<script[^>]*\bsrc="(https?://[^"]+)"', page)
    remote += re.findall(r'\b(?:import|from)\s*\(?\s*["\'](https?://[^"\']+)', page)
    remote += re.findall(r'<link[^>]*\bhref="(https?://[^"]+\.(?:css|js))"', page)
    for script in re.findall(r"<script\b[^>]*>(.*?)</script>", page, re.S):  # a loader written inline
        remote += re.findall(r"""["'](https?://[^"']+\.(?:css|js))["']""", script)
    if remote:
        problems.append(f"fetches {sorted(set(remote))}")
    prose = re.sub(r"<[^>]+>", " ", VERBATIM.sub(" ", page.partition("<body")[2] or page))
    tex = re.findall(r"\$\$|\\frac|\\text\{|\$[^$\s][^$]*\\[a-zA-Z]+[^$]*\$", prose)
    if tex:
        problems.append(f"formulas left as TeX: {tex[:5]}")
    no_alt = [tag[:80] for tag in re.findall(r"<img\b[^>]*>", page) if not re.search(r'\balt="[^"]+"', tag)]
    if no_alt:
        problems.append(f"{len(no_alt)} images without alternative text, e.g. {no_alt[0]}")
    return problems


def test_the_offline_check_finds_what_it_looks_for():
    """A page that loads MathJax from a CDN, leaves a formula as TeX and an image without alt text
    fails the check on each count; the same page made offline passes."""
    bad = ('<html><head><script src="https://cdnjs.cloudflare.com/mathjax.js"></script></head><body>'
           '<p>the factor $\\alpha = \\frac{1}{2}$</p><img src="data:image/png;base64,AA"></body></html>')
    assert len(offline_problems(bad)) == 3
    good = ('<html><head></head><body><p>the factor <math><mi>α</mi></math></p><pre>cost = $5 \\frac</pre>'
            '<img alt="a plot" src="data:image/png;base64,AA"></body></html>')
    assert offline_problems(good) == []
    loader = "<script>var src = 'https://unpkg.com/@jupyter-widgets/html-manager@*/dist/embed-amd.js';</script>"
    assert len(offline_problems(good.replace("<head>", "<head>" + loader))) == 1


def build_html_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_html", ROOT / "tools" / "build_html.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_missing_package_stops_the_build_before_any_chapter_runs(monkeypatch, tmp_path):
    build_html = build_html_module()
    assert build_html.missing_packages() == []  # the test install holds everything the edition needs
    monkeypatch.setattr(build_html, "NEEDS", build_html.NEEDS + ("no_such_package_here",))
    monkeypatch.setattr(build_html, "build", lambda *args: pytest.fail("the build started"))
    with pytest.raises(SystemExit, match="(?s)" + re.escape('no_such_package_here, not installed here') + ".*"
                       + re.escape('pip install -e ".[instructor]" && python tools/build_html.py')):
        build_html.main(["--out", str(tmp_path)])


def test_a_widget_becomes_the_picture_it_showed():
    """A widget in a chapter (chapter 03's sliders) reads offline: the page carries the figure it drew
    when the chapter ran, under a note, and no widget state or script to draw it from a CDN."""
    build_html = build_html_module()
    picture = {"output_type": "display_data", "data": {"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"},
               "metadata": {"image/png": {"alt": "Figure: the tile map"}}}
    model = dict(_model_module="@jupyter-widgets/controls", _view_module="@jupyter-widgets/controls")
    state = {"box": dict(model_name="VBoxModel", state=dict(model, children=["IPY_MODEL_slider", "IPY_MODEL_out"])),
             "slider": dict(model_name="IntSliderModel", state=dict(model, value=69)),
             "out": dict(model_name="OutputModel", state=dict(model, outputs=[picture]))}
    cell = nbformat.v4.new_code_cell("display(controls)", outputs=[nbformat.v4.new_output("display_data", data={
        "text/plain": "interactive(...)", build_html.WIDGET: {"version_major": 2, "version_minor": 0, "model_id": "box"}})])
    nb = nbformat.v4.new_notebook(cells=[cell], metadata={"widgets": {build_html.WIDGET_STATE: {
        "version_major": 2, "version_minor": 0, "state": state}}})
    page = build_html.chapter_page(build_html.with_alt_text(build_html.without_widgets(nb)), "a chapter")
    assert "widget-state" not in page and "unpkg" not in page and offline_problems(page) == []
    assert "shown as it first appeared" in page and 'alt="Figure: the tile map"' in page


def image_outputs(nb):
    return sum("image/png" in output.get("data", {}) for cell in nb.cells for output in cell.get("outputs", []))


@pytest.mark.after_notebooks
def test_html_edition(tmp_path, request):
    reused = executed_notebooks(request.config)
    (tmp_path / "executed").mkdir()
    for path, nb in reused.items():
        nbformat.write(nb, tmp_path / "executed" / Path(path).name)
    out = tmp_path / "html"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(Path(flashattn.__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "tools/build_html.py", "--out", str(out), "--executed",
                             str(tmp_path / "executed")], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    print(f"HTML edition: {len(reused)} of {len(CHAPTERS)} chapters reused from nbval's run")

    index = (out / "index.html").read_text(encoding="utf8")
    links = re.findall(r'href="([^"]+)\.html"', index)
    assert links == [path.stem for path in CHAPTERS], "the index links every chapter, in order"

    problems = []
    for path in CHAPTERS:
        page = out / f"{path.stem}.html"
        if not page.is_file():
            problems.append(f"{page.name}: missing")
            continue
        text = page.read_text(encoding="utf8")
        embedded = len(re.findall(r'<img[^>]+src="data:image/png;base64,', text))
        executed = reused.get(str(path))
        expected = image_outputs(executed) if executed is not None else 1
        if embedded < max(expected, 1):
            problems.append(f"{page.name}: {embedded} embedded images, expected at least {max(expected, 1)}")
        linked = [src for src in re.findall(r'<img[^>]+src="([^"]+)"', text) if not src.startswith("data:")]
        if linked:
            problems.append(f"{page.name}: images linked instead of embedded: {linked}")
        if "flashattn runs" not in text:
            problems.append(f"{page.name}: the first cell's output is missing (not executed?)")
        if 'href="index.html"' not in text:
            problems.append(f"{page.name}: no link back to the index")
        problems += [f"{page.name}: {p}" for p in offline_problems(text)]
    problems += [f"index.html: {p}" for p in offline_problems(index)]
    prose = re.sub(r"<[^>]+>", "", VERBATIM.sub("", index))
    if re.search(r"\]\(|`|(?<!\w)\*\w[^*]*\*(?!\w)", prose):
        problems.append("index.html: its chapter blurbs show unrendered Markdown")
    assert not problems, "\n".join(problems)

    # chapter 09 was executed on the H200 and its outputs recorded: the page carries them
    for record in sorted((ROOT / "docs" / "gpu-record").glob("*chapter-*-outputs*")):
        name = re.search(r"notebooks/\d+_(\w+)\.ipynb", record.read_text(encoding="utf8").split("\n", 1)[0]).group(1)
        (page,) = out.glob(f"[0-9][0-9]_{name}.html")  # by name: the record keeps the number it was taken under
        text = page.read_text(encoding="utf8")
        assert record.name in text and "CUDA GPU found: NVIDIA H200" in text, page.name
