"""Fused paged gather: many (layer, K/V, block) chunks -> one layer-contiguous staging buffer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._paged import NUM_WARPS, _item_coords, aligned16, tile_shape, word_bytes


@triton.jit
def _gather_kernel(
    ptr_tab,  # int64 [R, C]: byte address of block 0 of (requested layer j, entry c)
    block_ids,  # int32/int64 [n]: cache block of staging slot i (outside [0, num_blocks) = padding)
    out_ptr,  # word [>= R * region_words]: staging buffer, written
    err_ptr,  # int32 [1]: += 1 per invalid id other than -1 (deferred validation)
    n,  # staging slots
    num_blocks,  # blocks in the cache
    num_items,  # R * C * n
    stride_b,  # words between blocks (int64)
    stride_n,  # words between tokens of a block
    stride_h,  # words between heads
    region_words,  # words per staging region
    entry_words,  # words per entry (K or V) of a region
    C: tl.constexpr,  # entries per layer (2 = K, V; 1 = MLA)
    H: tl.constexpr,  # kv heads
    ROWS: tl.constexpr,  # block_size * H
    ROW_WORDS: tl.constexpr,  # head_dim * e / word
    WORD: tl.constexpr,  # bytes per word (8, 4, 2, 1)
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ALIGN16: tl.constexpr,  # host checked: every base address, stride and row is 16-byte aligned
):
    # grid: (min(num_items, max_ctas),); each program strides over the work items
    r_ar = tl.arange(0, BLOCK_R)
    w_ar = tl.arange(0, BLOCK_W)
    col_ok = w_ar < ROW_WORDS
    for w32 in tl.range(tl.program_id(0), num_items, tl.num_programs(0)):
        w = tl.cast(w32, tl.int64)
        j, c, i = _item_coords(w, n, C)
        bid = tl.load(block_ids + i).to(tl.int64)
        valid = (bid >= 0) & (bid < num_blocks)
        row_lim = tl.where(valid, ROWS, 0)  # invalid id: no row is read (gather) / written (scatter)
        tl.atomic_add(err_ptr, 1, mask=((bid != -1) & (bid < 0)) | (bid >= num_blocks))
        base = tl.load(ptr_tab + j * C + c).to(out_ptr.dtype)
        if ALIGN16:  # the hint must sit on the pointer (checked in PTX: ld.global.v2.b64)
            base = tl.multiple_of(base, 16)
        src = base + tl.where(valid, bid, 0) * stride_b
        dst = out_ptr + j * region_words + c * entry_words + i * (ROWS * ROW_WORDS)
        for r0 in tl.range(0, ROWS, BLOCK_R):
            rows = r0 + r_ar
            t = rows // H
            h = rows - t * H
            row_ok = rows < ROWS
            row_v = rows < row_lim
            s_row = t.to(tl.int64) * stride_n + h.to(tl.int64) * stride_h
            if ALIGN16:
                s_row = tl.multiple_of(s_row, 16 // WORD)
            s_off = s_row[:, None] + w_ar[None, :]
            d_off = (rows.to(tl.int64) * ROW_WORDS)[:, None] + w_ar[None, :]
            m = row_ok[:, None] & col_ok[None, :]
            mv = row_v[:, None] & col_ok[None, :]
            x = tl.load(src + s_off, mask=mv, other=0)
            tl.store(dst + d_off, x, mask=m)


_WORD_DTYPE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def gather_triton(layout, block_ids: torch.Tensor, fmt, out: torch.Tensor, err: torch.Tensor, max_ctas: int = 0) -> torch.Tensor:
    """Launch ``_gather_kernel`` for ``fmt.layers`` of ``layout``; ``out`` is uint8, validated.

    ``block_ids`` int32/int64 ``[n]`` on the cache device; ``err`` int32 ``[1]`` on the cache
    device; ``max_ctas`` caps the grid (0 = one program per chunk). Region padding is zeroed.
    """
    n = fmt.num_blocks
    if n == 0 or fmt.num_regions == 0:
        return out
    tab = layout.pointer_table_for(fmt.layers)
    sb, sn, sh = layout.byte_strides
    base_ptr = out.data_ptr()
    wb = word_bytes(layout.row_nbytes, sb, sn, sh, base_ptr, *layout.base_addresses_flat())
    words = out[: fmt.nbytes].view(_WORD_DTYPE[wb])
    rows = layout.block_size * layout.num_heads
    row_words = layout.row_nbytes // wb
    block_r, block_w = tile_shape(rows, row_words)
    num_items = fmt.num_regions * fmt.num_kv * n
    grid = (num_items if max_ctas <= 0 else min(num_items, max_ctas),)
    _gather_kernel[grid](
        tab, block_ids, words, err,
        n, layout.num_blocks, num_items,
        sb // wb, sn // wb, sh // wb,
        fmt.region_nbytes // wb, fmt.entry_nbytes // wb,
        C=fmt.num_kv, H=layout.num_heads, ROWS=rows, ROW_WORDS=row_words,
        WORD=wb, BLOCK_R=block_r, BLOCK_W=block_w, ALIGN16=aligned16(wb, layout, base_ptr), num_warps=NUM_WARPS,
    )
    if fmt.payload_nbytes < fmt.region_nbytes:
        out[: fmt.nbytes].view(fmt.num_regions, fmt.region_nbytes)[:, fmt.payload_nbytes :].zero_()
    return out
