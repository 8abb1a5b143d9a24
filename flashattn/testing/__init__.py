"""What the kernels are checked against: plain-PyTorch references and the tolerance rule.

``reference`` computes every step the course teaches in plain PyTorch (in float64 for checking);
``rule`` is the one tolerance rule (an error at most 2x, or 3x for gradients, PyTorch's own error
in the same dtype against float64, plus a floor) and the helpers that apply it.
"""
