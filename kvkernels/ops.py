"""Public gather / scatter: validation, backend choice, buffer allocation.

Id rules (every backend): ``block_ids`` is a 1-D int32 or int64 tensor (or a sequence of ints) of
cache block indices in ``[0, num_blocks)``; ``-1`` is *padding* (gather writes a zero block into
that staging slot, scatter skips it). Gather accepts duplicates; scatter rejects duplicate
destinations (two slots writing one block would race).

``validate=True`` (default; ``KVKERNELS_VALIDATE``) checks the ids on the host before any kernel
runs — for ids on a GPU that is one device-to-host sync. ``validate=False`` is for hot paths: no
sync; the kernels still never touch memory outside the cache (an invalid id is treated as padding)
and count invalid ids in a per-device counter that :func:`check_errors` reads (and resets) at the
caller's next convenient sync point. Scatter duplicates are not detected with ``validate=False``.
"""

from __future__ import annotations

import bisect
import contextlib

from typing import Sequence

import numpy as np
import torch

from . import backends, config
from ._validate import check, check_byte_buffer, check_int, describe, fail, same_device
from .layout import PagedLayout
from .staging import StagingFormat

__all__ = ["gather", "scatter", "check_errors", "as_block_ids"]

_ERR: dict[str, torch.Tensor] = {}


def _err_counter(device: torch.device) -> torch.Tensor:
    key = str(device)
    t = _ERR.get(key)
    if t is None:  # two threads' first use: both get the one counter that was stored first
        t = _ERR.setdefault(key, torch.zeros(1, dtype=torch.int32, device=device))
    return t


def check_errors(device=None) -> None:
    """Raise ``ValueError`` if a ``validate=False`` call met invalid block ids since the last check.

    Waits for the device (every stream: kernels on a pipeline's side streams count into the same
    counter), reads the per-device counter and takes what it read off it, so a count added by
    work another thread queues meanwhile is reported by the next check instead of wiped.
    ``device`` defaults to all devices used so far.
    """
    if device is None:
        keys = list(_ERR)
    else:  # "cuda" names the current device, whose counter is kept under "cuda:<index>"
        try:
            want = torch.device(device)
        except (RuntimeError, TypeError):
            # a str or int of the right type naming no device is a bad value; anything else a bad type
            fail("device", "a torch.device, a device string or index, or None", repr(device),
                 ValueError if isinstance(device, (str, int)) else TypeError)
        keys = [k for k in _ERR if same_device(torch.device(k), want)]
    for key in keys:
        t = _ERR.get(key)
        if t is None:
            continue
        if t.device.type == "cuda":
            # item() waits for the current stream only: a kernel still running on another stream
            # (the pipeline's pack stream) could count after the read and be wiped by a reset
            torch.cuda.synchronize(t.device)
        count = int(t.item())
        if count:
            t.sub_(count)
            raise ValueError(
                f"`block_ids`: {count} id(s) outside [-1, num_blocks) were passed with validate=False "
                f"on {key}; they were treated as padding (nothing outside the cache was touched)"
            )


def as_block_ids(block_ids, layout: PagedLayout) -> torch.Tensor:
    """Normalise ``block_ids`` to a 1-D int32/int64 tensor on the cache device (no range check).

    Host ids (a sequence or a CPU tensor) for a GPU cache go through pinned memory and a copy on
    the current stream that does not block the host: the returned tensor is valid for work
    issued on that stream (or after it). A caller's CPU tensor may be changed right after the
    call, pinned or not: its values are first copied into a fresh block of torch's pinned cache
    (a pinned tensor used as the copy's source, as ``tensor.to(device, non_blocking=True)``
    does, would be read whenever the stream gets there)."""
    return _to_cache_device(_ids_tensor(block_ids), _check_layout(layout))


def _ids_tensor(block_ids) -> torch.Tensor:
    """``block_ids`` as a 1-D int32/int64 tensor where it is (a sequence becomes a CPU tensor)."""
    if isinstance(block_ids, torch.Tensor):
        ids = block_ids
    elif isinstance(block_ids, Sequence) and not isinstance(block_ids, (str, bytes)):
        if not set(map(type, block_ids)) <= {int}:  # plain ints (what vLLM passes): one C-level pass
            for x in block_ids:
                if isinstance(x, bool) or not isinstance(x, int):
                    fail("block_ids", "ints", f"an element of type {type(x).__name__}", TypeError)
        try:  # through numpy: 4x cheaper than torch.tensor on a list (6 vs 25 us for 256 ids)
            ids = torch.from_numpy(np.array(block_ids, dtype=np.int64))
        except OverflowError:
            fail("block_ids", "ids that fit in int64", "an int out of that range", ValueError)
    else:
        fail("block_ids", "a 1-D int tensor or a sequence of ints", type(block_ids).__name__, TypeError)
    check(ids.dtype in (torch.int32, torch.int64), "block_ids", "dtype int32 or int64", ids.dtype, TypeError)
    check(ids.dim() == 1, "block_ids", "a 1-D tensor", describe(ids))
    return ids


def _to_cache_device(ids: torch.Tensor, layout: PagedLayout) -> torch.Tensor:
    """The second half of :func:`as_block_ids`: ``ids`` contiguous on the cache device."""
    if not same_device(ids.device, layout.device):
        if ids.device.type == "cpu":
            # pageable -> device would be a host sync (torch waits for the copy, i.e. for all
            # the work queued on the current stream); a copy into a pinned block from torch's
            # caching host allocator is not (the block is kept until the copy has run). A pinned
            # tensor of the caller's (vLLM's block tables are pinned) gets a fresh block too: as
            # the copy's source it would be read whenever the stream gets there, after the caller
            # may have refilled it with other, unchecked ids
            if layout.device.type == "cuda":
                staged = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
                staged.copy_(ids)
                ids = staged
            ids = ids.to(layout.device, non_blocking=True)
        else:
            fail("block_ids", f"a tensor on {layout.device} (the cache device) or on the CPU", ids.device)
    return ids if ids.is_contiguous() else ids.contiguous()


def _validate_ids(ids: torch.Tensor, layout: PagedLayout, *, unique: bool) -> None:
    """Range (and with ``unique``, duplicate) check of block ids, on the host: CPU ids as they are;
    device ids (only when validation was asked for them) read back in one copy, a host sync.
    numpy's calls cost a fraction of torch's dispatch, which dominated a cold ``start_load`` on
    the CPU host (125 of 340 us for 256 ids, twelfth session)."""
    if ids.numel() == 0:
        return
    a = ids.detach().cpu().numpy()
    lo, hi = int(a.min()), int(a.max())
    if lo < -1 or hi >= layout.num_blocks:
        bad = a[(a < -1) | (a >= layout.num_blocks)][:4].tolist()
        fail("block_ids", f"ids in [0, {layout.num_blocks}) or -1 (padding)", f"{bad} (first invalid)")
    if unique:
        srt = np.sort(a[a >= 0] if lo < 0 else a)
        if srt.size > 1 and bool((srt[1:] == srt[:-1]).any()):
            vals, counts = np.unique(srt, return_counts=True)
            fail("block_ids", "distinct destination ids for scatter", f"duplicates {vals[counts > 1][:4].tolist()}")


def _cache_extents(layout: PagedLayout) -> list[tuple[int, int]]:
    """Byte ranges ``[lo, hi)`` spanned by the cache's views, merged (computed once per layout)."""
    ext = layout._memo.get("extents")
    if ext is None:
        spans = []
        for row in layout.views:
            for v in row:
                hi = v.data_ptr() + v.element_size() * (1 + sum((n - 1) * st for n, st in zip(v.shape, v.stride())))
                spans.append((v.data_ptr(), hi))
        spans.sort()
        ext = []
        for lo, hi in spans:
            if ext and lo <= ext[-1][1]:
                ext[-1] = (ext[-1][0], max(ext[-1][1], hi))
            else:
                ext.append((lo, hi))
        layout._memo["extents"] = ext
    return ext


def _check_disjoint(buf: torch.Tensor, name: str, layout: PagedLayout, nbytes: int) -> None:
    """A staging buffer inside the cache's memory would be read and written by the same copy
    (the backends would not even agree on the result)."""
    if nbytes == 0 or buf.device.type != layout.device.type:
        return
    lo, hi = buf.data_ptr(), buf.data_ptr() + nbytes
    ext = _cache_extents(layout)  # sorted, disjoint: only the last extent starting below hi can overlap
    k = bisect.bisect_left(ext, (hi,)) - 1
    if k >= 0 and lo < ext[k][1]:
        a, b = ext[k]
        fail(name, "memory disjoint from the cache's", f"a buffer overlapping the cache at [{a:#x}, {b:#x})")


def _check_buffer(buf, name: str, layout: PagedLayout, nbytes: int) -> torch.Tensor:
    check_byte_buffer(buf, name, nbytes)
    if layout.device.type == "cuda":
        ok = same_device(buf.device, layout.device) or (buf.device.type == "cpu" and buf.is_pinned())
        if not ok:
            fail(name, f"memory on {layout.device} or pinned host memory", f"{buf.device} (pinned={buf.is_pinned()})")
    else:
        check(buf.device.type == layout.device.type, name, f"a tensor on {layout.device}", buf.device)
    _check_disjoint(buf, name, layout, nbytes)
    return buf


def _check_layout(layout) -> PagedLayout:
    if not isinstance(layout, PagedLayout):
        fail("layout", "a kvkernels.PagedLayout", type(layout).__name__, TypeError)
    return layout


def _prepare(layout, block_ids, layers, validate, backend, unique):
    layout = _check_layout(layout)
    ids = _ids_tensor(block_ids)
    if ids.device.type != "cpu":
        ids = _to_cache_device(ids, layout)  # a tensor on another GPU is refused first
    fmt = StagingFormat.for_layout(layout, ids.numel(), layers)
    if validate is None:
        validate = config.validate_default()
    check(isinstance(validate, bool), "validate", "a bool", repr(type(validate)), TypeError)
    b = backends.resolve(backend, layout.device)
    if validate:  # host ids are checked where they are, before their copy: no read-back sync
        _validate_ids(ids, layout, unique=unique)
    return layout, _to_cache_device(ids, layout), fmt, b


_SAME_DEVICE = contextlib.nullcontext()


def on_cache_device(layout: PagedLayout):
    """Context in which a Triton launch runs on the cache's GPU: Triton takes the device and stream
    from torch's *current* device, so a cache on cuda:1 while cuda:0 is current would launch on
    cuda:0 (refused without peer access; with it, unordered against cuda:1's stream). A no-op in
    the usual case (the cache's device is current, or a CPU cache)."""
    idx = layout._memo.get("cuda_index")  # on every launch's path: derived once per layout
    if idx is None:
        dev = layout.device
        idx = layout._memo["cuda_index"] = dev.index if dev.type == "cuda" and dev.index is not None else -1
    # torch._C._cuda_getDevice: the current device without torch.cuda's lazy-init wrapper (the
    # cache's tensors exist, so CUDA is initialised)
    if idx < 0 or idx == torch._C._cuda_getDevice():
        return _SAME_DEVICE
    return torch.cuda.device(idx)


GRANULARITIES = ("token", "block")  # of FP8 scales (kvkernels.quant)


def _check_granularity(granularity) -> None:
    check(granularity in GRANULARITIES, "granularity", "'token' or 'block'", repr(granularity))


def _caps(max_ctas) -> int:
    if max_ctas is None:
        return config.max_ctas()
    return check_int(max_ctas, "max_ctas", lo=0, hi=config.MAX_CTAS_LIMIT)


def gather(
    layout: PagedLayout,
    block_ids,
    *,
    out: torch.Tensor | None = None,
    layers=None,
    backend: str = "auto",
    max_ctas: int | None = None,
    validate: bool | None = None,
    quant: str | None = None,
    shuffle: bool = False,
    granularity: str = "token",
) -> torch.Tensor:
    """Pack blocks of a paged KV cache into a layer-contiguous staging buffer, one launch.

    Parameters
    ----------
    layout : PagedLayout
        The cache (read only).
    block_ids : Tensor or sequence of int
        ``[n]`` int32/int64, on the cache device (or CPU: copied there). Staging slot ``i`` holds
        cache block ``block_ids[i]``; ``-1`` = padding (a zero block); duplicates allowed.
    out : Tensor, optional
        ``[>= staging_nbytes]`` uint8, contiguous, on the cache device or (CUDA cache) pinned host
        memory (the kernel then writes through UVA: zero-copy). Written in place; allocated on
        the cache device when ``None``. With pinned host ``out`` the padding between regions is
        zeroed by the host during the call while the kernel runs later on the stream: do not
        hand in a host buffer that earlier queued work still writes (wait for that work first).
    layers : None, int or sequence of int
        Layers to pack (default all); regions come in ascending layer order.
    backend : {"auto", "triton", "cuda", "torch"}
    max_ctas : int, optional
        Cap on the Triton grid (programs), so the copy leaves SMs to attention; 0 = no cap.
        Default ``KVKERNELS_MAX_CTAS``.
    validate : bool, optional
        Host-side id check (see module docs). Default ``KVKERNELS_VALIDATE`` (True).
    quant : {None, "fp8"}
        ``"fp8"``: quantize in the same pass to e4m3 with fp32 scales per (token, head)
        (``granularity="token"``) or per (block, head) (``"block"``); format in docs/quant.md.
    shuffle : bool
        Store each 16-bit entry as a high-byte plane then a low-byte plane (better lossless
        compression); docs/quant.md.

    Returns
    -------
    Tensor
        ``out`` (its first ``staging_nbytes`` bytes are the staging buffer).

    Examples
    --------
    >>> import torch, kvkernels
    >>> caches = [torch.randn(2, 32, 16, 2, 64).to(torch.bfloat16) for _ in range(3)]
    >>> layout = kvkernels.PagedLayout.from_vllm(caches)
    >>> buf = kvkernels.gather(layout, [7, 3, 12])
    >>> buf.numel() == kvkernels.staging_nbytes(layout, 3)
    True
    """
    if quant is not None or shuffle:
        from .quant import gather_quant  # lazy: quant imports this module

        return gather_quant(layout, block_ids, quant=quant, shuffle=shuffle, granularity=granularity, out=out,
                            layers=layers, backend=backend, max_ctas=max_ctas, validate=validate)
    _check_granularity(granularity)  # unused on the raw path, still a typo
    layout, ids, fmt, b = _prepare(layout, block_ids, layers, validate, backend, unique=False)
    cap = _caps(max_ctas)
    if out is None:
        out = torch.empty(fmt.nbytes, dtype=torch.uint8, device=layout.device)
    else:
        _check_buffer(out, "out", layout, fmt.nbytes)
    return _gather_into(layout, ids, fmt, out, b, cap)


def _gather_into(layout: PagedLayout, ids: torch.Tensor, fmt: StagingFormat, out: torch.Tensor, b: str, cap: int):
    """The launch behind :func:`gather`, every argument already checked (``b`` resolved, ``ids``
    on the cache device): the pipeline's per-layer path calls it directly."""
    if fmt.nbytes == 0:
        return out
    if b == "triton":
        from kvkernels.triton_ops import gather_triton

        with on_cache_device(layout):
            return gather_triton(layout, ids, fmt, out, _err_counter(layout.device), cap)
    if b == "cuda":
        from ._cuda import gather_cuda

        return gather_cuda(layout, ids, fmt, out, _err_counter(layout.device), cap)
    from . import reference

    err = _err_counter(layout.device)
    err += ((ids < -1) | (ids >= layout.num_blocks)).sum().to(torch.int32)
    return reference.gather(layout, ids, fmt, out)


def scatter(
    staging: torch.Tensor,
    layout: PagedLayout,
    block_ids,
    *,
    layers=None,
    backend: str = "auto",
    max_ctas: int | None = None,
    validate: bool | None = None,
    quant: str | None = None,
    shuffle: bool = False,
    granularity: str = "token",
) -> None:
    """Unpack a staging buffer into (possibly different) blocks of a paged cache, in place.

    Parameters
    ----------
    staging : Tensor
        ``[>= staging_nbytes]`` uint8, as written by :func:`gather` for the same ``layers``, any
        source layout with the same block shape and dtype; on the cache device or pinned host.
    layout : PagedLayout
        The destination cache (written in place).
    block_ids : Tensor or sequence of int
        ``[n]`` destination blocks, distinct; ``-1`` skips that slot.
    layers, backend, max_ctas, validate, quant, shuffle, granularity
        As in :func:`gather`; ``quant``/``shuffle``/``granularity`` must match the gather that
        wrote ``staging`` (the bytes cannot tell; the SSD store records the scheme).

    Examples
    --------
    >>> import torch, kvkernels
    >>> src = kvkernels.PagedLayout.from_vllm([torch.randn(2, 32, 16, 2, 64) for _ in range(2)])
    >>> dst = kvkernels.PagedLayout.from_flashinfer([torch.zeros(32, 2, 2, 16, 64) for _ in range(2)], "HND")
    >>> kvkernels.scatter(kvkernels.gather(src, [1, 2]), dst, [30, 5])
    >>> bool((dst.views[1][1][5] == src.views[1][1][2]).all())
    True
    """
    if quant is not None or shuffle:
        from .quant import scatter_quant

        return scatter_quant(staging, layout, block_ids, quant=quant, shuffle=shuffle, granularity=granularity,
                             layers=layers, backend=backend, max_ctas=max_ctas, validate=validate)
    _check_granularity(granularity)  # unused on the raw path, still a typo
    layout, ids, fmt, b = _prepare(layout, block_ids, layers, validate, backend, unique=True)
    cap = _caps(max_ctas)
    _check_buffer(staging, "staging", layout, fmt.nbytes)
    _scatter_from(staging, layout, ids, fmt, b, cap)


def _scatter_from(staging: torch.Tensor, layout: PagedLayout, ids: torch.Tensor, fmt: StagingFormat, b: str,
                  cap: int) -> None:
    """The launch behind :func:`scatter`, every argument already checked (see :func:`_gather_into`)."""
    if fmt.nbytes == 0:
        return None
    if b == "triton":
        from kvkernels.triton_ops import scatter_triton

        with on_cache_device(layout):
            scatter_triton(staging, layout, ids, fmt, _err_counter(layout.device), cap)
        return None
    if b == "cuda":
        from ._cuda import scatter_cuda

        scatter_cuda(staging, layout, ids, fmt, _err_counter(layout.device), cap)
        return None
    from . import reference

    err = _err_counter(layout.device)
    err += ((ids < -1) | (ids >= layout.num_blocks)).sum().to(torch.int32)
    reference.scatter(staging, layout, ids, fmt)
    return None
