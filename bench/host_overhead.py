"""Diagnostic: the host (Python) cost of the step-path calls with the kernel launch stubbed out.

Issue 4 asks for <= 50 us of host time to issue one layer. On a GPU the pipeline bench measures
the whole call (``issue_us_per_layer``); this script splits off what kvkernels itself costs, on
any machine (no GPU needed), by replacing the Triton kernel, the CUDA C call and the gather inside
``save_layer`` with no-ops:

    python bench/host_overhead.py [--calls 3000]

Prints the median and the mean per call in microseconds (for the pipeline's per-layer calls the
mean is a whole step's host time over its layers). Numbers are for the host it runs on
(docs/PERF_NOTES.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace
from unittest import mock

import torch

from kvkernels import _cuda, backends, ops
from kvkernels import pipeline as pipeline_mod
from kvkernels.models import make_cache
from kvkernels.staging import StagingFormat

try:  # installed as kvkernels.bench, or run as a script
    from . import common
except ImportError:  # pragma: no cover
    import common  # type: ignore


def _median_us(fn, calls: int, cycle: int = 1) -> dict:
    """Median and mean of ``fn``'s calls, in µs. ``cycle``: the calls are steps of that many
    layers, whose first and last calls carry the step's own work (``start_load``, the entry, the
    step's end): the count is rounded up to whole steps, so the mean is a step's whole host time
    over its layers (the median shows a middle layer's call and hides that work)."""
    for _ in range(cycle):  # a whole step of warm-up: the timed calls start and end at a step's edges
        fn()
    calls = -(-calls // cycle) * cycle
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return {"median_us": 1e6 * statistics.median(ts), "mean_us": 1e6 * statistics.fmean(ts)}


class _NoKernel:
    def __getitem__(self, grid):
        return lambda *a, **k: None


class _NoLib:
    def kvk_paged_copy(self, *a):
        return 0

    def kvk_bulk_copy(self, *a):
        return 0

    def kvk_features(self):
        return 1


def run(calls: int = 3000) -> dict:
    lay = make_cache("vllm-nhd", num_layers=32, num_blocks=64, block_size=16, num_heads=8, head_dim=128)
    ids = torch.arange(2)
    out = torch.empty(1 << 20, dtype=torch.uint8)
    res = {}
    from kvkernels.triton_ops import gather as tg

    with mock.patch.object(tg, "_gather_kernel", _NoKernel()), \
            mock.patch.object(backends, "triton_available", lambda device=None: True):
        res["ops.gather[triton] minus the launcher"] = _median_us(
            lambda: ops.gather(lay, ids, out=out, layers=(3,), backend="triton", max_ctas=16, validate=False), calls)
        fmt = StagingFormat.for_layout(lay, 2, (3,))
        res["pipeline's launch path [triton] minus the launcher"] = _median_us(
            lambda: ops._gather_into(lay, ids, fmt, out, "triton", 16), calls)
    with mock.patch.object(_cuda, "_load", lambda: (_NoLib(), "stub")), \
            mock.patch.object(backends, "cuda_ext_available", lambda: True), \
            mock.patch.object(backends, "resolve", lambda b, d, real=backends.resolve: real(b, torch.device("cuda", 0))), \
            mock.patch.object(torch.cuda, "current_device", lambda: 0), \
            mock.patch.object(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0)), \
            mock.patch.object(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, create=True):
        # (a CUDA build of torch has the raw-stream call _cuda uses, and it fails without a GPU)
        res["ops.gather[cuda] minus the C call"] = _median_us(
            lambda: ops.gather(lay, ids, out=out, layers=(3,), backend="cuda", max_ctas=16, validate=False), calls)
    big = make_cache("vllm-nhd", num_layers=32, num_blocks=512, block_size=16, num_heads=8, head_dim=128)
    for name, cache, block_ids in (("a tensor of 2 ids", lay, ids),
                                   ("a list of 128 ids, as vLLM passes", big, list(range(0, 256, 2)))):
        pipe = pipeline_mod.LayerPipeline(cache, host_bytes=256 << 20, max_ctas=16, backend="torch")
        try:
            with mock.patch.object(pipeline_mod.ops, "_gather_into", lambda layout, ids, fmt, out, b, cap: out), \
                    mock.patch.object(pipe, "_pieces", lambda *a: ()):  # on CPU a "DMA" is a synchronous memcpy
                layer = iter(range(10**9))

                def save():
                    l = next(layer) % 32
                    pipe.save_layer(l, {"req": block_ids})
                    if l == 31:
                        pipe.wait_for_save()
                        pipe.get_finished()

                res[f"LayerPipeline.save_layer minus gather and DMA, {name}"] = _median_us(save, calls, 32)
                if name.startswith("a tensor"):
                    # the restore side: a step is start_load + one wait_for_layer_load per layer
                    pipe.wait_for_save()
                    pipe.get_finished()
                    with mock.patch.object(pipeline_mod.ops, "_scatter_from", lambda *a: None):
                        step = iter(range(10**9))

                        def restore():
                            l = next(step) % 32
                            if l == 0:
                                pipe.start_load({"req": block_ids})
                            pipe.wait_for_layer_load(l)
                            if l == 31:
                                pipe.get_finished()

                        res["LayerPipeline restore per layer (a step: start_load + 32 wait_for_layer_load) "
                            "minus scatter and DMA"] = _median_us(restore, calls, 32)

                        def restore_async():  # every layer issued by the call: one step per call
                            pipe.start_load({"req": block_ids}, asynchronous=True)
                            pipe.get_finished()

                        res["LayerPipeline asynchronous restore, a whole step (start_load(asynchronous=True), "
                            "32 layers) minus scatter and DMA"] = _median_us(restore_async, max(calls // 32, 50))
                    # what was timed restored the saved entry (a missing key is the error path)
                    if "req" not in pipe.entries or pipe.get_block_ids_with_load_errors():
                        raise RuntimeError("host_overhead: the timed restores did not restore the saved entry")
        finally:
            pipe.close()
    return res



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=common.positive_int, default=3000)
    a = p.parse_args(argv)
    print(f"{'per call, µs (pipeline rows: the mean is a whole step over its 32 layers)':88s} {'median':>8s} {'mean':>8s}")
    for k, v in run(a.calls).items():
        print(f"{k:88s} {v['median_us']:8.1f} {v['mean_us']:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
