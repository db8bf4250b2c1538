"""Launch-side helpers shared by the paged copy kernels (gather, scatter) and one device helper.

Work decomposition (both directions): a *work item* is one (region j, entry c, staging slot i),
i.e. one block of one layer's K or V: ``block_size * H`` rows of ``head_dim * e`` bytes. Items are
numbered ``w = (j * C + c) * n + i`` so that neighbouring programs touch neighbouring staging bytes.
The grid is ``min(num_items, max_ctas)`` programs (``max_ctas = 0``: one program per item) that
stride over the items (persistent grid), which is how the SM cap works.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Words per program tile. 2048 x 8-byte words = 16 KiB in flight per program with 4 warps:
# 32 bytes per thread per load, two 16-byte vectors. Chosen to cover one 32 KB Llama-3-8B chunk in
# 2 iterations; to be re-tuned on the GPU (docs/PERF_NOTES.md, "gather v1").
TILE_WORDS = 2048
NUM_WARPS = 4


@triton.jit
def _item_coords(w, n, C: tl.constexpr):
    """Work item ``w`` -> (region j, entry c, staging slot i), all int64."""
    jc = w // n
    i = w - jc * n
    j = jc // C
    c = jc - j * C
    return j, c, i


def word_bytes(*values: int) -> int:
    """Largest word (8, 4, 2, 1 bytes) dividing every byte count / address in ``values``."""
    for w in (8, 4, 2):
        if all(v % w == 0 for v in values):
            return w
    return 1


def tile_shape(rows: int, row_words: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_W): a power-of-two tile covering a row, ~TILE_WORDS words."""
    block_w = triton.next_power_of_2(row_words)
    block_r = max(1, min(triton.next_power_of_2(rows), TILE_WORDS // block_w))
    return block_r, block_w


def aligned16(word: int, layout, staging_ptr: int) -> bool:
    """True when 16-byte vector accesses are legal on both sides: 8-byte words, every base
    address, byte stride and row 16-aligned (the staging regions are 4096-aligned)."""
    sb, sn, sh = layout.byte_strides
    vals = (layout.row_nbytes, sb, sn, sh, staging_ptr, *layout.base_addresses_flat())
    return word == 8 and all(v % 16 == 0 for v in vals)
