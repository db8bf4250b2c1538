"""Typical user code of the public API, written as a typed connector would write it: never run,
only type-checked by tests/test_typing.py (mypy), so that the annotations kvkernels ships do not
refuse what the docs tell users to write. (Not collected: the name does not start with test_.)"""

from __future__ import annotations

from concurrent.futures import Future

import torch
from typing_extensions import assert_type  # (typing.assert_type: Python >= 3.11; mypy checks as 3.10)

import kvkernels
from kvkernels.compress import CompressedStaging, compress_regions, decompress_regions
from kvkernels.integrations.lmcache import lmcache_extra_config
from kvkernels.io import EntryMeta, Header, KVStore
from kvkernels.pipeline import HostEntry, LayerPipeline


def readme_example() -> None:  # README.md, "gather / scatter"
    caches = [torch.randn(2, 1024, 16, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(32)]
    layout = kvkernels.PagedLayout.from_vllm(caches)
    ids = torch.tensor([17, 3, 902, 45], device="cuda")
    staging = assert_type(kvkernels.gather(layout, ids, max_ctas=16), torch.Tensor)
    fmt = assert_type(kvkernels.StagingFormat.for_layout(layout, len(ids)), kvkernels.StagingFormat)
    host = torch.empty(fmt.nbytes, dtype=torch.uint8).pin_memory()
    host.copy_(staging, non_blocking=True)
    offset: int = fmt.region_offset(3)
    other = [torch.zeros(1024, 2, 8, 16, 128, dtype=torch.bfloat16, device="cuda") for _ in range(32)]
    dest = kvkernels.PagedLayout.from_flashinfer(other, kv_layout="HND")
    kvkernels.scatter(host.cuda(), dest, torch.tensor([5, 6, 7, 8], device="cuda"))
    kvkernels.scatter(host[offset:].cuda(), dest, [5, 6, 7, 8], layers=[3])  # a list of ids, one layer


def fp8_and_shuffle(layout: kvkernels.PagedLayout, ids: torch.Tensor, dst: list[int]) -> int:
    q = kvkernels.gather_quant(layout, ids, quant="fp8", granularity="block")
    kvkernels.scatter_quant(q, layout, dst, quant="fp8", granularity="block")
    s = kvkernels.gather(layout, ids, shuffle=True, layers=(0, 1))
    kvkernels.scatter(s, layout, dst, shuffle=True, layers=(0, 1))
    qf = assert_type(kvkernels.QuantStagingFormat.for_layout(layout, len(dst), granularity="block"),
                     kvkernels.QuantStagingFormat)
    return qf.nbytes + kvkernels.quant_staging_nbytes(layout, len(dst), quant="fp8")


def store_example(layout: kvkernels.PagedLayout, staging: torch.Tensor, new_ids: torch.Tensor) -> bool:  # store.md
    n = new_ids.numel()
    with KVStore(["/mnt/nvme0/kv", "/mnt/nvme1/kv"], capacity_bytes=2 << 40, fsync=False) as store:
        done = assert_type(store.put("req-42", staging, EntryMeta.for_layout(layout, n)), "Future[Header]")
        assert_type(done.result().meta, EntryMeta)
        buf: torch.Tensor = store.get("req-42", layers=[0, 1]).result()
        kvkernels.scatter(buf.cuda(), layout, new_ids, layers=[0, 1])
        return store.contains(("req", 43))


def compress_example(staging: torch.Tensor, fmt: kvkernels.StagingFormat,
                     qfmt: kvkernels.QuantStagingFormat, q: torch.Tensor) -> torch.Tensor:  # compress.md
    packed = assert_type(compress_regions(staging, fmt, codec="zstd", byteshuffle=True), CompressedStaging)
    compress_regions(q, qfmt)  # an FP8 staging buffer is compressed the same way
    return assert_type(decompress_regions(packed, layers=[0]), torch.Tensor)


def pipeline_step(layout: kvkernels.PagedLayout, store: KVStore, saves: dict[str, torch.Tensor],
                  loads: dict[str, list[int]], num_layers: int) -> tuple[set, set]:  # pipeline.md
    with LayerPipeline(layout, host_bytes=1 << 30) as scratch:  # (the with-block gives the typed object)
        assert_type(scratch, LayerPipeline)
    pipe = LayerPipeline(layout, host_bytes=1 << 30, store=store, prefetch_depth=2)
    pipe.start_load(loads)
    pipe.start_load({("req", 7): torch.tensor([1, 2])}, asynchronous=True)  # any hashable key
    for layer in range(num_layers):
        pipe.wait_for_layer_load(layer)
        pipe.save_layer(layer, saves)
    pipe.wait_for_save()
    saved, loaded = assert_type(pipe.get_finished(), tuple[set, set])
    failed: set = pipe.take_failed_loads() | pipe.take_failed_saves()
    ahead = assert_type(pipe.prefetch("req-9", num_blocks=4), "Future[HostEntry]")
    ahead.cancel()
    pipe.evict("req-9")
    pipe.close()
    return saved | failed, loaded


def lmcache_config() -> dict:
    return lmcache_extra_config("/tmp/kv", capacity_bytes=1 << 30)
