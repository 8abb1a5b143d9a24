"""Run a test file as a child process that compiles for an H100/H200 (sm_90) without a GPU.

The compiled-kernel tests need flashattn to define its kernels for the compiler, not for the
interpreter, in a process where TRITON_INTERPRET is unset. Each such test file runs itself as a
child (its ``__main__`` part compiles and checks, exiting 0 when all is well and SKIP when this
machine cannot compile for CUDA at all) and reports the child's verdict.
"""
import os
import subprocess
import sys

import pytest

SKIP = 77  # the child's exit status when this machine cannot compile for sm_90 at all
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_as_child(path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # set by flashattn on a CPU
    result = subprocess.run([sys.executable, os.path.abspath(path)], capture_output=True, text=True,
                            timeout=300, env=env, cwd=ROOT)
    if result.returncode == SKIP:
        pytest.skip(result.stdout.strip().splitlines()[-1] if result.stdout.strip() else "cannot compile")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
