"""show_source reads in JupyterLab's light and dark themes: every piece of text it draws has WCAG's
4.5:1 contrast against the background it is drawn on, in both.

The test renders the HTML as JupyterLab would, in miniature: a colour or background written on an
element (inline) wins; otherwise it comes from the element above, except that the theme colours
<pre> and <code> elements itself (their background, and their text), and the output area around
everything. That is what made the old box unreadable in the dark theme: its <pre> took the theme's
near-black, under the style's dark-blue function names.
"""
import re
from html.parser import HTMLParser

import pytest
from pygments.styles import get_style_by_name
from pygments.token import Name

from flashattn.course import notebook
from flashattn.kernels import backward, forward
from flashattn.testing import reference

# JupyterLab 4's --jp-layout-color0 and --jp-content-font-color1 (its alpha blended over the layout colour)
THEMES = {"light": dict(background="#ffffff", color="#212121"),
          "dark": dict(background="#111111", color="#ffffff")}
THEMED = {"pre", "code"}  # elements the theme colours, whatever their parent says
AA = 4.5


def rgb(colour):
    colour = colour.strip().lstrip("#")
    if len(colour) == 3:
        colour = "".join(c * 2 for c in colour)
    return tuple(int(colour[i:i + 2], 16) / 255 for i in (0, 2, 4))


def contrast(a, b):
    """WCAG 2's contrast ratio of two #rgb / #rrggbb colours."""
    def luminance(colour):
        r, g, b = (c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb(colour))
        return 0.2126 * r + 0.7152 * g + 0.0722 * b
    high, low = sorted((luminance(a), luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


class Render(HTMLParser):
    """Each piece of text with the colour and background it is drawn in, under one theme."""

    def __init__(self, theme):
        super().__init__()
        self.theme, self.stack, self.texts = theme, [dict(theme)], []

    def handle_starttag(self, tag, attrs):
        drawn = dict(self.theme) if tag in THEMED else dict(self.stack[-1])
        style = dict(attrs).get("style") or ""
        for prop, value in re.findall(r"(background(?:-color)?|(?<![-\w])color)\s*:\s*(#[0-9a-fA-F]{3,6})", style):
            drawn["background" if prop.startswith("background") else "color"] = value
        self.stack.append(drawn)

    def handle_endtag(self, tag):
        self.stack.pop()

    def close(self):
        super().close()
        assert len(self.stack) == 1, "unbalanced HTML"

    def handle_data(self, data):
        if data.strip():
            self.texts.append((data.strip(), self.stack[-1]["color"], self.stack[-1]["background"]))


def worst_contrast(html, theme):
    return min(((contrast(color, background), text, color, background)
                for text, color, background in texts(html, theme)), key=lambda found: found[0])


@pytest.mark.parametrize("theme", THEMES)
@pytest.mark.parametrize("obj", [forward.attn_fwd, backward.attn_bwd_dkdv, reference.naive_attention],
                         ids=["attn_fwd", "attn_bwd_dkdv", "naive_attention"])
def test_every_text_readable(obj, theme):
    ratio, text, color, background = worst_contrast(notebook.source_html(obj), theme)
    assert ratio >= AA, f"{theme} theme: {text!r} in {color} on {background}: contrast {ratio:.2f} < {AA}"


def test_function_names_readable_and_the_check_can_fail():
    html = notebook.source_html(forward.attn_fwd)
    name_colour = "#" + get_style_by_name(notebook.SOURCE_STYLE).style_for_token(Name.Function)["color"]
    for theme in THEMES:
        (color, background), = [(c, b) for t, c, b in texts(html, theme) if t == "attn_fwd"]
        assert rgb(color) == rgb(name_colour), "the function's name is drawn in the style's colour for names"
        assert contrast(color, background) >= AA, theme
    # The old box: a <pre> that takes the theme's colours, around the style's dark-blue names.
    old = '<div style="background: #f0f0f0"><pre><span style="color: #06287e">attn_fwd</span></pre></div>'
    assert worst_contrast(old, "light")[0] >= AA > worst_contrast(old, "dark")[0]


def texts(html, theme):
    render = Render(THEMES[theme])
    render.feed(html)
    render.close()
    return render.texts


def test_source_box_names_file_and_line():
    html = notebook.source_html(forward.attn_fwd)
    assert re.search(r">flashattn/kernels/forward\.py, line \d+</div>", html)
