"""``KVKernelsBackend``: an LMCache storage plugin writing through :class:`kvkernels.io.KVStore`.

Imports lmcache at module import: reach it through ``kvkernels.integrations.lmcache`` (which
imports this module lazily), or name this module directly in LMCache's config.

Contract with LMCache 0.5.6 (``StoragePluginInterface``, read from its storage manager):

* ``batched_submit_put_task`` returns at once. For every key that is neither stored nor being
  stored it takes one reference on the ``MemoryObj`` (``ref_count_up``; the storage manager drops
  its own right after the call), converts the chunk to the staging format on a plugin thread,
  writes through the store and drops the reference when the write is done (in place, the
  default: the store reads LMCache's memory itself; with ``inplace_io: false`` as soon as the
  staging copy is made), then calls ``on_complete_callback(key)`` once for
  that key (only when the entry is durable; exceptions from the callback are logged).
* ``get_blocking`` / ``batched_get_blocking`` / ``batched_get_non_blocking`` allocate the result
  from ``local_cpu_backend`` (the caller owns one reference) and return ``None`` (or a shorter
  prefix) on a miss, a corrupted entry (checksum mismatch: the store drops it) or a failed
  allocation: never wrong bytes.
* ``contains(key, pin=True)`` / ``batched_async_contains(..., pin=True)`` pin hits;
  ``batched_get_non_blocking`` releases the lookup's pins of the keys it was asked for
  (LocalDiskBackend takes and releases a pin of its own there and leaves the lookup's: here an
  asynchronous lookup's pins cannot outlive the get); the sync path unpins through
  ``StorageManager.batched_unpin``. Pinned entries are protected from
  the store's LRU eviction when the store offers ``pin``/``unpin``; otherwise pins are counted
  only and an entry evicted between lookup and retrieval is a miss (LMCache's prefix accounting
  handles that).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, List, Optional, Sequence

import torch

from lmcache.utils import CacheEngineKey, LayerCacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from .config import PluginConfigError, PluginSettings, environment_error, parse_extra_config
from kvkernels.io.store import close_before_stores_at_exit
from kvkernels.quant import store_scheme

from .chunk_io import FP8_SOURCE_DTYPES, ChunkIO, run_windowed, shape_of_header
from .convert import ChunkShape

__all__ = ["KVKernelsBackend", "key_string"]

log = logging.getLogger("kvkernels.integrations.lmcache")

# LMCache memory format of each chunk order (convert.ORDERS); "LTD" by K/V entries (2 or 1 = MLA)
_FORMATS = {("LTD", 2): MemoryFormat.KV_2LTD, ("LTD", 1): MemoryFormat.KV_MLA_FMT, ("T2D", 2): MemoryFormat.KV_T2D,
            ("2TD", 2): MemoryFormat.KV_2TD, ("TD", 1): MemoryFormat.KV_MLA_FMT}
# (MemoryFormat, tensor dims) of a chunk LMCache hands over -> its order (looked up with dims None
# for an object without a tensor: no such key, so no order)
_ORDER_OF: dict[tuple[MemoryFormat, Optional[int]], str] = {
    (MemoryFormat.KV_2LTD, 4): "LTD", (MemoryFormat.KV_MLA_FMT, 4): "LTD", (MemoryFormat.KV_MLA_FMT, 2): "TD",
    (MemoryFormat.KV_T2D, 3): "T2D", (MemoryFormat.KV_2TD, 3): "2TD"}
# the lookup id LMCache's synchronous layer-wise retrieve passes to batched_get_non_blocking
# (lmcache 0.5.6 storage_manager.py, layerwise_batched_get): every key it names must come back
_SYNC_LOOKUP_ID = "fake_lookup_id"
# how long a synchronous get (the layer-wise retrieve, get_blocking) waits for room in LMCache's CPU pool
_SYNC_ALLOC_WAIT_S = 2.0
# reads kept in flight per batched get: store queue depth x 4 (bounded staging memory for the
# reads that need a staging buffer; in-place reads use LMCache's own buffers)
_READ_WINDOW_PER_THREAD = 4


def _tag_value(v) -> list:
    """A tag value as ``[type name, value]``: numbers Python holds equal (``True``, ``1``,
    ``1.0``: LMCache's key equality and hash treat them as one) encode alike, as ``int``; a
    string stays apart from a number (``"7"`` is not ``7``)."""
    if isinstance(v, bool) or (isinstance(v, float) and v.is_integer()):
        v = int(v)
    return [type(v).__name__, v if v is None or isinstance(v, (str, int, float)) else repr(v)]


def key_string(key) -> str:
    """Store key of an LMCache key: ``lmcache/2:`` + a JSON list of every field of LMCache's key
    equality — model name, world size, worker id, chunk hash, dtype, the layer id of a
    ``LayerCacheEngineKey`` (null otherwise) and the tags, each tag value with its type name
    (numbers that compare equal, ``True`` / ``1`` / ``1.0``, as ``int``).

    ``CacheEngineKey.to_string`` is not used: its ``@`` / ``%`` separators are ambiguous (tags
    ``{user: "alice@b%c"}`` and ``{user: "alice", b: "c"}`` print alike, as do the tag values
    ``7`` and ``"7"``), so two keys LMCache keeps apart — two tenants, say — could share an
    entry. JSON quotes every string, so two keys map to the same entry exactly when LMCache
    considers them equal. The store hashes this string into the file name: a key never names a
    path.
    """
    tags = key.tags
    enc = None if tags is None else [[k, *_tag_value(v)] for k, v in tags]
    fields = [key.model_name, key.world_size, key.worker_id, key.chunk_hash, str(key.dtype),
              getattr(key, "layer_id", None), enc]
    return "lmcache/2:" + json.dumps(fields, separators=(",", ":"), ensure_ascii=False)


def _when_done(fut, fn) -> None:
    """``fn(fut)`` once the executor job behind ``fut`` is done — now when there is none or it is
    done already. Its outcome is retrieved (no "exception was never retrieved" for a job whose
    waiter was cancelled)."""
    if fut is None or fut.done():
        fn(fut)
        return

    def done(f):
        if not f.cancelled():
            f.exception()
        fn(f)

    fut.add_done_callback(done)


def _free_result(fut) -> None:
    """Give back the MemoryObj an abandoned allocation returned (if any)."""
    if fut is not None and not fut.cancelled() and fut.exception() is None and fut.result() is not None:
        fut.result().ref_count_down()


class KVKernelsBackend(StoragePluginInterface):
    """LMCache storage plugin: chunks stored as layer-addressable, checksummed kvkernels entries.

    Enabled by LMCache configuration alone (docs/lmcache.md)::

        storage_plugins: [kvkernels]
        extra_config:
          storage_plugin.kvkernels.module_path: kvkernels.integrations.lmcache
          storage_plugin.kvkernels.class_name: KVKernelsBackend
          kvkernels.paths: [/mnt/nvme0/kv, /mnt/nvme1/kv]
          kvkernels.capacity_bytes: 500000000000

    Parameters are LMCache's plugin constructor arguments. A bad ``kvkernels.*`` setting raises
    :class:`~kvkernels.integrations.lmcache.config.PluginConfigError` naming the key (and logs it
    at error level: LMCache itself only logs plugin failures).
    """

    def __init__(self, dst_device: str = "cpu", config=None, metadata=None, local_cpu_backend=None,
                 loop: Optional[asyncio.AbstractEventLoop] = None):
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        if getattr(metadata, "role", None) == "scheduler":
            # LMCache launches plugins in its scheduler process too (enable_scheduler_bypass_lookup):
            # a KVStore is one process per folder, so the scheduler's copy would answer lookups
            # from an index frozen at its start while the worker stores and evicts
            msg = ("kvkernels LMCache plugin: not supported in LMCache's scheduler role "
                   "(enable_scheduler_bypass_lookup): its store is owned by the worker process, and a "
                   "second process would answer lookups from a stale index; disable bypass lookup")
            log.error(msg)
            raise PluginConfigError(msg)
        if getattr(config, "use_layerwise", False) and getattr(config, "enable_blending", False):
            # LMCache 0.5.6's blending connector (VLLMBufferLayerwiseGPUConnector) copies every layer-0
            # hit's metadata.cached_positions into its position buffer; kvkernels entries do not carry
            # them, so each hit would fail that retrieve (TypeError on None) instead of missing
            msg = ("kvkernels LMCache plugin: not supported with use_layerwise + enable_blending: LMCache's "
                   "blending retrieve needs each chunk's cached_positions, which kvkernels entries do not "
                   "persist; disable blending or leave this plugin out of storage_plugins")
            log.error(msg)
            raise PluginConfigError(msg)
        try:
            extra = getattr(config, "extra_config", None) if config is not None else None
            self.settings: PluginSettings = parse_extra_config(extra)
            self._check_heads(self.settings, metadata)  # before the store opens: a refusal makes nothing
            from kvkernels.io import KVStore  # the store issue's front door

            s = self.settings
            worker = getattr(metadata, "worker_id", None)
            world = getattr(metadata, "world_size", None)
            self.store = KVStore(s.store_paths(worker, world), capacity_bytes=s.capacity_bytes, engine=s.engine,
                                 io_threads=s.io_threads, max_inflight_bytes=s.max_inflight_bytes,
                                 read_priority=s.read_priority, verify=s.verify, fsync=s.fsync)
        except PluginConfigError as exc:
            log.error("kvkernels LMCache plugin NOT created: %s", exc)
            raise
        except Exception as exc:
            log.error("kvkernels LMCache plugin NOT created: %s: %s", type(exc).__name__, exc)
            if environment_error(exc):  # (not the paths' fault)
                raise PluginConfigError(f"kvkernels LMCache plugin: {exc}") from exc
            raise PluginConfigError(f"kvkernels LMCache plugin: cannot open the store at "
                                    f"`kvkernels.paths`={list(self.settings.paths) if hasattr(self, 'settings') else '?'}: "
                                    f"{type(exc).__name__}: {exc}") from exc
        self._num_heads = self.settings.num_kv_heads or self._heads_from_metadata(metadata)
        self._layer_order = self._layerwise_order(config, metadata)
        self._layer_keys_per_chunk = self._layerwise_keys_per_chunk(config, metadata)
        self._metas: dict = {}
        self._lock = threading.Lock()
        self._put_tasks: dict[str, int] = {}
        self._held = 0  # bytes of LMCache chunks referenced by pending puts (bounded by max_pending_bytes when set)
        self._pins: dict[str, int] = defaultdict(int)
        self._lookup_pins: dict[str, Counter] = {}  # lookup id -> pins its batched_async_contains took
        self._store_pins = hasattr(self.store, "pin") and hasattr(self.store, "unpin")
        n_io = self.store.io_threads
        self._put_pool = ThreadPoolExecutor(self.settings.put_threads, thread_name_prefix="kvk-lmc-put")
        self._read_pool = ThreadPoolExecutor(max(2, n_io), thread_name_prefix="kvk-lmc-get")
        self._read_window = max(1, n_io * _READ_WINDOW_PER_THREAD)
        self.io = ChunkIO(self.store, inplace=self.settings.inplace_io,
                          keep=self.settings.put_threads + self._read_window + 2)
        self._warned: set[str] = set()
        self._closed = False  # refuses new work from the start of close()
        self._close_lock = threading.Lock()  # a second close() (the exit hook) waits for one under way
        self._close_done = False
        # StorageManager.close() closes LocalCPUBackend -- which frees the memory pool -- before the
        # plugins; puts and reads still in flight work on that pool (in-place I/O): drain them first
        close_pool = getattr(local_cpu_backend, "close", None)
        if callable(close_pool):
            def close_after_kvkernels(*args, **kwargs):
                self.close()
                return close_pool(*args, **kwargs)

            local_cpu_backend.close = close_after_kvkernels
        # closed at interpreter exit before the store (puts still queued in _put_pool are written)
        close_before_stores_at_exit(self)
        self.counters = {k: 0 for k in ("puts", "put_present", "put_skipped", "put_errors", "gets", "hits", "misses", "corrupt",
                                        "alloc_failures", "get_errors", "put_dropped_busy")}
        log.info("kvkernels LMCache plugin: store %s, engine %s, capacity %s, %d entries recovered",
                 self.store.paths, self.store.engine.name, self.settings.capacity_bytes, len(self.store))

    def __str__(self) -> str:
        return "KVKernelsBackend"

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _heads_from_metadata(metadata) -> int | None:
        shape = getattr(metadata, "kv_shape", None)
        try:
            return int(shape[3]) if shape is not None and len(shape) == 5 else None
        except (TypeError, ValueError, IndexError):
            return None

    @staticmethod
    def _check_heads(settings: PluginSettings, metadata) -> None:
        """``kvkernels.num_kv_heads`` against LMCache's ``kv_shape`` (num_layers, 2, chunk, H, D):
        a value that does not divide H*D gives every chunk one head (``ChunkShape.of``), so fp8
        takes one scale per token across all heads. With ``quant: fp8`` that is a
        ``PluginConfigError`` (LMCache then serves without the plugin, one ERROR line); without,
        the setting does nothing, said once. Skipped where K and V are not split (MLA: kv_shape[1]
        is 1, the latent has no heads) or there is no kv_shape. A value that divides H*D but is not
        kv_shape's H is taken (the scales then cover hidden / heads elements); with fp8 that is
        said at start."""
        heads = settings.num_kv_heads
        shape = getattr(metadata, "kv_shape", None)
        try:
            if not heads or shape is None or len(shape) != 5 or int(shape[1]) != 2:
                return
            hidden = int(shape[3]) * int(shape[4])
        except (TypeError, ValueError, IndexError):
            return
        if hidden % heads == 0:
            if settings.quant == "fp8" and heads != int(shape[3]):
                # it divides, so it is taken: each fp8 scale then covers hidden / heads elements, a
                # part of a head or several heads (coarser scales than per head lose accuracy)
                log.warning("kvkernels LMCache plugin: `kvkernels.num_kv_heads` %d differs from the %d heads of "
                            "LMCache's kv_shape %s: fp8 takes one scale per %s and %d elements (%s); leave it "
                            "out to follow LMCache's metadata", heads, int(shape[3]), tuple(shape),
                            "chunk" if settings.quant_granularity == "block" else "token", hidden // heads,
                            "several heads" if heads < int(shape[3]) else "part of a head")
            return
        what = (f"`kvkernels.num_kv_heads`: {heads} does not divide the hidden size {hidden} of LMCache's kv_shape "
                f"{tuple(shape)} ({shape[3]} heads)")
        if settings.quant == "fp8":
            raise PluginConfigError(f"{what}: fp8 would take one scale per token across all heads; leave it out, "
                                    "LMCache's metadata gives the heads")
        log.warning("kvkernels LMCache plugin: %s; it only shapes fp8 scales and is unused here (quant none)", what)

    def _warn_once(self, what: str, msg: str, *args) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg, *args)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _meta_for(self, shape: ChunkShape):
        meta = self._metas.get(shape)
        if meta is None:  # one per chunk shape: built and validated once
            meta = self._metas[shape] = self._new_meta(shape).validate()
        return meta

    def _new_meta(self, shape: ChunkShape):
        from kvkernels.io import EntryMeta

        s = self.settings
        # byte-plane shuffle is defined for 16-bit elements, FP8 for bf16/fp16/fp32: other chunks
        # are stored as they are (+ codec); an fp8 KV cache is never re-quantized
        scheme = store_scheme(quant=s.quant, shuffle=s.byteshuffle, granularity=s.quant_granularity, dtype=shape.dtype)
        if s.byteshuffle and shape.element_size != 2:
            self._warn_once(f"shuffle-{shape.dtype}", "kvkernels LMCache plugin: %s chunks are stored without "
                            "byte-plane shuffle (kvkernels.byteshuffle applies to 16-bit elements)", shape.dtype)
        if s.quant == "fp8" and shape.dtype not in FP8_SOURCE_DTYPES:
            self._warn_once(f"fp8-{shape.dtype}", "kvkernels LMCache plugin: %s chunks are stored as they are "
                            "(kvkernels.quant: fp8 applies to bf16/fp16/fp32)", shape.dtype)
        return EntryMeta(layers=tuple(range(shape.num_layers)), num_blocks=1, block_size=shape.num_tokens,
                         num_heads=shape.num_heads, head_dim=shape.head_dim, element_size=shape.element_size,
                         num_kv=shape.num_kv, num_layers=shape.num_layers,
                         dtype=str(shape.dtype).replace("torch.", ""), scheme=scheme, codec=s.compression)

    @staticmethod
    def _layerwise_order(config, metadata) -> Optional[str]:
        """The order of LMCache's layer-wise objects under this config, as its cache engine picks
        their MemoryFormat: ``KV_MLA_FMT`` ``[T, D]`` for MLA, else ``KV_T2D`` (``KV_2TD``, the
        blending format, is refused at construction); None when layer-wise mode is off."""
        if not getattr(config, "use_layerwise", False):
            return None
        return "TD" if getattr(metadata, "use_mla", False) else "T2D"

    @staticmethod
    def _layerwise_keys_per_chunk(config, metadata) -> Optional[int]:
        """Layer keys per chunk in LMCache's layer-wise mode: the ``keys_per_chunk`` its cache
        engine passes to ``async_lookup_and_prefetch`` (``metadata.kv_shape[0]``, its
        ``num_layers``); None when layer-wise mode is off or the shape is unknown."""
        if not getattr(config, "use_layerwise", False):
            return None
        try:
            n = int(metadata.kv_shape[0])
        except (AttributeError, TypeError, ValueError, IndexError):
            return None
        return n if n > 0 else None

    def _read_shape(self, key: CacheEngineKey, header) -> tuple[ChunkShape, MemoryFormat]:
        """Shape and MemoryFormat of the object a read of ``key`` fills: a layer key of layer-wise
        mode gets LMCache's layer-wise object; ``ValueError`` when the entry does not fit it."""
        order = self._layer_order if isinstance(key, LayerCacheEngineKey) and self._layer_order else "LTD"
        shape = shape_of_header(header).with_order(order)
        return shape, _FORMATS[(shape.order, shape.num_kv)]

    def _chunk_shape(self, obj: MemoryObj, t: Optional[torch.Tensor]) -> Optional[ChunkShape]:
        fmt = obj.get_memory_format()
        shapes = getattr(obj.metadata, "shapes", None)
        order = _ORDER_OF.get((fmt, None if t is None else t.dim()))
        if order is None or (shapes is not None and len(shapes) > 1):
            self._warn_once(f"fmt-{fmt}", "kvkernels LMCache plugin: MemoryFormat %s with tensor %s (or a multi-group "
                            "object) is not supported; such chunks are not stored (lookups miss)", fmt,
                            None if t is None else tuple(t.shape))
            return None
        assert t is not None  # (an order only with a tensor)
        try:
            shape = ChunkShape.of(t, self._num_heads, order)
        except ValueError:
            shape = None
        if shape is None or (order == "LTD" and t.shape[0] != (2 if fmt == MemoryFormat.KV_2LTD else 1)):
            self._warn_once(f"shape-{fmt}", "kvkernels LMCache plugin: unexpected %s tensor %s; not stored", fmt,
                            tuple(t.shape))
            return None
        if self._num_heads and shape.num_kv == 2 and shape.num_heads != self._num_heads and self.settings.quant == "fp8":
            # the heads do not divide this chunk's hidden size (no kv_shape to check them against at
            # start): stored with one head, so fp8 takes one scale per token across all heads
            self._warn_once(f"heads-{shape.num_heads * shape.head_dim}", "kvkernels LMCache plugin: %s heads do "
                            "not divide the hidden size %d: these chunks are stored as one head (one fp8 scale per "
                            "token across all heads); check `kvkernels.num_kv_heads`", self._num_heads,
                            shape.num_heads * shape.head_dim)
        return shape

    # ------------------------------------------------------------------ lookups
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        if self._closed:  # (LMCache may close its CPU backend, and so this plugin, and keep asking)
            return False  # a hit here would be a miss at every get
        ks = key_string(key)
        if pin and self._store_pins:
            return self._pin(ks)  # the store's pin is the hit test: no eviction between a check and the pin
        hit = self.store.contains(ks)
        if hit and pin:
            self._pin(ks)
        return hit

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return key_string(key) in self._put_tasks

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey], pin: bool = False) -> int:
        """Number of leading keys stored (prefix semantics); pins them when ``pin``, recorded under
        ``lookup_id`` so that ``batched_get_non_blocking`` of that lookup releases exactly those.

        Layer keys (layer-wise mode): only the hits of whole chunks are recorded. LMCache
        (``StorageManager.async_lookup_and_prefetch``) rounds the count down to whole chunks,
        unpins the rounded-off tail itself (``unpin``) and passes only the rest to
        ``batched_get_non_blocking``; when nothing is left it calls no get at all. A record of
        the tail was never popped then, and trimming it at the tail's unpin failed while another
        (synchronous) pin held the key: the stale record later made an unpin trim a live
        lookup's record, whose pins were then never released (entries pinned forever).
        """
        n = 0
        for key in keys:
            if not self.contains(key, pin=pin):
                break
            n += 1
        kpc = self._layer_keys_per_chunk
        # as LMCache rounds (num_hit_keys_raw // keys_per_chunk * keys_per_chunk); its keys start
        # at a chunk boundary, also after another backend's hits
        recorded = n // kpc * kpc if kpc and n and isinstance(keys[0], LayerCacheEngineKey) else n
        if pin and recorded:
            with self._lock:
                rec = self._lookup_pins.setdefault(lookup_id, Counter())
                rec.update(key_string(k) for k in keys[:recorded])
        return n

    def batched_contains(self, keys: List[CacheEngineKey], pin: bool = False) -> int:
        """Length of the prefix of ``keys`` stored here (pinned when ``pin``).

        A chunk's layer keys (LMCache 0.5.6's layer-wise ``lookup``) keep their pins only when
        every layer hits here: that lookup records pins (and unpins them later) only for a chunk
        found whole in one backend, so pins of a partial hit, or of the tail after another
        backend's part, were never released, and pinned entries are never evicted."""
        n = 0
        for key in keys:
            if not self.contains(key, pin=pin):
                break
            n += 1
        if pin and n and isinstance(keys[0], LayerCacheEngineKey) and (
                n < len(keys) or getattr(keys[0], "layer_id", 0) != 0):
            for key in keys[:n]:
                self._unpin_ks(key_string(key))
        return n

    def _pin(self, ks: str) -> bool:
        """Pin ``ks`` in the store and count it here; False (nothing counted) when the store does
        not hold it. Under the plugin's lock, as unpins: only a drop of the entry changes the
        store's count besides them (see :meth:`_unpin_ks`)."""
        with self._lock:
            if self._store_pins and not self.store.pin(ks):
                return False
            self._pins[ks] += 1
            return True

    def pin(self, key: CacheEngineKey) -> bool:
        if self._closed:
            return False
        ks = key_string(key)
        if not self._store_pins and not self.store.contains(ks):
            return False
        return self._pin(ks)

    def unpin(self, key: CacheEngineKey) -> bool:
        ks = key_string(key)
        res = self._unpin_ks(ks)
        with self._lock:
            # a caller that rounds a lookup's hits down unpins the rounded-off tail itself; where
            # that tail was recorded (plain keys: their chunks are not known here), pins recorded
            # for lookups may never exceed the pins held, so such a record gives the key up (and
            # an empty record goes). LMCache 0.5.6 rounds layer keys only, whose tails
            # batched_async_contains does not record: nothing to trim then
            excess = sum(rec.get(ks, 0) for rec in self._lookup_pins.values()) - self._pins.get(ks, 0)
            # newest first: LMCache's tail unpin follows the lookup whose batched_async_contains
            # just ran (no await between them), not the oldest record
            for lid, rec in reversed(list(self._lookup_pins.items())):
                if excess <= 0:
                    break
                take = min(excess, rec.get(ks, 0))
                if take:
                    rec[ks] -= take
                    excess -= take
                    if rec[ks] == 0:
                        del rec[ks]
                    if not rec:
                        del self._lookup_pins[lid]
        return res

    def _unpin_ks(self, ks: str) -> bool:
        with self._lock:
            had = self._pins.get(ks, 0) > 0
            if had:
                # pins the store lost with the entry (removed, or dropped as corrupt; perhaps stored
                # again since) are what an unpin gives up first: fewer pins in the store than counted
                # here are those. Giving up a newer lookup's store pin instead left its entry evictable
                lost = self._store_pins and self.store.pin_count(ks) < self._pins[ks]
                self._pins[ks] -= 1
                if self._pins[ks] == 0:
                    del self._pins[ks]
                if self._store_pins and not lost:
                    self.store.unpin(ks)
        return had or self.store.contains(ks)

    def pin_count(self, key: CacheEngineKey) -> int:
        with self._lock:
            return self._pins.get(key_string(key), 0)

    def touch_cache(self) -> None:
        """No-op: the store's LRU is updated by every read."""

    # ------------------------------------------------------------------ puts
    def batched_submit_put_task(self, keys: Sequence[CacheEngineKey], objs: List[MemoryObj], transfer_spec: Any = None,
                                on_complete_callback: Optional[Callable[[CacheEngineKey], None]] = None
                                ) -> Optional[List[Future]]:
        """Store chunks asynchronously; returns one Future (of the written header) per accepted key.

        Keys already stored or being stored are skipped (no reference taken, no callback), as
        are all keys once the plugin is closed, also when ``close()`` runs while this call is
        under way (LMCache's StorageManager.batched_put does not expect a backend to raise: an
        exception would also skip its loop dropping LMCache's own references to the objects).
        """
        futures: List[Future] = []
        for key, obj in zip(keys, objs):
            if self._closed:  # (checked per key: close() may run on another thread during the call)
                self._skip_closed()
                continue
            ks = key_string(key)
            if self.store.contains(ks):  # stored already: nothing to do (not a chunk that could not be stored)
                self._count("put_present")
                continue
            shapes = getattr(obj.metadata, "shapes", None)
            if shapes is not None and len(shapes) > 1:  # .tensor raises for a multi-group object
                self._chunk_shape(obj, None)  # logs once why it is not stored
                self._count("put_skipped")
                continue
            try:
                t = obj.tensor  # LMCache builds a new view on every access: once per object
            except Exception as exc:  # noqa: BLE001 - an object we cannot view is skipped, never raised into LMCache
                self._warn_once(f"tensor-{type(exc).__name__}", "kvkernels LMCache plugin: a chunk's tensor cannot "
                                "be read (%s: %s); such chunks are not stored", type(exc).__name__, exc)
                self._count("put_skipped")
                continue
            shape = self._chunk_shape(obj, t)
            if shape is None:
                self._count("put_skipped")
                continue
            nbytes = t.numel() * t.element_size()
            with self._lock:
                if ks in self._put_tasks:  # in flight already
                    self.counters["put_present"] += 1
                    continue
                bound = self.settings.max_pending_bytes
                if bound is not None and self._held and self._held + nbytes > bound:
                    # LMCache memory referenced by pending puts is bounded when asked: a chunk
                    # beyond it is not stored (a cache may drop a write; a later lookup misses)
                    self.counters["put_dropped_busy"] += 1
                    busy = True
                else:
                    self._put_tasks[ks] = 1
                    self._held += nbytes
                    busy = False
            if busy:
                self._warn_once("busy", "kvkernels LMCache plugin: pending puts hold %d bytes of LMCache memory "
                                "(kvkernels.max_pending_bytes = %d): further chunks are not stored until they drain "
                                "(counted in put_dropped_busy)", self._held, bound)
                continue
            obj.ref_count_up()
            fut: Future = Future()
            try:
                self._put_pool.submit(self._put_one, key, ks, obj, t, shape, on_complete_callback, fut, nbytes)
            except BaseException as exc:
                obj.ref_count_down()
                with self._lock:
                    self._put_tasks.pop(ks, None)
                    self._held -= nbytes
                # close() shut the pool down between the check at the top of this iteration and
                # the submit (close() sets _closed first): a put after close, skipped like one
                if not (isinstance(exc, RuntimeError) and self._closed):
                    raise
                self._skip_closed()
                continue
            futures.append(fut)
        return futures

    def _skip_closed(self) -> None:
        self._warn_once("closed-put", "kvkernels LMCache plugin: closed (with LMCache's CPU backend); "
                        "puts are skipped")
        self._count("put_skipped")

    def _put_one(self, key, ks: str, obj: MemoryObj, t: torch.Tensor, shape: ChunkShape, callback, fut: Future,
                 nbytes: int) -> None:
        """Submit one chunk to the store (on a plugin thread: the store's back pressure may block).

        Raw chunks are written in place (our reference is held until the bytes are on disk);
        converted ones (FP8, codec, CUDA) give LMCache its memory back right after the copy.
        """
        try:
            sfut, holds = self.io.put(ks, t, shape, self._meta_for(shape))
        except BaseException as exc:
            self._put_done(key, ks, obj, callback, fut, None, exc, nbytes)
            return
        if not holds:
            obj.ref_count_down()
            with self._lock:
                self._held -= nbytes
        sfut.add_done_callback(lambda f: self._put_done(key, ks, obj if holds else None, callback, fut, f, None,
                                                        nbytes if holds else 0))

    def _put_done(self, key, ks: str, obj, callback, fut: Future, sfut: Optional[Future], exc, nbytes: int) -> None:
        """The store finished a put (or it failed before reaching the store): release, count, call back."""
        if exc is None and sfut is not None:
            exc = sfut.exception()
        if obj is not None:
            obj.ref_count_down()
        with self._lock:
            self._held -= nbytes
        try:
            if exc is not None:
                self._count("put_errors")
                log.warning("kvkernels LMCache plugin: put of %s failed: %s: %s", ks, type(exc).__name__, exc)
                fut.set_exception(exc)
                return
            self._count("puts")
            if callback is not None:
                try:
                    callback(key)
                except Exception as cexc:  # LMCache's contract: callback errors are logged, not raised
                    log.warning("kvkernels LMCache plugin: on_complete_callback failed for %s: %s", ks, cexc)
            assert sfut is not None  # (None only with an exc: the put never reached the store)
            fut.set_result(sfut.result())
        finally:  # last: flush() returns only once the counters, the callback and the future are done
            with self._lock:
                self._put_tasks.pop(ks, None)

    # ------------------------------------------------------------------ gets
    def _allocate(self, shape: ChunkShape, mfmt: MemoryFormat, busy_loop: bool = True,
                  count: bool = True) -> Optional[MemoryObj]:
        if self.local_cpu_backend is None:
            self._warn_once("no-alloc", "kvkernels LMCache plugin: no LocalCPUBackend to allocate from "
                            "(max_local_cpu_size must be > 0); gets return None")
            return None
        obj = self.local_cpu_backend.allocate(shape.torch_shape, shape.dtype, mfmt, busy_loop=busy_loop)
        if obj is None and count:
            self._count("alloc_failures")
        return obj

    def _allocate_patiently(self, shape: ChunkShape, mfmt: MemoryFormat) -> Optional[MemoryObj]:
        """Allocate on a plugin thread, retrying for up to :data:`_SYNC_ALLOC_WAIT_S` while
        LMCache's pool is full (bounded: the caller's earlier layers may hold what would free it)."""
        if self.local_cpu_backend is None:  # no pool at all (max_local_cpu_size 0): nothing to wait for
            return self._allocate(shape, mfmt, busy_loop=False)
        end = time.monotonic() + _SYNC_ALLOC_WAIT_S
        while True:
            obj = self._allocate(shape, mfmt, busy_loop=False, count=False)
            if obj is not None or time.monotonic() >= end or self._closed:
                if obj is None:
                    self._count("alloc_failures")
                return obj
            time.sleep(0.005)

    def _finish_read(self, ks: str, pending, out: torch.Tensor) -> bool:
        """Wait for a read and decode it into ``out``; False (and no bytes trusted) on any failure."""
        outcome, exc = self.io.try_finish(pending, out)
        # a corrupt entry or any other failure is a miss for LMCache; the bytes are not used
        self._count({"ok": "hits", "corrupt": "corrupt"}.get(outcome, "misses"))
        if outcome == "corrupt":
            log.warning("kvkernels LMCache plugin: %s is corrupted, treated as a miss: %s", ks, exc)
        elif outcome == "error":
            log.warning("kvkernels LMCache plugin: read of %s failed, treated as a miss: %s: %s", ks,
                        type(exc).__name__, exc)
        return outcome == "ok"

    def _read_many(self, kss: List[str], objs: List[Optional[MemoryObj]], orders: List[str]) -> List[bool]:
        """Read several entries, ``_read_window`` in flight, finished in completion order."""
        ok = [False] * len(kss)

        def start(i):
            if objs[i] is None:
                return None
            try:
                return self.io.start_read(kss[i], objs[i].tensor, order=orders[i])
            except Exception as exc:  # a bad header, a closed store: a miss, never a leak
                log.warning("kvkernels LMCache plugin: %s unreadable: %s: %s", kss[i], type(exc).__name__, exc)
                return None

        def finish(j, st):
            ok[j] = self._finish_read(kss[j], st, objs[j].tensor)

        run_windowed(len(kss), start, finish, self._read_window)
        return ok

    def get_blocking(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return self.batched_get_blocking([key])[0]

    def batched_get_blocking(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        """Read chunks concurrently (the store's queue depth); ``None`` for misses and bad entries.

        Room in LMCache's pool is waited for up to :data:`_SYNC_ALLOC_WAIT_S` (LMCache's own
        ``busy_loop`` waits forever, and the objects this call already holds may be what would free
        it); after one such timeout the remaining keys get one try each."""
        if self._closed:  # misses, allocating nothing (LMCache's pool may be freed already)
            return [None] * len(keys)
        self._count("gets", len(keys))
        kss = [key_string(k) for k in keys]
        objs: List[Optional[MemoryObj]] = []
        orders: List[str] = []
        no_room = False
        for key, ks in zip(keys, kss):
            header = self.store.header(ks)
            obj, order = None, "LTD"
            if header is not None:
                try:
                    shape, mfmt = self._read_shape(key, header)
                    obj = self._allocate(shape, mfmt, busy_loop=False) if no_room else \
                        self._allocate_patiently(shape, mfmt)
                    order = shape.order
                    no_room = no_room or obj is None
                except ValueError as exc:
                    log.warning("kvkernels LMCache plugin: %s unreadable: %s", ks, exc)
                    self._count("misses")
            else:
                self._count("misses")
            objs.append(obj)
            orders.append(order)
        ok = self._read_many(kss, objs, orders)
        out: List[Optional[MemoryObj]] = []
        for obj, good in zip(objs, ok):
            if obj is not None and not good:
                obj.ref_count_down()
                obj = None
            out.append(obj)
        return out

    def get_non_blocking(self, key: CacheEngineKey, location: Optional[str] = None) -> Optional[Future]:
        if not self.store.contains(key_string(key)):
            return None
        return self._read_pool.submit(self.get_blocking, key)

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey],
                                       transfer_spec: Any = None) -> list[MemoryObj]:
        """Prefetch ``keys``; returns the leading chunks read successfully (prefix semantics).

        Releases the pins ``batched_async_contains`` took for this ``lookup_id`` on these keys,
        and only those: LMCache's synchronous layer-wise path calls this with
        ``"fake_lookup_id"`` on keys pinned by its lookup, which it unpins itself later.
        """
        try:
            self._count("gets", len(keys))
            kss = [key_string(k) for k in keys]
            objs: list = []
            orders: list = []
            sync = lookup_id == _SYNC_LOOKUP_ID
            if self._closed:  # nothing allocated: LMCache's pool may be freed already (closed with it)
                if sync:
                    raise RuntimeError("KVKernelsBackend is closed")
                return []
            loop = asyncio.get_running_loop()
            no_room = False
            for key, ks in zip(keys, kss):
                header = self.store.header(ks)
                if header is None:  # (gone since the lookup) a miss, as batched_get_blocking counts it
                    self._count("misses")
                    break
                try:
                    shape, mfmt = self._read_shape(key, header)
                except ValueError as exc:
                    log.warning("kvkernels LMCache plugin: %s unreadable: %s", ks, exc)
                    self._count("misses")
                    break
                obj = self._allocate(shape, mfmt, busy_loop=False, count=not sync)  # never spin on the event loop
                if obj is None and sync and not self._closed:
                    # the synchronous layer-wise retrieve must get every chunk: wait a little for
                    # room, on a plugin thread (the event loop keeps running)
                    waiting = loop.run_in_executor(self._read_pool, self._allocate_patiently, shape, mfmt)
                    try:
                        obj = await asyncio.shield(waiting)
                    except BaseException:  # the plugin closed meanwhile, or this task was cancelled:
                        for o in objs:  # give back what was allocated (no read into them yet)
                            o.ref_count_down()
                        _when_done(waiting, _free_result)  # and what the allocation still returns
                        raise
                    if obj is not None and self._closed:
                        obj.ref_count_down()
                        obj = None
                if obj is None:
                    no_room = True
                    log.error("kvkernels LMCache plugin: CPU staging pool exhausted during prefetch of %s; "
                              "returning %d of %d chunks", lookup_id, len(objs), len(keys))
                    break
                objs.append(obj)
                orders.append(shape.order)
            reading = None
            try:
                if self._closed:
                    raise RuntimeError("KVKernelsBackend is closed")
                reading = loop.run_in_executor(self._read_pool, self._read_many, kss[: len(objs)], objs, orders)
                ok = await asyncio.shield(reading)
            except BaseException as exc:  # e.g. the plugin closed while this get waited: nothing leaks
                # the objects go back to LMCache's pool once nothing writes into them: a task cancelled
                # while its reads run (a timeout around the prefetch) freed them at once, and the
                # reads then wrote into memory LMCache had handed to another chunk
                held = list(objs)
                _when_done(reading, lambda _: [o.ref_count_down() for o in held])
                if sync or not isinstance(exc, Exception):
                    raise
                # a prefetch: LMCache's done-callback would fail on an exception and never answer
                # the scheduler for this request; no chunks is an answer
                self._count("get_errors")
                log.warning("kvkernels LMCache plugin: prefetch %s read nothing: %s: %s", lookup_id,
                            type(exc).__name__, exc)
                return []
            result: list[MemoryObj] = []
            broken = False
            for obj, good in zip(objs, ok):
                broken = broken or not good
                if broken:  # after the first miss nothing counts (prefix): free the rest
                    obj.ref_count_down()
                else:
                    result.append(obj)
            if sync and len(result) < len(keys):
                # LMCache's synchronous layer-wise retrieve has already marked every chunk of the
                # layer as retrieved and pairs objects with token ranges by position: a short
                # list would leave the missing chunks' tokens unwritten yet reported loaded
                for obj in result:
                    obj.ref_count_down()
                self._count("get_errors")
                why = (f"LMCache's CPU pool had no room for it within {_SYNC_ALLOC_WAIT_S:g} s"
                       if no_room and len(result) == len(objs) else "its entry is missing or corrupt")
                raise RuntimeError(f"kvkernels LMCache plugin: {len(result)} of {len(keys)} chunks of a layer-wise "
                                   f"retrieve could be read (first failing: {kss[len(result)]}: {why}), so the "
                                   "retrieve fails instead of restoring part of the layer")
            return result
        finally:
            with self._lock:
                mine = self._lookup_pins.pop(lookup_id, Counter())
            for k in keys:
                ks = key_string(k)
                if mine.get(ks):
                    mine[ks] -= 1
                    self._unpin_ks(ks)

    def get_layers(self, key: CacheEngineKey, layers) -> Optional[torch.Tensor]:
        """Read only ``layers`` of a stored chunk: ``[num_kv, len(layers), T, H*D]`` CPU tensor, or None.

        Slot ``j`` holds the ``j``-th of ``layers`` *in ascending order*, as everywhere in
        kvkernels (``layers=[3, 1]`` gives layer 1, then layer 3).

        One aligned region read per layer (contiguous layers coalesce): what a layer-wise
        restore needs, without reading the whole chunk.
        """
        from kvkernels.staging import normalize_layers

        ks = key_string(key)
        header = self.store.header(ks)
        if header is None:
            return None
        shape = shape_of_header(header)
        layers = normalize_layers(layers, shape.num_layers)
        full = torch.empty(shape.torch_shape, dtype=shape.dtype)
        st = self.io.start_read(ks, full, layers=layers)
        if st is None or not self._finish_read(ks, st, full):
            return None
        return full[:, list(layers)]

    # ------------------------------------------------------------------ removal / lifecycle
    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        # the store's drop takes its pins; the lookups holding them still unpin later, and those
        # unpins give up the lost pins first (_unpin_ks), never the pin of a lookup made after the
        # key was stored again (dropping this plugin's count here let them take those).
        # Closed (LMCache may keep calling a plugin it closed with its CPU backend): nothing is
        # removed, the folder may be another store's by now (the store refuses with RuntimeError)
        if self._closed:
            return False
        try:
            return self.store.remove(key_string(key))
        except RuntimeError:
            if self._closed:  # closed on another thread since the check
                return False
            raise

    def get_allocator_backend(self):
        return self.local_cpu_backend

    def stats(self) -> dict:
        """Plugin counters plus the store's ``stats()``."""
        with self._lock:
            d: dict[str, Any] = dict(self.counters)
            d["put_tasks"] = len(self._put_tasks)
            d["pinned_keys"] = len(self._pins)
        d["store"] = self.store.stats()
        return d

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every submitted put has finished (tests, benchmarks, shutdown)."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if not self._put_tasks:
                    return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{len(self._put_tasks)} puts still pending")
            time.sleep(0.001)

    def close(self) -> None:
        """Finish pending puts, then close the store. Idempotent; a call while another thread
        closes waits for it."""
        with self._close_lock:
            if self._close_done:
                return
            self._closed = True
            self._put_pool.shutdown(wait=True)
            self._read_pool.shutdown(wait=True)
            self.store.close()
            self.io.bufs.clear()
            self._close_done = True
