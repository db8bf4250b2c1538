"""The ``kvkernels`` command (also ``python -m kvkernels``).

    kvkernels info                 versions, GPU, backends, I/O engines, nvCOMP
    kvkernels demo [--model M]     the main job: paged cache -> gather -> SSD store -> get -> scatter
                                   into other blocks of another layout -> verify bit-exactly
    kvkernels bench NAME [...]     run bench/bench_NAME.py (gather, store, compress, ...)
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

import torch

from .models import MODELS, get_model, make_cache

BENCHES = ("gather", "store", "compress", "pipeline", "lmcache", "resources")


def _cmd_info(args) -> int:
    from .info import info

    d = info()
    if args.json:
        print(json.dumps(d, indent=1, default=str))
        return 0
    w = max(len(k) for k in d)
    for k, v in d.items():
        print(f"{k.ljust(w)}  {v}")
    return 0


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def demo(model: str = "llama3-8b", *, blocks: int | None = None, layout: str = "vllm-nhd", dest_layout: str = "flashinfer-hnd",
         backend: str = "auto", device: str | None = None, seed: int = 0, store_dir: str | None = None, quiet: bool = False) -> dict:
    """Build a paged cache of ``model``'s shape, gather random blocks, scatter them into *other*
    blocks of a cache in ``dest_layout``, verify bit-exactly; through the SSD store when
    ``kvkernels.io.KVStore`` is available and ``store_dir`` is given. Returns the measurements."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = get_model(model)
    if dev.type == "cpu":  # scaled down on CPU: keep head_dim and block size, cut layers/heads/pool
        shape = shape.scaled(num_layers=min(shape.num_layers, 4), num_kv_heads=min(shape.num_kv_heads, 2))
        pool, n = 256, blocks or 64
    else:
        pool, n = 4096, blocks or 2048
    if shape.mla:
        layout, dest_layout = "mla", "mla-cross-layer"
    say = (lambda *a: None) if quiet else print
    kw = dict(num_layers=shape.num_layers, num_blocks=pool, block_size=16, num_heads=shape.num_kv_heads,
              head_dim=shape.head_dim, dtype=torch.bfloat16, device=dev)
    src = make_cache(layout, fill="random", seed=seed, **kw)
    dst = make_cache(dest_layout, fill="zero", **kw)
    gen = torch.Generator().manual_seed(seed + 1)
    src_ids = torch.randperm(pool, generator=gen)[:n].to(dev)
    dst_ids = torch.randperm(pool, generator=gen)[:n].to(dev)
    say(f"kvkernels demo: {model} ({'scaled for CPU: ' if dev.type == 'cpu' else ''}{shape.num_layers} layers, "
        f"{shape.num_kv_heads} kv heads, head_dim {shape.head_dim}, block 16, bf16) on {dev}")
    say(f"  source {src.kind}, destination {dst.kind}; {n} random blocks of a {pool}-block pool")
    import kvkernels

    kvkernels.gather(src, src_ids[:1], backend=backend)  # warm-up (JIT)
    _sync(dev)
    t0 = time.perf_counter()
    staging = kvkernels.gather(src, src_ids, backend=backend)
    _sync(dev)
    t_gather = time.perf_counter() - t0
    res = {"model": model, "device": str(dev), "blocks": n, "staging_bytes": staging.numel(),
           "chunk_bytes": src.chunk_nbytes, "gather_s": t_gather}
    restored = staging
    if store_dir is not None:
        from kvkernels.io import EntryMeta, KVStore

        host = staging.cpu()
        meta = EntryMeta.for_layout(src, n)
        with KVStore([store_dir]) as store:
            t0 = time.perf_counter()
            store.put("demo-request", host, meta).result()
            res["store_put_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            restored = store.get("demo-request").result()
            res["store_get_s"] = time.perf_counter() - t0
        restored = restored.to(dev)
        say(f"  store: put {host.numel() / res['store_put_s'] / 1e9:.2f} GB/s, get {host.numel() / res['store_get_s'] / 1e9:.2f} GB/s ({store_dir})")
    kvkernels.scatter(restored, dst, torch.full_like(dst_ids, -1), backend=backend)  # warm-up: all padding, writes nothing
    _sync(dev)
    t0 = time.perf_counter()
    kvkernels.scatter(restored, dst, dst_ids, backend=backend)
    _sync(dev)
    res["scatter_s"] = time.perf_counter() - t0
    ok = all(
        torch.equal(dst.views[l][c].index_select(0, dst_ids).view(torch.uint8 if src.dtype.itemsize == 1 else torch.int16),
                    src.views[l][c].index_select(0, src_ids).view(torch.uint8 if src.dtype.itemsize == 1 else torch.int16))
        for l in range(src.num_layers) for c in range(src.num_kv)
    )
    res["verified"] = bool(ok)
    moved = 2 * staging.numel()  # read + write
    say(f"  staging buffer: {staging.numel() / 1e6:.2f} MB ({src.num_layers} layer regions of "
        f"{staging.numel() // src.num_layers} B, chunk {src.chunk_nbytes} B)")
    say(f"  gather  {t_gather * 1e3:8.2f} ms  {moved / t_gather / 1e9:8.2f} GB/s (read+write)")
    say(f"  scatter {res['scatter_s'] * 1e3:8.2f} ms  {moved / res['scatter_s'] / 1e9:8.2f} GB/s (read+write)")
    say(f"  verify: {'bit-exact' if ok else 'MISMATCH'} ({n} blocks x {src.num_layers} layers x {src.num_kv} entries)")
    return res


def _cmd_demo(args) -> int:
    import shutil
    import tempfile

    tmp = None
    store = args.store
    if store is None and not args.no_store:
        tmp = store = tempfile.mkdtemp(prefix="kvkernels-demo-")
    try:
        res = demo(args.model, blocks=args.blocks, backend=args.backend, device=args.device, store_dir=store)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0 if res["verified"] else 1


def _cmd_bench(args, rest) -> int:
    try:
        mod = importlib.import_module(f"kvkernels.bench.bench_{args.name}")
    except ModuleNotFoundError as exc:
        print(f"kvkernels bench: no benchmark {args.name!r} in this build ({exc})", file=sys.stderr)
        return 2
    return int(mod.main(rest) or 0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kvkernels", description="Fast KV-cache offload kernels.")
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("info", help="versions, GPU, backends, I/O engines, nvCOMP")
    pi.add_argument("--json", action="store_true")
    pd = sub.add_parser("demo", help="cache -> gather -> (store) -> scatter into other blocks -> verify")
    pd.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    pd.add_argument("--blocks", type=int, default=None, help="blocks to move (default 2048 GPU, 64 CPU)")
    pd.add_argument("--backend", default="auto", choices=["auto", "triton", "cuda", "torch"])
    pd.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    pd.add_argument("--store", default=None, metavar="DIR",
                    help="SSD store directory for the round trip (default: a temporary directory, removed after)")
    pd.add_argument("--no-store", action="store_true", help="skip the SSD store step")
    pb = sub.add_parser("bench", add_help=False,
                        help="run a benchmark: kvkernels bench NAME [its arguments, --help for them]")
    pb.add_argument("name", choices=BENCHES)
    args, rest = p.parse_known_args(argv)
    if args.cmd == "bench":
        return _cmd_bench(args, rest)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    return {"info": _cmd_info, "demo": _cmd_demo}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
