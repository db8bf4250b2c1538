"""Shared body and launcher of the paged copy kernels (gather, scatter).

Work decomposition (both directions): a *work item* is one (region j, entry c, staging slot i),
i.e. one block of one layer's K or V: ``block_size * H`` rows of ``head_dim * e`` bytes. Items are
numbered ``w = (j * C + c) * n + i`` so that neighbouring programs touch neighbouring staging bytes.
The grid is ``min(num_items, max_ctas)`` programs (``max_ctas = 0``: one program per item) that
stride over the items (persistent grid), which is how the SM cap works.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Words per program tile. 2048 x 8-byte words = 16 KiB in flight per program with 4 warps:
# 32 bytes per thread per load, two 16-byte vectors. Chosen to cover one 32 KB Llama-3-8B chunk in
# 2 iterations; NOT yet measured on a GPU (docs/PERF_NOTES.md, "open questions").
TILE_WORDS = 2048
NUM_WARPS = 4

_WORD_DTYPE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit
def _item_coords(w, n, C: tl.constexpr):
    """Work item ``w`` -> (region j, entry c, staging slot i), all int64."""
    jc = w // n
    i = w - jc * n
    j = jc // C
    c = jc - j * C
    return j, c, i


@triton.jit
def _slot(w32, block_ids, err_ptr, n, num_blocks, C: tl.constexpr):
    """Work item ``w32`` -> ``(j, c, i, bid, valid)``: region, entry, staging slot, the slot's block
    id (int64) and whether it names a cache block. An invalid id other than -1 (padding) is counted
    in ``err_ptr`` once per slot: by the first ``n`` items (region 0, entry 0)."""
    w = tl.cast(w32, tl.int64)
    j, c, i = _item_coords(w, n, C)
    bid = tl.load(block_ids + i).to(tl.int64)
    valid = (bid >= 0) & (bid < num_blocks)
    tl.atomic_add(err_ptr, 1, mask=(((bid != -1) & (bid < 0)) | (bid >= num_blocks)) & (w < n))
    return j, c, i, bid, valid


@triton.jit
def _block_ptr(ptr_tab, j, c, bid, valid, stride_b, EBYTES: tl.constexpr, C: tl.constexpr, ALIGN16: tl.constexpr):
    """Pointer to block ``bid`` of (requested layer j, entry c) with ``EBYTES``-byte elements
    (``stride_b`` in elements); block 0 for an invalid id, so no address leaves the cache."""
    addr = tl.load(ptr_tab + j * C + c)
    if EBYTES == 8:
        base = addr.to(tl.pointer_type(tl.int64))
    elif EBYTES == 4:
        base = addr.to(tl.pointer_type(tl.int32))
    elif EBYTES == 2:
        base = addr.to(tl.pointer_type(tl.int16))
    else:
        base = addr.to(tl.pointer_type(tl.uint8))
    if ALIGN16:  # the hint must sit on the pointer (checked in PTX: 16-byte vector accesses)
        base = tl.multiple_of(base, 16)
    return base + tl.where(valid, bid, 0) * stride_b


@triton.jit
def _cache_rows(rows, stride_n, stride_h, H: tl.constexpr, EV: tl.constexpr, ALIGN16: tl.constexpr):
    """(token, head) rows ``t * H + h`` -> (offset of each row's first element in the block, ``h``);
    with ALIGN16 the offsets are hinted multiples of ``EV`` elements (16 bytes)."""
    t = rows // H
    h = rows - t * H
    off = t.to(tl.int64) * stride_n + h.to(tl.int64) * stride_h
    if ALIGN16:
        off = tl.multiple_of(off, EV)
    return off, h


@triton.jit
def _staging_rows(rows, ROW: tl.constexpr, ALIGN16: tl.constexpr):
    """Rows -> int64 offsets ``rows * ROW`` in a staging entry (hinted 16-aligned with ALIGN16)."""
    off = rows.to(tl.int64) * ROW
    if ALIGN16:
        off = tl.multiple_of(off, 16)
    return off


@triton.jit
def _paged_copy(
    ptr_tab,  # int64 [R, C]: byte address of block 0 of (requested layer j, entry c)
    block_ids,  # int32/int64 [n]: cache block of staging slot i (outside [0, num_blocks) = padding)
    stage_ptr,  # word [>= R * region_words]: staging buffer (written by gather, read by scatter)
    err_ptr,  # int32 [1]: += 1 per invalid id other than -1 (deferred validation)
    n, num_blocks, num_items,  # staging slots, cache blocks, R * C * n
    stride_b, stride_n, stride_h,  # cache strides in words: block, token, head (int64)
    region_words, entry_words,  # staging: words per region, words per entry (K or V)
    C: tl.constexpr,  # entries per layer (2 = K, V; 1 = MLA)
    H: tl.constexpr,  # kv heads
    ROWS: tl.constexpr,  # block_size * H
    ROW_WORDS: tl.constexpr,  # head_dim * e / WORD
    WORD: tl.constexpr,  # bytes per word (8, 4, 2, 1)
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ALIGN16: tl.constexpr,  # host checked: every base address, stride and row is 16-byte aligned
    TO_STAGING: tl.constexpr,  # True: cache -> staging (gather); False: staging -> cache (scatter)
):
    # grid: (min(num_items, max_ctas),); each program strides over the work items
    r_ar = tl.arange(0, BLOCK_R)
    w_ar = tl.arange(0, BLOCK_W)
    col_ok = w_ar < ROW_WORDS
    for w32 in tl.range(tl.program_id(0), num_items, tl.num_programs(0)):
        j, c, i, bid, valid = _slot(w32, block_ids, err_ptr, n, num_blocks, C)
        row_lim = tl.where(valid, ROWS, 0)  # invalid id: no cache row is touched
        cache = _block_ptr(ptr_tab, j, c, bid, valid, stride_b, WORD, C, ALIGN16)
        stage = stage_ptr + j * region_words + c * entry_words + i * (ROWS * ROW_WORDS)
        for r0 in tl.range(0, ROWS, BLOCK_R):
            rows = r0 + r_ar
            c_row, _h = _cache_rows(rows, stride_n, stride_h, H, 16 // WORD, ALIGN16)
            c_off = c_row[:, None] + w_ar[None, :]
            s_off = (rows.to(tl.int64) * ROW_WORDS)[:, None] + w_ar[None, :]
            m = (rows < ROWS)[:, None] & col_ok[None, :]
            mv = (rows < row_lim)[:, None] & col_ok[None, :]
            if TO_STAGING:  # padding / invalid ids write a zero block
                tl.store(stage + s_off, tl.load(cache + c_off, mask=mv, other=0), mask=m)
            else:  # padding / invalid ids are skipped
                tl.store(cache + c_off, tl.load(stage + s_off, mask=mv), mask=mv)


def tile_shape(rows: int, row_words: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_W): a power-of-two tile covering a row, ~TILE_WORDS words."""
    block_w = triton.next_power_of_2(row_words)
    block_r = max(1, min(triton.next_power_of_2(rows), TILE_WORDS // block_w))
    return block_r, block_w


def aligned16(word: int, layout, staging_ptr: int) -> bool:
    """True when 16-byte vector accesses are legal on both sides: 8-byte words, every base
    address, byte stride and row 16-aligned (the staging regions are 4096-aligned)."""
    return word == 8 and layout.access_width(staging_ptr) == 16


def persistent_grid(count: int, max_ctas: int) -> tuple[int]:
    """``(min(count, max_ctas),)`` (``max_ctas = 0``: ``count``), capped so that the kernels'
    ``tl.range(program_id, count, num_programs)`` never steps past 2^31 - 1: Triton types a
    ``count`` below 2^31 as i32, and a last ``w + num_programs`` beyond it wrapped negative and
    passed ``w < count`` (negative work items: ids and table read before their arrays, staging
    written before its buffer)."""
    grid = min(count if max_ctas <= 0 else min(count, max_ctas), 2**31 - 1)  # CUDA's grid x limit
    if count < 2**31:  # i32 loop bound: the last w + num_programs must stay <= 2^31 - 1
        grid = min(grid, 2**31 - count)
    return (max(grid, 1),)


def geometry(layout, fmt, max_ctas: int, elem_bytes: int):
    """Common launch arguments: ``(pointer table, (block, token, head) strides in elem_bytes
    units, num_items, grid)`` for ``fmt.layers`` of ``layout``."""
    tab = layout.pointer_table_for(fmt.layers)
    strides = tuple(s // elem_bytes for s in layout.byte_strides)
    num_items = fmt.num_regions * fmt.num_kv * fmt.num_blocks
    return tab, strides, num_items, persistent_grid(num_items, max_ctas)


def _launch_plan(kernel, layout, fmt, ptr: int, storage_offset: int, max_ctas: int):
    """Everything :func:`launch` passes besides the ids, the staging words and the error counter:
    a pure function of the layout, the format, the staging address and the cap, so it is kept per
    layout (on every layer's path of the pipeline; keyed by values, never by a tensor)."""
    key = (kernel, fmt, ptr, storage_offset, max_ctas)
    plan = layout.memo_get("triton_launch", key)
    if plan is None:
        # the kernels' word: 8, 4, 2 or 1 bytes; the staging's storage offset too (viewing it as words needs it)
        wb = layout.access_width(ptr, storage_offset, cap=8)
        tab, (sb, sn, sh), num_items, grid = geometry(layout, fmt, max_ctas, wb)
        rows = layout.block_size * layout.num_heads
        row_words = layout.row_nbytes // wb
        block_r, block_w = tile_shape(rows, row_words)
        scalars = (fmt.num_blocks, layout.num_blocks, num_items, sb, sn, sh,
                   fmt.region_nbytes // wb, fmt.entry_nbytes // wb)
        consts = dict(C=fmt.num_kv, H=layout.num_heads, ROWS=rows, ROW_WORDS=row_words, WORD=wb, BLOCK_R=block_r,
                      BLOCK_W=block_w, ALIGN16=aligned16(wb, layout, ptr), num_warps=NUM_WARPS)
        plan = layout.memo_put("triton_launch", key, (_WORD_DTYPE[wb], tab, grid, scalars, consts))
    return plan


def launch(kernel, layout, block_ids: torch.Tensor, fmt, staging: torch.Tensor, err: torch.Tensor, max_ctas: int) -> None:
    """Launch a paged copy ``kernel`` (same signature as :func:`_paged_copy` minus TO_STAGING)
    over ``fmt.layers`` of ``layout`` on the current stream."""
    if fmt.num_blocks == 0 or fmt.num_regions == 0:
        return
    word, tab, grid, scalars, consts = _launch_plan(kernel, layout, fmt, staging.data_ptr(), int(staging.storage_offset()),
                                                    max_ctas)
    kernel[grid](tab, block_ids, staging[: fmt.nbytes].view(word), err, *scalars, **consts)
