"""kvkernels: fast KV-cache offload kernels.

Pack a request's blocks from any paged KV layout into one layer-contiguous staging buffer
(:func:`gather`) and unpack them into other blocks (:func:`scatter`), with Triton kernels on the GPU
and a plain-PyTorch reference everywhere. See README.md and docs/layouts.md.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .layout import PagedLayout
from .ops import as_block_ids, check_errors, gather, scatter
from .quant import QuantStagingFormat, fp8_round_to_grid, gather_quant, quant_staging_nbytes, scatter_quant
from .staging import REGION_ALIGN, StagingFormat, staging_nbytes
from .info import info

__all__ = [
    "PagedLayout",
    "StagingFormat",
    "REGION_ALIGN",
    "staging_nbytes",
    "gather",
    "scatter",
    "check_errors",
    "as_block_ids",
    "QuantStagingFormat",
    "quant_staging_nbytes",
    "gather_quant",
    "scatter_quant",
    "fp8_round_to_grid",
    "info",
    "__version__",
]
