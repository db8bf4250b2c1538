"""Diagnostic: where the fused FP8 gather's time goes (issue 5: >= 80 % of the copy bound).

First run (H100, 2026-11-23): the FP8 gathers ran at 22-30 % of the device-copy peak (Triton) and
10-19 % (CUDA) while the plain gathers moved 96-98 %. Probes of the Triton kernel then showed the
per-element IEEE division ``x / s`` (``div.rn.f32``) to be the cost: ``x * (1 / s)`` took
2.2-2.4 ms instead of 9.6 ms on llama3-8b (but changed ~3e-5 of the codes), the fp8 conversion
instruction saved a further ~7 % over integer encoding (no byte differing), and the launch shape
(warps, tile size) helped nowhere (8 warps was slower on 4 KB chunks). The kernels now compute the same IEEE quotient from one
reciprocal per row and an FMA correction per element (Markstein; docs/quant.md) and, on the GPU,
encode with the conversion instruction. This script times, on one cache and block list:

* ``div_rn``: ``tl.div_rn`` per element (KVKERNELS_FP8_FMA_DIV=0);
* ``fma_div``: the reciprocal + FMA quotient (the default since 2026-11-23);
* ``fma_div,intcode``: with integer e4m3 encoding (the interpreter's) instead of the instruction;
* ``fma_div,warps=8``, ``fma_div,tile=2048``: launch shapes;
* ``fma_div,padded_d``: a head dim that is not a power of two (MLA's 576) as one tile padded to
  1024 (44 % of its lanes idle) instead of the default 512 tile plus a 64 tile (``split_d``, the
  default since the H100 run of 2026-11-23: 73-79 % of the bound against 48-54 % padded);
* ``items=4`` / ``items=8``: that many consecutive work items per program step (one division and
  one prologue per group), ``fma2``: the same quotient with one instruction less,
  ``tail_fix``: the split tiles kept in their load layouts (no tile-sized shared-memory
  conversion), ``maxnreg=72``: Triton's register cap (twelfth session, from a static SASS study);

with each variant's time, GB/s (bytes read + written, as ``bench_gather``), % of the measured
device-copy peak, and how many code/scale bytes differ from the default kernel's (must be 0), and the CUDA
backend's kernel beside it; every row also carries ``default_vs_torch_bytes_differing``, the
default kernel's own payload bytes against the torch reference's (must be 0: else every variant
was compared with wrong bytes; the exit code is 3 then too). GPU only:

    python bench/fp8_tuning.py [--models llama3-8b llama3-70b-tp8 deepseek-v3-mla] [--pool 4096] [--blocks 2048] [--out DIR]
    python bench/fp8_tuning.py --ncu-target     # one launch per kernel, model, granularity (.ci/gpu-bench ncu)
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

try:
    from . import common
except ImportError:  # pragma: no cover - run as a script
    import common  # type: ignore

from kvkernels import StagingFormat
from kvkernels.models import MODELS, get_model, make_cache
from kvkernels.quant import QuantStagingFormat, gather_quant

VARIANTS: dict[str, dict[str, Any]] = {
    "div_rn": {"FMA_DIV": False},
    "fma_div": {"FMA_DIV": True},
    "fma_div,intcode": {"FMA_DIV": True, "HW_CVT": False},
    "fma_div,warps=8": {"FMA_DIV": True, "num_warps": 8},
    "fma_div,tile=2048": {"FMA_DIV": True, "tile_elems": 2048},
    "fma_div,padded_d": {"FMA_DIV": True, "split_d": False},
    # the twelfth session's static SASS study (docs/PERF_NOTES.md, "Triton FP8 gather: what the
    # static SASS says"), predictions there: groups of items per program step (fixed per-item work
    # shared), the quotient with one instruction less, the split tiles kept in their load layouts
    "fma_div,items=4": {"FMA_DIV": True, "items": 4},
    "fma_div,items=8": {"FMA_DIV": True, "items": 8},
    "fma2": {"FMA_DIV": 2},
    "fma2,items=4": {"FMA_DIV": 2, "items": 4},
    "fma2,tail_fix": {"FMA_DIV": 2, "tail_fix": 2},
    "fma2,tail_fix,maxnreg=72": {"FMA_DIV": 2, "tail_fix": 2, "maxnreg": 72},
    "fma2,items=4,tail_fix": {"FMA_DIV": 2, "items": 4, "tail_fix": 2},
}


def check_sizes(models, pool: int, blocks: int) -> list:
    """``models`` each once, after checking every argument before anything is measured (an unknown
    model failed after the ones before it had run; more blocks than the pool launched a format for
    ``blocks`` blocks with ``pool`` ids)."""
    models = common.distinct(models)
    for m in models:
        get_model(m)  # ValueError naming the registry
    if not (isinstance(pool, int) and isinstance(blocks, int) and 1 <= blocks <= pool):
        raise ValueError(f"`blocks`: expected 1 <= blocks <= pool ({pool}), got {blocks}")
    return models


def _case(model: str, pool: int, blocks: int, device):
    """A bf16 cache of ``model``'s shape (vLLM NHD, or MLA) and ``blocks`` seeded random ids of its pool."""
    shape = get_model(model)
    lay = make_cache("mla" if shape.mla else "vllm-nhd", num_layers=shape.num_layers, num_blocks=pool,
                     block_size=16, num_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                     dtype=torch.bfloat16, device=device)
    ids = torch.randperm(pool, generator=torch.Generator().manual_seed(1))[:blocks].to(device)
    return lay, ids


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(models, *, pool: int = 4096, blocks: int = 2048, out_dir: str = "bench_results",
        device: str | torch.device = "cuda", variants: dict | None = None) -> list[dict]:
    """The rows (``variants``: a subset of :data:`VARIANTS`; ``device``: ``"cpu"`` runs the Triton
    kernels under ``TRITON_INTERPRET=1`` at tiny sizes, for the tests only — no measurement)."""
    from kvkernels.triton_ops.quant_gather import quant_gather_triton

    models = check_sizes(models, pool, blocks)
    device = torch.device(device)
    peaks = common.measure_peaks(device, 1 << 30 if device.type == "cuda" else 1 << 20)
    peak = peaks["d2d_gbps"]
    meta = common.env_record()
    meta["peaks"] = peaks
    rows: list[dict] = []
    for m in models:
        lay, ids = _case(m, pool, blocks, device)
        raw = StagingFormat.for_layout(lay, blocks)
        payload = raw.num_regions * raw.payload_nbytes  # as bench_gather
        for gran in ("token", "block"):
            fmt = QuantStagingFormat.for_layout(lay, blocks, granularity=gran)
            moved = common.fp8_moved(fmt, payload)
            err = torch.zeros(1, dtype=torch.int32, device=device)
            # ref and every variant's out start poisoned alike (0x5A): a byte a variant fails to write
            # then differs from ref (with one buffer kept across variants it held the last one's
            # correct byte); bytes no kernel writes stay equal
            ref = torch.full((fmt.nbytes,), 0x5A, dtype=torch.uint8, device=device)
            quant_gather_triton(lay, ids, fmt, ref, err)
            # and the default kernel itself against the torch reference (the definition: codes
            # bit-identical to torch's cast), over every region's payload: a wrong default would
            # otherwise make every variant "agree" with it (bytes_differing 0 everywhere)
            torch_ref = gather_quant(lay, ids, quant="fp8", granularity=gran, backend="torch")
            ref_wrong = sum(int((ref[o: o + n] != torch_ref[o: o + n]).sum()) for _, o, n in fmt.regions())
            out = torch.empty_like(ref)
            base = {"model": m, "chunk_kb": round(lay.chunk_nbytes / 1024, 2), "granularity": gran,
                    "default_vs_torch_bytes_differing": ref_wrong}
            for name, probe in (VARIANTS if variants is None else variants).items():
                try:
                    fn = lambda: quant_gather_triton(lay, ids, fmt, out, err, _probe=probe)  # noqa: E731
                    out.fill_(0x5A)
                    fn()
                    _sync(device)
                    diff = int((out != ref).sum())
                    ms = common.time_ms(fn, device=device)
                except Exception as exc:  # a variant that does not compile is a result too
                    rows.append({**base, "variant": name, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
                    common.progress(rows[-1])
                    continue
                bw = common.gbps(moved, ms)
                rows.append({**base, "variant": f"triton[{name}]", "ms": ms, "gbps": bw, "pct_peak": 100 * bw / peak,
                             "bytes_differing": diff})
                common.progress(rows[-1])
            from kvkernels._cuda import quant_gather_cuda

            # the CUDA kernel through its launcher, as the Triton rows (the public gather_quant
            # would add its own setup to this row only)
            fn = lambda: quant_gather_cuda(lay, ids, fmt, out, err)  # noqa: E731
            try:
                out.fill_(0x5A)
                fn()
                _sync(device)
                diff = int((out != ref).sum())
                ms = common.time_ms(fn, device=device)
            except Exception as exc:  # recorded as a row (the rows after it still run); main() then exits 3
                rows.append({**base, "variant": "cuda", "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
                common.progress(rows[-1])
                continue
            bw = common.gbps(moved, ms)
            rows.append({**base, "variant": "cuda", "ms": ms, "gbps": bw, "pct_peak": 100 * bw / peak,
                         "bytes_differing": diff})
            common.progress(rows[-1])
        # written after every model: a run cut off by a time cap keeps the finished ones (the
        # variants grew from 6 to 13 in the twelfth session); before the cache is freed, whose
        # empty_cache raises after a sticky CUDA error
        common.write_results(rows, {**meta, "partial": True}, out_dir, "fp8_tuning")
        lay = ids = ref = out = torch_ref = None  # type: ignore[assignment]  # noqa: F841 - frees the cache before the next model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    paths = common.write_results(rows, meta, out_dir, "fp8_tuning")
    print(f"# {meta['device']}  torch {meta['torch']}  triton {meta['triton']}  {meta['date']}  d2d {peak:.0f} GB/s")
    print(common.format_table(rows, ["model", "chunk_kb", "granularity", "variant", "ms", "gbps", "pct_peak",
                                     "bytes_differing", "error"]))
    print(f"# wrote {', '.join(paths.values())}")
    return rows


def ncu_target(models, *, pool: int = 4096, blocks: int = 2048,
               device: str | torch.device = "cuda") -> tuple[int, int]:
    """One launch of each FP8 quantizing gather — Triton's default kernel, then the CUDA one — per
    model and granularity, and no other kernel named ``quant_gather``: what ``.ci/gpu-bench ncu``
    profiles (``ncu --kernel-name regex:quant_gather``). Returns (launches, failed launches)."""
    from kvkernels._cuda import quant_gather_cuda
    from kvkernels.triton_ops.quant_gather import quant_gather_triton

    models = check_sizes(models, pool, blocks)
    device = torch.device(device)
    launches = failed = 0
    for m in models:
        lay, ids = _case(m, pool, blocks, device)
        for gran in ("token", "block"):
            fmt = QuantStagingFormat.for_layout(lay, blocks, granularity=gran)
            out = torch.empty(fmt.nbytes, dtype=torch.uint8, device=device)
            err = torch.zeros(1, dtype=torch.int32, device=device)
            for name, fn in (("triton", quant_gather_triton), ("cuda", quant_gather_cuda)):
                try:  # (the CUDA backend may not build: the Triton kernels are profiled all the same)
                    fn(lay, ids, fmt, out, err)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001 - reported, the next launch still runs
                    print(f"[ncu-target] {m} {gran} {name}: {type(exc).__name__}: {exc}", flush=True)
                    failed += 1
                    continue
                launches += 1
                print(f"[ncu-target] {m} chunk {lay.chunk_nbytes / 1024:g} KB {gran} {name}", flush=True)
        lay = ids = out = None  # type: ignore[assignment]  # noqa: F841 - frees the cache before the next model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return launches, failed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["llama3-8b", "llama3-70b-tp8", "deepseek-v3-mla"],
                   choices=sorted(MODELS))
    p.add_argument("--pool", type=common.positive_int, default=4096, help="blocks in the cache pool")
    p.add_argument("--blocks", type=common.positive_int, default=2048, help="random distinct blocks gathered")
    p.add_argument("--out", default="bench_results", help=common.OUT_HELP)
    p.add_argument("--ncu-target", action="store_true",
                   help="only launch each FP8 gather once per model and granularity (for ncu; .ci/gpu-bench ncu)")
    a = p.parse_args(argv)
    try:
        check_sizes(a.models, a.pool, a.blocks)
    except ValueError as exc:
        p.error(str(exc).replace("`blocks`", "argument --blocks"))
    if not a.ncu_target:  # checked before minutes of measuring (it was at the first write)
        common.check_dir(p, a.out, "argument --out")
    if not torch.cuda.is_available():
        print("fp8_tuning: needs a GPU", file=sys.stderr)
        return 2
    if a.ncu_target:
        n, failed = ncu_target(a.models, pool=a.pool, blocks=a.blocks)
        print(f"[ncu-target] {n} launches, {failed} failed")
        return 3 if failed else 0
    common.bench_paths(p, out=a.out)
    rows = run(a.models, pool=a.pool, blocks=a.blocks, out_dir=a.out)
    # a variant that raised (one illegal access poisons the context: every later row errors) or
    # wrote other bytes than the default kernel (itself checked against torch's cast by the tests) fails the run, so a wrapper's rc says so
    errors = sum(1 for r in rows if r.get("error"))
    wrong = sum(1 for r in rows if r.get("bytes_differing"))
    bad_ref = sum(1 for r in rows if r.get("default_vs_torch_bytes_differing"))
    if errors or wrong or bad_ref:
        print(f"# FAILED: {errors} rows raised, {wrong} rows differ from the default kernel's bytes, "
              f"{bad_ref} rows measured against a default kernel whose bytes differ from the torch "
              "reference's", file=sys.stderr)
        return 3
    print(f"# all {len(rows)} rows ran and match the default kernel's bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
