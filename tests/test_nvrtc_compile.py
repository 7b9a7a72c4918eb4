"""Every kernel source compiles with NVRTC for sm_80, sm_90 and sm_100, warning-free, on a machine without a GPU.

NVRTC is called directly (``cupy_backends.cuda.libs.nvrtc``): ``cupy.RawModule`` would ask the driver for the
architecture, which needs a GPU. The options are the CUDA backend's own, so this compiles exactly what the
backend will load. NVRTC has no -Werror; ``--display-error-number`` makes warnings recognisable in the log,
and any warning fails the test.
"""

from __future__ import annotations

import pytest
from nvrtc_probe import nvrtc_or_skip

from kvcanary_cupy.backends.cuda import nvrtc_options
from kvcanary_cupy.backends.kernel_backend import KERNEL_FILES, kernel_source, kernels_dir

nvrtc = nvrtc_or_skip()  # skips this module only where CuPy or the NVRTC library is not installed

ARCHITECTURES = ("sm_80", "sm_90", "sm_100")


def compile_for(file: str, arch: str) -> tuple[bytes, str]:
    # Headers are found through the backend's own --include-path, exactly as cupy.RawModule compiles them.
    # (CuPy's binding takes the source and its name as str.)
    program = nvrtc.createProgram(kernel_source(file), file, [], [])
    try:
        nvrtc.compileProgram(program, [f"--gpu-architecture={arch}", "--display-error-number", *nvrtc_options()])
    except Exception as exc:
        raise AssertionError(f"{file} failed to compile for {arch}:\n{nvrtc.getProgramLog(program)}") from exc
    return nvrtc.getCUBIN(program), nvrtc.getProgramLog(program)


def test_every_kernel_file_is_checked():
    on_disk = sorted(p.name for p in kernels_dir().glob("*.cu"))
    assert on_disk == sorted(KERNEL_FILES)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("file", KERNEL_FILES)
def test_kernel_compiles_without_warnings(file, arch):
    cubin, log = compile_for(file, arch)
    assert cubin[:4] == b"\x7fELF", "NVRTC did not produce a cubin"
    assert "warning" not in log.lower(), log
    assert "error" not in log.lower(), log


def test_a_warning_would_fail_the_check():
    """The check is live: the same compile path reports a warning for a kernel that has one."""
    program = nvrtc.createProgram('extern "C" __global__ void k(int* x) { int unused; x[0] = 1; }',
                                  "probe.cu", [], [])
    nvrtc.compileProgram(program, ["--gpu-architecture=sm_90", "--display-error-number"])
    assert "warning" in nvrtc.getProgramLog(program).lower()
