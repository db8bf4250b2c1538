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

from setuptools import setup

PACKAGE_DIR = {
    "kvkernels": "kvkernels",
    "kvkernels.triton_ops": "triton_ops",
    "kvkernels.io": "io",
    "kvkernels.integrations": "integrations",
    "kvkernels.integrations.lmcache": "integrations/lmcache",
    "kvkernels.integrations.vllm": "integrations/vllm",
    "kvkernels.bench": "bench",
}

setup(packages=list(PACKAGE_DIR), package_dir=PACKAGE_DIR, package_data={"kvkernels.bench": ["*.cpp"]})
