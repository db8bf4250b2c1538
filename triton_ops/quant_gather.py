"""Fused paged gather + FP8 quantization: (layer, K/V, block) chunks -> e4m3 codes + fp32 scales.

Format: :class:`kvkernels.quant.QuantStagingFormat` (``docs/quant.md``). Same work decomposition as
:mod:`._paged`: work item ``w = (j * C + c) * n + i`` (region j, entry c, staging slot i), a
persistent grid of ``min(num_items, max_ctas)`` programs striding over the items.

Rounding: the code of ``RN(x / s)`` (IEEE quotient, as torch's ``x / s``), never a plain ``/``
(approximate on the GPU). On the GPU the quotient is a reciprocal per row / tile and a Markstein
FMA correction per element (:func:`_quotient`: bit-identical to the IEEE division, without its
per-element cost) and the e4m3 code the conversion instruction; under the interpreter (whose FMA
rounds twice and whose fp8 conversion is wrong, field notes section 7) ``tl.div_rn`` per element
and integer operations on the fp32 bits (:func:`_e4m3_code`). Both give torch's bytes. With
``tl.div_rn`` per element on the GPU (until 2026-11-23) the kernel ran at 22-30 % of its bound on the
H100 (docs/PERF_NOTES.md, "FP8 gather").
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvkernels import config
from kvkernels.backends import triton_interpret

from ._paged import _cache_rows, _staging_rows, geometry, persistent_grid

# Elements per program tile (rows x padded head dim). 4096 fp32 temporaries = 16 KiB of registers
# per program at 4 warps. NOT yet measured on a GPU.
TILE_ELEMS = 4096
NUM_WARPS = 4

# cache dtype -> (IN_KIND constexpr, integer element type the kernel loads)
_KINDS = {torch.bfloat16: (0, torch.int16), torch.float16: (1, torch.int16), torch.float32: (2, torch.int32)}


def align16(layout, staging: torch.Tensor) -> bool:
    """True when 16-byte vector accesses are legal on both sides: every cache base address, byte
    stride and row, the staging address, and the staging rows (``head_dim`` bytes per fp8 row or
    byte plane; sections are 16-aligned) are multiples of 16 bytes."""
    return layout.access_width(staging.data_ptr()) == 16 and layout.head_dim % 16 == 0


@triton.jit
def _load_f32(ptr, mask, IN_KIND: tl.constexpr):
    """Load cache elements (as int16 / int32 bits) and widen to fp32 exactly."""
    v = tl.load(ptr, mask=mask, other=0)
    if IN_KIND == 0:  # bf16: the high half of an fp32 (no conversion instruction, exact)
        return (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif IN_KIND == 1:  # fp16
        return v.to(tl.float16, bitcast=True).to(tl.float32)
    else:  # fp32
        return v.to(tl.float32, bitcast=True)


@triton.jit
def _abs_bits(x):
    """``|x|`` as int32 bits with non-finite values replaced by 0 (int max == float max for >= 0)."""
    a = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.where(a < 0x7F800000, a, 0)


@triton.jit
def _scale_from_amax_bits(amax_bits):
    """``amax / 448`` (IEEE division), 1.0 where that is 0 (the zero rule)."""
    s = tl.div_rn(amax_bits.to(tl.float32, bitcast=True), tl.full(amax_bits.shape, 448.0, tl.float32))
    return tl.where(s > 0, s, 1.0)


@triton.jit
def _e4m3_code(y):
    """fp32 -> int32 e4m3fn code (0..255): saturating RNE; every NaN -> 0x7F. Integer bit ops
    only, plus one exact fp32 multiply-add for the subnormal range."""
    b = y.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    nan = a > 0x7F800000
    a = tl.minimum(a, 0x43E00000)  # 448.0 (inf saturates)
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960  # RNE on the 20 dropped mantissa bits
    # below 2**-6 the grid is k * 2**-9: RNE(y * 512) via the 2**23 magic number (the product is
    # exact, so a fused multiply-add rounds the same)
    sub = (a.to(tl.float32, bitcast=True) * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(a < 0x3C800000, sub, normal) | sign
    return tl.where(nan, 0x7F, code)


@triton.jit
def _recip(s):
    """``(f, s * f, RN(1 / (s * f)))`` of scales ``s``: ``f = 2**64`` where ``s < 2**-64`` (so the
    reciprocal stays finite), else 1 (see :func:`_quotient`); one IEEE division per row / tile."""
    f = tl.where(s < 5.421010862427522e-20, 18446744073709551616.0, 1.0)  # 2**-64, 2**64
    sf = s * f
    return f, sf, tl.div_rn(tl.full(s.shape, 1.0, tl.float32), sf)


@triton.jit
def _quotient(x, s, f, sf, r, FMA_DIV: tl.constexpr):
    """``RN(x / s)`` (the format's quotient) for per-row ``[R, 1]`` or scalar ``s`` and its
    :func:`_recip` values. FMA_DIV (the GPU): no division per element: ``q0 = RN((x * f) * r)`` is
    within one ulp, the residual ``e = x*f - q0 * s*f`` is exact in an FMA, and ``RN(q0 + e * r)``
    is the correctly rounded quotient (Markstein) wherever it can reach a nonzero e4m3 code (the
    pre-scale keeps every step out of underflow there; below, the code is +-0 either way);
    ``e == 0`` and non-finite ``q0`` keep ``q0``. Checked exactly in tests/test_quant.py. Without
    FMA_DIV (the interpreter, whose ``tl.fma`` rounds twice): ``tl.div_rn`` per element."""
    if FMA_DIV == 2:  # same values: -q0 * sf == q0 * -sf exactly; !(|q0| < inf) <=> bits >= 0x7F800000
        xs = x * f
        q0 = xs * r
        e = tl.fma(q0, -sf, xs)
        keep = (e == 0) | ~(tl.abs(q0) < float("inf"))
        return tl.where(keep, q0, tl.fma(e, r, q0))
    elif FMA_DIV:
        xs = x * f
        q0 = xs * r
        e = tl.fma(-q0, sf, xs)
        keep = (e == 0) | ((q0.to(tl.int32, bitcast=True) & 0x7FFFFFFF) >= 0x7F800000)
        return tl.where(keep, q0, tl.fma(e, r, q0))
    else:
        return tl.div_rn(x, tl.zeros_like(x) + s)


@triton.jit
def _code_of(y, HW_CVT: tl.constexpr):
    """e4m3 code (int32) of ``y``. HW_CVT (the GPU): the conversion instruction (saturating RNE),
    every NaN made 0x7F; else integer operations (the interpreter's conversion is wrong, field notes
    section 7). The H100 run of 2026-11-23 found no byte differing between them (bench/fp8_tuning.py)."""
    if HW_CVT:
        code = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
        return tl.where(y != y, 0x7F, code)
    return _e4m3_code(y)


@triton.jit
def _quant_gather_kernel(
    ptr_tab,  # int64 [R, C]: byte address of block 0 of (requested layer j, entry c)
    block_ids,  # int32/int64 [n]: cache block of staging slot i (outside [0, num_blocks) = padding)
    q_ptr,  # uint8 [>= R * region_nbytes]: staging bytes (e4m3 codes written here)
    s_ptr,  # int32 [>= R * region_nbytes / 4]: the same staging as 32-bit words (fp32 scale bits)
    err_ptr,  # int32 [1]: += 1 per invalid id other than -1 (deferred validation)
    n, num_blocks, num_items,  # staging slots, cache blocks, R * C * n
    stride_b, stride_n, stride_h,  # cache strides in elements: block, token, head (int64)
    region_nbytes, q_entry_nbytes, scale_base_nbytes, scale_entry_nbytes,  # format offsets (bytes)
    C: tl.constexpr,  # entries per layer (2 = K, V; 1 = MLA)
    H: tl.constexpr,  # kv heads
    BS: tl.constexpr,  # block_size
    D: tl.constexpr,  # head_dim
    IN_KIND: tl.constexpr,  # 0 bf16, 1 fp16, 2 fp32
    PER_BLOCK: tl.constexpr,  # False: scale per (token, head); True: per (block, head)
    BLOCK_R: tl.constexpr,  # rows per tile ((token, head) rows; tokens when PER_BLOCK)
    BLOCK_D: tl.constexpr,  # next_power_of_2(D), or the largest power of two below D with D_TAIL
    ALIGN16: tl.constexpr,  # host checked (align16): cache and staging rows 16-byte aligned
    HW_CVT: tl.constexpr,  # e4m3 code by the fp8 conversion instruction (GPU) or integer ops (interpreter)
    FMA_DIV: tl.constexpr,  # x / s by reciprocal + FMA correction (GPU) or tl.div_rn per element (interpreter)
    D_TAIL: tl.constexpr = 0,  # > 0: BLOCK_D is a power of two < D and columns BLOCK_D.. come as a second
    # tile of D_TAIL (the default for head dims that are not a power of two, e.g. MLA's 576 = 512 + 64)
    ITEMS: tl.constexpr = 1,  # consecutive work items per program step (one division, one prologue per group)
    TAIL_FIX: tl.constexpr = 0,  # with D_TAIL, 2: each tile stays in its load layout, only the rows'
    # maxima cross layouts (no tile-sized layout conversion through shared memory); 0: one layout
):
    # grid: (min(cdiv(num_items, ITEMS), max_ctas),); each program strides over groups of ITEMS
    # consecutive work items (the twelfth session's static SASS study, docs/PERF_NOTES.md: per-item
    # fixed work is a third of a 4 KB item's instructions; a group shares one division and prologue)
    ROWS: tl.constexpr = BS * H
    EB: tl.constexpr = 4 if IN_KIND == 2 else 2  # cache element bytes (loaded as int32 / int16 bits)
    EV: tl.constexpr = 16 // EB  # cache elements per 16 bytes
    r_ar = tl.arange(0, BLOCK_R)
    d_ar = tl.arange(0, BLOCK_D)
    d_ok = d_ar < D
    TAIL_W: tl.constexpr = D_TAIL if D_TAIL > 0 else 1
    e_ar = BLOCK_D + tl.arange(0, TAIL_W)  # the tail tile's columns (unused when D_TAIL == 0)
    e_ok = e_ar < D
    num_groups = (num_items - 1) // ITEMS + 1  # num_items >= 1 (the launcher); no int32 overflow near 2^31
    for g in tl.range(tl.program_id(0), num_groups, tl.num_programs(0)):
        w0 = g * ITEMS
        jc = w0 // n  # int32: one division per group, then carried
        i32 = w0 - jc * n
        for k in tl.static_range(ITEMS):
            live = k < num_items - w0  # (w0 + k could wrap in int32 near 2^31)
            jcl = tl.where(live, jc, 0)
            j = (jcl // C).to(tl.int64)
            c = (jcl - (jcl // C) * C).to(tl.int64)
            i = i32.to(tl.int64)
            # the table entry first (independent of the id), then the id; relaxed counter (no fence)
            addr = tl.load(ptr_tab + j * C + c)
            bid = tl.load(block_ids + i).to(tl.int64)
            # an invalid id is counted once per slot: by the first n items (region 0, entry 0)
            tl.atomic_add(err_ptr, 1, mask=(((bid != -1) & (bid < 0)) | (bid >= num_blocks)) & (k < n - w0) & live,
                          sem="relaxed")
            # a dead item (past the end) reads region 0's block and stores nothing: masking its
            # reads too (`& live`) took the default per-block kernel from 32 to 39 registers (sm_90)
            valid = (bid >= 0) & (bid < num_blocks)
            row_lim = tl.where(valid, ROWS, 0)  # invalid id: no cache row is read, zeros are written
            tok_lim = tl.where(valid, BS, 0)
            row_end = tl.where(live, ROWS, 0)  # past the last item: nothing stored
            tok_end = tl.where(live, BS, 0)
            if EB == 2:
                base = addr.to(tl.pointer_type(tl.int16))
            else:
                base = addr.to(tl.pointer_type(tl.int32))
            if ALIGN16:
                base = tl.multiple_of(base, 16)
            cache = base + tl.where(valid, bid, 0) * stride_b
            q_out = q_ptr + j * region_nbytes + c * q_entry_nbytes + i * (ROWS * D)
            s_out = s_ptr + (j * region_nbytes + scale_base_nbytes + c * scale_entry_nbytes) // 4
            if PER_BLOCK:
                s_out = s_out + i * H
                for h in tl.range(0, H):
                    # pass 1: amax over the block's tokens for head h
                    amax = tl.zeros([BLOCK_R], tl.int32)
                    amax2 = tl.zeros([BLOCK_R], tl.int32)
                    for t0 in tl.range(0, BS, BLOCK_R):
                        t = t0 + r_ar
                        c_row = t.to(tl.int64) * stride_n + tl.cast(h, tl.int64) * stride_h  # i64: (H-1)*stride_h may pass 2^31
                        if ALIGN16:
                            c_row = tl.multiple_of(c_row, EV)
                        off = c_row[:, None] + d_ar[None, :]
                        mv = (t < tok_lim)[:, None] & d_ok[None, :]
                        amax = tl.maximum(amax, tl.max(_abs_bits(_load_f32(cache + off, mv, IN_KIND)), axis=1))
                        if D_TAIL > 0:
                            mv2 = (t < tok_lim)[:, None] & e_ok[None, :]
                            x2 = _load_f32(cache + c_row[:, None] + e_ar[None, :], mv2, IN_KIND)
                            if TAIL_FIX == 2:  # the tail's own vector: the two meet only as scalars (max is exact)
                                amax2 = tl.maximum(amax2, tl.max(_abs_bits(x2), axis=1))
                            else:
                                amax = tl.maximum(amax, tl.max(_abs_bits(x2), axis=1))
                    if TAIL_FIX == 2 and D_TAIL > 0:
                        s = _scale_from_amax_bits(tl.maximum(tl.max(amax, axis=0), tl.max(amax2, axis=0)))
                    else:
                        s = _scale_from_amax_bits(tl.max(amax, axis=0))
                    f, sf, rc = _recip(s)
                    tl.store(s_out + h, tl.where(valid, s, 0.0).to(tl.int32, bitcast=True), mask=live)
                    # pass 2: quantize (the re-read should hit L2; not measured)
                    for t0 in tl.range(0, BS, BLOCK_R):
                        t = t0 + r_ar
                        c_row = t.to(tl.int64) * stride_n + tl.cast(h, tl.int64) * stride_h  # i64: (H-1)*stride_h may pass 2^31
                        if ALIGN16:
                            c_row = tl.multiple_of(c_row, EV)
                        off = c_row[:, None] + d_ar[None, :]
                        mv = (t < tok_lim)[:, None] & d_ok[None, :]
                        x = _load_f32(cache + off, mv, IN_KIND)
                        code = _code_of(_quotient(x, s, f, sf, rc, FMA_DIV), HW_CVT)
                        q_row = _staging_rows(t * H + h, D, ALIGN16)
                        tl.store(q_out + q_row[:, None] + d_ar[None, :], code.to(tl.uint8),
                                 mask=(t < tok_end)[:, None] & d_ok[None, :])
                        if D_TAIL > 0:
                            mv2 = (t < tok_lim)[:, None] & e_ok[None, :]
                            x2 = _load_f32(cache + c_row[:, None] + e_ar[None, :], mv2, IN_KIND)
                            code2 = _code_of(_quotient(x2, s, f, sf, rc, FMA_DIV), HW_CVT)
                            tl.store(q_out + q_row[:, None] + e_ar[None, :], code2.to(tl.uint8),
                                     mask=(t < tok_end)[:, None] & e_ok[None, :])
            else:
                s_out = s_out + i * ROWS
                for r0 in tl.range(0, ROWS, BLOCK_R):
                    rows = r0 + r_ar
                    c_row, _h = _cache_rows(rows, stride_n, stride_h, H, EV, ALIGN16)
                    off = c_row[:, None] + d_ar[None, :]
                    mv = (rows < row_lim)[:, None] & d_ok[None, :]
                    x = _load_f32(cache + off, mv, IN_KIND)
                    if D_TAIL > 0 and TAIL_FIX == 2:
                        # each tile keeps its load layout; only [R] row maxima cross layouts, through tl.gather
                        # (explicit small conversions); s, f, sf, rc are computed once per layout (same ops)
                        am_m = tl.max(_abs_bits(x), axis=1)
                        mv2 = (rows < row_lim)[:, None] & e_ok[None, :]
                        x2 = _load_f32(cache + c_row[:, None] + e_ar[None, :], mv2, IN_KIND)
                        am_t = tl.max(_abs_bits(x2), axis=1)
                        am = tl.maximum(am_m, tl.gather(am_t, tl.where(am_m < 0, 0, r_ar), 0))
                        am2 = tl.maximum(am_t, tl.gather(am_m, tl.where(am_t < 0, 0, r_ar), 0))
                    else:
                        am = tl.max(_abs_bits(x), axis=1)
                        if D_TAIL > 0:
                            mv2 = (rows < row_lim)[:, None] & e_ok[None, :]
                            x2 = _load_f32(cache + c_row[:, None] + e_ar[None, :], mv2, IN_KIND)
                            am = tl.maximum(am, tl.max(_abs_bits(x2), axis=1))
                    s = _scale_from_amax_bits(am)
                    f, sf, rc = _recip(s)
                    code = _code_of(_quotient(x, s[:, None], f[:, None], sf[:, None], rc[:, None], FMA_DIV), HW_CVT)
                    q_row = _staging_rows(rows, D, ALIGN16)
                    tl.store(q_out + q_row[:, None] + d_ar[None, :], code.to(tl.uint8),
                             mask=(rows < row_end)[:, None] & d_ok[None, :])
                    if D_TAIL > 0:
                        if TAIL_FIX == 2:
                            s2 = _scale_from_amax_bits(am2)
                            f2, sf2, rc2 = _recip(s2)
                            code2 = _code_of(_quotient(x2, s2[:, None], f2[:, None], sf2[:, None], rc2[:, None], FMA_DIV), HW_CVT)
                        else:
                            code2 = _code_of(_quotient(x2, s[:, None], f[:, None], sf[:, None], rc[:, None], FMA_DIV), HW_CVT)
                        tl.store(q_out + q_row[:, None] + e_ar[None, :], code2.to(tl.uint8),
                                 mask=(rows < row_end)[:, None] & e_ok[None, :])
                    s_st = tl.where(rows < row_lim, s, 0.0).to(tl.int32, bitcast=True)
                    tl.store(s_out + rows, s_st, mask=rows < row_end)
            i32 = i32 + 1
            wrap = i32 == n
            i32 = tl.where(wrap, 0, i32)
            jc = tl.where(wrap, jc + 1, jc)


@functools.lru_cache(maxsize=None)
def _has_fp8_cvt(device_index) -> bool:
    """Triton compiles fp8e4nv conversions only for sm_89 and later."""
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def tile_rows(rows: int, head_dim: int, tile_elems: int = TILE_ELEMS, block_d: int | None = None) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_D): rows of a power-of-two padded head dim (or of ``block_d`` columns),
    ~``tile_elems`` elements."""
    block_d = block_d or triton.next_power_of_2(head_dim)
    return max(1, min(triton.next_power_of_2(rows), tile_elems // block_d)), block_d


def quant_gather_triton(layout, block_ids: torch.Tensor, fmt, out: torch.Tensor, err: torch.Tensor, max_ctas: int = 0,
                        _probe: dict | None = None) -> torch.Tensor:
    """Quantize ``fmt.layers`` of ``layout`` into ``out`` (uint8, 16-byte aligned, validated by the
    caller) in the :class:`~kvkernels.quant.QuantStagingFormat` ``fmt``; one launch.

    ``block_ids`` int32/int64 ``[n]`` and ``err`` int32 ``[1]`` on the cache device; ``max_ctas``
    caps the grid (0 = one program per work item). Section gaps and region padding are zeroed.
    ``_probe``: kernel variants for bench/fp8_tuning.py only (``HW_CVT``, ``FMA_DIV`` — 2: the
    same quotient with one instruction less, ``num_warps``, ``tile_elems``, ``split_d``: False
    pads a head dim that is not a power of two to one tile instead of the default power-of-two
    tile plus a tail tile, ``items``: work items per program step, ``tail_fix``: 2 keeps the
    split tiles in their load layouts, ``maxnreg``: Triton's register cap). All variants write
    the same bytes (tests/test_quant.py); which are faster is for the GPU bench to say.
    """
    n = fmt.num_blocks
    if n == 0 or fmt.num_regions == 0:
        return out
    kind, _ = _KINDS[layout.dtype]
    tab, (sb, sn, sh), num_items, grid = geometry(layout, fmt, max_ctas, layout.element_size)
    stage = out[: fmt.nbytes]
    per_block = fmt.granularity == "block"
    probe = dict(_probe or {})
    warps = probe.pop("num_warps", NUM_WARPS)
    # the kernel runs on the cache's GPU even when ``out`` is pinned host memory (zero-copy): that
    # decides the fast paths, not where the staging lives (a pinned out took the IEEE division)
    on_gpu = layout.device.type == "cuda" and not triton_interpret()
    # Triton has fp8e4nv only from sm_89 (it refuses to compile it for an A100)
    hw_cvt = probe.pop("HW_CVT", on_gpu and _has_fp8_cvt(layout.device.index))
    # (the variable is read on every device: a malformed value is an error on the CPU too)
    fma_div = probe.pop("FMA_DIV", config.fp8_fma_div() and on_gpu)
    rows = layout.block_size if per_block else layout.block_size * layout.num_heads
    tile = probe.pop("tile_elems", TILE_ELEMS)
    block_r, block_d = tile_rows(rows, layout.head_dim, tile)
    d_tail = 0
    D = layout.head_dim
    # D not a power of two: a power-of-two main tile plus a tail tile, not one padded tile (MLA's
    # 576 on the H100, 2026-11-23: 73-79 % of the copy bound against 48-54 % padded to 1024)
    if probe.pop("split_d", True) and D & (D - 1):
        block_r, block_d = tile_rows(rows, D, tile, block_d=1 << (D.bit_length() - 1))
        d_tail = triton.next_power_of_2(D - block_d)
    items = int(probe.pop("items", 1))
    tail_fix = int(probe.pop("tail_fix", 0))
    if tail_fix not in (0, 2) or items < 1:
        raise ValueError(f"_probe: tail_fix must be 0 or 2 and items >= 1, got {tail_fix}, {items}")
    if items > 1:  # groups of `items` consecutive work items per program step
        grid = persistent_grid(-(-num_items // items), max_ctas)
    _quant_gather_kernel[grid](
        tab, block_ids, stage, stage.view(torch.int32), err,
        n, layout.num_blocks, num_items, sb, sn, sh,
        fmt.region_nbytes, fmt.q_entry_nbytes, fmt.num_kv * fmt.q_entry_nbytes, fmt.scale_entry_nbytes,
        C=fmt.num_kv, H=layout.num_heads, BS=layout.block_size, D=layout.head_dim, IN_KIND=kind,
        PER_BLOCK=per_block, BLOCK_R=block_r, BLOCK_D=block_d, ALIGN16=align16(layout, stage), HW_CVT=hw_cvt, FMA_DIV=fma_div,
        D_TAIL=d_tail, ITEMS=items, TAIL_FIX=tail_fix if d_tail else 0,
        num_warps=warps, **probe,
    )
    regions = stage.view(fmt.num_regions, fmt.region_nbytes)
    for a, b in fmt.gaps():
        regions[:, a:b].zero_()
    return out
