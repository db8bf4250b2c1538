#!/usr/bin/env bash
# Download the wheels the GPU image lacks into ./.whl (git-ignored), for `.ci/gpu` on a machine
# without network (Python 3.12, manylinux x86_64, CUDA 13). ~44 MB; the device tool carries it
# (`carry: [".whl"]`; .ci/gpu-env.sh installs every .whl/*.whl and fails when there are none).
# .whl is emptied first: two versions of one package side by side stop the whole offline install.
# Pinned to the versions the H100 runs of 2026-11-23 tested; bump them together, deliberately.
# nvidia-cutlass: only its C++ headers (the CUDA backend's SM90 bulk path). Where nvcc is found, the
# wheel (6.4 MB) is replaced by .whl/cutlass-include, the 47 headers the build reads (+ version.h, 0.8 MB), proven
# whole by building the library against them (csrc/build.py --cutlass-subset); .ci/gpu-env.sh
# points KVKERNELS_CUTLASS_INCLUDE there and checks them against the sources it runs. Re-run this
# script after a change in csrc that includes another CUTLASS header.
set -euo pipefail
cd "$(dirname "$0")/.."
pins=(kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 rapids-logger==0.3.0
      nvidia-nvcomp-cu13==6.0.0.12 nvidia-libnvcomp-cu13==6.0.0.12 zstandard==0.25.0
      nvidia-cutlass==4.2.0.0)
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_34_x86_64)
rm -rf .whl
mkdir -p .whl
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${plat[@]}" -d .whl "${pins[@]}"
# setuptools >= 77 builds kvkernels itself (the SPDX license string): used by .ci/gpu-env.sh only when
# the image's is older, so it is kept apart from the wheels installed for the tests
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d .whl/build setuptools==80.10.2
cw=$(compgen -G ".whl/nvidia_cutlass-*.whl" | head -n 1 || :)
if [ -z "$cw" ]; then
  echo "fetch_wheels: ERROR: no nvidia_cutlass wheel in .whl" >&2; exit 1
elif command -v nvcc >/dev/null || [ -x "${CUDA_HOME:-/nonexistent}/bin/nvcc" ]; then
  ctmp=$(mktemp -d)
  python3 -m zipfile -e "$cw" "$ctmp"
  if python3 csrc/build.py --cutlass-subset "$ctmp/cutlass_library/source/include" .whl/cutlass-include; then
    rm -f "$cw"
  else
    echo "fetch_wheels: WARNING: cutting the CUTLASS headers failed (above): the whole wheel is carried" >&2
  fi
  rm -rf "$ctmp"
else
  echo "fetch_wheels: no nvcc here: the whole CUTLASS wheel is carried (6.4 MB; with nvcc, only the headers the build reads)"
fi
ls -la .whl .whl/build
n=$(find .whl -maxdepth 1 -type f -name '*.whl' | wc -l)
want=${#pins[@]}
if [ -d .whl/cutlass-include ]; then want=$((want - 1)); fi
if [ "$n" -ne "$want" ]; then
  echo "fetch_wheels: ERROR: $n wheels in .whl for ${#pins[@]} pins (CUTLASS as headers: $([ -d .whl/cutlass-include ] && echo yes || echo no))" >&2; exit 1
fi
# what one device call carries: tracked + untracked-not-ignored files (+ shared/) + .whl, 64 MiB at most
bytes_of() { { xargs -0 -r stat -c %s -- 2>/dev/null || :; } | awk '{s += $1} END {print s + 0}'; }
whl=$(find .whl -type f -print0 | bytes_of)
tree=$({ git ls-files -z --cached --others --exclude-standard 2>/dev/null || :; } | bytes_of)
shared=0
if [ -d shared ]; then shared=$(find shared -type f -print0 | bytes_of); fi
total=$((whl + tree + shared))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
echo "fetch_wheels: .whl $(mib "$whl") + working tree $(mib "$tree") + shared/ $(mib "$shared") = $(mib "$total") of the device tool's 64 MiB"
if [ "$total" -gt $((58 * 1048576)) ]; then
  echo "fetch_wheels: WARNING: $(mib "$total") is close to (or over) the 64 MiB a device call carries: trim the tree or the wheels" >&2
fi
