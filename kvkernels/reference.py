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

from ._validate import check_byte_buffer, check_tensor, describe, fail
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


def _check_args(layout, block_ids, fmt, buf, name: str, fmt_type=StagingFormat) -> None:
    """Everything these functions index, checked before the first byte moves: the public ops pass
    arguments they built and checked, but these are exported, and a format of another layout or a
    short buffer used to fail part-way (an ``IndexError`` or a view error after some layers were
    written). Integer checks only (messages built on failure only): no device work, no sync.
    ``fmt_type``: the format class expected (``kvkernels.quant`` passes its FP8 format, which has
    no element size: its codes are bytes)."""
    if not isinstance(layout, PagedLayout):
        fail("layout", "a kvkernels.PagedLayout", type(layout).__name__, TypeError)
    if not isinstance(fmt, fmt_type):
        fail("fmt", f"a kvkernels.{fmt_type.__name__}", type(fmt).__name__, TypeError)
    sized = fmt_type is StagingFormat
    mine = (layout.block_size, layout.num_heads, layout.head_dim, layout.num_kv) + \
        ((layout.element_size,) if sized else ())
    theirs = (fmt.block_size, fmt.num_heads, fmt.head_dim, fmt.num_kv) + ((fmt.element_size,) if sized else ())
    if mine != theirs:
        what = "block_size, heads, head_dim, kv" + (", element_size" if sized else "")
        fail("fmt", f"a format of this layout ({what} = {mine})", theirs)
    nl = layout.num_layers
    if not all(0 <= j < nl for j in fmt.layers):
        fail("fmt", f"layers in [0, {nl})", fmt.layers)
    check_tensor(block_ids, "block_ids")
    if block_ids.dim() != 1 or block_ids.numel() != fmt.num_blocks:
        fail("block_ids", f"a 1-D tensor of fmt.num_blocks = {fmt.num_blocks} ids", describe(block_ids))
    if block_ids.is_floating_point() or block_ids.is_complex() or block_ids.dtype == torch.bool:
        fail("block_ids", "an integer tensor", block_ids.dtype, TypeError)
    check_byte_buffer(buf, name, fmt.nbytes)  # its shape rules; any device (scatter copies it over)


def gather(layout: PagedLayout, block_ids: torch.Tensor, fmt: StagingFormat, out: torch.Tensor) -> torch.Tensor:
    """Pack ``block_ids`` of ``fmt.layers`` into ``out[:fmt.nbytes]`` (see :mod:`kvkernels.staging`).

    ``block_ids``: integer ``[fmt.num_blocks]``. ``out``: uint8 ``[>= fmt.nbytes]``, contiguous.
    ``fmt`` must describe this layout (its block shape and element size; its layers in range):
    anything else raises before any byte is written. Ids are not range-checked here (out-of-range
    ones are padding, above); the public :func:`kvkernels.gather` checks them.
    """
    _check_args(layout, block_ids, fmt, out, "out")
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
    """Write the staged blocks into ``block_ids`` of the cache (in place); padding ids are skipped.

    Same argument rules as :func:`gather` (``staging`` in the place of ``out``), checked before
    any block is written."""
    _check_args(layout, block_ids, fmt, staging, "staging")
    n = fmt.num_blocks
    nb = layout.num_blocks
    dev = layout.device
    ids = block_ids.to(device=dev, dtype=torch.int64)
    valid = (ids >= 0) & (ids < nb)
    sel = valid.nonzero().flatten()
    dst_ids = ids.index_select(0, sel)
    src_buf = staging[: fmt.nbytes]  # only the format's bytes cross devices (a pool may be far larger)
    if src_buf.device != dev:  # blocking into a CPU cache: a non-blocking D2H copy returns before its bytes land
        src_buf = src_buf.to(dev, non_blocking=dev.type != "cpu")
    for j, layer in enumerate(fmt.layers):
        for c in range(fmt.num_kv):
            off = j * fmt.region_nbytes + c * fmt.entry_nbytes
            src = src_buf[off : off + fmt.entry_nbytes].view(n, layout.block_size, layout.num_heads, layout.row_nbytes)
            _byte_view(layout.views[layer][c]).index_copy_(0, dst_ids, src.index_select(0, sel))
