"""gather / scatter: every layout x dtype x backend, bit-exact; edge cases; every error path.

Two oracles: ``expected_staging`` below (slot by slot, written independently of reference.py)
checks the reference, and every backend is compared bit-exactly with the reference.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import kvkernels
from kvkernels import StagingFormat, reference
from kvkernels.models import LAYOUTS, make_cache
from kvtest import BACKENDS, DEVICE, bytes_equal

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]
HEAD_DIMS = [64, 80, 96, 128, 256, 576]
BLOCK_SIZES = [1, 16, 32]
ALL_LAYOUTS = sorted(LAYOUTS)

L, NB, BS, H, D = 3, 12, 4, 2, 64
IDS = [7, 3, 3, 11, 0]  # unsorted, with a duplicate


def cache(layout, *, dtype=torch.bfloat16, head_dim=D, block_size=BS, heads=H, blocks=NB, layers=L, fill="random", seed=0):
    return make_cache(
        layout, num_layers=layers, num_blocks=blocks, block_size=block_size, num_heads=heads,
        head_dim=head_dim, dtype=dtype, device=DEVICE, fill=fill, seed=seed,
    )


def expected_staging(lay, ids, layers=None) -> torch.Tensor:
    """Staging bytes built slot by slot from the definition (docs/layouts.md)."""
    fmt = StagingFormat.for_layout(lay, len(ids), layers)
    out = torch.zeros(fmt.nbytes, dtype=torch.uint8)
    for layer in fmt.layers:
        for c in range(lay.num_kv):
            base = fmt.entry_offset(layer, c)
            for i, b in enumerate(ids):
                if b == -1:
                    continue
                chunk = lay.views[layer][c][b].cpu().contiguous().view(-1).view(torch.uint8)
                out[base + i * fmt.chunk_nbytes : base + (i + 1) * fmt.chunk_nbytes] = chunk
    return out


def all_bytes(lay):
    """Copies of every view's bytes: on CPU ``.cpu()`` and ``.contiguous()`` return the cache's own
    memory, so a "before" snapshot taken without the clone is the cache and equals itself later."""
    return [v.cpu().contiguous().view(-1).view(torch.uint8).clone() for row in lay.views for v in row]


# ---------------------------------------------------------------------------------------- gather
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_gather_every_layout_dtype(layout, dtype, backend):
    lay = cache(layout, dtype=dtype)
    out = kvkernels.gather(lay, torch.tensor(IDS, device=DEVICE), backend=backend)
    assert out.dtype == torch.uint8 and out.numel() == kvkernels.staging_nbytes(lay, len(IDS))
    assert torch.equal(out.cpu(), expected_staging(lay, IDS))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("layout", ["vllm-nhd", "vllm-hnd", "mla"])
def test_gather_head_dims_block_sizes(layout, head_dim, block_size, backend):
    lay = cache(layout, head_dim=head_dim, block_size=block_size, layers=2, blocks=6)
    ids = [5, 0, 2]
    out = kvkernels.gather(lay, ids, backend=backend)
    assert torch.equal(out.cpu(), expected_staging(lay, ids))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_int32_ids_padding_and_layer_subsets(backend):
    lay = cache("vllm-hnd")
    ids = torch.tensor([4, -1, 9], dtype=torch.int32, device=DEVICE)
    for layers in (None, 1, [2, 0], (0, 1, 2)):
        out = kvkernels.gather(lay, ids, layers=layers, backend=backend)
        exp = expected_staging(lay, [4, -1, 9], layers)
        assert torch.equal(out.cpu(), exp), layers
    fmt = StagingFormat.for_layout(lay, 3)
    pad = out[fmt.entry_offset(0, 0) + fmt.chunk_nbytes : fmt.entry_offset(0, 0) + 2 * fmt.chunk_nbytes]
    assert int(pad.count_nonzero()) == 0  # the -1 slot is a zero block


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_into_given_out_zeroes_padding_and_keeps_tail(backend):
    lay = cache("mla", head_dim=576, block_size=1)  # payload 2*576*... not 4096-aligned: padding exists
    fmt = StagingFormat.for_layout(lay, 3)
    assert fmt.payload_nbytes < fmt.region_nbytes
    out = torch.full((fmt.nbytes + 100,), 0xAB, dtype=torch.uint8, device=DEVICE)
    ret = kvkernels.gather(lay, [1, 2, 3], out=out, backend=backend)
    assert ret is out
    assert torch.equal(out[: fmt.nbytes].cpu(), expected_staging(lay, [1, 2, 3]))
    assert bool((out[fmt.nbytes :] == 0xAB).all())  # bytes past the staging are untouched


@pytest.mark.parametrize("max_ctas", [0, 1, 3, 1000])
def test_gather_sm_cap_gives_same_bytes(max_ctas):
    lay = cache("flashinfer-hnd")
    out = kvkernels.gather(lay, IDS, backend="triton", max_ctas=max_ctas)
    assert torch.equal(out.cpu(), expected_staging(lay, IDS))


def test_gather_strided_view_of_larger_allocation():
    big = torch.empty(2, NB + 5, BS, H, D + 24, dtype=torch.float16, device=DEVICE)
    kvkernels.models.random_fill_(big)
    caches = [big[:, 3 : NB + 3, :, :, 8 : 8 + D]]  # a strided view at an offset (16-byte aligned here:
    # the unaligned widths are covered by the access-width and fuzz tests)
    lay = kvkernels.PagedLayout.from_vllm(caches)
    for backend in BACKENDS:
        out = kvkernels.gather(lay, IDS, backend=backend)
        assert torch.equal(out.cpu(), expected_staging(lay, IDS)), backend


def test_gather_kv0_view_of_vllm_tensor():
    """A K-only view such as kv[:, 0] described through from_views."""
    t = cache("vllm-nhd")
    k_only = kvkernels.PagedLayout.from_views([[row[0]] for row in t.views])
    for backend in BACKENDS:
        out = kvkernels.gather(k_only, IDS, backend=backend)
        assert torch.equal(out.cpu(), expected_staging(k_only, IDS)), backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_ids_gather_nothing_and_scatter_nothing(backend):
    """No ids: an empty uint8 staging buffer on the cache's device (the definition's), a caller's
    ``out`` returned untouched, and a scatter of it writes no block."""
    lay = cache("vllm-nhd")
    out = kvkernels.gather(lay, [], backend=backend)
    assert out.dtype == torch.uint8 and out.device == lay.device
    assert torch.equal(out.cpu(), expected_staging(lay, []))
    buf = torch.full((8,), 7, dtype=torch.uint8, device=DEVICE)
    assert kvkernels.gather(lay, [], out=buf, backend=backend) is buf and bool((buf == 7).all())
    before = [[v.clone() for v in vs] for vs in lay.views]
    kvkernels.scatter(out, lay, [], backend=backend)
    assert all(bytes_equal(a, b) for va, vb in zip(before, lay.views) for a, b in zip(va, vb))


# --------------------------------------------------------------------------------------- scatter
PAIRS = [
    ("vllm-nhd", "vllm-nhd"),
    ("vllm-nhd", "flashinfer-hnd"),
    ("vllm-hnd", "sglang"),
    ("flashinfer-nhd", "cross-layer"),
    ("cross-layer-hnd", "vllm-packed"),
    ("vllm-packed-blhnc", "vllm-packed-bhlnc"),
    ("sglang", "vllm-packed-lbnhc"),
    ("mla", "mla-cross-layer"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("src_name, dst_name", PAIRS)
def test_round_trip_into_other_ids_and_layout(src_name, dst_name, dtype, backend):
    src = cache(src_name, dtype=dtype, seed=1)
    dst = cache(dst_name, dtype=dtype, seed=2)
    src_ids, dst_ids = [7, 3, 11, 0], [1, 10, 5, 4]
    staging = kvkernels.gather(src, src_ids, backend=backend)
    kvkernels.scatter(staging, dst, torch.tensor(dst_ids, device=DEVICE), backend=backend)
    for l in range(L):
        for c in range(src.num_kv):
            got = dst.views[l][c].cpu()
            for s, d in zip(src_ids, dst_ids):
                assert bytes_equal(got[d], src.views[l][c][s].cpu())
    # blocks not named are untouched: compare with a fresh cache of the same seed
    untouched = [b for b in range(NB) if b not in dst_ids]
    fresh = cache(dst_name, dtype=dtype, seed=2)
    for l in range(L):
        for c in range(dst.num_kv):
            for b in untouched:
                assert bytes_equal(dst.views[l][c][b].cpu(), fresh.views[l][c][b].cpu())


@pytest.mark.parametrize("backend", BACKENDS)
def test_scatter_padding_skips_and_layer_subset(backend):
    src = cache("vllm-nhd", seed=3)
    dst = cache("vllm-hnd", fill="zero")
    staging = kvkernels.gather(src, [2, 5, 8], layers=[0, 2], backend=backend)
    kvkernels.scatter(staging, dst, [6, -1, 1], layers=[2, 0], backend=backend)
    for l in range(L):
        for c in range(2):
            v = dst.views[l][c].cpu()
            if l == 1:
                assert int(v.view(torch.int16).count_nonzero()) == 0
                continue
            assert bytes_equal(v[6], src.views[l][c][2].cpu())
            assert bytes_equal(v[1], src.views[l][c][8].cpu())
            assert int(v[[0, 2, 3, 4, 5, 7, 8, 9, 10, 11]].view(torch.int16).count_nonzero()) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_scatter_matches_reference_bytes(backend):
    src = cache("flashinfer-nhd", dtype=torch.float32, seed=4)
    staging = kvkernels.gather(src, IDS)
    a = cache("cross-layer", dtype=torch.float32, fill="zero")
    b = cache("cross-layer", dtype=torch.float32, fill="zero")
    kvkernels.scatter(staging, a, [0, 1, 2, 3, 4], backend=backend)
    reference.scatter(staging, b, torch.tensor([0, 1, 2, 3, 4], device=DEVICE), StagingFormat.for_layout(b, 5))
    assert all(torch.equal(x, y) for x, y in zip(all_bytes(a), all_bytes(b)))


@pytest.mark.gpu
def test_reference_scatter_of_a_gpu_staging_into_a_cpu_cache_waits_for_the_copy():
    """reference.scatter takes a staging buffer on any device: a CUDA one into a CPU cache was
    copied with non_blocking=True and read before the copy had landed (behind a busy stream)."""
    src = cache("vllm-nhd", dtype=torch.float32, seed=5)
    staging = kvkernels.gather(src, IDS).cuda()
    cpu_lay = make_cache("vllm-nhd", num_layers=L, num_blocks=NB, block_size=BS, num_heads=H,
                         head_dim=D, dtype=torch.float32, device="cpu", fill="zero")
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # queue work ahead of the copy on the current stream
        busy = busy @ busy / 4096
    fmt = StagingFormat.for_layout(cpu_lay, len(IDS))
    reference.scatter(staging, cpu_lay, torch.arange(len(IDS)), fmt)
    back = reference.gather(cpu_lay, torch.arange(len(IDS)), fmt, torch.empty(fmt.nbytes, dtype=torch.uint8))
    assert torch.equal(back, staging.cpu())


def _fmt_with_layers(fmt, layers):
    return dataclasses.replace(fmt, layers=tuple(layers))


@pytest.mark.parametrize("case", ["layer-out-of-range", "other-shape", "short-buffer", "ids-count", "float-ids",
                                  "2d-buffer", "not-a-format"])
def test_reference_refuses_bad_arguments_before_writing_anything(case):
    # reference.gather/scatter are exported; a format naming a layer past the cache's, a format of
    # another block shape, or a short buffer used to fail part-way, after earlier layers were written
    lay = cache("vllm-nhd", layers=3)
    src = cache("vllm-nhd", layers=3, seed=9)
    ids = torch.tensor([0, 2], device=DEVICE)
    fmt = StagingFormat.for_layout(lay, 2)
    staging = kvkernels.gather(src, [0, 2])
    buf = staging.clone()
    exc = ValueError
    if case == "layer-out-of-range":
        fmt = _fmt_with_layers(fmt, (0, 1, 3))  # layers 0 and 1 were written before the IndexError
        buf = torch.zeros(fmt.nbytes, dtype=torch.uint8, device=DEVICE)
    elif case == "other-shape":
        fmt = dataclasses.replace(fmt, head_dim=fmt.head_dim // 2)
    elif case == "short-buffer":
        buf = buf[: fmt.nbytes - 1]
    elif case == "ids-count":
        ids = torch.tensor([0, 2, 1], device=DEVICE)
    elif case == "float-ids":
        ids, exc = ids.double(), TypeError
    elif case == "2d-buffer":
        buf = buf.view(2, -1)
    else:
        fmt, exc = object(), TypeError
    before = all_bytes(lay)
    with pytest.raises(exc):
        reference.scatter(buf, lay, ids, fmt)
    assert all(torch.equal(x, y) for x, y in zip(before, all_bytes(lay)))
    out = torch.full((staging.numel() + 8,), 7, dtype=torch.uint8, device=DEVICE)
    if case == "short-buffer":
        out = out[: staging.numel() - 1]
    elif case == "2d-buffer":
        out = out[:-8].view(2, -1)
    keep = out.clone()
    with pytest.raises(exc):
        reference.gather(src, ids, fmt, out)
    assert torch.equal(out, keep)


# ------------------------------------------------------------------------------- deferred checks
@pytest.mark.parametrize("backend", BACKENDS)
def test_validate_false_never_touches_outside_and_reports_later(backend):
    kvkernels.check_errors()  # clear
    lay = cache("vllm-nhd")
    ids = torch.tensor([1, NB + 100, -7, 2], device=DEVICE)
    out = kvkernels.gather(lay, ids, validate=False, backend=backend)
    assert torch.equal(out.cpu(), expected_staging(lay, [1, -1, -1, 2]))
    with pytest.raises(ValueError, match="`block_ids`: 2 id\\(s\\) outside"):  # once per id, whatever the layers
        kvkernels.check_errors()
    kvkernels.check_errors()  # reset after raising
    dst = cache("vllm-nhd", fill="zero")
    kvkernels.scatter(out, dst, ids, validate=False, backend=backend)
    assert bytes_equal(dst.views[0][0][2].cpu(), lay.views[0][0][2].cpu())
    with pytest.raises(ValueError, match="validate=False"):
        kvkernels.check_errors(DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "torch"])
def test_check_errors_sees_counts_from_kernels_on_other_streams(backend):
    """A pipeline's kernels run on its side streams: check_errors waits for the device, not only
    the current stream (item() alone returned 0 while the side stream's kernel was still queued)."""
    kvkernels.check_errors()  # clear
    lay = cache("vllm-nhd")
    side = torch.cuda.Stream()
    ids = torch.tensor([1, NB + 5, 2], device=DEVICE)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~25 ms: the gather below is still queued at the check
        kvkernels.gather(lay, ids, validate=False, backend=backend)
    with pytest.raises(ValueError, match="`block_ids`: 1 id\\(s\\) outside"):
        kvkernels.check_errors()
    kvkernels.check_errors()  # the count was taken off: nothing left


# ----------------------------------------------------------------------------------- error paths
def _lay():
    return cache("vllm-nhd")


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda l: kvkernels.gather("nope", [0]), TypeError, "layout"),
        (lambda l: kvkernels.gather(l, [0.5]), TypeError, "block_ids"),
        (lambda l: kvkernels.gather(l, "01"), TypeError, "block_ids"),
        (lambda l: kvkernels.gather(l, torch.tensor([0.0])), TypeError, "block_ids"),
        (lambda l: kvkernels.gather(l, torch.tensor([[0]])), ValueError, "block_ids"),
        (lambda l: kvkernels.gather(l, [NB]), ValueError, "block_ids"),
        (lambda l: kvkernels.gather(l, [-2]), ValueError, "block_ids"),
        (lambda l: kvkernels.gather(l, [0, 2**64]), ValueError, "block_ids`: expected ids that fit in int64"),
        (lambda l: kvkernels.gather(l, (0, True)), TypeError, "block_ids"),
        (lambda l: kvkernels.gather(l, [0], layers=[L]), ValueError, "layers"),
        (lambda l: kvkernels.gather(l, [0], layers=[]), ValueError, "layers"),
        (lambda l: kvkernels.gather(l, [0], out=torch.empty(10, dtype=torch.uint8, device=DEVICE)), ValueError, "out"),
        (lambda l: kvkernels.gather(l, [0], out=torch.empty(1 << 16, device=DEVICE)), TypeError, "out"),
        (lambda l: kvkernels.gather(l, [0], out=torch.empty(2, 1 << 16, dtype=torch.uint8, device=DEVICE)), ValueError, "out"),
        (lambda l: kvkernels.gather(l, [0], out=torch.empty(1 << 17, dtype=torch.uint8, device=DEVICE)[::2]), ValueError, "out"),
        (lambda l: kvkernels.gather(l, [0], backend="bogus"), ValueError, "backend"),
        (lambda l: kvkernels.gather(l, [0], backend="cuda"), RuntimeError, "backend"),
        (lambda l: kvkernels.gather(l, [0], max_ctas=-1), ValueError, "max_ctas"),
        (lambda l: kvkernels.gather(l, [0], validate="yes"), TypeError, "validate"),
        (lambda l: kvkernels.scatter(torch.empty(10, dtype=torch.uint8, device=DEVICE), l, [0]), ValueError, "staging"),
        (lambda l: kvkernels.scatter(kvkernels.gather(l, [0, 1]), l, [3, 3]), ValueError, "duplicate"),
        (lambda l: kvkernels.scatter(kvkernels.gather(l, [0, 1]), l, [3, NB]), ValueError, "block_ids"),
        (lambda l: kvkernels.scatter(kvkernels.gather(l, [0]).view(torch.int8), l, [3]), TypeError, "staging"),
    ],
)
def test_bad_input_raises_before_any_write(call, exc, match):
    lay = _lay()
    before = all_bytes(lay)
    with pytest.raises(exc, match=match):
        call(lay)
    assert all(torch.equal(x, y) for x, y in zip(before, all_bytes(lay)))


def test_env_backend_triton_on_cpu_without_the_interpreter_takes_torch(monkeypatch):
    """KVKERNELS_BACKEND=triton applies to every call: CPU tensors (the LMCache plugin's host
    chunks) without the interpreter took it and every such call raised; as with `cuda`, they take
    the torch backend, while an explicit backend="triton" still says why it cannot run."""
    from kvkernels import backends

    monkeypatch.setattr(backends, "triton_available", lambda device=None: device is not None and device.type == "cuda")
    monkeypatch.setenv("KVKERNELS_BACKEND", "triton")
    cpu = torch.device("cpu")
    assert backends.resolve("auto", cpu) == "torch"
    with pytest.raises(RuntimeError, match="'triton' is not available on cpu"):
        backends.resolve("triton", cpu)
    lay = make_cache("vllm-nhd", num_layers=1, num_blocks=4, block_size=2, num_heads=1, head_dim=8, device="cpu")
    assert torch.equal(kvkernels.gather(lay, [1]), expected_staging(lay, [1]))


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("On", True), ("YES", True), ("y", True),
                                       ("Y", True), ("0", False), ("false", False), ("", False), ("2", False),
                                       ("t", False), ("n", False)])
def test_triton_interpret_is_read_as_triton_reads_it(monkeypatch, value, on):
    """Found by review (2026-11-25): only "1" counted, so TRITON_INTERPRET=true ran Triton's
    interpreter while kvkernels refused CPU tensors for want of it."""
    from kvkernels import backends

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert backends.triton_interpret() is on
    try:
        import triton.knobs as knobs  # the source of truth, where this triton has it
    except ImportError:
        return
    if hasattr(knobs, "getenv_bool"):
        assert knobs.getenv_bool("TRITON_INTERPRET", False) is on


def test_a_triton_older_than_the_kernels_need_is_not_used(monkeypatch):
    """Triton 3.2 (torch 2.6's) cannot compile the FP8 gather (no tl.gather) and its interpreter
    miscounts invalid ids: kvkernels treats it as absent, with the reason, instead of failing
    inside Triton on the first FP8 call."""
    import triton

    from kvkernels import backends

    assert backends._version_tuple("3.3.0") == (3, 3, 0) and backends._version_tuple("3.10.1+git1a2b") == (3, 10, 1)
    assert backends._version_tuple("3.4.0rc1") == (3, 4, 0) and backends._version_tuple("unknown") == ()
    interpreted = backends.triton_available(torch.device("cuda"))  # here: a GPU, or the interpreter (CI)
    monkeypatch.setattr(triton, "__version__", "3.2.0")
    backends._triton_import_error.cache_clear()
    try:
        assert not backends.triton_available(torch.device("cpu")) and not backends.triton_available(torch.device("cuda"))
        if interpreted:  # auto took triton for CUDA tensors; now the torch backend
            assert backends.resolve("auto", torch.device("cuda")) == "torch"
        with pytest.raises(RuntimeError, match=r"'triton' is not available on cpu: triton 3\.2\.0 is older than 3\.3, "
                                               r".*pip install 'triton>=3\.3'"):
            backends.resolve("triton", torch.device("cpu"))
        assert kvkernels.info()["triton_status"].startswith("triton 3.2.0 is older than 3.3")
    finally:
        monkeypatch.undo()
        backends._triton_import_error.cache_clear()
    assert backends.triton_available(torch.device("cuda")) == interpreted


def test_env_backend_and_bad_env(monkeypatch):
    lay = _lay()
    monkeypatch.setenv("KVKERNELS_BACKEND", "triton")
    assert torch.equal(kvkernels.gather(lay, [1]).cpu(), expected_staging(lay, [1]))
    monkeypatch.setenv("KVKERNELS_BACKEND", "fast")
    with pytest.raises(ValueError, match="KVKERNELS_BACKEND"):
        kvkernels.gather(lay, [1])
    monkeypatch.setenv("KVKERNELS_BACKEND", "auto")
    monkeypatch.setenv("KVKERNELS_MAX_CTAS", "x")
    with pytest.raises(ValueError, match="KVKERNELS_MAX_CTAS"):
        kvkernels.gather(lay, [1])
    monkeypatch.delenv("KVKERNELS_MAX_CTAS")
    from kvkernels import backends

    # a GPU-only setting is still checked where the Triton FP8 gather runs on the CPU (interpreter)
    if backends.triton_available(lay.device):
        monkeypatch.setenv("KVKERNELS_FP8_FMA_DIV", "maybe")
        with pytest.raises(ValueError, match="KVKERNELS_FP8_FMA_DIV"):
            kvkernels.gather(lay, [1], quant="fp8", backend="triton")


# ------------------------------------------------------------------------------------- fuzzing
ORDERS = ["KBNHD", "KBHND", "BKNHD", "BKHND", "BHNC", "BNC", "HBNC", "BND", "NBHKD"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    order=st.sampled_from(ORDERS),
    layers=st.integers(1, 3),
    blocks=st.integers(1, 6),
    bs=st.sampled_from([1, 2, 3, 16]),
    heads=st.integers(1, 3),
    dim=st.sampled_from([1, 3, 8, 64, 80]),
    dtype=st.sampled_from(DTYPES),
    data=st.data(),
)
def test_fuzz_orders_and_ids(order, layers, blocks, bs, heads, dim, dtype, data):
    dims = {"K": 2, "B": blocks, "N": bs, "H": heads, "D": dim, "C": 2 * dim}
    tensors = []
    for _ in range(layers):
        t = torch.empty(tuple(dims[x] for x in order), dtype=dtype)
        kvkernels.models.random_fill_(t)
        tensors.append(t.to(DEVICE))
    lay = kvkernels.PagedLayout.from_layers(tensors, order)
    ids = data.draw(st.lists(st.integers(-1, blocks - 1), min_size=1, max_size=8))
    sel = data.draw(st.none() | st.lists(st.integers(0, layers - 1), min_size=1, max_size=layers, unique=True))
    exp = expected_staging(lay, ids, sel)
    for backend in BACKENDS:
        out = kvkernels.gather(lay, ids, layers=sel, backend=backend, max_ctas=data.draw(st.integers(0, 4)))
        assert torch.equal(out.cpu(), exp), backend


# ------------------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["vllm-nhd", "vllm-hnd", "mla"])
def test_zero_copy_into_pinned_host(layout):
    lay = cache(layout, blocks=64)
    ids = torch.randint(0, 64, (40,), device=DEVICE)
    fmt = StagingFormat.for_layout(lay, 40)
    host = torch.empty(fmt.nbytes, dtype=torch.uint8).pin_memory()
    kvkernels.gather(lay, ids, out=host, backend="triton", max_ctas=8)
    torch.cuda.synchronize()
    assert torch.equal(host, kvkernels.gather(lay, ids, backend="torch").cpu())
    dst = cache(layout, blocks=64, fill="zero")
    kvkernels.scatter(host, dst, torch.arange(40, device=DEVICE), backend="triton")
    torch.cuda.synchronize()
    assert torch.equal(kvkernels.gather(dst, torch.arange(40, device=DEVICE)).cpu(), host)


@pytest.mark.gpu
def test_hot_path_has_no_host_sync():
    lay = cache("vllm-nhd", blocks=64)
    ids = torch.randint(0, 64, (32,), device=DEVICE)
    dst_ids = torch.arange(32, device=DEVICE)
    ids_list = ids.tolist()
    out = torch.empty(kvkernels.staging_nbytes(lay, 32), dtype=torch.uint8, device=DEVICE)
    for l in range(L):  # warm: JIT and the per-layer pointer tables
        kvkernels.gather(lay, ids, out=out, layers=l, backend="triton", validate=False)
        kvkernels.scatter(out, lay, dst_ids, layers=l, backend="triton", validate=False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for l in range(L):
            kvkernels.gather(lay, ids, out=out, layers=l, backend="triton", validate=False)
            kvkernels.scatter(out, lay, dst_ids, layers=l, backend="triton", validate=False)
        # host ids are range-checked on the host before their (non-blocking) copy: validate=True
        # costs no sync for them
        kvkernels.gather(lay, ids_list, out=out, layers=0, backend="triton", validate=True)
        kvkernels.scatter(out, lay, list(range(32)), layers=0, backend="triton", validate=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    kvkernels.check_errors()


@pytest.mark.gpu
def test_large_random_gather_matches_reference():
    lay = make_cache("vllm-nhd", num_layers=4, num_blocks=2048, block_size=16, num_heads=8, head_dim=128, device=DEVICE)
    ids = torch.randperm(2048, device=DEVICE)[:1024]
    a = kvkernels.gather(lay, ids, backend="triton")
    b = kvkernels.gather(lay, ids, backend="torch")
    assert torch.equal(a, b)
    dst = make_cache("flashinfer-hnd", num_layers=4, num_blocks=2048, block_size=16, num_heads=8, head_dim=128, device=DEVICE, fill="zero")
    dst_ids = torch.randperm(2048, device=DEVICE)[:1024]
    kvkernels.scatter(a, dst, dst_ids, backend="triton")
    assert torch.equal(kvkernels.gather(dst, dst_ids, backend="torch"), a)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    src_order=st.sampled_from(ORDERS),
    dst_order=st.sampled_from(ORDERS),
    blocks=st.integers(2, 8),
    bs=st.sampled_from([1, 3, 16]),
    heads=st.integers(1, 3),
    dim=st.sampled_from([8, 64, 80]),
    backend=st.sampled_from(BACKENDS),
    data=st.data(),
)
def test_fuzz_cross_order_round_trip(src_order, dst_order, blocks, bs, heads, dim, backend, data):
    def build(order, fill):
        dims = {"K": 2, "B": blocks, "N": bs, "H": heads, "D": dim, "C": 2 * dim}
        ts = []
        for _ in range(2):
            t = torch.zeros(tuple(dims[x] for x in order), dtype=torch.float16)
            if fill:
                kvkernels.models.random_fill_(t)
            ts.append(t.to(DEVICE))
        return kvkernels.PagedLayout.from_layers(ts, order)

    # only layouts of the same block shape pair up: same K/V split, same head count
    assume(("K" in src_order or "C" in src_order) == ("K" in dst_order or "C" in dst_order))
    assume(heads == 1 or ("H" in src_order) == ("H" in dst_order))
    src, dst = build(src_order, True), build(dst_order, False)
    src_ids = data.draw(st.lists(st.integers(0, blocks - 1), min_size=1, max_size=blocks))
    dst_ids = data.draw(st.permutations(range(blocks)))[: len(src_ids)]
    staging = kvkernels.gather(src, src_ids, backend=backend)
    kvkernels.scatter(staging, dst, dst_ids, backend=backend)
    assert torch.equal(kvkernels.gather(dst, dst_ids, backend="torch").cpu(), staging.cpu())


# ------------------------------------------------ regressions found by review (2026-11-23)
def test_check_errors_with_a_bare_device_name_finds_the_indexed_counter(monkeypatch):
    # counters live under "cuda:0"; check_errors("cuda") looked up "cuda" and found nothing
    from kvkernels import ops

    monkeypatch.setitem(ops._ERR, "cpu", torch.ones(1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"1 id\(s\)"):
        kvkernels.check_errors(torch.device("cpu"))
    if torch.cuda.is_available():
        kvkernels.gather(make_cache("vllm-nhd", num_layers=1, num_blocks=4, block_size=2, num_heads=1, head_dim=8,
                                    device="cuda"), [1, 9], validate=False)
        with pytest.raises(ValueError, match=r"1 id\(s\)"):
            kvkernels.check_errors("cuda")
    # the lookup itself, on any machine (the "cpu" key above is found by the exact-key lookup too):
    # a counter kept under "cuda:0" (a CPU tensor standing in) is found by the bare "cuda" while
    # device 0 is current, and not by another index
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setitem(ops._ERR, "cuda:0", torch.ones(1, dtype=torch.int32))
    kvkernels.check_errors("cuda:1")
    with pytest.raises(ValueError, match=r"1 id\(s\) .* on cuda:0"):
        kvkernels.check_errors("cuda")
    kvkernels.check_errors("cuda")  # the raise reset it


@pytest.mark.parametrize("backend", BACKENDS)
def test_staging_inside_the_cache_memory_is_refused(backend):
    t = torch.arange(2 * 8 * 4 * 2 * 64, dtype=torch.int16).view(2, 8, 4, 2, 64).clone().to(DEVICE)
    lay = kvkernels.PagedLayout.from_vllm([t])
    fmt = StagingFormat.for_layout(lay, 2)
    out = t.view(-1).view(torch.uint8)[: fmt.nbytes]  # the cache's own memory
    with pytest.raises(ValueError, match="`out`: expected memory disjoint from the cache"):
        kvkernels.gather(lay, [1, 0], out=out, backend=backend)
    with pytest.raises(ValueError, match="`staging`: expected memory disjoint from the cache"):
        kvkernels.scatter(out, lay, [1, 0], backend=backend)


def test_layouts_whose_views_share_memory_are_refused():
    v = torch.zeros(1, 2, 1, 8).expand(4, 2, 1, 8)
    with pytest.raises(ValueError, match="stride 0"):
        kvkernels.PagedLayout.from_views([[v, v]])
    k = torch.zeros(4, 2, 1, 8)
    with pytest.raises(ValueError, match=r"`views\[0\]\[1\]`: expected memory of its own"):
        kvkernels.PagedLayout.from_views([[k, k]])
    with pytest.raises(ValueError, match=r"`views\[1\]\[0\]`: expected memory of its own"):
        kvkernels.PagedLayout.from_views([[k], [k]])


def test_layouts_whose_views_partly_share_memory_are_refused():
    """Aliasing at different addresses (review, 2026-11-23): K and V shifted by one element of
    one tensor, a view whose blocks overlap, from_strides with V inside K's block — a scatter's
    bytes then depended on max_ctas. Interleaved layouts that do not alias stay accepted."""
    t = torch.zeros(3, 2, 1, 5)
    with pytest.raises(ValueError, match=r"`views\[0\]\[1\]`: expected memory of its own .*shared with views\[0\]\[0\]"):
        kvkernels.PagedLayout.from_views([[t[..., 0:4], t[..., 1:5]]])
    flat = torch.zeros(16)
    with pytest.raises(ValueError, match="slots that do not share memory"):
        kvkernels.PagedLayout.from_views([[flat.as_strided((3, 2, 1, 4), (4, 4, 4, 1))]])
    with pytest.raises(ValueError, match="memory of its own"):
        kvkernels.PagedLayout.from_strides([torch.zeros(64)], block_size=2, num_heads=1, head_dim=4, strides=(8, 4, 4),
                                           kv_offset=4, num_blocks=3)
    # V right after K's rows inside each block (packed), K|V split per token, layers interleaved
    # block-major: adjacent, never overlapping
    kvkernels.PagedLayout.from_strides([torch.zeros(64)], block_size=2, num_heads=1, head_dim=4, strides=(16, 4, 4),
                                       kv_offset=8, num_blocks=3)
    kvkernels.PagedLayout.from_views([[t[..., 0:2], t[..., 2:4]]])
    for name in ("cross-layer", "cross-layer-hnd", "vllm-packed-bhlnc", "mla-cross-layer", "sglang"):
        make_cache(name, num_layers=3, num_blocks=5, block_size=4, num_heads=2, head_dim=8)


def test_packed_per_layer_tensors_follow_the_order_given():
    L, B, N, H, D = 2, 4, 4, 2, 8
    phys = torch.randn(L, B, N, H, 2 * D)  # physical LBNHC
    one = kvkernels.PagedLayout.from_vllm_packed(phys, order="LBNHC")
    per = kvkernels.PagedLayout.from_vllm_packed([phys[l] for l in range(L)], order="LBNHC")
    assert (per.block_size, per.num_heads) == (one.block_size, one.num_heads) == (N, H)
    assert torch.equal(kvkernels.gather(one, [0, 1], backend="torch"), kvkernels.gather(per, [0, 1], backend="torch"))
    with pytest.raises(ValueError, match=r"5 dims for order"):  # too few dims: a clear error, not IndexError
        kvkernels.PagedLayout.from_tensor(torch.zeros(4, 2, 16), "LBNHC")


@pytest.mark.skipif(not kvkernels.backends.triton_available(DEVICE), reason="Triton")
def test_triton_staging_view_over_an_unaligned_storage_base():
    lay = make_cache("vllm-nhd", num_layers=2, num_blocks=6, block_size=2, num_heads=2, head_dim=8)
    ids = [3, -1, 0]
    ref = kvkernels.gather(lay, ids, backend="torch")
    n = ref.numel()
    ba = bytearray(n + 64)
    j = next(j for j in range(8) if (torch.frombuffer(ba, dtype=torch.uint8).data_ptr() + j) % 8 == 5)
    base = torch.frombuffer(memoryview(ba)[j:], dtype=torch.uint8)  # a storage that starts 5 bytes past 8
    s = (-base.data_ptr()) % 8
    out = base[s: s + n]  # an 8-aligned address, storage offset not a multiple of 8
    assert out.data_ptr() % 8 == 0 and out.storage_offset() % 8
    assert torch.equal(kvkernels.gather(lay, ids, out=out, backend="triton"), ref)


def test_small_input_checks_found_in_the_fourteenth_review(monkeypatch):
    # each of these was accepted silently or failed with a raw Python/torch error
    import numpy as np

    from kvkernels import ops
    from kvkernels.models import MODELS
    from kvkernels.quant import scatter_quant

    lay = make_cache("vllm-nhd", num_layers=2, num_blocks=8, block_size=4, num_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="`granularity`: expected 'token' or 'block', got 'bogus'"):
        kvkernels.gather(lay, [1], granularity="bogus")
    with pytest.raises(ValueError, match="`granularity`"):
        kvkernels.scatter(kvkernels.gather(lay, [1]), lay, [2], granularity="bogus")
    st = kvkernels.gather(lay, [1, 2], quant="fp8")
    with pytest.raises(ValueError, match="granularity='block'"):  # was overridden by the scheme
        scatter_quant(st, lay, [3, 4], scheme="fp8-token", granularity="block")
    with pytest.raises(TypeError, match="numpy"):  # said "expected a bool, got bool"
        kvkernels.gather(lay, [1], validate=np.bool_(True))
    with pytest.raises(ValueError, match="max_ctas"):  # wrapped through the C ABI's int64
        kvkernels.gather(lay, [1], max_ctas=2**63)
    monkeypatch.setenv("KVKERNELS_MAX_CTAS", "08")
    assert kvkernels.config.max_ctas() == 8
    monkeypatch.setenv("KVKERNELS_MAX_CTAS", "0x10")
    assert kvkernels.config.max_ctas() == 16
    monkeypatch.setenv("KVKERNELS_BACKEND", " torch ")
    assert kvkernels.config.backend() == "torch"
    with pytest.raises(ValueError, match="`device`"):  # the right type, naming no device
        kvkernels.check_errors("bogus")
    with pytest.raises(TypeError, match="`device`"):
        kvkernels.check_errors(2.5)
    with pytest.raises(TypeError, match="`layout`: expected a kvkernels.PagedLayout, got str"):
        kvkernels.staging_nbytes("x", 2)
    with pytest.raises(TypeError, match="`layout`"):
        ops.as_block_ids([1], "x")
    with pytest.raises(ValueError, match="`layout`: expected one of"):
        make_cache("vllm-packed-xyz", num_layers=1, num_blocks=2, block_size=2, num_heads=1, head_dim=4)
    with pytest.raises(ValueError, match="`num_blocks`"):
        make_cache("vllm-nhd", num_layers=1, num_blocks=-2, block_size=2, num_heads=1, head_dim=4)
    shape = MODELS["llama3-8b"]
    with pytest.raises(ValueError, match="`num_layers`"):  # 0 kept 32 layers
        shape.scaled(num_layers=0)
    assert shape.scaled(num_layers=2).num_layers == 2
    # the helpers still take numpy ints, and MLA ignores num_heads (None too)
    assert shape.scaled(num_layers=np.int64(3)).num_layers == 3
    assert make_cache("vllm-nhd", num_layers=np.int64(2), num_blocks=2, block_size=2, num_heads=1,
                      head_dim=4).num_layers == 2
    assert make_cache("mla", num_layers=1, num_blocks=2, block_size=2, num_heads=None, head_dim=8).num_kv == 1
    with pytest.raises(TypeError, match="`num_layers`: expected an int, got bool"):
        make_cache("vllm-nhd", num_layers=True, num_blocks=2, block_size=2, num_heads=1, head_dim=4)


def test_triton_launches_enter_the_caches_device(monkeypatch):
    # Triton launches on torch's current device: a cache on cuda:1 with cuda:0 current ran on the
    # wrong GPU and stream. Every Triton/quant launch now goes through ops.on_cache_device.
    import contextlib
    from types import SimpleNamespace

    from kvkernels import ops

    entered = []
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch.cuda, "device", lambda dev: (entered.append(dev), contextlib.nullcontext())[1])
    with ops.on_cache_device(SimpleNamespace(device=torch.device("cuda", 1), _memo={})):
        pass
    with ops.on_cache_device(SimpleNamespace(device=torch.device("cuda", 0), _memo={})):
        pass
    with ops.on_cache_device(SimpleNamespace(device=torch.device("cpu"), _memo={})):
        pass
    assert entered == [1]
    if "triton" not in BACKENDS or DEVICE.type != "cpu":
        return
    calls = []
    real = ops.on_cache_device
    monkeypatch.setattr(ops, "on_cache_device", lambda lay: (calls.append(lay), real(lay))[1])
    import kvkernels.quant as q

    monkeypatch.setattr(q, "on_cache_device", ops.on_cache_device)
    lay = make_cache("vllm-nhd", num_layers=1, num_blocks=4, block_size=2, num_heads=1, head_dim=8)
    st = kvkernels.gather(lay, [1], backend="triton")
    kvkernels.scatter(st, lay, [2], backend="triton")
    st = kvkernels.gather(lay, [1], backend="triton", quant="fp8")
    kvkernels.scatter(st, lay, [2], backend="triton", quant="fp8")
    assert calls == [lay] * 4


def test_persistent_grid_never_steps_past_int32():
    """The Triton kernels loop tl.range(program_id, count, num_programs) with an i32 counter when
    count < 2^31: the grid is capped so the last step cannot wrap negative (only past ~10^9 work
    items, 1-2 TB of staging in one call, but then it read before the id array)."""
    from kvkernels.triton_ops._paged import persistent_grid

    for count in (1, 5, 2**30, 2**30 + 1, 3 * 2**29, 2**31 - 2, 2**31 - 1):
        for cap in (0, 1, 132, 2**30, 2**31 - 1):
            (g,) = persistent_grid(count, cap)
            assert 1 <= g <= count and (cap == 0 or g <= cap)
            assert count - 1 + g <= 2**31 - 1  # the i32 loop's last w + num_programs does not wrap
    assert persistent_grid(5, 0) == (5,) and persistent_grid(5, 3) == (3,)  # unchanged below 2^30
    assert persistent_grid(2**31 + 5, 0) == (2**31 - 1,)  # i64 bound: only the grid limit



# ------------------------------------------------ found by mutation testing (thirty-second session)
@pytest.mark.parametrize("ids", [[0, 0, 1], [-1, 0, 0], [2, 0, 0]])
@pytest.mark.parametrize("backend", BACKENDS)
def test_scatter_refuses_block_zero_twice(backend, ids):
    """Duplicates of block 0 (the id a padded list's -1 filter sits next to) must be refused like
    any other: two slots writing one block race."""
    lay = cache("vllm-nhd")
    st = kvkernels.gather(lay, [3, 4, 5], backend="torch")
    before = all_bytes(lay)
    with pytest.raises(ValueError, match="block_ids"):
        kvkernels.scatter(st, lay, ids, backend=backend)
    assert all(torch.equal(x, y) for x, y in zip(before, all_bytes(lay)))


def test_padding_ids_are_not_counted_as_invalid_by_the_torch_backend():
    """-1 is padding: a validate=False gather with it must leave the invalid-id counter at 0."""
    lay = cache("vllm-nhd")
    kvkernels.check_errors(lay.device)  # (earlier tests' counts cleared)
    kvkernels.gather(lay, [-1, 2], backend="torch", validate=False)
    kvkernels.check_errors(lay.device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_layer_index_equal_to_the_layer_count_is_a_clear_error(backend):
    lay = cache("vllm-nhd")
    with pytest.raises(ValueError, match="layers"):
        kvkernels.gather(lay, [1, 2], layers=[0, lay.num_layers], backend=backend)
    st = kvkernels.gather(lay, [1, 2], backend="torch")
    with pytest.raises(ValueError, match="layers"):
        kvkernels.scatter(st, lay, [3, 4], layers=[lay.num_layers], backend=backend)


def test_the_cached_staging_format_follows_the_layers_asked_for():
    lay = cache("vllm-nhd")
    assert StagingFormat.for_layout(lay, 2).layers == tuple(range(lay.num_layers))
    assert StagingFormat.for_layout(lay, 2, 1).layers == (1,)
    assert StagingFormat.for_layout(lay, 2, (0, 1)).layers == (0, 1)
    assert kvkernels.staging_nbytes(lay, 2, layers=1) == StagingFormat.for_layout(lay, 2, 1).nbytes
