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
import os
import sys
import time
from typing import Any

import torch

from .models import MODELS, get_model, make_cache

BENCHES = ("gather", "store", "compress", "pipeline", "lmcache", "micro", "resources")


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


def demo_device(device: str | torch.device | None = None) -> torch.device:
    """The demo's device: ``device`` (``cuda[:N]`` or ``cpu``), default cuda when available.
    ``ValueError`` for another kind, ``RuntimeError`` for cuda on a machine without one."""
    try:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:  # torch's message lists every device type it knows
        raise ValueError(f"`device`: expected cuda or cpu, got {str(device)!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"`device`: expected cuda or cpu, got {str(device)!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = "torch is a CPU-only build" if torch.version.cuda is None else "no CUDA device is visible"
        raise RuntimeError(f"`device`: {str(device)!r} is not available ({why})")
    return dev


def demo_sizes(dev: torch.device) -> tuple[int, int]:
    """``(pool, default blocks)`` of the demo on ``dev``: 256 and 64 on CPU (scaled down), 4096 and
    2048 on a GPU. ``blocks`` must lie in ``1..pool``."""
    return (256, 64) if dev.type == "cpu" else (4096, 2048)


DEMO_REPS = 3  # timed calls of the demo's gather and scatter (the best is shown)


def _best_of(fn, dev: torch.device, reps: int = DEMO_REPS):
    """The shortest of ``reps`` timed calls of ``fn`` (each followed by a device sync) and the
    last call's result: one call timed alone ranged over 100x on a busy 2-core host."""
    best, out = float("inf"), None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn(out)
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    return best, out


def demo(model: str = "llama3-8b", *, blocks: int | None = None, layout: str = "vllm-nhd", dest_layout: str = "flashinfer-hnd",
         backend: str = "auto", device: str | None = None, seed: int = 0, store_dir: str | None = None, quiet: bool = False) -> dict:
    """Build a paged cache of ``model``'s shape, gather random blocks, scatter them into *other*
    blocks of a cache in ``dest_layout``, verify bit-exactly; through the SSD store when
    ``kvkernels.io.KVStore`` is available and ``store_dir`` is given. Returns the measurements.

    ``blocks``: how many distinct blocks move; ``None`` is the default of :func:`demo_sizes`,
    anything else must be in ``1..pool`` (``ValueError`` otherwise)."""
    dev = demo_device(device)
    shape = get_model(model)
    pool, n = demo_sizes(dev)
    if blocks is not None:
        if isinstance(blocks, bool) or not isinstance(blocks, int) or not 1 <= blocks <= pool:
            raise ValueError(f"`blocks`: expected an integer in 1..{pool} (the demo's pool on {dev.type}), got {blocks!r}")
        n = blocks
    from . import backends

    backends.resolve(backend, dev)  # an unavailable backend fails here, before any work
    if store_dir is not None and os.path.exists(store_dir) and not os.path.isdir(store_dir):
        raise NotADirectoryError(f"`store_dir` (--store): {store_dir!r} is not a directory")
    if dev.type == "cpu":  # scaled down on CPU: keep head_dim and block size, cut layers/heads/pool
        shape = shape.scaled(num_layers=min(shape.num_layers, 4), num_kv_heads=min(shape.num_kv_heads, 2))
    if shape.mla:
        layout, dest_layout = "mla", "mla-cross-layer"
    say = (lambda *a: None) if quiet else print
    kw: dict[str, Any] = dict(num_layers=shape.num_layers, num_blocks=pool, block_size=16, num_heads=shape.num_kv_heads,
              head_dim=shape.head_dim, dtype=torch.bfloat16, device=dev)
    src = make_cache(layout, fill="random", seed=seed, **kw)
    dst = make_cache(dest_layout, fill="zero", **kw)
    gen = torch.Generator().manual_seed(seed + 1)
    src_ids = torch.randperm(pool, generator=gen)[:n].to(dev)
    dst_ids = torch.randperm(pool, generator=gen)[:n].to(dev)
    say(f"kvkernels demo: {model} ({'scaled for CPU: ' if dev.type == 'cpu' else ''}{shape.num_layers} layers, "
        f"{shape.num_kv_heads} kv head{'' if shape.num_kv_heads == 1 else 's'}, head_dim {shape.head_dim}, "
        f"block 16, bf16) on {dev}")
    say(f"  source {src.kind}, destination {dst.kind}; {n} random blocks of a {pool}-block pool")
    import kvkernels

    kvkernels.gather(src, src_ids[:1], backend=backend)  # warm-up (JIT)
    _sync(dev)
    # (the later calls into the first one's buffer)
    t_gather, staging = _best_of(lambda prev: kvkernels.gather(src, src_ids, out=prev, backend=backend), dev)
    res = {"model": model, "device": str(dev), "blocks": n, "staging_bytes": staging.numel(),
           "chunk_bytes": src.chunk_nbytes, "gather_s": t_gather, "reps": DEMO_REPS}
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
    # (the same bytes into the same blocks each time)
    res["scatter_s"], _ = _best_of(lambda _prev: kvkernels.scatter(restored, dst, dst_ids, backend=backend), dev)
    ok = all(
        torch.equal(dst.views[l][c].index_select(0, dst_ids).view(torch.uint8 if src.dtype.itemsize == 1 else torch.int16),
                    src.views[l][c].index_select(0, src_ids).view(torch.uint8 if src.dtype.itemsize == 1 else torch.int16))
        for l in range(src.num_layers) for c in range(src.num_kv)
    )
    res["verified"] = bool(ok)
    moved = 2 * staging.numel()  # read + write
    say(f"  staging buffer: {staging.numel() / 1e6:.2f} MB ({src.num_layers} layer regions of "
        f"{staging.numel() // src.num_layers} B, chunk {src.chunk_nbytes} B)")
    say(f"  gather  {t_gather * 1e3:8.2f} ms  {moved / t_gather / 1e9:8.2f} GB/s (read+write, best of {DEMO_REPS})")
    say(f"  scatter {res['scatter_s'] * 1e3:8.2f} ms  {moved / res['scatter_s'] / 1e9:8.2f} GB/s (read+write, best of {DEMO_REPS})")
    say(f"  verify: {'bit-exact' if ok else 'MISMATCH'} ({n} blocks x {src.num_layers} layers x {src.num_kv} entries)")
    return res


# what the demo turns into one line and exit code 2 (the machine or the arguments, not a bug):
# ValueError (arguments), RuntimeError (backend or device unavailable), OSError (the --store
# directory), and torch's "Torch not compiled with CUDA enabled" AssertionError
_DEMO_ERRORS = (ValueError, RuntimeError, OSError, AssertionError)


def _user_error(exc: BaseException) -> bool:
    return not isinstance(exc, AssertionError) or "compiled with CUDA" in str(exc)


def _env_ok(prog: str) -> bool:
    """Every malformed ``KVKERNELS_*`` value, printed before a command starts (False if any)."""
    from . import config

    bad = config.env_problems()
    for msg in bad:
        print(f"{prog}: error: {msg}", file=sys.stderr)
    return not bad


def _cmd_demo(args, parser) -> int:
    import shutil
    import tempfile

    if not _env_ok("kvkernels demo"):
        return 2
    try:
        dev = demo_device(args.device)
    except _DEMO_ERRORS as exc:
        if not _user_error(exc):
            raise
        print(f"kvkernels demo: error: {exc}", file=sys.stderr)
        return 2
    pool, default = demo_sizes(dev)
    if args.blocks is not None and not 1 <= args.blocks <= pool:
        parser.error(f"argument --blocks: expected 1 <= N <= {pool} (the demo's pool on {dev.type}; "
                     f"default {default}), got {args.blocks}")
    tmp = None
    store = args.store
    if store is not None:  # before the demo builds and gathers anything, naming the flag
        from kvkernels.bench.common import dir_problem

        why = dir_problem(store)
        if why:
            print(f"kvkernels demo: error: argument --store: {why}", file=sys.stderr)
            return 2
    if store is None and not args.no_store:
        tmp = store = tempfile.mkdtemp(prefix="kvkernels-demo-")
    try:
        res = demo(args.model, blocks=args.blocks, backend=args.backend, device=args.device, store_dir=store)
    except _DEMO_ERRORS as exc:
        if not _user_error(exc) or isinstance(exc, BrokenPipeError):
            raise
        print(f"kvkernels demo: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0 if res["verified"] else 1


def _bench_list() -> str:
    """``NAME  first line of its docstring`` per bench, read from the source (nothing imported)."""
    import ast
    import importlib.util

    lines = []
    for name in BENCHES:
        doc = ""
        try:
            spec = importlib.util.find_spec(f"kvkernels.bench.bench_{name}")
            if spec is not None and spec.origin:
                with open(spec.origin, encoding="utf-8") as f:
                    doc = (ast.get_docstring(ast.parse(f.read())) or "").split("\n")[0]
        except (ImportError, OSError, SyntaxError):
            doc = "(not in this build)"
        lines.append(f"  {name.ljust(10)} {doc}")
    return "\n".join(lines)


def _cmd_bench(args, rest, parser) -> int:
    if args.name is None:
        help_ = any(a in ("-h", "--help") for a in rest)
        out = sys.stdout if help_ else sys.stderr
        print(f"usage: {parser.prog} NAME [its arguments; NAME --help lists them]\n\nbenchmarks:\n{_bench_list()}",
              file=out)
        if not help_:
            print(f"{parser.prog}: error: the following arguments are required: NAME", file=sys.stderr)
        return 0 if help_ else 2
    try:
        mod = importlib.import_module(f"kvkernels.bench.bench_{args.name}")
    except ModuleNotFoundError as exc:
        print(f"kvkernels bench: no benchmark {args.name!r} in this build ({exc})", file=sys.stderr)
        return 2
    if not any(a in ("-h", "--help") for a in rest) and not _env_ok(f"{parser.prog} {args.name}"):
        return 2
    res = mod.main(rest, prog=f"{parser.prog} {args.name}")
    # an exit code; anything else (None, or a result object from an older bench) is success
    return res if isinstance(res, int) else 0


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has left (the write end then polls POLLERR)."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # no real stdout (captured, closed)
        return False


def main(argv=None) -> int:
    try:
        rc = _main(argv)
        sys.stdout.flush()  # here, not at the interpreter's exit: block-buffered output into a pipe
        return rc
    except BrokenPipeError:
        if not _stdout_gone():  # another stream (stderr redirected into a closed pipe): not ours to hide
            raise
        # `kvkernels demo | head`: the reader left; no error line, no traceback, and nothing left
        # for Python's own flush at exit to fail on
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kvkernels", description="Fast KV-cache offload kernels.")
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("info", help="versions, GPU, backends, I/O engines, nvCOMP, malformed KVKERNELS_* values")
    pi.add_argument("--json", action="store_true")
    pd = sub.add_parser("demo", help="cache -> gather -> (store) -> scatter into other blocks -> verify")
    pd.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    pd.add_argument("--blocks", type=int, default=None,
                    help="blocks to move, 1 to the pool size (pool 4096 on a GPU, 256 on CPU; default 2048 GPU, 64 CPU)")
    pd.add_argument("--backend", default="auto", choices=["auto", "triton", "cuda", "torch"])
    pd.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    where = pd.add_mutually_exclusive_group()
    where.add_argument("--store", default=None, metavar="DIR",
                       help="SSD store directory for the round trip (created when missing, parents too; the "
                            "entry 'demo-request' and the store's lock file stay there; default: a temporary "
                            "directory, removed after)")
    where.add_argument("--no-store", action="store_true", help="skip the SSD store step")
    pb = sub.add_parser("bench", add_help=False,
                        help="run a benchmark: kvkernels bench NAME [its arguments, --help for them]")
    pb.add_argument("name", nargs="?", choices=BENCHES, metavar="NAME")
    args, rest = p.parse_known_args(argv)
    if args.cmd == "bench":
        return _cmd_bench(args, rest, pb)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "demo":
        return _cmd_demo(args, pd)
    return _cmd_info(args)


if __name__ == "__main__":
    sys.exit(main())
