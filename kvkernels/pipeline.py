"""Layer-wise offload / restore: copy-engine DMA overlapped with attention, no host sync in the step.

Contract (full text in ``docs/pipeline.md``, with what a vLLM 0.33 connector adapter keeps on
top: layer names, request ids, ``finished_req_ids``). The worker-side calls:

==============================================  ====================================================
vLLM worker hook                                :class:`LayerPipeline`
==============================================  ====================================================
``start_load_kv`` (synchronous loads)           :meth:`LayerPipeline.start_load` (``{key: dst_ids}``)
``start_load_kv`` (``load_kv_async``)           ``start_load(..., asynchronous=True)`` (no compute wait)
``wait_for_layer_load``                         :meth:`LayerPipeline.wait_for_layer_load` (a *stream* wait)
``save_kv_layer``                               :meth:`LayerPipeline.save_layer` (``{key: src_ids}``)
``wait_for_save``                               :meth:`LayerPipeline.wait_for_save` (a *stream* wait)
``get_transfer_results`` / ``get_finished``     :meth:`LayerPipeline.get_finished` (keys; polls events),
                                                :meth:`take_failed_saves`, :meth:`take_failed_loads`
``get_block_ids_with_load_errors``              :meth:`LayerPipeline.get_block_ids_with_load_errors`
==============================================  ====================================================

Data path, per layer ``l`` (GPU):

* save: an event on the compute stream marks layer ``l`` final -> the *pack* stream gathers the
  layer's blocks (capped grid, ``max_ctas``) into a device staging slot (a ring of
  ``num_slots`` slots of ``slot_bytes``) -> the *D2H* stream copies the slot into the request's
  region of one pinned host pool -> the slot is released by an event. Layers larger than a slot
  are chunked, so gathering chunk ``i + 1`` overlaps the DMA of chunk ``i``.
* restore: the *H2D* stream copies layer ``l`` of the host entry into a slot -> the pack stream
  scatters it into the destination blocks -> an event per layer; ``wait_for_layer_load(l)``
  makes the compute stream wait on it and issues layer ``l + prefetch_depth``.
* SSD: :meth:`prefetch` reads an entry from a :class:`kvkernels.io.KVStore` into the host pool
  in groups of layers, in layer order (the SSD half of an async load, off the step). ``start_load`` may
  be called while that read is still in flight: each layer's H2D then waits, *on the GPU*, for
  that layer's read (``cuStreamWaitValue32`` on a pinned per-layer flag the reading thread sets),
  so the restore and the compute start with the first layers on disk instead of after the whole
  entry. A saved entry is written to the store after its DMA completes, by a background thread.
  None of this blocks the step.

Nothing on the step path calls ``torch.cuda.synchronize()``, ``Stream.synchronize()``,
``Event.synchronize()`` or ``.item()``: host-visible completion is only ever polled
(``Event.query()``). On CPU the same code runs synchronously (streams and events are no-ops).

Memory is bounded and allocated once: one pinned host pool of ``host_bytes`` (registered at
construction) and ``num_slots * slot_bytes`` of device staging per direction, plus as much again
for asynchronous restores, allocated at the first one (``start_load(..., asynchronous=True)``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import logging
import mmap
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Hashable, Mapping

import numpy as np
import torch

from . import backends, config, ops
from ._validate import check, check_int, fail
from .layout import PagedLayout
from .staging import REGION_ALIGN, StagingFormat

if TYPE_CHECKING:
    from ._cudart import Runtime

__all__ = ["PinnedPool", "LayerPipeline", "HostEntry"]

log = logging.getLogger("kvkernels")

# per-layer read gate of a streamed SSD load (a pinned int32 per layer): 0 = not read yet,
# READ = the layer's bytes are in the host pool, FAILED = its read failed (the bytes were zeroed)
GATE_READ, GATE_FAILED = 1, 2
_CU_STREAM_WAIT_VALUE_GEQ = 0x0


@functools.lru_cache(maxsize=None)
def _cu_stream_wait_value32():
    """The driver's ``cuStreamWaitValue32`` (torch does not expose it), or None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    for name in ("cuStreamWaitValue32_v2", "cuStreamWaitValue32"):
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
            return fn
    return None


def _note_latest(keys: dict, key, kept: int) -> None:
    """``key`` as the newest of the insertion-ordered ``keys``, the oldest dropped past ``kept``."""
    keys.pop(key, None)
    keys[key] = None
    while len(keys) > kept:
        del keys[next(iter(keys))]


def _check_mapping(x, name: str) -> None:
    if not isinstance(x, Mapping):
        fail(name, "a mapping {key: block_ids}", type(x).__name__, TypeError)


def _layer_groups(num_layers: int, groups: int = 8) -> list[list[int]]:
    """Layers split into at most ``groups`` runs in order: one store read each (a read per layer
    costs per-request overhead; one read for the whole entry delays the first layer)."""
    per = max(1, -(-num_layers // groups))
    return [list(range(a, min(num_layers, a + per))) for a in range(0, num_layers, per)]


class _OnStream:
    """Makes a stream of the current device the current stream, and restores the previous one
    on exit (torch's ``StreamContext`` minus its device handling: the caller checked the device)."""

    __slots__ = ("_to", "_prev")

    def __init__(self, stream):
        self._to = (stream.stream_id, stream.device_index, stream.device_type)

    def __enter__(self):
        self._prev = torch._C._cuda_getCurrentStream(self._to[1])
        torch._C._cuda_setStream(*self._to)
        return self

    def __exit__(self, *exc) -> None:
        torch._C._cuda_setStream(*self._prev)


# the current stream's handle on a device index (torch's C binding; Triton's launcher calls it)
_RAW_CURRENT = getattr(torch._C, "_cuda_getCurrentRawStream", None)

# failed_saves keeps the latest this many keys (oldest dropped): request ids are unique in a
# server, so a key never saved again would otherwise stay for the process's life
FAILED_SAVES_KEPT = 4096
# failed restores kept for take_failed_loads (keys, the latest) and for get_block_ids_with_load_errors
# (device-id tensors; host ids fold into one set, bounded by the cache's blocks) when the caller
# does not drain them (a soak run grew both by ~2 items a step for ever)
FAILED_LOADS_KEPT = 4096
# with read_priority, a saved entry's SSD write waits for a gap in the reads at most this long
# after it was queued (then it is put; the store still runs reads first): a steady prefetch
# stream must not hold a finished save (and its host region) forever
WRITE_MAX_DELAY_S = 1.0


class _Handle:
    """A stream known by its CUDA handle only (what the ``cudart`` calls take)."""

    __slots__ = ("cuda_stream",)

    def __init__(self, handle: int):
        self.cuda_stream = handle


# ---------------------------------------------------------------------------- CPU stand-ins
class _NullEvent:
    """Event stand-in on CPU: work is synchronous, so everything is always complete."""

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _NullStream:
    # declared, never set: the runtime calls (stream_api="cudart", copy_mode="dma") drive CUDA
    # streams; the tests that run those paths on CPU give the stand-in a handle (monkeypatch)
    cuda_stream: int

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


@functools.lru_cache(maxsize=4096)
def _copy_pieces(f, cfmt, layer: int, host_block: int, slot_block: int, n: int,
                 num_kv: int) -> tuple[tuple[int, int, int], ...]:
    """``(host offset, slot offset, nbytes)`` of the copies that move ``n`` blocks of ``layer``
    between a host entry (format ``f``, from its block ``host_block``) and a slot (format ``cfmt``,
    from its block ``slot_block``): one run per K/V entry, merged where both sides are contiguous.
    Pure function of immutable formats, cached (on every layer's path)."""
    nb = n * f.chunk_nbytes
    out: list[list[int]] = []
    for c in range(num_kv):
        h = f.entry_offset(layer, c) + host_block * f.chunk_nbytes
        d = c * cfmt.entry_nbytes + slot_block * cfmt.chunk_nbytes
        if out and out[-1][0] + out[-1][2] == h and out[-1][1] + out[-1][2] == d:
            out[-1][2] += nb
        else:
            out.append([h, d, nb])
    return tuple((x[0], x[1], x[2]) for x in out)


def _zero_region_padding(buf: torch.Tensor, fmt: StagingFormat) -> None:
    """Zero the bytes between each region's payload and the next 4 KiB boundary of a new host
    entry: the copies write payloads only, and the pool region held another entry before
    (the staging format's padding is zero, and an SSD file must not carry another request's KV)."""
    pad = fmt.region_nbytes - fmt.payload_nbytes
    if pad:
        buf[: fmt.num_regions * fmt.region_nbytes].view(fmt.num_regions, fmt.region_nbytes)[:, fmt.payload_nbytes:].zero_()


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class _DmaPlan:
    """One request's blocks as copy-engine pieces (``copy_mode="dma"``): for each run of blocks
    that is contiguous both in the cache (consecutive ids, blocks ``chunk_nbytes`` apart) and in
    the host entry, its offset from the cache view's base (``cache_rel``), its offset inside a
    K/V entry of the host region (``host_rel``) and its size. Padding ids (-1) get no piece (a
    restore skips them; a save with padding uses the gather, which writes zero blocks). The same
    for every layer and for K and V: built once per request per step, from host ids."""

    __slots__ = ("n", "cache_rel", "host_rel", "sizes")

    def __init__(self, ids: np.ndarray, block_stride: int, chunk_nbytes: int):
        ids = np.asarray(ids, dtype=np.int64)
        self.n = int(ids.size)
        pad = self.n > 0 and int(ids.min()) < 0  # no padding: the ids alone (once per request per step)
        pos = np.flatnonzero(ids >= 0) if pad else None
        vals = ids[pos] if pad else ids
        m = int(vals.size)
        if m and block_stride == chunk_nbytes:  # neighbouring blocks are neighbouring bytes: runs
            brk = np.empty(m, dtype=bool)  # a piece starts here
            brk[0] = True
            np.not_equal(np.diff(vals), 1, out=brk[1:])
            if pad:  # the host side must continue too
                assert pos is not None  # (set with pad)
                brk[1:] |= np.diff(pos) != 1
            starts = np.flatnonzero(brk)
        else:
            starts = np.arange(m, dtype=np.int64)
        self.cache_rel = vals[starts] * block_stride
        self.host_rel = (pos[starts] if pos is not None else starts) * chunk_nbytes  # (pos: set with pad)
        self.sizes = np.diff(starts, append=m).astype(np.int64) * chunk_nbytes

    def numel(self) -> int:
        """Block ids of the request (as ``Tensor.numel`` of its ids: the entry's size)."""
        return self.n


class _DmaBatch:
    """The pieces of several requests' plans for every K/V entry, laid out for one
    ``cudaMemcpyBatchAsync`` per layer: for layer ``l`` the cache address of a piece is
    ``base[l][kv] + cache_rel`` and its host address ``host0 + l * host1`` (a host entry's layer
    regions are ``region_nbytes`` apart). A layer's row of addresses is computed at its first use
    (four numpy operations, into arrays allocated once per batch) and kept: the batch lives for
    a step, and a layer is issued once per step per direction."""

    __slots__ = ("sig", "count", "sizes", "kv", "cache_rel", "host0", "host1", "base_tab", "cache_addr", "host_addr",
                 "_done", "_ptrs")

    def __init__(self, sig, parts, num_kv: int, base_tab: np.ndarray):
        kv, cache_rel, host0, host1, sizes = [], [], [], [], []
        for ent, plan in parts:
            f, ptr = ent.fmt, ent.buf.data_ptr()
            m = plan.sizes.size
            for c in range(num_kv):
                kv.append(np.full(m, c, dtype=np.int64))
                cache_rel.append(plan.cache_rel)
                host0.append(ptr + f.entry_offset(0, c) + plan.host_rel)
                host1.append(np.full(m, f.region_nbytes, dtype=np.int64))
                sizes.append(plan.sizes)
        cat = (lambda xs: np.concatenate(xs).astype(np.int64, copy=False) if xs else np.zeros(0, dtype=np.int64))
        self.kv, self.cache_rel, self.host0, self.host1 = cat(kv), cat(cache_rel), cat(host0), cat(host1)
        self.sig = sig
        self.sizes = np.ascontiguousarray(cat(sizes))
        self.count = int(self.sizes.size)
        self.base_tab = base_tab
        num_layers = base_tab.shape[0]
        self.cache_addr = np.empty((num_layers, self.count), dtype=np.int64)
        self.host_addr = np.empty((num_layers, self.count), dtype=np.int64)
        self._done = bytearray(num_layers)
        # the arrays' addresses, taken once (numpy's .ctypes costs ~1 us a call)
        self._ptrs = (self.cache_addr.ctypes.data, self.host_addr.ctypes.data, self.sizes.ctypes.data)

    def _fill(self, layer: int) -> None:
        c, h = self.cache_addr[layer], self.host_addr[layer]
        self.base_tab[layer].take(self.kv, out=c)
        np.add(c, self.cache_rel, out=c)
        np.multiply(self.host1, layer, out=h)
        np.add(h, self.host0, out=h)
        self._done[layer] = 1

    def pointers(self, layer: int) -> tuple[int, int, int]:
        """``(cache addresses, host addresses, sizes)`` of ``layer``'s pieces: addresses of
        ``count`` int64 values each, valid while this batch lives."""
        if not self._done[layer]:
            self._fill(layer)
        row = layer * self.count * 8
        return self._ptrs[0] + row, self._ptrs[1] + row, self._ptrs[2]

    def pieces(self, layer: int):
        """``(cache address, host address, nbytes)`` of ``layer``'s pieces (the CPU path)."""
        if not self._done[layer]:
            self._fill(layer)
        return zip(self.cache_addr[layer].tolist(), self.host_addr[layer].tolist(), self.sizes.tolist())


def _drain(streams) -> None:
    """Wait for a dropped pipeline's streams (a host wait, at garbage collection only)."""
    for s in streams:
        s.synchronize()


def _named(exc: Exception, name: str) -> Exception:
    """A validation error re-raised with the caller's argument, ``name`` (e.g. ``saves['a']``),
    in front: the checkers name their own (``block_ids``), not one of the call. (An ``except``
    clause, not a context manager: this is on the step path, ~1 us per ``with`` saved.)"""
    if type(exc) not in (TypeError, ValueError):
        return exc
    return type(exc)(f"`{name}`: {exc}")


# ---------------------------------------------------------------------------- pinned host pool
_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


def _clear_cuda_error() -> None:
    """After a failed runtime call outside ``_cudart`` (torch's ``cudart()`` bindings): the
    thread's last error cleared, through the runtime torch loaded (:meth:`_cudart.Runtime.clear_error`)."""
    try:
        from . import _cudart

        rt = _cudart.load()
        if rt is not None:
            rt.clear_error()
    except Exception:
        pass


def _on_device(device):
    """``device`` current for a bare runtime call (``None``: as it is). torch's cudart binding has
    no guard, and cudaHostRegister/Unregister initialise the *current* device's context: a pool
    for a cache on cuda:1 registered while device 0 is current would create a context (hundreds
    of MiB) on cuda:0. A portable registration serves every context, so the cache's is enough."""
    return torch.cuda.device(device) if device is not None else contextlib.nullcontext()


def _host_register(ptr: int, nbytes: int, device=None) -> None:
    with _on_device(device):
        rc = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE))
    if rc != 0:
        _clear_cuda_error()
        raise RuntimeError(f"kvkernels: cudaHostRegister of the {nbytes}-byte host pool failed (cudaError {rc}: "
                           "not enough free host memory?)")


def _host_unregister(ptr: int, buf: torch.Tensor, device, wait: bool = True) -> None:
    """Unpin the pool (``buf`` keeps its pages mapped until then), with ``device`` (the cache's)
    current. At garbage collection the pool's last DMAs may still be queued (a pipeline dropped
    without ``close()``): with ``wait``, that device is waited for first (a host wait, at
    collection only)."""
    try:
        if device is not None and wait:
            torch.cuda.synchronize(device)
    except Exception:  # a sticky error or a capture in progress: unpin anyway (the memory must not
        _clear_cuda_error()  # be freed while registered)
    try:
        with _on_device(device):
            rc = int(torch.cuda.cudart().cudaHostUnregister(ptr))
        if rc != 0:
            _clear_cuda_error()
    except Exception:  # a context already torn down: the process is going away, nothing to unpin
        pass


class PinnedPool:
    """One pinned host allocation carved into 4 KiB-aligned regions (first fit, coalescing).

    Registered once at construction (``cudaHostRegister`` of exactly the pool's bytes, portable)
    and unregistered by :meth:`release` (or at garbage collection): no per-transfer pinning or
    allocation. Not torch's pinned allocator: it rounds a request up to a power of two and keeps
    the block cached after it is freed, so a 40 GiB pool would pin 64 GiB for the life of the
    process. ``pin=False``: pageable memory (CPU caches). ``device``: the GPU whose queued DMAs
    an unregistration at garbage collection waits for. ``alloc`` returns ``None`` when no region
    fits (the caller decides: evict or fail).
    """

    def __init__(self, nbytes: int, *, pin: bool = True, device=None):
        check_int(nbytes, "host_bytes", lo=REGION_ALIGN)
        self.nbytes = _round_up(nbytes, REGION_ALIGN)
        # whole pages (64 KiB on some ARM hosts): what the mapping and a registration cover
        reg = _round_up(self.nbytes, max(REGION_ALIGN, mmap.PAGESIZE))
        # an anonymous mapping: page-aligned (4 KiB-aligned regions for O_DIRECT reads), exactly
        # ``reg`` bytes, and the tensor's storage starts where the registration starts (torch's
        # is_pinned() asks about the storage's base pointer: a view into a larger, unaligned
        # allocation read as pageable on the H100 of 2026-11-23, though the DMAs were async)
        # (private, as malloc'd memory is: a shared mapping would be shared with forked children)
        buf = torch.frombuffer(mmap.mmap(-1, reg, flags=mmap.MAP_PRIVATE), dtype=torch.uint8)
        self.buffer = buf[: self.nbytes]
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # sorted (offset, size)
        self._lock = threading.Lock()
        self._unpin: weakref.finalize | None = None
        if pin:
            ptr = self.buffer.data_ptr()
            _host_register(ptr, reg, device)
            self._unpin = weakref.finalize(self, _host_unregister, ptr, buf, device)
            self._unpin.atexit = False  # at exit the process unpins (and DMAs may be in flight)

    @property
    def pinned(self) -> bool:
        return self._unpin is not None and self._unpin.alive

    def release(self) -> None:
        """Unpin now (the memory stays readable, pageable). Every DMA on the pool must be done:
        :meth:`LayerPipeline.close` calls it after draining its streams."""
        if self._unpin is not None and self._unpin.alive:
            detached = self._unpin.detach()
            assert detached is not None  # (alive just above)
            _, _, (ptr, buf, dev), _ = detached
            _host_unregister(ptr, buf, dev, wait=False)

    def alloc(self, nbytes: int) -> int | None:
        size = _round_up(max(nbytes, 1), REGION_ALIGN)
        with self._lock:
            for i, (off, sz) in enumerate(self._free):
                if sz >= size:
                    if sz == size:
                        self._free.pop(i)
                    else:
                        self._free[i] = (off + size, sz - size)
                    return off
        return None

    def free(self, offset: int, nbytes: int) -> None:
        size = _round_up(max(nbytes, 1), REGION_ALIGN)
        with self._lock:
            self._free.append((offset, size))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for off, sz in self._free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + sz)
                else:
                    merged.append((off, sz))
            self._free = merged

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(sz for _, sz in self._free)

    @property
    def largest_free(self) -> int:
        """The largest region ``alloc`` could return now."""
        with self._lock:
            return max((sz for _, sz in self._free), default=0)

    def largest_free_with(self, regions: list[tuple[int, int]]) -> int:
        """The largest region ``alloc`` could return once ``regions`` (``(offset, nbytes)``, as
        given to :meth:`free`) were freed too; nothing is freed."""
        with self._lock:
            spans = sorted(self._free + [(o, _round_up(max(n, 1), REGION_ALIGN)) for o, n in regions])
        best, start, end = 0, None, None
        for off, sz in spans:
            if start is None or off != end:
                start = off
            end = off + sz
            best = max(best, end - start)
        return best

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buffer[offset : offset + nbytes]


# ---------------------------------------------------------------------------- entries
@dataclass(eq=False)
class HostEntry:
    """One request's KV in the host pool, in the standard staging format (all layers)."""

    key: Hashable
    fmt: StagingFormat
    offset: int
    buf: torch.Tensor  # uint8 [fmt.nbytes] view of the pool
    state: str = "saving"  # saving -> saved | loading (SSD) -> ready | failed
    layers_done: set = field(default_factory=set)
    done_event: torch.cuda.Event | _NullEvent | None = None  # D2H of the last layer complete
    ssd_future: Future | None = None
    error: str | None = None
    users: int = 0  # loads in flight reading it
    # streamed SSD read (prefetch): per-layer gate flags (pinned int32 on a GPU host) and events
    gate: torch.Tensor | None = None
    layer_read: list[threading.Event] | None = None  # threading.Event per layer: set when its gate is released
    read_future: Future | None = None  # the prefetch reading it (a second prefetch of the key waits on it)
    # while saving: the host ids of the last layer and their device copy, reused by the next layer
    # when the caller passes the same ids again (vLLM passes one list per request for all layers)
    save_ids: tuple | None = None


class LayerPipeline:
    """Layer-wise offload/restore of paged KV between a device cache and pinned host (and SSD).

    Parameters
    ----------
    layout : PagedLayout
        The device (or CPU) cache. Written in place by restores.
    host_bytes : int
        Size of the pinned host pool (entries live there in the staging format).
    slot_bytes : int
        Bytes of one device staging slot; layers bigger than a slot are chunked. Default 64 MiB.
    num_slots : int
        Slots per direction (a ring; >= 2 so gather and DMA overlap). Default 3.
    max_ctas : int
        Grid cap of the gather/scatter kernels (SMs left to attention). Default 16.
    prefetch_depth : int
        Layers restored ahead of ``wait_for_layer_load`` (>= 1). Default 2.
    store : kvkernels.io.KVStore, optional
        SSD tier: saved entries are written there; :meth:`prefetch` reads from it. Its keys are
        the pipeline's: with a store that has ``check_key`` (``KVStore``: str or bytes), a key it
        refuses is a ``TypeError`` at ``save_layer`` / ``prefetch``, before anything is issued.
    backend : str
        Kernel backend for gather/scatter (``"auto"``).
    read_priority : bool
        SSD writes of saved entries wait while prefetch reads are in flight (default True), at
        most :data:`WRITE_MAX_DELAY_S` after each write was queued.
    pack_priority : int
        CUDA priority of the pack stream (the gather / scatter kernels): 0 (default) is the
        compute stream's own; lower is higher (torch clamps to the device's range, -5..0 on the
        H100). On the H100 (2026-11-23) a 16-CTA gather beside the attention proxy took 530 us
        per layer against 71 us alone: its CTAs wait for SMs the compute holds. A higher
        priority lets them in first, so the gather's SM time is short and bunched; whether
        that costs the compute less is measured (``kvkernels bench pipeline``,
        ``[priority=-1]`` rows) before it becomes a default.
    stream_api : {"torch", "cudart"}, optional
        How the per-layer calls record events, make streams wait and start DMAs: through torch's
        Python API (default) or by calling the CUDA runtime directly (``kvkernels._cudart``: ~1 us
        a call instead of several; issue 4's host-time target). Default
        ``KVKERNELS_PIPELINE_STREAM_API`` (``torch``); ``cudart`` needs a CUDA cache.
    copy_mode : {"gather", "dma"}, optional
        How a layer's blocks move: ``gather`` (a capped-SM gather into a device slot, then large
        DMAs; restore: DMAs into a slot, then a scatter) or ``dma`` (one ``cudaMemcpyBatchAsync``
        per layer straight between the cache's blocks and the host entry, runs of consecutive
        blocks merged: no SM and no device staging). ``dma`` needs a layout whose per-block K/V
        chunks are contiguous in the staging format's (token, head, dim) order — NHD caches,
        MLA, SGLang; not HND, whose chunks the gather transposes — and, on a GPU, CUDA >= 12.8; requests whose ids
        are device tensors (not read back: a sync) or, in a save, contain padding use the gather
        for that call. Default ``KVKERNELS_PIPELINE_COPY_MODE`` (``gather``).
    """

    def __init__(self, layout: PagedLayout, *, host_bytes: int, slot_bytes: int = 64 << 20, num_slots: int = 3,
                 max_ctas: int = 16, prefetch_depth: int = 2, store=None, backend: str = "auto",
                 read_priority: bool = True, stream_api: str | None = None, pack_priority: int = 0,
                 copy_mode: str | None = None):
        if not isinstance(layout, PagedLayout):
            fail("layout", "a kvkernels.PagedLayout", type(layout).__name__, TypeError)
        check_int(num_slots, "num_slots", lo=2)
        check_int(prefetch_depth, "prefetch_depth", lo=1)
        check_int(max_ctas, "max_ctas", lo=0, hi=config.MAX_CTAS_LIMIT)  # passed to the kernels as is
        check_int(pack_priority, "pack_priority", hi=0)
        # (a read-only store needs only get(); saves with a store that cannot put are failed saves)
        if store is not None and not callable(getattr(store, "get", None)):
            fail("store", "a kvkernels.io.KVStore (or an object with its get() and put()) or None",
                 type(store).__name__, TypeError)
        if not (isinstance(read_priority, (bool, np.bool_, int)) and read_priority in (0, 1)):  # (as KVStore's)
            fail("read_priority", "True or False", repr(read_priority), TypeError)
        self.layout = layout
        self.cuda = layout.device.type == "cuda"
        self.stream_api = self._resolve_stream_api(stream_api)
        self._rt: Runtime | None = None
        if self.stream_api == "cudart":
            from . import _cudart

            self._rt = _cudart.load()
            if self._rt is None:
                raise RuntimeError(f"`stream_api`: 'cudart' is not available: {_cudart.reason()}")
        self.copy_mode = self._resolve_copy_mode(copy_mode)
        self._batch_rt: Runtime | None = None  # the runtime whose cudaMemcpyBatchAsync moves dma-mode layers (GPU)
        per_block = layout.num_kv * layout.chunk_nbytes
        check_int(slot_bytes, "slot_bytes", lo=per_block)
        # a slot holds one chunk of one layer: [K chunk | V chunk], chunk_blocks blocks each
        self.chunk_blocks = slot_bytes // per_block
        self.slot_bytes = _round_up(self.chunk_blocks * per_block, REGION_ALIGN)
        self.num_slots = num_slots
        self.max_ctas = max_ctas
        self.pack_priority = pack_priority
        self.prefetch_depth = prefetch_depth
        self.backend = backend
        self._kernels = backends.resolve(backend, layout.device)  # once: the per-layer calls skip ops' checks
        if self._kernels == "torch" and layout.device.type == "cuda":
            log.warning("kvkernels: LayerPipeline on %s with the torch backend: each restored layer's scatter "
                        "syncs the host (padding ids found with nonzero); triton or cuda keep the step sync-free",
                        layout.device)
        self.store = store
        self._check_store_key = getattr(store, "check_key", None) if store is not None else None
        self.pool = PinnedPool(host_bytes, pin=self.cuda, device=layout.device if self.cuda else None)
        dev = layout.device
        self._slots = {d: [torch.empty(self.slot_bytes, dtype=torch.uint8, device=dev) for _ in range(num_slots)]
                       for d in ("save", "load")}
        self._slot_next = {"save": 0, "load": 0}
        # (the side streams: CUDA streams, or their no-op stand-in on CPU)
        self.pack_stream: torch.cuda.Stream | _NullStream
        self.d2h_stream: torch.cuda.Stream | _NullStream
        self.h2d_stream: torch.cuda.Stream | _NullStream
        self._async_streams: tuple[torch.cuda.Stream | _NullStream, torch.cuda.Stream | _NullStream]
        if self.cuda:
            self.pack_stream = torch.cuda.Stream(device=dev, priority=pack_priority)
            self.d2h_stream = torch.cuda.Stream(device=dev)
            self.h2d_stream = torch.cuda.Stream(device=dev)
            # asynchronous restores (start_load(asynchronous=True)) have streams of their own: on
            # the side streams above they would hold the next step's gathers and restores (the
            # streams run in order), and through wait_for_save the next forward
            self._async_streams = (torch.cuda.Stream(device=dev), torch.cuda.Stream(device=dev, priority=pack_priority))
            self._device_index = self.pack_stream.device_index
            if self._kernels in ("triton", "cuda"):
                # the kernels' per-layer pointer tables are built from a Python list, a blocking
                # pageable copy on the current stream: here, not at a layer's first save or
                # restore, where the current stream is the pack stream waiting for the compute
                # (the host would wait for layer l's attention, once per layer of the first step)
                with _on_device(dev):
                    for layer in range(layout.num_layers):
                        layout.pointer_table_for((layer,))
        else:
            self.pack_stream = self.d2h_stream = self.h2d_stream = _NullStream()
            self._async_streams = (_NullStream(), _NullStream())
        # events are reused (a stream wait binds to the record made before it): creating and
        # recording fresh ones cost host time on every layer. _slot_free: the slot's last reader
        # is done; _slot_filled: the slot's gather (save) or H2D (load) is done
        self._slot_free = {d: [self._event() for _ in range(num_slots)] for d in ("save", "load")}
        self._slot_filled = {d: [self._event() for _ in range(num_slots)] for d in ("save", "load")}
        self._ready = {d: self._event() for d in ("save", "load")}  # the compute stream's point of entry
        self._gathered = self._event()  # the last save_layer's gathers (the pack stream is in order)
        self._save_pending = False
        self._dma_read = self._event()  # the last save_layer's dma-mode copies (on the D2H stream)
        self._dma_pending = False
        self._save_batch: _DmaBatch | None = None  # dma-mode saves: reused while the same plans come back
        self._load_batch: _DmaBatch | None = None  # dma-mode restores of the current start_load
        self._finished_off = self._event()  # a previous restore's last layers, issued by start_load
        self._last_waited = -1  # the highest layer wait_for_layer_load was called for, this restore
        self._loads_async = False  # the current restore is start_load(asynchronous=True): no compute waits
        # [slots, free events, filled events, next]: made at the first async restore
        self._async_slots: list | None = None
        # one "layer restored" event per layer, re-recorded by each restore (only stream waits bind
        # to them; the last layer's, which get_finished polls, is new per restore)
        self._layer_loaded = [self._event() for _ in range(layout.num_layers)]
        if self.cuda:
            # a pipeline dropped without close() waits for its streams before its slots and pool can
            # be reused: the slots are used on side streams, and torch's pinned-memory allocator
            # does not see DMAs issued through the runtime (stream_api="cudart")
            # (close() runs the same drain once, then it is detached)
            self._drain_streams = weakref.finalize(self, _drain, (self.pack_stream, self.d2h_stream, self.h2d_stream,
                                                                  *self._async_streams))
            for ev in (*self._slot_free["save"], *self._slot_free["load"], *self._slot_filled["save"],
                       *self._slot_filled["load"], *self._ready.values(), self._gathered, self._dma_read,
                       self._finished_off, *self._layer_loaded):
                ev.record(self.pack_stream)  # creates the CUDA event (torch creates it at the first record)
        self.entries: dict[Hashable, HostEntry] = {}
        self._lock = threading.RLock()
        # (entry, dst ids, streamed, what a failure reports: host ids as given, or the caller's tensor)
        self._loads: list[tuple[HostEntry, torch.Tensor, bool, object]] = []
        self._load_events: dict[int, torch.cuda.Event | _NullEvent] = {}
        self._next_load_layer = 0
        self._saving: dict[Hashable, HostEntry] = {}
        if self.copy_mode == "dma":
            self._base_tab = np.array(layout.base_addresses(), dtype=np.int64)  # [L, num_kv] view addresses
            if self.cuda:
                why = self._probe_batch()
                if why is not None and copy_mode is not None:  # asked for by the caller: refused here
                    raise RuntimeError(f"`copy_mode`: 'dma' is not available: {why}")
                if why is not None:  # from KVKERNELS_PIPELINE_COPY_MODE: a process-wide preference
                    log.warning("kvkernels: KVKERNELS_PIPELINE_COPY_MODE=dma is not available (%s): this "
                                "pipeline gathers", why)
                    self.copy_mode = "gather"
                    del self._base_tab
        # (the requests' id copies, their concatenation): _save_together
        self._batch_ids: tuple[tuple[torch.Tensor, ...] | None, torch.Tensor] | None = None
        # (last layer's event, [(entry, what a failure reports; None: already reported)])
        self._pending_loads: list[tuple[torch.cuda.Event | _NullEvent, list]] = []
        # the current restore's item in _pending_loads once its last layer is issued (None before):
        # a failure after that (the tail of _finish_issuing_loads) marks it failed, never a second item
        self._loads_pending: tuple[torch.cuda.Event | _NullEvent, list] | None = None
        self._load_cat: torch.Tensor | None = None  # the restores' destination ids concatenated when they share a slot
        # destination ids of loads that failed: device tensors (read back when asked for, the
        # latest FAILED_LOADS_KEPT) and host ids (folded into a set: at most the cache's blocks)
        self._load_errors: list = []
        self._load_error_ids: set[int] = set()
        self._failed_loads: dict[Hashable, None] = {}  # their keys, insertion-ordered, FAILED_LOADS_KEPT at most
        self._failed_saves: dict[Hashable, None] = {}  # insertion-ordered, FAILED_SAVES_KEPT at most
        self._warned_load_errors = False
        self._orphans: list[HostEntry] = []  # replaced entries whose regions are still in use
        self._saves_failing: dict[Hashable, set] = {}  # saves without host memory: layers seen so far
        # SSD leg: reads (prefetch) and writes (saved entries) on separate threads; a write
        # starts only while no read is in flight (reads first: mixed read/write costs SSDs ~60 %)
        self._io_reads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvk-pipeline-read")
        self._io_writes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvk-pipeline-write")
        self._ssd_removals: dict = {}  # key -> its queued store.remove (see _forget_ssd)
        self._reads_inflight = 0
        self._io_cv = threading.Condition()
        self.read_priority = bool(read_priority)
        self._closed = False  # refuses new work from the start of close()
        self._close_lock = threading.Lock()  # a second close() (the exit hook) waits for one under way
        self._close_done = False  # close() ran to its end (an interrupted one did not: the next redoes it)
        # streamed SSD restores: the H2D stream waits on per-layer flags in pinned memory (GPU)
        self._gpu_gates = self.cuda and store is not None and self._probe_gates()
        # a pipeline not closed when the interpreter exits is closed then, before the KVStores
        # (its queued SSD writes still find the store open); loaded with any KVStore in use
        store_mod = sys.modules.get("kvkernels.io.store") if store is not None else None
        if store_mod is not None:
            store_mod.close_before_stores_at_exit(self)

    # ------------------------------------------------------------------ helpers
    def _resolve_stream_api(self, stream_api) -> str:
        if stream_api is None:
            from . import config

            stream_api = config.pipeline_stream_api()  # read (and checked) on every device
            if not self.cuda:  # a process-wide preference for GPU pipelines
                return "torch"
        check(stream_api in ("torch", "cudart"), "stream_api", "'torch' or 'cudart'", repr(stream_api))
        if stream_api == "cudart" and not self.cuda:
            fail("stream_api", "'torch' for a cache on the CPU ('cudart' drives CUDA streams)", "'cudart'")
        return stream_api

    def _resolve_copy_mode(self, copy_mode) -> str:
        """The constructor's ``copy_mode`` (refused where it cannot apply), or the environment's
        (a process-wide preference: layouts it cannot apply to gather, with a warning)."""
        explicit = copy_mode is not None
        if not explicit:
            from . import config

            copy_mode = config.pipeline_copy_mode()
        check(copy_mode in ("gather", "dma"), "copy_mode", "'gather' or 'dma'", repr(copy_mode))
        if copy_mode == "dma" and not self.layout.is_contiguous_chunk():
            why = ("'dma' copies each block's K/V chunk as one piece, and this layout's chunks are not contiguous "
                   "in (token, head, dim) order (HND or strided)")
            if explicit:
                fail("copy_mode", f"'gather' for this layout: {why}", "'dma'")
            log.warning("kvkernels: KVKERNELS_PIPELINE_COPY_MODE=dma does not apply to this layout (%s): this "
                        "pipeline gathers", why)
            return "gather"
        return copy_mode

    def _probe_batch(self) -> str | None:
        """Set up ``cudaMemcpyBatchAsync`` for dma mode and try one copy (a slot's first 16 bytes to
        the pool; a host wait, at construction only): None when it works, else why not. The
        runtime torch loaded may be newer than the driver (minor-version compatibility), which
        would refuse the call at the first step otherwise."""
        from . import _cudart

        rt = self._rt or _cudart.load()
        if rt is None:
            return _cudart.reason()
        if rt._batch is None:
            return rt.batch_reason
        addrs = np.array([self.pool.buffer.data_ptr(), self._slots["save"][0].data_ptr(), 16], dtype=np.int64)
        assert isinstance(self.d2h_stream, torch.cuda.Stream)  # (probed for a CUDA cache only)
        try:
            with torch.cuda.device(self._device_index):
                a = addrs.ctypes.data
                rt.memcpy_batch(a, a + 8, a + 16, 1, self.d2h_stream.cuda_stream)
                self.d2h_stream.synchronize()
        except RuntimeError as exc:
            return str(exc)
        self._batch_rt = rt
        return None

    def _check_device(self) -> None:
        """``stream_api="cudart"`` and ``copy_mode="dma"`` call the runtime without torch's device
        guard: the cache's
        device must be the current one (vLLM workers set it), or the runtime would work in (and
        create) another device's context."""
        if (self._rt is not None or self._batch_rt is not None) and self.cuda and \
                torch.cuda.current_device() != self._device_index:
            raise RuntimeError(f"LayerPipeline(stream_api='cudart' or copy_mode='dma'): the current CUDA device is "
                               f"cuda:{torch.cuda.current_device()}, the cache is on cuda:{self._device_index} "
                               "(torch.cuda.set_device)")

    def _record(self, ev, stream) -> None:
        """``ev`` marks the work queued so far on ``stream`` (a torch stream; None on CPU)."""
        if self._rt is not None:
            self._rt.record(ev.cuda_event, stream.cuda_stream)
        else:
            ev.record(stream if self.cuda else None)

    def _wait(self, stream, ev) -> None:
        """``stream`` waits for ``ev`` (a stream wait, never a host wait)."""
        if self._rt is not None:
            self._rt.wait(stream.cuda_stream, ev.cuda_event)
        else:
            stream.wait_event(ev)

    def _dma(self, host: torch.Tensor, slot: torch.Tensor, pieces, to_host: bool) -> None:
        """For ``(h, s, n)`` in ``pieces`` (:meth:`_pieces`): ``slot[s:s+n] -> host[h:h+n]`` on the
        D2H stream (``to_host``) or back on the H2D stream; asynchronous (pinned pool, device slot)."""
        stream = self.d2h_stream if to_host else self.h2d_stream
        if self._rt is not None:
            sh, hp, sp = stream.cuda_stream, host.data_ptr(), slot.data_ptr()
            for h, s_, n in pieces:
                if to_host:
                    self._rt.memcpy(hp + h, sp + s_, n, sh)
                else:
                    self._rt.memcpy(sp + s_, hp + h, n, sh)
            return
        with self._stream(stream):
            for h, s_, n in pieces:
                if to_host:
                    host[h : h + n].copy_(slot[s_ : s_ + n], non_blocking=True)
                else:
                    slot[s_ : s_ + n].copy_(host[h : h + n], non_blocking=True)

    def _run_batch(self, b: _DmaBatch, layer: int, to_host: bool) -> None:
        """``layer``'s pieces of ``b``: cache -> host on the D2H stream (``to_host``) or host ->
        cache on the H2D stream, as one ``cudaMemcpyBatchAsync``; on a CPU cache the same pieces
        by ``memmove``, synchronously."""
        if self._batch_rt is not None:
            cache, host, sizes = b.pointers(layer)
            stream = self.d2h_stream if to_host else self.h2d_stream
            if to_host:
                self._batch_rt.memcpy_batch(host, cache, sizes, b.count, stream.cuda_stream)
            else:
                self._batch_rt.memcpy_batch(cache, host, sizes, b.count, stream.cuda_stream)
            return
        for c, h, n in b.pieces(layer):
            if to_host:
                ctypes.memmove(h, c, n)
            else:
                ctypes.memmove(c, h, n)

    def _probe_gates(self) -> bool:
        """Whether the driver's stream wait on a pinned flag works here (one wait on a flag that
        is already set); otherwise streamed loads wait for each layer's read on the host."""
        fn = _cu_stream_wait_value32()
        if fn is None:
            log.warning("kvkernels: cuStreamWaitValue32 not found: streamed SSD loads wait on the host")
            return False
        self._gate_probe = torch.full((1,), GATE_READ, dtype=torch.int32, pin_memory=True)  # outlives the wait
        rc = fn(self.h2d_stream.cuda_stream, self._gate_probe.data_ptr(), GATE_READ, _CU_STREAM_WAIT_VALUE_GEQ)
        if rc != 0:
            log.warning("kvkernels: cuStreamWaitValue32 on pinned memory failed (CUresult %d): streamed SSD "
                        "loads wait on the host", rc)
            return False
        return True

    def _gate(self, ent: HostEntry, layer: int) -> None:
        """Before the H2D of ``layer`` of a streamed entry: on the GPU, the H2D stream waits for the
        layer's flag (no host wait); on CPU (or without the driver call) the host waits. A layer
        already read (its flag is set before its event) needs neither."""
        assert ent.layer_read is not None  # (a streamed entry: prefetch made its gates)
        if ent.layer_read[layer].is_set():
            return
        if self._gpu_gates:
            assert ent.gate is not None
            rc = _cu_stream_wait_value32()(self.h2d_stream.cuda_stream, ent.gate.data_ptr() + 4 * layer, GATE_READ,
                                           _CU_STREAM_WAIT_VALUE_GEQ)
            if rc == 0:
                return
            log.warning("kvkernels: cuStreamWaitValue32 failed (CUresult %d): waiting on the host", rc)
        ent.layer_read[layer].wait()

    def _event(self):
        return torch.cuda.Event() if self.cuda else _NullEvent()

    def _compute_stream(self):
        """The caller's current stream on the cache's device. Not ``torch.cuda.current_stream``:
        its device-index resolution (lazy init, availability and environment checks) cost more
        than the rest of a layer's bookkeeping on the H100 host of 2026-11-23 (profile:
        pipeline_issue_profile.txt); the same two C calls it ends in, with the index known."""
        if not self.cuda:
            return _NullStream()
        sid, dev, kind = torch._C._cuda_getCurrentStream(self._device_index)
        return torch.cuda.Stream(stream_id=sid, device_index=dev, device_type=kind)

    def _compute(self):
        """The compute stream as :meth:`_record` / :meth:`_wait` take it: with ``stream_api="cudart"``
        only its handle (``torch._C._cuda_getCurrentRawStream``, the call Triton's launcher makes;
        no torch ``Stream`` object built per layer), else :meth:`_compute_stream`."""
        if self._rt is not None and self.cuda and _RAW_CURRENT is not None:
            return _Handle(_RAW_CURRENT(self._device_index))
        return self._compute_stream()

    def _stream(self, s):
        """``with torch.cuda.stream(s)``, without its device guards where the stream's device is
        the current one (always, for a pipeline driven from its cache's device; otherwise torch's
        context, which also switches devices)."""
        if not self.cuda:
            return contextlib.nullcontext()
        if torch._C._cuda_getDevice() != s.device_index:
            return torch.cuda.stream(s)
        return _OnStream(s)

    def _chunks(self, n: int):
        for a in range(0, n, self.chunk_blocks):
            yield a, min(n, a + self.chunk_blocks)

    def _pieces(self, f: StagingFormat, cfmt: StagingFormat, layer: int, a: int) -> tuple[tuple[int, int, int], ...]:
        """``(host offset, slot offset, nbytes)`` of the copies that move blocks ``a..`` of ``layer``
        between the host entry (format ``f``) and a slot (format ``cfmt``): one per K/V entry,
        merged where both sides are contiguous (a whole layer in one slot: one copy). Each DMA
        costs a fixed setup; on the H100 32 per-layer pairs of 8.4 MB copies reached 75 % of one
        large copy."""
        return _copy_pieces(f, cfmt, layer, a, 0, cfmt.num_blocks, self.layout.num_kv)

    def _share_a_slot(self, entries) -> bool:
        """Several requests whose blocks fit one slot together: one gather / scatter for all."""
        return len(entries) > 1 and sum(ent.fmt.num_blocks for ent in entries) <= self.chunk_blocks

    def _take_slot(self, direction: str) -> int:
        s = self._slot_next[direction]
        self._slot_next[direction] = (s + 1) % self.num_slots
        return s

    def _ids(self, block_ids, name: str, *, unique: bool = False) -> torch.Tensor:
        """Ids on the cache device for the pack stream (the only stream that reads them): host ids
        are range-checked (and, with ``unique``, checked for duplicates) where they are, then
        copied on that stream through pinned memory (no host sync, no race with the kernels).
        Device ids are not read back (a sync): the kernels skip ids outside the cache and count
        them (``kvkernels.check_errors``)."""
        if isinstance(block_ids, torch.Tensor) and block_ids.device.type != "cpu" and (
                block_ids.is_contiguous() or not self.cuda):
            try:  # no copy (a tensor on another GPU is refused)
                ids = ops.as_block_ids(block_ids, self.layout)
            except (TypeError, ValueError) as exc:
                raise _named(exc, name) from None
        elif isinstance(block_ids, torch.Tensor) and block_ids.device.type != "cpu":
            # a strided device tensor: made contiguous on the pack stream, after the caller's
            # stream has produced it (rare: one fresh event)
            made = torch.cuda.Event()
            made.record(self._compute_stream())
            self.pack_stream.wait_event(made)
            with self._stream(self.pack_stream):
                try:
                    ids = ops.as_block_ids(block_ids, self.layout)
                except (TypeError, ValueError) as exc:
                    raise _named(exc, name) from None
            # the caller's tensor is read on the pack stream, maybe after the caller dropped it:
            # its memory must not go back to the compute stream's allocations before that
            assert isinstance(self.pack_stream, torch.cuda.Stream)  # (a strided device tensor: a CUDA cache)
            block_ids.record_stream(self.pack_stream)
        else:
            host = self._host_ids(block_ids, name, unique=unique)
            with self._stream(self.pack_stream):
                ids = ops._to_cache_device(host, self.layout)
            if ids is block_ids:  # a CPU cache keeps the caller's own tensor: later layers read it
                ids = ids.clone()  # after this call returns, so they get a copy of what was checked
        check(ids.numel() > 0, name, "at least one block id", "an empty list")
        if self.cuda:
            assert isinstance(self.pack_stream, torch.cuda.Stream)
            ids.record_stream(self.pack_stream)
        return ids

    def _host_ids(self, block_ids, name: str, *, unique: bool = False) -> torch.Tensor:
        """Host ids (a sequence of ints or a CPU tensor) as a CPU int64 tensor, range-checked (and
        with ``unique``, checked for duplicates); never empty."""
        try:
            host = ops._ids_tensor(block_ids)
            ops._validate_ids(host, self.layout, unique=unique)
        except (TypeError, ValueError) as exc:
            raise _named(exc, name) from None
        check(host.numel() > 0, name, "at least one block id", "an empty list")
        return host.to(torch.int64)

    @staticmethod
    def _host_ids_key(block_ids):
        """What identifies host ids across layers: their values (a list, a tuple or a CPU tensor:
        a version counter would miss writes through ``.numpy()`` and does not exist for inference
        tensors, which is what vLLM's forward holds); None for device tensors (used as they are)."""
        if type(block_ids) in (list, tuple):  # what vLLM passes: no ABC check (~0.6 us a call)
            return tuple(block_ids)
        if isinstance(block_ids, torch.Tensor):  # (not 1-D: refused, named, by _host_ids)
            return tuple(block_ids.tolist()) if block_ids.device.type == "cpu" and block_ids.dim() == 1 else None
        if isinstance(block_ids, Sequence) and not isinstance(block_ids, (str, bytes)):
            return tuple(block_ids)  # any sequence _ids_tensor takes (a range, an array.array)
        return None

    def _save_ids(self, key, block_ids) -> tuple[torch.Tensor | _DmaPlan, tuple | None]:
        """``(device ids or a _DmaPlan, host key)`` of one layer's save: host ids equal to the
        previous layer's (``HostEntry.save_ids``) are not converted and copied again (host key
        None then: nothing to store); new host ids come with the key to store beside their copy
        (``copy_mode="dma"``: their plan, checked but not copied; with padding, device ids for
        the gather, which writes zero blocks)."""
        hk = self._host_ids_key(block_ids)
        ent = self._saving.get(key)
        if hk is not None and ent is not None and ent.save_ids is not None and ent.save_ids[0] == hk:
            return ent.save_ids[1], None
        if hk is not None and self.copy_mode == "dma":
            host = self._host_ids(block_ids, f"saves[{key!r}]")
            arr = host.numpy()
            if not (arr < 0).any():
                return _DmaPlan(arr, self.layout.byte_strides[0], self.layout.chunk_nbytes), hk
        return self._ids(block_ids, f"saves[{key!r}]"), hk

    def _ensure_open(self):
        if self._closed:
            raise RuntimeError("LayerPipeline is closed")

    # ------------------------------------------------------------------ save (offload)
    def _entry_for_save(self, key, n: int, layer: int) -> HostEntry | None:
        ent = self._saving.get(key)
        if ent is not None and layer in ent.layers_done:
            # a layer seen twice: the key's last save stopped part way (its step raised) and this
            # is a new one; the old entry can never complete
            self._abandon_save(key, ent, "stopped part way: a new save of the key began")
            ent = None
        if ent is not None:
            check(ent.fmt.num_blocks == n, "saves", f"{ent.fmt.num_blocks} blocks for key {key!r} (as at its first layer)", n)
            return ent
        failed = self._saves_failing.get(key)
        if failed is not None and layer in failed:
            del self._saves_failing[key]  # a layer seen twice: a new save of the key (the last one stopped)
        elif failed is not None:  # no host memory at its first layer: the whole save stays failed
            failed.add(layer)
            if len(failed) == self.layout.num_layers:
                del self._saves_failing[key]
            return None
        fmt = StagingFormat.for_layout(self.layout, n)
        with self._lock:  # re-saving a key: its old host copy goes first if nothing reads it
            old = self.entries.get(key)
            if old is not None and not self._in_use(old):
                del self.entries[key]
                self._release(old)  # a D2H still writing it is ordered before ours (same stream)
        off = self._alloc_host(fmt.nbytes)
        if off is None:
            self._forget_older(key)
            self._note_failed_save(key)
            if self.layout.num_layers > 1:  # its later layers must not start a partial entry
                self._saves_failing[key] = {layer}
            return None
        with self._lock:
            old = self.entries.pop(key, None)
            if old is not None:
                self._drop(old)  # still read by a restore, a prefetch or an SSD put: freed later
            ent = HostEntry(key=key, fmt=fmt, offset=off, buf=self.pool.view(off, fmt.nbytes))
            _zero_region_padding(ent.buf, fmt)  # no copy writes it, and the SSD copy must not carry stale bytes
            self.entries[key] = ent
        self._saving[key] = ent
        with self._lock:
            self._failed_saves.pop(key, None)  # the set reports each key's latest save
        return ent

    # (keys: Any, not Hashable: Mapping's key type is invariant, and a dict[str, ...] is no Mapping[Hashable, ...])
    def save_layer(self, layer: int, saves: Mapping[Any, object]) -> None:
        """Offload ``layer`` of each request in ``saves`` (``{key: src_block_ids}``).

        Call after the compute stream has produced the layer's KV (vLLM: ``save_kv_layer``).
        Issues work on side streams and returns; it never waits for the host. The same key must
        be saved for every layer with the same number of blocks; the entry completes when all
        layers have been saved (see :meth:`get_finished`).
        """
        self._ensure_open()
        check_int(layer, "layer", lo=0, hi=self.layout.num_layers - 1)
        _check_mapping(saves, "saves")
        if not saves:
            return
        self._check_device()
        # every key's ids and block count are checked before anything is issued: a bad call
        # raises with nothing issued, and every save it names misses this layer, so each of
        # them fails for the rest of its step (never completed from a mix of two steps)
        checked: list[tuple[Hashable, torch.Tensor | _DmaPlan, tuple | None]] = []
        try:
            for key, block_ids in saves.items():
                cur = self._saving.get(key)
                # a key the store refuses (its put would fail after a whole step of copies):
                # checked when its save starts (a save under way passed the check)
                if cur is None:
                    self._check_key(key, f"saves[{key!r}]")
                ids, host_key = self._save_ids(key, block_ids)
                if cur is not None and layer not in cur.layers_done:
                    check(cur.fmt.num_blocks == ids.numel(), "saves",
                          f"{cur.fmt.num_blocks} blocks for key {key!r} (as at its first layer)", ids.numel())
                checked.append((key, ids, host_key))
        except BaseException:
            self._fail_call(layer, saves)
            raise
        self._record(self._ready["save"], self._compute())  # layer's KV is final here
        todo: list[tuple[Hashable, HostEntry, torch.Tensor | _DmaPlan]] = []
        try:
            for key, ids, host_key in checked:
                ent = self._entry_for_save(key, ids.numel(), layer)
                if ent is None:
                    continue
                if host_key is not None:  # new host ids (even in the same tensor, on a CPU cache)
                    ent.save_ids = (host_key, ids)
                    if not isinstance(ids, _DmaPlan):  # the shared gather's memo holds gather ids only
                        self._batch_ids = None
                todo.append((key, ent, ids))
        except BaseException:  # not expected (checked above): nothing of this call is issued
            self._fail_call(layer, saves)
            raise
        if not todo:
            return
        dma = [t for t in todo if isinstance(t[2], _DmaPlan)]
        gather = [t for t in todo if not isinstance(t[2], _DmaPlan)] if dma else todo
        try:
            self._issue_saves(layer, todo, gather, dma)
        except BaseException:  # a launch or DMA that could not be issued (JIT, runtime)
            self._fail_saves(layer, todo)
            raise
        finally:
            if gather:
                self._record(self._gathered, self.pack_stream)
                self._save_pending = True
            if dma:
                self._record(self._dma_read, self.d2h_stream)
                self._dma_pending = True

    def _fail_call(self, layer: int, keys) -> None:
        """A ``save_layer`` call that raised before issuing: every key it names fails its save
        (reported in ``failed_saves``; a save under way is abandoned, a save not begun is
        ignored for the rest of its step, as one that found no host memory)."""
        for key in keys:
            cur = self._saving.get(key)
            if cur is not None:
                self._abandon_save(key, cur, f"not issued at layer {layer} (its save_layer call raised)")
            else:
                first = key not in self._saves_failing  # (else its older copies went at the first failure)
                if first:
                    self._forget_older(key)
                self._note_failed_save(key, forget=first)
            if layer + 1 < self.layout.num_layers:
                self._saves_failing[key] = set(range(layer + 1))
            else:
                self._saves_failing.pop(key, None)

    def _fail_saves(self, layer: int, todo) -> None:
        """The saves of ``todo`` could not be issued at ``layer``: reported in ``failed_saves``,
        their entries dropped (never completed from a mix of two saves), and the key's later
        layers of this save ignored, as for a save that found no host memory."""
        for key, ent, _ in todo:
            self._abandon_save(key, ent, f"could not be issued at layer {layer}")
            if layer + 1 < self.layout.num_layers:
                self._saves_failing[key] = set(range(layer + 1))

    def _forget_older(self, key) -> None:
        """A new save of ``key`` failed before it had an entry: the key's older entry leaves the
        pool too (freed once nothing uses it), so neither ``get_finished`` nor a restore gives an
        older save in place of the failed latest one (its SSD copy: :meth:`_note_failed_save`)."""
        with self._lock:
            old = self.entries.pop(key, None)
            if old is not None:
                self._drop(old)

    def _forget_ssd(self, key) -> None:
        """Queue the removal of ``key``'s SSD copy on the writer thread (after any put of it
        queued there, before any later save's put); a prefetch of the key waits for it."""
        remove = getattr(self.store, "remove", None)
        if remove is not None and self._store_takes(key):  # (a key it refuses has no copy there)
            def run():
                try:
                    remove(key)
                except Exception as exc:  # noqa: BLE001 - a closed or failing store: logged, nothing waits on it
                    log.warning("kvkernels: could not remove the SSD copy of %r after its new save failed: %s",
                                key, exc)

            try:
                fut = self._io_writes.submit(run)
            except RuntimeError:  # the pipeline is closing: its writer takes nothing more
                return
            with self._lock:  # a prefetch of the key reads only after it (see prefetch's run)
                self._ssd_removals[key] = fut
            fut.add_done_callback(lambda f: self._removal_done(key, f))

    def _check_key(self, key, name: str | None = None) -> None:
        """Raise the store's error for a key it refuses (``check_key``; a store without it takes
        any), prefixed with ``name`` when given."""
        if self._check_store_key is None:
            return
        try:
            self._check_store_key(key)
        except (TypeError, ValueError) as exc:
            raise (_named(exc, name) if name else exc) from None

    def _store_takes(self, key) -> bool:
        """Whether the store takes ``key``."""
        try:
            self._check_key(key)
            return True
        except (TypeError, ValueError):
            return False

    def _removal_done(self, key, fut: Future) -> None:
        with self._lock:
            if self._ssd_removals.get(key) is fut:
                del self._ssd_removals[key]

    def _abandon_save(self, key, ent: HostEntry, why: str) -> None:
        """Drop a save under way (reported in ``failed_saves``). Its region goes back to the pool
        only once the D2H copies already queued into it are done (a fresh event on the D2H
        stream, see ``_in_use``): a prefetch writes a region from a host thread at once. If the
        event cannot be recorded (a failing runtime), the region is never reused."""
        if self._saving.get(key) is ent:
            del self._saving[key]
        try:
            ev = self._event()
            ev.record(self.d2h_stream if self.cuda else None)
        except Exception:
            log.exception("kvkernels: a failed save's copies cannot be tracked; its host region is not reused")
            ev = None
        reusable = ev is not None
        with self._lock:  # "failed" and its event together: a prefetch on another thread that saw
            # the state without the event could free the region under the queued D2H copies
            ent.state, ent.error, ent.save_ids = "failed", f"save {why}", None
            if ev is not None:
                ent.done_event = ev
            if self.entries.get(key) is ent:
                del self.entries[key]
                if reusable:
                    self._drop(ent)
        self._note_failed_save(key)

    def _issue_saves(self, layer: int, todo, gather, dma) -> None:
        """``layer`` of ``todo`` (``[(key, entry, ids)]``): the ``dma`` part as one batched DMA
        straight from the blocks (:meth:`_save_dma`); the ``gather`` part gathered + D2H, all in
        one gather when they fit one slot together (one launch per layer however many
        requests), else request by request in slot-sized chunks. Then the entries that have all
        their layers get their done event."""
        if dma:
            self._wait(self.d2h_stream, self._ready["save"])
            self._save_dma(layer, dma)
        if gather:
            self._wait(self.pack_stream, self._ready["save"])
        entries = [ent for _, ent, _ in gather]
        if self._share_a_slot(entries):
            self._save_together(layer, gather, sum(ent.fmt.num_blocks for ent in entries))
        else:
            for _, ent, ids in gather:
                f = ent.fmt
                for a, b in self._chunks(f.num_blocks):
                    cfmt = StagingFormat.for_layout(self.layout, b - a, (layer,))
                    slot = self._gather_to_slot(ids if b - a == f.num_blocks else ids[a:b], cfmt)
                    self._dma(ent.buf, self._slots["save"][slot], self._pieces(f, cfmt, layer, a), to_host=True)
                    self._record(self._slot_free["save"][slot], self.d2h_stream)
        for key, ent, _ in todo:
            ent.layers_done.add(layer)
            if len(ent.layers_done) == self.layout.num_layers:
                ev = self._event()
                ev.record(self.d2h_stream if self.cuda else None)
                ent.done_event = ev
                del self._saving[key]
                ent.save_ids = None
                if self.store is not None:
                    ent.ssd_future = self._io_writes.submit(self._write_to_store, ent, time.monotonic())

    def _save_dma(self, layer: int, dma) -> None:
        """``layer`` of the dma-mode saves ``[(key, entry, plan)]``: one batched DMA from the
        cache's blocks into the entries (the D2H stream waited for the layer's KV). The batch's
        pieces are reused while the same plans come back (every layer of a step)."""
        sig = tuple((ent, plan) for _, ent, plan in dma)
        b = self._save_batch
        if b is None or len(b.sig) != len(sig) or any(x[0] is not y[0] or x[1] is not y[1] for x, y in zip(b.sig, sig)):
            b = self._save_batch = _DmaBatch(sig, sig, self.layout.num_kv, self._base_tab)
        self._run_batch(b, layer, to_host=True)

    def _gather_to_slot(self, ids: torch.Tensor, cfmt: StagingFormat) -> int:
        """Gather ``ids`` (format ``cfmt``) into the next save slot on the pack stream and make
        the D2H stream wait for it; returns the slot (the caller issues its DMAs, then records
        the slot free on the D2H stream)."""
        s = self._take_slot("save")
        self._wait(self.pack_stream, self._slot_free["save"][s])  # its last DMA is done
        with self._stream(self.pack_stream):
            # checked once in __init__ (slots, backend, cap) and in _ids: the launch alone
            ops._gather_into(self.layout, ids, cfmt, self._slots["save"][s], self._kernels, self.max_ctas)
        packed = self._slot_filled["save"][s]
        self._record(packed, self.pack_stream)
        self._wait(self.d2h_stream, packed)
        return s

    def _save_together(self, layer: int, todo, total: int) -> None:
        """One gather of every request's blocks of ``layer`` (ids concatenated; the concatenation
        is reused while the same id tensors come back, i.e. for every layer of a step), then each
        request's K and V runs of the slot to its entry."""
        # reused while the same requests come back with the same host-id copies as at the last
        # layer (save_layer drops the memo whenever a request's host ids change; it holds the
        # copies, so their identity is theirs alone); a caller's device tensors are
        # concatenated each layer
        own = all(ent.save_ids is not None and ent.save_ids[1] is ids for _, ent, ids in todo)
        sig = tuple(ids for _, _, ids in todo) if own else None
        memo = self._batch_ids
        if sig is None or memo is None or memo[0] is None or len(memo[0]) != len(sig) or \
                any(a is not b for a, b in zip(memo[0], sig)):
            with self._stream(self.pack_stream):  # the ids are ready on the pack stream
                cat = torch.cat([ids.to(torch.int64) for _, _, ids in todo])
            memo = self._batch_ids = (sig, cat)
        cfmt = StagingFormat.for_layout(self.layout, total, (layer,))
        s = self._gather_to_slot(memo[1], cfmt)
        slot = self._slots["save"][s]
        off = 0
        for _, ent, _ in todo:
            # the request's runs: its blocks at ``off`` in the slot shared by all of them
            self._dma(ent.buf, slot, _copy_pieces(ent.fmt, cfmt, layer, 0, off, ent.fmt.num_blocks, self.layout.num_kv),
                      to_host=True)
            off += ent.fmt.num_blocks
        self._record(self._slot_free["save"][s], self.d2h_stream)

    def _write_to_store(self, ent: HostEntry, queued: float):
        """Background thread: wait for the entry's DMA (off the step path), then put it."""
        assert ent.done_event is not None  # (recorded before the write was queued)
        ent.done_event.synchronize()
        # reads before writes: wait for a gap, within a bound counted from when the write was
        # queued (one writer thread: a per-write bound would let a backlog of k saves wait k times)
        with self._io_cv:
            deadline = queued + WRITE_MAX_DELAY_S
            while self.read_priority and self._reads_inflight > 0 and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._io_cv.wait(timeout=min(0.05, left))
        from kvkernels.io import EntryMeta  # the store issue's metadata

        meta = EntryMeta.for_layout(self.layout, ent.fmt.num_blocks)
        return self.store.put(ent.key, ent.buf, meta).result()

    def wait_for_save(self) -> None:
        """Make the compute stream wait until every issued gather has *read* the cache (so the
        blocks may be reused by later kernels); a stream wait, not a host wait (vLLM:
        ``wait_for_save``). DMA and SSD completion are reported by :meth:`get_finished`.

        It ends the step, as in vLLM: a save that has not had all its layers by now (its step
        stopped part way: an exception in the forward) is abandoned and reported in
        :attr:`failed_saves` — otherwise its host region stayed held (a save under way is never
        evicted) until a save of the same key, which an aborted request never makes."""
        self._check_device()
        for key, ent in list(self._saving.items()):
            self._abandon_save(key, ent, f"incomplete when its step ended ({len(ent.layers_done)} of "
                               f"{self.layout.num_layers} layers saved before wait_for_save)")
        self._saves_failing.clear()  # a failed save's later layers belong to the step just ended
        if self._save_pending or self._dma_pending:
            compute = self._compute()
            if self._save_pending:  # the pack stream runs in order: its last gather's event covers all
                self._wait(compute, self._gathered)
                self._save_pending = False
            if self._dma_pending:  # the same for dma-mode saves on the D2H stream
                self._wait(compute, self._dma_read)
                self._dma_pending = False

    # ------------------------------------------------------------------ load (restore)
    def prefetch(self, key, *, num_blocks: int) -> "Future[HostEntry]":
        """Read entry ``key`` (``num_blocks`` blocks) from the SSD store into the host pool, in
        the background (vLLM: the async part of a load, before the step). The future resolves
        to the :class:`HostEntry` (state ``ready`` or ``failed``). A key already in the pool is
        not read again: while a prefetch reads it, the future is that prefetch's (done when the
        read is, so a done future means the entry is in host memory or failed); else it gives
        the entry as it is (``saved``, ``ready``, or ``saving`` while a save of it is under way;
        ``start_load`` restores it once complete); one held there with another number of blocks
        is a ``ValueError``."""
        self._ensure_open()
        if self.store is None:
            fail("store", "a KVStore to prefetch from", None)
        check_int(num_blocks, "num_blocks", lo=1)  # as saves and loads: at least one block
        self._check_key(key)
        fmt = StagingFormat.for_layout(self.layout, num_blocks)
        num_layers = self.layout.num_layers
        with self._lock:
            ent = self.entries.get(key)
            if ent is not None and ent.state != "failed":
                check(ent.fmt.num_blocks == num_blocks, "num_blocks",
                      f"{ent.fmt.num_blocks}, the blocks of key {key!r} in the host pool ({ent.state})", num_blocks)
            if ent is not None and ent.state == "loading" and ent.read_future is not None:
                return ent.read_future  # being read: done when that read is (not at once)
            if ent is not None and (ent.state in ("saved", "ready", "loading", "saving") or ent.users):
                fut: Future = Future()  # present (or failed and still read by a load: retry later)
                fut.set_result(ent)
                return fut
            if ent is not None:  # a failed earlier read: its pool region goes back before the retry
                del self.entries[key]
                self._drop(ent)  # (freed once nothing uses it: _in_use checks its copies' event)
            # the gates first: a pinned allocation that fails (host memory short) after the pool
            # region was taken would have lost the region
            gates = torch.zeros(num_layers, dtype=torch.int32, pin_memory=self._gpu_gates)
            off = self._alloc_host(fmt.nbytes)
            if off is None:
                fail("host_bytes", f"room for {fmt.nbytes} more bytes in the host pool", f"{self.pool.free_bytes} free")
            # the caller gets a future of its own that is already running: cancelling the executor's
            # queued future skipped run(), and its finally, for good (the entry stayed "loading",
            # its region held, its gates shut, and every later SSD write waited WRITE_MAX_DELAY_S)
            done: Future = Future()
            done.set_running_or_notify_cancel()
            ent = HostEntry(key=key, fmt=fmt, offset=off, buf=self.pool.view(off, fmt.nbytes), state="loading",
                            gate=gates, layer_read=[threading.Event() for _ in range(num_layers)], read_future=done)
            self.entries[key] = ent
        assert ent.gate is not None  # (made just above, as its layer_read)
        gate = ent.gate.numpy()  # plain stores from the reading thread

        def region(layer: int) -> torch.Tensor:
            return ent.buf[fmt.region_offset(layer) : fmt.region_offset(layer) + fmt.region_nbytes]

        def run():
            # one read per group of layers, all queued at once (the store keeps its queue depth),
            # gates released in layer order as the groups complete
            errors: list[str] = []
            assert ent.layer_read is not None  # (made with the entry, above)
            try:
                reads: list[tuple[list[int], Future | Exception]] = []
                header = getattr(self.store, "header", None)
                refused: Exception | None
                refused, h = None, None
                try:  # (a header that cannot be read fails the entry, as a failed read does)
                    h = header(key) if header is not None else None
                    if header is not None and h is None:
                        # not stored: a miss, also when a put lands before the reads (unchecked, unpinned)
                        refused = KeyError(key)
                    elif h is not None:
                        why = self._stored_mismatch(h, num_blocks)
                        refused = None if why is None else ValueError(why)
                except Exception as exc:  # noqa: BLE001 - e.g. a store closed meanwhile
                    refused, h = exc, None
                # every group reads the version whose header was checked: a put of the key
                # meanwhile fails the later groups (a miss) instead of mixing two versions' layers
                pin = {} if h is None else {"expect": h}
                for g in _layer_groups(num_layers):
                    if refused is not None:  # e.g. fewer blocks stored: short reads would leave stale bytes
                        reads.append((g, refused))
                        continue
                    try:
                        reads.append((g, self.store.get(key, out=[region(l) for l in g], layers=g, **pin)))
                    except Exception as exc:  # noqa: BLE001 - a refused read fails its layers
                        reads.append((g, exc))
                for g, r in reads:
                    try:
                        if isinstance(r, Exception):
                            raise r
                        r.result()
                        ok = True
                    except Exception as exc:  # noqa: BLE001 - any read error fails the layers, never the step
                        errors.append(f"{type(exc).__name__}: {exc}")
                        ok = False
                    for l in g:
                        if not ok:  # never restore stale pool bytes (another request's KV) or a torn read
                            region(l).zero_()
                            ent.error = errors[0]
                        gate[l] = GATE_READ if ok else GATE_FAILED
                        ent.layer_read[l].set()
            finally:
                for l in range(num_layers):  # whatever happened, no stream or thread waits forever
                    if not ent.layer_read[l].is_set():
                        region(l).zero_()
                        gate[l] = GATE_FAILED
                        ent.layer_read[l].set()
                        errors = errors or ["read aborted"]
                ent.state = "failed" if errors else "ready"
                if errors:
                    ent.error = errors[0]
                with self._io_cv:
                    self._reads_inflight -= 1
                    self._io_cv.notify_all()
            return ent

        def job():
            try:
                done.set_result(run())
            except BaseException as exc:  # noqa: BLE001 - delivered through the future
                done.set_exception(exc)

        def submit() -> bool:
            """Queue the read (counted in flight from here); False, the entry failed, when
            close() has shut the readers down meanwhile: nothing is left loading."""
            with self._io_cv:
                self._reads_inflight += 1
            try:
                self._io_reads.submit(job)
                return True
            except RuntimeError:
                with self._io_cv:
                    self._reads_inflight -= 1
                    self._io_cv.notify_all()
                with self._lock:
                    mine = self.entries.get(key) is ent  # else a save of the key replaced it: dropped there
                    if mine:
                        del self.entries[key]
                    ent.state, ent.error = "failed", "LayerPipeline is closed"
                    gate[:] = GATE_FAILED
                    assert ent.layer_read is not None  # (made with the entry, above)
                    for e in ent.layer_read:
                        e.set()
                    if mine:  # (dropped twice, its region was freed twice: two entries could get it)
                        self._drop(ent)  # (a restore may have taken the entry while it waited: freed after it)
                return False

        with self._lock:
            removal = self._ssd_removals.get(key)
        if removal is not None:
            # the key's older SSD copy is being removed (its new save failed): the read is queued
            # once that is done, holding no reader thread meanwhile and not counted as a read in
            # flight (the writes queued ahead of the removal must not wait for it)
            def after_removal(_f: Future) -> None:
                if not submit():
                    done.set_result(ent)

            removal.add_done_callback(after_removal)
            return done
        if not submit():
            raise RuntimeError("LayerPipeline is closed") from None
        return done

    def _stored_mismatch(self, h, num_blocks: int) -> str | None:
        """Why the store's entry with header ``h`` is not what ``prefetch(key, num_blocks=)``
        expects (blocks, shape, dtype, raw scheme), or None."""
        from kvkernels.io import EntryMeta

        want = EntryMeta.for_layout(self.layout, num_blocks)
        if h.meta != want:
            return f"stored entry {h.meta} is not the {want} asked for"
        return None

    # (keys: Any, as save_layer's)
    def start_load(self, loads: Mapping[Any, object], *, asynchronous: bool = False) -> None:
        """Begin restoring ``{key: dst_block_ids}`` layer by layer (vLLM: ``start_load_kv``).

        Each key must be in the host pool: saved earlier, or prefetched from SSD — ready, or
        still being read (a streamed load: each layer's copy waits on the GPU for that layer's
        read, see the module docstring). A key that is missing or whose read already failed does
        not restore: its destination block ids are reported by
        :meth:`get_block_ids_with_load_errors` and nothing is written to them. A streamed read
        that fails part way writes zeros for the layers whose read failed (never stale or torn
        bytes), restores the others, and reports all the key's destination blocks (after the
        step, through the same getter; the key is not reported loaded).
        Issues the first ``prefetch_depth`` layers and returns without waiting. Bad arguments
        raise before anything is issued or changed; a failure after the checks (an allocation, a
        runtime call) raises with every restore of the call reported as a load error, none left
        half started.

        ``asynchronous=True``: the destination blocks are not read by the forward running now
        (vLLM's asynchronous loads, ``load_kv_async``, started after the forward is launched and
        reported through ``finished_recving``). Every layer is issued at once on streams of its
        own (behind the compute queued so far: the blocks are free), the compute stream is
        never made to wait for them (``wait_for_layer_load`` waits for nothing during such a
        restore), and a key is reported by :meth:`get_finished` once its copies are done — its
        blocks must not be read before that. Each key must be wholly in host memory: an entry
        still being read from SSD is refused (``ValueError``; wait for its ``prefetch`` future),
        so no copy on the side streams ever waits for the disk. Such restores run on an H2D and
        a pack stream of their own with ``num_slots`` load slots of their own, allocated by the
        first call (if that allocation fails, the call raises having changed nothing).
        """
        self._ensure_open()
        _check_mapping(loads, "loads")
        if not isinstance(asynchronous, (bool, np.bool_)):
            fail("asynchronous", "True or False", repr(asynchronous), TypeError)
        self._check_device()
        if asynchronous:
            with self._lock:
                for key in loads:
                    ent = self.entries.get(key)
                    check(ent is None or ent.state != "loading", f"loads[{key!r}]",
                          "an entry in host memory for an asynchronous restore (wait for its prefetch)",
                          "an entry still being read from SSD")
        # (key, device ids, host ids as a tuple or None): the host values once, for the cross-request
        # check and for what a failure reports
        hks = {key: self._host_ids_key(block_ids) for key, block_ids in loads.items()}
        # copy_mode="dma": every restore's ids on the host (device ids are not read back: a sync),
        # so the layers go as batched DMAs straight into the blocks; else all through the slots
        dma = self.copy_mode == "dma" and all(hk is not None for hk in hks.values())
        if asynchronous and self.cuda:
            # a device tensor of ids may be the caller's own (a block table rewritten in place on
            # the compute stream next step) and nothing orders the compute after an asynchronous
            # restore: its scatters (and a failure's report) read a copy made here, on the
            # compute stream, before anything later the caller queues there
            loads = {k: v.clone(memory_format=torch.contiguous_format)
                     if isinstance(v, torch.Tensor) and v.device.type == "cuda" else v for k, v in loads.items()}
        side = self._async_side if asynchronous else contextlib.nullcontext
        with side():  # an asynchronous restore's ids are copied on its own pack stream
            checked = [(key, self._host_ids(block_ids, f"loads[{key!r}]", unique=True) if dma
                        else self._ids(block_ids, f"loads[{key!r}]", unique=True), hks[key], block_ids)
                       for key, block_ids in loads.items()]
        self._check_distinct_destinations(checked)
        if self._loads and self._last_waited < self.layout.num_layers - 1:
            try:
                self._finish_issuing_loads()  # a previous load not waited to the end
            except BaseException:  # it could not be issued (reported): this call's restores neither
                for key, ids, hk, given in checked:
                    self._note_load_error(key, hk if hk is not None else given)
                raise
        self._loads = []
        self._loads_pending = None
        self._load_events = {}
        self._next_load_layer = 0
        self._last_waited = -1
        self._loads_async = bool(asynchronous)
        handled: set = set()  # keys of this call already restoring or reported failed
        with side():
            try:
                self._begin_loads(checked, handled, dma)
                if asynchronous:  # every layer now (its entries are in host memory: no read to wait for)
                    self._finish_issuing_loads()
            except BaseException:  # e.g. an allocation or a runtime call failing after the checks: no
                # restore of this call is left half started (its entries in use, to be issued by the
                # next call into blocks the caller was told were not restored); all are load errors
                for key, ids, hk, given in checked:
                    if key not in handled:
                        self._note_load_error(key, hk if hk is not None else given)
                self._fail_loads()
                raise

    def _begin_loads(self, checked, handled: set, dma: bool) -> None:
        """``start_load`` after its checks: the entries taken into use, the first layers issued."""
        start = self._ready["load"]
        self._record(start, self._compute())  # earlier users of the destination blocks are done
        self._wait(self.h2d_stream, start)
        self._wait(self.pack_stream, start)
        with self._lock:  # a prefetch on another thread may evict an entry between its check and its use
            for key, ids, hk, given in checked:
                ent = self.entries.get(key)
                ok = (ent is not None and ent.state in ("saved", "ready", "saving", "loading")
                      and ent.fmt.num_blocks == ids.numel())
                # (``ent is not None`` below: implied by ok, spelled out for the type checker)
                if ok and ent is not None and ent.state == "loading" and self._loads_async:
                    ok = False  # (a prefetch of a missing key began since the check: never gate on the disk)
                if ok and ent is not None and ent.state == "saving":
                    ok = len(ent.layers_done) == self.layout.num_layers
                # what a failure reports: host ids as given (their device copy is still queued on the
                # pack stream); device ids are read back off the step path, in the getter
                err = hk if hk is not None else given
                handled.add(key)
                if not ok:
                    self._note_load_error(key, err)
                    continue
                assert ent is not None  # (ok)
                ent.users += 1  # (listed at once: a failure below gives the use back through _fail_loads)
                self._loads.append((ent, ids, ent.state == "loading", err))  # streamed: gate each layer
                if ent.done_event is not None and self.cuda:
                    self._wait(self.h2d_stream, ent.done_event)  # a save of it still in flight
        # several restores that fit one slot together: one scatter per layer for all of them
        self._load_cat = None
        self._load_batch = None
        if dma:
            parts = [(ent, _DmaPlan(ids.numpy(), self.layout.byte_strides[0], self.layout.chunk_nbytes))
                     for ent, ids, *_ in self._loads]
            self._load_batch = _DmaBatch(None, parts, self.layout.num_kv, self._base_tab)
        elif self._share_a_slot([ent for ent, *_ in self._loads]):
            with self._stream(self.pack_stream):  # the ids are ready on the pack stream
                self._load_cat = torch.cat([ids.to(torch.int64) for _, ids, *_ in self._loads])
        for _ in range(min(self.prefetch_depth, self.layout.num_layers)):
            self._issue_load_layer()

    @contextlib.contextmanager
    def _async_side(self):
        """Run an asynchronous restore's work on its own H2D and pack streams and its own load
        slots (``num_slots`` more device slots of ``slot_bytes``, allocated at the first one): the
        restore methods read the streams and slots
        from these attributes, swapped in for the call's duration (the step-path calls come from
        one thread)."""
        if self._async_slots is None:
            dev = self.layout.device
            free = [self._event() for _ in range(self.num_slots)]
            filled = [self._event() for _ in range(self.num_slots)]
            if self.cuda:
                for ev in (*free, *filled):
                    ev.record(self._async_streams[1])  # creates the CUDA event (as the constructor's)
            # (dma mode uses slots too, for restores given device ids)
            slots = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=dev) for _ in range(self.num_slots)]
            self._async_slots = [slots, free, filled, 0]
        a = self._async_slots
        kept = (self.h2d_stream, self.pack_stream, self._slots["load"], self._slot_free["load"],
                self._slot_filled["load"], self._slot_next["load"])
        try:
            self.h2d_stream, self.pack_stream = self._async_streams
            self._slots["load"], self._slot_free["load"], self._slot_filled["load"], self._slot_next["load"] = a
            yield
        finally:
            a[3] = self._slot_next["load"]
            (self.h2d_stream, self.pack_stream, self._slots["load"], self._slot_free["load"],
             self._slot_filled["load"], self._slot_next["load"]) = kept

    def _finish_issuing_loads(self, *, wait_reads: bool = True) -> None:
        """Issue the current restore's layers not issued yet (a restore not waited to the end)
        and order the compute after them. Its last layers' copies (scatters on the pack stream,
        dma copies on the H2D stream) come before the compute's next kernels and before a next
        load's copies, which may be on the other stream (dma after gather): the compute waits for
        both streams (stream waits, no host wait) — except after an asynchronous restore (issued
        whole by ``start_load`` through here), which nothing on the compute waits for.
        ``wait_reads=False`` (``get_finished``, which
        never blocks): a streamed layer whose SSD read is not in yet and that only a host wait
        could gate (CPU, or no ``cuStreamWaitValue32``) is left with the rest for a later call."""
        issued = False
        while self._loads and self._next_load_layer < self.layout.num_layers:
            if not wait_reads and not self._gpu_gates and any(
                    streamed and ent.layer_read is not None and not ent.layer_read[self._next_load_layer].is_set()
                    for ent, _, streamed, _ in self._loads):
                break
            self._issue_load_layer()
            issued = True
        # also when every layer was issued already (prefetch_depth) but not all were waited for
        if issued or wait_reads or self._last_waited < self._next_load_layer - 1:
            self._record(self._finished_off, self.pack_stream)
            self._wait(self.h2d_stream, self._finished_off)
            self._record(self._finished_off, self.h2d_stream)
            if not self._loads_async:  # nothing on the compute waits for an asynchronous restore
                self._wait(self._compute(), self._finished_off)
            self._last_waited = max(self._last_waited, self._next_load_layer - 1)

    def _check_distinct_destinations(self, checked) -> None:
        """Restores of one step must not share a destination block (restored together, they
        would race in one scatter). Checked across the requests that pass host ids (within one
        request ``_ids`` checks); device ids are not read back."""
        hks = [(key, hk) for key, _, hk, _ in checked if hk is not None]
        if len(hks) < 2:
            return
        seen: dict[int, Hashable] = {}
        total = sum(len(hk) - hk.count(-1) for _, hk in hks)
        if len(set(itertools.chain.from_iterable(hk for _, hk in hks)) - {-1}) == total:
            return
        for key, hk in hks:
            for x in hk:
                if x >= 0 and seen.setdefault(x, key) != key:
                    fail("loads", "distinct destination block ids across the requests",
                         f"block {x} in loads[{seen[x]!r}] and loads[{key!r}]")

    def _issue_load_layer(self) -> None:
        layer = self._next_load_layer
        if layer >= self.layout.num_layers:
            return
        self._next_load_layer += 1
        try:
            self._issue_load_layer_work(layer)
        except BaseException:  # a launch or DMA that could not be issued (JIT, runtime)
            self._fail_loads()
            raise

    def _fail_loads(self) -> None:
        """Issuing a restore's layer failed: every current restore is reported failed (its
        destination blocks through :meth:`get_block_ids_with_load_errors`, never as loaded) and
        no further layer is issued. Their entries stay in use (not evictable, gates kept) until
        the copies already issued are done: a fresh event behind both side streams, polled by
        :meth:`get_finished` like a finished restore's."""
        loads, self._loads, self._load_cat, self._load_batch = self._loads, [], None, None
        self._next_load_layer = self.layout.num_layers
        queued, self._loads_pending = self._loads_pending, None
        if queued is not None and any(item is queued for item in self._pending_loads):
            # every layer was issued and the completion is queued already (what failed came after:
            # ordering the streams): report them failed through that item, whose event keeps the
            # entries in use until their copies are done. A second item decremented `users` twice
            # (in use for ever) and reported the keys failed and then loaded
            entries = queued[1]
            for i, (ent, err) in enumerate(entries):
                if err is not None:
                    self._note_load_error(ent.key, err)
                    entries[i] = (ent, None)
            return
        if not loads:
            return
        for ent, *_, err in loads:
            self._note_load_error(ent.key, err)
        try:
            ev = self._event()
            if self.cuda:
                assert isinstance(self.h2d_stream, torch.cuda.Stream)
                copied = torch.cuda.Event()
                copied.record(self.h2d_stream)
                self.pack_stream.wait_event(copied)
                ev.record(self.pack_stream)
                # the layer's scatters already queued (earlier requests) are ordered before the
                # compute's next use of those blocks: a stream wait, as wait_for_layer_load's
                self._compute_stream().wait_event(ev)
        except Exception:  # the runtime itself is failing: the entries stay in use (never reused)
            log.exception("kvkernels: restore failed and its completion cannot be tracked")
            return
        self._pending_loads.append((ev, [(ent, None) for ent, *_ in loads]))

    def _issue_load_layer_work(self, layer: int) -> None:
        if not self._loads:  # nothing to restore (start_load({})): no event, so the compute waits
            return  # for nothing (a pack-stream event would order it after the saves' gathers)
        done_on = self.pack_stream  # the stream whose work completes the layer
        if self._load_batch is not None:
            for ent, _, streamed, _ in self._loads:
                if streamed:
                    self._gate(ent, layer)  # the layer's bytes are in the host pool (or zeroed on failure)
            self._run_batch(self._load_batch, layer, to_host=False)
            done_on = self.h2d_stream
        elif self._load_cat is not None:
            self._load_together(layer)
        else:
            for ent, ids, streamed, _ in self._loads:
                f = ent.fmt
                if streamed:
                    self._gate(ent, layer)  # the layer's bytes are in the host pool (or zeroed on failure)
                for a, b in self._chunks(f.num_blocks):
                    cfmt = StagingFormat.for_layout(self.layout, b - a, (layer,))
                    s, slot = self._load_slot()
                    self._dma(ent.buf, slot, self._pieces(f, cfmt, layer, a), to_host=False)
                    self._scatter_slot(s, ids if b - a == f.num_blocks else ids[a:b], cfmt)
        if layer == self.layout.num_layers - 1 and self._loads:
            # a fresh event (torch's API: it has no handle yet): get_finished polls it, and a
            # reused one would report only the latest restore's record — a restore started
            # every step could then never be seen finished. The entries stay in use (not
            # evictable, their pool regions and gates untouched) until get_finished sees it
            ev = self._event()
            ev.record(done_on if self.cuda else None)
            self._loads_pending = (ev, [(ent, err) for ent, _, _, err in self._loads])
            self._pending_loads.append(self._loads_pending)
        else:
            ev = self._layer_loaded[layer]
            self._record(ev, done_on)
        self._load_events[layer] = ev

    def _load_slot(self) -> tuple[int, torch.Tensor]:
        """The next load slot, once its last scatter is done (the H2D stream waits for it)."""
        s = self._take_slot("load")
        self._wait(self.h2d_stream, self._slot_free["load"][s])
        return s, self._slots["load"][s]

    def _scatter_slot(self, s: int, ids: torch.Tensor, cfmt: StagingFormat) -> None:
        """After the H2D copies into load slot ``s``: the pack stream waits for them, scatters
        ``ids`` (format ``cfmt``), and the slot is free once that is done."""
        copied = self._slot_filled["load"][s]
        self._record(copied, self.h2d_stream)
        self._wait(self.pack_stream, copied)
        with self._stream(self.pack_stream):
            ops._scatter_from(self._slots["load"][s], self.layout, ids, cfmt, self._kernels, self.max_ctas)
        self._record(self._slot_free["load"][s], self.pack_stream)

    def _load_together(self, layer: int) -> None:
        """Every restore's ``layer`` into one slot (one H2D per K/V run of each entry), then one
        scatter with the concatenated destination ids (``start_load``; destinations must be
        distinct across the restores, as within one)."""
        for ent, _, streamed, _ in self._loads:
            if streamed:
                self._gate(ent, layer)  # the layer's bytes are in the host pool (or zeroed on failure)
        assert self._load_cat is not None  # (called when _begin_loads concatenated the ids)
        cfmt = StagingFormat.for_layout(self.layout, self._load_cat.numel(), (layer,))
        s, slot = self._load_slot()
        off = 0
        for ent, *_ in self._loads:
            # the request's runs: its blocks at ``off`` in the slot shared by all of them
            self._dma(ent.buf, slot, _copy_pieces(ent.fmt, cfmt, layer, 0, off, ent.fmt.num_blocks, self.layout.num_kv),
                      to_host=False)
            off += ent.fmt.num_blocks
        self._scatter_slot(s, self._load_cat, cfmt)

    def wait_for_layer_load(self, layer: int) -> None:
        """Make the compute stream wait for ``layer``'s restore (a stream wait, not a host wait)
        and issue layer ``layer + prefetch_depth`` (vLLM: ``wait_for_layer_load``)."""
        check_int(layer, "layer", lo=0, hi=self.layout.num_layers - 1)
        self._ensure_open()  # close() unpinned the pool: no DMA may start from it any more
        if self._loads_async:  # every layer is issued and the forward does not read these blocks
            return
        self._check_device()
        while self._next_load_layer <= layer:  # waited out of order: issue up to it
            self._issue_load_layer()
        self._last_waited = max(self._last_waited, layer)
        ev = self._load_events.get(layer)
        if ev is not None:
            self._wait(self._compute(), ev)
        target = layer + self.prefetch_depth
        while self._next_load_layer <= min(target, self.layout.num_layers - 1):
            self._issue_load_layer()

    # ------------------------------------------------------------------ completion
    def get_finished(self) -> tuple[set, set]:
        """``(saved_keys, loaded_keys)`` completed since the last call; polls events, never
        blocks (vLLM: ``get_finished``). A save is finished when its DMA (and SSD write, with a
        store) is done; keys whose save could not get host memory are reported as saved-failed
        through :attr:`failed_saves`. A restore whose layers were not all waited for (its last
        layers maybe not issued) is issued to the end here, the compute stream ordered after it
        (stream waits), so it completes and is reported — up to a streamed layer whose SSD read
        is not in yet where only a host wait could gate it (CPU, no ``cuStreamWaitValue32``):
        those are issued by a later call (or by the next ``start_load``), never waited for here.

        Both sets speak of each key's *latest* save, as :attr:`failed_saves` does: a new save of a
        key replaces its entry, so an earlier save of it not yet reported is not reported (its
        blocks were free once its gather ran; with ``copy_mode="dma"``, once ``wait_for_save``
        returned) — the new save's outcome is."""
        # not waited to its last layer (an unissued layer implies that: waiting issues up to it),
        # the same test as start_load's
        if self._loads and self._last_waited < self.layout.num_layers - 1 and not self._closed:
            self._check_device()  # the issuing below may call the runtime directly (cudart, dma)
            try:
                self._finish_issuing_loads(wait_reads=False)
            except Exception:  # noqa: BLE001 - a layer that could not be issued: its restores are
                log.exception("kvkernels: finishing a restore's layers failed")  # reported as load errors
        saved = set()
        with self._lock:
            for key, ent in list(self.entries.items()):
                if ent.state != "saving" or ent.done_event is None or not ent.done_event.query():
                    continue
                if ent.ssd_future is not None:
                    if not ent.ssd_future.done():
                        continue
                    if ent.ssd_future.exception() is not None:
                        ent.error = repr(ent.ssd_future.exception())
                        self._note_failed_save(key)  # (the store kept the older copy: removed)
                ent.state = "saved"
                saved.add(key)
        loaded = set()
        still = []
        for ev, loads in self._pending_loads:
            if not ev.query():
                still.append((ev, loads))
                continue
            for ent, err in loads:
                ent.users -= 1  # its H2D copies have run: the entry may be evicted now
                if err is None:  # a restore that failed while being issued: reported already
                    continue
                if self._read_failed(ent):  # a streamed read failed part way: its blocks are not valid
                    self._note_load_error(ent.key, err)
                else:
                    loaded.add(ent.key)
        self._pending_loads = still
        if self._orphans:
            self._reap()
        return saved, loaded

    @staticmethod
    def _read_failed(ent: HostEntry) -> bool:
        """Whether a prefetched entry has a layer whose read failed. Read from the gates, which are
        final before the restore could pass them (``state`` is set a moment after the last gate
        opens, so a finished restore may still see ``loading``)."""
        if ent.gate is None:
            return ent.state == "failed"
        return bool((ent.gate.numpy() == GATE_FAILED).any())

    def _note_failed_save(self, key, *, forget: bool = True) -> None:
        """Every failed save of ``key`` comes here: reported in :attr:`failed_saves` and, with
        ``forget``, the key's older SSD copy removed (:meth:`_forget_ssd`: a prefetch must never
        give an older save in place of the failed latest one)."""
        if forget:
            self._forget_ssd(key)
        with self._lock:  # take_failed_saves may run on another thread (a connector's)
            _note_latest(self._failed_saves, key, FAILED_SAVES_KEPT)

    @property
    def failed_saves(self) -> set:
        """Keys whose latest save failed (no host memory, not issued, a failed SSD put); a key
        leaves the set when a new save of it starts or :meth:`take_failed_saves` returns it.
        The latest :data:`FAILED_SAVES_KEPT` keys are kept."""
        with self._lock:
            return set(self._failed_saves)

    def take_failed_saves(self) -> set:
        """:attr:`failed_saves`, emptied: for a caller that polls each step (a connector reports
        each failed save once)."""
        with self._lock:
            out, self._failed_saves = set(self._failed_saves), {}
        return out

    def _note_load_error(self, key, ids) -> None:
        """A restore of ``key`` into ``ids`` that failed: for both getters."""
        if isinstance(ids, torch.Tensor) and ids.device.type != "cpu":
            host = None
        else:  # host values: folded now (no sync), so they never pile up
            host = [int(x) for x in (ids.tolist() if isinstance(ids, torch.Tensor) else ids) if x >= 0]
        with self._lock:  # (take_failed_loads may run on a connector's thread)
            if host is None:
                self._load_errors.append(ids)
                if len(self._load_errors) > FAILED_LOADS_KEPT:
                    del self._load_errors[0]
                    if not self._warned_load_errors:
                        self._warned_load_errors = True
                        log.warning("kvkernels: more than %d failed restores with device ids not taken by "
                                    "get_block_ids_with_load_errors(): the oldest are dropped", FAILED_LOADS_KEPT)
            else:
                self._load_error_ids.update(host)
            _note_latest(self._failed_loads, key, FAILED_LOADS_KEPT)

    def take_failed_loads(self) -> set:
        """Keys whose restore failed since the last call (the same failures whose destination
        blocks :meth:`get_block_ids_with_load_errors` reports), emptied by this call. A failed
        restore is never reported loaded by :meth:`get_finished`; a connector whose framework wants
        failed loads reported per request (vLLM's ``finished_recving`` with ``failed_recving``)
        reads them here. Host only, never blocks. The latest :data:`FAILED_LOADS_KEPT` keys are
        kept between calls. Outcomes are per key: a key restored by two
        calls before :meth:`get_finished` reported the first is reported once per outcome (it may
        then be in both, each speaking of one restore)."""
        with self._lock:
            out, self._failed_loads = set(self._failed_loads), {}
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Destination block ids of loads that could not restore (missing / failed entries):
        nothing was written to them, except for a restore that failed part way (a streamed
        read that failed, written as zeros; a layer that could not be issued), whose blocks may
        hold some restored layers — never valid KV either way. Cleared by this call. Reads
        device ids back to the host (a sync: vLLM calls it right after launching the forward, so
        a connector passes host ids, as vLLM gives them)."""
        with self._lock:
            errors, self._load_errors = self._load_errors, []
            out, self._load_error_ids = self._load_error_ids, set()
        for ids in errors:
            # device ids: the caller's own tensor, or one whose copy preceded a restore that
            # get_finished saw complete
            out.update(int(x) for x in ids.cpu().tolist() if x >= 0)
        return out

    # ------------------------------------------------------------------ host pool management
    def _release(self, ent: HostEntry) -> None:
        self.pool.free(ent.offset, ent.fmt.nbytes)

    @staticmethod
    def _in_use(ent: HostEntry) -> bool:
        """Something may still read or write the entry's pool region: a restore not yet reported
        by get_finished, the prefetch filling it, the SSD put reading it, or its save's D2H
        copies (``done_event``: polled, never waited on)."""
        return (bool(ent.users) or ent.state == "loading" or (ent.ssd_future is not None and not ent.ssd_future.done())
                or (ent.done_event is not None and not ent.done_event.query()))

    def _drop(self, ent: HostEntry) -> None:
        """Free an entry already removed from ``entries`` (caller holds the lock), or park it
        until nothing uses its region (freed by :meth:`_reap`)."""
        if self._in_use(ent):
            self._orphans.append(ent)
        else:
            self._release(ent)

    def _reap(self) -> None:
        with self._lock:
            keep = []
            for ent in self._orphans:
                if self._in_use(ent):
                    keep.append(ent)
                else:
                    self._release(ent)
            self._orphans = keep

    def _alloc_host(self, nbytes: int) -> int | None:
        """A pool region for ``nbytes``, evicting finished entries if needed; None if none fits."""
        off = self.pool.alloc(nbytes)
        if off is None:
            self._reap()
            self._evict_for(nbytes)
            off = self.pool.alloc(nbytes)
        return off

    def _evict_for(self, nbytes: int) -> None:
        """Free finished entries (oldest first) until ``nbytes`` could fit — none when freeing
        all of them would not make one piece that large (an entry larger than the pool, or
        entries in use splitting it): a save that cannot fit anyway emptied the host cache."""
        need = _round_up(max(nbytes, 1), REGION_ALIGN)
        with self._lock:
            if self.pool.largest_free >= need:  # one piece must fit, not the sum of the pieces
                return
            victims: list[Hashable] = []
            regions: list[tuple[int, int]] = []
            for key, ent in self.entries.items():
                if ent.state in ("saved", "ready", "failed") and not self._in_use(ent):
                    victims.append(key)
                    regions.append((ent.offset, ent.fmt.nbytes))
                    if self.pool.largest_free_with(regions) >= need:
                        break
            else:
                return
            for key in victims:
                self._release(self.entries.pop(key))

    def evict(self, key) -> bool:
        """Drop ``key``'s host copy (not its SSD copy). False if absent or in use."""
        with self._lock:
            ent = self.entries.get(key)
            if ent is None or ent.state == "saving" or self._in_use(ent):
                return False
            del self.entries[key]
            self._release(ent)
            return True

    def close(self) -> None:
        """Wait for background SSD work and release the pool (a host wait: not on the step path).
        Idempotent; a call while another thread closes waits for it to finish (the exit hook
        must not close the stores under this pipeline's queued writes)."""
        with self._close_lock:
            if self._close_done:
                return
            self._closed = True  # first: a prefetch racing close() is refused, not left half-submitted
            if self._loads and self._next_load_layer < self.layout.num_layers:
                # a restore whose last layers were never issued (get_finished does not issue them
                # after close): reported failed, as a save left part way is, not left unreported
                # with its entry in use
                try:
                    self._fail_loads()
                except Exception:  # noqa: BLE001 - close() must still drain and release the pool
                    log.exception("kvkernels: reporting an unfinished restore at close() failed")
            self._io_reads.shutdown(wait=True)
            with self._io_cv:
                self._io_cv.notify_all()
            self._io_writes.shutdown(wait=True)
            if self.cuda:
                self._drain_streams()
            self.pool.release()  # after the drain: no DMA reads or writes it any more
            self._close_done = True

    def __enter__(self) -> LayerPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
