"""Build the course's static HTML edition: every chapter executed, one page each, and an index.

    pip install -e ".[instructor]" && python tools/build_html.py   # what it needs, then the edition
    python tools/build_html.py                  # into build/html/; open build/html/index.html
    python tools/build_html.py --out DIR        # elsewhere
    python tools/build_html.py --executed DIR   # reuse chapters already executed (DIR/NN_name.ipynb)

The committed notebooks carry no outputs (clean diffs), so a repository page shows no figures; this
edition is for reading without running. It executes each chapter top to bottom on this machine (on
a CPU, through Triton's interpreter, as CI does), converts it with nbconvert, figures embedded in
the page, and adds what a CPU cannot show: where a chapter was also executed on a GPU and its
outputs were recorded (``docs/gpu-record/*chapter-NN-outputs*``, found by the notebook named on
their first line), those outputs, under the cells that printed them. The pages need no network
either: the formulas are turned into MathML when the page is built (latex2mathml, which every
browser draws), no script is loaded from elsewhere, and an interactive widget shows the figure it
drew when the chapter ran. What it needs beyond the course's own install (the ``instructor`` extra)
is checked before anything runs.
"""
import argparse
import html
import re
import sys
from pathlib import Path

try:
    import nbformat
except ImportError:  # main() says what to install
    nbformat = None

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
RECORD = ROOT / "docs" / "gpu-record"
WIDGET = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


#: What the edition imports beyond the course's own install: nbclient and ipykernel run the chapters,
#: nbformat and nbconvert write the pages, latex2mathml draws the formulas. pyproject.toml's
#: ``instructor`` extra installs them all.
NEEDS = ("nbformat", "nbclient", "ipykernel", "nbconvert", "latex2mathml")
INSTALL = 'pip install -e ".[instructor]"'


def missing_packages():
    """The packages of NEEDS that cannot be imported here."""
    from importlib.util import find_spec

    return [name for name in NEEDS if find_spec(name) is None]


def chapters():
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def title(nb):
    """The chapter's title (its first "# " heading) and the first paragraph under it."""
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.startswith("# "):
            heading, _, rest = cell.source.partition("\n")
            paragraph = rest.strip().split("\n\n")[0].replace("\n", " ")
            return heading[2:].strip(), paragraph
    return "", ""


# --- Executing ----------------------------------------------------------------------------------------

def executed(paths, reuse=None, workers=2):
    """{path: the chapter with its outputs}: taken from ``reuse/<name>`` where present, else run."""
    found, todo = {}, []
    for path in paths:
        copy = Path(reuse) / path.name if reuse else None
        if copy is not None and copy.is_file():
            found[path] = nbformat.read(copy, as_version=4)
        else:
            todo.append(path)
    if todo:
        from flashattn.course.notebook import execute

        print(f"executing {len(todo)} chapters, {workers} at a time ...", flush=True)
        for path, (nb, seconds) in execute(todo, cwd=NOTEBOOKS, workers=workers).items():
            if isinstance(nb, Exception):
                raise SystemExit(f"{path.name} failed to run: {type(nb).__name__}: {str(nb)[-2000:]}")
            print(f"  {path.stem}: {seconds:.0f} s", flush=True)
            found[path] = nb
    return found


# --- The recorded GPU outputs -------------------------------------------------------------------------

def recorded_name(record):
    """The name (without its number) of the chapter a record of outputs was taken from, read off its
    first line ("# notebooks/NN_name.ipynb executed on ..."): chapters keep their names when they
    are renumbered, so a record found by name stays with its chapter."""
    first = record.read_text(encoding="utf8").split("\n", 1)[0]
    match = re.search(r"notebooks/\d+_(\w+)\.ipynb", first)
    return match.group(1) if match else None


def record_of(path):
    """(file, its header, {cell index: (execution number, text)}) of the chapter's recorded GPU
    outputs, or None. The record lists each code cell as ``## cell N (execution K)``."""
    files = [record for record in sorted(RECORD.glob("*chapter-*-outputs*"))
             if recorded_name(record) == path.stem.split("_", 1)[1]]
    if not files:
        return None
    text = files[-1].read_text(encoding="utf8")
    header = " ".join(line.lstrip("# ").strip() for line in text.split("\n") if line.startswith("# "))
    cells = {}
    for match in re.finditer(r"^## cell (\d+) \(execution (\d+)\)\n(.*?)(?=^## cell |\Z)", text, re.S | re.M):
        cells[int(match.group(1))] = (int(match.group(2)), match.group(3).strip("\n"))
    return files[-1], header, cells


def _recorded_cell(text, label):
    return nbformat.v4.new_markdown_cell(f"**{label}**\n\n```text\n{text}\n```" if text.strip()
                                         else f"**{label}**: no text output")


def with_record(nb, record):
    """The chapter with its recorded GPU outputs: under each cell that printed them when the cells
    still line up with the record (the cell at each recorded index is the code cell of that rank),
    else all together at the end, each under the number of the cell it came from."""
    file, header, cells = record
    source = file.relative_to(ROOT).as_posix()
    code = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"]
    lines_up = all(index < len(nb.cells) and nb.cells[index].cell_type == "code"
                   and code.index(index) + 1 == execution for index, (execution, _) in cells.items())
    intro = (f"*This chapter also ran on a GPU. {header.rstrip('.')}, recorded in `{source}`: "
             + ("shown under each cell, after what it printed here.*" if lines_up else
                "shown at the end of the page (the chapter has changed since, so they are not placed "
                "under their cells).*"))
    nb.cells.insert(1, nbformat.v4.new_markdown_cell(intro))
    if lines_up:
        for index in sorted(cells, reverse=True):
            nb.cells.insert(index + 2, _recorded_cell(cells[index][1], "On the GPU (recorded):"))
    else:
        nb.cells.append(nbformat.v4.new_markdown_cell(f"## Recorded on the GPU\n\n{header}."))
        for index in sorted(cells):
            nb.cells.append(_recorded_cell(cells[index][1], f"cell {index}, on the GPU (recorded):"))
    return nb


# --- Pages --------------------------------------------------------------------------------------------

def widget_outputs(model_id, state):
    """The outputs the widget ``model_id`` showed when the chapter ran: those of every Output widget
    inside it (an ``interactive`` draws its figure into one), read from the saved widget state."""
    model = state.get(model_id)
    if model is None:
        return []
    found = list(model["state"].get("outputs", [])) if model.get("model_name") == "OutputModel" else []
    for child in model["state"].get("children", []):
        found += widget_outputs(str(child).removeprefix("IPY_MODEL_"), state)
    return found


def without_widgets(nb):
    """Interactive widgets cannot work in a static page, and the script that would draw them comes
    from a CDN: the saved widget state goes (and with it that script), and each widget becomes the
    pictures it showed when the chapter ran (an ``interactive`` figure at its first values), under a
    note that says so; a widget that showed none becomes the note alone."""
    state = nb.metadata.pop("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    for cell in nb.cells:
        outputs = []
        for output in cell.get("outputs", []):
            view = output.get("data", {}).get(WIDGET)
            if view is None:
                outputs.append(output)
                continue
            pictures = [nbformat.from_dict(shown) for shown in widget_outputs(view.get("model_id"), state)
                        if "image/png" in shown.get("data", {})]
            note = ("An interactive widget, shown as it first appeared: run the chapter to move its controls."
                    if pictures else "An interactive widget: run the chapter to use it.")
            outputs.append(nbformat.v4.new_output("display_data", data={
                "text/html": f"<p><em>({note})</em></p>", "text/plain": f"({note})"}))
            outputs += pictures
        if "outputs" in cell:
            cell.outputs = outputs
    return nb


def with_alt_text(nb):
    """Every figure a cell printed as an image carrying its alternative text (the ``alt`` that
    flashattn.plotting.alt puts beside each figure; the lab template drops it)."""
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if "image/png" in data:
                alt = output.get("metadata", {}).get("image/png", {}).get("alt") or "a figure the cell above draws"
                data["text/html"] = (f'<img alt="{html.escape(alt, quote=True)}" '
                                     f'src="data:image/png;base64,{data.pop("image/png").strip()}">')
    return nb


def with_navigation(nb, position, entries):
    """Links to the index and to the chapters before and after, at the top and the bottom."""
    links = ["[index](index.html)"]
    if position > 0:
        links.insert(0, f"[← {entries[position - 1][1]}]({entries[position - 1][0]}.html)")
    if position + 1 < len(entries):
        links.append(f"[{entries[position + 1][1]} →]({entries[position + 1][0]}.html)")
    bar = " · ".join(links)
    nb.cells.insert(0, nbformat.v4.new_markdown_cell(bar))
    nb.cells.append(nbformat.v4.new_markdown_cell(bar))
    return nb


def chapter_page(nb, name):
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="lab", embed_images=True)
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": name, "path": str(NOTEBOOKS)}})
    return offline(body)


# --- Offline: math as MathML, no scripts from elsewhere ------------------------------------------------

# nbconvert's page loads require.js and MathJax from a CDN, and mermaid (for diagrams, which the
# course has none of) as a module from one; offline, MathJax's absence leaves every formula as TeX.
REMOTE_SCRIPTS = re.compile(r'<script[^>]*\bsrc="https?://[^"]*"[^>]*>\s*</script>'
                            r'|<script type="text/x-mathjax-config">.*?</script>'
                            r'|<script type="module">(?:(?!</script>).)*?https?://(?:(?!</script>).)*</script>', re.S)
# Elements whose text is not prose: code, outputs, scripts, and math already converted.
VERBATIM = re.compile(r"<(pre|code|script|style|math)\b.*?</\1>", re.S)
MATH = re.compile(r"\$\$(.+?)\$\$|(?<![\\$])\$(?!\s)([^$]+?)(?<!\s)\$", re.S)


def mathml(text):
    """``text`` (HTML prose) with every ``$...$`` and ``$$...$$`` formula as a MathML element."""
    from latex2mathml.converter import convert

    def formula(match):
        display, inline = match.groups()
        return convert(html.unescape(display if display is not None else inline),
                       display="block" if display is not None else "inline")
    # Between tags only: a formula never holds one (nbconvert keeps math away from markdown).
    return "".join(piece if piece.startswith("<") else MATH.sub(formula, piece)
                   for piece in re.split(r"(<[^>]*>)", text))


def offline(page):
    """The page with its formulas drawn as MathML and the scripts it would fetch from a CDN removed."""
    page = REMOTE_SCRIPTS.sub("", page)
    head, sep, body = page.partition("<body")
    if not sep:  # a fragment
        head, body = "", page
    parts, last = [], 0
    for match in VERBATIM.finditer(body):
        parts += [mathml(body[last:match.start()]), match.group(0)]
        last = match.end()
    parts.append(mathml(body[last:]))
    return head + sep + "".join(parts)


def index_page(entries):
    from nbconvert.filters import markdown2html

    items = "\n".join(f'<li><a href="{stem}.html"><strong>{html.escape(heading)}</strong></a>'
                      f'{offline(markdown2html(paragraph))}</li>' for stem, heading, paragraph in entries)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>FlashAttention in Triton, from scratch</title>
<style>body {{ font-family: system-ui, sans-serif; max-width: 52em; margin: 2em auto; padding: 0 1em;
line-height: 1.5; color: #1f2328; background: #ffffff; }} li {{ margin-bottom: 1em; }} p {{ margin: 0.2em 0; }}
a {{ color: #0550ae; }}</style></head>
<body>
<h1>FlashAttention in Triton, from scratch</h1>
<p>A course that takes you from naive attention to fast, tested FlashAttention forward and backward
kernels written in Triton. This is its static edition: each chapter executed top to bottom on the
machine that built it (each page's first output says where: on a CPU, through Triton's interpreter),
with the outputs a GPU printed where a chapter was also run on one and they were recorded.</p>
<ol start="0">
{items}
</ol>
</body></html>
"""


def build(out, reuse=None, workers=2):
    """Write the edition into ``out``; returns the pages written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = chapters()
    runs = executed(paths, reuse, workers)
    entries = [(path.stem, *title(runs[path])) for path in paths]
    written = []
    for position, path in enumerate(paths):
        nb = with_alt_text(without_widgets(runs[path]))
        record = record_of(path)
        if record is not None:
            nb = with_record(nb, record)
        nb = with_navigation(nb, position, [(stem, heading) for stem, heading, _ in entries])
        page = out / f"{path.stem}.html"
        page.write_text(chapter_page(nb, entries[position][1]), encoding="utf8")
        written.append(page)
    index = out / "index.html"
    index.write_text(index_page(entries), encoding="utf8")
    return [index] + written


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "build" / "html"), help="folder to write (default: build/html)")
    parser.add_argument("--executed", help="a folder of chapters already executed, reused instead of running them")
    parser.add_argument("--workers", type=int, default=2, help="chapters executed at once (default: 2)")
    args = parser.parse_args(argv)
    missing = missing_packages()
    if missing:  # say so now, not after minutes of running chapters
        raise SystemExit(f"the HTML edition needs {', '.join(missing)}, not installed here. From the repository's "
                         f"root, install them and build:\n    {INSTALL} && python tools/build_html.py")
    pages = build(args.out, args.executed, args.workers)
    print(f"wrote {len(pages)} pages; open {pages[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
