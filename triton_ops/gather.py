"""Fused paged gather: many (layer, K/V, block) chunks -> one layer-contiguous staging buffer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._paged import _WORD_DTYPE, _paged_copy, launch  # noqa: F401  (_WORD_DTYPE re-exported)


@triton.jit
def _gather_kernel(
    ptr_tab, block_ids, out_ptr, err_ptr,  # int64 [R, C]; int32/int64 [n]; word [staging]; int32 [1]
    n, num_blocks, num_items, stride_b, stride_n, stride_h, region_words, entry_words,
    C: tl.constexpr, H: tl.constexpr, ROWS: tl.constexpr, ROW_WORDS: tl.constexpr, WORD: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, ALIGN16: tl.constexpr,
):
    # grid: (min(num_items, max_ctas),); arguments as documented on _paged_copy
    _paged_copy(ptr_tab, block_ids, out_ptr, err_ptr, n, num_blocks, num_items, stride_b, stride_n, stride_h,
                region_words, entry_words, C, H, ROWS, ROW_WORDS, WORD, BLOCK_R, BLOCK_W, ALIGN16, True)


def gather_triton(layout, block_ids: torch.Tensor, fmt, out: torch.Tensor, err: torch.Tensor, max_ctas: int = 0) -> torch.Tensor:
    """Pack ``fmt.layers`` of ``layout`` into ``out`` (uint8, validated by the caller).

    ``block_ids`` int32/int64 ``[n]`` on the cache device; ``err`` int32 ``[1]`` on the cache
    device; ``max_ctas`` caps the grid (0 = one program per chunk). Region padding is zeroed.
    """
    launch(_gather_kernel, layout, block_ids, fmt, out, err, max_ctas)
    if fmt.num_blocks and fmt.payload_nbytes < fmt.region_nbytes:
        out[: fmt.nbytes].view(fmt.num_regions, fmt.region_nbytes)[:, fmt.payload_nbytes :].zero_()
    return out
