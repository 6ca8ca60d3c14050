"""Builds the C++ core deepinfer._C (scheduler, block manager, input prep, CPU kernels) with pybind11."""
import glob
import os

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import find_packages, setup

# One compiler per core (NPY_NUM_BUILD_JOBS to override): the serial build took 65 s of every fresh CI run on 2 cores.
ParallelCompile("NPY_NUM_BUILD_JOBS").install()

DEBUG = os.environ.get("DEEPINFER_DEBUG", "0") == "1"
# Invariant checks (DI_CHECK) compile in for debug builds only; release keeps the hot path lean.
macros = [] if DEBUG else [("NDEBUG", "1")]
# No implicit FMA contraction: a*b + c stays two roundings, as torch's separate mul and add ops compute it
# (the kernels' own FMAs are explicit intrinsics).
flags = (["-O0", "-g"] if DEBUG else ["-O3"]) + ["-march=native", "-ffp-contract=off"]

ext = Pybind11Extension(
    "deepinfer._C",
    sorted(glob.glob("csrc/**/*.cpp", recursive=True)),
    # Without the headers here an edit to one (the kernels are templates in headers) leaves a stale build.
    depends=sorted(glob.glob("csrc/**/*.h", recursive=True)),
    include_dirs=["csrc"],
    cxx_std=17,
    define_macros=macros,
    extra_compile_args=flags,
    extra_link_args=["-pthread"],
)

setup(
    name="deepinfer",
    version="0.1.0",
    packages=find_packages(include=["deepinfer*", "eplb*", "tilelang_ops*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": build_ext},
    python_requires=">=3.10",
)
