"""The launchers keep their per-call arguments in plans (host time on every layer's path): the
plan must give exactly the arguments computed from scratch, and never freeze what changes from
call to call (the ids, the staging buffer, the error counter, the stream, the bulk switch).

Runs on CPU: the Triton kernel and the CUDA C library are replaced by recorders."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvkernels import _cuda, backends, ops
from kvkernels.models import make_cache
from kvkernels.staging import StagingFormat
from kvkernels.triton_ops import gather as tg

CASES = [("vllm-nhd", 16, 8, 128), ("flashinfer-hnd", 16, 2, 64), ("mla", 8, 1, 576)]


class _Recorder:
    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *a, **k: self.calls.append((grid, a, k))


def _expected_triton(lay, fmt, out, cap):
    wb = lay.access_width(out.data_ptr(), out.storage_offset(), cap=8)
    items = fmt.num_regions * fmt.num_kv * fmt.num_blocks
    sb, sn, sh = (s // wb for s in lay.byte_strides)
    scalars = (fmt.num_blocks, lay.num_blocks, items, sb, sn, sh, fmt.region_nbytes // wb, fmt.entry_nbytes // wb)
    return wb, (min(items, cap) if cap else items,), scalars


@pytest.mark.parametrize("kind,bs,h,d", CASES)
def test_triton_plan_gives_the_computed_arguments_and_follows_each_call(kind, bs, h, d, monkeypatch):
    lay = make_cache(kind, num_layers=3, num_blocks=40, block_size=bs, num_heads=h, head_dim=d)
    rec = _Recorder()
    monkeypatch.setattr(tg, "_gather_kernel", rec)
    monkeypatch.setattr(backends, "triton_available", lambda device=None: True)
    big = torch.empty(4 << 20, dtype=torch.uint8)
    calls = [(torch.tensor([3, 1, 7]), big, (1,), 16), (torch.tensor([5, 2, 9]), big, (1,), 16),  # plan reused
             (torch.tensor([4, 4, 0], dtype=torch.int32), big[8:], (1,), 16),  # 8-byte-aligned view: other words
             (torch.tensor([1, 2, 3, 4, 5]), big, (0, 2), 0)]
    for ids, out, layers, cap in calls:
        ops.gather(lay, ids, out=out, layers=layers, backend="triton", max_ctas=cap, validate=False)
        grid, a, k = rec.calls[-1]
        fmt = StagingFormat.for_layout(lay, ids.numel(), layers)
        wb, want_grid, scalars = _expected_triton(lay, fmt, out, cap)
        assert grid == want_grid
        assert a[1] is ids  # this call's ids, not a planned one
        assert a[2].data_ptr() == out.data_ptr() and a[2].element_size() == wb and a[2].numel() * wb == fmt.nbytes
        assert a[4:] == scalars
        assert torch.equal(a[0].cpu(), torch.tensor([[v.data_ptr() for v in lay.views[l]] for l in layers]))
        assert k["WORD"] == wb and k["C"] == lay.num_kv and k["ROWS"] == bs * h
    assert len(lay._memo["triton_launch"]) == 3  # calls 1 and 2 shared a plan


class _Lib:
    def __init__(self):
        self.calls = []

    def kvk_paged_copy(self, *a):
        self.calls.append(("paged", a))
        return 0

    def kvk_bulk_copy(self, *a):
        self.calls.append(("bulk", a))
        return 0

    def kvk_features(self):
        return 1


@pytest.mark.parametrize("kind,bs,h,d", CASES)
def test_cuda_plan_gives_the_computed_arguments_and_follows_each_call(kind, bs, h, d, monkeypatch):
    lay = make_cache(kind, num_layers=3, num_blocks=40, block_size=bs, num_heads=h, head_dim=d)
    lib = _Lib()
    stream = SimpleNamespace(cuda_stream=111)
    monkeypatch.setattr(_cuda, "_load", lambda: (lib, "stub"))
    monkeypatch.setattr(backends, "cuda_ext_available", lambda: True)
    monkeypatch.setattr(backends, "resolve", lambda backend, device: "cuda")  # CPU tensors posing as CUDA ones
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    # a CUDA build of torch has the raw-stream call _cuda._raw_stream prefers: it must give the stand-in too
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda idx: stream.cuda_stream, raising=False)
    out = torch.empty(4 << 20, dtype=torch.uint8)
    for step, ids in enumerate((torch.tensor([3, 1, 7]), torch.tensor([6, 2, 8], dtype=torch.int32))):
        stream.cuda_stream = 111 + step
        ops.gather(lay, ids, out=out, layers=(2,), backend="cuda", max_ctas=16, validate=False)
        kind_, a = lib.calls[-1]
        fmt = StagingFormat.for_layout(lay, 3, (2,))
        sb, sn, sh = lay.byte_strides
        want = (1, lay.pointer_table_for((2,)).data_ptr(), ids.data_ptr(), int(ids.dtype == torch.int64),
                out.data_ptr(), ops._err_counter(lay.device).data_ptr(), 3, lay.num_blocks, lay.num_kv, 1, h, bs * h,
                lay.row_nbytes, sb, sn, sh, fmt.region_nbytes, fmt.entry_nbytes,
                lay.access_width(out.data_ptr()), 16, 0, 111 + step)
        assert (kind_, a) == ("paged", want)
    # the bulk switch is read on every call, not frozen in the plan
    monkeypatch.setenv("KVKERNELS_CUDA_BULK", "1")
    monkeypatch.setattr(_cuda, "_use_bulk", lambda layout, staging: True)
    ops.gather(lay, torch.tensor([1, 2, 3]), out=out, layers=(2,), backend="cuda", max_ctas=16, validate=False)
    assert lib.calls[-1][0] == "bulk" and lib.calls[-1][1][-3:] == (16, 0, 112)
