"""The public ops: ``flashattn.attention``, ``varlen_attention`` and ``decode``, and their autograd.

``attention``, ``varlen`` and ``decode`` check what a user passes and reshape it for the kernels;
``autograd`` joins forward and backward in a ``torch.autograd.Function`` registered as PyTorch
operators; ``dispatch`` picks the Triton or the Gluon kernels per call; ``warmup`` compiles the
backward's kernels while the forward's run.
"""
