"""One LMCache chunk <-> one :class:`kvkernels.io.KVStore` entry: the I/O core shared by the
in-process plugin (``backend.py``) and the MP-mode L2 adapter (``l2_adapter.py``).

A chunk is a tensor ``[num_kv, L, T, H*D]`` (``KV_2LTD``: ``num_kv = 2``; MLA: 1). Its entry is
kvkernels' layer-contiguous staging format (docs/layouts.md): region ``l`` = ``K[l]`` then
``V[l]``, one checksum per region, so one layer can be read alone. How the bytes get there
depends on the entry's ``scheme``/``codec`` (recorded in its header; reads always follow the
header, never the current settings):

* ``raw``, contiguous CPU chunk (LMCache's allocator): **in place** — the store gets the views
  ``[[K[0], V[0]], [K[1], V[1]], ...]`` of the chunk and moves them with one vectored
  ``pwritev``/``preadv`` (O_DIRECT in place when 4 KiB aligned). No conversion copy. Such
  entries store exactly ``K[l]|V[l]`` per region (zero padded on disk).
* ``raw`` otherwise (CUDA chunks, ``inplace=False``): through a pooled, 4 KiB-aligned staging
  buffer (``kvkernels.gather``/``scatter`` for CUDA chunks, a strided copy for CPU ones); such
  entries store the padded region. A CUDA chunk's buffers are pinned (the kernels refuse
  pageable host memory for a CUDA cache), its put waits for the gather (a stream sync on the
  put thread) before the store checksums and writes, and a read's buffers go back to the pool
  after the scatter has run. LMCache 0.5.6 hands a plugin pinned CPU objects only.
* a codec (``zstd``), optionally after the byte-plane ``shuffle``: staging buffer, then
  :func:`kvkernels.compress.compress_regions` (one stream per region).
* ``fp8-token`` / ``fp8-block``: ``kvkernels.gather(..., quant="fp8")`` into a staging buffer
  (docs/quant.md), optionally followed by the codec; reads dequantize with
  ``kvkernels.scatter(..., quant="fp8")`` into the chunk's dtype.

No lmcache import here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Optional

import torch

from kvkernels.quant import FP8_SOURCE_DTYPES, scheme_args

from .convert import ChunkShape, chunk_layout, chunk_to_staging, staging_to_chunk

__all__ = ["BufferPool", "ChunkIO", "PendingRead", "shape_of_header", "fp8_granularity", "FP8_SOURCE_DTYPES",
           "run_windowed"]

#: an entry's dtype field for an opaque object's bytes: this prefix and a hash of its layout
OPAQUE_DTYPE_PREFIX = "obj:"


def fp8_granularity(scheme: str) -> Optional[str]:
    """``"token"``/``"block"`` for FP8 entries (scheme ``fp8-token``/``fp8-block``), else None.
    (FP8 applies to the chunk dtypes in ``FP8_SOURCE_DTYPES``; 8-bit chunks are stored as they are.)"""
    args = scheme_args(scheme)
    return args["granularity"] if args["quant"] else None


def shape_of_header(header) -> ChunkShape:
    """The chunk shape an entry decodes into; ``ValueError`` for entries that are not one chunk."""
    m = header.meta
    # (an opaque object of the L2 adapter: its bytes, its layout's hash in the dtype field)
    dtype = torch.uint8 if m.dtype.startswith(OPAQUE_DTYPE_PREFIX) else getattr(torch, m.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"stored dtype {m.dtype!r} is not a torch dtype")
    if m.num_blocks != 1 or m.num_kv not in (1, 2) or tuple(m.layers) != tuple(range(m.num_layers)):
        raise ValueError("entry was not written from an LMCache chunk")
    return ChunkShape(m.num_kv, m.num_layers, m.block_size, m.num_heads, m.head_dim, dtype)


def run_windowed(n: int, start, finish, window: int) -> None:
    """``start(i)`` for ``i < n`` with at most ``window`` started and unfinished; ``finish(i, started)``
    in **completion order**.

    ``start`` returns an object with a ``future`` attribute (or None: nothing to wait for).
    Completion order matters: finishing in submission order let one slow read hold the window
    while the store's workers ran dry (a 32-chunk restore ran ~10 % below LocalDiskBackend's on
    the CPU host, all of the gap in this loop).
    """
    from concurrent.futures import FIRST_COMPLETED, wait

    inflight: dict = {}  # future -> (i, started)
    i = 0
    while i < n or inflight:
        while i < n and len(inflight) < window:
            st = start(i)
            if st is not None:
                inflight[st.future] = (i, st)
            i += 1
        if inflight:
            done, _ = wait(list(inflight), return_when=FIRST_COMPLETED)
            for f in done:
                j, st = inflight.pop(f)
                finish(j, st)


class BufferPool:
    """Reusable 4 KiB-aligned staging buffers (fresh 32 MiB buffers page-fault on first touch).

    At most ``keep`` buffers are kept *in all*, across sizes: the least recently given size's
    go first. (Kept per size, a server's pool grew by a size for every token count a prompt's
    last chunk ever had: a soak run held 516 MiB for 256 sizes of a small model, ~8 GiB for
    Llama-3-8B's 32 MiB chunks.)"""

    def __init__(self, keep: int):
        from kvkernels.io import aligned_empty

        self._new = aligned_empty
        self._keep = keep
        self._free: OrderedDict[tuple[int, bool], list[torch.Tensor]] = OrderedDict()  # oldest size first
        self._held = 0
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """Buffers kept for reuse now (at most ``keep``)."""
        return self._held

    def take(self, nbytes: int, pin: bool = False) -> torch.Tensor:
        """``pin``: page-locked (a CUDA chunk's gather or scatter reads or writes it through UVA;
        ``kvkernels.gather``/``scatter`` refuse pageable host memory for a CUDA cache)."""
        with self._lock:
            lst = self._free.get((nbytes, pin))
            if lst:
                self._held -= 1
                buf = lst.pop()
                if not lst:
                    del self._free[(nbytes, pin)]
                return buf
        return self._new(nbytes, pin=pin)

    def give(self, buf: torch.Tensor, pin: bool = False) -> None:
        if self._keep <= 0:
            return
        with self._lock:
            k = (buf.numel(), pin)
            self._free.setdefault(k, []).append(buf)
            self._free.move_to_end(k)
            self._held += 1
            while self._held > self._keep:
                old = next(iter(self._free))
                lst = self._free[old]
                lst.pop(0)
                self._held -= 1
                if not lst:
                    del self._free[old]

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._held = 0


@dataclass
class PendingRead:
    """A started read (:meth:`ChunkIO.start_read`); finish it with :meth:`ChunkIO.finish_read`."""

    header: Any
    shape: ChunkShape
    fmt: Any  # StagingFormat or QuantStagingFormat of the regions read
    buf: Optional[torch.Tensor]  # staging buffer (None: read in place)
    future: Future
    key: Any = None  # the store key (an entry that does not decode is removed under it)
    pinned: bool = False  # buf (and the decoder's buffer) are pinned: `out` is a CUDA chunk


class ChunkIO:
    """Store and load LMCache chunks through a :class:`~kvkernels.io.KVStore` (module docs).

    Parameters
    ----------
    store : KVStore
    inplace : bool
        Raw contiguous CPU chunks go by vectored I/O straight from/into the chunk.
    keep : int
        Staging buffers kept for reuse, in all (:class:`BufferPool`).
    """

    def __init__(self, store, *, inplace: bool = True, keep: int = 8):
        self.store = store
        self.inplace = bool(inplace)
        self.bufs = BufferPool(keep)

    # ------------------------------------------------------------------ helpers
    def _inplace(self, t: torch.Tensor, meta, shape: ChunkShape) -> bool:
        return (self.inplace and t.device.type == "cpu" and t.is_contiguous() and meta.codec == "none"
                and meta.scheme == "raw" and shape.contiguous_layers)

    @staticmethod
    def regions(t: torch.Tensor, shape: ChunkShape, layers=None) -> list[list[torch.Tensor]]:
        """``[[K[l] bytes, V[l] bytes] for l in layers]``: uint8 views into chunk ``t``, no copy."""
        per_kv = [kv.unbind(0) for kv in t.view(torch.uint8).view(shape.num_kv, shape.num_layers, -1).unbind(0)]
        by_layer = [list(p) for p in zip(*per_kv)]  # unbind: ~4x cheaper than indexing in a loop
        return by_layer if layers is None else [by_layer[l] for l in layers]

    # ------------------------------------------------------------------ put
    def put(self, key: str, t: torch.Tensor, shape: ChunkShape, meta) -> tuple[Future, bool]:
        """Start storing chunk ``t`` (``shape.torch_shape``) under ``key`` with ``meta``.

        Returns ``(future, holds_source)``: the store's future (of the written header), and
        whether the write reads ``t`` itself (in place: ``t`` must stay valid and unchanged until
        the future is done). When ``holds_source`` is False the bytes were already copied (or
        quantized) into a staging buffer, which goes back to the pool when the write is done.
        May block on the store's back pressure (``max_inflight_bytes``).
        """
        if self._inplace(t, meta, shape):
            return self.store.put(key, self.regions(t, shape), meta), True
        fmt = meta.fmt
        gran = fp8_granularity(meta.scheme)
        if gran is not None:
            from kvkernels.quant import QuantStagingFormat

            fmt = QuantStagingFormat.from_staging(fmt, gran)
        # a CUDA chunk is packed by a kernel: into pinned host memory, and the store's threads
        # (checksum, write) read the buffer only once that kernel has run (it writes through
        # UVA, later, on the stream): an entry whose checksum matches bytes not yet written
        cuda = t.device.type == "cuda"
        buf = self.bufs.take(fmt.nbytes, pin=cuda)
        try:
            if gran is not None:
                import kvkernels

                kvkernels.gather(chunk_layout(t, shape), [0], out=buf, quant="fp8", granularity=gran)
            else:
                chunk_to_staging(t, shape, buf, fmt)
            if cuda:
                torch.cuda.current_stream(t.device).synchronize()
            if meta.codec != "none":
                from kvkernels.compress import compress_regions

                cs = compress_regions(buf, fmt, codec=meta.codec, byteshuffle=meta.scheme == "shuffle")
                fut = self.store.put(key, [r.contiguous() for r in cs.regions], meta)
            elif gran is not None:
                q = fmt.region_nbytes
                fut = self.store.put(key, [buf[j * q : (j + 1) * q] for j in range(fmt.num_regions)], meta)
            else:
                fut = self.store.put(key, buf, meta)
        except BaseException:
            if cuda:  # a kernel launched before the failure may still write it
                torch.cuda.current_stream(t.device).synchronize()
            self.bufs.give(buf, cuda)
            raise
        fut.add_done_callback(lambda _f: self.bufs.give(buf, cuda))
        return fut, False

    # ------------------------------------------------------------------ get
    def start_read(self, key: str, out: torch.Tensor, layers=None, order: str = "LTD") -> Optional[PendingRead]:
        """Start reading ``key`` (``layers``: default all) for chunk ``out``; None when absent.

        ``order``: how ``out`` holds the entry (:data:`~.convert.ORDERS`; a layer-wise object
        of one layer can take any of them). Raw entries whose regions hold exactly ``K[l]|V[l]``
        are read straight into ``out`` (vectored, no staging buffer) when ``out`` is a contiguous
        CPU tensor of the entry's shape and dtype whose layers are contiguous; others go through a
        pooled staging buffer. Raises ``ValueError`` for an entry that is not one chunk or does
        not fit ``order``.
        """
        header = self.store.header(key)
        if header is None:
            return None
        shape = shape_of_header(header).with_order(order)
        fmt = header.meta.fmt if layers is None else header.meta.fmt.with_layers(layers)
        payload = shape.payload_elems * shape.element_size
        sel = [r for r in header.regions if r.layer in fmt.layers]
        if (self._inplace(out, header.meta, shape) and out.shape == shape.torch_shape and out.dtype == shape.dtype
                and all(r.stored == payload for r in sel)):
            # fmt.layers (ascending), the order the destinations are built in: a list `out` is
            # filled in the order of `layers`
            fut = self.store.get(key, out=self.regions(out, shape, fmt.layers), layers=list(fmt.layers),
                                 expect=header)
            return PendingRead(header, shape, fmt, None, fut, key)
        gran = fp8_granularity(header.meta.scheme)
        if gran is not None:
            from kvkernels.quant import QuantStagingFormat

            fmt = QuantStagingFormat.from_staging(fmt, gran)
        pinned = out.device.type == "cuda"  # the scatter into a CUDA chunk reads it through UVA
        buf = self.bufs.take(fmt.nbytes, pin=pinned)
        q = fmt.region_nbytes
        try:
            dest = buf if gran is None else [buf[j * q : (j + 1) * q] for j in range(fmt.num_regions)]
            # dest's order (ascending); `expect`: the version `header` describes (the decode uses
            # its region sizes), a miss if a put of the key replaced it since
            fut = self.store.get(key, out=dest, layers=list(fmt.layers), expect=header)
        except BaseException:
            self.bufs.give(buf, pinned)
            raise
        return PendingRead(header, shape, fmt, buf, fut, key, pinned)

    def try_finish(self, pending: PendingRead, out: torch.Tensor) -> tuple[str, Optional[BaseException]]:
        """:meth:`finish_read` with the outcome classified for the callers' counters and logs:
        ``("ok", None)``, ``("missing", exc)`` (removed meanwhile), ``("corrupt", exc)`` (checksum
        or truncation: the store dropped the entry; or regions that do not decode: removed here
        unless a newer version replaced it or the store closed, as the message says)
        or ``("error", exc)`` (I/O, sizes).
        On anything but ``"ok"`` the bytes in ``out`` must not be used."""
        from kvkernels.io import CorruptEntryError

        try:
            self.finish_read(pending, out)
            return "ok", None
        except KeyError as exc:
            return "missing", exc
        except CorruptEntryError as exc:
            return "corrupt", exc
        except Exception as exc:
            return "error", exc

    def finish_read(self, pending: PendingRead, out: torch.Tensor) -> None:
        """Wait for a read and decode it into chunk ``out`` (only the layers read are written).

        Raises what the read raised: ``KeyError`` (removed meanwhile), ``CorruptEntryError``
        (checksum: the store dropped the entry), ``OSError``, codec errors. On any exception the
        bytes in ``out`` must not be used.
        """
        header, shape, fmt, buf = pending.header, pending.shape, pending.fmt, pending.buf
        extra = None
        try:
            pending.future.result()
            if buf is None:  # read in place
                return
            staging = buf
            m = header.meta
            if m.codec != "none":
                from kvkernels.compress import CompressedStaging, decompress_regions

                sel = [r for r in header.regions if r.layer in fmt.layers]
                cs = CompressedStaging.from_buffer(buf, fmt, [r.stored for r in sel], m.codec,
                                                   byteshuffle=m.scheme == "shuffle")
                extra = self.bufs.take(fmt.nbytes, pin=pending.pinned)
                try:
                    staging = decompress_regions(cs, out=extra)
                except ValueError as exc:
                    # the bytes passed the store's checksum but do not decode (e.g. an nvCOMP region
                    # without the kvkernels header of 2026-11-23, written by an older kvkernels):
                    # drop the entry so that it is stored again, instead of a miss on every read
                    fate = "kept (no key to remove it under)"
                    if pending.key is not None:  # that version only: a newer one put meanwhile stays
                        try:
                            fate = "removed" if self.store.remove(pending.key, expect=header) else \
                                "already removed or replaced"
                        except RuntimeError:  # the store closed meanwhile: its folder is not ours to edit
                            fate = "kept (the store closed meanwhile)"
                    from kvkernels.io import CorruptEntryError

                    raise CorruptEntryError(f"entry {pending.key!r} does not decode ({exc}); {fate}") from exc
            gran = fp8_granularity(m.scheme)
            if gran is not None:  # dequantize in one pass into the chunk's dtype
                import kvkernels

                layers_arg = fmt.layers if len(fmt.layers) < shape.num_layers else None
                kvkernels.scatter(staging, chunk_layout(out, shape), [0], layers=layers_arg, quant="fp8",
                                  granularity=gran)
            else:
                staging_to_chunk(staging, shape, out, fmt, layers=fmt.layers)
        finally:
            if pending.pinned and (buf is not None or extra is not None):
                # the scatter into the CUDA chunk reads the pooled host buffers on the stream:
                # they go back (to be refilled by the next read) only once it has run
                torch.cuda.current_stream(out.device).synchronize()
            if buf is not None:
                if pending.future.done():
                    self.bufs.give(buf, pending.pinned)
                else:  # interrupted while waiting (KeyboardInterrupt): the read still writes into
                    # it; pooled now, the next read would have been handed it (and its bytes)
                    held, pinned = buf, pending.pinned

                    def give_back(_done: Future) -> None:
                        self.bufs.give(held, pinned)

                    pending.future.add_done_callback(give_back)
            if extra is not None:
                self.bufs.give(extra, pending.pinned)
