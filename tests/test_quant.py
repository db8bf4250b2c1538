"""FP8 quantization and byte-plane shuffle (kvkernels.quant, triton_ops/{quant_gather,
dequant_scatter,shuffle_gather,unshuffle_scatter}.py).

Oracles: the rounding helpers against torch's own ``float8_e4m3fn`` cast (bit-exact); the reference
against staging bytes built slot by slot from the definition (docs/quant.md); every backend
against the reference, bit-exactly, in both directions; shuffle round trips bit-exact; FP8 round
trips within the tolerance table below.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

import kvkernels
from kvkernels import StagingFormat
from kvkernels.models import make_cache, random_fill_
from kvkernels.quant import (
    CANONICAL_NAN_BITS,
    QuantStagingFormat,
    dequantize_rows,
    fp8_codes,
    fp8_round_to_grid,
    gather_quant,
    quant_staging_nbytes,
    quantize_rows,
    scatter_quant,
)
from kvtest import BACKENDS, DEVICE, bytes_equal

FP8_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHUFFLE_DTYPES = [torch.bfloat16, torch.float16]
LAYOUTS = ["vllm-nhd", "vllm-hnd", "flashinfer-nhd", "mla", "sglang"]
GRANULARITIES = ["token", "block"]
HEAD_DIMS = [64, 128, 576]
BLOCK_SIZES = [1, 16]

L, NB, BS, H, D = 2, 8, 4, 2, 64
IDS = [5, -1, 2, 2, 7]  # unsorted, padding, duplicate (gather)
DST = [1, -1, 6, 0, 3]  # distinct destinations (scatter)

# Round-trip tolerance table: |x - dequant(quant(x))| <= REL * |x| + SUB * scale + OUT * |x_hat|.
#   REL = 2**-4: e4m3 keeps 3 mantissa bits; RNE error is at most half a step, 2**-4 of the binade's
#                lower bound, so <= 2**-4 * |x / s| for |x / s| >= 2**-6 (the normal range).
#   SUB = 2**-10: below 2**-6 the grid is uniform with step 2**-9 (in units of the scale): half a step.
#   OUT: the final RNE into the cache dtype, half an ulp: bf16 2**-8, fp16 2**-11, fp32 2**-24.
#   (x / s and code * s are IEEE fp32 operations: their 2**-24 relative errors are inside the slack
#   factor 1.001 applied below.)
# RMSE / RMS bounds on N(0, 1) data: measured 2.50-2.52% (token) and 2.67-2.70% (block: the block
# amax is larger, so more values sit in lower binades relative to it) for every dtype here (max error
# 3.6-3.8% of the row / tile amax). Field notes section 5 measured 2.2% RMSE on real SmolLM2 KV per
# (token, head). Bounds leave ~30% head room for other seeds.
TOL = {
    "REL": 2.0**-4,
    "SUB": 2.0**-10,
    "OUT": {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24},
    # half the cache dtype's smallest subnormal: the final rounding of a subnormal x_hat
    "TINY": {torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25, torch.float32: 2.0**-150},
    "RMSE": {"token": 0.032, "block": 0.035},
}


def cache(layout, *, dtype=torch.bfloat16, head_dim=D, block_size=BS, heads=H, blocks=NB, layers=L, fill="random", seed=0):
    return make_cache(
        layout, num_layers=layers, num_blocks=blocks, block_size=block_size, num_heads=heads,
        head_dim=head_dim, dtype=dtype, device=DEVICE, fill=fill, seed=seed,
    )


def normal_cache(layout, *, dtype=torch.bfloat16, seed=0, **kw):
    """A cache of N(0, 1) * 3 values (random *bytes* would be mostly NaN / huge for fp8 accuracy)."""
    lay = cache(layout, dtype=dtype, fill="zero", **kw)
    g = torch.Generator().manual_seed(seed)
    for row in lay.views:
        for v in row:
            v.copy_((torch.randn(v.shape, generator=g) * 3).to(dtype))
    return lay


def cache_bytes(lay):
    return [v.cpu().contiguous().view(-1).view(torch.uint8) for row in lay.views for v in row]


def same_cache(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(cache_bytes(a), cache_bytes(b)))


# ------------------------------------------------------------------------------ rounding helpers
def special_values() -> torch.Tensor:
    """Every e4m3 grid value, every midpoint (ties) and its fp32 neighbours, the saturation
    boundary, e4m3 and fp32 subnormals, signed zeros, inf, NaN."""
    grid = torch.arange(0, 127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (grid[:-1] + grid[1:]) / 2  # exact in fp32
    nb = lambda t, k: (t.view(torch.int32) + k).view(torch.float32)  # noqa: E731
    extra = torch.tensor(
        [448.0, 449.0, 463.99, 464.0, 464.01, 479.9, 480.0, 1e30, float("inf"), 2.0**-9, 2.0**-10,
         3 * 2.0**-10, 2.0**-11, 2.0**-6, 2.0**-6 - 2.0**-10, 1e-40, 1.4e-45, 0.0, float("nan")]
    )
    pos = torch.cat([grid, mids, nb(mids, 1), nb(mids, -1), extra])
    return torch.cat([pos, -pos])


def fp32_samples() -> torch.Tensor:
    """Special values + every fp32 whose low 16 bits are zero (all exponents, signs, NaN/inf) +
    random bit patterns."""
    hi = (torch.arange(0, 1 << 16, dtype=torch.int32) << 16).view(torch.float32)
    rnd = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), dtype=torch.int64, generator=torch.Generator().manual_seed(1))
    return torch.cat([special_values(), hi, rnd.to(torch.int32).view(torch.float32)])


def test_fp8_round_to_grid_is_torch_cast_bit_exact():
    x = fp32_samples()
    got = fp8_round_to_grid(x)
    exp = x.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    nan = torch.isnan(x)
    assert torch.equal(got[~nan].view(torch.int32), exp[~nan].view(torch.int32))  # signed zeros too
    assert bool(torch.isnan(got[nan]).all())


def test_fp8_codes_bytes_and_nan_policy():
    x = fp32_samples()
    codes = fp8_codes(x)
    exp = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    nan = torch.isnan(x)
    assert torch.equal(codes[~nan], exp[~nan])
    assert bool((codes[nan] == 0x7F).all())  # one NaN code whatever the sign
    got = fp8_codes(torch.tensor([-0.0, 0.0, float("inf"), -float("inf"), 1.0625, 1.1875, -1e-30]))
    assert got.tolist() == [0x80, 0x00, 0x7E, 0xFE, 0x38, 0x3A, 0x80]  # ties to even: 1.0, 1.25


def test_fp8_round_to_grid_rejects_other_dtypes():
    with pytest.raises(TypeError, match="`x`: expected dtype torch.float32"):
        fp8_round_to_grid(torch.zeros(3, dtype=torch.bfloat16))


def crafted_fp32_cache():
    """fp32 cache whose every (token, head) row has amax exactly 448 (scale exactly 1.0), so the
    kernel encodes the crafted values themselves: ties, saturation, subnormals, zeros, inf, NaN."""
    vals = special_values()
    vals = vals[torch.isfinite(vals) & (vals.abs() <= 448)]
    rows_needed = -(-vals.numel() // (D - 1))
    blocks = -(-rows_needed // (BS * H)) + 1
    lay = cache("vllm-nhd", dtype=torch.float32, blocks=blocks, layers=1, fill="zero")
    flat = torch.zeros(blocks * BS * H, D)
    flat[:, 0] = 448.0
    body = torch.zeros(blocks * BS * H * (D - 1))
    body[: vals.numel()] = vals
    flat[:, 1:] = body.view(-1, D - 1)
    flat[-1, 1:4] = torch.tensor([float("inf"), float("nan"), -float("inf")])  # non-finite row
    lay.views[0][0].copy_(flat.view(blocks, BS, H, D))
    lay.views[0][1].copy_(-flat.view(blocks, BS, H, D))
    return lay


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_codes_equal_torch_cast(backend):
    lay = crafted_fp32_cache()
    ids = list(range(lay.num_blocks))
    buf = gather_quant(lay, ids, quant="fp8", backend=backend).cpu()
    fmt = QuantStagingFormat.for_layout(lay, len(ids))
    for c in range(2):
        x = lay.views[0][c].reshape(-1, D).cpu()
        q = buf[fmt.q_offset(0, c) :][: fmt.q_nbytes].view(-1, D)
        s = buf[fmt.scale_offset(0, c) :][: fmt.scale_nbytes].view(torch.float32)
        assert bool((s == 1.0).all())
        exp = (x / 1.0).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        nan = torch.isnan(x)
        assert torch.equal(q[~nan], exp[~nan]), backend
        assert bool((q[nan] == 0x7F).all())


# -------------------------------------------------------------------------------------- format
def test_quant_format_worked_example():
    """The worked example of docs/quant.md: Llama-3-8B shape, 3 blocks, layers 1 and 3 of 4."""
    lay = cache("vllm-nhd", heads=8, head_dim=128, block_size=16, layers=4, blocks=4, fill="zero")
    fmt = QuantStagingFormat.for_layout(lay, 3, layers=[3, 1])
    assert fmt.layers == (1, 3)
    assert (fmt.q_nbytes, fmt.q_entry_nbytes, fmt.scale_nbytes, fmt.scale_entry_nbytes) == (49152, 49152, 1536, 1536)
    assert (fmt.payload_nbytes, fmt.region_nbytes, fmt.nbytes) == (101376, 102400, 204800)
    assert [fmt.q_offset(3, 0), fmt.q_offset(3, 1), fmt.scale_offset(3, 0), fmt.scale_offset(3, 1)] == [
        102400, 151552, 200704, 202240]
    blk = QuantStagingFormat.for_layout(lay, 3, layers=[3, 1], granularity="block")
    assert (blk.scale_nbytes, blk.payload_nbytes, blk.region_nbytes) == (96, 98496, 102400)
    raw = StagingFormat.for_layout(lay, 3, layers=[3, 1])
    assert raw.region_nbytes == 196608  # fp8 is 0.52x of bf16 here
    assert quant_staging_nbytes(lay, 3, [1, 3], quant="fp8") == 204800
    assert quant_staging_nbytes(lay, 3, [1, 3], shuffle=True) == raw.nbytes
    for q in ("fp8", None):  # a non-layout is a TypeError naming it (fp8 raised AttributeError)
        with pytest.raises(TypeError, match="`layout`: expected a kvkernels.PagedLayout"):
            quant_staging_nbytes(None, 3, quant=q)
    # element-level positions of the docs: (slot 1 = block 2, token 5, head 2, dim 7) of layer 3's V
    lay.views[3][1][2, 5, 2, 7] = torch.tensor(0x4123, dtype=torch.int16).view(torch.bfloat16)
    buf = gather_quant(lay, [0, 2, 1], quant="fp8", layers=[3, 1])
    assert buf[173319].item() == 0x7E  # the row's amax: code 448
    assert torch.equal(buf[202920:202924].view(torch.float32), lay.views[3][1][2, 5, 2, 7:8].float() / 448)
    shuf = gather_quant(lay, [0, 2, 1], shuffle=True, layers=[1, 3])
    assert (shuf[316679].item(), shuf[365831].item()) == (0x41, 0x23)


def test_quant_format_sections_are_16_aligned():
    lay = cache("mla", head_dim=5, block_size=3, heads=1, fill="zero")  # odd sizes everywhere
    fmt = QuantStagingFormat.for_layout(lay, 3)
    assert fmt.q_nbytes == 45 and fmt.q_entry_nbytes == 48 and fmt.scale_offset(0, 0) == 48
    assert fmt.gaps() == [(45, 48), (48 + 36, 48 + 48), (96, 4096)]


def expected_fp8_staging(lay, ids, granularity="token", layers=None) -> torch.Tensor:
    """FP8 staging bytes built slot by slot from the definition (docs/quant.md)."""
    fmt = QuantStagingFormat.for_layout(lay, len(ids), layers, granularity)
    out = torch.zeros(fmt.nbytes, dtype=torch.uint8)
    rows, sp = fmt.rows_per_block * fmt.head_dim, fmt.scales_per_block * 4
    for layer in fmt.layers:
        for c in range(lay.num_kv):
            for i, b in enumerate(ids):
                if b == -1:
                    continue
                x = lay.views[layer][c][b].cpu().float()  # [bs, H, D]
                a = torch.where(torch.isfinite(x), x.abs(), 0.0).amax(-1, keepdim=True)
                if granularity == "block":
                    a = a.amax(0, keepdim=True)
                s = a / 448
                s = torch.where(s > 0, s, 1.0)
                y = x / s
                q = torch.where(torch.isnan(y), float("nan"), y).clamp(-448, 448).to(torch.float8_e4m3fn)
                qo, so = fmt.q_offset(layer, c) + i * rows, fmt.scale_offset(layer, c) + i * sp
                out[qo : qo + rows] = q.view(torch.uint8).reshape(-1)
                out[so : so + sp] = s.reshape(-1).contiguous().view(torch.uint8)
    return out


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("layout", ["vllm-hnd", "mla"])
def test_reference_fp8_matches_definition(layout, granularity):
    lay = cache(layout, dtype=torch.bfloat16)  # random bytes: NaN, inf, huge, subnormal values
    out = gather_quant(lay, IDS, quant="fp8", granularity=granularity, backend="torch")
    assert torch.equal(out.cpu(), expected_fp8_staging(lay, IDS, granularity))
    sub = gather_quant(lay, IDS, quant="fp8", granularity=granularity, layers=[1], backend="torch")
    assert torch.equal(sub.cpu(), expected_fp8_staging(lay, IDS, granularity, layers=[1]))


SLOTS = {"padded": (IDS, DST), "valid": ([5, 2, 2, 7], [1, 6, 0, 3]), "one": ([5], [3])}


@pytest.mark.parametrize("slots", sorted(SLOTS))
@pytest.mark.parametrize("layout", ["vllm-nhd", "cross-layer", "vllm-packed-lbnhc"])  # the last two stack layers
@pytest.mark.parametrize("slice_elems", [1, 1 << 20])  # one block per set of ops / the default (layers grouped)
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cpu_fast_paths_match_definitions(monkeypatch, dtype, granularity, slice_elems, layout, slots):
    """On CPU the torch backend quantizes in place on cache-sized slices (several layers at once
    when one strided view covers them) and sends non-finite rows to the definition: same bytes as
    the slot-by-slot definition, both directions, and the fp32 cache it reads is left untouched."""
    from kvkernels import quant

    monkeypatch.setattr(quant, "_CPU_SLICE_ELEMS", slice_elems)
    ids, dst_ids = SLOTS[slots]
    lay = normal_cache(layout, dtype=dtype)
    k = lay.views[0][0]
    k[5, 0].zero_()  # zero rule
    k[5, 1].fill_(1e-40 if dtype == torch.float32 else 1e-38)  # subnormal / tiny amax
    k[2, 2, 1, 3] = float("inf")  # definition path for that row (or tile)
    lay.views[1][1][7, 3, 0, 0] = float("nan")
    before = [b.clone() for b in cache_bytes(lay)]  # cache_bytes may alias the cache on CPU
    out = gather_quant(lay, ids, quant="fp8", granularity=granularity, backend="torch").cpu()
    assert all(torch.equal(x, y) for x, y in zip(before, cache_bytes(lay)))
    assert torch.equal(out, expected_fp8_staging(lay, ids, granularity))
    fmt = QuantStagingFormat.for_layout(lay, len(ids), granularity=granularity)
    out[fmt.scale_offset(1, 1) : fmt.scale_offset(1, 1) + 4] = torch.tensor([1e38]).view(torch.uint8)  # 256 * s = inf
    dst = cache(layout, dtype=dtype, fill="zero")
    scatter_quant(out, dst, dst_ids, quant="fp8", granularity=granularity, backend="torch")
    n = len(ids)
    sshape = (n, BS, H) if granularity == "token" else (n, H)
    for layer in range(L):
        for c in range(2):
            qo, so = fmt.q_offset(layer, c), fmt.scale_offset(layer, c)
            q = out[qo : qo + fmt.q_nbytes].view(n, BS, H, D)
            s = out[so : so + fmt.scale_nbytes].view(torch.float32).view(sshape)
            want = dequantize_rows(q, s, dtype, granularity)
            for i, b in enumerate(dst_ids):
                if b >= 0:
                    assert bytes_equal(dst.views[layer][c][b].cpu(), want[i]), (layer, c, i)
    untouched = [b for b in range(NB) if b not in dst_ids]
    assert all(not dst.views[l][c][b].any() for l in range(L) for c in range(2) for b in untouched)


@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=str)
def test_cpu_dequantize_decode_is_the_definition(dtype):
    """Every code (NaN codes included) times scales from fp32 subnormals to the overflow edge."""
    from kvkernels.quant import _dequantize_rows_cpu

    tiny = torch.finfo(torch.float32).tiny
    scales = torch.tensor([1.0, 3.0 / 448, 1e-3, tiny, tiny / 1024, 2.0**-149, 1e30, 1.3e36, 3e38, 0.0, -2.5])
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for with_nan in (False, True):
        q = codes if with_nan else codes[(codes & 0x7F) != 0x7F]
        q = q.view(1, 1, 1, -1).expand(1, len(scales), 1, -1).contiguous()
        s = scales.view(1, -1, 1)
        assert bytes_equal(_dequantize_rows_cpu(q, s, dtype, "token"), dequantize_rows(q, s, dtype, "token"))
        sb = scales[:1].view(1, 1)
        assert bytes_equal(_dequantize_rows_cpu(q, sb, dtype, "block"), dequantize_rows(q, sb, dtype, "block"))


def test_reference_shuffle_is_planes_of_raw_staging():
    lay = cache("flashinfer-nhd", dtype=torch.float16)
    raw = kvkernels.gather(lay, IDS, backend="torch").cpu()
    shuf = gather_quant(lay, IDS, shuffle=True, backend="torch").cpu()
    fmt = StagingFormat.for_layout(lay, len(IDS))
    assert shuf.numel() == raw.numel()
    half = fmt.entry_nbytes // 2
    for layer in fmt.layers:
        for c in range(2):
            off = fmt.entry_offset(layer, c)
            pairs = raw[off : off + fmt.entry_nbytes].view(-1, 2)
            assert torch.equal(shuf[off : off + half], pairs[:, 1])  # high bytes first
            assert torch.equal(shuf[off + half : off + 2 * half], pairs[:, 0])


# ------------------------------------------------------------- backends vs reference, bit-exact
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_triton_matches_reference(layout, dtype, granularity):
    lay = cache(layout, dtype=dtype)  # random bytes: every special value class appears
    ids = torch.tensor(IDS, device=DEVICE)
    ref = gather_quant(lay, ids, quant="fp8", granularity=granularity, backend="torch")
    tri = gather_quant(lay, ids, quant="fp8", granularity=granularity, backend="triton")
    assert torch.equal(ref, tri)
    outs = []
    for backend in BACKENDS:
        dst = cache(layout, dtype=dtype, seed=1)
        scatter_quant(ref, dst, DST, quant="fp8", granularity=granularity, backend=backend)
        outs.append(dst)
    assert same_cache(outs[0], outs[1])
    untouched = cache(layout, dtype=dtype, seed=1)  # the -1 slot and other blocks are not written
    for c in range(lay.num_kv):
        for b in (2, 4, 5, 7):
            assert bytes_equal(outs[1].views[1][c][b], untouched.views[1][c][b])


@pytest.mark.parametrize("dtype", SHUFFLE_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shuffle_triton_matches_reference_and_round_trips(layout, dtype):
    lay = cache(layout, dtype=dtype)
    ref = gather_quant(lay, IDS, shuffle=True, backend="torch")
    tri = gather_quant(lay, IDS, shuffle=True, backend="triton")
    assert torch.equal(ref, tri)
    dsts = []
    for backend in BACKENDS:
        dst = cache(layout, dtype=dtype, seed=1)
        scatter_quant(tri, dst, DST, shuffle=True, backend=backend)
        dsts.append(dst)
    assert same_cache(dsts[0], dsts[1])
    for c in range(lay.num_kv):  # bit-exact round trip (NaN payloads included)
        for i, (s, d) in enumerate(zip(IDS, DST)):
            if s >= 0 and d >= 0:
                assert bytes_equal(dsts[1].views[0][c][d], lay.views[0][c][s]), (c, i)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("layout", ["vllm-nhd", "mla"])
def test_head_dims_block_sizes(layout, head_dim, block_size):
    kw = dict(head_dim=head_dim, block_size=block_size, blocks=4, layers=1)
    lay = cache(layout, **kw)
    ids = [3, -1, 0]
    for mode in (dict(quant="fp8"), dict(quant="fp8", granularity="block"), dict(shuffle=True)):
        ref = gather_quant(lay, ids, backend="torch", **mode)
        assert torch.equal(ref, gather_quant(lay, ids, backend="triton", **mode)), mode
        a, b = cache(layout, seed=2, **kw), cache(layout, seed=2, **kw)
        scatter_quant(ref, a, [1, -1, 2], backend="torch", **mode)
        scatter_quant(ref, b, [1, -1, 2], backend="triton", **mode)
        assert same_cache(a, b), mode


def strided_layouts(dtype, seed=0):
    """A view into a larger allocation (odd base offset, padded head stride) and a K-only view."""
    big = torch.zeros(2, NB + 5, BS, H, D + 24, dtype=dtype)
    random_fill_(big, torch.Generator().manual_seed(seed))
    sliced = kvkernels.PagedLayout.from_vllm([big.to(DEVICE)[:, 3 : NB + 3, :, :, 8 : 8 + D]])
    k_only = kvkernels.PagedLayout.from_views([[row[0]] for row in cache("vllm-hnd", dtype=dtype, seed=seed).views])
    return sliced, k_only


@pytest.mark.parametrize("dtype", SHUFFLE_DTYPES, ids=str)
def test_strided_views(dtype):
    for lay in strided_layouts(dtype):
        for mode in (dict(quant="fp8"), dict(shuffle=True)):
            ref = gather_quant(lay, IDS, backend="torch", **mode)
            assert torch.equal(ref, gather_quant(lay, IDS, backend="triton", **mode)), mode
            dsts = []
            for backend in BACKENDS:
                dst = strided_layouts(dtype)[0 if lay.num_layers == 1 and lay.num_kv == 2 else 1]
                scatter_quant(ref, dst, DST, backend=backend, **mode)
                dsts.append(dst)
            assert all(same_cache(dsts[0], d) for d in dsts[1:]), mode


@pytest.mark.parametrize("max_ctas", [1, 3])
def test_sm_cap_gives_same_bytes(max_ctas):
    lay = cache("flashinfer-nhd")
    for mode in (dict(quant="fp8"), dict(shuffle=True)):
        ref = gather_quant(lay, IDS, backend="torch", **mode)
        assert torch.equal(ref, gather_quant(lay, IDS, backend="triton", max_ctas=max_ctas, **mode))


# ---------------------------------------------------------------------------------- semantics
@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_gaps_and_tail_are_zero_and_out_is_reused(backend):
    lay = cache("mla", head_dim=576, block_size=1, fill="random")
    fmt = QuantStagingFormat.for_layout(lay, 3)
    out = torch.full((fmt.nbytes + 64,), 0xAB, dtype=torch.uint8, device=DEVICE)
    ret = gather_quant(lay, [1, -1, 3], quant="fp8", out=out, backend=backend)
    assert ret is out
    assert bool((out[fmt.nbytes :] == 0xAB).all())  # bytes past the staging are untouched
    for layer in fmt.layers:
        q = out[fmt.q_offset(layer, 0) + 576 : fmt.q_offset(layer, 0) + 2 * 576]
        s = out[fmt.scale_offset(layer, 0) + 4 : fmt.scale_offset(layer, 0) + 8]
        assert int(q.count_nonzero()) == 0 and int(s.count_nonzero()) == 0  # the -1 slot
        base = fmt.region_offset(layer)
        for a, b in fmt.gaps():
            assert int(out[base + a : base + b].count_nonzero()) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_rows_round_trip_exactly_with_scale_one(backend):
    lay = cache("vllm-nhd", dtype=torch.bfloat16, fill="zero")
    lay.views[0][0][2, 1].fill_(-0.0)  # a row of negative zeros keeps its signs
    buf = gather_quant(lay, [2], quant="fp8", backend=backend)
    fmt = QuantStagingFormat.for_layout(lay, 1)
    s = buf[fmt.scale_offset(0, 0) :][: fmt.scale_nbytes].view(torch.float32)
    assert bool((s == 1.0).all())
    dst = cache("vllm-nhd", dtype=torch.bfloat16, seed=3)
    scatter_quant(buf, dst, [5], quant="fp8", backend=backend)
    for c in range(2):
        assert bytes_equal(dst.views[0][c][5], lay.views[0][c][2])


@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_inf_saturates_and_nan_is_canonical(backend, dtype):
    lay = normal_cache("vllm-nhd", dtype=dtype, blocks=2, layers=1)
    row = lay.views[0][0][0, 0, 0]
    row[:3] = torch.tensor([float("inf"), float("nan"), -float("inf")], dtype=dtype)
    amax = torch.where(torch.isfinite(row.float()), row.float().abs(), 0).max()
    dst = cache("vllm-nhd", dtype=dtype, blocks=2, layers=1, fill="zero")
    scatter_quant(gather_quant(lay, [0], quant="fp8", backend=backend), dst, [1], quant="fp8", backend=backend)
    got = dst.views[0][0][1, 0, 0]
    s = amax / 448
    assert got[0].float().item() == pytest.approx((448 * s).item(), rel=TOL["OUT"][dtype])
    assert got[2].float().item() == pytest.approx((-448 * s).item(), rel=TOL["OUT"][dtype])
    ity = torch.int32 if dtype == torch.float32 else torch.int16
    assert got[1:2].view(ity).item() == CANONICAL_NAN_BITS[dtype]


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=str)
def test_fp8_round_trip_error_within_tolerance(dtype, granularity):
    lay = normal_cache("vllm-hnd", dtype=dtype, blocks=6, block_size=16, heads=2)
    ids = [4, 0, 5]
    buf = gather_quant(lay, ids, quant="fp8", granularity=granularity, backend="triton")
    dst = cache("vllm-hnd", dtype=dtype, blocks=6, block_size=16, heads=2, fill="zero")
    scatter_quant(buf, dst, [1, 2, 3], quant="fp8", granularity=granularity, backend="triton")
    fmt = QuantStagingFormat.for_layout(lay, 3, granularity=granularity)
    for c in range(2):
        x = lay.views[0][c][ids].float()
        xh = dst.views[0][c][[1, 2, 3]].float()
        s = buf[fmt.scale_offset(0, c) :][: fmt.scale_nbytes].view(torch.float32)
        s = s.view(3, 16, 2, 1) if granularity == "token" else s.view(3, 1, 2, 1)
        assert bool(((x - xh).abs() <= _bound(x, xh, s, dtype)).all())
        rmse = ((x - xh).pow(2).mean().sqrt() / x.pow(2).mean().sqrt()).item()
        assert rmse <= TOL["RMSE"][granularity], rmse


def _bound(x, xh, s, dtype):
    """docs/quant.md's round-trip tolerance (fp32 values of x, x_hat and their scales)."""
    return (TOL["REL"] * x.abs() + TOL["SUB"] * s + TOL["OUT"][dtype] * xh.abs() + TOL["TINY"][dtype]) * 1.001


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_fp8_round_trip_bound_holds_for_fp16_subnormal_rows(granularity):
    """An fp16 row of subnormals (|x| < 2^-14) has a normal fp32 scale, but its x_hat rounds to
    fp16's subnormal grid: absolute error up to 2^-25, more than u * |x_hat| (the TINY term)."""
    dtype = torch.float16
    lay = cache("vllm-hnd", dtype=dtype, blocks=4, block_size=16, heads=2, fill="zero")
    g = torch.Generator().manual_seed(3)
    for row in lay.views:
        for v in row:
            v.copy_((torch.randn(v.shape, generator=g) * 2.0**-20).to(dtype))
    ids = [3, 0]
    buf = gather_quant(lay, ids, quant="fp8", granularity=granularity, backend="torch")
    dst = cache("vllm-hnd", dtype=dtype, blocks=4, block_size=16, heads=2, fill="zero")
    scatter_quant(buf, dst, [1, 2], quant="fp8", granularity=granularity, backend="torch")
    fmt = QuantStagingFormat.for_layout(lay, 2, granularity=granularity)
    worst = 0.0
    for c in range(2):
        x = lay.views[0][c][ids].float()
        xh = dst.views[0][c][[1, 2]].float()
        s = buf[fmt.scale_offset(0, c) :][: fmt.scale_nbytes].view(torch.float32)
        s = s.view(2, 16, 2, 1) if granularity == "token" else s.view(2, 1, 2, 1)
        assert bool((s > 2.0**-126).all())  # normal fp32 scales: the case the bound covers
        assert bool(((x - xh).abs() <= _bound(x, xh, s, dtype)).all())
        without = (TOL["REL"] * x.abs() + TOL["SUB"] * s + TOL["OUT"][dtype] * xh.abs()) * 1.001
        worst = max(worst, float(((x - xh).abs() / without).max()))
    assert worst > 1.0  # the term is needed: without it these rows break the bound


def test_quantize_rows_and_dequantize_rows_are_inverse_on_grid_values():
    q = torch.arange(0, 256, dtype=torch.int32).to(torch.uint8)
    q = q[(q & 0x7F) != 0x7F].view(1, 1, 2, -1)  # every non-NaN code (127 x 2), one row per sign
    x = dequantize_rows(q, torch.ones(1, 1, 2), torch.float32)
    q2, s = quantize_rows(x * 1.0)
    assert bool((s == 1.0).all()) and torch.equal(q2, q)  # amax 448 per row: scale exactly 1


def test_validate_false_counts_invalid_ids_as_padding():
    lay = cache("vllm-nhd")
    kvkernels.check_errors()
    for backend in BACKENDS:
        ref = gather_quant(lay, [1, -1, 2], quant="fp8", backend="torch")
        got = gather_quant(lay, [1, 999, 2], quant="fp8", backend=backend, validate=False)
        assert torch.equal(ref, got)
        with pytest.raises(ValueError, match=r"`block_ids`: 1 id\(s\) .*validate=False"):  # once, all layers
            kvkernels.check_errors()


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_ids(backend):
    lay = cache("vllm-nhd")
    for mode in (dict(quant="fp8"), dict(shuffle=True)):
        buf = gather_quant(lay, [], backend=backend, **mode)
        assert buf.numel() == 0 and buf.dtype == torch.uint8 and buf.device == lay.device
        scatter_quant(buf, lay, [], backend=backend, **mode)  # a no-op, no error


def test_quant_none_is_the_plain_gather_scatter():
    lay = cache("vllm-hnd")
    out = gather_quant(lay, IDS)
    assert torch.equal(out, kvkernels.gather(lay, IDS))
    dst = cache("vllm-hnd", seed=1)
    scatter_quant(out, dst, DST)
    assert bytes_equal(dst.views[1][1][6], lay.views[1][1][2])


# ----------------------------------------------------------------------------------- errors
def test_errors():
    bf = cache("vllm-nhd")
    f32 = cache("vllm-nhd", dtype=torch.float32)
    f8 = cache("vllm-nhd", dtype=torch.float8_e4m3fn)
    mla_u8 = cache("mla", dtype=torch.uint8)
    with pytest.raises(ValueError, match="`shuffle`: expected a cache with a 16-bit dtype"):
        gather_quant(f32, [0], shuffle=True)
    with pytest.raises(ValueError, match="`shuffle`: expected a cache with a 16-bit dtype"):
        scatter_quant(torch.zeros(1 << 20, dtype=torch.uint8), f32, [0], shuffle=True)
    for lay in (f8, mla_u8):
        with pytest.raises(ValueError, match="`quant`: .*pass through raw"):
            gather_quant(lay, [0], quant="fp8")
    with pytest.raises(ValueError, match="`quant`: expected a bfloat16, float16 or float32 cache"):
        gather_quant(cache("vllm-nhd", dtype=torch.int16), [0], quant="fp8")
    with pytest.raises(ValueError, match="`quant`: expected None or 'fp8'"):
        gather_quant(bf, [0], quant="int8")
    with pytest.raises(ValueError, match="`shuffle`: expected False with quant='fp8'"):
        gather_quant(bf, [0], quant="fp8", shuffle=True)
    with pytest.raises(TypeError, match="`shuffle`: expected a bool"):
        gather_quant(bf, [0], shuffle=1)
    with pytest.raises(ValueError, match="`granularity`: expected 'token' or 'block'"):
        gather_quant(bf, [0], quant="fp8", granularity="head")
    need = quant_staging_nbytes(bf, 2, quant="fp8")
    with pytest.raises(ValueError, match=f"`out`: expected at least {need} bytes"):
        gather_quant(bf, [0, 1], quant="fp8", out=torch.empty(need - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="`out`: expected a 16-byte aligned buffer"):
        gather_quant(bf, [0, 1], quant="fp8", out=torch.empty(need + 16, dtype=torch.uint8)[1:])
    with pytest.raises(ValueError, match="`staging`: expected at least"):
        scatter_quant(torch.empty(10, dtype=torch.uint8), bf, [0], quant="fp8")
    with pytest.raises(TypeError, match="`staging`: expected dtype torch.uint8"):
        scatter_quant(torch.empty(need, dtype=torch.float32), bf, [0], quant="fp8")
    good = gather_quant(bf, [0, 1], quant="fp8")
    before = [b.clone() for b in cache_bytes(bf)]  # cache_bytes aliases the cache on CPU
    with pytest.raises(ValueError, match="`block_ids`: expected distinct destination ids"):
        scatter_quant(good, bf, [3, 3], quant="fp8")
    with pytest.raises(ValueError, match=r"`block_ids`: expected ids in \[0, 8\) or -1"):
        scatter_quant(good, bf, [3, 8], quant="fp8")
    with pytest.raises(ValueError, match=r"`block_ids`: expected ids in \[0, 8\) or -1"):
        gather_quant(bf, [-2], shuffle=True)
    with pytest.raises(ValueError, match="`layers`: expected layer indices"):
        gather_quant(bf, [0], quant="fp8", layers=[5])
    assert all(torch.equal(a, b) for a, b in zip(before, cache_bytes(bf)))  # nothing was written



@pytest.mark.parametrize("fn", ["gather_fp8", "scatter_fp8", "gather_shuffle", "scatter_shuffle"])
@pytest.mark.parametrize("case", ["short-buffer", "other-shape", "ids-count", "not-a-format"])
def test_exported_references_refuse_bad_arguments_before_moving_a_byte(fn, case):
    """kvkernels.quant exports its torch references. They checked nothing: their views are strided
    into the buffer's storage, so a short ``out`` slice was written past its end (into its parent)
    and a short ``staging`` slice read past its end; a format of another shape was broadcast."""
    from kvkernels import quant

    fp8 = fn.endswith("fp8")
    lay = cache("vllm-nhd", seed=3)
    ids = torch.tensor([1, 2], device=DEVICE)
    fmt = QuantStagingFormat.for_layout(lay, 2) if fp8 else StagingFormat.for_layout(lay, 2)
    parent = gather_quant(lay, ids, quant="fp8") if fp8 else gather_quant(lay, ids, shuffle=True)
    buf, exc = parent, ValueError
    if case == "short-buffer":
        buf = parent[:16]  # the rest of the parent is a valid staging: reading it would "work"
    elif case == "other-shape":
        fmt = dataclasses.replace(fmt, head_dim=1)
    elif case == "ids-count":
        ids = torch.tensor([1, 2, 3], device=DEVICE)
    else:
        fmt, exc = (StagingFormat.for_layout(lay, 2) if fp8 else object()), TypeError
    dst = cache("vllm-nhd", fill="zero")
    keep = parent.clone()
    with pytest.raises(exc):
        if fn.startswith("gather"):
            getattr(quant, fn)(lay, ids, fmt, buf)
        else:
            getattr(quant, fn)(buf, dst, ids, fmt)
    assert torch.equal(parent, keep)  # nothing written into (or past) the buffer
    assert not any(b.any() for b in cache_bytes(dst))  # nothing restored


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kw", [{"quant": "fp8"}, {"shuffle": True}])
def test_scatter_into_a_cache_made_under_inference_mode(backend, kw):
    """Serving code allocates its caches under ``torch.inference_mode()``. The torch FP8 scatter
    wrote them in their dtype, which torch refuses outside that mode, where every other backend
    and scheme (byte views, kernels) restores them."""
    src = cache("vllm-nhd", seed=4)
    with torch.inference_mode():
        dst = cache("vllm-nhd", fill="zero")
    st = gather_quant(src, [1, 2, 5], **kw)
    scatter_quant(st, dst, [0, 3, 7], backend=backend, **kw)
    ref = cache("vllm-nhd", fill="zero")
    scatter_quant(st, ref, [0, 3, 7], backend=backend, **kw)
    assert all(torch.equal(a, b) for a, b in zip(cache_bytes(dst), cache_bytes(ref)))
    assert any(b.any() for b in cache_bytes(dst))

# ------------------------------------------------------------------------- GPU compile (no GPU)
COMPILE_PROBE = r"""
import json, re, sys
from kvkernels.bench.bench_resources import compile_triton_variants
ks = compile_triton_variants(sys.argv[1] == "align16", which=tuple(sys.argv[2].split(",")))
print(json.dumps({name: {"insns": sorted(set(re.findall(r"(?:ld|st|div|cvt|fma)\.[\w.]*", k.asm["ptx"]))),
                         "ndiv": k.asm["ptx"].count("div.rn.f32"), "shared": k.metadata.shared}
                  for name, k in ks.items()}))
"""


def _compile_probe(align: str, which: str) -> dict:
    """``{kernel: {"insns", "ndiv", "shared"}}`` of ``compile_triton_variants(align, which)`` for
    sm_90, compiled in a child process without ``TRITON_INTERPRET`` (no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", COMPILE_PROBE, align, which], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_split_d_probe_compiles_for_sm90():
    """The FP8 gather's split-D probe (MLA's 576-wide rows as a 512 tile plus a 64 tile; correct
    under the interpreter in the tests above only when selected, so checked here for the GPU
    compiler): sm_90 PTX with the e4m3 conversion, the FMA quotient, few divisions and 16-byte loads."""
    ks = _compile_probe("align16", "quant_split")
    assert len(ks) == 2
    for name, k in ks.items():
        assert {"cvt.rn.satfinite.e4m3x2.f32", "fma.rn.f32", "ld.global.v4.b32"} <= set(k["insns"]), (name, k)
        assert k["ndiv"] <= 4, (name, k["ndiv"])


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_split_d_probe_gives_the_same_bytes(granularity, dtype):
    """A head dim that is not a power of two as a power-of-two tile plus a tail tile (the
    default) and as one padded tile (bench/fp8_tuning.py's ``split_d=False``) both write the
    reference's bytes: MLA 576, 80, 96."""
    from kvkernels.triton_ops.quant_gather import quant_gather_triton

    if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel on CPU needs TRITON_INTERPRET=1")
    for kind, h, d in (("mla", 1, 576), ("vllm-nhd", 2, 80), ("vllm-hnd", 3, 96)):
        lay = cache(kind, dtype=dtype, head_dim=d, heads=h, block_size=4, blocks=8, layers=2, seed=3)  # random bytes
        ids = torch.tensor([3, -1, 5, 0], device=DEVICE)
        fmt = QuantStagingFormat.for_layout(lay, 4, granularity=granularity)
        ref = gather_quant(lay, ids, quant="fp8", granularity=granularity, backend="torch")
        for split in (True, False):
            out = torch.zeros(fmt.nbytes, dtype=torch.uint8, device=DEVICE)
            quant_gather_triton(lay, ids, fmt, out, torch.zeros(1, dtype=torch.int32, device=DEVICE),
                                _probe={"split_d": split})
            assert torch.equal(out, ref[: fmt.nbytes]), (kind, d, split)


# the twelfth session's variants of the Triton FP8 gather (bench/fp8_tuning.py; docs/PERF_NOTES.md,
# "Triton FP8 gather: what the static SASS says"): groups of work items per program step, the split
# tiles kept in their load layouts, the quotient with one instruction less (GPU only: FMA_DIV=2)
FP8_PROBES = [{"items": 3}, {"items": 4}, {"tail_fix": 2}, {"items": 4, "tail_fix": 2}]


@pytest.mark.parametrize("probe", FP8_PROBES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_fp8_gather_variants_give_the_same_bytes(probe, granularity):
    """Each variant writes the reference's bytes and counts the same invalid ids, including the
    last, partial group of items (its stores masked) and padding / invalid ids inside a group: a
    4 KB-chunk-like cache (one head), MLA's 576 (split tiles), two heads of 80 (HND). On the GPU
    the same with the FMA quotient and its one-instruction-shorter form (FMA_DIV=2)."""
    from kvkernels.triton_ops.quant_gather import quant_gather_triton

    if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel on CPU needs TRITON_INTERPRET=1")
    fmas = [False] if DEVICE.type == "cpu" else [True, 2]  # the interpreter's FMA rounds twice
    for kind, h, d in (("vllm-nhd", 1, 128), ("mla", 1, 576), ("vllm-hnd", 2, 80)):
        lay = cache(kind, dtype=torch.bfloat16, head_dim=d, heads=h, block_size=4, blocks=9, layers=2, seed=5)
        ids = torch.tensor([3, -1, 5, 0, 8, 12, 2], device=DEVICE)  # 12: invalid (counted, zeros written)
        fmt = QuantStagingFormat.for_layout(lay, len(ids), granularity=granularity)
        ref = torch.zeros(fmt.nbytes, dtype=torch.uint8, device=DEVICE)
        err_ref = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        quant_gather_triton(lay, ids, fmt, ref, err_ref)
        assert int(err_ref) == 1
        slot = ids.tolist().index(12)  # the invalid id's slot: zeros, like padding
        pad = ids.clone()
        pad[slot] = -1
        want = gather_quant(lay, pad, quant="fp8", granularity=granularity, backend="torch")
        assert torch.equal(ref, want[: fmt.nbytes]), kind
        for fma in fmas:
            for cap in (0, 3):  # one program per group, and a persistent grid of 3 programs
                out = torch.full((fmt.nbytes,), 0x5A, dtype=torch.uint8, device=DEVICE)
                err = torch.zeros(1, dtype=torch.int32, device=DEVICE)
                quant_gather_triton(lay, ids, fmt, out, err, max_ctas=cap, _probe={**probe, "FMA_DIV": fma})
                assert torch.equal(out, ref), (kind, probe, fma, cap)
                assert int(err) == 1, (kind, probe, fma, cap)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_fma_div_2_is_the_same_quotient_as_fma_div_1(granularity):
    """``FMA_DIV=2`` rewrites the FMA correction (``fma(q0, -sf, xs)``, a non-finite test on
    ``|q0|``): the same value for every input whatever the FMA rounds to, so under the interpreter
    (whose FMA rounds twice: both differ from torch there) the two forms must agree byte for byte,
    on random cache bytes (NaN, inf, subnormals, -0 among them); on the GPU both equal torch's
    bytes (test above)."""
    from kvkernels.triton_ops.quant_gather import quant_gather_triton

    if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel on CPU needs TRITON_INTERPRET=1")
    lay = cache("vllm-nhd", dtype=torch.bfloat16, head_dim=64, heads=2, block_size=8, blocks=6, layers=2, seed=11)
    ids = torch.tensor([4, 0, 5, 2], device=DEVICE)
    fmt = QuantStagingFormat.for_layout(lay, len(ids), granularity=granularity)
    outs = []
    for fma in (True, 2):
        out = torch.zeros(fmt.nbytes, dtype=torch.uint8, device=DEVICE)
        quant_gather_triton(lay, ids, fmt, out, torch.zeros(1, dtype=torch.int32, device=DEVICE),
                            _probe={"FMA_DIV": fma, "HW_CVT": False})
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_fp8_gather_variants_compile_for_sm90():
    """The variants compile to sm_90 PTX with the conversion instruction, the FMA quotient,
    16-byte loads and divisions per row / tile only; the MLA tail fix has no tile-sized shared
    memory round trip left (the default split kernel uses 4 KiB for it)."""
    ks = _compile_probe("align16", "quant_probes")
    assert len(ks) == 4
    for name, k in ks.items():
        assert {"cvt.rn.satfinite.e4m3x2.f32", "fma.rn.f32", "ld.global.v4.b32"} <= set(k["insns"]), (name, k)
        assert k["ndiv"] <= (8 if "items4" in name else 6), (name, k["ndiv"])  # 2 per item (scale, reciprocal)
        if "tailfix" in name:
            assert k["shared"] <= 64, (name, k["shared"])


@pytest.mark.parametrize("align", ["align16", "unaligned"])
def test_kernels_compile_for_sm90(align):
    """Every kernel variant compiles to sm_90 PTX here (no GPU): the divisions are IEEE (div.rn.f32)
    and only per row / tile (scale and reciprocal: a handful in the PTX, not one per element; the
    quotients are the FMA correction, fma.rn.f32); the quantizing gather's codes come from the
    saturating RNE conversion (cvt.rn.satfinite.e4m3x2, its GPU path) and no other fp8 / bf16
    conversion is used; the aligned variants use 16-byte accesses."""
    ks = _compile_probe(align, "quant,shuffle")
    assert len(ks) == 11
    for name, k in ks.items():
        ins = k["insns"]
        hw = {"cvt.rn.satfinite.e4m3x2.f32"} if name.startswith("quant_gather") else set()
        assert hw <= set(ins), (name, ins)
        assert not any(("e4m3" in i or "bf16" in i) and i not in hw for i in ins), (name, ins)
        if name.startswith("quant"):
            assert "div.rn.f32" in ins and not any(i.startswith("div.full") or i.startswith("div.approx") for i in ins)
            assert k["ndiv"] <= 4, (name, k["ndiv"])  # per row / tile, not per element
        if name.startswith("quant_gather"):
            assert "fma.rn.f32" in ins, (name, ins)
        if align == "align16":
            assert "ld.global.v4.b32" in ins and "st.global.v4.b32" in ins, (name, ins)


# ------------------------------------------- the GPU kernels' quotient (reciprocal + FMA correction)
def _rn32(v) -> float:
    """Exact rational -> nearest-even fp32 (subnormals; overflow -> inf)."""
    from fractions import Fraction

    if v == 0:
        return 0.0
    sign, v = (-1.0 if v < 0 else 1.0), abs(v)
    e = v.numerator.bit_length() - v.denominator.bit_length()
    if Fraction(2) ** e > v:
        e -= 1
    e = max(e, -126)
    q = v / Fraction(2) ** (e - 23)
    n, rem = divmod(q.numerator, q.denominator)
    if 2 * rem > q.denominator or (2 * rem == q.denominator and n % 2):
        n += 1
    val = n * 2.0 ** (e - 23)
    return sign * (math.inf if val > 3.4028234663852886e38 else float(np.float32(val)))


def _fma32(a: float, b: float, c: float) -> float:
    from fractions import Fraction

    if not all(map(math.isfinite, (a, b, c))):
        with np.errstate(all="ignore"):
            return float(np.float32(a) * np.float32(b) + np.float32(c))
    return _rn32(Fraction(a) * Fraction(b) + Fraction(c))


def _markstein_quotient(x: float, s: float) -> float:
    """csrc/kernels/fp8.cuh ``quotient`` / triton_ops/quant_gather.py ``_quotient``, step by step."""
    m = lambda a, b: float(np.float32(a) * np.float32(b))  # noqa: E731
    f = 2.0**64 if s < 2.0**-64 else 1.0
    xs, sf = m(x, f), m(s, f)
    r = float(np.float32(1.0) / np.float32(sf))
    q0 = m(xs, r)
    e = _fma32(-q0, sf, xs)
    return q0 if e == 0 or not math.isfinite(q0) else _fma32(e, r, q0)


def test_gpu_quotient_gives_the_codes_of_ieee_division():
    """The GPU encoders replace ``x / s`` per element by a reciprocal per row and two FMAs: exact
    arithmetic here (fractions, one rounding per FMA) over random rows, values near e4m3 ties,
    scales with all-ones / single-bit significands across the exponent range, tiny (pre-scaled)
    scales and the specials; the e4m3 code must equal that of the IEEE quotient every time (the
    fp32 quotients themselves may differ only where both codes are +-0: subnormal x, no code-
    relevant quotient). 420 000 such pairs checked when this was written, no code differing."""
    rng = random.Random(5)
    f32 = lambda b: float(np.frombuffer(np.uint32(b).tobytes(), dtype=np.float32)[0])  # noqa: E731
    xs, ss = [], []
    for _ in range(12000):
        amax = f32(rng.randrange(1, 0x7F800000))
        s = float(np.float32(amax) / np.float32(448.0)) or 1.0
        mode = rng.random()
        if mode < 0.4:
            x = f32(rng.randrange(0, 0x7F800000))
            x = min(x, amax)
        elif mode < 0.8:
            x = float(np.float32(amax) * np.float32(f32(rng.randrange(0x30000000, 0x3F800000))))
        else:  # values whose quotient lies anywhere on the e4m3 range, ties included
            x = float(np.float32(f32(rng.randrange(0x3A800000, 0x43E00001))) * np.float32(s))
        xs.append(-x if rng.randrange(2) else x)
        ss.append(s)
    for m in (0x7FFFFF, 0x7FFFFE, 0x000001, 0x400000, 0):
        for ex in list(range(1, 255, 9)) + [254]:
            s = f32((ex << 23) | m)
            for _ in range(8):
                x = float(np.float32(s) * np.float32(f32(rng.randrange(0x30000000, 0x43E00001))))
                xs += [x, -x]
                ss += [s, s]
    for s in (1.0, 2.0, 2.0**-140, 2.0**-64, 2.0**-65, f32(0x1F7FFFFF), f32(0x00000001)):
        for x in (0.0, -0.0, math.inf, -math.inf, math.nan, 448 * s, -448 * s, f32(1), -f32(1)):
            xs.append(x)
            ss.append(s)
    got = torch.tensor([_markstein_quotient(x, s) for x, s in zip(xs, ss)], dtype=torch.float32)
    want = torch.tensor(xs, dtype=torch.float32) / torch.tensor(ss, dtype=torch.float32)
    code = lambda y: torch.where(torch.isnan(y), 0x7F, y.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).int())  # noqa: E731
    assert torch.equal(code(got), code(want))
    differ = (got.view(torch.int32) != want.view(torch.int32)) & ~(torch.isnan(got) & torch.isnan(want))
    # only where x * f is subnormal (< 2**-126, with s * f >= 2**-85): quotients < 2**-41, codes +-0
    assert (want[differ].abs() < 2.0**-41).all()


def test_store_scheme_is_the_inverse_of_scheme_args_and_the_integrations_rule():
    from kvkernels.quant import STORE_SCHEMES, scheme_args, store_scheme

    for scheme in STORE_SCHEMES:
        assert store_scheme(**scheme_args(scheme)) == scheme
    # the rule applied to chunks of any dtype: FP8 for bf16/fp16/fp32 only, shuffle for 16-bit only
    assert store_scheme(quant="fp8", granularity="block", dtype=torch.float32) == "fp8-block"
    assert store_scheme(quant="fp8", shuffle=True, dtype=torch.bfloat16) == "fp8-token"
    assert store_scheme(quant="fp8", shuffle=True, dtype=torch.float8_e4m3fn) == "raw"  # never re-quantized
    assert store_scheme(shuffle=True, dtype=torch.float16) == "shuffle"
    assert store_scheme(shuffle=True, dtype=torch.float32) == "raw"
    with pytest.raises(ValueError, match="granularity"):
        store_scheme(quant="fp8", granularity="row")
    # a bad argument is an error whatever the dtype decides (it used to become a "raw" header)
    assert store_scheme(quant="none", shuffle=True, dtype=torch.bfloat16) == "shuffle"  # the integrations' setting
    for bad, exc, name in (({"quant": "FP8"}, ValueError, "quant"), ({"quant": "int8"}, ValueError, "quant"),
                           ({"quant": "fp8", "granularity": "blk", "dtype": torch.uint8}, ValueError, "granularity"),
                           ({"shuffle": 1, "dtype": torch.bfloat16}, TypeError, "shuffle"),
                           ({"dtype": "bfloat16"}, TypeError, "dtype")):
        with pytest.raises(exc, match=name):
            store_scheme(**bad)


def test_fp8_per_block_gather_head_offsets_past_2_31_elements():
    # heads outermost in a layer (vLLM packed LHBNC, from_strides "HBND"): h * stride_h was an
    # int32 product in the Triton per-block gather; at (H-1) * stride_h >= 2^31 it wrapped and read
    # 4 GiB before the head's data. The storage is one lazily allocated ~8.6 GB tensor (only the
    # few touched pages are resident on a CPU; real memory on a GPU).
    H, BS, D, NB = 3, 2, 16, 2
    S = 2**30 + 64  # head stride in elements: fits in int32, so Triton types it i32
    K0 = 2**31  # element offset of the views in the storage, so the wrapped offset stays inside it
    inner = (BS - 1) * D + (H - 1) * S + D
    try:
        big = torch.empty(K0 + 128 + (NB - 1) * BS * D + inner + 64, dtype=torch.bfloat16, device=DEVICE)
    except (RuntimeError, MemoryError) as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"cannot reserve 8.6 GB: {exc}")
    lay = kvkernels.PagedLayout.from_strides([big], block_size=BS, num_heads=H, head_dim=D, strides=(BS * D, D, S),
                                             num_blocks=NB, kv_offset=NB * BS * D, offset=K0)
    g = torch.Generator().manual_seed(0)
    for v in lay.views[0]:
        v.copy_(torch.randn(v.shape, generator=g).to(torch.bfloat16))
    wrap = K0 + 2 * S - 2**32  # where the wrapped offset of head 2 pointed: a sentinel there
    big[wrap - 64: wrap + 4 * BS * D + 64].fill_(1000.0)
    ids = [1, 0]
    for gran in ("token", "block"):
        ref = kvkernels.gather(lay, ids, quant="fp8", granularity=gran, backend="torch")
        got = kvkernels.gather(lay, ids, quant="fp8", granularity=gran, backend="triton")
        assert bytes_equal(got, ref), gran
    del big, lay


@pytest.mark.gpu
def test_fp8_gather_into_pinned_host_out_keeps_the_gpu_fast_paths(monkeypatch):
    # the fast-path switches followed `out`'s device: a pinned host staging (zero-copy) took the
    # IEEE division and integer encoding, 22-30 % of the bound (same bytes, slower)
    from kvkernels.triton_ops import quant_gather as qg

    lay = make_cache("vllm-nhd", num_layers=2, num_blocks=8, block_size=16, num_heads=2, head_dim=64, device=DEVICE)
    seen = {}
    real = qg._quant_gather_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*a, **k):
                seen.update(k)
                return real[grid](*a, **k)
            return launch

    monkeypatch.setattr(qg, "_quant_gather_kernel", Spy())
    fmt_bytes = kvkernels.gather(lay, [1, 2], quant="fp8").numel()
    host = torch.empty(fmt_bytes, dtype=torch.uint8).pin_memory()
    got = kvkernels.gather(lay, [1, 2], quant="fp8", out=host, backend="triton")
    torch.cuda.current_stream().synchronize()
    assert seen["FMA_DIV"] is kvkernels.config.fp8_fma_div()
    assert seen["HW_CVT"] is (torch.cuda.get_device_capability() >= (8, 9))
    assert bytes_equal(got, kvkernels.gather(lay, [1, 2], quant="fp8", backend="torch").cpu())


def test_fp8_buffer_on_an_unaligned_storage_is_a_clear_error():
    # 16-byte aligned address, but the storage starts 1-3 bytes off: torch's int32/fp32 view of it
    # raised a bare RuntimeError from inside the launch
    lay = kvkernels.PagedLayout.from_vllm([torch.randn(2, 4, 4, 2, 16).bfloat16()])
    st = kvkernels.gather(lay, [1, 0], quant="fp8", backend="torch")
    raw = bytearray(st.numel() + 64)
    for k in (1, 2, 3):
        base = torch.frombuffer(raw, dtype=torch.uint8, offset=k)
        s = next(s for s in range(16) if (base.data_ptr() + s) % 16 == 0)
        for b in [b for b in BACKENDS if b == "torch" or DEVICE.type == "cpu"]:  # a CPU cache: Triton only interpreted
            with pytest.raises(ValueError, match="storage offset"):
                kvkernels.gather(lay, [1, 0], quant="fp8", out=base[s:], backend=b)
            with pytest.raises(ValueError, match="storage offset"):
                kvkernels.scatter(base[s:], lay, [1, 0], quant="fp8", backend=b)



# ------------------------------------------------ found by mutation testing (thirty-second session)
def test_codes_sections_are_rounded_to_16_bytes_as_documented():
    """One block of 1 token, 1 head, head_dim 4: 4 code bytes per entry, a 16-byte section (a
    4-byte rounding kept every round trip working: all backends take offsets from the format)."""
    lay = cache("vllm-nhd", heads=1, head_dim=4, block_size=1, layers=1, blocks=2, fill="zero")
    fmt = QuantStagingFormat.for_layout(lay, 1)
    assert (fmt.q_nbytes, fmt.q_entry_nbytes) == (4, 16)
    assert [fmt.q_offset(0, 0), fmt.q_offset(0, 1), fmt.scale_offset(0, 0), fmt.scale_offset(0, 1)] == [0, 16, 32, 48]


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_fp8_buffer_aligned_to_4_but_not_16_bytes_is_refused(backend):
    lay = cache("vllm-nhd")
    fmt = QuantStagingFormat.for_layout(lay, 2)
    base = torch.zeros(fmt.nbytes + 64, dtype=torch.uint8, device=lay.device)
    k = next(k for k in range(4, 64, 4) if (base.data_ptr() + k) % 16)
    out = base[k: k + fmt.nbytes]
    with pytest.raises(ValueError, match="16-byte aligned"):
        gather_quant(lay, [1, 2], out=out, quant="fp8", backend=backend)
    good = gather_quant(lay, [1, 2], quant="fp8", backend="torch")
    out.copy_(good)
    before = cache_bytes(lay)
    with pytest.raises(ValueError, match="16-byte aligned"):
        scatter_quant(out, lay, [3, 4], quant="fp8", backend=backend)
    assert all(torch.equal(x, y) for x, y in zip(before, cache_bytes(lay)))


def test_shuffle_against_a_raw_scheme_is_refused_before_writing():
    """A buffer stored as "raw" restored with shuffle=True (or the reverse) would put byte planes
    into the cache as values: a ValueError naming `scheme`, nothing written."""
    lay = cache("vllm-nhd")
    st = kvkernels.gather(lay, [1, 2], backend="torch")
    before = cache_bytes(lay)
    with pytest.raises(ValueError, match="`scheme`"):
        scatter_quant(st, lay, [3, 4], shuffle=True, scheme="raw", backend="torch")
    assert all(torch.equal(x, y) for x, y in zip(before, cache_bytes(lay)))
