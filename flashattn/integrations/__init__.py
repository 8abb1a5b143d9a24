"""flashattn inside other libraries: adapters that let a model library call the public ops.

Each module here sits on top of ``flashattn.attention``, ``flashattn.varlen_attention`` and
``flashattn.decode`` and speaks one library's calling convention, so that a model written for that
library runs on the course's kernels without a change to the model. ``transformers`` registers an
attention function (and its mask function) with Hugging Face transformers' ``AttentionInterface``.

The libraries stay optional: importing ``flashattn`` never imports this layer, and a module here
imports its library only when it is imported itself.
"""
import warnings


def untested(library, version, oldest):
    """What to warn of when ``library``'s ``version`` (a string) is older than ``oldest``, the
    (major, minor) its adapter's tests ran with; None when it is not."""
    release = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    if len(release) < 2 or release >= tuple(oldest):
        return None
    least = ".".join(map(str, oldest))
    return (f"flashattn.integrations.{library} is tested with {library} {least} or later, and this is {version}: "
            f"results may differ from the library's own attention; pip install \"{library}>={least}\"")


def warn_if_untested(library, version, oldest):
    """Warn (once, at the adapter's import) where ``library`` is older than its tests."""
    message = untested(library, version, oldest)
    if message:
        warnings.warn(message, stacklevel=3)
