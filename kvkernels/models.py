"""Registry of real model KV shapes and a factory of paged caches in every supported layout.

Used by the demo, the benchmarks and the tests, so that all three talk about the same shapes.
Shapes are per tensor-parallel rank (``llama3-70b-tp8`` holds 1 of 8 KV heads).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ._validate import check, check_index, fail
from .layout import PagedLayout

__all__ = ["ModelShape", "MODELS", "get_model", "LAYOUTS", "make_cache", "random_fill_"]


def _count(v, name: str) -> int:
    """A size >= 1 for these helpers: an int or anything integer-like (numpy ints), not a bool."""
    return check_index(v, name, lo=1)


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    mla: bool = False

    def scaled(self, *, num_layers: int | None = None, num_kv_heads: int | None = None) -> "ModelShape":
        """A smaller copy (CPU demo / tests keep head_dim, cut layers and heads)."""
        num_layers = None if num_layers is None else _count(num_layers, "num_layers")
        num_kv_heads = None if num_kv_heads is None else _count(num_kv_heads, "num_kv_heads")
        return replace(
            self,
            num_layers=self.num_layers if num_layers is None else num_layers,
            num_kv_heads=(self.num_kv_heads if num_kv_heads is None else num_kv_heads) if not self.mla else 1,
        )

    def chunk_nbytes(self, block_size: int, element_size: int = 2) -> int:
        """Bytes of one block of one layer's K (or V, or MLA latent)."""
        return block_size * self.num_kv_heads * self.head_dim * element_size


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama3-8b", 32, 8, 128),
        ModelShape("llama3-70b-tp8", 80, 1, 128),
        ModelShape("qwen3-32b", 64, 8, 128),
        ModelShape("deepseek-v3-mla", 61, 1, 576, mla=True),
        ModelShape("smollm2-135m", 30, 3, 64),
    )
}


def get_model(name: str) -> ModelShape:
    if name not in MODELS:
        fail("model", f"one of {sorted(MODELS)}", repr(name))
    return MODELS[name]


# layout name -> (description). Every one is built by make_cache below.
LAYOUTS = {
    "vllm-nhd": "vLLM FlashAttention, per layer [2, B, N, H, D]",
    "vllm-hnd": "vLLM FlashAttention HND, per layer [2, B, H, N, D]",
    "flashinfer-nhd": "FlashInfer, per layer [B, 2, N, H, D]",
    "flashinfer-hnd": "FlashInfer HND, per layer [B, 2, H, N, D]",
    "cross-layer": "block-major, one tensor [B, L, 2, N, H, D]",
    "cross-layer-hnd": "block-major, one tensor [B, L, 2, H, N, D] (TensorRT-LLM's order; vLLM's HND: VLLM_CROSS_LAYER_ORDERS)",
    "vllm-packed": "K|V packed, per layer [B, H, N, 2D] (physical LBHNC)",
    "vllm-packed-lbnhc": "K|V packed, one tensor physical [L, B, N, H, 2D]",
    "vllm-packed-blhnc": "K|V packed, one tensor physical [B, L, H, N, 2D]",
    "vllm-packed-bhlnc": "K|V packed, one tensor physical [B, H, L, N, 2D]",
    "sglang": "SGLang token pools, per layer K and V [B*N, H, D]",
    "mla": "MLA latent, per layer [B, N, D]",
    "mla-cross-layer": "MLA block-major, one tensor [B, L, N, D]",
}


def random_fill_(t: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill a *contiguous* tensor with random bytes (every bit pattern, NaNs included)."""
    b = t.view(torch.uint8) if t.element_size() == 1 else t.view(-1).view(torch.uint8)
    if t.device.type == "cuda" and b.numel() > _HOST_FILL_MAX:
        # benchmark-sized caches (GBs): drawn on the device, seeded from the host generator, in
        # place (a host draw of 18 GB takes minutes); small tensors keep the host draw, whose bytes
        # are the same on every device
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        g = torch.Generator(device=t.device).manual_seed(seed)
        for piece in b.split(_HOST_FILL_MAX):
            piece.random_(0, 256, generator=g)
        return t
    src = torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=generator)
    b.copy_(src.to(t.device))
    return t


_HOST_FILL_MAX = 1 << 24  # bytes: above this (per tensor; a llama3-8b layer of 4096 blocks is 256 MiB) the draw is on the device


def _alloc(shape, dtype, device, fill, gen):
    t = torch.empty(shape, dtype=dtype, device=device)
    if fill == "random":
        random_fill_(t, gen)
    elif fill == "zero":
        t.view(torch.uint8).zero_() if t.element_size() == 1 else t.view(-1).view(torch.uint8).zero_()
    elif fill != "empty":
        fail("fill", "'random', 'zero' or 'empty'", repr(fill))
    return t


def make_cache(
    layout: str,
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    device="cpu",
    fill: str = "random",
    seed: int = 0,
) -> PagedLayout:
    """Allocate a paged cache in ``layout`` (a key of :data:`LAYOUTS`) and describe it.

    ``fill``: ``"random"`` bytes, ``"zero"``, or ``"empty"`` (uninitialised). MLA layouts ignore
    ``num_heads`` (one latent entry per token).
    """
    check(isinstance(layout, str) and layout in LAYOUTS, "layout", f"one of {sorted(LAYOUTS)}", repr(layout))
    if layout.startswith("mla"):
        num_heads = 1  # ignored (None accepted)
    L, B, N, H, D = (_count(v, nm) for v, nm in ((num_layers, "num_layers"), (num_blocks, "num_blocks"),
                                                  (block_size, "block_size"), (num_heads, "num_heads"),
                                                  (head_dim, "head_dim")))
    gen = torch.Generator().manual_seed(seed)
    a = lambda shape: _alloc(shape, dtype, device, fill, gen)  # noqa: E731
    if layout == "vllm-nhd":
        return PagedLayout.from_vllm([a((2, B, N, H, D)) for _ in range(L)], "NHD")
    if layout == "vllm-hnd":
        return PagedLayout.from_vllm([a((2, B, H, N, D)) for _ in range(L)], "HND")
    if layout == "flashinfer-nhd":
        return PagedLayout.from_flashinfer([a((B, 2, N, H, D)) for _ in range(L)], "NHD")
    if layout == "flashinfer-hnd":
        return PagedLayout.from_flashinfer([a((B, 2, H, N, D)) for _ in range(L)], "HND")
    if layout == "cross-layer":
        return PagedLayout.from_cross_layer(a((B, L, 2, N, H, D)))
    if layout == "cross-layer-hnd":
        return PagedLayout.from_cross_layer(a((B, L, 2, H, N, D)), order="BLKHND")
    if layout == "vllm-packed":
        # logical [B, H, N, 2D], physical LBHNC: contiguous per layer
        return PagedLayout.from_vllm_packed([a((B, H, N, 2 * D)) for _ in range(L)])
    if layout.startswith("vllm-packed-"):
        order = layout.rsplit("-", 1)[1].upper()
        dims = {"L": L, "B": B, "N": N, "H": H, "C": 2 * D}
        return PagedLayout.from_vllm_packed(a(tuple(dims[x] for x in order)), order=order)
    if layout == "sglang":
        return PagedLayout.from_sglang([a((B * N, H, D)) for _ in range(L)], [a((B * N, H, D)) for _ in range(L)], N)
    if layout == "mla":
        return PagedLayout.from_mla([a((B, N, D)) for _ in range(L)])
    if layout == "mla-cross-layer":
        return PagedLayout.from_cross_layer(a((B, L, N, D)), order="BLND")
    fail("layout", f"one of {sorted(LAYOUTS)}", repr(layout))


def is_mla(layout: str) -> bool:
    check(layout in LAYOUTS, "layout", f"one of {sorted(LAYOUTS)}", repr(layout))
    return layout.startswith("mla")
