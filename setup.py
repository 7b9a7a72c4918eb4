"""Package list only (metadata: pyproject.toml). Discovery picks up every kvcanary_cupy subpackage; the kernel
sources, kept in kernels/ at the top of the repository, are mapped to kvcanary_cupy.kernels, which
discovery cannot see because the folder lies outside kvcanary_cupy/."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["kvcanary_cupy", "kvcanary_cupy.*"]), "kvcanary_cupy.kernels"])
