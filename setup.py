"""kvkernels build: a pure-Python package whose top-level folders map into the kvkernels namespace.

folder                 -> import name
kvkernels/             -> kvkernels
triton_ops/            -> kvkernels.triton_ops
io/                    -> kvkernels.io            (never a top-level `io`)
integrations/lmcache/  -> kvkernels.integrations.lmcache
integrations/vllm/     -> kvkernels.integrations.vllm
bench/                 -> kvkernels.bench         (so `kvkernels bench` works from any install)

The CUDA extension in csrc/ is built only when KVKERNELS_BUILD_CUDA=1 and nvcc is present (see
docs/ and csrc/README.md); otherwise this is a pure-Python install that works with the Triton and
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
}


class BuildPyWithCuda(build_py):
    """With KVKERNELS_BUILD_CUDA=1 (and nvcc), compile csrc into kvkernels/_lib/ at install."""

    def run(self):
        super().run()
        if os.environ.get("KVKERNELS_BUILD_CUDA", "0") != "1":
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
    package_data={"kvkernels.bench": ["*.cpp"], "kvkernels.csrc": ["kernels/*.cuh", "bindings/*.cu", "*.md"]},
    cmdclass={"build_py": BuildPyWithCuda},
)
