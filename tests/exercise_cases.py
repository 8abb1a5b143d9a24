"""What the exercise tests share (a helper module, not a test file): the parameters of the
deliberate mistakes each checker must name."""
import pytest


def mistakes(*cases):
    """pytest parameters (edits, message), one per named mistake: ``cases`` are
    ``(name, edits, message)`` with ``edits`` the (old, new) replacements that write the mistake
    into the notebook's solution and ``message`` what the checker must say."""
    return pytest.mark.parametrize("edits, message", [pytest.param(edits, message, id=name)
                                                      for name, edits, message in cases])
