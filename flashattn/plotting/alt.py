"""Alternative text for the figures a notebook shows, from what each figure says of itself.

Jupyter shows a matplotlib figure as a PNG, which a screen reader cannot read. :func:`describe`
turns a figure's titles and axis labels into a sentence, and :func:`register` makes IPython put it
beside the PNG of every figure it displays (the output's ``alt`` metadata, which nbconvert, nbgrader
and the course's HTML edition write as the image's ``alt`` text).
"""


def describe(fig):
    """A one-sentence description of ``fig``: its title, then each panel's title and axis labels."""
    parts = []
    title = fig._suptitle.get_text() if getattr(fig, "_suptitle", None) is not None else ""
    panels = []
    for ax in fig.get_axes():
        words = [ax.get_title()] + [label for label in (ax.get_xlabel(), ax.get_ylabel()) if label]
        words = [w.strip() for w in words if w and w.strip()]
        if words:
            panels.append(words[0] if len(words) == 1 else f"{words[0]} ({', '.join(words[1:])})")
    if title.strip():
        parts.append(title.strip())
    if panels:
        parts.append("; ".join(panels))
    text = ": ".join(parts) if parts else "a figure without a title"
    return f"Figure: {text}"


def register(ip=None):
    """In an IPython kernel, give every matplotlib figure it displays as a PNG the alternative text
    of :func:`describe`. Elsewhere (a script, the tests), nothing. Safe to call more than once."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = ip or get_ipython()
    formatters = getattr(getattr(ip, "display_formatter", None), "formatters", None)
    if not formatters or "image/png" not in formatters:
        return False
    import matplotlib
    from matplotlib.figure import Figure

    if "inline" in str(matplotlib.get_backend()):
        try:  # Jupyter's inline backend registers its PNG formatter when it is first imported
            import matplotlib_inline.backend_inline  # noqa: F401
        except ImportError:
            return False

    png = formatters["image/png"]
    try:
        plain = png.lookup_by_type(Figure)
    except KeyError:
        return False
    if getattr(plain, "with_alt_text", False):
        return True

    def with_alt(fig):
        data = plain(fig)
        return data if data is None else (data, {"alt": describe(fig)})
    with_alt.with_alt_text = True
    png.for_type(Figure, with_alt)
    return True
