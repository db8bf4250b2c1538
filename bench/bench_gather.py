"""Benchmark: fused paged gather / scatter vs. the measured peaks and the baselines users pick.

For each registry model (``kvkernels.models.MODELS``) and layout (NHD, HND; MLA for
deepseek-v3-mla), with a pool of ``--pool`` blocks and ``--blocks`` random distinct block ids, all
layers, in one run:

* peaks: one-shot device copy (read + write counted) and one-shot pinned D2H / H2D;
* ``kvk-gather`` / ``kvk-scatter``: kvkernels Triton (and the CUDA C++ backend when it loads),
  device staging (GB/s = read + write bytes);
* ``torch-index_select``: one ``index_select(out=...)`` per layer and K/V into the same staging;
* ``memcpy-per-chunk-d2d``: one ``cudaMemcpyAsync`` per (block, layer, K/V) chunk, C++ loop;
* ``memcpy-per-chunk-d2h``: the same into pinned host (what vLLM's ``swap_blocks`` does);
* ``memcpy-batch-d2h``: the same chunks as one ``cudaMemcpyBatchAsync`` (CUDA >= 12.8) on a side
  stream;
* ``kvk-zero-copy-d2h``: the Triton gather writing pinned host through UVA (full grid and 16 CTAs);
* ``kvk-gather+d2h``: gather into device staging, then one D2H copy;
* ``kvk-{gather,scatter}-{fp8-token,fp8-block,shuffle}[backend]``: the fused FP8 quantizing
  gather / dequantizing scatter and the byte-plane shuffle; GB/s = bytes read + written (raw
  payload + codes + scales for FP8) against the device-copy peak (issue 5: >= 80 %).

Every row's bytes are checked after its timed calls: one more call into a destination first
overwritten with the complement of the expected bytes, compared with the torch backend's (the
per-chunk copies: each chunk's bytes in memory order). A variant that fails its check, or
raises, has its rows dropped and is named in the results' ``failed_variants`` (exit code 3); one
the machine cannot run (no GPU; Triton on a CPU without ``TRITON_INTERPRET``; no CUDA backend, no
bulk path for the layout, no ``cudaMemcpyBatchAsync``, chunks that are not one run of bytes) in
``skipped_variants``. The
``kvk-gather[...]`` / ``kvk-scatter[...]`` rows without ``ctas=`` use every SM (``max_ctas=0``
named: ``KVKERNELS_MAX_CTAS`` does not change them); the meta's ``kvkernels_env`` lists the
``KVKERNELS_*`` settings of the run.

GB/s for device-to-device methods counts bytes read + written (like the copy peak); host methods
count payload bytes (like the D2H peak). Outputs: a table, ``gather.csv`` / ``gather.json``
(GPU, versions, date) and ``gather.png`` under ``--out``.

    python bench/bench_gather.py --out bench_results/h100      # full run on a GPU
    kvkernels bench gather --quick                             # smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

try:  # run as a script (bench/ on sys.path) or as kvkernels.bench.bench_gather
    from . import common
except ImportError:  # pragma: no cover
    import common  # type: ignore

import kvkernels
from kvkernels import StagingFormat
from kvkernels.models import MODELS, get_model, make_cache

LAYOUT_OF = {"nhd": "vllm-nhd", "hnd": "vllm-hnd", "mla": "mla"}

_MEMCPY = None


def _memcpy_ext():
    """Compile (once) the per-chunk cudaMemcpyAsync loop; None when it cannot be built."""
    global _MEMCPY
    if _MEMCPY is None:
        try:
            from torch.utils.cpp_extension import load

            src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_memcpy_loop.cpp")
            _MEMCPY = load(name="kvk_bench_memcpy", sources=[src], with_cuda=True, verbose=False)
        except Exception as exc:  # pragma: no cover - GPU machines only
            print(f"[bench] per-chunk memcpy baseline unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
            _MEMCPY = False
    return _MEMCPY or None


def _dense_chunk(lay) -> bool:
    """True when one (block, layer, entry) chunk is one contiguous run of raw bytes."""
    _, sn, sh = lay.byte_strides
    span = (lay.block_size - 1) * sn + (lay.num_heads - 1) * sh + lay.row_nbytes
    return span == lay.chunk_nbytes


def _chunk_tables(lay, ids: torch.Tensor, staging_base: int, fmt: StagingFormat):
    """Source / destination addresses of every chunk (raw block bytes, as swap_blocks copies)."""
    sb = lay.byte_strides[0]
    ids_h = ids.cpu().to(torch.int64)
    src, dst = [], []
    for l in fmt.layers:
        for c in range(lay.num_kv):
            base = lay.views[l][c].data_ptr()
            src.append(base + ids_h * sb)
            off = staging_base + fmt.entry_offset(l, c)
            dst.append(off + torch.arange(len(ids_h), dtype=torch.int64) * fmt.chunk_nbytes)
    return torch.cat(src), torch.cat(dst)


_VARIANTS = common.Variants()  # failed variants (rows dropped; exit code 3) and skipped ones: in the meta
_FAILED, _SKIPPED = _VARIANTS.failed, _VARIANTS.skipped
_skip = _VARIANTS.skip
_variant = _VARIANTS.guard  # with _variant(tag, rows): one variant's rows


def _same(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Raise unless ``got`` holds ``want``'s bytes (a byte check after a variant's timed calls)."""
    if not common.same_bytes(got, want):
        bad = int((got.reshape(-1).cpu() != want.reshape(-1).cpu()).sum())
        raise RuntimeError(f"{what}: {bad} of {want.numel()} bytes differ from the torch reference's")


def synced(fn):
    """``fn`` followed by a device sync (a check reads host memory the call's copies write)."""
    def call():
        fn()
        torch.cuda.synchronize()
    return call


def bench_case(model: str, layout_key: str, *, pool: int, blocks: int, device: torch.device, peaks: dict,
               block_size: int = 16, layers: int | None = None, heads: int | None = None, dtype=torch.bfloat16,
               baselines: bool = True) -> list[dict]:
    shape = get_model(model)
    if layers or heads:
        shape = shape.scaled(num_layers=layers, num_kv_heads=heads)
    lay = make_cache(
        LAYOUT_OF[layout_key], num_layers=shape.num_layers, num_blocks=pool, block_size=block_size,
        num_heads=shape.num_kv_heads, head_dim=shape.head_dim, dtype=dtype, device=device,
    )
    gen = torch.Generator().manual_seed(1)
    ids = torch.randperm(pool, generator=gen)[:blocks].to(device)
    dst_ids = torch.randperm(pool, generator=gen)[:blocks].to(device)
    fmt = StagingFormat.for_layout(lay, blocks)
    payload = fmt.num_regions * fmt.payload_nbytes
    out = torch.empty(fmt.nbytes, dtype=torch.uint8, device=device)
    cuda = device.type == "cuda"
    backend = "triton" if (cuda or kvkernels.backends.triton_interpret()) else "torch"
    base = {"model": model, "layout": layout_key, "chunk_kb": round(lay.chunk_nbytes / 1024, 2),
            "blocks": blocks, "layers": lay.num_layers, "payload_mb": round(payload / 1e6, 2)}
    case = f"{model}/{layout_key}"
    rows: list[dict] = []

    def add(method, ms, nbytes, peak_key):
        bw = common.gbps(nbytes, ms)
        peak = peaks.get(peak_key)
        rows.append({**base, "method": method, "ms": ms, "gbps": bw,
                     "pct_peak": (100.0 * bw / peak) if peak else None, "peak": peak_key})
        common.progress(rows[-1])

    # Byte checks, after each variant's timed calls (the cache changes as scatters run: the
    # expected bytes are read when checked). The destination is first overwritten with the
    # complement of the expected bytes, so a call that writes nothing cannot pass on what an
    # earlier row left there. The reference is the torch backend (plain index_select / copy_).
    def ref(block_ids) -> torch.Tensor:
        return kvkernels.gather(lay, block_ids, backend="torch")

    def payload_of(buf: torch.Tensor) -> torch.Tensor:
        """The payload bytes of a staging buffer (methods that do not write region padding)."""
        return buf[: fmt.nbytes].view(fmt.num_regions, fmt.region_nbytes)[:, : fmt.payload_nbytes]

    def check_gather(what, call, dest: torch.Tensor, *, payload: bool = False, raw: bool = False,
                     also=()) -> None:
        """``call()`` into ``dest`` (and the buffers ``also``) overwritten with the complement of
        the blocks' staging first, then ``dest`` compared: whole, or the regions' payload only
        (``payload``: methods that do not write region padding; ``raw``: the per-chunk copies)."""
        full = ref(ids)
        for buf in (dest, *also):
            common.poison(buf, full)
        call()
        if raw or payload:
            _same(what, payload_of(dest), raw_chunks() if raw else payload_of(full))
        else:
            _same(what, dest[: fmt.nbytes], full)

    def check_scatter(what, call_from) -> None:
        staged = ref(ids)  # what the call writes into dst_ids
        kvkernels.scatter(torch.bitwise_not(staged), lay, dst_ids, backend="torch")
        call_from(staged)
        _same(what, ref(dst_ids), staged)

    def raw_chunks() -> torch.Tensor:
        """What the per-chunk copies write: each chunk's bytes in memory order (= the staging
        order for NHD; HND chunks are [heads, tokens, dim]), per region as the staging lays them."""
        regions = []
        for l in fmt.layers:
            entries = []
            for c in range(lay.num_kv):
                v = lay.views[l][c]
                strides = v.stride()
                order = sorted((1, 2, 3), key=lambda d: -strides[d])  # memory order of a dense chunk
                entries.append(v.permute(0, *order).index_select(0, ids).contiguous().view(torch.uint8).reshape(-1))
            regions.append(torch.cat(entries))  # (a region's entries lie back to back: payload_nbytes)
        return torch.stack(regions)

    backends = [backend]
    if backend == "torch":  # a CPU run without the interpreter: the torch backend's rows stand in
        _skip(f"{case} kvk-*[triton]", common.NO_TRITON_ON_CPU)
    if not cuda:
        _skip(f"{case} kvk-*[cuda]", common.NO_CUDA_BACKEND_ON_CPU)
    else:
        from kvkernels import _cuda

        if _cuda.available():  # the compiled backend beside Triton (issue: CUDA C++ backend)
            backends.append("cuda")
        else:
            _skip(f"{case} kvk-*[cuda]", f"CUDA backend unavailable: {_cuda.reason()}")
    # (row name, backend, KVKERNELS_CUDA_BULK): the CUDA backend's SM90 bulk path as its own row
    # where it applies (contiguous chunks, device staging, sm_90, built with the CUTLASS headers)
    variants = [(b, b, "0") for b in backends]
    if "cuda" in backends:
        with common.env(KVKERNELS_CUDA_BULK="1"):
            if _cuda._use_bulk(lay, out):
                variants.append(("cuda-bulk", "cuda", "1"))
            else:
                _skip(f"{case} kvk-*[cuda-bulk]", "the bulk path does not apply (chunks not contiguous, not sm_90, "
                      "or built without the CUTLASS headers)")
    for name, b, bulk in variants:
        with common.env(KVKERNELS_CUDA_BULK=bulk):
            # every SM (max_ctas=0 named: KVKERNELS_MAX_CTAS must not change what "full grid" means)
            with _variant(f"{case} kvk-gather[{name}]", rows):
                add(f"kvk-gather[{name}]", common.time_ms(
                    lambda: kvkernels.gather(lay, ids, out=out, backend=b, validate=False, max_ctas=0), device=device),
                    2 * payload, "d2d_gbps")
                check_gather(f"kvk-gather[{name}]", lambda: kvkernels.gather(lay, ids, out=out, backend=b, max_ctas=0), out)
            with _variant(f"{case} kvk-scatter[{name}]", rows):
                add(f"kvk-scatter[{name}]", common.time_ms(
                    lambda: kvkernels.scatter(out, lay, dst_ids, backend=b, validate=False, max_ctas=0), device=device),
                    2 * payload, "d2d_gbps")
                check_scatter(f"kvk-scatter[{name}]",
                              lambda st: kvkernels.scatter(st, lay, dst_ids, backend=b, max_ctas=0))
            # few SMs (what the pipeline gives a copy beside attention): bandwidth per CTA
            for cap in (16, 32) if cuda else ():
                with _variant(f"{case} kvk-gather[{name},ctas={cap}]", rows):
                    add(f"kvk-gather[{name},ctas={cap}]", common.time_ms(
                        lambda: kvkernels.gather(lay, ids, out=out, backend=b, validate=False, max_ctas=cap),
                        device=device), 2 * payload, "d2d_gbps")
                    check_gather(f"kvk-gather[{name},ctas={cap}]",
                                 lambda: kvkernels.gather(lay, ids, out=out, backend=b, max_ctas=cap), out)
    rows += _quant_rows(lay, ids, dst_ids, payload, base, peaks, device, backends)
    if not baselines:
        return rows

    def index_select_all():
        for l in fmt.layers:
            for c in range(lay.num_kv):
                off = fmt.entry_offset(l, c)
                dst = out[off: off + fmt.entry_nbytes].view(lay.dtype).view(blocks, lay.block_size, lay.num_heads, lay.head_dim)
                torch.index_select(lay.views[l][c], 0, ids, out=dst)

    with _variant(f"{case} torch-index_select", rows):
        add("torch-index_select", common.time_ms(index_select_all, device=device), 2 * payload, "d2d_gbps")
        check_gather("torch-index_select", index_select_all, out, payload=True)
    if not cuda:
        _skip(f"{case} memcpy-*, kvk-zero-copy-d2h, kvk-gather+d2h", "no GPU (copies to pinned host memory)")
        return rows
    ext = _memcpy_ext() if _dense_chunk(lay) else None
    if not _dense_chunk(lay):
        _skip(f"{case} memcpy-*", "a chunk is not one contiguous run of bytes (one cudaMemcpyAsync per chunk cannot copy it)")
    elif ext is None:
        _skip(f"{case} memcpy-*", "the per-chunk memcpy extension did not build (message above)")
    stream = torch.cuda.current_stream().cuda_stream
    host = torch.empty(fmt.nbytes, dtype=torch.uint8).pin_memory()
    if ext is not None:
        s_tab, d_tab = _chunk_tables(lay, ids, out.data_ptr(), fmt)
        with _variant(f"{case} memcpy-per-chunk-d2d", rows):
            add("memcpy-per-chunk-d2d", common.time_ms(lambda: ext.memcpy_chunks(s_tab, d_tab, lay.chunk_nbytes, stream), device=device),
                2 * payload, "d2d_gbps")
            check_gather("memcpy-per-chunk-d2d", lambda: ext.memcpy_chunks(s_tab, d_tab, lay.chunk_nbytes, stream), out,
                         raw=True)
        s_tab, h_tab = _chunk_tables(lay, ids, host.data_ptr(), fmt)
        with _variant(f"{case} memcpy-per-chunk-d2h", rows):
            add("memcpy-per-chunk-d2h", common.time_ms(lambda: ext.memcpy_chunks(s_tab, h_tab, lay.chunk_nbytes, stream), device=device),
                payload, "d2h_gbps")
            check_gather("memcpy-per-chunk-d2h", synced(lambda: ext.memcpy_chunks(s_tab, h_tab, lay.chunk_nbytes, stream)),
                         host, raw=True)
        side = torch.cuda.Stream(device=device)  # cudaMemcpyBatchAsync rejects the legacy default stream

        def batch_d2h():
            cur = torch.cuda.current_stream()
            side.wait_stream(cur)
            ext.memcpy_batch(s_tab, h_tab, lay.chunk_nbytes, side.cuda_stream)
            cur.wait_stream(side)

        try:
            batch_d2h()
            torch.cuda.synchronize()
        except RuntimeError as exc:  # CUDA < 12.8 or a driver without it
            _skip(f"{case} memcpy-batch-d2h", f"cudaMemcpyBatchAsync refused: {exc}")
        else:
            with _variant(f"{case} memcpy-batch-d2h", rows):
                add("memcpy-batch-d2h", common.time_ms(batch_d2h, device=device), payload, "d2h_gbps")
                check_gather("memcpy-batch-d2h", synced(batch_d2h), host, raw=True)
    for cap in (0, 16):
        with _variant(f"{case} kvk-zero-copy-d2h[ctas={cap or 'all'}]", rows):
            add(f"kvk-zero-copy-d2h[ctas={cap or 'all'}]",
                common.time_ms(lambda: kvkernels.gather(lay, ids, out=host, backend="triton", max_ctas=cap, validate=False), device=device),
                payload, "d2h_gbps")
            check_gather(f"kvk-zero-copy-d2h[ctas={cap or 'all'}]", synced(
                lambda: kvkernels.gather(lay, ids, out=host, backend="triton", max_ctas=cap)), host)

    def gather_then_d2h():
        kvkernels.gather(lay, ids, out=out, backend="triton", validate=False, max_ctas=0)
        host.copy_(out, non_blocking=True)

    with _variant(f"{case} kvk-gather+d2h", rows):
        add("kvk-gather+d2h", common.time_ms(gather_then_d2h, device=device), payload, "d2h_gbps")
        # the device staging overwritten too (an earlier row's check left the right bytes in it)
        check_gather("kvk-gather+d2h", synced(gather_then_d2h), host, also=(out,))
    return rows


def _quant_rows(lay, ids, dst_ids, payload, base, peaks, device, backends) -> list[dict]:
    """Fused FP8 (per token-head and per block-head scales) and byte-plane shuffle, gather and
    scatter, per backend. Bound: bytes read + bytes written (raw payload + codes + scales for
    FP8, twice the payload for shuffle) over the measured device-copy peak (issue 5: >= 80 %).
    Each row's bytes are checked against the torch backend's after its timed calls (the
    destination overwritten with their complement first)."""
    from kvkernels.quant import QuantStagingFormat, gather_quant, scatter_quant

    rows: list[dict] = []
    peak = peaks.get("d2d_gbps")
    case = f"{base['model']}/{base['layout']}"
    variants: list[tuple[str, dict[str, Any]]] = [("fp8-token", dict(quant="fp8", granularity="token")),
                ("fp8-block", dict(quant="fp8", granularity="block"))]
    if lay.dtype in (torch.bfloat16, torch.float16):
        variants.append(("shuffle", dict(shuffle=True)))
    for vname, kw in variants:
        if "quant" in kw:
            qf = QuantStagingFormat.for_layout(lay, len(ids), granularity=kw["granularity"])
            moved = common.fp8_moved(qf, payload)
        else:
            moved = 2 * payload
        for b in backends:
            st = None
            for op in ("gather", "scatter"):
                with _variant(f"{case} kvk-{op}-{vname}[{b}]", rows):
                    if st is None:
                        st = gather_quant(lay, ids, backend=b, validate=False, **kw)
                    buf = st
                    if op == "gather":
                        def fn():
                            gather_quant(lay, ids, out=buf, backend=b, validate=False, **kw)
                    else:
                        def fn():
                            scatter_quant(buf, lay, dst_ids, backend=b, validate=False, **kw)
                    ms = common.time_ms(fn, device=device, reps=2)  # reps: CPU only (the interpreter is slow)
                    bw = common.gbps(moved, ms)
                    rows.append({**base, "method": f"kvk-{op}-{vname}[{b}]", "ms": ms, "gbps": bw,
                                 "pct_peak": (100.0 * bw / peak) if peak else None, "peak": "d2d_gbps"})
                    common.progress(rows[-1])
                    want = gather_quant(lay, ids, backend="torch", **kw)  # the codes of the blocks as they are now
                    if op == "gather":
                        common.poison(buf, want)
                        gather_quant(lay, ids, out=buf, backend=b, **kw)
                        _same(f"kvk-gather-{vname}[{b}]", buf, want)
                    else:  # what the torch backend's scatter leaves in the blocks, then this one's
                        raw = kvkernels.gather(lay, dst_ids, backend="torch")
                        kvkernels.scatter(torch.bitwise_not(raw), lay, dst_ids, backend="torch")
                        scatter_quant(want, lay, dst_ids, backend="torch", **kw)
                        expect = kvkernels.gather(lay, dst_ids, backend="torch")
                        kvkernels.scatter(torch.bitwise_not(expect), lay, dst_ids, backend="torch")
                        scatter_quant(want, lay, dst_ids, backend=b, **kw)
                        _same(f"kvk-scatter-{vname}[{b}]", kvkernels.gather(lay, dst_ids, backend="torch"), expect)
            del st
    return rows


FIRST = ["llama3-70b-tp8", "deepseek-v3-mla", "llama3-8b"]
TINY_SIZES = (32, 8)  # (pool, blocks) of a --tiny run
QUICK_BLOCKS = 512  # --quick gathers at most this many blocks


def sizes(pool: int, blocks: int, *, tiny: bool = False, quick: bool = False) -> tuple[int, int]:
    """The (pool, blocks) a run uses: fixed for ``tiny``, ``blocks`` capped for ``quick``;
    ``ValueError`` when more blocks than the pool holds would be gathered (checked after those
    adjustments: ``--quick --pool 1000`` gathers 512 of 1,000 blocks, and ``--tiny`` ignores both)."""
    if tiny:
        return TINY_SIZES
    if quick:
        blocks = min(blocks, QUICK_BLOCKS)
    if blocks > pool:
        raise ValueError(f"--blocks ({blocks}{', capped by --quick' if quick else ''}) must be <= --pool ({pool})")
    return pool, blocks


def run(*, models=None, layouts=("nhd", "hnd"), pool=4096, blocks=2048, out_dir="bench_results", quick=False,
        peak_nbytes=1 << 30, tiny=False, plot=True) -> dict:
    device, tiny, meta = common.start(tiny, peak_nbytes)
    peaks = meta["peaks"]
    _VARIANTS.clear()
    pool, blocks = sizes(pool, blocks, tiny=tiny, quick=quick)
    models, layouts = common.distinct(models), common.distinct(layouts)
    if tiny:
        models = models or ["smollm2-135m"]
        print(f"[bench] tiny sizes: pool {pool}, {blocks} blocks (--pool / --blocks do not apply)")
    elif quick:
        models = models or ["llama3-8b", "deepseek-v3-mla"]
    # the shapes with open targets first (4 KB chunks, MLA), so a time-capped run still has them
    models = models or sorted(MODELS, key=lambda m: (m not in FIRST, FIRST.index(m) if m in FIRST else 0))
    rows: list[dict] = []
    for m in models:
        keys = ["mla"] if get_model(m).mla else [k for k in layouts if k != "mla"]
        for key in keys:
            kw: dict[str, Any] = dict(layers=2, heads=1, block_size=4) if tiny else {}
            rows += bench_case(m, key, pool=pool, blocks=blocks, device=device, peaks=peaks, **kw)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            common.write_results(rows, {**meta, **_VARIANTS.meta(partial=True)}, out_dir, "gather")  # kept if a time cap cuts the run
    meta.update(_VARIANTS.meta())
    paths = common.write_results(rows, meta, out_dir, "gather")
    print(f"# {meta['device']}  torch {meta['torch']}  triton {meta['triton']}  {meta['date']}")
    pk = f"d2d {peaks['d2d_gbps']:.0f} GB/s"
    if peaks.get("d2h_gbps"):
        pk += f", D2H {peaks['d2h_gbps']:.1f} GB/s, H2D {peaks['h2d_gbps']:.1f} GB/s"
    print(f"# measured peaks: {pk}")
    print(common.format_table(rows, ["model", "layout", "chunk_kb", "method", "ms", "gbps", "pct_peak"]))
    return common.finish(rows, meta, paths, out_dir=out_dir, stem="gather", plot=plot,
                         case=lambda r: f"{r['model']}/{r['layout']}", value="pct_peak", ylabel="% of measured peak", title=f"paged gather/scatter, {blocks} blocks")


def main(argv=None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), help="default: all registry models")
    p.add_argument("--layouts", nargs="+", default=["nhd", "hnd"], choices=["nhd", "hnd"])
    p.add_argument("--pool", type=common.positive_int, default=4096, help="blocks in the cache pool")
    p.add_argument("--blocks", type=common.positive_int, default=2048, help="random distinct blocks gathered")
    p.add_argument("--out", default="bench_results", help=common.OUT_HELP)
    p.add_argument("--quick", action="store_true", help=f"two models, at most {QUICK_BLOCKS} blocks (CI smoke)")
    p.add_argument("--tiny", action="store_true", help="tiny CPU-sized run")
    p.add_argument("--no-plot", action="store_true")
    a = p.parse_args(argv)
    try:
        sizes(a.pool, a.blocks, tiny=a.tiny, quick=a.quick)
    except ValueError as exc:
        p.error(str(exc))
    common.bench_paths(p, out=a.out)
    _VARIANTS.clear()  # this call's failures only (run() clears them too)
    run(models=a.models, layouts=a.layouts, pool=a.pool, blocks=a.blocks, out_dir=a.out, quick=a.quick,
        tiny=a.tiny, plot=not a.no_plot)
    return _VARIANTS.exit_code()  # the rows that ran are written; the rc (and .ci/gpu-bench's) says some did not


if __name__ == "__main__":
    sys.exit(main())
