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

from dataclasses import dataclass, replace

import torch

from kvkernels._validate import check, describe

__all__ = ["ChunkShape", "ORDERS", "chunk_layout", "chunk_to_staging", "staging_to_chunk"]

# How a chunk tensor holds its K/V, layers and tokens (LMCache's MemoryFormat of the object):
#   "LTD"  [num_kv, L, T, H*D]  KV_2LTD (num_kv 2) and KV_MLA_FMT (num_kv 1): whole chunks
#   "T2D"  [T, 2, H*D]          KV_T2D: one layer of layer-wise mode (token-major: K and V interleave)
#   "2TD"  [2, T, H*D]          KV_2TD: one layer, layer-wise mode with blending
#   "TD"   [T, D]               KV_MLA_FMT of layer-wise MLA: one layer
# "2TD" and "TD" are the bytes of "LTD" with L = 1, so they share its in-place I/O; "T2D" is not.
ORDERS = ("LTD", "T2D", "2TD", "TD")


@dataclass(frozen=True)
class ChunkShape:
    """Shape of one LMCache chunk (:data:`ORDERS`): ``[num_kv, L, T, H*D]`` by default."""

    num_kv: int  # 2 (K, V) or 1 (MLA latent)
    num_layers: int
    num_tokens: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    order: str = "LTD"

    @classmethod
    def of(cls, t: torch.Tensor, num_heads: int | None = None, order: str = "LTD") -> "ChunkShape":
        check(order in ORDERS, "order", f"one of {ORDERS}", repr(order))
        if order == "LTD":
            check(t.dim() == 4 and t.shape[0] in (1, 2), "chunk", "a [2 or 1, L, T, H*D] tensor", describe(t))
            kv, L, T, HD = (int(x) for x in t.shape)
        elif order == "TD":
            check(t.dim() == 2, "chunk", "a [T, D] tensor (layer-wise MLA)", describe(t))
            kv, L, (T, HD) = 1, 1, (int(x) for x in t.shape)
        else:
            two = (t.dim() == 3) and t.shape[1 if order == "T2D" else 0] == 2
            check(two, "chunk", "a [T, 2, H*D] tensor" if order == "T2D" else "a [2, T, H*D] tensor", describe(t))
            kv, L = 2, 1
            T, HD = (int(t.shape[0]), int(t.shape[2])) if order == "T2D" else (int(t.shape[1]), int(t.shape[2]))
        H = num_heads if num_heads and HD % num_heads == 0 and kv == 2 else 1
        return cls(kv, L, T, int(H), int(HD // H), t.dtype, order)

    def with_order(self, order: str) -> "ChunkShape":
        """The same entry presented as an object of another order (a layer-wise object of one
        layer); ``ValueError`` when its layers or K/V entries do not fit that order."""
        check(order in ORDERS, "order", f"one of {ORDERS}", repr(order))
        if order != "LTD":
            check(self.num_layers == 1, "order", f"a one-layer entry for {order!r}", f"{self.num_layers} layers")
            check(self.num_kv == (1 if order == "TD" else 2), "order", f"an entry fitting {order!r}",
                  f"num_kv={self.num_kv}")
        return replace(self, order=order)

    @property
    def torch_shape(self) -> torch.Size:
        hd = self.num_heads * self.head_dim
        return torch.Size({"LTD": [self.num_kv, self.num_layers, self.num_tokens, hd],
                           "T2D": [self.num_tokens, 2, hd], "2TD": [2, self.num_tokens, hd],
                           "TD": [self.num_tokens, hd]}[self.order])

    @property
    def contiguous_layers(self) -> bool:
        """True when each layer's K and V are contiguous in the tensor (all orders but "T2D")."""
        return self.order != "T2D"

    def kv_view(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as ``[L, num_kv, T, H*D]`` (a view, strided for "T2D")."""
        hd = self.num_heads * self.head_dim
        if self.order == "T2D":
            return t.view(self.num_tokens, 2, hd).permute(1, 0, 2).unsqueeze(0)
        return t.view(self.num_kv, self.num_layers, self.num_tokens, hd).transpose(0, 1)

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def payload_elems(self) -> int:
        """Elements of one layer: ``num_kv * T * H * D``."""
        return self.num_kv * self.num_tokens * self.num_heads * self.head_dim


def chunk_layout(t: torch.Tensor, shape: ChunkShape):
    """The chunk as a :class:`kvkernels.PagedLayout` of one block of ``T`` tokens."""
    from kvkernels import PagedLayout

    s = shape
    if s.order == "T2D":  # token-major: K and V of a token side by side
        return PagedLayout.from_tensor(t.view(1, 1, s.num_tokens, 2, s.num_heads, s.head_dim), "LBNKHD")
    if s.num_kv == 2:
        return PagedLayout.from_tensor(t.view(2, s.num_layers, 1, s.num_tokens, s.num_heads, s.head_dim), "KLBNHD")
    return PagedLayout.from_tensor(t.view(s.num_layers, 1, s.num_tokens, 1, s.head_dim), "LBNHD")


def _region_view(staging: torch.Tensor, shape: ChunkShape, n_layers: int, region_nbytes: int) -> torch.Tensor:
    """``[n_layers, num_kv, T, H*D]`` view of the payload part of each region of ``staging``."""
    payload = shape.payload_elems * shape.element_size
    v = staging[: n_layers * region_nbytes].view(n_layers, region_nbytes)[:, :payload]
    return v.view(shape.dtype).view(n_layers, shape.num_kv, shape.num_tokens, -1)


def chunk_to_staging(t: torch.Tensor, shape: ChunkShape, out: torch.Tensor, fmt) -> torch.Tensor:
    """Write chunk ``t`` ``[num_kv, L, T, H*D]`` into ``out`` (1-D uint8, ``>= fmt.nbytes``)."""
    check(t.shape == shape.torch_shape and t.dtype == shape.dtype, "chunk", f"{tuple(shape.torch_shape)} {shape.dtype}",
          describe(t))
    if t.device.type == "cuda":
        import kvkernels

        return kvkernels.gather(chunk_layout(t, shape), [0], out=out)
    _region_view(out, shape, shape.num_layers, fmt.region_nbytes).copy_(shape.kv_view(t))
    pad = fmt.region_nbytes - shape.payload_elems * shape.element_size
    if pad:
        out[: fmt.nbytes].view(shape.num_layers, fmt.region_nbytes)[:, fmt.region_nbytes - pad:].zero_()
    return out


def staging_to_chunk(staging: torch.Tensor, shape: ChunkShape, out: torch.Tensor, fmt, layers=None) -> torch.Tensor:
    """Write staging regions back into chunk ``out`` ``[num_kv, L, T, H*D]`` (in place).

    ``layers``: the layers present in ``staging`` (region ``j`` = ``layers[j]``, default all);
    other layers of ``out`` are left untouched.
    """
    check(out.shape == shape.torch_shape, "out", f"{tuple(shape.torch_shape)}", describe(out))
    layers = list(range(shape.num_layers)) if layers is None else list(layers)
    if out.device.type == "cuda":
        import kvkernels

        kvkernels.scatter(staging, chunk_layout(out, shape), [0], layers=layers if len(layers) < shape.num_layers else None)
        return out
    src = _region_view(staging, shape, len(layers), fmt.region_nbytes)  # [n, kv, T, HD]
    dst = shape.kv_view(out)  # [L, kv, T, HD]
    if layers == list(range(shape.num_layers)):
        dst.copy_(src)
    else:
        for j, l in enumerate(layers):
            dst[l].copy_(src[j])
    return out
