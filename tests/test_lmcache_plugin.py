"""LMCache storage plugin (kvkernels.integrations.lmcache) through the real lmcache package.

The plugin is created by LMCache's own machinery (``StorageManager`` -> ``CreateStorageBackends``
-> ``storage_plugin_launcher``) from an ``LMCacheEngineConfig``; chunks are real ``MemoryObj``
from LMCache's ``LocalCPUBackend`` allocator and keys are real ``CacheEngineKey``.

Without lmcache installed the module is skipped (set ``KVKERNELS_REQUIRE_LMCACHE=1`` in CI to make
that an error instead).
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

if os.environ.get("KVKERNELS_REQUIRE_LMCACHE") == "1":
    import lmcache  # noqa: F401
else:
    pytest.importorskip("lmcache", reason="lmcache==0.5.6 not installed (pip install 'kvkernels[lmcache]')")

from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.event_manager import EventManager  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend import CreateStorageBackends  # noqa: E402
from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: E402

import kvkernels  # noqa: E402
from kvkernels.integrations.lmcache import (  # noqa: E402
    KVKernelsBackend,
    PluginConfigError,
    key_string,
    chunk_to_staging,
    lmcache_extra_config,
    parse_extra_config,
    staging_to_chunk,
)
from kvkernels.integrations.lmcache.convert import ChunkShape, chunk_layout  # noqa: E402
from kvtest import bytes_equal  # noqa: E402


# small llama-like chunk: L layers, T tokens, H kv heads, D head dim
L, T, H, D = 4, 16, 2, 8
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
MODEL = "test/llama-tiny"


def _metadata(dtype=torch.bfloat16, worker_id=0, world_size=1, use_mla=False):
    return LMCacheMetadata(model_name=MODEL, world_size=world_size, local_world_size=world_size, worker_id=worker_id,
                           local_worker_id=worker_id, kv_dtype=dtype, kv_shape=(L, 2, T, H, D), use_mla=use_mla,
                           chunk_size=T)


def _config(path, lmcache_options=None, **kv):
    return LMCacheEngineConfig.from_defaults(chunk_size=T, local_cpu=True, max_local_cpu_size=0.05,
                                             storage_plugins=["kvkernels"],
                                             extra_config=lmcache_extra_config(str(path), **kv),
                                             **(lmcache_options or {}))


def _key(h: int, dtype=torch.bfloat16, worker_id=0) -> CacheEngineKey:
    return CacheEngineKey(MODEL, 1, worker_id, h, dtype)


class Manager:
    """A StorageManager built from config (LMCache creates the plugin), torn down on close()."""

    def __init__(self, path, dtype=torch.bfloat16, lmcache_options=None, use_mla=False, **kv):
        self.sm = StorageManager(_config(path, lmcache_options, **kv), _metadata(dtype, use_mla=use_mla), EventManager())
        self.plugin = self.sm.storage_backends.get("kvkernels")
        assert isinstance(self.plugin, KVKernelsBackend), list(self.sm.storage_backends)
        self.cpu = self.sm.storage_backends["LocalCPUBackend"]

    def chunk(self, seed: int, dtype=torch.bfloat16, tokens: int = T):
        """A MemoryObj from LMCache's allocator filled with seeded data, and a copy of its bytes."""
        obj = self.sm.allocate(torch.Size([2, L, tokens, H * D]), dtype, MemoryFormat.KV_2LTD)
        g = torch.Generator().manual_seed(seed)
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=g).to(dtype))
        return obj, obj.tensor.clone()

    def put(self, keys, objs, **kw):
        """Store through the plugin only (the manager's batched_put also fills LocalCPUBackend)."""
        futs = self.plugin.batched_submit_put_task(keys, objs, **kw)
        for o in objs:  # what StorageManager.batched_put does after submitting
            o.ref_count_down()
        self.plugin.flush(timeout=30)
        return futs

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.sm.loop).result(30)

    def close(self):
        self.sm.close()


@pytest.fixture
def mgr(tmp_path):
    m = Manager(tmp_path / "kv")
    yield m
    m.close()


def _entry_files(root) -> list[str]:
    return sorted(glob.glob(os.path.join(str(root), "**", "*.kvk"), recursive=True))


# ----------------------------------------------------------------------------- creation / config
def test_created_by_lmcache_launcher_from_config(tmp_path):
    loop = asyncio.new_event_loop()
    backends = CreateStorageBackends(_config(tmp_path / "kv"), _metadata(), loop)
    try:
        plugin = backends["kvkernels"]
        assert isinstance(plugin, KVKernelsBackend)
        assert plugin.get_allocator_backend() is backends["LocalCPUBackend"]
        # one store per worker process: <path>/worker<id>of<world>.v2 (".v2": the JSON keys)
        assert plugin.store.paths == [str(tmp_path / "kv" / "worker0of1.v2")]
    finally:
        for b in reversed(list(backends.values())):
            b.close()
        loop.close()


@pytest.mark.parametrize("extra, key", [
    ({}, "kvkernels.paths"),
    ({"kvkernels.paths": 7}, "kvkernels.paths"),
    ({"kvkernels.paths": "/tmp/x", "kvkernels.engine": "spdk"}, "kvkernels.engine"),
    ({"kvkernels.paths": "/tmp/x", "kvkernels.capacity_bytes": "lots"}, "kvkernels.capacity_bytes"),
    ({"kvkernels.paths": "/tmp/x", "kvkernels.capcity_bytes": 10}, "kvkernels.capcity_bytes"),
    ({"kvkernels.paths": "/tmp/x", "kvkernels.compression": "brotli"}, "kvkernels.compression"),
    ({"kvkernels.paths": "/tmp/x", "kvkernels.fsync": "maybe"}, "kvkernels.fsync"),
    ({"kvkernels.paths": "/tmp/x", "kvkernels.quant": "int4"}, "kvkernels.quant"),
    ({"kvkernels.paths": "/tmp/x", "kvkernels.quant_granularity": "layer"}, "kvkernels.quant_granularity"),
    ({"kvkernels.paths": "/tmp/x", "kvkernels.quant": "fp8", "kvkernels.compression": "zstd",
      "kvkernels.byteshuffle": True}, "kvkernels.byteshuffle"),
    ({"kvkernels.paths": "/tmp/x", "kvkernels.inplace_io": "sometimes"}, "kvkernels.inplace_io"),
    # (review, 2026-11-25: taken and did nothing, as byteshuffle without a codec would)
    ({"kvkernels.paths": "/tmp/x", "kvkernels.quant_granularity": "block"}, "kvkernels.quant_granularity"),
    ({"kvkernels.paths": "/tmp/x", "kvkernels.quant": "none", "kvkernels.quant_granularity": "block"},
     "kvkernels.quant_granularity"),
])
def test_bad_config_names_the_key(extra, key):
    with pytest.raises(PluginConfigError, match=key.replace(".", r"\.")):
        parse_extra_config(extra)


def test_zstd_without_the_zstandard_package_is_a_config_error(monkeypatch):
    """The [lmcache] extra does not bring zstandard: compression zstd without it was accepted and
    then failed every put (one warning each, nothing stored)."""
    from kvkernels.integrations.lmcache import config as cfg_mod

    extra = {"kvkernels.paths": "/tmp/x", "kvkernels.compression": "zstd"}
    assert parse_extra_config(extra).compression == "zstd"  # installed here
    monkeypatch.setattr(cfg_mod, "_have_zstandard", lambda: False)
    with pytest.raises(PluginConfigError, match=r"kvkernels\.compression.*zstandard"):
        parse_extra_config(extra)
    assert parse_extra_config({"kvkernels.paths": "/tmp/x"}).compression == "none"


def test_keys_lmcache_holds_equal_share_an_entry_and_others_do_not():
    """Tag values True / 1 / 1.0 are one key to LMCache (equal, same hash): one entry; "7" and 7
    are two keys: two entries."""
    def k(v):
        return CacheEngineKey(MODEL, 1, 0, 5, torch.bfloat16, request_configs={"lmcache.tag.user": v})

    for a, b in [(1, 1.0), (1, True), (0, -0.0), (2.5, 2.5), ("7", 7), (1.5, 1), ("a", "b")]:
        assert (k(a) == k(b)) == (key_string(k(a)) == key_string(k(b))), (a, b)


def test_broken_config_is_loud(tmp_path, caplog):
    """Direct construction raises naming the key; through LMCache's launcher (which only logs
    plugin failures) our logger reports it at error level and no plugin is registered."""
    extra = {"storage_plugin.kvkernels.module_path": "kvkernels.integrations.lmcache",
             "storage_plugin.kvkernels.class_name": "KVKernelsBackend",
             "kvkernels.paths": str(tmp_path / "kv"), "kvkernels.engine": "spdk"}
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=T, local_cpu=True, max_local_cpu_size=0.05,
                                            storage_plugins=["kvkernels"], extra_config=extra)
    with pytest.raises(PluginConfigError, match=r"kvkernels\.engine"):
        KVKernelsBackend(dst_device="cpu", config=cfg, metadata=_metadata())
    loop = asyncio.new_event_loop()
    with caplog.at_level(logging.ERROR, logger="kvkernels.integrations.lmcache"):
        backends = CreateStorageBackends(cfg, _metadata(), loop)
    try:
        assert "kvkernels" not in backends
        errors = [r for r in caplog.records if r.name == "kvkernels.integrations.lmcache" and r.levelno == logging.ERROR]
        assert errors and "kvkernels.engine" in errors[0].getMessage()
    finally:
        for b in backends.values():
            b.close()
        loop.close()


def test_a_bad_environment_variable_is_named_without_blaming_the_paths(tmp_path, monkeypatch):
    # it said "cannot open the store at `kvkernels.paths`=[...]: ValueError: `KVKERNELS_IO_THREADS`..."
    monkeypatch.setenv("KVKERNELS_IO_THREADS", "abc")
    cfg = _config(tmp_path / "kv")
    cfg.extra_config.pop("kvkernels.io_threads", None)
    with pytest.raises(PluginConfigError) as info:
        KVKernelsBackend(dst_device="cpu", config=cfg, metadata=_metadata())
    assert str(info.value).startswith("kvkernels LMCache plugin: `KVKERNELS_IO_THREADS`")
    assert "kvkernels.paths" not in str(info.value)


def test_unwritable_path_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    cfg = _config(blocker / "sub")
    with pytest.raises(PluginConfigError, match=r"kvkernels\.paths"):
        KVKernelsBackend(dst_device="cpu", config=cfg, metadata=_metadata())


# ----------------------------------------------------------------------------- conversion
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, T])
def test_chunk_staging_matches_kvkernels_gather(dtype, tokens):
    t = torch.randn(2, L, tokens, H * D).to(dtype)
    shape = ChunkShape.of(t, H)
    lay = chunk_layout(t, shape)
    fmt = kvkernels.StagingFormat.for_layout(lay, 1)
    ours = chunk_to_staging(t, shape, torch.full((fmt.nbytes,), 0xAB, dtype=torch.uint8), fmt)
    assert torch.equal(ours, kvkernels.gather(lay, [0], backend="torch"))
    back = staging_to_chunk(ours, shape, torch.empty_like(t), fmt)
    assert bytes_equal(back, t)
    # one layer alone: region 0 of a single-layer staging
    one = kvkernels.gather(lay, [0], layers=[2], backend="torch")
    part = torch.zeros_like(t)
    staging_to_chunk(one, shape, part, fmt.with_layers([2]), layers=[2])
    assert bytes_equal(part[:, 2], t[:, 2]) and not part[:, 0].any()


@pytest.mark.parametrize("order, dims", [("T2D", (T, 2, H * D)), ("2TD", (2, T, H * D)), ("TD", (T, D))])
def test_layerwise_orders_convert_like_their_paged_layout(order, dims):
    """A layer-wise object's CPU conversion (strided views) gives the bytes kvkernels.gather gives
    for its PagedLayout (the path CUDA objects and FP8 take), and converts back."""
    t = torch.randn(dims).to(torch.bfloat16)
    shape = ChunkShape.of(t, H, order)
    assert shape.torch_shape == t.shape and shape.num_layers == 1
    lay = chunk_layout(t, shape)
    fmt = kvkernels.StagingFormat.for_layout(lay, 1)
    ours = chunk_to_staging(t, shape, torch.full((fmt.nbytes,), 0xAB, dtype=torch.uint8), fmt)
    assert torch.equal(ours, kvkernels.gather(lay, [0], backend="torch"))
    assert bytes_equal(staging_to_chunk(ours, shape, torch.empty_like(t), fmt), t)
    with pytest.raises(ValueError, match="order"):
        ChunkShape.of(torch.zeros(2, L, T, H * D), H).with_order(order)  # L layers cannot be one object


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_chunk_conversion_matches_cpu(dtype):
    """CUDA chunks go through kvkernels.gather/scatter (Triton); same bytes as the CPU copy path."""
    t = torch.randn(2, L, T, H * D).to(dtype)
    shape = ChunkShape.of(t, H)
    fmt = kvkernels.StagingFormat.for_layout(chunk_layout(t, shape), 1)
    cpu = chunk_to_staging(t, shape, torch.empty(fmt.nbytes, dtype=torch.uint8), fmt)
    gpu = chunk_to_staging(t.cuda(), shape, torch.empty(fmt.nbytes, dtype=torch.uint8, device="cuda"), fmt)
    assert torch.equal(cpu, gpu.cpu())
    back = staging_to_chunk(gpu, shape, torch.empty_like(t, device="cuda"), fmt)
    assert bytes_equal(back.cpu(), t)


@pytest.mark.gpu
@pytest.mark.parametrize("quant, codec", [(None, "none"), (None, "zstd"), ("fp8", "none")])
def test_chunk_io_round_trips_cuda_chunks(tmp_path, quant, codec):
    """ChunkIO with a CUDA chunk (not what LMCache 0.5.6 hands a plugin, but exported and
    documented): its pooled staging was pageable, which kvkernels.gather refuses for a CUDA
    cache; pinned, the store must not read it before the gather kernel has written it (the
    compute stream is held busy while the put is issued) and a read's buffer goes back to the
    pool only after the scatter has run."""
    from kvkernels.integrations.lmcache.chunk_io import ChunkIO
    from kvkernels.io import EntryMeta, KVStore
    from kvkernels.quant import store_scheme

    t = torch.randn(2, L, T, H * D).to(torch.bfloat16).cuda()
    shape = ChunkShape.of(t, H)
    meta = EntryMeta(layers=tuple(range(shape.num_layers)), num_blocks=1, block_size=shape.num_tokens,
                     num_heads=shape.num_heads, head_dim=shape.head_dim, element_size=shape.element_size,
                     num_kv=shape.num_kv, num_layers=shape.num_layers, dtype="bfloat16",
                     scheme=store_scheme(quant=quant, dtype=t.dtype), codec=codec).validate()
    store = KVStore(str(tmp_path / "s"), engine="posix")
    try:
        io = ChunkIO(store, inplace=False)
        outs = []
        for i in range(2):  # the second put/read reuses the pool's pinned buffers
            src = t if i == 0 else t.flip(1)
            torch.cuda._sleep(100_000_000)  # ~50 ms: the gather queues behind it
            fut, _holds = io.put(f"k{i}", src, shape, meta)
            fut.result(timeout=60)
            out = torch.full_like(t, float("nan"))
            pending = io.start_read(f"k{i}", out)
            torch.cuda._sleep(100_000_000)  # the scatter queues behind it
            io.finish_read(pending, out)
            outs.append((src, out))
        torch.cuda.synchronize()
        for src, out in outs:
            if quant is None:
                assert bytes_equal(out.cpu(), src.cpu())
            else:  # e4m3: within its rounding (per-token scales)
                assert torch.allclose(out.float().cpu(), src.float().cpu(), rtol=0.07, atol=1e-2)
    finally:
        store.close()


@pytest.mark.parametrize("inplace, quant", [(True, None), (False, None), (False, "fp8")])
def test_chunk_io_reads_layers_given_out_of_order_into_their_own_slots(tmp_path, inplace, quant):
    """start_read(layers=[2, 0]) fills each layer's own place in the chunk (the store fills a
    list of destinations in the order of ``layers``; ChunkIO builds them ascending)."""
    from kvkernels.integrations.lmcache.chunk_io import ChunkIO
    from kvkernels.io import EntryMeta, KVStore
    from kvkernels.quant import store_scheme

    t = torch.randn(2, L, T, H * D).to(torch.bfloat16)
    for l in range(L):
        t[:, l] += 10 * l  # each layer's values far apart: a swap is not within FP8's rounding
    shape = ChunkShape.of(t, H)
    meta = EntryMeta(layers=tuple(range(L)), num_blocks=1, block_size=T, num_heads=H, head_dim=D, element_size=2,
                     num_kv=2, num_layers=L, dtype="bfloat16", scheme=store_scheme(quant=quant, dtype=t.dtype),
                     codec="none").validate()
    store = KVStore(str(tmp_path / "s"), engine="posix")
    try:
        io = ChunkIO(store, inplace=inplace)
        fut, _ = io.put("k", t, shape, meta)
        fut.result(timeout=60)
        out = torch.zeros_like(t)
        io.finish_read(io.start_read("k", out, layers=[2, 0]), out)
        for l in (0, 2):
            if quant is None:
                assert torch.equal(out[:, l], t[:, l]), l
            else:
                assert torch.allclose(out[:, l].float(), t[:, l].float(), rtol=0.07, atol=0.1), l
        assert bool((out[:, 1] == 0).all()) and bool((out[:, 3] == 0).all())
    finally:
        store.close()


def test_chunk_io_never_decodes_a_newer_version_with_the_older_headers_sizes(tmp_path, monkeypatch):
    """start_read plans the read and the decode from ``header(key)``. A put of the key between
    that header and the read (here: header() answers with the version read before the put)
    stored other compressed sizes: the read is a miss, instead of decoding the new bytes with the
    old sizes (garbage, or an entry wrongly removed as undecodable)."""
    pytest.importorskip("zstandard")
    from kvkernels.integrations.lmcache.chunk_io import ChunkIO
    from kvkernels.io import EntryMeta, KVStore

    t1 = torch.randn(2, L, T, H * D).to(torch.bfloat16)
    t2 = torch.zeros_like(t1)  # compresses to far fewer bytes
    shape = ChunkShape.of(t1, H)
    meta = EntryMeta(layers=tuple(range(L)), num_blocks=1, block_size=T, num_heads=H, head_dim=D, element_size=2,
                     num_kv=2, num_layers=L, dtype="bfloat16", scheme="shuffle", codec="zstd").validate()
    store = KVStore(str(tmp_path / "s"), engine="posix")
    try:
        io = ChunkIO(store, inplace=False)
        io.put("k", t1, shape, meta)[0].result(timeout=60)
        h1 = store.header("k")
        io.put("k", t2, shape, meta)[0].result(timeout=60)
        assert [r.stored for r in store.header("k").regions] != [r.stored for r in h1.regions]
        monkeypatch.setattr(store, "header", lambda key: h1)
        out = torch.full_like(t1, 7)
        outcome, exc = io.try_finish(io.start_read("k", out), out)
        assert outcome == "missing" and isinstance(exc, KeyError), (outcome, exc)
        monkeypatch.undo()
        assert store.contains("k")  # the new version is kept, and reads whole
        io.finish_read(io.start_read("k", out), out)
        assert torch.equal(out, t2)
    finally:
        store.close()


def test_mla_chunk_round_trip():
    t = torch.randn(1, L, T, 24).to(torch.bfloat16)
    shape = ChunkShape.of(t, H)
    assert (shape.num_kv, shape.num_heads, shape.head_dim) == (1, 1, 24)
    lay = chunk_layout(t, shape)
    fmt = kvkernels.StagingFormat.for_layout(lay, 1)
    st = chunk_to_staging(t, shape, torch.empty(fmt.nbytes, dtype=torch.uint8), fmt)
    assert torch.equal(st, kvkernels.gather(lay, [0], backend="torch"))
    assert bytes_equal(staging_to_chunk(st, shape, torch.empty_like(t), fmt), t)


# ----------------------------------------------------------------------------- store / lookup / retrieve
def test_put_contains_get_through_storage_manager(mgr):
    keys = [_key(1000 + i) for i in range(4)]
    pairs = [mgr.chunk(i) for i in range(4)]
    objs = [p[0] for p in pairs]
    for o in objs:
        o.ref_count_up()  # keep them alive to check the plugin's reference handling
    mgr.sm.batched_put(keys, objs)  # LMCache fans out to LocalCPUBackend and the plugin
    mgr.plugin.flush(timeout=30)
    for k, (o, ref) in zip(keys, pairs):
        assert mgr.plugin.contains(k)
        assert not mgr.plugin.exists_in_put_tasks(k)
        assert o.get_ref_count() == 2  # ours (1) + LocalCPUBackend's copy; the plugin released its own
        got = mgr.sm.get(k, location="kvkernels")
        assert got is not None and got is not o
        assert bytes_equal(got.tensor, ref)
        assert got.get_memory_format() == MemoryFormat.KV_2LTD
        got.ref_count_down()
        o.ref_count_down()
    assert mgr.sm.contains(_key(1), search_range=["kvkernels"]) is None
    assert mgr.plugin.get_blocking(_key(1)) is None


def test_ref_count_and_callback_contract(mgr):
    keys = [_key(i) for i in range(3)]
    pairs = [mgr.chunk(10 + i) for i in range(3)]
    objs = [p[0] for p in pairs]
    done = []
    for o in objs:
        o.ref_count_up()  # the test's own reference
    futs = mgr.plugin.batched_submit_put_task(keys, objs, on_complete_callback=done.append)
    assert len(futs) == 3
    for f in futs:
        f.result(30)
    mgr.plugin.flush(timeout=30)
    assert sorted(k.chunk_hash for k in done) == [0, 1, 2]  # once per key
    assert [o.get_ref_count() for o in objs] == [2, 2, 2]  # the plugin took one and gave it back
    # already stored: skipped, no reference taken, no callback
    assert mgr.plugin.batched_submit_put_task(keys[:1], objs[:1], on_complete_callback=done.append) == []
    assert objs[0].get_ref_count() == 2 and len(done) == 3
    # a raising callback is logged, the entry still stored
    def boom(k):
        raise RuntimeError("callback failed")
    o, ref = mgr.chunk(99)
    mgr.put([_key(99)], [o], on_complete_callback=boom)
    assert mgr.plugin.contains(_key(99))
    for o in objs:
        o.ref_count_down()
        o.ref_count_down()


def test_flush_returns_after_the_callbacks_and_the_futures(mgr):
    """flush() waited for the put tasks only: a slow on_complete_callback (and the put's future,
    resolved after it) could still be running when it returned."""
    import time

    done = []

    def slow(k):
        time.sleep(0.3)
        done.append(k)

    o, _ = mgr.chunk(77)
    futs = mgr.plugin.batched_submit_put_task([_key(77)], [o], on_complete_callback=slow)
    o.ref_count_down()
    mgr.plugin.flush(timeout=30)
    assert len(done) == 1 and futs[0].done() and mgr.plugin.stats()["puts"] >= 1
    assert not mgr.plugin.exists_in_put_tasks(_key(77)) and mgr.plugin.contains(_key(77))


def test_batched_get_blocking_and_layer_read(mgr):
    keys = [_key(i) for i in range(6)]
    pairs = [mgr.chunk(20 + i) for i in range(6)]
    refs = [p[1] for p in pairs]
    mgr.put(keys, [p[0] for p in pairs])
    got = mgr.plugin.batched_get_blocking(keys[:3] + [_key(12345)] + keys[3:])
    assert got[3] is None
    for g, ref in zip(got[:3] + got[4:], refs):
        assert bytes_equal(g.tensor, ref)
        g.ref_count_down()
    part = mgr.plugin.get_layers(keys[1], [1, 3])
    assert bytes_equal(part, refs[1][:, [1, 3]])
    assert mgr.plugin.get_layers(_key(4242), [0]) is None


def test_short_last_chunk_and_dtypes(tmp_path):
    for dtype in DTYPES:
        m = Manager(tmp_path / str(dtype), dtype=dtype)
        try:
            o, ref = m.chunk(5, dtype=dtype, tokens=5)  # last chunk of a prompt: fewer tokens
            m.put([_key(5, dtype)], [o])
            got = m.plugin.get_blocking(_key(5, dtype))
            assert got.tensor.shape == (2, L, 5, H * D) and bytes_equal(got.tensor, ref)
            got.ref_count_down()
            # dtype is part of the key
            assert not m.plugin.contains(_key(5, torch.float64 if dtype != torch.float64 else torch.float32))
        finally:
            m.close()


def test_async_prefix_lookup_and_prefetch(mgr):
    keys = [_key(i) for i in range(6)]
    pairs = {i: mgr.chunk(30 + i) for i in (0, 1, 2, 4, 5)}  # 3 is missing
    mgr.put([keys[i] for i in pairs], [p[0] for p in pairs.values()])
    n = mgr.run(mgr.plugin.batched_async_contains("req-1", keys, pin=True))
    assert n == 3
    assert [mgr.plugin.pin_count(k) for k in keys] == [1, 1, 1, 0, 0, 0]
    objs = mgr.run(mgr.plugin.batched_get_non_blocking("req-1", keys[:n]))
    assert len(objs) == 3
    for i, o in enumerate(objs):
        assert bytes_equal(o.tensor, pairs[i][1])
        o.ref_count_down()
    assert [mgr.plugin.pin_count(k) for k in keys] == [0] * 6  # unpinned by the prefetch
    # an entry removed between lookup and load: the prefix stops there, nothing leaks
    assert mgr.run(mgr.plugin.batched_async_contains("req-2", keys[:3], pin=True)) == 3
    assert mgr.plugin.remove(keys[1])
    before = _active(mgr)
    objs = mgr.run(mgr.plugin.batched_get_non_blocking("req-2", keys[:3]))
    assert len(objs) == 1 and bytes_equal(objs[0].tensor, pairs[0][1])
    assert _active(mgr) == before + 1  # only the returned chunk is live
    objs[0].ref_count_down()
    assert _active(mgr) == before


def test_pin_unpin_remove(mgr):
    o, _ = mgr.chunk(7)
    mgr.put([_key(7)], [o])
    assert not mgr.plugin.pin(_key(8))
    assert mgr.plugin.pin(_key(7)) and mgr.plugin.contains(_key(7), pin=True)
    assert mgr.plugin.pin_count(_key(7)) == 2
    mgr.sm.batched_unpin([_key(7)], locations=["kvkernels"])
    assert mgr.plugin.pin_count(_key(7)) == 1
    assert mgr.plugin.unpin(_key(7)) and mgr.plugin.pin_count(_key(7)) == 0
    assert mgr.plugin.remove(_key(7)) and not mgr.plugin.contains(_key(7))
    assert not mgr.plugin.remove(_key(7))


def test_num_kv_heads_that_cannot_divide_the_metadatas_hidden_size_is_a_config_error_with_fp8(tmp_path, caplog):
    # it was ignored: ChunkShape.of took one head for every chunk (one fp8 scale across all heads)
    cfg = _config(tmp_path / "kv", quant="fp8", num_kv_heads=3)  # hidden H * D = 16
    with pytest.raises(PluginConfigError, match=r"kvkernels\.num_kv_heads.*3 does not divide the hidden size 16"):
        KVKernelsBackend(dst_device="cpu", config=cfg, metadata=_metadata())
    assert not (tmp_path / "kv").exists()  # refused before the store opened: nothing made, nothing recovered
    # without fp8 the setting does nothing: the plugin is made (LMCache would serve without its
    # tier otherwise), and says so once
    with caplog.at_level(logging.WARNING, logger="kvkernels.integrations.lmcache"):
        m = Manager(tmp_path / "kv", num_kv_heads=3)
    try:
        obj, want = m.chunk(5)
        m.put([_key(5)], [obj])
        got = m.plugin.get_blocking(_key(5))
        assert bytes_equal(got.tensor, want)
        got.ref_count_down()
    finally:
        m.close()
    said = [r.getMessage() for r in caplog.records if "does not divide" in r.getMessage()]
    assert len(said) == 2 and "NOT created" in said[0] and "unused here (quant none)" in said[1], said


def test_num_kv_heads_is_not_checked_where_k_and_v_are_not_split(tmp_path):
    # MLA by its kv_shape (K/V factor 1, the latent has no heads), also without use_mla (LMCache's
    # TensorRT-LLM integration builds such metadata without setting it)
    md = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                         kv_dtype=torch.bfloat16, kv_shape=(L, 1, T, 1, 576), use_mla=False, chunk_size=T)
    b = KVKernelsBackend(dst_device="cpu", config=_config(tmp_path / "kv", quant="fp8", num_kv_heads=5), metadata=md)
    b.close()


def test_heads_that_do_not_divide_a_chunk_are_said(tmp_path, caplog):
    # without a kv_shape to check against at start (set here after it), such chunks are stored as
    # one head: said once, not silently
    m = Manager(tmp_path / "kv", quant="fp8")
    try:
        m.plugin._num_heads = 3
        with caplog.at_level(logging.WARNING, logger="kvkernels.integrations.lmcache"):
            for i in (11, 12):
                obj, _ = m.chunk(i)
                m.put([_key(i)], [obj])
        h = m.plugin.store.header(key_string(_key(11)))
        assert (h.meta.num_heads, h.meta.head_dim) == (1, H * D)
        said = [r for r in caplog.records if "do not divide the hidden size" in r.getMessage()]
        assert len(said) == 1 and "kvkernels.num_kv_heads" in said[0].getMessage()
    finally:
        m.close()


def test_num_kv_heads_overrides_the_metadata_for_fp8_scales(tmp_path):
    m = Manager(tmp_path / "kv", quant="fp8", num_kv_heads=1)  # metadata says H = 2
    try:
        obj, want = m.chunk(9)
        m.put([_key(9)], [obj])
        h = m.plugin.store.header(key_string(_key(9)))
        assert (h.meta.num_heads, h.meta.head_dim, h.meta.scheme) == (1, H * D, "fp8-token")
        got = m.plugin.get_blocking(_key(9))
        assert bool(((got.tensor.float() - want.float()).abs() <= 0.07 * want.float().abs().amax(-1, keepdim=True)).all())
        got.ref_count_down()
    finally:
        m.close()


# ----------------------------------------------------------------------------- layer-wise mode
# LMCache's layer-wise mode (use_layerwise) stores one object per (chunk, layer) under a
# LayerCacheEngineKey: KV_T2D [T, 2, H*D], KV_MLA_FMT [T, D] for MLA (KV_2TD [2, T, H*D], the
# blending format, is refused: test_refused_with_layerwise_blending).
LAYERWISE = {
    "T2D": ({"use_layerwise": True}, False, MemoryFormat.KV_T2D, (T, 2, H * D)),
    "TD": ({"use_layerwise": True}, True, MemoryFormat.KV_MLA_FMT, (T, D)),
}


def _layer_objs(m, fmt, shape, seed, dtype=torch.bfloat16):
    from lmcache.utils import LayerCacheEngineKey

    keys = [LayerCacheEngineKey(MODEL, 1, 0, seed, dtype, layer_id=layer) for layer in range(L)]
    objs, want = [], []
    for layer in range(L):
        obj = m.sm.allocate(torch.Size(shape), dtype, fmt)
        g = torch.Generator().manual_seed(seed * 100 + layer)
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=g).to(dtype))
        objs.append(obj)
        want.append(obj.tensor.clone())
    return keys, objs, want


@pytest.mark.parametrize("quant", ["none", "fp8"])
@pytest.mark.parametrize("order", sorted(LAYERWISE))
def test_layerwise_objects_round_trip_in_their_own_format(tmp_path, order, quant):
    """Per-layer objects are stored (one one-layer entry each), come back from both read paths
    and after a restart as objects of LMCache's layer-wise format, bytes equal (FP8: within
    e4m3's step); the entry on disk is the canonical staging (K then V) whatever the order."""
    options, mla, fmt, shape = LAYERWISE[order]
    kw = {"quant": quant} if quant != "none" else {}
    m = Manager(tmp_path / "kv", lmcache_options=options, use_mla=mla, **kw)
    try:
        assert m.plugin._layer_order == order
        keys, objs, want = _layer_objs(m, fmt, shape, seed=3)
        m.put(keys, objs)
        assert all(m.plugin.contains(k) for k in keys) and m.plugin.stats()["put_errors"] == 0
        header = m.plugin.store.header(key_string(keys[1]))
        assert header.meta.num_layers == 1 and header.meta.num_kv == (1 if mla else 2)

        def check(got):
            assert len(got) == L
            for o, w in zip(got, want):
                assert o is not None and o.get_memory_format() == fmt and tuple(o.tensor.shape) == shape
                if quant == "none":
                    assert bytes_equal(o.tensor, w)
                else:
                    err = (o.tensor.float() - w.float()).abs()
                    assert bool((err <= 0.0625 * w.float().abs() + 1e-2).all())
                o.ref_count_down()

        check(m.plugin.batched_get_blocking(keys))
        check(m.run(m.plugin.batched_get_non_blocking("lookup", keys)))
        # LMCache's own layer-wise retrieval: one future per layer over the layer's chunks
        tasks = list(m.sm.layerwise_batched_get([[k] for k in keys], location="kvkernels"))
        check([t.result(30)[0] for t in tasks])
        if quant == "none":  # the entry's bytes are the staging format: K then V, canonical order
            k_then_v = torch.stack([want[1]], 0) if mla else (
                want[1].transpose(0, 1) if order == "T2D" else want[1])
            raw = m.plugin.store.get(key_string(keys[1])).result()
            n = k_then_v.numel() * k_then_v.element_size()
            assert torch.equal(raw[:n], k_then_v.contiguous().view(-1).view(torch.uint8))
    finally:
        m.close()
    m2 = Manager(tmp_path / "kv", lmcache_options=options, use_mla=mla, **kw)  # a new process: same entries
    try:
        check(m2.plugin.batched_get_blocking(keys))
    finally:
        m2.close()


def test_an_unpin_after_the_store_dropped_the_entry_leaves_a_newer_lookups_pin(mgr):
    """Lookup A pins a chunk; its file is found corrupt and the store drops it (its pins go with
    it); LMCache stores the chunk again and lookup B pins it; then A unpins. A's unpin used to
    take B's store pin: the entry was evictable while B held it."""
    from kvkernels.io import key_digest

    k, ks = _key(601), key_string(_key(601))
    o, _ = mgr.chunk(1)
    mgr.put([k], [o])
    assert mgr.plugin.contains(k, pin=True)  # lookup A
    with open(mgr.plugin.store._index[key_digest(ks)].path, "r+b") as f:
        f.seek(4096 + 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    assert mgr.plugin.get_blocking(k) is None and mgr.plugin.store.pin_count(ks) == 0  # dropped, pins too
    o2, ref2 = mgr.chunk(2)
    mgr.put([k], [o2])
    assert mgr.plugin.contains(k, pin=True)  # lookup B
    assert mgr.plugin.unpin(k)  # lookup A's unpin: gives up the pin the store lost
    assert mgr.plugin.store.pin_count(ks) == 1 and mgr.plugin.pin_count(k) == 1
    assert mgr.plugin.unpin(k)  # lookup B's
    assert mgr.plugin.store.pin_count(ks) == 0 and mgr.plugin.pin_count(k) == 0
    # a pin of a key the store no longer holds counts nothing (the store's pin is the hit test)
    assert mgr.plugin.remove(k) and not mgr.plugin.contains(k, pin=True) and mgr.plugin.pin_count(k) == 0


def test_an_unpin_after_a_remove_leaves_the_pin_of_a_lookup_made_after_the_key_was_stored_again(mgr):
    """LMCache removes keys other requests still hold lookup pins on (remove_after_retrieve, clear):
    remove() dropped this plugin's count too, so the old lookup's unpin (sync) or prefetch (async)
    then took the pin of a lookup made after the key was stored again."""
    for sync in (True, False):
        k = _key(702 if sync else 703)
        ks = key_string(k)
        mgr.put([k], [mgr.chunk(1)[0]])
        if sync:
            assert mgr.plugin.contains(k, pin=True)  # lookup A
        else:
            assert mgr.run(mgr.plugin.batched_async_contains("A", [k], pin=True)) == 1
        assert mgr.plugin.remove(k)
        mgr.put([k], [mgr.chunk(2)[0]])
        assert mgr.run(mgr.plugin.batched_async_contains("B", [k], pin=True)) == 1  # lookup B
        if sync:
            mgr.plugin.unpin(k)  # A's unpin
        else:
            for o in mgr.run(mgr.plugin.batched_get_non_blocking("A", [k])):  # A's prefetch
                o.ref_count_down()
        assert mgr.plugin.store.pin_count(ks) == 1, "B's pin was taken"
        for o in mgr.run(mgr.plugin.batched_get_non_blocking("B", [k])):
            o.ref_count_down()
        assert mgr.plugin.store.pin_count(ks) == 0 and mgr.plugin.pin_count(k) == 0 and not mgr.plugin._lookup_pins


def test_a_tail_unpin_trims_the_record_of_the_lookup_that_just_ran(mgr):
    """LMCache unpins a lookup's rounded-off tail right after that lookup's batched_async_contains;
    the plugin trimmed the oldest lookup's record instead: the newest record stayed orphaned and its
    pin was never released (the entry could never be evicted)."""
    k1, k2 = _key(811), _key(812)
    mgr.put([k1, k2], [mgr.chunk(1)[0], mgr.chunk(2)[0]])
    assert mgr.run(mgr.plugin.batched_async_contains("A", [k1, k2], pin=True)) == 2
    mgr.plugin.store.remove(key_string(k2))  # the store drops one layer key (e.g. found corrupt)
    assert mgr.run(mgr.plugin.batched_async_contains("B", [k1, k2], pin=True)) == 1
    mgr.plugin.unpin(k1)  # LMCache's tail unpin for B (a partial chunk rounds to 0); B gets no prefetch
    for o in mgr.run(mgr.plugin.batched_get_non_blocking("A", [k1, k2])):
        o.ref_count_down()
    assert mgr.plugin.store.pin_count(key_string(k1)) == 0 and not mgr.plugin._lookup_pins


def test_layerwise_lookup_of_a_partly_stored_chunk_leaves_no_pins(tmp_path):
    """LMCache 0.5.6's layer-wise lookup (StorageManager.batched_contains over a chunk's layer keys,
    pin=True) records the pins only for a chunk found whole in one backend; a chunk with a layer
    missing (a dropped put) kept its other layers pinned forever, unevictable. Whole chunks keep
    their pins for LMCache to release."""
    options, mla, fmt, shape = LAYERWISE["T2D"]
    m = Manager(tmp_path / "kv", lmcache_options=options, use_mla=mla, fsync=False)
    try:
        keys, objs, _ = _layer_objs(m, fmt, shape, seed=5)
        m.put(keys[:-1], objs[:-1])  # the last layer's put never happened
        objs[-1].ref_count_down()
        for _ in range(3):
            hit, _mapping = m.sm.batched_contains(keys, None, True)
            assert hit == L - 1
        assert [m.plugin.pin_count(k) for k in keys] == [0] * L
        assert m.plugin.store.stats()["pinned"] == 0
        hit, _mapping = m.sm.batched_contains(keys[1:-1], None, True)  # another backend held layer 0
        assert hit == L - 2 and m.plugin.store.stats()["pinned"] == 0
        whole, wobjs, _ = _layer_objs(m, fmt, shape, seed=6)
        m.put(whole, wobjs)
        hit, mapping = m.sm.batched_contains(whole, None, True)
        assert hit == L and [m.plugin.pin_count(k) for k in whole] == [1] * L
        for k in whole:
            m.plugin.unpin(k)
        assert m.plugin.store.stats()["pinned"] == 0
    finally:
        m.close()


def test_layerwise_keys_of_a_whole_chunk_entry_miss_and_plain_keys_still_work(tmp_path):
    """A layer key whose entry is not one layer (cannot be a layer-wise object) is a miss, not
    garbage; whole-chunk keys keep their KV_2LTD objects in layer-wise mode."""
    from lmcache.utils import LayerCacheEngineKey

    m = Manager(tmp_path / "kv", lmcache_options={"use_layerwise": True})
    try:
        obj, want = m.chunk(5)
        m.put([_key(5)], [obj])
        got = m.plugin.batched_get_blocking([_key(5)])[0]
        assert got.get_memory_format() == MemoryFormat.KV_2LTD and bytes_equal(got.tensor, want)
        got.ref_count_down()
        # an entry of L layers stored under a layer key (not what LMCache writes): not readable as one layer
        lk = LayerCacheEngineKey(MODEL, 1, 0, 6, torch.bfloat16, layer_id=0)
        obj, _ = m.chunk(6)
        m.put([lk], [obj])
        assert m.plugin.batched_get_blocking([lk]) == [None]
        assert m.run(m.plugin.batched_get_non_blocking("lookup", [lk])) == []
    finally:
        m.close()


# ----------------------------------------------------------------------------- durability
def test_restart_sees_old_entries(tmp_path):
    m = Manager(tmp_path / "kv")
    o, ref = m.chunk(40)
    m.put([_key(40)], [o])
    m.close()
    m2 = Manager(tmp_path / "kv")  # a new plugin instance over the same directory
    try:
        assert m2.plugin.contains(_key(40))
        got = m2.plugin.get_blocking(_key(40))
        assert bytes_equal(got.tensor, ref)
        got.ref_count_down()
    finally:
        m2.close()


@pytest.mark.parametrize("where", ["region", "header"])
def test_corrupted_file_is_a_miss_never_garbage(tmp_path, where):
    m = Manager(tmp_path / "kv")
    o, ref = m.chunk(50)
    m.put([_key(50)], [o])
    (path,) = _entry_files(tmp_path / "kv")
    if where == "header":
        m.close()
    with open(path, "r+b") as f:
        f.seek(4096 + 100 if where == "region" else 200)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    if where == "header":
        m = Manager(tmp_path / "kv")  # recovery skips the bad file
    try:
        before = _active(m)
        assert m.plugin.get_blocking(_key(50)) is None
        assert _active(m) == before  # the MemoryObj allocated for the failed read went back
        assert not m.plugin.contains(_key(50))
        if where == "region":
            assert m.plugin.stats()["corrupt"] == 1  # detected by the checksum, not a plain miss
        else:
            assert len(m.plugin.store.recovery["bad_files"]) == 1
    finally:
        m.close()


def _active(m: Manager) -> int:
    """Live allocations in LMCache's CPU pool (leak check)."""
    return m.cpu.memory_allocator.pin_allocator.num_active_allocations


def _entry_bytes(tmp_path) -> int:
    """Bytes one stored chunk takes in the store (to size capacities in entries)."""
    probe = Manager(tmp_path / "probe")
    try:
        o, _ = probe.chunk(0)
        probe.put([_key(0)], [o])
        return probe.plugin.stats()["store"]["bytes_used"]
    finally:
        probe.close()


def test_eviction_keeps_newest(tmp_path):
    m = Manager(tmp_path / "kv", capacity_bytes=3 * _entry_bytes(tmp_path))
    try:
        pairs = [m.chunk(60 + i) for i in range(5)]
        for i, (o, _) in enumerate(pairs):
            m.put([_key(60 + i)], [o])
        assert [m.plugin.contains(_key(60 + i)) for i in range(5)] == [False, False, True, True, True]
        assert m.plugin.stats()["store"]["evictions"] == 2
        got = m.plugin.get_blocking(_key(64))
        assert bytes_equal(got.tensor, pairs[4][1])
        got.ref_count_down()
    finally:
        m.close()


def test_pinned_chunks_survive_eviction(tmp_path):
    """A chunk pinned by a lookup (``contains(pin=True)``) is not evicted before it is loaded."""
    m = Manager(tmp_path / "kv", capacity_bytes=2 * _entry_bytes(tmp_path))
    try:
        pairs = [m.chunk(80 + i) for i in range(4)]
        m.put([_key(80)], [pairs[0][0]])
        assert m.plugin.contains(_key(80), pin=True)  # the lookup pins it
        assert m.plugin.store.pin_count(key_string(_key(80))) == 1
        for i in (1, 2):
            m.put([_key(80 + i)], [pairs[i][0]])
        # 80 is the oldest but pinned: 81 was evicted instead
        assert [m.plugin.contains(_key(80 + i)) for i in range(3)] == [True, False, True]
        got = m.plugin.get_blocking(_key(80))
        assert bytes_equal(got.tensor, pairs[0][1])
        got.ref_count_down()
        m.sm.batched_unpin([_key(80)], locations=["kvkernels"])
        assert m.plugin.store.pin_count(key_string(_key(80))) == 0
        m.put([_key(83)], [pairs[3][0]])  # unpinned, and read after 82 was written: 82 is the LRU one
        assert [m.plugin.contains(_key(80 + i)) for i in range(4)] == [True, False, False, True]
        assert m.plugin.contains(_key(80), pin=False)
        m.put([_key(82)], [m.chunk(82)[0]])  # now 80 is the least recently used and unpinned: it goes
        assert [m.plugin.contains(_key(80 + i)) for i in range(4)] == [False, False, True, True]
    finally:
        m.close()


def test_inplace_io_moves_lmcache_memory_without_a_copy(tmp_path, monkeypatch):
    """Raw CPU chunks go to the store as views of the MemoryObj (K[l], V[l] per region) and come
    back straight into the new MemoryObj; entries written either way read back either way."""
    m = Manager(tmp_path / "kv")
    try:
        seen = {"put": [], "get": []}
        store = m.plugin.store
        real_put, real_get = store.put, store.get
        monkeypatch.setattr(store, "put", lambda k, st, meta: seen["put"].append(st) or real_put(k, st, meta))
        monkeypatch.setattr(store, "get", lambda k, out=None, layers=None, **kw: seen["get"].append(out) or real_get(k, out, layers, **kw))
        o, ref = m.chunk(7)
        lo, hi = o.tensor.data_ptr(), o.tensor.data_ptr() + o.tensor.numel() * o.tensor.element_size()
        m.put([_key(7)], [o])
        regions = seen["put"][0]
        assert isinstance(regions, list) and len(regions) == L and all(len(r) == 2 for r in regions)
        assert all(lo <= t.data_ptr() < hi for r in regions for t in r)  # views of LMCache's memory
        assert regions[1][1].data_ptr() == lo + (L + 1) * T * H * D * 2  # V of layer 1 in [2, L, T, H*D]
        got = m.plugin.get_blocking(_key(7))
        outs = seen["get"][0]
        g0 = got.tensor.data_ptr()
        assert isinstance(outs, list) and outs[0][0].data_ptr() == g0  # read straight into the result
        assert bytes_equal(got.tensor, ref)
        got.ref_count_down()
    finally:
        m.close()
    # the same store read and written by a plugin with inplace_io off (staging buffer + copy):
    # in-place entries store K|V unpadded, staged ones the padded region; both read back exactly
    m2 = Manager(tmp_path / "kv", inplace_io=False)
    try:
        got = m2.plugin.get_blocking(_key(7))
        assert bytes_equal(got.tensor, ref)
        got.ref_count_down()
        o, ref8 = m2.chunk(8)
        m2.put([_key(8)], [o])
    finally:
        m2.close()
    m3 = Manager(tmp_path / "kv")
    try:
        got = m3.plugin.get_blocking(_key(8))
        assert bytes_equal(got.tensor, ref8)
        got.ref_count_down()
        assert bytes_equal(m3.plugin.get_layers(_key(8), [2]), ref8[:, [2]])
        assert bytes_equal(m3.plugin.get_layers(_key(7), [3, 0]), ref[:, [0, 3]])
    finally:
        m3.close()


def _fp8_reference(ref: torch.Tensor, granularity: str) -> torch.Tensor:
    """What an FP8 round trip must give: kvkernels' torch reference quantize -> dequantize."""
    from kvkernels.quant import gather_quant, scatter_quant

    shape = ChunkShape.of(ref, H)
    src = ref.clone()
    buf = gather_quant(chunk_layout(src, shape), [0], quant="fp8", granularity=granularity, backend="torch")
    out = torch.zeros_like(ref)
    scatter_quant(buf, chunk_layout(out, shape), [0], quant="fp8", granularity=granularity, backend="torch")
    return out


@pytest.mark.parametrize("granularity, codec", [("token", "none"), ("block", "none"), ("token", "zstd")])
def test_fp8_storage_round_trip(tmp_path, granularity, codec):
    """``kvkernels.quant: fp8`` stores e4m3 codes + scales (about half the bytes) and restores
    exactly what kvkernels' FP8 reference restores; the header, not the config, says how to decode."""
    m = Manager(tmp_path / "kv", quant="fp8", quant_granularity=granularity, compression=codec)
    try:
        pairs = [m.chunk(300 + i) for i in range(3)]
        m.put([_key(300 + i) for i in range(3)], [p[0] for p in pairs])
        h = m.plugin.store.header(key_string(_key(300)))
        assert h.meta.scheme == f"fp8-{granularity}" and h.meta.codec == codec
        from kvkernels.quant import QuantStagingFormat

        qfmt = QuantStagingFormat.from_staging(h.meta.fmt, granularity)
        assert qfmt.payload_nbytes < h.meta.fmt.payload_nbytes  # (D + 4) / 2D of bf16 per token-head
        if codec == "none":  # the FP8 regions themselves (4 KiB padded) are what is stored
            assert [r.stored for r in h.regions] == [qfmt.region_nbytes] * L
        else:
            assert all(r.stored <= qfmt.region_nbytes for r in h.regions)
        got = m.plugin.batched_get_blocking([_key(300 + i) for i in range(3)])
        for g, (_, ref) in zip(got, pairs):
            want = _fp8_reference(ref, granularity)
            assert bytes_equal(g.tensor, want)
            assert (g.tensor.float() - ref.float()).abs().max() <= ref.float().abs().max() / 8  # e4m3: 3 mantissa bits
            g.ref_count_down()
        assert bytes_equal(m.plugin.get_layers(_key(301), [1]), _fp8_reference(pairs[1][1], granularity)[:, [1]])
    finally:
        m.close()
    m2 = Manager(tmp_path / "kv")  # restarted with the default (raw) config: old FP8 entries still decode
    try:
        got = m2.plugin.get_blocking(_key(302))
        assert bytes_equal(got.tensor, _fp8_reference(pairs[2][1], granularity))
        got.ref_count_down()
    finally:
        m2.close()


def test_fp8_setting_leaves_8bit_chunks_as_they_are(tmp_path):
    m = Manager(tmp_path / "kv", dtype=torch.float8_e4m3fn, quant="fp8")
    try:
        obj = m.sm.allocate(torch.Size([2, L, T, H * D]), torch.float8_e4m3fn, MemoryFormat.KV_2LTD)
        g = torch.Generator().manual_seed(5)
        obj.tensor.view(torch.uint8).copy_(torch.randint(0, 120, obj.tensor.shape, generator=g, dtype=torch.uint8))
        ref = obj.tensor.clone()
        m.put([_key(5, torch.float8_e4m3fn)], [obj])
        assert m.plugin.store.header(key_string(_key(5, torch.float8_e4m3fn))).meta.scheme == "raw"
        got = m.plugin.get_blocking(_key(5, torch.float8_e4m3fn))
        assert bytes_equal(got.tensor, ref)
        got.ref_count_down()
    finally:
        m.close()


def test_concurrent_puts_and_gets(mgr):
    n_threads, per = 4, 6
    errors = []

    def work(tid):
        try:
            for i in range(per):
                h = 10_000 * (tid + 1) + i
                o, ref = mgr.chunk(h)
                mgr.plugin.batched_submit_put_task([_key(h)], [o])
                o.ref_count_down()
                while not mgr.plugin.contains(_key(h)):
                    assert mgr.plugin.exists_in_put_tasks(_key(h)) or mgr.plugin.contains(_key(h))
                got = mgr.plugin.get_blocking(_key(h))
                if got is None or not bytes_equal(got.tensor, ref):
                    errors.append(h)
                if got is not None:
                    got.ref_count_down()
        except Exception as exc:  # surfaced below
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert mgr.plugin.stats()["puts"] == n_threads * per


def test_zstd_compression_round_trip(tmp_path):
    pytest.importorskip("zstandard")
    m = Manager(tmp_path / "kv", compression="zstd", byteshuffle=True)
    try:
        o, ref = m.chunk(70)
        m.put([_key(70)], [o])
        header = m.plugin.store.header(key_string(_key(70)))
        assert (header.meta.codec, header.meta.scheme) == ("zstd", "shuffle")
        assert sum(r.stored for r in header.regions) < ref.numel() * ref.element_size()
        got = m.plugin.get_blocking(_key(70))
        assert bytes_equal(got.tensor, ref)
        got.ref_count_down()
        assert bytes_equal(m.plugin.get_layers(_key(70), [3]), ref[:, [3]])
    finally:
        m.close()


def _store_undecodable(m, n: int, seed: int) -> None:
    """Store chunk ``n`` (zstd), then replace its regions by random bytes under the same header:
    the entry passes the store's checksums but does not decode."""
    o, _ = m.chunk(n)
    m.put([_key(n)], [o])
    ks = key_string(_key(n))
    h = m.plugin.store.header(ks)
    assert h.meta.codec == "zstd" and all(r.stored < r.raw for r in h.regions)
    g = torch.Generator().manual_seed(seed)
    junk = [torch.randint(0, 256, (r.stored,), generator=g, dtype=torch.uint8) for r in h.regions]
    m.plugin.store.remove(ks)
    m.plugin.store.put(ks, junk, h.meta).result()


def test_entry_that_does_not_decode_is_removed_not_a_miss_forever(tmp_path, caplog):
    """Regions that pass the store's checksum but do not decode (here zstd regions replaced by
    other bytes under the same header; in practice an entry in a region format this kvkernels
    refuses) are counted corrupt and removed, so LMCache stores the chunk again."""
    pytest.importorskip("zstandard")
    m = Manager(tmp_path / "kv", compression="zstd")
    try:
        _store_undecodable(m, 71, seed=0)
        before = _active(m)
        with caplog.at_level("WARNING"):
            assert m.plugin.get_blocking(_key(71)) is None
        assert _active(m) == before
        assert m.plugin.stats()["corrupt"] == 1 and not m.plugin.contains(_key(71))
        # the warning says what became of the entry (removed: this read's version was still there)
        assert any("does not decode" in r.getMessage() and r.getMessage().endswith("; removed")
                   for r in caplog.records)
        o2, ref2 = m.chunk(72)
        m.put([_key(71)], [o2])  # stored again under the key, and read back whole
        got = m.plugin.get_blocking(_key(71))
        assert bytes_equal(got.tensor, ref2)
        got.ref_count_down()
    finally:
        m.close()


@pytest.mark.parametrize("remove_does", ["returns False", "raises RuntimeError"])
def test_entry_that_does_not_decode_says_when_it_was_not_removed(tmp_path, caplog, monkeypatch, remove_does):
    """The corrupt warning names the entry's fate: a remove that found another version (False),
    or a store closed meanwhile (RuntimeError), leaves it; the message must not say 'removed'."""
    pytest.importorskip("zstandard")
    m = Manager(tmp_path / "kv", compression="zstd")
    try:
        _store_undecodable(m, 73, seed=1)

        def remove(key, *, expect=None):
            if remove_does == "returns False":
                return False
            raise RuntimeError("KVStore is closed")

        monkeypatch.setattr(m.plugin.store, "remove", remove)
        with caplog.at_level("WARNING"):
            assert m.plugin.get_blocking(_key(73)) is None
        want = "already removed or replaced" if remove_does == "returns False" else "the store closed meanwhile"
        msgs = [r.getMessage() for r in caplog.records if "does not decode" in r.getMessage()]
        assert msgs and all(want in s and not s.endswith("; removed") for s in msgs)
    finally:
        monkeypatch.undo()
        m.close()


def test_bench_tiny(tmp_path):
    from kvkernels.bench import bench_lmcache

    import json

    def rows_of(stem):
        with open(tmp_path / "out" / f"{stem}.json") as f:
            return json.load(f)["rows"]

    assert bench_lmcache.main(["--tiny", "--dir", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    rows = rows_of("bench_lmcache")
    assert [r["backend"] for r in rows] == list(bench_lmcache.BACKENDS)
    assert all(r["store_gbps"] > 0 and r["retrieve_gbps"] > 0 for r in rows)
    assert os.path.exists(tmp_path / "out" / "bench_lmcache.csv")
    assert bench_lmcache.main(["--tiny", "--restore", "--dir", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    assert all(r["retrieve_gbps"] > 0 for r in rows_of("bench_lmcache_restore"))
    assert bench_lmcache.main(["--tiny", "--layerwise", "--dir", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    rows = rows_of("bench_lmcache_layerwise")
    assert all(r["store_gbps"] > 0 and r["retrieve_gbps"] > 0 for r in rows) and len(rows) == 4


def test_foreign_entry_under_a_key_is_a_miss(mgr):
    """A store entry that is not an LMCache chunk (e.g. two blocks) is never handed to LMCache."""
    from kvkernels.io import EntryMeta

    lay = kvkernels.PagedLayout.from_vllm([torch.randn(2, 4, T, H, D).to(torch.bfloat16) for _ in range(L)])
    mgr.plugin.store.put(key_string(_key(77)), kvkernels.gather(lay, [0, 1]), EntryMeta.for_layout(lay, 2)).result()
    assert mgr.plugin.contains(_key(77))
    assert mgr.plugin.get_blocking(_key(77)) is None
    assert mgr.plugin.batched_get_blocking([_key(77)]) == [None]


def test_import_without_lmcache():
    """``import kvkernels.integrations.lmcache`` and config parsing work when lmcache is absent."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['lmcache'] = None\n"
            "import kvkernels.integrations.lmcache as m\n"
            "assert m.parse_extra_config({'kvkernels.paths': '/tmp/a,/tmp/b'}).paths == ('/tmp/a', '/tmp/b')\n"
            "try:\n    m.KVKernelsBackend\nexcept ImportError:\n    print('lazy-ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "lazy-ok" in out.stdout


def test_docs_yaml_config_creates_the_plugin(tmp_path):
    """docs/lmcache-kvkernels.yaml loads with LMCache's own config reader and creates the plugin."""
    here = os.path.dirname(os.path.abspath(__file__))
    cfg = LMCacheEngineConfig.from_file(os.path.join(here, os.pardir, "docs", "lmcache-kvkernels.yaml"))
    assert cfg.storage_plugins == ["kvkernels"]
    settings = parse_extra_config(cfg.extra_config)
    assert settings.capacity_bytes == 500_000_000_000 and len(settings.paths) == 2
    cfg.extra_config["kvkernels.paths"] = [str(tmp_path / "a"), str(tmp_path / "b")]
    cfg.max_local_cpu_size = 0.05
    loop = asyncio.new_event_loop()
    backends = CreateStorageBackends(cfg, _metadata(), loop)
    try:
        assert isinstance(backends["kvkernels"], KVKernelsBackend)
        assert len(backends["kvkernels"].store.paths) == 2
    finally:
        for b in reversed(list(backends.values())):
            b.close()
        loop.close()


# ------------------------------------------------ regressions found by review (2026-11-23)
def test_manager_close_with_puts_in_flight_drains_them_before_the_pool_is_freed(tmp_path):
    # StorageManager.close() closes LocalCPUBackend (freeing the pinned pool) before the plugins:
    # in-place puts still reading that pool crashed the process (SIGSEGV in the checksum)
    code = f"""
import sys, torch, glob, logging
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
logging.disable(logging.WARNING)
import test_lmcache_plugin as t
m = t.Manager({str(tmp_path / 'kv')!r}, fsync=True, io_threads=1, put_threads=1)
keys, objs = [], []
for i in range(24):
    o, _ = m.chunk(100 + i)
    keys.append(t._key(100 + i)); objs.append(o)
m.sm.batched_put(keys, objs)
m.sm.close()
print("entries", len(glob.glob({str(tmp_path / 'kv')!r} + "/**/*.kvk", recursive=True)))
"""
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "entries 24" in r.stdout


def test_sync_layerwise_retrieval_leaves_other_lookups_pins(tmp_path):
    # LMCache's sync layer-wise path pins in lookup, calls batched_get_non_blocking("fake_lookup_id")
    # and unpins in lookup_unpin: the plugin must not unpin there too (it took request B's pin)
    from lmcache.utils import LayerCacheEngineKey

    m = Manager(tmp_path / "kv", lmcache_options={"use_layerwise": True}, fsync=False)
    try:
        p = m.plugin
        keys = [LayerCacheEngineKey(MODEL, 1, 0, 1, torch.bfloat16, layer_id=l) for l in range(L)]
        objs = [m.sm.allocate(torch.Size((T, 2, H * D)), torch.bfloat16, MemoryFormat.KV_T2D) for _ in keys]
        for o in objs:
            o.tensor.normal_()
        m.put(keys, objs)
        for _req in ("A", "B"):  # two requests sharing the chunk look it up with pin=True
            hit, _ = m.sm.batched_contains(keys, ["kvkernels"], pin=True)
            assert hit == L
        for task in m.sm.layerwise_batched_get([[k] for k in keys], location="kvkernels"):  # A retrieves
            for o in task.result(30):
                o.ref_count_down()
        m.sm.batched_unpin(keys, ["kvkernels"])  # A's lookup_unpin
        assert p.pin_count(keys[0]) == 1 and p.store.pin_count(key_string(keys[0])) == 1  # B's pin stays
    finally:
        m.close()


def test_async_lookup_pins_are_released_by_their_prefetch_only(mgr):
    keys = [_key(300 + i) for i in range(3)]
    objs = [mgr.chunk(300 + i)[0] for i in range(3)]
    mgr.put(keys, objs)
    assert mgr.run(mgr.plugin.batched_async_contains("req-1", keys, pin=True)) == 3
    assert mgr.plugin.unpin(keys[2])  # LMCache releases a rounded-off tail itself
    got = mgr.run(mgr.plugin.batched_get_non_blocking("req-1", keys[:2]))
    for o in got:
        o.ref_count_down()
    assert len(got) == 2 and all(mgr.plugin.pin_count(k) == 0 for k in keys)
    assert not mgr.plugin._lookup_pins  # nothing left recorded for the finished lookup


def test_a_put_that_fails_before_the_store_releases_its_chunk_and_never_calls_back(mgr, monkeypatch):
    """The conversion or the store refuses a chunk (here io.put raises): LMCache's reference goes
    back, the callback is not called, the future fails, and nothing stays counted pending."""
    def refuse(*a, **k):
        raise OSError(28, "simulated: refused before the write")

    monkeypatch.setattr(mgr.plugin.io, "put", refuse)
    before = _active(mgr)
    o, _ = mgr.chunk(340)
    called = []
    futs = mgr.plugin.batched_submit_put_task([_key(340)], [o], on_complete_callback=called.append)
    o.ref_count_down()  # LMCache's own reference (StorageManager.batched_put drops it)
    mgr.plugin.flush(timeout=30)
    assert len(futs) == 1 and isinstance(futs[0].exception(timeout=30), OSError)
    assert called == [] and mgr.plugin.stats()["put_errors"] == 1 and not mgr.plugin.contains(_key(340))
    assert _active(mgr) == before and mgr.plugin._held == 0 and not mgr.plugin._put_tasks


def test_a_prefetch_whose_middle_chunk_is_corrupt_returns_the_prefix_and_frees_the_rest(mgr):
    """Prefix semantics: LMCache pairs the returned chunks with its keys by position, so after a
    chunk that fails to read nothing may be returned (a later chunk would restore the wrong
    tokens), and everything allocated after it goes back."""
    from kvkernels.io import key_digest

    keys = [_key(350 + i) for i in range(3)]
    refs = []
    for i, k in enumerate(keys):
        o, ref = mgr.chunk(350 + i)
        refs.append(ref)
        mgr.put([k], [o])
    with open(mgr.plugin.store._index[key_digest(key_string(keys[1]))].path, "r+b") as f:
        f.seek(4096 + 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    assert mgr.run(mgr.plugin.batched_async_contains("req-p", keys, pin=True)) == 3
    before = _active(mgr)
    got = mgr.run(mgr.plugin.batched_get_non_blocking("req-p", keys))
    assert len(got) == 1 and bytes_equal(got[0].tensor, refs[0])
    assert _active(mgr) == before + 1  # only the returned chunk is held
    got[0].ref_count_down()
    assert _active(mgr) == before and all(mgr.plugin.pin_count(k) == 0 for k in keys)
    assert mgr.plugin.contains(keys[2]) and not mgr.plugin.contains(keys[1])  # the corrupt one was dropped


def test_a_closed_plugin_answers_lookups_puts_and_prefetches_without_raising(mgr):
    """LMCache can close the plugin alone (closing its CPU backend closes it) and keep calling it:
    lookups said hit (every get then missed), puts raised into StorageManager.batched_put, and a
    prefetch raised inside LMCache's done-callback (the scheduler never heard back)."""
    keys = [_key(320 + i) for i in range(2)]
    mgr.put(keys, [mgr.chunk(320 + i)[0] for i in range(2)])
    assert mgr.run(mgr.plugin.batched_async_contains("req-c", keys, pin=True)) == 2
    before = _active(mgr)
    mgr.plugin.close()
    assert not mgr.plugin.contains(keys[0]) and mgr.plugin.batched_contains(keys) == 0
    o, _ = mgr.chunk(330)
    assert mgr.plugin.batched_submit_put_task([_key(330)], [o]) == []
    o.ref_count_down()
    assert mgr.run(mgr.plugin.batched_get_non_blocking("req-c", keys)) == []
    assert mgr.plugin.batched_get_blocking(keys) == [None, None] and not mgr.plugin.pin(keys[0])
    assert _active(mgr) == before  # nothing allocated from LMCache's pool (it may be freed with the plugin)
    assert not mgr.plugin._lookup_pins and all(mgr.plugin.pin_count(k) == 0 for k in keys)
    # a closed plugin's remove deletes nothing: the folder may be another store's by then
    from kvkernels.io import KVStore

    with KVStore(mgr.plugin.store.paths) as st:
        assert mgr.plugin.remove(keys[0]) is False
        assert st.contains(key_string(keys[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=str)
def test_byteshuffle_setting_stores_non_16bit_chunks_unshuffled(tmp_path, dtype):
    m = Manager(tmp_path / "kv", dtype=dtype, fsync=False, compression="zstd", byteshuffle=True)
    try:
        k = _key(7, dtype)
        obj = m.sm.allocate(torch.Size((2, L, T, H * D)), dtype, MemoryFormat.KV_2LTD)
        obj.tensor.view(torch.uint8).copy_(torch.randint(0, 256, obj.tensor.shape, dtype=torch.uint8)
                                           if dtype.itemsize == 1 else
                                           torch.randint(0, 256, (*obj.tensor.shape[:-1], obj.tensor.shape[-1] * 4),
                                                         dtype=torch.uint8))
        ref = obj.tensor.clone()
        m.put([k], [obj])
        assert m.plugin.contains(k) and m.plugin.stats()["put_errors"] == 0
        back = m.plugin.get_blocking(k)
        assert torch.equal(back.tensor.view(torch.uint8), ref.view(torch.uint8))
        back.ref_count_down()
    finally:
        m.close()


def test_a_key_stored_or_in_flight_counts_as_present_not_skipped(mgr):
    # re-stores of a key already there counted in put_skipped, the counter of chunks that could
    # not be stored: a dashboard read normal re-stores as failures
    obj, _ = mgr.chunk(21)
    obj2, _ = mgr.chunk(21)
    mgr.put([_key(21)], [obj])
    assert mgr.plugin.batched_submit_put_task([_key(21)], [obj2]) == []  # stored already
    obj2.ref_count_down()
    st = mgr.plugin.stats()
    assert (st["puts"], st["put_present"], st["put_skipped"]) == (1, 1, 0)
    eng = mgr.plugin.store.engine  # and in flight: its write held until the second batch is in
    orig, release = eng.write_file, threading.Event()

    def slow(*a, **k):
        release.wait(10)
        return orig(*a, **k)

    eng.write_file = slow
    try:
        a, _ = mgr.chunk(22)
        b, _ = mgr.chunk(22)
        assert len(mgr.plugin.batched_submit_put_task([_key(22)], [a])) == 1
        assert mgr.plugin.batched_submit_put_task([_key(22)], [b]) == []
        for o in (a, b):
            o.ref_count_down()
    finally:
        release.set()
        mgr.plugin.flush(timeout=30)
        eng.write_file = orig
    st = mgr.plugin.stats()
    assert (st["puts"], st["put_present"], st["put_skipped"]) == (2, 2, 0)


# ------------------------------------------------ regressions found by review (2026-11-23, 13th session)
def test_a_multi_group_chunk_is_skipped_not_raised_into_lmcache(mgr):
    s1, s2 = torch.Size([2, 2, T, H * D]), torch.Size([2, 2, T, 2 * H * D])
    obj = mgr.cpu.allocate([s1, s2], [torch.bfloat16, torch.bfloat16], MemoryFormat.KV_2LTD)
    assert obj is not None and len(obj.metadata.shapes) == 2
    before = obj.get_ref_count()
    assert mgr.plugin.batched_submit_put_task([_key(1)], [obj]) == []
    assert obj.get_ref_count() == before and not mgr.plugin.contains(_key(1))
    assert mgr.plugin.counters["put_skipped"] == 1
    obj.ref_count_down()


def test_sync_layerwise_retrieve_of_a_corrupt_layer_fails_instead_of_a_short_list(tmp_path):
    # LMCache's synchronous layer-wise retrieve pairs objects with token ranges by position after
    # marking every chunk retrieved: a short list would leave tokens unwritten but reported loaded
    from lmcache.utils import LayerCacheEngineKey
    from kvkernels.io.format import key_digest

    m = Manager(tmp_path / "kv", lmcache_options={"use_layerwise": True}, fsync=False)
    try:
        keys = [[LayerCacheEngineKey(MODEL, 1, 0, h, torch.bfloat16, layer_id=l) for l in range(L)] for h in (1, 2)]
        for ks in keys:
            objs = [m.sm.allocate(torch.Size((T, 2, H * D)), torch.bfloat16, MemoryFormat.KV_T2D) for _ in ks]
            for o in objs:
                o.tensor.normal_()
            m.put(ks, objs)
        ent = m.plugin.store._index[key_digest(key_string(keys[1][2]))]  # the second chunk, layer 2
        with open(ent.path, "r+b") as f:
            f.seek(ent.header.regions[0].offset + 5)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
        layer_major = [list(row) for row in zip(*keys)]
        for l, task in enumerate(m.sm.layerwise_batched_get(layer_major, location="kvkernels")):
            if l == 2:
                with pytest.raises(RuntimeError, match="1 of 2 chunks"):
                    task.result(30)
                break
            got = task.result(30)
            assert len(got) == 2
            for o in got:
                o.ref_count_down()
        assert m.plugin.counters["get_errors"] == 1
        # the async prefetch path keeps its prefix semantics: the leading chunk only
        got = m.run(m.plugin.batched_get_non_blocking("req-1", layer_major[2]))
        assert len(got) == 1
        for o in got:
            o.ref_count_down()
    finally:
        m.close()


def test_keys_lmcache_keeps_apart_never_share_an_entry():
    a = CacheEngineKey(MODEL, 1, 0, 0x1234, torch.bfloat16, request_configs={"lmcache.tag.user": "alice@b%c"})
    b = CacheEngineKey(MODEL, 1, 0, 0x1234, torch.bfloat16,
                       request_configs={"lmcache.tag.user": "alice", "lmcache.tag.b": "c"})
    c = CacheEngineKey(MODEL, 1, 0, 0x1234, torch.bfloat16, request_configs={"lmcache.tag.user": 7})
    d = CacheEngineKey(MODEL, 1, 0, 0x1234, torch.bfloat16, request_configs={"lmcache.tag.user": "7"})
    assert a.to_string() == b.to_string() and c.to_string() == d.to_string()  # LMCache's own strings collide
    assert a != b and c != d
    assert key_string(a) != key_string(b) and key_string(c) != key_string(d)
    e = CacheEngineKey(MODEL, 1, 0, 0x1234, torch.bfloat16, request_configs={"lmcache.tag.user": 7})
    assert c == e and key_string(c) == key_string(e)


def test_a_batch_larger_than_max_inflight_bytes_is_stored_whole_by_default(tmp_path):
    # the store's back pressure bounds the bytes in flight to the disk; it must not drop the tail
    # of a batch (the first version of the bound kept 2 of 6 chunks on an idle disk)
    m = Manager(tmp_path / "kv", fsync=False, max_inflight_bytes=8192)  # two chunks of 4096 B
    try:
        objs = [m.chunk(i)[0] for i in range(6)]
        m.put([_key(i) for i in range(6)], objs)
        assert all(m.plugin.contains(_key(i)) for i in range(6)) and m.plugin.counters["put_dropped_busy"] == 0
    finally:
        m.close()


def test_pending_puts_hold_at_most_max_pending_bytes_of_lmcache_memory(tmp_path):
    m = Manager(tmp_path / "kv", fsync=False, max_pending_bytes=4096, put_threads=2)  # one chunk: 4096 B
    try:
        eng = m.plugin.store.engine
        orig = eng.write_file
        release = threading.Event()

        def slow(*a, **k):
            release.wait(10)
            return orig(*a, **k)

        eng.write_file = slow
        objs = [m.chunk(i)[0] for i in range(6)]
        futs = m.plugin.batched_submit_put_task([_key(i) for i in range(6)], objs)
        for o in objs:
            o.ref_count_down()  # what StorageManager.batched_put does
        held = [o for o in objs if o.get_ref_count() > 0]
        assert len(futs) == 1 and len(held) == 1 and m.plugin.counters["put_dropped_busy"] == 5
        release.set()
        m.plugin.flush(timeout=30)
        assert all(o.get_ref_count() == 0 for o in objs) and m.plugin._held == 0
        assert m.plugin.contains(_key(0)) and not m.plugin.contains(_key(1))
        eng.write_file = orig
        m.put([_key(1)], [m.chunk(1)[0]])  # drained: accepted again
        assert m.plugin.contains(_key(1))
    finally:
        m.close()


def test_refused_in_lmcache_scheduler_role(tmp_path):
    meta = _metadata()
    meta.role = "scheduler"
    with pytest.raises(PluginConfigError, match="scheduler"):
        KVKernelsBackend(config=_config(tmp_path / "kv"), metadata=meta)


@pytest.mark.parametrize("use_mla", [False, True])
def test_refused_with_layerwise_blending(tmp_path, use_mla):
    """LMCache's blending connector reads every layer-0 hit's cached_positions (None from kvkernels:
    its retrieve failed on each hit); the plugin refuses that config at start instead, and LMCache
    keeps its other tiers."""
    cfg = _config(tmp_path / "kv", {"use_layerwise": True, "enable_blending": True})
    with pytest.raises(PluginConfigError, match="enable_blending"):
        KVKernelsBackend(config=cfg, metadata=_metadata(use_mla=use_mla))
    assert not os.path.exists(tmp_path / "kv")  # refused before the store opened
    KVKernelsBackend(config=_config(tmp_path / "ok", {"enable_blending": True}), metadata=_metadata()).close()


def test_blocking_gets_wait_a_bounded_time_for_room_then_miss(tmp_path):
    """LMCache's pool is full of objects in use: get_blocking / batched_get_blocking give None after
    _SYNC_ALLOC_WAIT_S (LMCache's busy_loop allocation waited forever), the batch waits once, not
    once per key; with room again the same keys read back."""
    import time
    from kvkernels.integrations.lmcache import backend as backend_mod

    m = Manager(tmp_path / "kv", fsync=False)
    held = []
    try:
        keys, want = [_key(h) for h in (1, 2, 3)], []
        objs = []
        for h in (1, 2, 3):
            o, ref = m.chunk(h)
            objs.append(o)
            want.append(ref)
        m.put(keys, objs)
        shape = torch.Size([2, L, T, H * D])
        while (o := m.cpu.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD, eviction=False,
                                   busy_loop=False)) is not None:
            held.append(o)
        failures = m.plugin.stats()["alloc_failures"]
        res = {}

        def gets():  # on a thread: the waits this test is about used to be endless
            res["one"] = m.plugin.get_blocking(keys[0])
            res["batch"] = m.plugin.batched_get_blocking(keys)

        t0 = time.monotonic()
        th = threading.Thread(target=gets, daemon=True)
        th.start()
        th.join(60)
        took = time.monotonic() - t0
        assert not th.is_alive(), "blocking get still waiting for room after 60 s"
        assert res == {"one": None, "batch": [None, None, None]}
        wait = backend_mod._SYNC_ALLOC_WAIT_S
        assert 2 * wait <= took < 2 * wait + 5, took  # two waits: one per call, not one per key
        assert m.plugin.stats()["alloc_failures"] == failures + 4
        for o in held:
            o.ref_count_down()
        held = []
        got = m.plugin.batched_get_blocking(keys)
        for o, ref in zip(got, want):
            assert o is not None and bytes_equal(o.tensor, ref)
            o.ref_count_down()
    finally:
        for o in held:
            o.ref_count_down()
        m.close()


def test_blocking_gets_without_a_cpu_pool_miss_at_once(tmp_path):
    """LMCache gives plugins no LocalCPUBackend when max_local_cpu_size is 0: a hit cannot be
    allocated, and the bounded wait for room must not apply (nothing can free any)."""
    import time

    m = Manager(tmp_path / "kv", fsync=False)
    try:
        obj, _ = m.chunk(1)
        m.put([_key(1)], [obj])
    finally:
        m.close()
    plugin = KVKernelsBackend(config=_config(tmp_path / "kv", fsync=False), metadata=_metadata())
    try:
        assert plugin.contains(_key(1))
        t0 = time.monotonic()
        assert plugin.get_blocking(_key(1)) is None
        assert plugin.batched_get_blocking([_key(1), _key(1)]) == [None, None]
        assert time.monotonic() - t0 < 1.0
    finally:
        plugin.close()


def test_sync_layerwise_get_waits_for_room_and_frees_everything_when_the_plugin_closes(tmp_path):
    """LMCache's pool has room for one of two chunks: the synchronous layer-wise get waits for room
    on a plugin thread (the event loop keeps running) and fails saying why; closed meanwhile
    (LMCache's DELETE /backends/<name>), it gives back the chunk it had allocated."""
    import time
    from lmcache.utils import LayerCacheEngineKey

    shape = torch.Size((T, 2, H * D))
    for close in (False, True):
        m = Manager(tmp_path / f"kv{int(close)}", lmcache_options={"use_layerwise": True}, fsync=False)
        held = []
        try:
            keys = [LayerCacheEngineKey(MODEL, 1, 0, h, torch.bfloat16, layer_id=0) for h in (1, 2)]
            m.put(keys, [m.sm.allocate(shape, torch.bfloat16, MemoryFormat.KV_T2D) for _ in keys])
            while (o := m.cpu.allocate(shape, torch.bfloat16, MemoryFormat.KV_T2D, eviction=False,
                                       busy_loop=False)) is not None:
                held.append(o)
            capacity = len(held)
            held.pop().ref_count_down()  # room for exactly one chunk
            if close:
                threading.Timer(0.3, lambda: m.sm.close_backend("kvkernels")).start()
            t0 = time.time()
            fut = asyncio.run_coroutine_threadsafe(m.plugin.batched_get_non_blocking("fake_lookup_id", keys), m.sm.loop)
            s = time.time()
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), m.sm.loop).result(5)
            assert time.time() - s < 0.5  # the loop is not blocked by the wait
            with pytest.raises(RuntimeError, match="closed" if close else "no room for it within 2 s"):
                fut.result(10)
            assert time.time() - t0 < (1.5 if close else 5)
            for o in held:
                o.ref_count_down()
            held = []
            again = []
            while (o := m.cpu.allocate(shape, torch.bfloat16, MemoryFormat.KV_T2D, eviction=False,
                                       busy_loop=False)) is not None:
                again.append(o)
            assert len(again) == capacity  # nothing leaked
            for o in again:
                o.ref_count_down()
        finally:
            for o in held:
                o.ref_count_down()
            m.close()


# ------------------------------------------------ regressions found by review (2026-11-24)
def test_a_put_batch_overlapping_close_skips_the_rest_and_lmcache_drops_its_references(mgr, monkeypatch):
    """close() (LMCache closing its CPU backend, or DELETE /backends/<name>, on another thread)
    ran while StorageManager.batched_put was inside the plugin: the submit of the next key failed
    (the put pool was shut down) and raised into batched_put, which has no try, so LMCache's loop
    dropping its own reference on every object never ran (the objects leaked). Keys from the close
    on are skipped, as for a put after close; the key submitted before it is still written."""
    p = mgr.plugin
    keys = [_key(900 + i) for i in range(3)]
    objs = [mgr.chunk(900 + i)[0] for i in range(3)]
    real_contains = p.store.contains
    closer = threading.Thread(target=p.close)

    def contains(ks):  # the second key passed the closed check; close() runs to its end meanwhile
        if ks == key_string(keys[1]) and not closer.is_alive() and not p._closed:
            closer.start()
            closer.join(30)
        return real_contains(ks)

    monkeypatch.setattr(p.store, "contains", contains)
    mgr.sm.batched_put(keys, objs)  # the real caller: raised RuntimeError('cannot schedule new futures ...')
    assert p._closed and not closer.is_alive()
    assert [o.get_ref_count() for o in objs] == [1, 1, 1]  # LocalCPUBackend's only (was 2: leaked)
    assert p.stats()["put_skipped"] == 2 and p.stats()["puts"] == 1 and p.stats()["put_errors"] == 0
    assert not p._put_tasks and p._held == 0
    from kvkernels.io import KVStore

    with KVStore(p.store.paths, engine="posix") as st:  # (the closed store answers as an empty one)
        assert st.contains(key_string(keys[0])) and not st.contains(key_string(keys[1]))


def test_a_layerwise_async_lookup_rounded_to_no_chunk_leaves_no_record_to_take_a_later_lookups_pins(tmp_path):
    """Layer-wise mode: a sync lookup (cache_engine.lookup, pin=True) holds a chunk's layer keys; a
    layer entry goes; an async lookup A finds L-1 layers, LMCache rounds that to 0 chunks, unpins
    them itself and asks for no prefetch. A's record of the L-1 pins stayed (the sync pin kept the
    unpin from trimming it); after the layer is stored again, lookup B pins the chunk and the sync
    lookup's unpin trimmed B's record instead of A's: B's prefetch released nothing and the chunk
    stayed pinned forever (never evictable)."""
    options, mla, fmt, shape = LAYERWISE["T2D"]
    m = Manager(tmp_path / "kv", lmcache_options=options, use_mla=mla, fsync=False)
    try:
        p = m.plugin
        keys, objs, _ = _layer_objs(m, fmt, shape, seed=9)
        last = objs[-1].tensor.clone()
        m.put(keys, objs)
        hit, mapping = m.sm.batched_contains(keys, None, True)  # the sync lookup
        assert hit == L and list(mapping) == ["kvkernels"]
        m.sm.remove(keys[-1])
        m.run(m.sm.async_lookup_and_prefetch("A", keys, [0, T], pin=True, keys_per_chunk=L))  # LMCache's own
        assert not p._lookup_pins  # A recorded nothing: LMCache unpinned its L-1 hits, no prefetch follows
        assert [p.store.pin_count(key_string(k)) for k in keys] == [1] * (L - 1) + [0]  # the sync lookup's
        again = m.sm.allocate(torch.Size(shape), torch.bfloat16, fmt)
        again.tensor.copy_(last)
        m.put([keys[-1]], [again])
        assert m.run(p.batched_async_contains("B", keys, pin=True)) == L  # lookup B (its prefetch follows)
        m.sm.batched_unpin(keys, ["kvkernels"])  # the sync lookup's lookup_unpin
        got = m.run(p.batched_get_non_blocking("B", keys))  # B's prefetch
        assert len(got) == L
        for o in got:
            o.ref_count_down()
        assert [p.store.pin_count(key_string(k)) for k in keys] == [0] * L  # was [1, 1, 1, 0]
        assert [p.pin_count(k) for k in keys] == [0] * L and not p._lookup_pins
    finally:
        m.close()


@pytest.mark.parametrize("granularity", ["token", "block"])
@pytest.mark.parametrize("heads,says", [(1, "several heads"), (4, "part of a head"), (None, None), (2, None)])
def test_num_kv_heads_that_divides_but_differs_from_the_metadata_is_said_with_fp8(tmp_path, caplog, heads, says,
                                                                                 granularity):
    # it was taken silently: one scale across both heads of kv_shape (coarser) or per half head
    md_heads = _metadata().kv_shape[3]
    assert md_heads == 2  # what the cases above assume
    with caplog.at_level(logging.WARNING, logger="kvkernels.integrations.lmcache"):
        b = KVKernelsBackend(dst_device="cpu", config=_config(tmp_path / "kv", quant="fp8", num_kv_heads=heads,
                                                              quant_granularity=granularity),
                             metadata=_metadata())
    b.close()
    said = [r.getMessage() for r in caplog.records if "differs from the" in r.getMessage()]
    if says is None:
        assert said == []
    else:
        assert len(said) == 1 and says in said[0] and f"num_kv_heads` {heads}" in said[0], said
        assert f"one scale per {'chunk' if granularity == 'block' else 'token'} and" in said[0], said


def test_the_staging_buffer_pool_is_bounded_across_sizes():
    # it kept up to `keep` buffers per size: a server's pool grew by a size for every token count
    # a prompt's last chunk ever had (a soak run: 516 MiB held for 256 sizes of a small model)
    from kvkernels.integrations.lmcache.chunk_io import BufferPool

    pool = BufferPool(keep=4)
    for n in range(1, 40):
        bufs = [pool.take(4096 * n) for _ in range(2)]
        for b in bufs:
            pool.give(b)
        assert pool.held <= 4
    assert {k[0] for k in pool._free} == {4096 * 38, 4096 * 39}  # the least recently given sizes went first
    kept = pool.take(4096 * 39)  # the most recent size is still there: reused, not new
    assert kept.data_ptr() in {b.data_ptr() for b in bufs}
    pool.give(kept)
    pool.clear()
    assert pool.held == 0
    none = BufferPool(keep=0)
    none.give(none.take(4096))
    assert none.held == 0


def test_chunks_of_many_token_counts_keep_a_bounded_staging_pool(tmp_path):
    # a staged path (zstd here) takes a buffer of the chunk's size: the last chunk of each prompt
    # has its own token count, so its own size (2 KiB per token and layer here: 4 KiB steps)
    from kvkernels.integrations.lmcache.chunk_io import ChunkIO
    from kvkernels.io import EntryMeta, KVStore

    keep, hd = 3, 512
    store = KVStore(str(tmp_path / "s"), engine="posix")
    try:
        io = ChunkIO(store, inplace=False, keep=keep)
        for tokens in range(2, 42, 2):  # 20 sizes
            t = torch.randn(2, 2, tokens, hd).to(torch.bfloat16)
            shape = ChunkShape.of(t, 1)
            meta = EntryMeta(layers=(0, 1), num_blocks=1, block_size=tokens, num_heads=1, head_dim=hd,
                             element_size=2, num_kv=2, num_layers=2, dtype="bfloat16", scheme="raw",
                             codec="zstd").validate()
            fut, _holds = io.put(f"k{tokens}", t, shape, meta)
            fut.result(timeout=60)
            out = torch.empty_like(t)
            io.finish_read(io.start_read(f"k{tokens}", out), out)
            assert bytes_equal(out, t)
        sizes = {k[0] for k in io.bufs._free}
        held = sum(len(lst) for lst in io.bufs._free.values())
        assert 0 < held <= keep, (held, len(sizes))
        assert held == io.bufs.held
    finally:
        store.close()


# ------------------------------------------------ review fixes (2026-11-25, 31st session)
def test_a_prefetch_cancelled_while_its_reads_run_frees_its_chunks_only_after_them(mgr, monkeypatch):
    """Found by review: a batched_get_non_blocking task cancelled while its reads ran (a timeout
    around the prefetch) gave its MemoryObjs back to LMCache at once; the reads then wrote the
    stored chunk into memory LMCache had handed to another user. They go back once the reads
    are done now (LMCache 0.5.6 itself never cancels this task)."""
    p = mgr.plugin
    obj, _ = mgr.chunk(7)
    mgr.put([_key(7)], [obj])
    pool = mgr.cpu.memory_allocator.pin_allocator
    active = pool.num_active_allocations
    started, release, finished = threading.Event(), threading.Event(), threading.Event()
    real_start, real_finish = p.io.start_read, p._finish_read

    def slow_start(*a, **k):  # a slow disk: the read is issued once released
        started.set()
        assert release.wait(20)
        return real_start(*a, **k)

    def finish(*a, **k):
        try:
            return real_finish(*a, **k)
        finally:
            finished.set()

    monkeypatch.setattr(p.io, "start_read", slow_start)
    monkeypatch.setattr(p, "_finish_read", finish)
    fut = asyncio.run_coroutine_threadsafe(p.batched_get_non_blocking("req-x", [_key(7)]), mgr.sm.loop)
    assert started.wait(20)
    fut.cancel()
    deadline = time.time() + 10
    while not fut.cancelled() and time.time() < deadline:
        time.sleep(0.01)
    assert fut.cancelled() and pool.num_active_allocations == active + 1  # still held for the read
    # LMCache hands out other memory meanwhile: the read cannot land in it
    new = mgr.sm.allocate(torch.Size([2, L, T, H * D]), torch.bfloat16, MemoryFormat.KV_2LTD)
    new.tensor.zero_()
    release.set()
    assert finished.wait(20)
    deadline = time.time() + 20  # the loop runs the read's done-callback, which gives the object back
    while pool.num_active_allocations > active + 1 and time.time() < deadline:
        time.sleep(0.01)
    assert not bool(new.tensor.ne(0).any())  # (it held the stored chunk's bytes before the fix)
    new.ref_count_down()
    assert pool.num_active_allocations == active  # the cancelled read's object went back after it


def test_a_prefetch_counts_a_key_gone_since_its_lookup_as_a_miss(mgr):
    """Found by review: the prefetch path counted nothing for a key whose entry was gone (or
    unreadable) when it ran, where batched_get_blocking counts a miss."""
    p = mgr.plugin
    keys = [_key(40 + i) for i in range(3)]
    mgr.put(keys, [mgr.chunk(40 + i)[0] for i in range(3)])
    assert mgr.run(p.batched_async_contains("req", keys, pin=True)) == 3
    p.remove(keys[1])
    s0 = p.stats()
    got = mgr.run(p.batched_get_non_blocking("req", keys))
    assert len(got) == 1
    for o in got:
        o.ref_count_down()
    s1 = p.stats()
    assert (s1["gets"] - s0["gets"], s1["hits"] - s0["hits"], s1["misses"] - s0["misses"]) == (3, 1, 1)


def test_extra_config_takes_pathlib_paths(tmp_path):
    """Found by review: lmcache_extra_config(Path(...)) raised "'PosixPath' object is not
    iterable", and [Path(...)] was refused as not a directory."""
    from pathlib import Path

    a, b = tmp_path / "a", tmp_path / "b"
    assert lmcache_extra_config(a)["kvkernels.paths"] == str(a)
    assert lmcache_extra_config([a, str(b)])["kvkernels.paths"] == [str(a), str(b)]
    assert parse_extra_config({"kvkernels.paths": Path(a)}).paths == (str(a),)
    with pytest.raises(PluginConfigError, match="`kvkernels.paths`: expected a directory or a list"):
        lmcache_extra_config(3)


def test_a_read_interrupted_while_waiting_gives_its_staging_buffer_back_only_when_it_ends(tmp_path):
    """A KeyboardInterrupt in ``finish_read``'s wait gave the staging buffer back to the pool while
    the store's thread still read into it: the next read took it, and got its bytes overwritten."""
    from concurrent.futures import Future

    from kvkernels.integrations.lmcache.chunk_io import ChunkIO, PendingRead

    class Interrupted(Future):
        def result(self, timeout=None):
            raise KeyboardInterrupt

    io = ChunkIO(None, inplace=False, keep=4)
    buf = io.bufs.take(4096)
    fut = Interrupted()
    pending = PendingRead(header=None, shape=None, fmt=None, buf=buf, future=fut)
    with pytest.raises(KeyboardInterrupt):
        io.finish_read(pending, torch.empty(4096, dtype=torch.uint8))
    assert io.bufs.held == 0  # still the read's
    fut.set_result(None)
    assert io.bufs.held == 1 and io.bufs.take(4096) is buf


# ------------------------------------------------ found by mutation testing (thirty-second session)
def test_key_string_format_is_stable():
    """Entries are stored under this string: a change makes every stored entry unreadable."""
    assert key_string(CacheEngineKey(MODEL, 1, 0, 0x1234, torch.bfloat16)) == \
        'lmcache/2:["test/llama-tiny",1,0,4660,"torch.bfloat16",null,null]'


def test_a_non_scalar_tag_value_is_kept_apart_from_its_repr_string():
    a = CacheEngineKey(MODEL, 1, 0, 1, torch.bfloat16, request_configs={"lmcache.tag.u": (1, 2)})
    b = CacheEngineKey(MODEL, 1, 0, 1, torch.bfloat16, request_configs={"lmcache.tag.u": "(1, 2)"})
    assert a != b and key_string(a) != key_string(b)


def test_batched_contains_counts_leading_keys_only(mgr):
    mgr.put([_key(0), _key(2)], [mgr.chunk(0)[0], mgr.chunk(2)[0]])
    assert mgr.plugin.batched_contains([_key(0), _key(1), _key(2)]) == 1


def test_a_read_error_counts_a_miss_not_a_hit(mgr, monkeypatch):
    from concurrent.futures import Future
    mgr.put([_key(1)], [mgr.chunk(1)[0]])

    def failing(*a, **k):
        f = Future()
        f.set_exception(OSError(5, "EIO"))
        return f

    monkeypatch.setattr(mgr.plugin.store, "get", failing)
    before = dict(mgr.plugin.counters)
    assert mgr.plugin.get_blocking(_key(1)) is None
    assert mgr.plugin.counters["hits"] == before["hits"]
    assert mgr.plugin.counters["misses"] == before["misses"] + 1


def _puts_behind_a_slow_disk(m, n):
    eng = m.plugin.store.engine
    orig, release = eng.write_file, threading.Event()
    eng.write_file = lambda *a, **k: (release.wait(10), orig(*a, **k))[1]
    objs = [m.chunk(i)[0] for i in range(n)]
    futs = m.plugin.batched_submit_put_task([_key(i) for i in range(n)], objs)
    for o in objs:
        o.ref_count_down()
    release.set()
    m.plugin.flush(timeout=30)
    eng.write_file = orig
    return futs


def test_a_chunk_that_reaches_max_pending_bytes_exactly_is_taken(tmp_path):
    m = Manager(tmp_path / "kv", fsync=False, max_pending_bytes=8192)  # two chunks of 4096 B
    try:
        futs = _puts_behind_a_slow_disk(m, 4)
        assert len(futs) == 2 and m.plugin.counters["put_dropped_busy"] == 2
    finally:
        m.close()


def test_a_bound_smaller_than_a_chunk_still_stores_one(tmp_path):
    m = Manager(tmp_path / "kv", fsync=False, max_pending_bytes=1000)
    try:
        futs = _puts_behind_a_slow_disk(m, 3)
        assert len(futs) == 1 and m.plugin.contains(_key(0))
    finally:
        m.close()


def test_run_windowed_keeps_at_most_window_started():
    """The documented read concurrency (4 x io_threads in flight) is run_windowed's window."""
    from concurrent.futures import Future
    from types import SimpleNamespace
    from kvkernels.integrations.lmcache.chunk_io import run_windowed
    live, peak = set(), [0]

    def start(i):
        f = Future()
        f.set_result(None)
        live.add(i)
        peak[0] = max(peak[0], len(live))
        return SimpleNamespace(future=f)

    run_windowed(10, start, lambda j, st: live.discard(j), 3)
    assert peak[0] == 3 and not live


@pytest.mark.parametrize("k", ["io_threads", "capacity_bytes", "put_threads", "max_pending_bytes", "num_kv_heads"])
def test_zero_is_refused_for_int_keys(k):
    with pytest.raises(PluginConfigError, match=k):
        parse_extra_config({"kvkernels.paths": "/tmp/x", f"kvkernels.{k}": 0})


@pytest.mark.parametrize("v,want", [("0", False), ("1", True), ("off", False), ("yes", True), (0, False)])
def test_bool_strings(v, want):
    assert parse_extra_config({"kvkernels.paths": "/tmp/x", "kvkernels.verify": v}).verify is want


@pytest.mark.parametrize("kv", [dict(quant="fp8"), dict(inplace_io=False)])
def test_a_converted_chunk_is_released_after_its_put(tmp_path, kv):
    m = Manager(tmp_path / "kv", fsync=False, **kv)
    try:
        obj = m.chunk(1)[0]
        m.put([_key(1)], [obj])
        assert obj.get_ref_count() == 0 and m.plugin.contains(_key(1))
    finally:
        m.close()
