"""Measurement: benchmarks against SDPA, profiles, the GPU checks and compiling without a GPU.

``bench`` (TFLOPS and memory), ``bench_decode`` (a decoding step) and ``variants`` (packed batches,
grouped heads, windows) time flashattn side by side with PyTorch's SDPA on a GPU; ``ring`` times
ring attention on several GPUs (under torchrun) against PyTorch's context_parallel; ``profiling``
records and reads a proton profile; ``gpu_checks`` runs the Gluon and float32 checks in watched
child processes; ``compiled`` compiles any kernel for sm_75 to sm_90 on a machine without a GPU.
"""
