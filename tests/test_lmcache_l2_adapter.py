"""LMCache MP-mode L2 adapter (kvkernels.integrations.lmcache.l2_adapter) through the real lmcache package.

The adapter is built the way ``lmcache server`` builds it: the ``--l2-adapter`` JSON is parsed by
LMCache's ``add_l2_adapters_args`` / ``parse_args_to_l2_adapters_config`` (``"type": "plugin"``)
and the adapter is created by LMCache's factory ``create_l2_adapter(config, l1_memory_desc)``.
Buffers are real MP-mode L1 objects from LMCache's ``L1MemoryManager``; keys are real
``ObjectKey``. Completion is observed through the adapter's event fds, as LMCache's store and
prefetch controllers do. One test runs the whole ``StorageManager`` (store controller -> adapter,
prefetch controller -> lookup-and-lock -> load -> unlock).

Without lmcache installed the module is skipped (set ``KVKERNELS_REQUIRE_LMCACHE=1`` in CI to make
that an error instead).
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import select
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

from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, ObjectKey, PrefetchTaskSpec  # noqa: E402
from lmcache.v1.distributed.config import (  # noqa: E402
    EvictionConfig,
    L1ManagerConfig,
    L1MemoryManagerConfig,
    StorageManagerConfig,
)
from lmcache.v1.distributed.l2_adapters import create_l2_adapter  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import (  # noqa: E402
    L2AdaptersConfig,
    add_l2_adapters_args,
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.distributed.memory_manager.l1_memory_manager import L1MemoryManager  # noqa: E402
from lmcache.v1.distributed.storage_manager import StorageManager  # noqa: E402
from lmcache.v1.platform.event_notifier import consume_fd  # noqa: E402

from kvkernels.integrations.lmcache.l2_adapter import (  # noqa: E402
    CLASS_NAME,
    MODULE_PATH,
    KVKernelsL2Adapter,
    KVKernelsL2AdapterConfig,
    L2AdapterConfigError,
    object_key_string,
    parse_adapter_params,
)
from kvkernels.io import KVStore  # noqa: E402
from kvtest import bytes_equal  # noqa: E402

# small llama-like object: L layers, T tokens, H kv heads x D head dim (hidden = H * D)
L, T, H, D = 4, 32, 2, 64
MODEL = "test/llama-tiny"
RANK = ObjectKey.ComputeKVRank(world_size=1, global_rank=0, local_world_size=1, local_rank=0)
KV = MemoryLayoutDesc(shapes=[torch.Size([2, L, T, H * D])], dtypes=[torch.bfloat16])
TIMEOUT = 30.0


def _key(i: int, group: int = 0, salt: str = "") -> ObjectKey:
    return ObjectKey(chunk_hash=i.to_bytes(8, "big"), model_name=MODEL, kv_rank=RANK, object_group_id=group,
                     cache_salt=salt)


def _spec(path, **params) -> dict:
    return {"type": "plugin", "module_path": MODULE_PATH, "class_name": CLASS_NAME,
            "adapter_params": {"paths": [str(path)], "fsync": False, **params}}


_PARSER = None


def _parse(spec: dict) -> L2AdaptersConfig:
    """What ``lmcache server --l2-adapter '<json>'`` does with the flag."""
    global _PARSER
    if _PARSER is None:
        _PARSER = add_l2_adapters_args(argparse.ArgumentParser())
    return parse_args_to_l2_adapters_config(_PARSER.parse_args(["--l2-adapter", json.dumps(spec)]))


class L1:
    """MP-mode L1 buffers (LMCache's L1MemoryManager), freed at teardown."""

    def __init__(self):
        self.mm = L1MemoryManager(L1MemoryManagerConfig(size_in_bytes=16 << 20, use_lazy=False, shm_name=""))
        self.live: list = []

    def alloc(self, n: int, desc: MemoryLayoutDesc = KV, seed: int | None = None, fill: int | None = None):
        err, objs = self.mm.allocate(desc, n)
        assert len(objs) == n, err
        self.live.extend(objs)
        for j, o in enumerate(objs):
            raw = o.raw_tensor[: o.get_size()]
            if seed is not None:
                g = torch.Generator().manual_seed(seed + j)
                raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=g))
            elif fill is not None:
                raw.fill_(fill)
        return objs

    def close(self):
        self.mm.free(self.live)
        self.live.clear()


@pytest.fixture
def l1():
    m = L1()
    yield m
    m.close()


def _make(l1: L1, path, **params) -> KVKernelsL2Adapter:
    (cfg,) = _parse(_spec(path, **params)).adapters
    adapter = create_l2_adapter(cfg, l1.mm.get_l1_memory_desc())
    assert isinstance(adapter, KVKernelsL2Adapter)
    return adapter


@pytest.fixture
def adapter(l1, tmp_path):
    a = _make(l1, tmp_path / "kv")
    yield a
    a.close()


def _wait(fd: int, query, timeout: float = TIMEOUT):
    """Poll ``fd`` like LMCache's controllers: wait until readable, drain it, query the result."""
    end = time.monotonic() + timeout
    while True:
        res = query()
        if res is not None and res != {}:
            return res
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError("no completion signalled")
        r, _, _ = select.select([fd], [], [], min(left, 0.5))
        if r:
            consume_fd(fd)


def _store(a: KVKernelsL2Adapter, keys, objs):
    tid = a.submit_store_task(keys, objs)
    done = {}
    while tid not in done:
        done.update(_wait(a.get_store_event_fd(), a.pop_completed_store_tasks))
    return done[tid]


def _lookup(a: KVKernelsL2Adapter, keys) -> list[int]:
    tid = a.submit_lookup_and_lock_task(keys, {0: KV})
    return _wait(a.get_lookup_and_lock_event_fd(), lambda: a.query_lookup_and_lock_result(tid)).get_indices_list()


def _load(a: KVKernelsL2Adapter, keys, objs) -> list[int]:
    tid = a.submit_load_task(keys, objs)
    return _wait(a.get_load_event_fd(), lambda: a.query_load_result(tid)).get_indices_list()


def _unlock_and_settle(a: KVKernelsL2Adapter, keys):
    a.submit_unlock(keys)
    # unlocks run on the adapter's lock thread; a lookup queued behind them completes after them
    _lookup(a, [])


def _bytes(obj) -> torch.Tensor:
    return obj.raw_tensor[: obj.get_size()].clone()


def _entry_files(root) -> list[str]:
    return sorted(glob.glob(os.path.join(str(root), "**", "*.kvk"), recursive=True))


# ----------------------------------------------------------------------------- creation / config
def test_created_by_lmcache_plugin_factory(l1, tmp_path):
    (cfg,) = _parse(_spec(tmp_path / "kv", capacity_bytes=1 << 30, io_threads=2)).adapters
    a = create_l2_adapter(cfg, l1.mm.get_l1_memory_desc())
    try:
        assert isinstance(a, KVKernelsL2Adapter)
        # the factory found KVKernelsL2AdapterConfig by name and parsed adapter_params with it
        assert a.settings.capacity_bytes == 1 << 30 and a.store.io_threads == 2
        assert a.store.paths == [str(tmp_path / "kv")]
        fds = {a.get_store_event_fd(), a.get_lookup_and_lock_event_fd(), a.get_load_event_fd()}
        assert len(fds) == 3  # LMCache's controllers map fd -> adapter: they must differ
        assert a.supports_global_eviction  # capacity declared to LMCache's eviction controller
        assert a.report_status()["is_healthy"] is True
        # non-blocking: the store completes later and is signalled on the store fd only
        obj = l1.alloc(1, seed=1)
        tid = a.submit_store_task([_key(1)], obj)
        r, _, _ = select.select([a.get_store_event_fd()], [], [], TIMEOUT)
        assert r == [a.get_store_event_fd()]
        res = a.pop_completed_store_tasks()  # the result is there once the fd is readable
        assert res[tid].is_successful() and res[tid].bytes_transferred() == obj[0].get_size()
        assert a.pop_completed_store_tasks() == {}  # popped once
        assert a.get_usage().total_bytes_used == obj[0].get_size()
    finally:
        a.close()
    a.close()  # idempotent
    assert a.report_status()["is_healthy"] is False
    with pytest.raises(RuntimeError, match="closed"):
        a.submit_store_task([_key(2)], obj)


@pytest.mark.parametrize("params, key", [
    ({"paths": None}, "adapter_params.paths"),
    ({"paths": 7}, "adapter_params.paths"),
    ({"engine": "spdk"}, "adapter_params.engine"),
    ({"capacity_bytes": "lots"}, "adapter_params.capacity_bytes"),
    ({"compression": "brotli"}, "adapter_params.compression"),
    ({"fsync": "maybe"}, "adapter_params.fsync"),
    ({"capcity_bytes": 10}, "capcity_bytes"),          # a typo is an error, not ignored
    ({"kvkernels.paths": "/x"}, "without the `kvkernels.` prefix"),
    ({"per_worker_subdir": True}, "does not apply in MP mode"),
    ({"quant": "int4"}, "adapter_params.quant"),
    ({"num_kv_heads": 0}, "adapter_params.num_kv_heads"),
    ({"inplace_io": False}, "inplace_io"),                # an in-process plugin setting the adapter does not do
    # the other key a message names is the adapter's too (it said "unless kvkernels.compression ...")
    ({"byteshuffle": True}, "unless `adapter_params.compression` is a codec"),
    ({"byteshuffle": True, "compression": "zstd", "quant": "fp8"}, "with `adapter_params.quant`: fp8"),
])
def test_bad_config_raises_naming_the_key(l1, tmp_path, params, key):
    spec = _spec(tmp_path / "kv")
    spec["adapter_params"].update(params)
    if spec["adapter_params"]["paths"] is None:
        del spec["adapter_params"]["paths"]
    (cfg,) = _parse(spec).adapters  # LMCache's CLI parsing only checks module_path / class_name
    with pytest.raises(ValueError, match=key.replace(".", r"\.")) as info:
        create_l2_adapter(cfg, l1.mm.get_l1_memory_desc())
    assert isinstance(info.value, L2AdapterConfigError)
    assert not os.path.exists(tmp_path / "kv")  # nothing created for a rejected config


def test_the_documented_server_command_parses_with_lmcache(tmp_path):
    # docs/lmcache-mp.md's `lmcache server` command lacked --eviction-policy, which LMCache 0.5.6
    # requires with --l1-size-gb: the command a user copies failed with a traceback
    import shlex

    from lmcache.v1.distributed.config import parse_args as parse_server_args

    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "lmcache-mp.md")).read()
    block = doc.split("\nlmcache server", 1)[1].split("```", 1)[0]  # the command, to its fence
    argv = shlex.split("lmcache server" + block.replace("\\\n", " "))[2:]
    cfg = parse_server_args(argv)  # what `lmcache server` does with its storage arguments
    (adapter,) = cfg.l2_adapter_config.adapters
    assert CLASS_NAME in repr(vars(adapter)) and MODULE_PATH in repr(vars(adapter))  # (LMCache imports neither here)
    params = json.loads(argv[argv.index("--l2-adapter") + 1])["adapter_params"]
    parse_adapter_params(params)  # and the adapter takes its adapter_params


def test_a_bad_environment_variable_is_named_without_blaming_the_paths(l1, tmp_path, monkeypatch):
    monkeypatch.setenv("KVKERNELS_IO_THREADS", "abc")
    with pytest.raises(L2AdapterConfigError) as info:
        _make(l1, tmp_path / "kv")
    assert str(info.value).startswith("kvkernels L2 adapter: `KVKERNELS_IO_THREADS`")
    assert "adapter_params.paths" not in str(info.value)


def test_bad_config_types(tmp_path):
    with pytest.raises(TypeError, match="adapter_params"):
        KVKernelsL2AdapterConfig.from_dict(["/tmp/x"])
    with pytest.raises(TypeError, match="config"):
        KVKernelsL2Adapter(42)
    with pytest.raises(ValueError, match="adapter_params must be a dict"):  # LMCache's own check
        _parse({"type": "plugin", "module_path": MODULE_PATH, "class_name": CLASS_NAME, "adapter_params": [1]})
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")  # a path that cannot be a directory
    with pytest.raises(L2AdapterConfigError, match="adapter_params.paths"):
        KVKernelsL2Adapter({"paths": str(blocker / "kv")})


# ----------------------------------------------------------------------------- round trips
MLA = MemoryLayoutDesc(shapes=[torch.Size([1, L, T, D])], dtypes=[torch.float16])
MLA3D = MemoryLayoutDesc(shapes=[torch.Size([L, T, D])], dtypes=[torch.float32])  # engine-driven MLA
MULTI = MemoryLayoutDesc(shapes=[torch.Size([2, L, T, H * D]), torch.Size([3, 5])],
                         dtypes=[torch.bfloat16, torch.float32])  # two kernel groups in one object


@pytest.mark.parametrize("desc", [KV, MLA, MLA3D, MULTI], ids=["kv2ltd", "mla", "mla3d", "multigroup"])
def test_store_lookup_load_round_trip(adapter, l1, desc):
    keys = [_key(10 + i) for i in range(3)]
    src = l1.alloc(3, desc, seed=10)
    refs = [_bytes(o) for o in src]
    res = _store(adapter, keys, src)
    assert res.is_successful() and res.bytes_transferred() == sum(o.get_size() for o in src)
    assert _lookup(adapter, keys) == [0, 1, 2]
    dst = l1.alloc(3, desc, fill=0xAB)
    assert _load(adapter, keys, dst) == [0, 1, 2]
    for o, ref in zip(dst, refs):
        assert bytes_equal(_bytes(o), ref)
    _unlock_and_settle(adapter, keys)
    assert all(adapter.lock_count(k) == 0 for k in keys)


def test_entries_are_layer_addressable_staging(adapter, l1):
    """A KV object is stored in kvkernels' staging format: region l = K[l] then V[l], one per layer."""
    (src,) = l1.alloc(1, seed=20)
    assert _store(adapter, [_key(20)], [src]).is_successful()
    ks = object_key_string(_key(20))
    assert ks.startswith("lmcache-mp:" + MODEL)
    h = adapter.store.header(ks)
    assert h.meta.layers == tuple(range(L)) and h.meta.num_kv == 2 and h.meta.dtype == "bfloat16"
    chunk = src.tensor  # [2, L, T, H*D]
    layer2 = adapter.store.get(ks, layers=[2]).result()  # one layer read alone
    payload = 2 * T * H * D * 2
    want = torch.cat([chunk[0, 2].reshape(-1), chunk[1, 2].reshape(-1)]).view(torch.uint8)
    assert bytes_equal(layer2[:payload], want)


def test_raw_objects_move_in_place(adapter, l1, monkeypatch):
    """Stores hand the store views of the L1 object (no staging copy); loads read into L1 directly."""
    seen = []
    real_put, real_get = adapter.store.put, adapter.store.get
    monkeypatch.setattr(adapter.store, "put", lambda k, st, meta: seen.append(st) or real_put(k, st, meta))
    monkeypatch.setattr(adapter.store, "get", lambda k, out=None, layers=None, **kw: seen.append(out) or real_get(k, out, layers, **kw))
    (src,) = l1.alloc(1, seed=25)
    assert _store(adapter, [_key(25)], [src]).is_successful()
    lo = src.tensor.data_ptr()
    assert isinstance(seen[0], list) and seen[0][0][0].data_ptr() == lo  # K[0] of the L1 object itself
    assert seen[0][0][1].data_ptr() == lo + L * T * H * D * 2  # V[0]
    (dst,) = l1.alloc(1, fill=0)
    assert _lookup(adapter, [_key(25)]) == [0] and _load(adapter, [_key(25)], [dst]) == [0]
    assert isinstance(seen[1], list) and seen[1][0][0].data_ptr() == dst.tensor.data_ptr()
    assert bytes_equal(_bytes(dst), _bytes(src))
    _unlock_and_settle(adapter, [_key(25)])


def test_store_skips_existing_keys(adapter, l1):
    src = l1.alloc(2, seed=30)
    assert _store(adapter, [_key(30)], src[:1]).bytes_transferred() == src[0].get_size()
    res = _store(adapter, [_key(30), _key(31)], src)  # key 30 is there: only 31 is written
    assert res.is_successful() and res.bytes_transferred() == src[1].get_size()
    assert adapter.store.stats()["puts"] == 2
    # counted as present (the plugin's put_present), not as a store that could not be done
    assert adapter.counters["store_present"] == 1 and adapter.counters["store_errors"] == 0
    dst = l1.alloc(1, fill=0)
    assert _load(adapter, [_key(30)], dst) == [0]
    assert bytes_equal(_bytes(dst[0]), _bytes(src[0]))  # the first write is kept


def test_zstd_round_trip(l1, tmp_path):
    pytest.importorskip("zstandard")
    a = _make(l1, tmp_path / "kv", compression="zstd", byteshuffle=True)
    try:
        src = l1.alloc(1, seed=40)
        src[0].tensor.view(torch.int16).bitwise_and_(0x0FFF)  # compressible high bytes
        ref = _bytes(src[0])
        assert _store(a, [_key(40)], src).is_successful()
        h = a.store.header(object_key_string(_key(40)))
        assert (h.meta.codec, h.meta.scheme) == ("zstd", "shuffle")
        assert sum(r.stored for r in h.regions) < ref.numel()
        dst = l1.alloc(1, fill=0)
        assert _load(a, [_key(40)], dst) == [0]
        assert bytes_equal(_bytes(dst[0]), ref)
    finally:
        a.close()


def _normal(objs, seed):
    """Fill bf16 objects with N(0, 1) values per head, each head at its own scale (random bytes
    would be mostly NaN / huge for an accuracy check)."""
    g = torch.Generator().manual_seed(seed)
    for o in objs:
        t = o.tensor.view(2, L, T, H, D)
        t.copy_((torch.randn(t.shape, generator=g) * torch.tensor([0.05, 20.0]).view(1, 1, 1, H, 1)).bfloat16())


@pytest.mark.parametrize("heads, granularity", [(None, "token"), (H, "token"), (H, "block")])
def test_fp8_round_trip(l1, tmp_path, heads, granularity):
    """quant: fp8 stores e4m3 codes + fp32 scales (about half the bytes) and loads dequantize into
    the L1 object. num_kv_heads gives each head its own scale; without it one scale spans the
    token's row (all heads), which costs the small-magnitude head its precision."""
    params = {"quant": "fp8", "quant_granularity": granularity, **({"num_kv_heads": heads} if heads else {})}
    a = _make(l1, tmp_path / "kv", **params)
    try:
        src = l1.alloc(1, fill=0)
        _normal(src, 7)
        ref = src[0].tensor.float().clone()
        assert _store(a, [_key(70)], src).is_successful()
        h = a.store.header(object_key_string(_key(70)))
        assert h.meta.scheme == f"fp8-{granularity}" and h.meta.num_heads == (heads or 1)
        assert sum(r.stored for r in h.regions) < src[0].get_size()  # 4 KiB-rounded regions: 0.75x at this toy size
        dst = l1.alloc(1, fill=0)
        assert _load(a, [_key(70)], dst) == [0]
        err = (dst[0].tensor.float() - ref).abs().view(2, L, T, H, D)
        x = ref.view(2, L, T, H, D).abs()
        # the scale's scope: per head (num_kv_heads) or the whole row; per token or per chunk
        dims = ([-1] if heads else [-1, -2]) + ([2] if granularity == "block" else [])
        s = x.amax(dim=dims, keepdim=True) / 448
        bound = 2.0**-4 * x + 2.0**-10 * s + 2.0**-8 * x  # e4m3 half step, subnormal half step, bf16 rounding
        assert bool((err <= bound * 1.001 + 1e-30).all())
        small = float(err[..., 0, :].max() / x[..., 0, :].max())
        assert small < 0.07 if heads else small < 0.5  # one row scale costs the small head its precision
    finally:
        a.close()
    b = _make(l1, tmp_path / "kv")  # a restart without the setting still decodes by the header
    try:
        dst = l1.alloc(1, fill=0)
        assert _load(b, [_key(70)], dst) == [0]
        assert float((dst[0].tensor.float() - ref).abs().max()) <= 20.0 * 5 * 0.0625
    finally:
        b.close()


def test_num_kv_heads_must_divide_the_hidden_size(l1, tmp_path, caplog):
    # every store failed (a warning each) while report_status said healthy
    a = _make(l1, tmp_path / "kv", quant="fp8", num_kv_heads=3)  # hidden = 2 * 64 = 128
    try:
        assert a.report_status()["is_healthy"]
        with caplog.at_level(logging.ERROR, logger="kvkernels.integrations.lmcache"):
            for i in (3, 4):
                src = l1.alloc(1, seed=i)
                assert not _store(a, [_key(i)], src).is_successful()
        st = a.report_status()
        assert st["counters"]["store_errors"] == 2
        assert not a.store.contains(object_key_string(_key(3)))
        assert st["is_healthy"] is False and len(st["config_errors"]) == 1
        assert "`adapter_params.num_kv_heads`: 3 does not divide" in st["config_errors"][0]
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR and "num_kv_heads" in r.getMessage()]
        assert len(errors) == 1  # said once, not per object
    finally:
        a.close()


def test_num_kv_heads_that_cannot_divide_is_unused_without_fp8(l1, tmp_path, caplog):
    # it only shapes fp8 scales: without fp8 every store of such objects failed all the same
    a = _make(l1, tmp_path / "kv", num_kv_heads=3)  # hidden = 2 * 64 = 128, quant none
    try:
        with caplog.at_level(logging.WARNING, logger="kvkernels.integrations.lmcache"):
            for i in (5, 6):
                src = l1.alloc(1, seed=i)
                assert _store(a, [_key(i)], src).is_successful()
                dst = l1.alloc(1, fill=0)
                assert _load(a, [_key(i)], dst) == [0]
                assert bytes_equal(_bytes(dst[0]), _bytes(src[0]))
        st = a.report_status()
        assert st["is_healthy"] and st["config_errors"] == [] and st["counters"]["store_errors"] == 0
        said = [r for r in caplog.records if "unused here (quant none)" in r.getMessage()]
        assert len(said) == 1
    finally:
        a.close()


# ----------------------------------------------------------------------------- lookups, locks, misses
def test_partial_lookup_locks_and_unlock(adapter, l1):
    keys = [_key(50 + i) for i in range(5)]
    src = l1.alloc(2, seed=50)
    assert _store(adapter, [keys[0], keys[2]], src).is_successful()
    assert _lookup(adapter, keys) == [0, 2]  # bit i = keys[i], not a prefix count
    assert _lookup(adapter, keys[:1]) == [0]
    assert [adapter.lock_count(k) for k in keys] == [2, 0, 1, 0, 0]
    # locked entries are refused by delete (LMCache's eviction controller / API)
    adapter.delete([keys[0], keys[2]])
    assert adapter.store.contains(object_key_string(keys[0]))
    assert adapter.report_status()["counters"]["delete_refused_locked"] == 2
    _unlock_and_settle(adapter, keys)  # keys that were not locked are ignored
    assert [adapter.lock_count(k) for k in keys] == [1, 0, 0, 0, 0]
    used = adapter.get_usage().total_bytes_used
    adapter.delete([keys[0], keys[2]])  # keys[2] is unlocked now: deleted; keys[0] still locked
    assert adapter.store.contains(object_key_string(keys[0]))
    assert not adapter.store.contains(object_key_string(keys[2]))
    assert adapter.get_usage().total_bytes_used == used - src[1].get_size()
    assert _lookup(adapter, [keys[2]]) == []
    _unlock_and_settle(adapter, [keys[0]])
    assert adapter.lock_count(keys[0]) == 0 and adapter.report_status()["locked_keys"] == 0


def test_a_closed_adapters_delete_removes_nothing_of_the_folders_next_store(l1, tmp_path):
    """KVStore.remove on a closed store raises now (it used to unlink a file of the store that
    had opened the folder since); LMCache's eviction may still call delete after close: nothing
    is deleted and nothing is raised into it."""
    from kvkernels.io import KVStore

    a = _make(l1, tmp_path / "kv")
    k = _key(60)
    assert _store(a, [k], l1.alloc(1, seed=60)).is_successful()
    paths = a.store.paths
    a.close()
    with KVStore(paths) as st:
        a.delete([k])
        assert st.contains(object_key_string(k))

def test_miss_and_layout_mismatch_fail_without_touching_buffers(adapter, l1):
    src = l1.alloc(1, seed=60)
    assert _store(adapter, [_key(60)], src).is_successful()
    other = MemoryLayoutDesc(shapes=[torch.Size([2, L, T, H * D])], dtypes=[torch.float16])  # same size, other dtype
    dst = l1.alloc(2, fill=0x5A) + l1.alloc(1, other, fill=0x5A)
    sentinel = _bytes(dst[1])
    # key 61 was never stored; key 60 into a buffer of another layout is refused
    assert _load(adapter, [_key(60), _key(61), _key(60)], dst) == [0]
    assert bytes_equal(_bytes(dst[0]), _bytes(src[0]))
    assert bytes_equal(_bytes(dst[1]), sentinel) and bytes_equal(_bytes(dst[2]), sentinel)
    c = adapter.report_status()["counters"]
    assert (c["load_misses"], c["load_mismatch"]) == (1, 1)
    assert _load(adapter, [], []) == []  # an empty task completes too


def test_corrupted_entry_is_a_failed_load_never_garbage(adapter, l1, tmp_path):
    src = l1.alloc(2, seed=70)
    assert _store(adapter, [_key(70)], src[:1]).is_successful()
    (bad,) = _entry_files(tmp_path / "kv")
    assert _store(adapter, [_key(71)], src[1:]).is_successful()
    with open(bad, "r+b") as f:  # flip one byte inside layer 1's region
        h = adapter.store.header(object_key_string(_key(70)))
        f.seek(h.regions[1].offset + 123)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    dst = l1.alloc(2, fill=0x11)
    assert _lookup(adapter, [_key(70), _key(71)]) == [0, 1]
    # the bad entry's bit is clear (raw entries are read in place, so its buffer content is
    # unspecified: a cleared bit is how LMCache learns not to use it); the good entry still loads
    assert _load(adapter, [_key(70), _key(71)], dst) == [1]
    assert bytes_equal(_bytes(dst[1]), _bytes(src[1]))
    assert adapter.report_status()["counters"]["corrupt"] == 1
    _unlock_and_settle(adapter, [_key(70), _key(71)])
    assert _lookup(adapter, [_key(70)]) == []  # the store dropped the entry: later lookups miss
    assert adapter.store.stats()["corrupt"] == 1


# ----------------------------------------------------------------------------- persistence, concurrency
def test_entries_persist_after_close_and_reopen(l1, tmp_path):
    a = _make(l1, tmp_path / "kv", fsync=True)
    src = l1.alloc(3, seed=80)
    keys = [_key(80), _key(81, group=1), _key(82, salt="user-a")]
    assert _store(a, keys, src).is_successful()
    a.close()
    b = _make(l1, tmp_path / "kv")  # a new server process over the same directory
    try:
        assert b.store.recovery["entries"] == 3 and b.store.recovery["bad_files"] == []
        # every ObjectKey field is part of the entry's identity
        assert _lookup(b, keys + [_key(80, group=1), _key(82)]) == [0, 1, 2]
        dst = l1.alloc(3, fill=0)
        assert _load(b, keys, dst) == [0, 1, 2]
        for o, s in zip(dst, src):
            assert bytes_equal(_bytes(o), _bytes(s))
    finally:
        b.close()


def test_deleting_an_entry_recovered_from_an_earlier_run_keeps_the_usage_true(l1, tmp_path):
    """A key stored by an earlier process was never counted in this process's usage: deleting it
    removes the entry and reports it with size 0 (the usage used to drop by its bytes, below what
    the keys this process stored hold)."""
    a = _make(l1, tmp_path / "kv")
    assert _store(a, [_key(90)], l1.alloc(1, seed=90)).is_successful()
    a.close()
    b = _make(l1, tmp_path / "kv")
    try:
        src = l1.alloc(1, seed=91)
        assert _store(b, [_key(91)], src).is_successful()
        used = b.get_usage().total_bytes_used
        assert used == src[0].get_size()
        b.delete([_key(90)])
        assert b.get_usage().total_bytes_used == used
        assert b.counters["deleted"] == 1 and b.counters["deleted_recovered"] == 1
        assert _lookup(b, [_key(90), _key(91)]) == [1]
        _unlock_and_settle(b, [_key(91)])  # (the lookup locked its hit)
        b.delete([_key(91)])  # a key this process stored: its size comes off
        assert b.get_usage().total_bytes_used == 0 and b.counters["deleted_recovered"] == 1
    finally:
        b.close()


def test_concurrent_stores_and_loads(adapter, l1):
    n_threads, per = 4, 3
    base = l1.alloc(per, seed=90)
    assert _store(adapter, [_key(900 + i) for i in range(per)], base).is_successful()
    src = {t: l1.alloc(per, seed=100 + 10 * t) for t in range(n_threads)}
    dst = {t: l1.alloc(per, fill=0) for t in range(n_threads)}
    store_ids, load_ids = {}, {}
    errors: list = []

    def worker(t):
        try:
            keys = [_key(1000 + t * per + i) for i in range(per)]
            store_ids[t] = adapter.submit_store_task(keys, src[t])
            # the same keys from two threads at once: written once
            adapter.submit_store_task(keys[:1], src[t][:1])
            load_ids[t] = adapter.submit_load_task([_key(900 + i) for i in range(per)], dst[t])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(TIMEOUT)
    assert errors == []
    done: dict = {}
    while len(done) < 2 * n_threads:
        done.update(_wait(adapter.get_store_event_fd(), adapter.pop_completed_store_tasks))
    assert all(done[store_ids[t]].is_successful() for t in range(n_threads))
    for t in range(n_threads):
        assert _wait(adapter.get_load_event_fd(), lambda: adapter.query_load_result(load_ids[t])).get_indices_list() \
            == list(range(per))
        for o, s in zip(dst[t], base):
            assert bytes_equal(_bytes(o), _bytes(s))
    assert adapter.store.stats()["puts"] == per + n_threads * per  # duplicates were not rewritten
    keys = [_key(1000 + i) for i in range(n_threads * per)]
    out = l1.alloc(n_threads * per, fill=0)
    assert _load(adapter, keys, out) == list(range(n_threads * per))
    for t in range(n_threads):
        for i in range(per):
            assert bytes_equal(_bytes(out[t * per + i]), _bytes(src[t][i]))


@pytest.mark.parametrize("first_write_fails", [False, True])
def test_a_task_storing_a_key_another_task_writes_reports_that_write(adapter, l1, first_write_fails):
    """Two store tasks name one key: it is written once, and the second task's result is that
    write's (it reported success while the only write of the key failed: LMCache could then count
    the key as stored in L2)."""
    from concurrent.futures import Future

    real_put = adapter.io.put
    gate, started = threading.Event(), threading.Event()

    def held_put(ks, view, shape, meta):
        fut, holds = real_put(ks, view, shape, meta)
        out = Future()

        def finish():
            gate.wait(TIMEOUT)
            try:
                fut.result()
                if first_write_fails:
                    raise OSError(5, "simulated write failure")
                out.set_result(None)
            except Exception as exc:
                out.set_exception(exc)

        threading.Thread(target=finish, daemon=True).start()
        started.set()
        return out, holds

    adapter.io.put = held_put
    objs = l1.alloc(1, seed=7)
    t1 = adapter.submit_store_task([_key(77)], objs)
    assert started.wait(TIMEOUT)
    t2 = adapter.submit_store_task([_key(77)], objs)
    t0 = time.monotonic()
    while adapter.counters["store_present"] < 1 and time.monotonic() - t0 < TIMEOUT:
        time.sleep(0.01)  # until t2 has seen the key claimed (it then waits for t1's write)
    assert adapter.counters["store_present"] == 1
    time.sleep(0.1)
    assert adapter.pop_completed_store_tasks() == {}
    gate.set()
    done: dict = {}
    while len(done) < 2:
        done.update(_wait(adapter.get_store_event_fd(), adapter.pop_completed_store_tasks))
    assert done[t1].is_successful() is not first_write_fails
    assert done[t2].is_successful() is not first_write_fails
    assert adapter.store.stats()["puts"] == 1  # written once
    assert adapter.report_status()["stores_in_flight"] == 0


def test_a_store_that_fails_before_its_write_releases_the_key_for_the_next_task(adapter, l1, monkeypatch):
    """io.put raising (before any write) fails that task and gives the key's claim back: a later
    task storing the key writes it (a kept claim made every later task wait forever on it)."""
    real_put = adapter.io.put
    calls = []

    def failing_once(*a, **k):
        calls.append(a[0])
        if len(calls) == 1:
            raise OSError(28, "simulated: no space left before the write")
        return real_put(*a, **k)

    monkeypatch.setattr(adapter.io, "put", failing_once)
    objs = l1.alloc(1, seed=9)
    assert not _store(adapter, [_key(91)], objs).is_successful()
    assert adapter.counters["store_errors"] == 1 and not adapter.store.contains(object_key_string(_key(91)))
    assert _store(adapter, [_key(91)], objs).is_successful()  # within _wait's timeout: not stuck
    assert adapter.store.contains(object_key_string(_key(91))) and len(calls) == 2
    assert adapter.report_status()["stores_in_flight"] == 0


def test_an_unlock_after_a_corrupt_drop_leaves_a_newer_locks_pin(adapter, l1):
    """Lookup A locks (pins) a key; A's load finds it corrupt and the store drops it with its pins;
    it is stored again and lookup B locks it; A's unlock then took B's store pin (evictable while
    LMCache holds B's lock)."""
    from kvkernels.io import key_digest

    k = _key(901)
    ks = object_key_string(k)
    objs = l1.alloc(1, seed=1)
    assert _store(adapter, [k], objs).is_successful()
    assert _lookup(adapter, [k]) == [0]  # lookup A
    with open(adapter.store._index[key_digest(ks)].path, "r+b") as f:
        f.seek(4096 + 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    assert _load(adapter, [k], l1.alloc(1, seed=2)) == []  # corrupt: dropped, pins too
    assert _store(adapter, [k], objs).is_successful()
    assert _lookup(adapter, [k]) == [0]  # lookup B
    _unlock_and_settle(adapter, [k])  # A's unlock
    assert adapter.store.pin_count(ks) == adapter.lock_count(k) == 1
    _unlock_and_settle(adapter, [k])  # B's
    assert adapter.store.pin_count(ks) == adapter.lock_count(k) == 0


def test_close_finishes_submitted_work(l1, tmp_path):
    a = _make(l1, tmp_path / "kv")
    src = l1.alloc(2, seed=110)
    tid = a.submit_store_task([_key(110), _key(111)], src)
    a.close()  # waits for the task; its result stays poppable
    assert a.pop_completed_store_tasks()[tid].is_successful()
    assert len(_entry_files(tmp_path / "kv")) == 2
    a.submit_unlock([_key(110)])  # after close: a no-op, never an error


@pytest.mark.skipif(not hasattr(KVStore, "pin"), reason="KVStore has no pin API: locks do not stop its LRU")
def test_locked_entries_survive_store_lru_eviction(l1, tmp_path):
    entry = 4096 + L * 2 * T * H * D * 2  # header + one region per layer
    a = _make(l1, tmp_path / "kv", capacity_bytes=int(2.5 * entry))
    try:
        src = l1.alloc(4, seed=120)
        keys = [_key(120 + i) for i in range(4)]
        assert _store(a, keys[:1], src[:1]).is_successful()
        assert _lookup(a, keys[:1]) == [0]  # locked
        assert _store(a, keys[1:2], src[1:2]).is_successful()
        assert _store(a, keys[2:3], src[2:3]).is_successful()  # needs room: the LRU victim is not the locked key
        assert _lookup(a, keys[:3]) == [0, 2]
        _unlock_and_settle(a, keys[:3])  # key 2 unlocked (key 0 keeps its first lookup's lock)
        _unlock_and_settle(a, keys[:1])
        # a locked entry counts as used at its last unlock (the store's rule for pins: a lookup
        # hit is a use, as LMCache's touch_cache of hits says): key 2, unlocked first, is the victim
        assert _store(a, keys[3:], src[3:]).is_successful()
        assert _lookup(a, keys) == [0, 3]
    finally:
        a.close()


# ----------------------------------------------------------------------------- LMCache StorageManager end to end
def test_storage_manager_store_then_prefetch_from_l2(tmp_path):
    """LMCache's StorageManager drives the adapter: store controller writes L1 objects to it,
    the prefetch controller looks up + locks, loads into fresh L1 buffers and unlocks."""
    cfg = StorageManagerConfig(
        l1_manager_config=L1ManagerConfig(memory_config=L1MemoryManagerConfig(size_in_bytes=8 << 20, use_lazy=False,
                                                                              shm_name="")),
        eviction_config=EvictionConfig(eviction_policy="LRU"),
        l2_adapter_config=_parse(_spec(tmp_path / "kv")))
    sm = StorageManager(cfg)
    try:
        ((_, a),) = sm.l2_adapters()
        assert isinstance(a, KVKernelsL2Adapter)
        keys = [_key(200 + i) for i in range(3)]
        reserved = sm.reserve_write(keys, KV)
        refs = {}
        for i, k in enumerate(keys):
            t = reserved[k].tensor
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(200 + i)))
            refs[k] = t.clone()
        sm.finish_write(keys)
        end = time.monotonic() + TIMEOUT
        while not all(a.store.contains(object_key_string(k)) for k in keys):  # written behind LMCache's back
            assert time.monotonic() < end, a.report_status()
            time.sleep(0.005)
        # LMCache releases its L1 read locks when its store controller has seen the task complete
        # (after our eventfd), a moment after the entries are visible in the store: poll for it
        deleted = 0
        while deleted < 3:
            assert time.monotonic() < end, a.report_status()
            deleted += sm.delete_l1_keys(keys)[0]
            time.sleep(0.005)
        assert deleted == 3  # only L2 has them now
        want = keys + [_key(299)]  # one key that is nowhere
        handle = sm.submit_prefetch_task(PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=want, object_group_id=0,
                                                                                        layout_desc=KV)]))
        assert sm.wait_prefetch_status(handle, TIMEOUT)
        result = sm.query_prefetch_status(handle)
        assert result.l2_hit_cells[0].get_indices_list() == [0, 1, 2]
        with sm.read_prefetched_results(keys, result.l1_owners) as objs:
            assert objs is not None
            for k, o in zip(keys, objs):
                assert bytes_equal(o.tensor, refs[k])
        assert a.report_status()["counters"]["loaded"] == 3
        end = time.monotonic() + TIMEOUT
        while a.report_status()["locked_keys"]:  # the controller unlocked what it locked
            assert time.monotonic() < end
            time.sleep(0.005)
    finally:
        sm.close()
    assert a.report_status()["is_healthy"] is False  # the StorageManager closed the adapter


# ------------------------------------------------ regressions found by review (2026-11-23)
def test_lmcache_eviction_recovers_from_entries_the_store_evicted_itself(l1, tmp_path):
    # the store's own LRU (capacity_bytes) drops entries without telling LMCache; delete() ignored
    # keys the store no longer held, so LMCache's usage never came down and its eviction was stuck
    from lmcache.v1.distributed.config import EvictionConfig
    from lmcache.v1.distributed.storage_controllers.eviction_controller import (
        L2AdapterEvictionState,
        L2EvictionController,
    )

    one = 69632  # a 64 KiB object's entry (plus its header)
    a = _make(l1, tmp_path / "kv", capacity_bytes=6 * one)
    try:
        state = L2AdapterEvictionState(0, a, EvictionConfig(eviction_policy="LRU", trigger_watermark=0.8,
                                                             eviction_ratio=0.2))
        ctl = L2EvictionController([state])  # not started: its passes are run by hand
        for i in range(0, 24, 4):
            objs = l1.alloc(4, seed=i)
            assert _store(a, [_key(j) for j in range(i, i + 4)], objs).is_successful()
            l1.mm.free(objs)
            l1.live = [o for o in l1.live if o not in objs]
        assert a.get_usage().usage_fraction > 1.0  # LMCache was told 24, the store holds 6
        for _ in range(20):
            ctl._check_and_evict_global(state)
        assert a.get_usage().usage_fraction <= 0.8
        assert a.counters["deleted_already_evicted"] > 0  # keys the store had dropped, taken back
    finally:
        a.close()


def test_a_key_stored_again_after_the_store_evicted_it_is_counted_once(l1, tmp_path):
    # LMCache was told of the key at its first store; the store's LRU dropped it; LMCache stored
    # it again: its old size must be taken back, or LMCache's usage never returns to zero
    one = 69632  # a 64 KiB object's entry (plus its header)
    a = _make(l1, tmp_path / "kv", capacity_bytes=int(2.5 * one))
    try:
        objs = l1.alloc(3, seed=3)
        size = objs[0].get_size()
        keys = [_key(300 + i) for i in range(3)]
        for k, o in zip(keys, objs):
            assert _store(a, [k], [o]).is_successful()
        assert not a.store.contains(object_key_string(keys[0]))  # the store's own eviction
        assert a.get_usage().total_bytes_used == 3 * size
        assert _store(a, [keys[0]], [objs[0]]).is_successful()
        assert a.get_usage().total_bytes_used == 3 * size  # not 4
        a.delete(keys)
        assert a.get_usage().total_bytes_used == 0 and len(a.store) == 0
    finally:
        a.close()


@pytest.mark.parametrize("slice_", [4096, 2])
def test_keys_the_store_evicted_on_its_own_are_announced_deleted_and_not_kept(l1, tmp_path, monkeypatch, slice_):
    # without LMCache's eviction (no "eviction" block) nothing called delete(): the adapter kept
    # every key ever stored (a soak run: 1,200 keys held for a store of 40) and LMCache's usage
    # climbed past the store's capacity for ever
    from lmcache.v1.distributed.internal_api import L2AdapterListener

    import kvkernels.integrations.lmcache.l2_adapter as l2mod

    deleted = []

    class Rec(L2AdapterListener):
        def on_l2_keys_stored(self, keys, sizes):
            pass

        def on_l2_keys_accessed(self, keys):
            pass

        def on_l2_keys_deleted(self, keys):
            deleted.extend(object_key_string(k) for k in keys)

    monkeypatch.setattr(l2mod, "TOLD_SWEEP_MIN", 3, raising=False)
    monkeypatch.setattr(l2mod, "TOLD_SWEEP_SLICE", slice_, raising=False)  # (2: several holds of the notice lock)
    one = 69632  # a 64 KiB object's entry (plus its header)
    a = _make(l1, tmp_path / "kv", capacity_bytes=int(4.5 * one))  # the store holds 4
    a.register_listener(Rec())
    try:
        objs = l1.alloc(1, seed=5)
        size = objs[0].get_size()
        keys = [_key(400 + i) for i in range(40)]
        def settled():  # the sweep runs on the store task's thread after its completion is signalled
            return len(a._told) <= len(a.store) + 3 + 1 and a.get_usage().total_bytes_used == len(a._told) * size

        for i, k in enumerate(keys):
            assert _store(a, [k], objs).is_successful()
            t0 = time.monotonic()
            while not settled() and time.monotonic() - t0 < TIMEOUT:
                time.sleep(0.005)
            assert settled(), (i, len(a._told), len(a.store))  # bounded by the store, not by the keys seen
        with a._sweeping:  # (a sweep still under way ends first)
            pass
        held = {object_key_string(k) for k in keys if a.store.contains(object_key_string(k))}
        assert len(held) == 4 and set(deleted) == {object_key_string(k) for k in keys} - held - set(a._told)
        assert len(deleted) == len(set(deleted)) and a.counters["evicted_by_store"] == len(deleted) >= 32
        # LMCache deleting them all now: the swept keys are not announced a second time
        n, told = len(deleted), set(a._told)  # held keys, and evicted ones not swept yet
        assert held <= told
        a.delete(keys)
        assert len(deleted) == n + len(told) and set(deleted[n:]) == told
        assert a.get_usage().total_bytes_used == 0 and a._told == {} and len(a.store) == 0
    finally:
        a.close()


@pytest.mark.parametrize("known_before", [False, True])
def test_a_delete_landing_after_the_write_leaves_no_stored_notice_behind(l1, tmp_path, known_before):
    """LMCache's eviction may delete a key while a store task of it is between its write and its
    stored notice. The notice came after the delete's: LMCache's listeners kept a key L2 did not
    hold, and its usage counted it. Now the task announces only entries still held, and a key's
    notices reach the listeners in the order its accounting changed."""
    from lmcache.v1.distributed.internal_api import L2AdapterListener

    events = []

    class Rec(L2AdapterListener):
        def on_l2_keys_stored(self, keys, sizes):
            events.append(("stored", [object_key_string(k) for k in keys]))

        def on_l2_keys_accessed(self, keys):
            pass

        def on_l2_keys_deleted(self, keys):
            events.append(("deleted", [object_key_string(k) for k in keys]))

    a = _make(l1, tmp_path / "kv")
    a.register_listener(Rec())
    try:
        (obj,) = l1.alloc(1, seed=5)
        key = _key(400)
        ks = object_key_string(key)
        if known_before:  # LMCache was told of it; the store then lost it (its own eviction)
            assert _store(a, [key], [obj]).is_successful()
            assert a.store.remove(ks)
        real_put = a.io.put

        def put(*args, **kw):  # a delete() lands right after this write completes
            fut, holds = real_put(*args, **kw)

            class After:
                def result(self, timeout=None):
                    r = fut.result(timeout)
                    a.delete([key])
                    return r

            return After(), holds

        a.io.put = put
        assert _store(a, [key], [obj]).is_successful()
        assert not a.store.contains(ks)
        state = {}
        for kind, keys in events:
            for k in keys:
                state[k] = kind
        assert state.get(ks) == "deleted"  # what the listeners last heard: not held
        assert a.get_usage().total_bytes_used == 0
        assert _lookup(a, [key]) == []
    finally:
        a.close()


def test_a_delete_racing_the_stored_notice_is_heard_after_it(l1, tmp_path):
    """A delete() on another thread while a store task is announcing the key: its deleted notice
    must reach the listeners after the stored one (they would otherwise keep the key)."""
    from lmcache.v1.distributed.internal_api import L2AdapterListener

    events, racers = [], []
    a = _make(l1, tmp_path / "kv")
    key = _key(401)
    ks = object_key_string(key)

    class Rec(L2AdapterListener):
        def on_l2_keys_stored(self, keys, sizes):
            if not racers:  # LMCache's eviction deletes the key while this notice is delivered
                t = threading.Thread(target=a.delete, args=([key],))
                racers.append(t)
                t.start()
                t.join(0.3)  # it waits for this notice to end
            events.append(("stored", [object_key_string(k) for k in keys]))

        def on_l2_keys_accessed(self, keys):
            pass

        def on_l2_keys_deleted(self, keys):
            events.append(("deleted", [object_key_string(k) for k in keys]))

    a.register_listener(Rec())
    try:
        (obj,) = l1.alloc(1, seed=6)
        assert _store(a, [key], [obj]).is_successful()
        racers[0].join(TIMEOUT)
        assert [kind for kind, keys in events if ks in keys] == ["stored", "deleted"]
        assert not a.store.contains(ks) and a.get_usage().total_bytes_used == 0
    finally:
        a.close()


def test_a_store_task_does_not_wait_for_a_whole_eviction_batch(l1, tmp_path, monkeypatch):
    """delete() holds the notice lock a slice of keys at a time: a store task ending its write
    during a long eviction batch is announced (and completed) before the batch ends."""
    from kvkernels.integrations.lmcache import l2_adapter as L2

    a = _make(l1, tmp_path / "kv")
    try:
        n = 6 * L2.DELETE_SLICE
        batch = [_key(1000 + i) for i in range(n)]  # never stored: each costs only its remove
        real_remove = a.store._remove_deferring  # (what delete() calls: the file goes after its locks)
        started = threading.Event()

        def slow_remove(ks, doomed, **kw):
            started.set()
            time.sleep(0.004)
            return real_remove(ks, doomed, **kw)

        monkeypatch.setattr(a.store, "_remove_deferring", slow_remove)
        t0 = time.monotonic()
        t = threading.Thread(target=a.delete, args=(batch,))
        t.start()
        assert started.wait(TIMEOUT)
        (obj,) = l1.alloc(1, seed=9)
        assert _store(a, [_key(999)], [obj]).is_successful()
        stored_at = time.monotonic() - t0
        t.join(TIMEOUT)
        deleted_at = time.monotonic() - t0
        assert stored_at < deleted_at - 0.3, (stored_at, deleted_at)  # not at the batch's end
        assert a.store.contains(object_key_string(_key(999)))
    finally:
        a.close()


def test_a_delete_whose_remove_raises_still_announces_what_it_removed(l1, tmp_path, monkeypatch):
    """A store.remove raising part-way through a batch: the keys removed before it are still
    announced (their deleted notice was lost: LMCache kept counting them)."""
    a = _make(l1, tmp_path / "kv")
    try:
        objs = l1.alloc(3, seed=11)
        keys = [_key(500 + i) for i in range(3)]
        assert _store(a, keys, objs).is_successful()
        used = a.get_usage().total_bytes_used
        real_remove = a.store._remove_deferring  # (what delete() calls)

        def remove(ks, doomed, **kw):
            if ks == object_key_string(keys[1]):
                raise RuntimeError("injected")
            return real_remove(ks, doomed, **kw)

        monkeypatch.setattr(a.store, "_remove_deferring", remove)
        with pytest.raises(RuntimeError, match="injected"):
            a.delete(keys)
        assert not a.store.contains(object_key_string(keys[0]))
        assert a.get_usage().total_bytes_used == used - objs[0].get_size()
        assert len(_entry_files(tmp_path / "kv")) == 2 and a.store._unlinking == {}  # its file went too
    finally:
        monkeypatch.undo()
        a.close()


def test_delete_removes_files_outside_the_adapters_and_the_stores_locks(l1, tmp_path, monkeypatch):
    # a 1,024-key eviction batch unlinked its files under the adapter's lock: lookups, loads and
    # unlocks waited (round trips p99 8 ms, max 36 ms, against 22 us idle)
    import kvkernels.io.store as store_mod

    a = _make(l1, tmp_path / "kv")
    try:
        objs = l1.alloc(3, seed=13)
        keys = [_key(600 + i) for i in range(3)]
        assert _store(a, keys, objs).is_successful()
        held = []
        real_unlink = os.unlink

        def unlink(path, *args, **kw):
            if str(path).endswith(".kvk"):
                held.append((a._lock.locked(), a.store._lock._is_owned()))
            return real_unlink(path, *args, **kw)

        monkeypatch.setattr(store_mod.os, "unlink", unlink)
        a.delete(keys)
        assert held == [(False, False)] * 3, held
        assert _entry_files(tmp_path / "kv") == [] and a.get_usage().total_bytes_used == 0
    finally:
        monkeypatch.undo()
        a.close()


def test_byteshuffle_setting_stores_fp32_objects_unshuffled(l1, tmp_path):
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    a = _make(l1, tmp_path / "kv", compression="zstd", byteshuffle=True)
    try:
        desc = MemoryLayoutDesc(shapes=[torch.Size([2, L, T, H * D])], dtypes=[torch.float32])
        objs = l1.alloc(2, desc=desc, seed=1)
        res = _store(a, [_key(1), _key(2)], objs)
        assert res.is_successful() and a.counters["store_errors"] == 0
        assert _lookup(a, [_key(1), _key(2)]) == [0, 1]
        back = l1.alloc(2, desc=desc, fill=0)
        assert _load(a, [_key(1), _key(2)], back) == [0, 1]
        for o, b in zip(objs, back):
            assert torch.equal(o.raw_tensor[: o.get_size()], b.raw_tensor[: b.get_size()])
    finally:
        a.close()


def test_store_tasks_still_queued_at_interpreter_exit_are_written(tmp_path):
    """A process that exits without closing the adapter: its queued store tasks ran after the
    KVStore had been closed at exit (each failed: "KVStore is closed"); the adapter is closed
    first now, so they are written."""
    here = os.path.dirname(os.path.abspath(__file__))
    script = f"""
import sys, time
sys.path.insert(0, {here!r})
from test_lmcache_l2_adapter import L1, _make, _key
l1 = L1()
a = _make(l1, {str(tmp_path / "kv")!r}, put_threads=1)
real_put = a.store.put
def slow_put(*x, **k):
    time.sleep(0.02)
    return real_put(*x, **k)
a.store.put = slow_put
objs = l1.alloc(12, seed=1)
for i in range(12):
    a.submit_store_task([_key(i)], [objs[i]])
"""
    env = {**os.environ, "KVKERNELS_REQUIRE_LMCACHE": "1"}
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300, env=env, cwd=here)
    from kvkernels.io import KVStore

    with KVStore(tmp_path / "kv") as store:
        assert len(store) == 12


# ------------------------------------------------ review fixes (2026-11-25, 31st session)
def test_a_multi_group_object_does_not_load_into_a_buffer_of_another_layout(l1, adapter):
    """Found by review: a multi-group object (stored as opaque bytes) recorded only its size, so
    a bf16 one loaded "successfully" into an fp16 buffer of the same size: bits taken for other
    values. Its layout is part of the entry now (a hash of its groups' shapes and dtypes)."""
    shapes = [torch.Size([2, L, T, H * D]), torch.Size([3, 5])]
    bf16 = MemoryLayoutDesc(shapes=shapes, dtypes=[torch.bfloat16, torch.float32])
    fp16 = MemoryLayoutDesc(shapes=shapes, dtypes=[torch.float16, torch.float32])
    src = l1.alloc(1, bf16, seed=1)
    assert _store(adapter, [_key(1)], src).is_successful()
    assert _load(adapter, [_key(1)], l1.alloc(1, fp16, fill=0)) == []
    assert adapter.report_status()["counters"]["load_mismatch"] == 1
    dst = l1.alloc(1, bf16, fill=0)
    assert _load(adapter, [_key(1)], dst) == [0] and bytes_equal(_bytes(dst[0]), _bytes(src[0]))


def test_a_key_held_in_another_layout_is_replaced_by_a_store(l1, tmp_path):
    """Found by review: an entry of another layout under a key (kept from a run with another KV
    dtype) made every store of the key a success of 0 bytes that wrote nothing, and every load a
    mismatch, until the store evicted it. A store replaces it now."""
    fp16 = MemoryLayoutDesc(shapes=[torch.Size([2, L, T, H * D])], dtypes=[torch.float16])
    a = _make(l1, tmp_path / "kv")
    assert _store(a, [_key(7)], l1.alloc(1, KV, seed=1)).is_successful()  # run 1: bf16
    a.close()
    a = _make(l1, tmp_path / "kv")  # run 2: fp16
    try:
        src = l1.alloc(1, fp16, seed=2)
        r = _store(a, [_key(7)], src)
        assert r.is_successful() and r.bytes_transferred() == src[0].get_size()
        dst = l1.alloc(1, fp16, fill=0)
        assert _load(a, [_key(7)], dst) == [0] and bytes_equal(_bytes(dst[0]), _bytes(src[0]))
        assert _store(a, [_key(7)], src).bytes_transferred() == 0  # the same layout now: present
        c = a.report_status()["counters"]
        assert (c["stored"], c["store_present"], c["load_mismatch"]) == (1, 1, 0)
    finally:
        a.close()


def test_a_write_that_fails_after_its_rename_leaves_no_readable_entry(l1, tmp_path, monkeypatch):
    """Found by review: a put failing after its rename (an EIO syncing the directory, fsync on)
    was reported failed and never told to LMCache, yet the entry stayed: lookups hit and loads
    succeeded while LMCache's usage never counted it. It is removed now."""
    import errno

    import kvkernels.io.store as store_mod

    a = _make(l1, tmp_path / "kv", fsync=True)
    try:
        real, calls = store_mod._fsync_dir, []

        def fsync_dir(d):
            calls.append(d)
            if len(calls) > 1:  # the shard folder's parent first, then the rename's directory
                raise OSError(errno.EIO, "injected EIO")
            real(d)

        monkeypatch.setattr(store_mod, "_fsync_dir", fsync_dir)
        a.store._shards_synced.clear()
        r = _store(a, [_key(9)], l1.alloc(1, seed=3))
        monkeypatch.setattr(store_mod, "_fsync_dir", real)
        assert not r.is_successful() and len(calls) >= 2
        assert a.get_usage().total_bytes_used == 0 and _lookup(a, [_key(9)]) == []
        assert not a.store.contains(object_key_string(_key(9)))
    finally:
        a.close()


def test_a_constructor_failing_after_the_store_opened_leaves_nothing_open(l1, tmp_path, monkeypatch):
    """Found by review: an adapter whose third event fd could not be made (EMFILE) left its store
    open (the folder locked: a retry in the same process was refused) and two event fds."""
    import errno

    import kvkernels.integrations.lmcache.l2_adapter as mod

    real, n = mod.create_event_notifier, [0]

    def flaky():
        n[0] += 1
        if n[0] == 3:
            raise OSError(errno.EMFILE, "Too many open files (injected)")
        return real()

    def fds() -> int:  # open event fds (others may come and go on other threads meanwhile)
        n = 0
        for f in os.listdir("/proc/self/fd"):
            try:
                n += "eventfd" in os.readlink(f"/proc/self/fd/{f}")
            except OSError:
                pass
        return n

    before = fds()
    monkeypatch.setattr(mod, "create_event_notifier", flaky)
    with pytest.raises(OSError, match="injected"):
        _make(l1, tmp_path / "kv")
    monkeypatch.setattr(mod, "create_event_notifier", real)
    assert fds() == before
    _make(l1, tmp_path / "kv").close()  # the folder is free again


def test_a_load_finishes_into_the_view_its_read_started_with(adapter, l1, monkeypatch):
    """The chunk view was made twice, at the read's start and at its finish; the second time
    outside try_finish, so an exception there failed the whole task and abandoned its reads
    still in flight (their buffers written after the task reported)."""
    keys = [_key(40 + i) for i in range(3)]
    src = l1.alloc(3, KV, seed=40)
    refs = [_bytes(o) for o in src]
    assert _store(adapter, keys, src).is_successful()
    made = []
    real = adapter._chunk_view

    def view_once(obj, plan):
        if id(obj) in made:
            raise RuntimeError("the chunk view was made again")
        made.append(id(obj))
        return real(obj, plan)

    monkeypatch.setattr(adapter, "_chunk_view", view_once)
    dst = l1.alloc(3, KV, fill=0xAB)
    assert _load(adapter, keys, dst) == [0, 1, 2]
    assert all(bytes_equal(_bytes(o), ref) for o, ref in zip(dst, refs))
    assert adapter.counters["load_errors"] == 0
    _unlock_and_settle(adapter, keys)


# ------------------------------------------------ found by mutation testing (thirty-second session)
def test_object_key_string_format_is_stable():
    """Entries are stored under this string: a change makes every stored entry unreadable."""
    assert object_key_string(ObjectKey(b"\x01\x02", "m/x", 0x01000100)) == "lmcache-mp:m/x@0x01000100@0@0102"
    assert object_key_string(ObjectKey(b"\xab", "m", 3, 2, cache_salt="s1")) == "lmcache-mp:m@0x00000003@2@ab@s1"
