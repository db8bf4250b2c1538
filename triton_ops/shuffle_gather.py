"""Fused paged gather + byte-plane shuffle: 16-bit (layer, K/V, block) chunks -> hi plane | lo plane.

Format (``docs/quant.md``): the raw staging offsets (:class:`kvkernels.StagingFormat`); inside each
entry (K or V) of a region, ``N = n * block_size * H * D`` elements ``e[k]`` (raw staging order)
are stored as ``e[k] >> 8`` at ``entry + k`` and ``e[k] & 0xFF`` at ``entry + N + k``. Same work
items and persistent grid as :mod:`._paged`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._paged import _block_ptr, _cache_rows, _slot, _staging_rows, geometry
from .quant_gather import NUM_WARPS, align16, tile_rows


@triton.jit
def _shuffle_gather_kernel(
    ptr_tab,  # int64 [R, C]: byte address of block 0 of (requested layer j, entry c)
    block_ids,  # int32/int64 [n]: cache block of staging slot i (outside [0, num_blocks) = padding)
    out_ptr,  # uint8 [>= R * region_nbytes]: staging bytes (planes written here)
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
        row_lim = tl.where(valid, ROWS, 0)  # invalid id: no cache row is read, zeros are written
        cache = _block_ptr(ptr_tab, j, c, bid, valid, stride_b, 2, C, ALIGN16)
        hi_out = out_ptr + j * region_nbytes + c * entry_nbytes + i * (ROWS * D)
        for r0 in tl.range(0, ROWS, BLOCK_R):
            rows = r0 + r_ar
            c_row, _h = _cache_rows(rows, stride_n, stride_h, H, 8, ALIGN16)  # 8 16-bit elements = 16 bytes
            off = c_row[:, None] + d_ar[None, :]
            v = tl.load(cache + off, mask=(rows < row_lim)[:, None] & d_ok[None, :], other=0).to(tl.int32)
            s_off = _staging_rows(rows, D, ALIGN16)[:, None] + d_ar[None, :]
            m = (rows < ROWS)[:, None] & d_ok[None, :]
            tl.store(hi_out + s_off, ((v >> 8) & 0xFF).to(tl.uint8), mask=m)
            tl.store(hi_out + plane_nbytes + s_off, (v & 0xFF).to(tl.uint8), mask=m)


def shuffle_gather_triton(layout, block_ids: torch.Tensor, fmt, out: torch.Tensor, err: torch.Tensor, max_ctas: int = 0) -> torch.Tensor:
    """Pack ``fmt.layers`` of a 16-bit ``layout`` into ``out`` (uint8, validated by the caller) as
    byte planes; one launch. ``block_ids`` int32/int64 ``[n]`` and ``err`` int32 ``[1]`` on the
    cache device; ``max_ctas`` caps the grid. Region padding is zeroed."""
    n = fmt.num_blocks
    if n == 0 or fmt.num_regions == 0:
        return out
    tab, (sb, sn, sh), num_items, grid = geometry(layout, fmt, max_ctas, 2)
    rows = layout.block_size * layout.num_heads
    block_r, block_d = tile_rows(rows, layout.head_dim)
    _shuffle_gather_kernel[grid](
        tab, block_ids, out, err, n, layout.num_blocks, num_items, sb, sn, sh,
        fmt.region_nbytes, fmt.entry_nbytes, fmt.entry_nbytes // 2,
        C=fmt.num_kv, H=layout.num_heads, ROWS=rows, D=layout.head_dim,
        BLOCK_R=block_r, BLOCK_D=block_d,
        ALIGN16=align16(layout, out), num_warps=NUM_WARPS,
    )
    if fmt.payload_nbytes < fmt.region_nbytes:
        out[: fmt.nbytes].view(fmt.num_regions, fmt.region_nbytes)[:, fmt.payload_nbytes :].zero_()
    return out
