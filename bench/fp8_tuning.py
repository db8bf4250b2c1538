"""Diagnostic: where the fused FP8 gather's time goes (issue 5: >= 80 % of the copy bound).

On the H100 (2026-11-23) the FP8 gathers ran at 22-30 % of the device-copy peak (Triton) and
11-19 % (CUDA) while the plain gathers moved 96-98 % and the FP8 scatters 58-94 %. The gather
adds, per element, one IEEE division (``x / s``), the integer e4m3 encoding and a row max. This
script times kernel variants of the Triton quantizing gather on the same cache and blocks:

* ``base``: the shipped kernel (``tl.div_rn`` per element, integer e4m3 code, 4 warps, 4096-element tiles);
* ``recip``: ``x * (1 / s)``: one division per row instead of one per element;
* ``hwcvt``: the code from the fp8 conversion instruction instead of integer operations;
* ``recip+hwcvt``, and launch shapes (``warps=8``, ``tile=2048/8192``);

and reports each variant's time, GB/s (bytes read + written, as ``bench_gather``), % of the
measured device-copy peak, and how many code/scale bytes differ from ``base`` (a variant that is
fast but changes bytes would change the format's rounding rule: docs/quant.md). The CUDA
backend's kernel is timed beside it. GPU only:

    python bench/fp8_tuning.py [--models llama3-8b llama3-70b-tp8 deepseek-v3-mla] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench import common  # noqa: E402
from kvkernels import StagingFormat  # noqa: E402
from kvkernels.models import get_model, make_cache  # noqa: E402
from kvkernels.quant import QuantStagingFormat, gather_quant  # noqa: E402

VARIANTS = {
    "base": {},
    "recip": {"DIV_MODE": 1},
    "hwcvt": {"HW_CVT": True},
    "recip+hwcvt": {"DIV_MODE": 1, "HW_CVT": True},
    "warps=8": {"num_warps": 8},
    "tile=2048": {"tile_elems": 2048},
    "tile=8192": {"tile_elems": 8192},
    "recip+hwcvt,warps=8": {"DIV_MODE": 1, "HW_CVT": True, "num_warps": 8},
}


def run(models, *, pool: int = 4096, blocks: int = 2048, out_dir: str = "bench_results") -> list[dict]:
    from triton_ops.quant_gather import quant_gather_triton

    device = torch.device("cuda")
    peaks = common.measure_peaks(device, 1 << 30)
    peak = peaks["d2d_gbps"]
    meta = common.env_record()
    meta["peaks"] = peaks
    rows: list[dict] = []
    for m in models:
        shape = get_model(m)
        lay = make_cache("mla" if shape.mla else "vllm-nhd", num_layers=shape.num_layers, num_blocks=pool,
                         block_size=16, num_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                         dtype=torch.bfloat16, device=device)
        g = torch.Generator().manual_seed(1)
        ids = torch.randperm(pool, generator=g)[:blocks].to(device)
        raw = StagingFormat.for_layout(lay, blocks)
        payload = raw.num_regions * raw.payload_nbytes  # as bench_gather
        for gran in ("token", "block"):
            fmt = QuantStagingFormat.for_layout(lay, blocks, granularity=gran)
            moved = payload + fmt.num_regions * fmt.num_kv * (fmt.q_nbytes + fmt.scale_nbytes)
            err = torch.zeros(1, dtype=torch.int32, device=device)
            ref = torch.zeros(fmt.nbytes, dtype=torch.uint8, device=device)
            quant_gather_triton(lay, ids, fmt, ref, err)
            out = torch.zeros_like(ref)
            base = {"model": m, "chunk_kb": round(lay.chunk_nbytes / 1024, 2), "granularity": gran}
            for name, probe in VARIANTS.items():
                try:
                    fn = lambda: quant_gather_triton(lay, ids, fmt, out, err, _probe=probe)  # noqa: E731
                    fn()
                    torch.cuda.synchronize()
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
            fn = lambda: gather_quant(lay, ids, out=out, backend="cuda", quant="fp8", granularity=gran,  # noqa: E731
                                      validate=False)
            fn()
            torch.cuda.synchronize()
            diff = int((out != ref).sum())
            ms = common.time_ms(fn, device=device)
            bw = common.gbps(moved, ms)
            rows.append({**base, "variant": "cuda[base]", "ms": ms, "gbps": bw, "pct_peak": 100 * bw / peak,
                         "bytes_differing": diff})
            common.progress(rows[-1])
        lay = ids = ref = out = None  # noqa: F841 - frees the cache before the next model
        torch.cuda.empty_cache()
    paths = common.write_results(rows, meta, out_dir, "fp8_tuning")
    print(f"# {meta['device']}  torch {meta['torch']}  triton {meta['triton']}  {meta['date']}  d2d {peak:.0f} GB/s")
    print(common.format_table(rows, ["model", "chunk_kb", "granularity", "variant", "ms", "gbps", "pct_peak",
                                     "bytes_differing", "error"]))
    print(f"# wrote {', '.join(paths.values())}")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["llama3-8b", "llama3-70b-tp8", "deepseek-v3-mla"])
    p.add_argument("--blocks", type=int, default=2048)
    p.add_argument("--out", default="bench_results")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_tuning: needs a GPU", file=sys.stderr)
        return 2
    run(a.models, blocks=a.blocks, out_dir=a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
