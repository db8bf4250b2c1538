# shellcheck shell=bash
# Sourced by .ci/gpu and .ci/gpu-bench on a bare GPU machine: install the carried wheels (./.whl,
# from .ci/fetch_wheels.sh; no network needed) into /tmp/kvk-site and kvkernels itself (editable,
# without touching the image's torch/triton). Returns non-zero, with a "GPU CI env: ..." message, when
# ./.whl holds no wheels (not fetched, or not carried: the device call needs `carry: [".whl"]`) or
# their install fails, or when the carried CUTLASS headers (.whl/cutlass-include) miss one the sources
# include: without them kvikio/nvCOMP/zstandard/CUTLASS are missing, their tests skip
# and a run would pass green without having tested them. Opt-out: KVK_ALLOW_NO_WHEELS=1 (a dry run
# without the wheels) turns both into a warning; the editable install must always succeed.
export PIP_DISABLE_PIP_VERSION_CHECK=1
_kvk_no_wheels() {
  if [ "${KVK_ALLOW_NO_WHEELS:-0}" = "1" ]; then
    echo "GPU CI env: WARNING: $1; going on without the wheels (KVK_ALLOW_NO_WHEELS=1): the kvikio/nvCOMP/zstandard/CUTLASS tests will skip or fail" >&2
    return 0
  fi
  echo "GPU CI env: ERROR: $1 (run .ci/fetch_wheels.sh here and carry .whl; KVK_ALLOW_NO_WHEELS=1 to go on without them)" >&2
  return 1
}
# a warm machine (a later call of the same session) has them already: the stamp names the wheels
# installed there (their hashes), so the same set is not installed again (5-30 s per call)
_kvk_stamp=""
if compgen -G ".whl/*.whl" >/dev/null; then
  _kvk_stamp=$(sha256sum .whl/*.whl 2>/dev/null | sha256sum | cut -c1-64)
fi
if ! compgen -G ".whl/*.whl" >/dev/null; then
  _kvk_no_wheels "no wheels in $(pwd)/.whl" || return 1
elif [ -n "$_kvk_stamp" ] && [ "$(cat /tmp/kvk-site/.kvk-stamp 2>/dev/null)" = "$_kvk_stamp" ]; then
  export PYTHONPATH=/tmp/kvk-site${PYTHONPATH:+:$PYTHONPATH}
  echo "GPU CI env: the wheels of .whl are in /tmp/kvk-site already (same hashes): not installed again"
elif rm -rf /tmp/kvk-site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvk-site .whl/*.whl; then
  export PYTHONPATH=/tmp/kvk-site${PYTHONPATH:+:$PYTHONPATH}
  [ -n "$_kvk_stamp" ] && { echo "$_kvk_stamp" >/tmp/kvk-site/.kvk-stamp; } 2>/dev/null
  echo "GPU CI env: installed $(compgen -G '.whl/*.whl' | wc -l) wheels from .whl into /tmp/kvk-site"
else
  _kvk_no_wheels "pip install of .whl/*.whl into /tmp/kvk-site failed (pip's error above: two versions of one package? or this is not Python 3.12, which .ci/fetch_wheels.sh fetches for the GPU image)" || return 1
fi
# CUTLASS as the headers the build reads (.ci/fetch_wheels.sh cuts them from the wheel where it has
# nvcc): checked against the sources here, so a csrc change that includes another header fails now,
# with the fix named, rather than as a CUDA-backend build error inside the tests
if [ -f .whl/cutlass-include/KVK_SUBSET ]; then
  export KVKERNELS_CUTLASS_INCLUDE="$(pwd)/.whl/cutlass-include"
  if python3 csrc/build.py --check-cutlass "$KVKERNELS_CUTLASS_INCLUDE"; then :; else
    unset KVKERNELS_CUTLASS_INCLUDE  # (a dry run goes on with the nvidia-cutlass package, if any)
    _kvk_no_wheels "the carried CUTLASS headers (.whl/cutlass-include, $(sed -n 2p .whl/cutlass-include/KVK_SUBSET)) fail the check above: re-run .ci/fetch_wheels.sh on this tree" || return 1
  fi
fi
# (into the active Python: on a development machine, run a dry run from the tree its venv points to)
# The build uses the image's setuptools (--no-build-isolation: no index here). pyproject.toml's SPDX
# `license` string needs setuptools >= 77; an older one is stood in for, for this build only, by
# the wheel .ci/fetch_wheels.sh puts in .whl/build (not in /tmp/kvk-site: the tests never see it)
_kvk_build_pp=""
if ! python3 -c 'import setuptools, sys; sys.exit(tuple(int(x) for x in setuptools.__version__.split(".")[:2]) < (77, 0))' 2>/dev/null; then
  if compgen -G ".whl/build/setuptools-*.whl" >/dev/null && rm -rf /tmp/kvk-build \
      && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/kvk-build .whl/build/setuptools-*.whl; then
    _kvk_build_pp=/tmp/kvk-build
    echo "GPU CI env: the image's setuptools is older than 77: kvkernels is built with .whl/build's"
  else
    echo "GPU CI env: ERROR: installing kvkernels needs setuptools >= 77 and neither the image nor .whl/build has it (run .ci/fetch_wheels.sh and carry .whl)" >&2
    return 1
  fi
fi
if ! PYTHONPATH="${_kvk_build_pp}${_kvk_build_pp:+${PYTHONPATH:+:}}${PYTHONPATH:-}" \
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . ; then
  echo "GPU CI env: ERROR: editable install of kvkernels failed" >&2; return 1
fi
