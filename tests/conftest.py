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
