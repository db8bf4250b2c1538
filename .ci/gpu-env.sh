# Sourced by .ci/gpu and .ci/gpu-bench on a bare GPU machine: install the carried wheels (./.whl,
# from .ci/fetch_wheels.sh; no network needed) into /tmp/kvk-site and kvkernels itself (editable,
# without touching the image's torch/triton).
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvk-site .whl/*.whl \
    && export PYTHONPATH=/tmp/kvk-site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! python3 -m pip install -q --no-deps --no-build-isolation -e . ; then
  echo "GPU CI: editable install of kvkernels failed"; return 1
fi
