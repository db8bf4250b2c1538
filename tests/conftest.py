"""pytest setup: Triton mode (via kvtest), the ``gpu`` marker, the ``device`` fixture."""

from __future__ import annotations

import kvtest  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)
import pytest

from kvtest import DEVICE, HAS_CUDA


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _fresh_invalid_id_counters():
    """Each test starts with kvkernels' invalid-id counters at zero: a test that fails before its
    ``check_errors()`` must not fail the next one (seen on the H100: a failed FP8 test left a count
    that made the host-sync test raise)."""
    from kvkernels import ops

    for t in ops._ERR.values():
        t.zero_()
    yield
