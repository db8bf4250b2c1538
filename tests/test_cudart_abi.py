"""The ctypes bindings of ``kvkernels._cudart`` against the CUDA runtime's real C declarations.

``LayerPipeline(copy_mode="dma")`` calls ``cudaMemcpyBatchAsync`` through ctypes: a wrong
argument list or struct layout would not fail loudly on a GPU, it would pass garbage to the
driver. Here a stand-in runtime is compiled with the host C compiler *against the toolkit's own
``cuda_runtime_api.h``* (the compiler refuses a definition whose signature differs from the
header's declaration; the struct's size and offsets are exported), so the binding is checked on
a CPU-only machine. Its copies are ``memcpy``: the pipeline's dma path runs through it end to end.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from kvtest import DEVICE

_SRC = r"""
#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

static int g_version = CUDART_VERSION, g_driver = CUDART_VERSION;
size_t fake_batches = 0, fake_last_count = 0;
uintptr_t fake_last_stream = 0;

void fake_set_version(int v) { g_version = v; }
void fake_set_driver(int v) { g_driver = v; }
size_t fake_attr_size(void) { return sizeof(struct cudaMemcpyAttributes); }
size_t fake_attr_offset(int i) {
  switch (i) {
    case 0: return offsetof(struct cudaMemcpyAttributes, srcAccessOrder);
    case 1: return offsetof(struct cudaMemcpyAttributes, srcLocHint);
    case 2: return offsetof(struct cudaMemcpyAttributes, dstLocHint);
    default: return offsetof(struct cudaMemcpyAttributes, flags);
  }
}

cudaError_t CUDARTAPI cudaRuntimeGetVersion(int *v) { *v = g_version; return cudaSuccess; }
cudaError_t CUDARTAPI cudaDriverGetVersion(int *v) { *v = g_driver; return cudaSuccess; }
cudaError_t CUDARTAPI cudaGetLastError(void) { return cudaSuccess; }
const char *CUDARTAPI cudaGetErrorString(cudaError_t e) { return e == cudaErrorInvalidValue ? "invalid argument" : "other"; }
cudaError_t CUDARTAPI cudaEventRecord(cudaEvent_t e, cudaStream_t s) { return cudaSuccess; }
cudaError_t CUDARTAPI cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int f) { return cudaSuccess; }
cudaError_t CUDARTAPI cudaMemcpyAsync(void *d, const void *s, size_t n, enum cudaMemcpyKind k, cudaStream_t st) {
  memcpy(d, s, n);
  return cudaSuccess;
}

/* the declaration in cuda_runtime_api.h decides this signature (a mismatch does not compile):
   CUDA 13 dropped 12.8/12.9's failIdx argument */
#if CUDART_VERSION >= 13000
cudaError_t CUDARTAPI cudaMemcpyBatchAsync(void *const *dsts, const void *const *srcs, const size_t *sizes,
                                           size_t count, struct cudaMemcpyAttributes *attrs, size_t *attrsIdxs,
                                           size_t numAttrs, cudaStream_t stream) {
#else
cudaError_t CUDARTAPI cudaMemcpyBatchAsync(void **dsts, void **srcs, size_t *sizes, size_t count,
                                           struct cudaMemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs,
                                           size_t *failIdx, cudaStream_t stream) {
  if (failIdx == NULL) return cudaErrorInvalidValue;
#endif
  /* what the pipeline promises: one attribute for all copies, sources in stream order, no hints,
     and never the legacy default stream (the real runtime rejects it) */
  if (numAttrs != 1 || attrsIdxs[0] != 0 || attrs[0].srcAccessOrder != cudaMemcpySrcAccessOrderStream ||
      attrs[0].flags != 0 || attrs[0].srcLocHint.type != 0 || attrs[0].dstLocHint.type != 0 || count == 0 ||
      stream == (cudaStream_t)0)
    return cudaErrorInvalidValue;
  for (size_t i = 0; i < count; ++i) memcpy(dsts[i], srcs[i], sizes[i]);
  fake_batches++;
  fake_last_count = count;
  fake_last_stream = (uintptr_t)stream;
  return cudaSuccess;
}
"""


def _cuda_include() -> str | None:
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    roots.append("/usr/local/cuda")
    for r in roots:
        if r and os.path.exists(os.path.join(r, "include", "cuda_runtime_api.h")):
            return os.path.join(r, "include")
    return None


@pytest.fixture(scope="module")
def fake_runtime(tmp_path_factory):
    inc, cc = _cuda_include(), shutil.which("cc") or shutil.which("gcc")
    if inc is None or cc is None:
        pytest.skip("needs the CUDA toolkit's headers and a C compiler")
    with open(os.path.join(inc, "cuda_runtime_api.h")) as f:
        if "cudaMemcpyBatchAsync" not in f.read():
            pytest.skip("this toolkit has no cudaMemcpyBatchAsync (CUDA < 12.8)")
    d = tmp_path_factory.mktemp("fake_cudart")
    src, lib = d / "fake_cudart.c", d / "libfake_cudart.so"
    src.write_text(_SRC)
    r = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", f"-I{inc}", str(src), "-o", str(lib)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr  # a signature that differs from the header's fails here
    return ctypes.CDLL(str(lib))


def test_attribute_struct_matches_the_header(fake_runtime):
    from kvkernels._cudart import MemcpyAttributes

    fake_runtime.fake_attr_size.restype = ctypes.c_size_t
    fake_runtime.fake_attr_offset.restype = ctypes.c_size_t
    assert ctypes.sizeof(MemcpyAttributes) == fake_runtime.fake_attr_size()
    names = ["srcAccessOrder", "srcLocHint", "dstLocHint", "flags"]
    assert [getattr(MemcpyAttributes, n).offset for n in names] == [fake_runtime.fake_attr_offset(i) for i in range(4)]


def test_batch_copies_through_the_headers_signature(fake_runtime):
    from kvkernels._cudart import Runtime

    rt = Runtime(fake_runtime, "fake")
    assert rt.version >= 12080 and rt._batch is not None, rt.batch_reason
    src = torch.arange(4096, dtype=torch.uint8)
    dst = torch.zeros(4096, dtype=torch.uint8)
    srcs = np.array([src.data_ptr() + 100, src.data_ptr() + 1000], dtype=np.int64)
    dsts = np.array([dst.data_ptr(), dst.data_ptr() + 2000], dtype=np.int64)
    sizes = np.array([50, 300], dtype=np.int64)
    rt.memcpy_batch(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, 2, 77)
    assert torch.equal(dst[:50], src[100:150]) and torch.equal(dst[2000:2300], src[1000:1300])
    assert dst[50:2000].sum() == 0 and dst[2300:].sum() == 0
    assert ctypes.c_size_t.in_dll(fake_runtime, "fake_last_stream").value == 77
    with pytest.raises(RuntimeError, match="cudaMemcpyBatchAsync of 2 copies failed: invalid argument"):
        rt.memcpy_batch(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, 2, 0)  # the legacy stream


def test_batch_is_refused_below_cuda_12_8(fake_runtime):
    from kvkernels._cudart import Runtime

    was = Runtime(fake_runtime, "fake").version
    fake_runtime.fake_set_version(12060)
    try:
        rt = Runtime(fake_runtime, "fake")
    finally:
        fake_runtime.fake_set_version(was)
    assert rt.version == 12060 and rt._batch is None and "12.8" in rt.batch_reason
    with pytest.raises(RuntimeError, match="12.8"):
        rt.memcpy_batch(0, 0, 0, 1, 1)
    # a new runtime on an older driver (CUDA minor-version compatibility): refused up front, not
    # at the first step's copy
    fake_runtime.fake_set_driver(12040)
    try:
        rt = Runtime(fake_runtime, "fake")
    finally:
        fake_runtime.fake_set_driver(was)
    assert rt.version == was and rt._batch is None and "driver" in rt.batch_reason


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the GPU runs the real runtime in test_pipeline's dma tests")
@pytest.mark.parametrize("layout", ["vllm-nhd", "mla"])
def test_pipeline_dma_path_through_the_compiled_runtime(fake_runtime, layout, monkeypatch):
    """The pipeline's GPU-side dma path (numpy address arrays handed to the runtime), on CPU
    memory through the compiled stand-in: one batch per layer and direction, bytes bit-exact."""
    from kvkernels import pipeline as pmod
    from kvkernels._cudart import Runtime
    from test_pipeline import L, cache, drain, run_step_loads, run_step_saves, snapshot, assert_blocks_hold

    monkeypatch.setattr(pmod._NullStream, "cuda_stream", 5, raising=False)
    lay = cache(layout)
    src, dst = [3, 4, 5, 9, 1], [20, 21, 22, 0, 2]
    expect = snapshot(lay, src)
    batches = ctypes.c_size_t.in_dll(fake_runtime, "fake_batches")
    with pmod.LayerPipeline(lay, host_bytes=1 << 20, copy_mode="dma") as pipe:
        pipe._batch_rt = Runtime(fake_runtime, "fake")
        before = batches.value
        run_step_saves(pipe, {"a": src})
        assert batches.value - before == L
        assert ctypes.c_size_t.in_dll(fake_runtime, "fake_last_count").value == lay.num_kv * 3  # [3,4,5] [9] [1]
        assert drain(pipe)[0] == {"a"}
        run_step_loads(pipe, {"a": dst})
        assert batches.value - before == 2 * L
        assert drain(pipe)[1] == {"a"}
    assert_blocks_hold(lay, dst, expect)
