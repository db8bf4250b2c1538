"""kvkernels build: a pure-Python package whose top-level folders map into the kvkernels namespace.

folder                 -> import name
kvkernels/             -> kvkernels
triton_ops/            -> kvkernels.triton_ops
io/                    -> kvkernels.io            (never a top-level `io`)
integrations/lmcache/  -> kvkernels.integrations.lmcache
integrations/vllm/     -> kvkernels.integrations.vllm
bench/                 -> kvkernels.bench         (so `kvkernels bench` works from any install)

The CUDA extension in csrc/ is built only when KVKERNELS_BUILD_CUDA=1 and nvcc is present (see
docs/ and docs/csrc.md); otherwise this is a pure-Python install that works with the Triton and
torch backends.
"""

import importlib.util
import os
import sys

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

PACKAGE_DIR = {
    "kvkernels": "kvkernels",
    "kvkernels.triton_ops": "triton_ops",
    "kvkernels.io": "io",
    "kvkernels.integrations": "integrations",
    "kvkernels.integrations.lmcache": "integrations/lmcache",
    "kvkernels.integrations.vllm": "integrations/vllm",
    "kvkernels.bench": "bench",
    "kvkernels.csrc": "csrc",  # sources shipped so the backend can be built just in time
    # (listed as packages of their own: setuptools warns that data inside an unlisted importable
    # folder "would be ignored", and says later releases will ignore it)
    "kvkernels.csrc.kernels": "csrc/kernels",
    "kvkernels.csrc.bindings": "csrc/bindings",
}
# the suffixes csrc/build.py's source_key hashes: the wheel ships every file a build uses
CSRC_SOURCES = ["*.cu", "*.cuh", "*.h", "*.hpp"]


def _build_cuda_requested() -> bool:
    """``KVKERNELS_BUILD_CUDA`` read like every other boolean variable (``config.env_bool``: the
    package cannot be imported here, mid-install): 1/true/yes/on builds, unset/empty/0/false/no/off
    does not, anything else stops the install instead of silently giving a pure-Python one."""
    raw = os.environ.get("KVKERNELS_BUILD_CUDA", "")
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("", "0", "false", "no", "off"):
        return False
    raise RuntimeError(f"`KVKERNELS_BUILD_CUDA`: expected 0/1/true/false, got {raw!r}")


class BuildPyWithCuda(build_py):
    """With KVKERNELS_BUILD_CUDA=1 (and nvcc), compile csrc into kvkernels/_lib/ at install."""

    def run(self):
        super().run()
        if not _build_cuda_requested():
            return
        if getattr(self, "editable_mode", False):
            # an editable install's build_lib is a temporary folder: the library was compiled
            # (~20 s) and thrown away. The checkout's csrc/ is built just in time instead.
            sys.stderr.write("kvkernels: KVKERNELS_BUILD_CUDA=1 does nothing for an editable install; the CUDA "
                             "backend is built just in time from csrc/ on first use (docs/csrc.md)\n")
            return
        spec = importlib.util.spec_from_file_location("kvk_csrc_build", os.path.join("csrc", "build.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        if mod.nvcc() is None:
            raise RuntimeError("KVKERNELS_BUILD_CUDA=1 but nvcc was not found")
        if mod.cutlass_include() is None:
            # pip builds in an isolated environment, where the nvidia-cutlass of the target one
            # is not installed: the library then lacks the SM90 bulk path, and it is the one
            # loaded (before any just-in-time build)
            msg = ("KVKERNELS_BUILD_CUDA=1: no CUTLASS headers in the build environment, so the library is built "
                   "without the SM90 bulk path; pip install --no-build-isolation (with nvidia-cutlass installed) "
                   "or set KVKERNELS_CUTLASS_INCLUDE=<site-packages>/cutlass_library/source/include")
            if os.environ.get("KVKERNELS_REQUIRE_CUTLASS", "").strip() == "1":
                raise RuntimeError(msg + " (KVKERNELS_REQUIRE_CUTLASS=1)")
            sys.stderr.write(f"kvkernels: WARNING: {msg}\n")
        mod.build(os.path.join(self.build_lib, "kvkernels", "_lib"), verbose=True)


class CudaAwareDistribution(Distribution):
    """A wheel carrying the compiled library is platform-specific (an x86_64 .so linked to
    libcudart.so.13): tagged as such, not ``py3-none-any``."""

    def has_ext_modules(self):
        return _build_cuda_requested()


class BdistWheelCuda(bdist_wheel):
    """That wheel's tag: ``py3-none-<platform>``. The library is loaded with ctypes through a C ABI,
    so any Python 3 can load it (setuptools would say ``cp311-cp311``, as for an extension module)."""

    def get_tag(self):
        python, abi, plat = super().get_tag()
        return ("py3", "none", plat) if _build_cuda_requested() else (python, abi, plat)


setup(
    packages=list(PACKAGE_DIR),
    package_dir=PACKAGE_DIR,
    package_data={"kvkernels": ["py.typed"], "kvkernels.bench": ["*.cpp"], "kvkernels.csrc.kernels": CSRC_SOURCES,
                  "kvkernels.csrc.bindings": CSRC_SOURCES},
    # only the package_data above: the sdist's MANIFEST.in (its tests, csrc/tests, docs) and a
    # setuptools-scm file finder (every tracked file) must not put csrc/tests into the wheel
    include_package_data=False,
    cmdclass={"build_py": BuildPyWithCuda, "bdist_wheel": BdistWheelCuda},
    distclass=CudaAwareDistribution,
)
