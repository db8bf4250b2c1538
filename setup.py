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

from setuptools import setup
from setuptools.command.build_py import build_py

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
        spec = importlib.util.spec_from_file_location("kvk_csrc_build", os.path.join("csrc", "build.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        if mod.nvcc() is None:
            raise RuntimeError("KVKERNELS_BUILD_CUDA=1 but nvcc was not found")
        mod.build(os.path.join(self.build_lib, "kvkernels", "_lib"), verbose=True)

setup(
    packages=list(PACKAGE_DIR),
    package_dir=PACKAGE_DIR,
    package_data={"kvkernels": ["py.typed"], "kvkernels.bench": ["*.cpp"], "kvkernels.csrc.kernels": CSRC_SOURCES,
                  "kvkernels.csrc.bindings": CSRC_SOURCES},
    cmdclass={"build_py": BuildPyWithCuda},
)
