"""LMCache chunk tensors <-> kvkernels' layer-contiguous staging format (no lmcache import here).

An LMCache ``KV_2LTD`` chunk is ``[2, L, T, H*D]`` (K for all layers, then V for all layers); a
``KV_MLA_FMT`` chunk is ``[1, L, T, D]``. Viewed with a block axis of size one it is a paged
cache of one block of ``T`` tokens (``PagedLayout.from_tensor(chunk.view(2, L, 1, T, H, D),
"KLBNHD")``), so the staging buffer of that block is the chunk in layer-contiguous order:
region ``l`` = ``K[l]`` (``T*H*D`` elements) then ``V[l]``, padded to 4096 bytes. One layer of a
stored chunk is then one aligned region of the file and can be read alone.

CUDA chunks go through :func:`kvkernels.gather` / :func:`kvkernels.scatter` (Triton). CPU chunks
(the LMCache allocator is pinned host memory) take one strided ``copy_``: 1.7 ms for a llama3-8b
256-token chunk (32 MiB) against 6.0 ms for the torch reference gather on the CPU host (3 runs,
CPU dev box); both give the same bytes (tests/test_lmcache_plugin.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvkernels._validate import check, describe

__all__ = ["ChunkShape", "chunk_layout", "chunk_to_staging", "staging_to_chunk"]


@dataclass(frozen=True)
class ChunkShape:
    """Shape of one LMCache chunk: ``[num_kv, L, T, H*D]``."""

    num_kv: int  # 2 (KV_2LTD) or 1 (KV_MLA_FMT)
    num_layers: int
    num_tokens: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor, num_heads: int | None = None) -> "ChunkShape":
        check(t.dim() == 4 and t.shape[0] in (1, 2), "chunk", "a [2 or 1, L, T, H*D] tensor", describe(t))
        kv, L, T, HD = t.shape
        H = num_heads if num_heads and HD % num_heads == 0 and kv == 2 else 1
        return cls(int(kv), int(L), int(T), int(H), int(HD // H), t.dtype)

    @property
    def torch_shape(self) -> torch.Size:
        return torch.Size([self.num_kv, self.num_layers, self.num_tokens, self.num_heads * self.head_dim])

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def payload_elems(self) -> int:
        """Elements of one layer: ``num_kv * T * H * D``."""
        return self.num_kv * self.num_tokens * self.num_heads * self.head_dim


def chunk_layout(t: torch.Tensor, shape: ChunkShape):
    """The chunk as a :class:`kvkernels.PagedLayout` of one block of ``T`` tokens."""
    from kvkernels import PagedLayout

    s = shape
    if s.num_kv == 2:
        return PagedLayout.from_tensor(t.view(2, s.num_layers, 1, s.num_tokens, s.num_heads, s.head_dim), "KLBNHD")
    return PagedLayout.from_tensor(t.view(s.num_layers, 1, s.num_tokens, 1, s.head_dim), "LBNHD")


def _region_view(staging: torch.Tensor, shape: ChunkShape, n_layers: int, region_nbytes: int) -> torch.Tensor:
    """``[n_layers, num_kv, T*H*D]`` view of the payload part of each region of ``staging``."""
    payload = shape.payload_elems * shape.element_size
    v = staging[: n_layers * region_nbytes].view(n_layers, region_nbytes)[:, :payload]
    return v.view(shape.dtype).view(n_layers, shape.num_kv, -1)


def chunk_to_staging(t: torch.Tensor, shape: ChunkShape, out: torch.Tensor, fmt) -> torch.Tensor:
    """Write chunk ``t`` ``[num_kv, L, T, H*D]`` into ``out`` (1-D uint8, ``>= fmt.nbytes``)."""
    check(t.shape == shape.torch_shape and t.dtype == shape.dtype, "chunk", f"{tuple(shape.torch_shape)} {shape.dtype}",
          describe(t))
    if t.device.type == "cuda":
        import kvkernels

        return kvkernels.gather(chunk_layout(t, shape), [0], out=out)
    src = t.reshape(shape.num_kv, shape.num_layers, -1).transpose(0, 1)  # [L, kv, T*HD]
    _region_view(out, shape, shape.num_layers, fmt.region_nbytes).copy_(src)
    pad = fmt.region_nbytes - shape.payload_elems * shape.element_size
    if pad:
        out[: fmt.nbytes].view(shape.num_layers, fmt.region_nbytes)[:, fmt.region_nbytes - pad:].zero_()
    return out


def staging_to_chunk(staging: torch.Tensor, shape: ChunkShape, out: torch.Tensor, fmt, layers=None) -> torch.Tensor:
    """Write staging regions back into chunk ``out`` ``[num_kv, L, T, H*D]`` (in place).

    ``layers``: the layers present in ``staging`` (region ``j`` = ``layers[j]``, default all);
    other layers of ``out`` are left untouched.
    """
    check(out.shape[1:] == shape.torch_shape[1:] or layers is not None, "out", f"{tuple(shape.torch_shape)}",
          describe(out))
    layers = list(range(shape.num_layers)) if layers is None else list(layers)
    if out.device.type == "cuda":
        import kvkernels

        kvkernels.scatter(staging, chunk_layout(out, shape), [0], layers=layers if len(layers) < shape.num_layers else None)
        return out
    src = _region_view(staging, shape, len(layers), fmt.region_nbytes)  # [n, kv, T*HD]
    dst = out.view(shape.num_kv, shape.num_layers, -1).transpose(0, 1)  # [L, kv, T*HD]
    if layers == list(range(shape.num_layers)):
        dst.copy_(src)
    else:
        for j, l in enumerate(layers):
            dst[l].copy_(src[j])
    return out
