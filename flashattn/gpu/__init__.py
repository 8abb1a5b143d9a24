"""The GPU configuration: where the kernels run and with which tiles.

``runtime`` picks a CUDA GPU or Triton's interpreter before any kernel is defined; ``archs`` holds
each architecture's limits (sm_75 to sm_90); ``configs`` the candidate tiles, the rules that judge
them and the defaults (``defaults``, generated); ``launcher`` launches a kernel with its default,
fixed or autotuned configuration; ``direct`` launches a compiled kernel again without Triton's JIT.
Nothing here defines a kernel.
"""
