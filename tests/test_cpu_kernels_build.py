"""The C kernels (cpu_kernels/build.py) build wherever a C compiler is on PATH. The kernels' own test files skip
without the library, so a compile error would otherwise turn ~175 tests into skips and leave the suite green."""

import os
import shutil
import subprocess

import pytest

from truespec.cpu_kernels import build


def test_the_cpu_kernels_build_wherever_a_c_compiler_is() -> None:
    compiler = shutil.which(os.environ.get("CC") or "cc")
    if compiler is None or os.environ.get("TRUESPEC_NATIVE", "1") == "0":
        pytest.skip("no C compiler (or TRUESPEC_NATIVE=0): the CPU path keeps its torch ops")
    try:
        library = build._build(compiler)
    except subprocess.CalledProcessError as e:
        pytest.fail(f"the C kernels do not compile with {compiler}:\n{e.stderr[-4000:]}")
    assert library.exists() and build.load() is not None
