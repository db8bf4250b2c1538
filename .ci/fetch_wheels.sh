#!/usr/bin/env bash
# Download the wheels the GPU image lacks into ./.whl (git-ignored), for `.ci/gpu` on a machine
# without network (Python 3.12, manylinux x86_64, CUDA 13). ~46 MB; the device tool carries it.
# nvidia-cutlass: only its C++ headers (the CUDA backend's SM90 bulk path), installed --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_34_x86_64)
for pkg in kvikio-cu13 libkvikio-cu13 rapids-logger nvidia-nvcomp-cu13 nvidia-libnvcomp-cu13 zstandard crc32c nvidia-cutlass==4.2.0.0; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d .whl "$pkg"
done
ls -la .whl
du -sh .whl
