"""Plain-PyTorch definitions of every op: the specification the kernels are tested against.

These run on any device (they are the ``backend="torch"`` path and the CPU fallback). They move
bytes: every cache view is reinterpreted as ``uint8`` rows of ``head_dim * element_size`` bytes,
so any dtype (fp8 included) is moved bit-exactly.

Id semantics (shared by every backend): an id in ``[0, num_blocks)`` selects that block; any other
value (``-1`` is the documented padding value) is *padding*: gather writes zeros into that staging
slot, scatter leaves the cache untouched for it. The public ops reject out-of-range ids other than
``-1`` before any kernel runs unless ``validate=False``.
"""

from __future__ import annotations

import torch

from .layout import PagedLayout
from .staging import StagingFormat

__all__ = ["gather", "scatter"]


def _byte_view(v: torch.Tensor) -> torch.Tensor:
    """``[nb, bs, H, D]`` of any dtype -> ``[nb, bs, H, D * e]`` uint8 view of the same memory."""
    if v.dtype == torch.uint8:
        return v
    if v.shape[-1] == 1 and v.stride(-1) != 1:  # head_dim 1: its stride is never stepped (torch wants 1)
        v = v.as_strided(v.shape, (*v.stride()[:-1], 1))
    return v.view(torch.uint8)


def gather(layout: PagedLayout, block_ids: torch.Tensor, fmt: StagingFormat, out: torch.Tensor) -> torch.Tensor:
    """Pack ``block_ids`` of ``fmt.layers`` into ``out[:fmt.nbytes]`` (see :mod:`kvkernels.staging`).

    ``block_ids``: int64 ``[n]`` on the cache device. ``out``: uint8 ``[>= fmt.nbytes]``.
    """
    n = fmt.num_blocks
    nb = layout.num_blocks
    dev = layout.device
    ids = block_ids.to(device=dev, dtype=torch.int64)
    valid = (ids >= 0) & (ids < nb)
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    keep = valid.view(n, 1, 1, 1).to(torch.uint8)
    region = fmt.region_nbytes
    for j, layer in enumerate(fmt.layers):
        base = j * region
        for c in range(fmt.num_kv):
            src = _byte_view(layout.views[layer][c]).index_select(0, safe) * keep
            off = base + c * fmt.entry_nbytes
            dst = out[off : off + fmt.entry_nbytes].view(n, layout.block_size, layout.num_heads, layout.row_nbytes)
            dst.copy_(src, non_blocking=True)
        if fmt.payload_nbytes < region:
            out[base + fmt.payload_nbytes : base + region].zero_()
    return out


def scatter(staging: torch.Tensor, layout: PagedLayout, block_ids: torch.Tensor, fmt: StagingFormat) -> None:
    """Write the staged blocks into ``block_ids`` of the cache (in place); padding ids are skipped."""
    n = fmt.num_blocks
    nb = layout.num_blocks
    dev = layout.device
    ids = block_ids.to(device=dev, dtype=torch.int64)
    valid = (ids >= 0) & (ids < nb)
    sel = valid.nonzero().flatten()
    dst_ids = ids.index_select(0, sel)
    src_buf = staging.to(dev, non_blocking=True) if staging.device != dev else staging
    for j, layer in enumerate(fmt.layers):
        for c in range(fmt.num_kv):
            off = j * fmt.region_nbytes + c * fmt.entry_nbytes
            src = src_buf[off : off + fmt.entry_nbytes].view(n, layout.block_size, layout.num_heads, layout.row_nbytes)
            _byte_view(layout.views[layer][c]).index_copy_(0, dst_ids, src.index_select(0, sel))
