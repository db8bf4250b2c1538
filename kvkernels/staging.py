"""The layer-contiguous staging format (exact definition in ``docs/layouts.md``).

For ``n`` blocks of ``block_size`` tokens, ``H`` KV heads, head dim ``D`` and element size ``e``,
the staging buffer is a 1-D ``uint8`` buffer of ``len(layers)`` *regions* in ascending layer
order. Region ``j`` (the ``j``-th requested layer) starts at ``j * region_nbytes`` and holds K then
V, each ``[n, block_size, H, D]`` in canonical NHD order whatever the source layout (block ``i`` of
the staging is ``block_ids[i]`` of the cache); MLA holds the single entry ``[n, block_size, D]``.
``region_nbytes`` is the payload rounded up to a multiple of :data:`REGION_ALIGN` (4096) bytes,
and the padding is zero, so any layer can be read or written alone with O_DIRECT / GPUDirect
Storage alignment.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass

import torch

from ._validate import check, check_int, fail
from .layout import PagedLayout

__all__ = ["REGION_ALIGN", "RegionArithmetic", "StagingFormat", "staging_nbytes", "normalize_layers"]

REGION_ALIGN = 4096


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def normalize_layers(layers, num_layers: int, staged: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """``None`` -> all layers; an int -> one layer; an iterable -> sorted, distinct, in range.
    ``staged``: the layers a buffer holds; each one asked for must be among them (``None`` ->
    all of them)."""
    if staged is not None and layers is None:
        return tuple(staged)
    if layers is None:
        return tuple(range(num_layers))
    if isinstance(layers, torch.Tensor):
        fail("layers", "None, an int or a sequence of ints (host values)", "a Tensor", TypeError)
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = (layers,)
    try:
        seq = list(layers)
    except TypeError:
        fail("layers", "None, an int or a sequence of ints", type(layers).__name__, TypeError)
    check(len(seq) > 0, "layers", "at least one layer", "an empty sequence")
    for x in seq:
        if isinstance(x, bool) or not isinstance(x, int):
            fail("layers", "ints", f"an element of type {type(x).__name__}", TypeError)
        if staged is not None:
            check(x in staged, "layers", f"layers among the staged ones {tuple(staged)}", x)
        else:
            check(0 <= x < num_layers, "layers", f"layer indices in [0, {num_layers})", x)
    check(len(set(seq)) == len(seq), "layers", "distinct layer indices", seq)
    return tuple(sorted(seq))


class RegionArithmetic:
    """Region sizes and offsets shared by every staging format (raw, FP8, ...).

    A format defines ``layers`` (ascending) and ``payload_nbytes`` (meaningful bytes of one
    region); regions are that payload rounded up to :data:`REGION_ALIGN`, back to back.
    """

    layers: tuple[int, ...]

    @property
    def payload_nbytes(self) -> int:  # pragma: no cover - defined by each format
        raise NotImplementedError

    @functools.cached_property
    def region_nbytes(self) -> int:
        """Region size, the payload rounded up to a multiple of 4096."""
        return _round_up(self.payload_nbytes, REGION_ALIGN)

    @property
    def num_regions(self) -> int:
        return len(self.layers)

    @functools.cached_property
    def nbytes(self) -> int:
        """Total bytes of the staging buffer."""
        return self.num_regions * self.region_nbytes

    def region_index(self, layer: int) -> int:
        """Position ``j`` of ``layer`` in this buffer (``ValueError`` if absent)."""
        try:
            return self.layers.index(layer)
        except ValueError:
            fail("layer", f"one of the staged layers {self.layers}", layer)

    def region_offset(self, layer: int) -> int:
        """Byte offset of ``layer``'s region."""
        return self.region_index(layer) * self.region_nbytes

    def regions(self) -> list[tuple[int, int, int]]:
        """``[(layer, offset, payload_nbytes)]`` for every region."""
        return [(l, j * self.region_nbytes, self.payload_nbytes) for j, l in enumerate(self.layers)]


@dataclass(frozen=True)
class StagingFormat(RegionArithmetic):
    """Offsets and sizes of the regions of one staging buffer.

    Parameters
    ----------
    layers : tuple of int
        The layers present, ascending. Region ``j`` holds layer ``layers[j]``.
    num_blocks : int
        ``n``, blocks per region.
    block_size, num_heads, head_dim, element_size : int
        Shape of one block and bytes per element of the cache dtype.
    num_kv : int
        2 (K then V) or 1 (MLA).
    """

    layers: tuple[int, ...]
    num_blocks: int
    block_size: int
    num_heads: int
    head_dim: int
    element_size: int
    num_kv: int = 2

    @classmethod
    def for_layout(cls, layout, num_blocks: int, layers=None) -> "StagingFormat":
        """The format :func:`kvkernels.gather` writes for ``num_blocks`` blocks of ``layout``."""
        # on every copy's path: formats are immutable, so the common argument types are looked up
        # in a small per-layout cache (exact ints only: True must still be refused as a count)
        key = None
        if hasattr(layout, "memo_get") and type(num_blocks) is int and num_blocks >= 0 and (
                layers is None or type(layers) is int or (type(layers) is tuple and all(type(x) is int for x in layers))):
            key = (cls, num_blocks, layers)
            got = layout.memo_get("formats", key)
            if got is not None:
                return got
        if not isinstance(layout, PagedLayout):
            fail("layout", "a kvkernels.PagedLayout", type(layout).__name__, TypeError)
        check_int(num_blocks, "num_blocks", lo=0)
        fmt = cls(
            layers=normalize_layers(layers, layout.num_layers),
            num_blocks=num_blocks,
            block_size=layout.block_size,
            num_heads=layout.num_heads,
            head_dim=layout.head_dim,
            element_size=layout.element_size,
            num_kv=layout.num_kv,
        )
        if key is not None:
            layout.memo_put("formats", key, fmt, bound=1024)
        return fmt

    @functools.cached_property
    def chunk_nbytes(self) -> int:
        """One block of one entry of one layer: ``block_size * H * D * e``."""
        return self.block_size * self.num_heads * self.head_dim * self.element_size

    @functools.cached_property
    def entry_nbytes(self) -> int:
        """One entry (K or V) of one region: ``n * chunk_nbytes``."""
        return self.num_blocks * self.chunk_nbytes

    @functools.cached_property
    def payload_nbytes(self) -> int:
        """Meaningful bytes of one region: ``num_kv * entry_nbytes``."""
        return self.num_kv * self.entry_nbytes

    def entry_offset(self, layer: int, kv: int) -> int:
        """Byte offset of entry ``kv`` (0 = K, 1 = V) of ``layer``."""
        check(0 <= kv < self.num_kv, "kv", f"an entry index in [0, {self.num_kv})", kv)
        return self.region_offset(layer) + kv * self.entry_nbytes

    def with_layers(self, layers) -> "StagingFormat":
        """The same format restricted to a subset of its layers."""
        sel = normalize_layers(layers, max(self.layers, default=-1) + 1, staged=self.layers)
        return StagingFormat(sel, self.num_blocks, self.block_size, self.num_heads, self.head_dim, self.element_size, self.num_kv)


def staging_nbytes(layout, num_blocks: int, layers=None) -> int:
    """Bytes :func:`kvkernels.gather` needs for ``num_blocks`` blocks of ``layers`` of ``layout``."""
    return StagingFormat.for_layout(layout, num_blocks, layers).nbytes
