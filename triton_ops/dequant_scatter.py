"""Fused FP8 dequantization + paged scatter: e4m3 codes + fp32 scales -> (layer, K/V, block) chunks.

Inverse of :mod:`.quant_gather` (same work items, same persistent grid). ``y = code * scale`` in
fp32 (one IEEE multiply), then round-to-nearest-even into the cache dtype. The e4m3 decode and the
bf16 rounding are integer bit operations (the interpreter's fp32 -> bf16 conversion truncates);
every NaN is written as the dtype's canonical quiet NaN (GPU arithmetic does not keep NaN signs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._paged import _block_ptr, _cache_rows, _slot, _staging_rows, geometry
from .quant_gather import _KINDS, NUM_WARPS, align16, tile_rows


@triton.jit
def _e4m3_decode(q):
    """int32 code (0..255) -> fp32 value (exact); 0x7F / 0xFF -> 480.0 here, NaN is set by the caller."""
    mag = q & 0x7F
    normal = (mag << 20) + (120 << 23)  # exponent bias 7 -> 127
    sub = (mag.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # k * 2**-9, exact
    bits = tl.where(mag < 8, sub, normal) | ((q & 0x80) << 24)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _store_from_f32(ptr, y, nan, mask, OUT_KIND: tl.constexpr):
    """Round fp32 ``y`` to the cache dtype (RNE) and store its bits; ``nan`` -> canonical NaN."""
    if OUT_KIND == 0:  # bf16: RNE on the 16 dropped bits, by integer ops
        b = y.to(tl.int32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        tl.store(ptr, tl.where(nan, 0x7FC0, r).to(tl.int16), mask=mask)
    elif OUT_KIND == 1:  # fp16: the conversion is RNE on the GPU and in the interpreter
        r = y.to(tl.float16).to(tl.int16, bitcast=True)
        tl.store(ptr, tl.where(nan, 0x7E00, r.to(tl.int32)).to(tl.int16), mask=mask)
    else:
        tl.store(ptr, tl.where(nan, 0x7FC00000, y.to(tl.int32, bitcast=True)), mask=mask)


@triton.jit
def _dequant_scatter_kernel(
    ptr_tab,  # int64 [R, C]: byte address of block 0 of (requested layer j, entry c)
    block_ids,  # int32/int64 [n]: destination block of staging slot i (outside [0, num_blocks) = skipped)
    q_ptr,  # uint8 [>= R * region_nbytes]: staging bytes (e4m3 codes read here)
    s_ptr,  # fp32 [>= R * region_nbytes / 4]: the same staging as fp32 words (scales)
    err_ptr,  # int32 [1]: += 1 per invalid id other than -1 (deferred validation)
    n, num_blocks, num_items,  # staging slots, cache blocks, R * C * n
    stride_b, stride_n, stride_h,  # cache strides in elements: block, token, head (int64)
    region_nbytes, q_entry_nbytes, scale_base_nbytes, scale_entry_nbytes,  # format offsets (bytes)
    C: tl.constexpr,  # entries per layer (2 = K, V; 1 = MLA)
    H: tl.constexpr,  # kv heads
    BS: tl.constexpr,  # block_size
    D: tl.constexpr,  # head_dim
    OUT_KIND: tl.constexpr,  # 0 bf16, 1 fp16, 2 fp32
    PER_BLOCK: tl.constexpr,  # False: scale per (token, head); True: per (block, head)
    BLOCK_R: tl.constexpr,  # (token, head) rows per tile
    BLOCK_D: tl.constexpr,  # next_power_of_2(D)
    ALIGN16: tl.constexpr,  # host checked (align16): cache and staging rows 16-byte aligned
):
    # grid: (min(num_items, max_ctas),); each program strides over the work items
    ROWS: tl.constexpr = BS * H
    EB: tl.constexpr = 4 if OUT_KIND == 2 else 2  # cache element bytes (loaded as int32 / int16 bits)
    EV: tl.constexpr = 16 // EB  # cache elements per 16 bytes
    r_ar = tl.arange(0, BLOCK_R)
    d_ar = tl.arange(0, BLOCK_D)
    d_ok = d_ar < D
    for w32 in tl.range(tl.program_id(0), num_items, tl.num_programs(0)):
        j, c, i, bid, valid = _slot(w32, block_ids, err_ptr, n, num_blocks, C)
        row_lim = tl.where(valid, ROWS, 0)  # invalid id: nothing is written
        cache = _block_ptr(ptr_tab, j, c, bid, valid, stride_b, EB, C, ALIGN16)
        q_in = q_ptr + j * region_nbytes + c * q_entry_nbytes + i * (ROWS * D)
        s_in = s_ptr + (j * region_nbytes + scale_base_nbytes + c * scale_entry_nbytes) // 4
        for r0 in tl.range(0, ROWS, BLOCK_R):
            rows = r0 + r_ar
            c_row, hh = _cache_rows(rows, stride_n, stride_h, H, EV, ALIGN16)
            rv = rows < row_lim
            mv = rv[:, None] & d_ok[None, :]
            if PER_BLOCK:
                s = tl.load(s_in + i * H + hh, mask=rv, other=0.0)
            else:
                s = tl.load(s_in + i * ROWS + rows, mask=rv, other=0.0)
            q_off = _staging_rows(rows, D, ALIGN16)[:, None] + d_ar[None, :]
            q = tl.load(q_in + q_off, mask=mv, other=0).to(tl.int32)
            y = _e4m3_decode(q) * s[:, None]
            nan = ((q & 0x7F) == 0x7F) | (y != y)
            off = c_row[:, None] + d_ar[None, :]
            _store_from_f32(cache + off, y, nan, mv, OUT_KIND)


def dequant_scatter_triton(staging: torch.Tensor, layout, block_ids: torch.Tensor, fmt, err: torch.Tensor, max_ctas: int = 0) -> None:
    """Dequantize ``staging`` (uint8, 16-byte aligned, validated by the caller; written by
    :func:`~kvkernels.triton_ops.quant_gather.quant_gather_triton` with ``fmt``) into
    ``block_ids`` of the cache, in place.

    ``block_ids`` int32/int64 ``[n]`` (distinct) and ``err`` int32 ``[1]`` on the cache device;
    ``max_ctas`` caps the grid. A pinned host ``staging`` is read through UVA.
    """
    n = fmt.num_blocks
    if n == 0 or fmt.num_regions == 0:
        return
    kind, _ = _KINDS[layout.dtype]
    tab, (sb, sn, sh), num_items, grid = geometry(layout, fmt, max_ctas, layout.element_size)
    stage = staging[: fmt.nbytes]
    block_r, block_d = tile_rows(layout.block_size * layout.num_heads, layout.head_dim)
    _dequant_scatter_kernel[grid](
        tab, block_ids, stage, stage.view(torch.float32), err,
        n, layout.num_blocks, num_items, sb, sn, sh,
        fmt.region_nbytes, fmt.q_entry_nbytes, fmt.num_kv * fmt.q_entry_nbytes, fmt.scale_entry_nbytes,
        C=fmt.num_kv, H=layout.num_heads, BS=layout.block_size, D=layout.head_dim, OUT_KIND=kind,
        PER_BLOCK=fmt.granularity == "block", BLOCK_R=block_r, BLOCK_D=block_d,
        ALIGN16=align16(layout, stage), num_warps=NUM_WARPS,
    )
