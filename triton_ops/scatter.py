"""Fused paged scatter: one layer-contiguous staging buffer -> many (layer, K/V, block) chunks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._paged import _paged_copy, launch


@triton.jit
def _scatter_kernel(
    ptr_tab, block_ids, stage_ptr, err_ptr,  # int64 [R, C]; int32/int64 [n]; word [staging]; int32 [1]
    n, num_blocks, num_items, stride_b, stride_n, stride_h, region_words, entry_words,
    C: tl.constexpr, H: tl.constexpr, ROWS: tl.constexpr, ROW_WORDS: tl.constexpr, WORD: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, ALIGN16: tl.constexpr,
):
    # grid: (min(num_items, max_ctas),); arguments as documented on _paged_copy
    _paged_copy(ptr_tab, block_ids, stage_ptr, err_ptr, n, num_blocks, num_items, stride_b, stride_n, stride_h,
                region_words, entry_words, C, H, ROWS, ROW_WORDS, WORD, BLOCK_R, BLOCK_W, ALIGN16, False)


def scatter_triton(staging: torch.Tensor, layout, block_ids: torch.Tensor, fmt, err: torch.Tensor, max_ctas: int = 0) -> None:
    """Write ``staging`` (uint8, validated by the caller) into ``block_ids`` of the cache, in
    place. ``block_ids`` int32/int64 ``[n]`` and ``err`` int32 ``[1]`` on the cache device;
    ``max_ctas`` caps the grid. Ids must be distinct (two slots writing one block race)."""
    launch(_scatter_kernel, layout, block_ids, fmt, staging, err, max_ctas)
