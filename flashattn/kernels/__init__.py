"""The Triton kernels a learner reads: the forward, the backward, decoding, and what they share.

``tiles`` holds the ``@triton.jit`` pieces the kernels share, ``traversal`` their tile ranges in
plain Python, ``forward``, ``backward`` and ``decode`` the kernels and their launchers, and
``sequences`` the launch tables of packed batches. A launcher takes (B, H, N, D) tensors that are
already checked; the public ops of ``flashattn.ops`` check and reshape what a user passes.
"""
