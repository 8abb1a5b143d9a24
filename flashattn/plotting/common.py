"""What every picture shares: an Axes to draw into, and tensors or arrays as NumPy."""
import matplotlib.pyplot as plt
import numpy as np


def axes_for(ax, figsize=(5, 4)):
    """``ax``, or the Axes of a new figure of ``figsize`` when ``ax`` is None."""
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


def to_numpy(x):
    """A tensor (any device, any dtype) or array-like as a float64 NumPy array."""
    return x.detach().double().cpu().numpy() if hasattr(x, "detach") else np.asarray(x, dtype=float)
