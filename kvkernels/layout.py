"""Describe any paged KV cache from its tensors and strides, without copying.

A :class:`PagedLayout` holds, for every layer ``l`` and every entry ``c`` (``c = 0`` key,
``c = 1`` value; MLA caches have a single entry), a strided *view* of the user's memory with the
canonical index order ``[num_blocks, block_size, num_heads, head_dim]``. Whatever the physical
order of the source (NHD, HND, block-major cross-layer, K|V packed in the last dim, SGLang token
pools), only the strides differ. The kernels read base addresses and byte strides off these views;
the reference reads the views directly. All layers must share one shape, dtype, device and set of
strides (that is what every server allocates); their base addresses are free.

Dimension letters used by the ``order`` strings of :meth:`PagedLayout.from_tensor`:

===  ==========================================================
L    layer
B    block (page) index
K    key/value pair axis (size 2: 0 = K, 1 = V)
N    token position inside a block (``block_size``)
H    KV head
D    head dim (must be the innermost, stride 1)
C    K and V packed in the last dim (``2 * head_dim``), same as ``KD``
===  ==========================================================

See ``docs/layouts.md`` for every preset with its shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from ._validate import check, check_int, check_memory, check_tensor, describe, fail, same_device

__all__ = ["PagedLayout"]

_LETTERS = "LKBNHD"  # canonical order: layer, K|V, block, token, head, dim

# vLLM's packed (2026 layout refactor) physical orders: L = layer, B = block, N = token in block,
# H = head, C = 2*head_dim (K then V).
VLLM_PACKED_ORDERS = ("LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")

# vLLM's cross-layer caches (``prefer_cross_layer_blocks``; the connector receives the tensor in
# its physical shape): the order of that shape per attention backend and VLLM_KV_CACHE_LAYOUT,
# from the backends' ``get_kv_cache_stride_order(include_num_layers_dimension=True)`` (vLLM 0.18:
# FlashAttention (2, 0, 1, 3, 4, 5) NHD / (2, 4, 0, 1, 3, 5) HND over (L, 2, B, N, H, D);
# FlashInfer (1, 0, 2, 3, 4, 5) / (1, 2, 4, 0, 3, 5) over (L, B, 2, N, H, D)).
# ``BLKHND`` is TensorRT-LLM's (LMCache's ``nb_nl_two_nh_bs_hs``), not a vLLM HND cache.
VLLM_CROSS_LAYER_ORDERS = {
    ("flash_attn", "NHD"): "BLKNHD",
    ("flash_attn", "HND"): "BHLKND",
    ("flashinfer", "NHD"): "BLKNHD",
    ("flashinfer", "HND"): "BKHLND",
}


def _views_from_order(t: torch.Tensor, order: str, name: str) -> list[list[torch.Tensor]]:
    """Split one tensor whose dims are named by ``order`` into ``[L][C]`` canonical views."""
    check(isinstance(order, str), "order", "a string of dim letters", repr(order), TypeError)
    order = order.upper()
    check(t.dim() == len(order), name, f"{len(order)} dims for order {order!r}", describe(t))  # before indexing
    if "C" in order:
        if "K" in order or "D" in order:
            fail("order", "'C' (packed K|V) without 'K' or 'D'", repr(order))
        ci = order.index("C")
        check(t.shape[ci] % 2 == 0, name, f"an even packed dim (2*head_dim) at position {ci}", describe(t))
        check(t.stride(ci) == 1, name, "the packed K|V dim to be contiguous (stride 1)", describe(t))
        t = t.unflatten(ci, (2, t.shape[ci] // 2))
        order = order[:ci] + "KD" + order[ci + 1 :]
    check(
        len(set(order)) == len(order) and set(order) <= set(_LETTERS),
        "order",
        f"distinct letters from {_LETTERS!r} (or C)",
        repr(order),
    )
    for req in "BND":
        check(req in order, "order", f"a string containing {req!r}", repr(order))
    check(t.dim() == len(order), name, f"{len(order)} dims for order {order!r}", describe(t))
    if "K" in order:
        check(t.shape[order.index("K")] == 2, name, f"size 2 on the K axis of order {order!r}", describe(t))
    # permute to canonical [L, K, B, N, H, D], inserting missing axes as size-1 dims
    for letter in _LETTERS:
        if letter not in order:
            t = t.unsqueeze(-1)
            order = order + letter
    t = t.permute([order.index(x) for x in _LETTERS])
    return [[t[layer, c] for c in range(t.shape[1])] for layer in range(t.shape[0])]


def _layer_list(kv_caches, name: str) -> list[torch.Tensor]:
    if isinstance(kv_caches, torch.Tensor):
        fail(name, "a list or dict of per-layer tensors", "a single Tensor", TypeError)
    if isinstance(kv_caches, Mapping):
        items = list(kv_caches.values())
    elif isinstance(kv_caches, Sequence):
        items = list(kv_caches)
    else:
        fail(name, "a list or dict of per-layer tensors", type(kv_caches).__name__, TypeError)
    check(len(items) > 0, name, "at least one layer", "an empty collection")
    for i, t in enumerate(items):
        check_tensor(t, f"{name}[{i}]")
    return items


def _check_layout(kind: str, layout: str) -> str:
    check(isinstance(layout, str) and layout.upper() in ("NHD", "HND"), "kv_layout", "'NHD' or 'HND'", repr(layout))
    return layout.upper()


def _check_hnd_shape(kv_caches, ctor: str) -> None:
    """``"HND"`` names tensors whose *shape* is ``[.., H, N, D]``. vLLM hands out the logical
    ``[.., N, H, D]`` shape whatever ``VLLM_KV_CACHE_LAYOUT`` (a permuted view: the strides carry
    HND), and read as HND its block size and head count would swap without an error. Such a
    tensor has a smaller stride on dim 2 than on dim 3, which no HND-shaped HND tensor has (a
    permuted view keeps a size-1 dim's physical stride: one KV head per rank is caught too)."""
    for i, t in enumerate(_layer_list(kv_caches, "kv_caches")):  # from_layers' own list rules
        if t.dim() == 5 and t.size(2) > 1 and t.stride(2) < t.stride(3):
            fail(f"kv_caches[{i}]", f"a tensor shaped [.., H, N, D] for {ctor}(..., 'HND') (dim 2's stride larger "
                 "than dim 3's)",
                 f"shape {tuple(t.shape)} with strides {t.stride()}: the logical [.., N, H, D] view vLLM hands "
                 f"out whatever VLLM_KV_CACHE_LAYOUT (its strides carry HND) — pass it with kv_layout='NHD'; "
                 "a tensor that really is shaped [.., H, N, D] over NHD-ordered memory: name its dims with "
                 "from_layers(..., order=)")


def _strides_hit(delta: int, dims, row: int) -> bool:
    """Whether two views with the same nested strides whose first bytes are ``delta`` apart share a
    byte: ``delta`` = sum of d_i * stride_i + e with |d_i| < n_i and |e| < ``row`` (``dims``: (byte
    stride, size), largest stride first; nested strides leave two candidates per level)."""
    if not dims:
        return -row < delta < row
    (st, n), rest = dims[0], dims[1:]
    q = delta // st
    return any(-n < d < n and _strides_hit(delta - d * st, rest, row) for d in (q, q + 1))


def _check_no_aliasing(out, name) -> None:
    """No two slots (block, token, head rows) of the layout share memory: within a view each of
    its block / token / head strides steps past everything inside it, and no two views (K and V,
    layers — they share strides) overlap. A scatter into aliased slots writes one place from
    several (the result depended on the backend and on ``max_ctas``)."""
    v0 = out[0][0]
    esz = v0.element_size()
    row = v0.shape[3] * esz  # the head dim is contiguous (checked above)
    dims = sorted((st * esz, n) for n, st in zip(v0.shape[:3], v0.stride()[:3]) if n > 1)
    extent = row
    for st, n in dims:
        if st < extent:
            fail(name(0, 0), "slots that do not share memory (each of the block / token / head strides must step "
                 "past the dims inside it)", describe(v0))
        extent += (n - 1) * st
    desc = dims[::-1]
    views = sorted((v.data_ptr(), li, ci) for li, r in enumerate(out) for ci, v in enumerate(r))
    for i, (a, la, ca) in enumerate(views):
        for b, lb, cb in views[i + 1:]:
            if b - a >= extent:  # sorted by address: no later view starts inside this one's footprint
                break
            if _strides_hit(b - a, desc, row):
                what = "the same memory as" if a == b else "memory shared with"
                fail(name(lb, cb), f"memory of its own (it is {what} {name(la, ca)})", describe(out[lb][cb]))


def _checked_views(views, _names=None) -> tuple[tuple[torch.Tensor, ...], ...]:
    """The checks of :meth:`PagedLayout.from_views`: ``views`` as a tuple of per-layer tuples."""
    if isinstance(views, torch.Tensor) or not isinstance(views, (Sequence, Mapping)):
        fail("views", "a list of per-layer [K, V] (or [latent]) tensor lists", type(views).__name__, TypeError)
    items = list(views.values()) if isinstance(views, Mapping) else list(views)
    # error messages name the caller's argument (a preset passes how its own inputs are named)
    name = _names or (lambda li, ci: f"views[{li}][{ci}]")
    check(len(items) > 0, name(0, 0).split("[")[0] if _names else "views", "at least one layer",
          "an empty collection")
    out: list[tuple[torch.Tensor, ...]] = []
    ref = None
    norm: list[list[torch.Tensor]] = []
    for li, entry in enumerate(items):
        if isinstance(entry, torch.Tensor):
            fail(f"views[{li}]", "a sequence of 1 (MLA) or 2 (K, V) tensors", "a single Tensor", TypeError)
        try:
            entry = list(entry)
        except TypeError:
            fail(f"views[{li}]", "a sequence of 1 (MLA) or 2 (K, V) tensors", type(entry).__name__, TypeError)
        check(len(entry) in (1, 2), f"views[{li}]", "1 (MLA) or 2 (K, V) tensors", len(entry))
        norm.append(entry)
    for li, entry in enumerate(norm):
        row = []
        for ci, v in enumerate(entry):
            nm = name(li, ci)
            check_tensor(v, nm)
            check(v.dim() == 4, nm, "4 dims [num_blocks, block_size, num_heads, head_dim]", describe(v))
            check(v.numel() > 0, nm, "a non-empty tensor", describe(v))
            # kernels write the cache behind autograd's back (no version bump); torch's own
            # in-place copies refuse a leaf that requires grad part way through a scatter
            check(not v.requires_grad, nm, "a tensor that does not require grad (pass .detach())", describe(v))
            check(v.stride(3) == 1 or v.shape[3] == 1, nm, "a contiguous head dim (stride 1)", describe(v))
            # (torch's own dtype views are aligned; Tensor.set_ on a byte offset is not, and the
            # FP8 / shuffle kernels load whole elements: a misaligned-address fault on a GPU)
            check(v.data_ptr() % v.element_size() == 0, nm, f"an address aligned to its {v.element_size()}-byte "
                  "elements", f"address {v.data_ptr():#x}")
            # an expanded dim (stride 0) makes blocks / tokens / heads share memory: a scatter
            # would write one place from several slots (the backends disagree on the result)
            check(all(n == 1 or st != 0 for n, st in zip(v.shape, v.stride())), nm,
                  "no dimension of size > 1 with stride 0 (expanded views alias their elements)", describe(v))
            if ref is None:
                ref = v
                check(not v.is_complex() and v.dtype != torch.bool, nm, "a real dtype", v.dtype, TypeError)
                check_memory(v, nm)  # (a meta cache: a gather "succeeded" with no data)
            else:
                check(v.shape == ref.shape, nm, f"shape {tuple(ref.shape)} like {name(0, 0)}", describe(v))
                check(v.dtype == ref.dtype, nm, f"dtype {ref.dtype} like {name(0, 0)}", v.dtype, TypeError)
                check(same_device(v.device, ref.device), nm, f"device {ref.device} like {name(0, 0)}", v.device)
                check(
                    v.stride() == ref.stride(),
                    nm,
                    f"strides {tuple(ref.stride())} like {name(0, 0)} (layers must agree)",
                    describe(v),
                )
            row.append(v)
        if out:
            check(len(row) == len(out[0]), f"views[{li}]", f"{len(out[0])} entries like views[0]", len(row))
        out.append(tuple(row))
    _check_no_aliasing(out, name)
    return tuple(out)


@dataclass(frozen=True, eq=False)
class PagedLayout:
    """A paged KV cache described by strided views (no copy).

    Build it with a preset (:meth:`from_vllm`, :meth:`from_flashinfer`, :meth:`from_mla`,
    :meth:`from_cross_layer`, :meth:`from_vllm_packed`, :meth:`from_sglang`) or the generic
    :meth:`from_views` / :meth:`from_tensor` / :meth:`from_strides`.

    Attributes
    ----------
    views : tuple of tuple of Tensor
        ``views[l][c]`` is ``[num_blocks, block_size, num_heads, head_dim]`` (a view of the cache
        memory, any strides, head dim contiguous).
    kind : str
        Name of the preset that built it (for messages).

    Examples
    --------
    >>> import torch, kvkernels
    >>> caches = [torch.zeros(2, 64, 16, 8, 128, dtype=torch.bfloat16) for _ in range(4)]
    >>> layout = kvkernels.PagedLayout.from_vllm(caches)
    >>> (layout.num_layers, layout.num_kv, layout.num_blocks, layout.chunk_nbytes)
    (4, 2, 64, 32768)
    """

    views: tuple[tuple[torch.Tensor, ...], ...]
    kind: str = "custom"
    # values derived once per layout (pointer tables, strides, alignment, formats, launch plans):
    # the layout is immutable, and these are on every copy's path
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __getstate__(self):
        # the memo holds raw addresses of *these* tensors (pointer tables, launch plans): a copy
        # (copy.deepcopy, pickle) has its own tensors and derives its own (the Triton and CUDA
        # backends otherwise read and wrote the original cache through the copy)
        state = dict(self.__dict__)
        state["_memo"] = {}
        return state

    def __post_init__(self):
        # ``PagedLayout(views=...)`` called directly gets the same checks as every preset (the
        # kernels trust views[0][0]'s shape and strides for all views)
        object.__setattr__(self, "views", _checked_views(self.views))

    @classmethod
    def _trusted(cls, views: tuple, kind: str) -> "PagedLayout":
        """A layout from views :func:`_checked_views` has already accepted (no second check)."""
        self = object.__new__(cls)
        for k, v in (("views", views), ("kind", kind), ("_memo", {})):
            object.__setattr__(self, k, v)
        return self

    # ------------------------------------------------------------------ generic constructors
    @classmethod
    def from_views(cls, views, *, kind: str = "custom", _names=None) -> "PagedLayout":
        """Generic constructor: ``views[l][c]`` are ``[num_blocks, block_size, H, D]`` tensors.

        Every preset ends here. All views must share shape, dtype, device and strides, and have a
        contiguous head dim (stride 1). The tensors are kept (not copied): the layout is valid as
        long as the cache memory is.
        """
        return cls._trusted(_checked_views(views, _names), kind)

    @classmethod
    def from_tensor(cls, kv_cache: torch.Tensor, order: str, *, kind: str = "tensor",
                    _name: str = "kv_cache") -> "PagedLayout":
        """One tensor whose dims are named by ``order`` (letters ``LBKNHD`` or ``C``; see module doc).

        ``"KBNHD"`` is one vLLM FlashAttention layer, ``"BLKNHD"`` a block-major cross-layer cache.
        (``_name``: the argument a preset's errors name.)
        """
        check_tensor(kv_cache, _name)
        return cls.from_views(_views_from_order(kv_cache, order, _name), kind=kind, _names=lambda li, ci: _name)

    @classmethod
    def from_layers(cls, kv_caches, order: str, *, kind: str = "layers") -> "PagedLayout":
        """A list (or dict, in layer order) of per-layer tensors, each with dims named by ``order``."""
        layers = _layer_list(kv_caches, "kv_caches")
        check("L" not in str(order).upper(), "order", "per-layer dims (no 'L')", repr(order))
        views = []
        for i, t in enumerate(layers):
            views.extend(_views_from_order(t, order, f"kv_caches[{i}]"))
        return cls.from_views(views, kind=kind, _names=lambda li, ci: f"kv_caches[{li}]")

    @classmethod
    def from_strides(
        cls,
        tensors,
        *,
        block_size: int,
        num_heads: int,
        head_dim: int,
        strides: tuple[int, int, int],
        num_blocks: int | None = None,
        kv_offset: int | None = None,
        offset: int = 0,
        kind: str = "strides",
    ) -> "PagedLayout":
        """Generic constructor from per-layer base tensors and element strides.

        Parameters
        ----------
        tensors : list of Tensor
            One tensor per layer; only its storage, storage offset and dtype are used.
        block_size, num_heads, head_dim : int
            Shape of one block.
        strides : (int, int, int)
            Element strides of (block, token, head); the head dim is contiguous.
        num_blocks : int, optional
            Default: as many as fit in the smallest storage.
        kv_offset : int, optional
            Element offset of V from K inside a layer; ``None`` = one entry (MLA).
        offset : int
            Element offset of K from the tensor's own start.

        Raises ``ValueError`` when a view would reach outside a tensor's storage.
        """
        layers = _layer_list(tensors, "tensors")
        check_int(block_size, "block_size", lo=1)
        check_int(num_heads, "num_heads", lo=1)
        check_int(head_dim, "head_dim", lo=1)
        check(
            isinstance(strides, (tuple, list)) and len(strides) == 3
            and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in strides),
            "strides",
            "3 non-negative ints (block, token, head)",
            strides,
        )
        check_int(offset, "offset")
        if kv_offset is not None:
            check_int(kv_offset, "kv_offset")
        if num_blocks is not None:
            check_int(num_blocks, "num_blocks", lo=1)
        entries = [offset] if kv_offset is None else [offset, offset + kv_offset]
        # extent of one block-shaped view, in elements, from its first element
        inner = (block_size - 1) * strides[1] + (num_heads - 1) * strides[2] + head_dim
        caps = []
        for t in layers:
            # elements, base (int(): torch 2.15's stubs type storage_offset() as int | SymInt)
            caps.append((t.untyped_storage().nbytes() // t.element_size(), int(t.storage_offset())))
        nb = num_blocks
        if nb is None:
            # as many as fit in the smallest storage (every layer must have the same num_blocks)
            check(strides[0] > 0, "strides", "a positive block stride when num_blocks is None", strides)
            nb = min((cap - base - max(entries) - inner) // strides[0] + 1 for cap, base in caps)
            check(nb >= 1, "tensors", "storages holding at least one block for these strides and offsets",
                  f"room for {nb} blocks")
        views = []
        for i, (t, (cap, base)) in enumerate(zip(layers, caps)):
            row = []
            for off in entries:
                last = base + off + (nb - 1) * strides[0] + inner
                check(
                    base + off >= 0 and last <= cap,
                    f"tensors[{i}]",
                    f"a storage of at least {last} elements for this view",
                    f"{cap} elements",
                )
                row.append(
                    torch.as_strided(t, (nb, block_size, num_heads, head_dim), (*strides, 1), base + off)
                )
            views.append(row)
        return cls.from_views(views, kind=kind, _names=lambda li, ci: f"tensors[{li}]")

    # ------------------------------------------------------------------ presets
    @classmethod
    def from_vllm(cls, kv_caches, kv_layout: str = "NHD") -> "PagedLayout":
        """vLLM FlashAttention: per layer ``[2, num_blocks, block_size, H, D]`` (NHD) or
        ``[2, num_blocks, H, block_size, D]`` (HND); a list, or a dict in layer order.

        ``kv_layout`` names the tensors' *shape*. vLLM's model runner hands out the NHD shape for
        both ``VLLM_KV_CACHE_LAYOUT`` settings (HND memory is a permuted view, its strides carry
        the order): pass vLLM's own tensors as ``"NHD"`` (the default); ``"HND"`` refuses them."""
        kl = _check_layout("vllm", kv_layout)
        if kl == "HND":
            _check_hnd_shape(kv_caches, "from_vllm")
        return cls.from_layers(kv_caches, "KB" + ("NHD" if kl == "NHD" else "HND"), kind=f"vllm-{kl}")

    @classmethod
    def from_flashinfer(cls, kv_caches, kv_layout: str = "NHD") -> "PagedLayout":
        """vLLM FlashInfer: per layer ``[num_blocks, 2, block_size, H, D]`` (NHD) or
        ``[num_blocks, 2, H, block_size, D]`` (HND) — the shape, as for :meth:`from_vllm` (vLLM's
        own tensors are NHD-shaped with HND strides: pass them as ``"NHD"``)."""
        kl = _check_layout("flashinfer", kv_layout)
        if kl == "HND":
            _check_hnd_shape(kv_caches, "from_flashinfer")
        return cls.from_layers(kv_caches, "BK" + ("NHD" if kl == "NHD" else "HND"), kind=f"flashinfer-{kl}")

    @classmethod
    def from_mla(cls, kv_caches) -> "PagedLayout":
        """MLA (DeepSeek): per layer ``[num_blocks, block_size, head_dim]`` (e.g. 576 = 512 + 64),
        one latent entry per token (no K/V split). fp8 caches (656-byte entries) are ``uint8``.
        vLLM's 4-D per-layer views ``[num_blocks, 1, block_size, head_dim]`` (one head; its MLA
        backends squeeze that dim themselves) are taken too: the head dim is squeezed here (a
        view). Not through ``from_vllm_packed``, which would split the latent into K and V."""
        layers = _layer_list(kv_caches, "kv_caches")
        layers = [t.squeeze(1) if t.dim() == 4 and t.shape[1] == 1 else t for t in layers]
        for i, t in enumerate(layers):
            check(t.dim() == 3, f"kv_caches[{i}]",
                  "3 dims [num_blocks, block_size, head_dim] (or vLLM's [num_blocks, 1, block_size, head_dim])",
                  describe(t))
        return cls.from_layers(layers, "BND", kind="mla")

    @classmethod
    def from_cross_layer(cls, kv_cache: torch.Tensor, order: str = "BLKNHD") -> "PagedLayout":
        """One block-major tensor holding all layers per block, in its physical shape: default
        ``[num_blocks, num_layers, 2, block_size, H, D]`` (vLLM ``prefer_cross_layer_blocks`` with
        NHD, FlashAttention or FlashInfer); pass ``order`` for others — vLLM with HND:
        ``"BHLKND"`` (FlashAttention), ``"BKHLND"`` (FlashInfer) (:data:`VLLM_CROSS_LAYER_ORDERS`);
        TensorRT-LLM's ``"BLKHND"``; a one-entry cache ``"BLND"``."""
        check_tensor(kv_cache, "kv_cache")
        check("L" in str(order).upper(), "order", "an order containing 'L'", repr(order))
        return cls.from_tensor(kv_cache, order, kind="cross-layer")

    @classmethod
    def from_vllm_packed(cls, kv_caches, order: str | None = None) -> "PagedLayout":
        """vLLM packed K|V (2026 refactor): logical ``[num_blocks, H, block_size, 2*D]`` per layer.

        ``kv_caches`` is either a list/dict of per-layer tensors in that logical shape (any strides:
        the physical order lives in them), or, with ``order``, per-layer tensors whose dims are in
        that physical order without ``L``, or one tensor in physical order ``order`` (one of
        ``LBNHC`` (default), ``LBHNC``, ``LHBNC``, ``BLHNC``, ``BLNHC``, ``BHLNC``), its dims in
        that order.
        """
        if isinstance(kv_caches, torch.Tensor):
            order = "LBNHC" if order is None else str(order).upper()
            check(order in VLLM_PACKED_ORDERS, "order", f"one of {VLLM_PACKED_ORDERS}", repr(order))
            return cls.from_tensor(kv_caches, order, kind=f"vllm-packed-{order}", _name="kv_caches")
        if order is not None:  # per-layer tensors whose dims are in that physical order (L dropped)
            order = str(order).upper()
            check(order in VLLM_PACKED_ORDERS, "order", f"one of {VLLM_PACKED_ORDERS}", repr(order))
            return cls.from_layers(kv_caches, order.replace("L", ""), kind=f"vllm-packed-{order}")
        return cls.from_layers(kv_caches, "BHNC", kind="vllm-packed")

    @classmethod
    def from_sglang(cls, k_buffers, v_buffers, page_size: int) -> "PagedLayout":
        """SGLang token pools: per layer ``k_buffers[l]`` and ``v_buffers[l]`` of ``[size, H, D]``;
        block ``b`` is tokens ``[b * page_size, (b + 1) * page_size)`` (``num_blocks = size //
        page_size``; SGLang's page 0 is its padding page, its allocator's pages start at 1, so a
        page number is a block id). Its HND pools (``SGLANG_USE_HND_KVCACHE=1``) are page-major
        ``[num_pages, H, page_size, D]``: taken as they are (block ``b`` = page ``b``)."""
        ks = _layer_list(k_buffers, "k_buffers")
        vs = _layer_list(v_buffers, "v_buffers")
        check(len(ks) == len(vs), "v_buffers", f"{len(ks)} layers like k_buffers", len(vs))
        check_int(page_size, "page_size", lo=1)
        views = []
        for i, (k, v) in enumerate(zip(ks, vs)):
            row = []
            for nm, t in ((f"k_buffers[{i}]", k), (f"v_buffers[{i}]", v)):
                if t.dim() == 4:  # HND pages [num_pages, H, page_size, D] -> [pages, page_size, H, D]
                    check(t.shape[2] == page_size, nm, f"[num_pages, num_heads, page_size={page_size}, head_dim]",
                          describe(t))
                    row.append(t.permute(0, 2, 1, 3))
                    continue
                check(t.dim() == 3, nm, "3 dims [size, num_heads, head_dim] (or 4 of an HND pool "
                      "[num_pages, num_heads, page_size, head_dim])", describe(t))
                check(t.shape[0] >= page_size, nm, f"at least page_size={page_size} tokens", describe(t))
                nb = t.shape[0] // page_size
                s0, s1, s2 = t.stride()
                row.append(t.as_strided((nb, page_size, t.shape[1], t.shape[2]), (page_size * s0, s0, s1, s2)))
            views.append(row)
        return cls.from_views(views, kind=f"sglang-page{page_size}",
                              _names=lambda li, ci: f"{'kv'[ci]}_buffers[{li}]")

    # ------------------------------------------------------------------ properties
    @property
    def num_layers(self) -> int:
        return len(self.views)

    @property
    def num_kv(self) -> int:
        """2 for K/V caches, 1 for MLA."""
        return len(self.views[0])

    @property
    def _ref(self) -> torch.Tensor:
        return self.views[0][0]

    @property
    def num_blocks(self) -> int:
        return self._ref.shape[0]

    @property
    def block_size(self) -> int:
        return self._ref.shape[1]

    @property
    def num_heads(self) -> int:
        return self._ref.shape[2]

    @property
    def head_dim(self) -> int:
        return self._ref.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self._ref.dtype

    @property
    def device(self) -> torch.device:
        return self._ref.device

    @property
    def element_size(self) -> int:
        return self._ref.element_size()

    @property
    def row_nbytes(self) -> int:
        """Bytes of one (token, head) row: ``head_dim * element_size``."""
        return self.head_dim * self.element_size

    @property
    def chunk_nbytes(self) -> int:
        """Bytes of one block of one layer for one entry (K or V): ``block_size*H*D*e``."""
        return self.block_size * self.num_heads * self.row_nbytes

    @property
    def byte_strides(self) -> tuple[int, int, int]:
        """Byte strides of (block, token, head), shared by all layers. A dimension of size 1 is
        never stepped, so its stride is reported as 0: torch gives such a dimension an arbitrary
        stride (MLA's single head: 2 bytes), which must not decide the kernels' access width (it
        made the CUDA backend move MLA caches in 2-byte words, 31 % of the copy peak on the H100)."""
        got = self._memo.get("byte_strides")  # on every launch's path: computed once per layout
        if got is None:
            e = self.element_size
            s = self._ref.stride()
            sizes = (self.num_blocks, self.block_size, self.num_heads)
            got = self._memo["byte_strides"] = tuple(0 if n == 1 else st * e for n, st in zip(sizes, s[:3]))
        return got

    def is_contiguous_chunk(self) -> bool:
        """True when one (block, layer, entry) chunk is one contiguous run of bytes (NHD-like)."""
        _, sn, sh = self.byte_strides
        h = self.num_heads
        return (h == 1 or sh == self.row_nbytes) and (self.block_size == 1 or sn == h * self.row_nbytes)

    def access_width(self, *addresses: int, cap: int = 16) -> int:
        """Largest access width (16, 8, 4, 2 or 1 bytes, at most ``cap``) dividing the row size,
        every byte stride, every view's base address and each of ``addresses`` (e.g. the staging
        pointer). The cache's part is computed once per layout: the kernels' launchers call this
        on every copy, and walking every layer's base address cost ~30 us per call."""
        own = self._memo.get("align")
        if own is None:
            vals = (self.row_nbytes, *self.byte_strides, *self.base_addresses_flat())
            own = next(w for w in (16, 8, 4, 2, 1) if all(v % w == 0 for v in vals))
            self._memo["align"] = own
        w = min(own, cap)
        while w > 1 and any(a % w for a in addresses):
            w //= 2
        return w

    def base_addresses(self) -> list[list[int]]:
        """Byte addresses ``[L][C]`` of block 0 of every view."""
        return [[v.data_ptr() for v in row] for row in self.views]

    def base_addresses_flat(self) -> list[int]:
        return [a for row in self.base_addresses() for a in row]

    def memo_get(self, table: str, key):
        """A value derived from this (immutable) layout, kept in ``_memo[table]``, or None."""
        return self._memo.setdefault(table, {}).get(key)

    def memo_put(self, table: str, key, value, bound: int = 4096):
        """Keep ``value`` under ``key`` in ``_memo[table]``, a table cleared when it reaches
        ``bound`` entries (keys such as request sizes and buffer addresses vary); returns it."""
        t = self._memo.setdefault(table, {})
        if len(t) >= bound:
            t.clear()
        t[key] = value
        return value

    def pointer_table_for(self, layers: tuple[int, ...]) -> torch.Tensor:
        """``int64 [len(layers), num_kv]`` device table of base addresses of ``layers`` (cached per
        layer tuple, so steady-state calls do no host-to-device copy)."""
        key = tuple(layers)
        tables = self._memo.setdefault("ptr_tables", {})
        tab = tables.get(key)
        if tab is None:
            addrs = self.base_addresses()
            tab = torch.tensor([addrs[l] for l in key], dtype=torch.int64, device=self.device)
            tables[key] = tab
        return tab

    def __repr__(self) -> str:
        return (
            f"PagedLayout(kind={self.kind!r}, layers={self.num_layers}, kv={self.num_kv}, "
            f"blocks={self.num_blocks}, block_size={self.block_size}, heads={self.num_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, device={self.device}, "
            f"byte_strides={self.byte_strides})"
        )
