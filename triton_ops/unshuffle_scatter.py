"""Fused byte-plane un-shuffle + paged scatter: hi plane | lo plane -> 16-bit (layer, K/V, block) chunks.

Inverse of :mod:`.shuffle_gather` (same format, work items and persistent grid).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._paged import _block_ptr, _cache_rows, _slot, _staging_rows, geometry
from .quant_gather import NUM_WARPS, align16, tile_rows


@triton.jit
def _unshuffle_scatter_kernel(
    ptr_tab,  # int64 [R, C]: byte address of block 0 of (requested layer j, entry c)
    block_ids,  # int32/int64 [n]: destination block of staging slot i (outside [0, num_blocks) = skipped)
    stage_ptr,  # uint8 [>= R * region_nbytes]: staging bytes (planes read here)
    err_ptr,  # int32 [1]: += 1 per invalid id other than -1 (deferred validation)
    n, num_blocks, num_items,  # staging slots, cache blocks, R * C * n
    stride_b, stride_n, stride_h,  # cache strides in 16-bit elements: block, token, head (int64)
    region_nbytes, entry_nbytes, plane_nbytes,  # staging: bytes per region, per entry (2N), per plane (N)
    C: tl.constexpr,  # entries per layer (2 = K, V; 1 = MLA)
    H: tl.constexpr,  # kv heads
    ROWS: tl.constexpr,  # block_size * H
    D: tl.constexpr,  # head_dim
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next_power_of_2(D)
    ALIGN16: tl.constexpr,  # host checked (align16): cache and staging rows 16-byte aligned
):
    # grid: (min(num_items, max_ctas),); each program strides over the work items
    r_ar = tl.arange(0, BLOCK_R)
    d_ar = tl.arange(0, BLOCK_D)
    d_ok = d_ar < D
    for w32 in tl.range(tl.program_id(0), num_items, tl.num_programs(0)):
        j, c, i, bid, valid = _slot(w32, block_ids, err_ptr, n, num_blocks, C)
        row_lim = tl.where(valid, ROWS, 0)  # invalid id: nothing is written
        cache = _block_ptr(ptr_tab, j, c, bid, valid, stride_b, 2, C, ALIGN16)
        hi_in = stage_ptr + j * region_nbytes + c * entry_nbytes + i * (ROWS * D)
        for r0 in tl.range(0, ROWS, BLOCK_R):
            rows = r0 + r_ar
            mv = (rows < row_lim)[:, None] & d_ok[None, :]
            s_off = _staging_rows(rows, D, ALIGN16)[:, None] + d_ar[None, :]
            hi = tl.load(hi_in + s_off, mask=mv, other=0).to(tl.int32)
            lo = tl.load(hi_in + plane_nbytes + s_off, mask=mv, other=0).to(tl.int32)
            c_row, _h = _cache_rows(rows, stride_n, stride_h, H, 8, ALIGN16)  # 8 16-bit elements = 16 bytes
            off = c_row[:, None] + d_ar[None, :]
            tl.store(cache + off, ((hi << 8) | lo).to(tl.int16), mask=mv)


def unshuffle_scatter_triton(staging: torch.Tensor, layout, block_ids: torch.Tensor, fmt, err: torch.Tensor, max_ctas: int = 0) -> None:
    """Write byte-plane ``staging`` (uint8, validated by the caller) into ``block_ids`` of a 16-bit
    cache, in place. ``block_ids`` int32/int64 ``[n]`` (distinct) and ``err`` int32 ``[1]`` on the
    cache device; ``max_ctas`` caps the grid."""
    n = fmt.num_blocks
    if n == 0 or fmt.num_regions == 0:
        return
    tab, (sb, sn, sh), num_items, grid = geometry(layout, fmt, max_ctas, 2)
    rows = layout.block_size * layout.num_heads
    block_r, block_d = tile_rows(rows, layout.head_dim)
    _unshuffle_scatter_kernel[grid](
        tab, block_ids, staging[: fmt.nbytes], err, n, layout.num_blocks, num_items, sb, sn, sh,
        fmt.region_nbytes, fmt.entry_nbytes, fmt.entry_nbytes // 2,
        C=fmt.num_kv, H=layout.num_heads, ROWS=rows, D=layout.head_dim,
        BLOCK_R=block_r, BLOCK_D=block_d,
        ALIGN16=align16(layout, staging), num_warps=NUM_WARPS,
    )
