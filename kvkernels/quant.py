"""FP8 (e4m3 + fp32 scales) and byte-plane-shuffle staging formats, their reference ops and the
public entry points :func:`gather_quant` / :func:`scatter_quant` (exact formats: ``docs/quant.md``).

FP8 staging (:class:`QuantStagingFormat`)
    Region ``j`` (layer ``layers[j]``) starts at ``j * region_nbytes`` and holds, in this order::

        K codes   uint8 (e4m3fn) [n, block_size, H, D]    q_entry_nbytes bytes (rounded up to 16)
        V codes   uint8 (e4m3fn) [n, block_size, H, D]    q_entry_nbytes
        K scales  fp32           [n, block_size, H]       scale_entry_nbytes (rounded up to 16)
                                 ([n, H] with granularity="block")
        V scales  fp32           same
        zero padding up to a multiple of 4096

    MLA (one entry) holds codes then scales. ``x ≈ code * scale`` with
    ``scale = amax / 448`` where ``amax`` is the max of ``|x|`` over the *finite* elements of the
    (token, head) row (``granularity="token"``) or of the (block, head) tile (``"block"``).
    **Zero rule**: when ``amax / 448`` is 0 (an all-zero row, or only non-finite values, or an fp32
    row with ``amax <= 224 * 2**-149``, whose quotient rounds to 0) the scale is 1.0, so zeros (with their sign) round-trip exactly.
    Codes are ``(x / scale).clamp(-448, 448).to(torch.float8_e4m3fn)`` (saturating RNE) except that
    every NaN becomes ``0x7F`` (NaN's sign is not portable: GPU arithmetic returns canonical NaN);
    ``±inf`` saturates to ``±448``. Padding ids (``-1``) write all-zero bytes (codes and scales).

Shuffle staging (same :class:`~kvkernels.staging.StagingFormat` offsets as the raw format)
    Each entry (K or V) of a region, ``N = n * block_size * H * D`` 16-bit elements ``e[k]`` in the
    raw staging order, is stored as its high-byte plane ``e[k] >> 8`` (``N`` bytes) followed by its
    low-byte plane ``e[k] & 0xFF`` (``N`` bytes). Only 16-bit caches (bf16, fp16).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ._validate import check, check_int, fail
from .layout import PagedLayout
from .ops import GRANULARITIES, _caps, _check_buffer, _check_granularity, _err_counter, _prepare, on_cache_device
from .staging import RegionArithmetic, StagingFormat, normalize_layers

__all__ = [
    "STORE_SCHEMES",
    "scheme_args",
    "store_scheme",
    "FP8_MAX",
    "CANONICAL_NAN_BITS",
    "QUANT_SCHEMES",
    "GRANULARITIES",
    "QuantStagingFormat",
    "quant_staging_nbytes",
    "fp8_round_to_grid",
    "fp8_codes",
    "gather_fp8",
    "scatter_fp8",
    "gather_shuffle",
    "scatter_shuffle",
    "gather_quant",
    "scatter_quant",
]

FP8_MAX = 448.0
# The one NaN that FP8 dequantization writes, per cache dtype (positive quiet NaN).
CANONICAL_NAN_BITS = {torch.bfloat16: 0x7FC0, torch.float16: 0x7E00, torch.float32: 0x7FC00000}
QUANT_SCHEMES = (None, "fp8")
# the store header's ``scheme`` (io/format.py EntryMeta): how a staging buffer must be restored
STORE_SCHEMES = ("raw", "shuffle", "fp8-token", "fp8-block")


def scheme_args(scheme: str) -> dict:
    """``quant`` / ``shuffle`` / ``granularity`` of :func:`scatter_quant` for a store header's
    ``scheme`` (``"raw"``, ``"shuffle"``, ``"fp8-token"``, ``"fp8-block"``)."""
    check(scheme in STORE_SCHEMES, "scheme", f"one of {STORE_SCHEMES}", repr(scheme))
    if scheme.startswith("fp8-"):
        return {"quant": "fp8", "shuffle": False, "granularity": scheme[4:]}
    return {"quant": None, "shuffle": scheme == "shuffle", "granularity": "token"}


def store_scheme(*, quant=None, shuffle: bool = False, granularity: str = "token", dtype=None) -> str:
    """The store header's ``scheme`` for a gather with these arguments (the inverse of
    :func:`scheme_args`). With ``dtype`` (the cache's), the rule the integrations apply to
    whatever chunks arrive: FP8 only for bf16/fp16/fp32 (8-bit caches pass through as they are),
    byte-plane shuffle only for 16-bit elements; FP8 wins over shuffle. Arguments are checked
    whatever applies (a typo must not turn into a header that says ``"raw"``)."""
    check(quant in QUANT_SCHEMES or quant == "none", "quant", "None, 'none' (the integrations' setting) or 'fp8'",
          repr(quant))
    check(isinstance(shuffle, bool), "shuffle", "a bool", repr(type(shuffle)), TypeError)
    _check_granularity(granularity)
    check(dtype is None or isinstance(dtype, torch.dtype), "dtype", "a torch.dtype or None", repr(dtype), TypeError)
    if quant == "fp8" and (dtype is None or dtype in FP8_SOURCE_DTYPES):
        return f"fp8-{granularity}"
    if shuffle and (dtype is None or dtype.itemsize == 2):
        return "shuffle"
    return "raw"
SECTION_ALIGN = 16  # every codes / scales section starts 16-byte aligned (vector access, fp32 scales)
FP8_SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FP8_DTYPES = tuple(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n)
)


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


# ------------------------------------------------------------------------------------------ format
@dataclass(frozen=True)
class QuantStagingFormat(RegionArithmetic):
    """Offsets and sizes of an FP8 staging buffer (see the module docstring / ``docs/quant.md``).

    Parameters
    ----------
    layers : tuple of int
        Layers present, ascending; region ``j`` holds ``layers[j]``.
    num_blocks, block_size, num_heads, head_dim : int
        ``n`` staged blocks and the block shape of the cache.
    num_kv : int
        2 (K, V) or 1 (MLA).
    granularity : {"token", "block"}
        One scale per (token, head) or per (block, head).
    """

    layers: tuple[int, ...]
    num_blocks: int
    block_size: int
    num_heads: int
    head_dim: int
    num_kv: int = 2
    granularity: str = "token"

    @classmethod
    def for_layout(cls, layout, num_blocks: int, layers=None, granularity: str = "token") -> "QuantStagingFormat":
        if not isinstance(layout, PagedLayout):
            fail("layout", "a kvkernels.PagedLayout", type(layout).__name__, TypeError)
        check_int(num_blocks, "num_blocks", lo=0)
        _check_granularity(granularity)
        return cls(
            normalize_layers(layers, layout.num_layers), num_blocks, layout.block_size,
            layout.num_heads, layout.head_dim, layout.num_kv, granularity,
        )

    @classmethod
    def from_staging(cls, fmt: StagingFormat, granularity: str = "token") -> "QuantStagingFormat":
        """The FP8 format with the same layers and block shape as the raw format ``fmt``."""
        _check_granularity(granularity)
        return cls(fmt.layers, fmt.num_blocks, fmt.block_size, fmt.num_heads, fmt.head_dim, fmt.num_kv, granularity)

    @functools.cached_property
    def rows_per_block(self) -> int:
        """(token, head) rows of ``head_dim`` values in one block: ``block_size * H``."""
        return self.block_size * self.num_heads

    @functools.cached_property
    def scales_per_block(self) -> int:
        """``block_size * H`` (token granularity) or ``H`` (block granularity)."""
        return self.rows_per_block if self.granularity == "token" else self.num_heads

    @functools.cached_property
    def q_nbytes(self) -> int:
        """Meaningful bytes of one entry's codes: ``n * block_size * H * D``."""
        return self.num_blocks * self.rows_per_block * self.head_dim

    @functools.cached_property
    def q_entry_nbytes(self) -> int:
        """One entry's codes section, rounded up to 16 bytes."""
        return _round_up(self.q_nbytes, SECTION_ALIGN)

    @functools.cached_property
    def scale_nbytes(self) -> int:
        """Meaningful bytes of one entry's scales: ``4 * n * scales_per_block``."""
        return 4 * self.num_blocks * self.scales_per_block

    @functools.cached_property
    def scale_entry_nbytes(self) -> int:
        """One entry's scales section, rounded up to 16 bytes."""
        return _round_up(self.scale_nbytes, SECTION_ALIGN)

    @functools.cached_property
    def payload_nbytes(self) -> int:
        """``num_kv`` x (codes section + scales section)."""
        return self.num_kv * (self.q_entry_nbytes + self.scale_entry_nbytes)

    def q_offset(self, layer: int, kv: int) -> int:
        """Byte offset of the codes of entry ``kv`` (0 = K, 1 = V) of ``layer``."""
        check(0 <= kv < self.num_kv, "kv", f"an entry index in [0, {self.num_kv})", kv)
        return self.region_offset(layer) + kv * self.q_entry_nbytes

    def scale_offset(self, layer: int, kv: int) -> int:
        """Byte offset of the fp32 scales of entry ``kv`` of ``layer``."""
        check(0 <= kv < self.num_kv, "kv", f"an entry index in [0, {self.num_kv})", kv)
        return self.region_offset(layer) + self.num_kv * self.q_entry_nbytes + kv * self.scale_entry_nbytes

    def gaps(self) -> list[tuple[int, int]]:
        """``[(start, stop)]`` byte ranges *within a region* that hold no data (zeroed by gather)."""
        out = []
        for c in range(self.num_kv):
            q0 = c * self.q_entry_nbytes
            out.append((q0 + self.q_nbytes, q0 + self.q_entry_nbytes))
            s0 = self.num_kv * self.q_entry_nbytes + c * self.scale_entry_nbytes
            out.append((s0 + self.scale_nbytes, s0 + self.scale_entry_nbytes))
        out.append((self.payload_nbytes, self.region_nbytes))
        return [(a, b) for a, b in out if b > a]


def quant_staging_nbytes(layout, num_blocks: int, layers=None, *, quant=None, shuffle=False, granularity="token") -> int:
    """Bytes :func:`gather_quant` needs (``quant=None``: the raw / shuffled size)."""
    _check_scheme(quant, shuffle, granularity)
    if quant == "fp8":
        return QuantStagingFormat.for_layout(layout, num_blocks, layers, granularity).nbytes
    return StagingFormat.for_layout(layout, num_blocks, layers).nbytes


# ------------------------------------------------------------------------------------ fp8 rounding
def fp8_codes(y: torch.Tensor) -> torch.Tensor:
    """fp32 ``y`` -> uint8 e4m3fn codes, saturating round-to-nearest-even, with integer bit ops.

    The same arithmetic as the Triton kernel: bit-identical to
    ``y.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)`` for every non-NaN ``y``;
    every NaN gives ``0x7F``.
    """
    check(y.dtype == torch.float32, "y", "dtype torch.float32", y.dtype, TypeError)
    b = y.view(torch.int32)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    nan = a > 0x7F800000
    a = torch.clamp_max(a, 0x43E00000)  # 448.0: saturate (inf included)
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960  # RNE on the 20 dropped mantissa bits
    # below 2**-6 the e4m3 grid is k * 2**-9: RNE of y * 512 through the 2**23 magic number (exact)
    sub = (a.view(torch.float32) * 512.0 + 8388608.0).view(torch.int32) - 0x4B000000
    code = torch.where(a < 0x3C800000, sub, normal) | sign
    return torch.where(nan, 0x7F, code).to(torch.uint8)


def _decode_codes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.float8_e4m3fn).float()


def fp8_round_to_grid(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> fp32 values exactly on the e4m3 grid (saturating RNE, integer bit ops).

    Bit-identical to ``x.clamp(-448, 448).to(torch.float8_e4m3fn).float()`` for every non-NaN
    input (signed zeros and ties included); NaN stays NaN.

    Examples
    --------
    >>> import torch
    >>> from kvkernels.quant import fp8_round_to_grid
    >>> fp8_round_to_grid(torch.tensor([1.0625, 1.1875, 500.0, -0.0])).tolist()
    [1.0, 1.25, 448.0, -0.0]
    """
    check(isinstance(x, torch.Tensor), "x", "a torch.Tensor", type(x).__name__, TypeError)
    check(x.dtype == torch.float32, "x", "dtype torch.float32", x.dtype, TypeError)
    return _decode_codes(fp8_codes(x.contiguous()))


def _scales(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """``x`` fp32 ``[n, bs, H, D]`` -> scales ``[n, bs, H, 1]`` or ``[n, 1, H, 1]`` (zero rule applied)."""
    a = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x))
    amax = a.amax(dim=-1, keepdim=True)
    if granularity == "block":
        amax = amax.amax(dim=-3, keepdim=True)
    # divided by a tensor on amax's device: torch's CUDA division by a Python scalar multiplies by
    # its reciprocal (off by one ulp from the IEEE quotient for some amax; seen on the H100)
    s = amax / torch.full((), FP8_MAX, dtype=amax.dtype, device=amax.device)
    return torch.where(s > 0, s, torch.ones_like(s))


def quantize_rows(x: torch.Tensor, granularity: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[n, bs, H, D]`` (bf16/fp16/fp32) -> (codes uint8 ``[n, bs, H, D]``, fp32 scales
    ``[n, bs, H]`` or ``[n, H]``), by the definition (``torch``'s own fp8 cast)."""
    xf = x.float()
    s = _scales(xf, granularity)
    y = xf / s
    q = y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    q = torch.where(torch.isnan(y), torch.full_like(q, 0x7F), q)  # one NaN code whatever the sign
    s = s.squeeze(-1)
    return q, (s.squeeze(-2) if granularity == "block" else s)


def dequantize_rows(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype, granularity: str = "token") -> torch.Tensor:
    """Inverse of :func:`quantize_rows`: ``(code * scale)`` in fp32, cast (RNE) to ``dtype``; every
    NaN becomes :data:`CANONICAL_NAN_BITS` (set on the bits: torch's own casts disagree on NaN,
    e.g. its vectorized CPU fp32 -> bf16 path writes ``0xFFFF``)."""
    s = s.unsqueeze(-2) if granularity == "block" else s
    y = _decode_codes(q) * s.unsqueeze(-1)
    out = y.to(dtype)
    ity = torch.int32 if out.element_size() == 4 else torch.int16
    bits = torch.where(torch.isnan(y), torch.full_like(out, 0, dtype=ity) + CANONICAL_NAN_BITS[dtype], out.view(ity))
    return bits.view(dtype)


# ------------------------------------------------------------------ fast CPU forms of the above
# The torch backend is also the CPU fallback (e.g. the LMCache plugin quantizing host chunks), so
# on CPU it runs these: the same fp32 operations in the same order, in place and on cache-sized
# slices, with the rare non-finite rows sent to the definitions above. Bit-identical to them
# (tests/test_quant.py checks it on random, zero, subnormal, inf and NaN rows).
# Elements per set of ops: fp32 temporaries of ~4 MiB. Measured on a llama3-8b chunk in a worker
# thread (CPU host, 3 runs): 1 layer per set 0.4-0.65 GB/s, 4 layers 1.0-1.2, 8 layers 0.8-1.3,
# all 32 layers 0.4-0.5 (the temporaries leave the cache).
_CPU_SLICE_ELEMS = 1 << 20


def _quantize_rows_cpu(x: torch.Tensor, granularity: str, q_out: torch.Tensor, s_out: torch.Tensor) -> None:
    """:func:`quantize_rows` of ``x`` written into ``q_out`` (uint8) and ``s_out`` (fp32)."""
    xf = x.to(torch.float32, copy=True)  # never divide the caller's fp32 cache in place
    amax = xf.abs().amax(dim=-1, keepdim=True)
    if granularity == "block":
        amax = amax.amax(dim=-3, keepdim=True)
    if not bool(torch.isfinite(amax).all()):  # inf/NaN in a row: the definition's masking
        q, s = quantize_rows(x, granularity)
        q_out.copy_(q)
        s_out.copy_(s)
        return
    s = amax.div_(FP8_MAX)
    s.masked_fill_(s == 0, 1.0)  # zero rule (s is never negative here)
    q_out.view(torch.float8_e4m3fn).copy_(xf.div_(s).clamp_(-FP8_MAX, FP8_MAX))  # the cast, into place
    s = s.squeeze(-1)
    s_out.copy_(s.squeeze(-2) if granularity == "block" else s)


_SCALE_FOLD_MAX = torch.finfo(torch.float32).max / 256


def _dequantize_rows_cpu(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype, granularity: str) -> torch.Tensor:
    """:func:`dequantize_rows`, with the e4m3 decode done on int16 bits (torch's own fp8 -> fp32
    cast is scalar on CPU): ``code & 0x7F`` shifted left by 7 is the fp16 whose value is the code's
    magnitude times ``2**-8``, subnormals included, so ``y = fp16 * (256 * s)``. Both products are
    exact but the last, which rounds the same real number as ``code * s``: bit-identical whenever
    ``256 * s`` is finite. NaN codes (``0x7F``/``0xFF``), non-finite or huge scales go to the
    definition."""
    if int((q & 0x7F).amax()) == 0x7F or not bool((s.abs() <= _SCALE_FOLD_MAX).all()):
        return dequantize_rows(q, s, dtype, granularity)
    sb = (s.unsqueeze(-2) if granularity == "block" else s).unsqueeze(-1) * 256.0
    q16 = q.to(torch.int16)
    sign = q16.bitwise_and(0x80).bitwise_left_shift_(8)
    half = q16.bitwise_and_(0x7F).bitwise_left_shift_(7).bitwise_or_(sign).view(torch.float16)
    return half.to(torch.float32).mul_(sb).to(dtype)


def _stack_layers(layout: PagedLayout, layers, c: int) -> torch.Tensor | None:
    """Entry ``c`` of the longest run (>= 2) of ``layers`` that one strided view covers, as a
    ``[k, num_blocks, bs, H, D]`` tensor (layer stride constant, same storage, shape and strides,
    e.g. an LMCache chunk or a cross-layer cache); None when there is none."""
    vs = [layout.views[l][c] for l in layers]
    if len(vs) < 2:
        return None
    v0 = vs[0]
    es, step = v0.element_size(), vs[1].data_ptr() - v0.data_ptr()
    if step <= 0 or step % es:
        return None
    k = 1
    while (k < len(vs) and vs[k].data_ptr() - v0.data_ptr() == k * step and vs[k].stride() == v0.stride()
           and vs[k].untyped_storage().data_ptr() == v0.untyped_storage().data_ptr()):
        k += 1
    if k < 2:
        return None
    return v0.as_strided((k, *v0.shape), (step // es, *v0.stride()), v0.storage_offset())


def _region_sections(out: torch.Tensor, fmt: QuantStagingFormat, j: int, k: int,
                     c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[k, n, bs, H, D]`` (uint8) and scales (fp32 ``[k, n, bs, H]`` or ``[k, n, H]``) of
    entry ``c`` in regions ``j .. j + k - 1`` of ``out``, as views."""
    n, bs, hh, d = fmt.num_blocks, fmt.block_size, fmt.num_heads, fmt.head_dim
    r, layer = fmt.region_nbytes, fmt.layers[j]
    q = out.as_strided((k, n, bs, hh, d), (r, bs * hh * d, hh * d, d, 1),
                       out.storage_offset() + fmt.q_offset(layer, c))
    f32 = out[: fmt.nbytes].view(torch.float32)
    shape = (k, n, bs, hh) if fmt.granularity == "token" else (k, n, hh)
    strides = (r // 4, bs * hh, hh, 1) if fmt.granularity == "token" else (r // 4, hh, 1)
    s = f32.as_strided(shape, strides, f32.storage_offset() + fmt.scale_offset(layer, c) // 4)
    return q, s


def _layer_runs(layout: PagedLayout, fmt: QuantStagingFormat, c: int, group: bool):
    """``(j, k, stacked)`` covering the regions in order: runs of ``k`` layers to convert with one
    set of ops (``stacked``: their view, see :func:`_stack_layers`), else single layers (None).
    Fewer, larger torch ops matter off the main thread: there each op waits ~50-70 us for its
    OpenMP team on the 2-vCPU CI host (docs/PERF_NOTES.md)."""
    per_layer = fmt.num_blocks * fmt.block_size * fmt.num_heads * fmt.head_dim
    most = max(1, _CPU_SLICE_ELEMS // max(1, per_layer)) if group else 1
    j = 0
    while j < fmt.num_regions:
        stk = _stack_layers(layout, fmt.layers[j : j + most], c) if most > 1 else None
        k = 1 if stk is None else stk.shape[0]
        yield j, k, stk
        j += k


def _slices(n: int, row_elems: int):
    step = max(1, _CPU_SLICE_ELEMS // max(1, row_elems))
    return ((i, min(n, i + step)) for i in range(0, n, step))


# ------------------------------------------------------------------------------------ references
_INT_OF_WIDTH = {2: torch.int16, 4: torch.int32}


def _int_view(v: torch.Tensor) -> torch.Tensor:
    """``v`` (a bf16 / fp16 / fp32 cache view or block) as the integer dtype of its width: torch
    refuses in-place writes in the float dtype to caches made under ``torch.inference_mode()``,
    not through such a view; and unlike a byte view it keeps CPU ``index_copy_``'s element count
    (byte views made the CPU FP8 scatter 1.4x slower)."""
    return v.view(_INT_OF_WIDTH[v.element_size()])


def _check_ref_args(layout, block_ids, fmt, buf, name: str, fmt_type) -> None:
    """The exported references' argument checks (:func:`kvkernels.reference._check_args`), plus
    what FP8 needs: a cache dtype it quantizes and a buffer its fp32 scale views can address."""
    from .reference import _check_args

    _check_args(layout, block_ids, fmt, buf, name, fmt_type)
    _check_dtype(layout, "fp8", False)
    _check_aligned(buf, name)


def _ids(layout, block_ids):
    ids = block_ids.to(device=layout.device, dtype=torch.int64)
    valid = (ids >= 0) & (ids < layout.num_blocks)
    return ids, valid


def gather_fp8(layout: PagedLayout, block_ids: torch.Tensor, fmt: QuantStagingFormat, out: torch.Tensor) -> torch.Tensor:
    """Reference FP8 gather: quantize ``block_ids`` of ``fmt.layers`` into ``out[:fmt.nbytes]``.

    ``block_ids`` int32/int64 ``[n]`` (padding / invalid ids -> all-zero codes and scales);
    ``out`` uint8 ``[>= fmt.nbytes]``, 16-byte aligned, written in place; gaps and region padding
    are zeroed. Arguments are checked as in :func:`kvkernels.reference.gather`, before any byte
    is written (the views below are strided into ``out``'s storage: a short ``out`` would be
    written past its end).
    """
    _check_ref_args(layout, block_ids, fmt, out, "out", QuantStagingFormat)
    ids, valid = _ids(layout, block_ids)
    if layout.device.type == "cpu" and out.device.type == "cpu":
        return _gather_fp8_cpu(layout, ids, valid, fmt, out)
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    n = fmt.num_blocks
    out[: fmt.nbytes].zero_()
    keep = valid.view(n, 1, 1, 1)
    for layer in fmt.layers:
        for c in range(fmt.num_kv):
            x = layout.views[layer][c].index_select(0, safe)
            q, s = quantize_rows(x, fmt.granularity)
            q = torch.where(keep, q, torch.zeros_like(q))
            s = torch.where(valid.view((n,) + (1,) * (s.dim() - 1)), s, torch.zeros_like(s))
            qo, so = fmt.q_offset(layer, c), fmt.scale_offset(layer, c)
            out[qo : qo + fmt.q_nbytes].copy_(q.reshape(-1).to(out.device))
            out[so : so + fmt.scale_nbytes].copy_(s.reshape(-1).contiguous().view(torch.uint8).to(out.device))
    return out


def scatter_fp8(staging: torch.Tensor, layout: PagedLayout, block_ids: torch.Tensor, fmt: QuantStagingFormat) -> None:
    """Reference FP8 scatter: dequantize ``staging`` into ``block_ids`` of the cache (in place);
    padding / invalid ids are skipped. Arguments checked as in :func:`gather_fp8`.

    The cache is written through integer views of its width (:func:`_int_view`): torch refuses
    in-place writes in the cache's dtype to tensors made under ``torch.inference_mode()`` (how
    serving code allocates its caches), and every other backend and scheme restores those."""
    _check_ref_args(layout, block_ids, fmt, staging, "staging", QuantStagingFormat)
    ids, valid = _ids(layout, block_ids)
    sel = valid.nonzero().flatten()
    dst = ids.index_select(0, sel)
    if layout.device.type == "cpu" and staging.device.type == "cpu":
        return _scatter_fp8_cpu(staging, layout, sel, dst, fmt)
    # (only the format's bytes cross: the staging may be a slice of a large pinned pool)
    buf = staging[: fmt.nbytes].to(layout.device) if staging.device != layout.device else staging
    n, bs, hh, d = fmt.num_blocks, fmt.block_size, fmt.num_heads, fmt.head_dim
    sshape = (n, bs, hh) if fmt.granularity == "token" else (n, hh)
    for layer in fmt.layers:
        for c in range(fmt.num_kv):
            qo, so = fmt.q_offset(layer, c), fmt.scale_offset(layer, c)
            q = buf[qo : qo + fmt.q_nbytes].view(n, bs, hh, d).index_select(0, sel)
            s = buf[so : so + fmt.scale_nbytes].view(torch.float32).view(sshape).index_select(0, sel)
            y = dequantize_rows(q, s, layout.dtype, fmt.granularity).contiguous()
            _int_view(layout.views[layer][c]).index_copy_(0, dst, _int_view(y))


def _gather_fp8_cpu(layout: PagedLayout, ids, valid, fmt: QuantStagingFormat, out: torch.Tensor) -> torch.Tensor:
    """:func:`gather_fp8` on CPU: codes and scales written straight into ``out``, slice by slice."""
    n, bs, hh, d = fmt.num_blocks, fmt.block_size, fmt.num_heads, fmt.head_dim
    for j in range(fmt.num_regions):
        for a, b in fmt.gaps():
            out[j * fmt.region_nbytes + a : j * fmt.region_nbytes + b].zero_()
    sshape = (n, bs, hh) if fmt.granularity == "token" else (n, hh)
    all_valid = bool(valid.all())
    for c in range(fmt.num_kv):
        for r, k, stk in _layer_runs(layout, fmt, c, all_valid):
            if stk is not None:  # k layers, every id valid: one set of ops
                x = stk[:, int(ids[0])].unsqueeze(1) if n == 1 else stk.index_select(1, ids)
                _quantize_rows_cpu(x, fmt.granularity, *_region_sections(out, fmt, r, k, c))
                continue
            q_out, s_out = (t[0] for t in _region_sections(out, fmt, r, 1, c))
            view = layout.views[fmt.layers[r]][c]
            for i, j in _slices(n, bs * hh * d):
                v = valid[i:j]
                if bool(v.all()):  # a run of valid ids: no masking pass
                    x = view[int(ids[i])].unsqueeze(0) if j - i == 1 else view.index_select(0, ids[i:j])
                    _quantize_rows_cpu(x, fmt.granularity, q_out[i:j], s_out[i:j])
                    continue
                q_out[i:j].zero_()  # padding / invalid slots: all-zero codes and scales
                s_out[i:j].zero_()
                keep = v.nonzero().flatten()
                if keep.numel():
                    q = torch.empty((keep.numel(), bs, hh, d), dtype=torch.uint8)
                    s = torch.empty((keep.numel(),) + sshape[1:], dtype=torch.float32)
                    _quantize_rows_cpu(view.index_select(0, ids[i:j].index_select(0, keep)), fmt.granularity, q, s)
                    q_out[i:j].index_copy_(0, keep, q)
                    s_out[i:j].index_copy_(0, keep, s)
    return out


def _scatter_fp8_cpu(staging: torch.Tensor, layout: PagedLayout, sel, dst, fmt: QuantStagingFormat) -> None:
    """:func:`scatter_fp8` on CPU, slice by slice (``sel``: staging slots to restore, ``dst``:
    their blocks)."""
    n, bs, hh, d = fmt.num_blocks, fmt.block_size, fmt.num_heads, fmt.head_dim
    identity = sel.numel() == n
    for c in range(fmt.num_kv):
        for r, k, stk in _layer_runs(layout, fmt, c, identity):
            if stk is not None:  # k layers, every slot restored: one set of ops
                y = _dequantize_rows_cpu(*_region_sections(staging, fmt, r, k, c), layout.dtype, fmt.granularity)
                if n == 1:
                    _int_view(stk[:, int(dst[0])]).copy_(_int_view(y[:, 0]))
                else:
                    _int_view(stk).index_copy_(1, dst, _int_view(y))
                continue
            q_all, s_all = (t[0] for t in _region_sections(staging, fmt, r, 1, c))
            view = layout.views[fmt.layers[r]][c]
            for i, j in _slices(sel.numel(), bs * hh * d):
                if identity:  # every slot restored: contiguous slices, no index copies
                    q, s = q_all[i:j], s_all[i:j]
                else:
                    q, s = q_all.index_select(0, sel[i:j]), s_all.index_select(0, sel[i:j])
                y = _dequantize_rows_cpu(q, s, layout.dtype, fmt.granularity)
                if j - i == 1:  # index_copy_ is elementwise on CPU; one block is one strided copy
                    _int_view(view[int(dst[i])]).copy_(_int_view(y[0]))
                else:
                    _int_view(view).index_copy_(0, dst[i:j], _int_view(y))


def _entries(fmt: StagingFormat):
    for j in range(fmt.num_regions):
        for c in range(fmt.num_kv):
            yield j * fmt.region_nbytes + c * fmt.entry_nbytes


def gather_shuffle(layout: PagedLayout, block_ids: torch.Tensor, fmt: StagingFormat, out: torch.Tensor) -> torch.Tensor:
    """Reference shuffled gather: the raw staging with each entry split into its high-byte plane
    then its low-byte plane (16-bit caches; little-endian element bytes)."""
    from . import reference

    reference._check_args(layout, block_ids, fmt, out, "out")  # (the raw gather below fills its own buffer)
    raw = reference.gather(layout, block_ids, fmt, torch.empty(fmt.nbytes, dtype=torch.uint8, device=layout.device))
    half = fmt.entry_nbytes // 2
    for off in _entries(fmt):
        e = raw[off : off + fmt.entry_nbytes].view(half, 2)
        out[off : off + half].copy_(e[:, 1])
        out[off + half : off + fmt.entry_nbytes].copy_(e[:, 0])
    for j in range(fmt.num_regions):
        out[j * fmt.region_nbytes + fmt.payload_nbytes : (j + 1) * fmt.region_nbytes].zero_()
    return out


def scatter_shuffle(staging: torch.Tensor, layout: PagedLayout, block_ids: torch.Tensor, fmt: StagingFormat) -> None:
    """Reference shuffled scatter: undo the plane split, then the raw scatter (in place)."""
    from . import reference

    reference._check_args(layout, block_ids, fmt, staging, "staging")  # (the raw scatter reads its own copy)
    # (only the format's bytes cross: the staging may be a slice of a large pinned pool)
    buf = staging[: fmt.nbytes].to(layout.device) if staging.device != layout.device else staging
    raw = torch.zeros(fmt.nbytes, dtype=torch.uint8, device=layout.device)
    half = fmt.entry_nbytes // 2
    for off in _entries(fmt):
        e = raw[off : off + fmt.entry_nbytes].view(half, 2)
        e[:, 1].copy_(buf[off : off + half])
        e[:, 0].copy_(buf[off + half : off + fmt.entry_nbytes])
    reference.scatter(raw, layout, block_ids, fmt)


# ------------------------------------------------------------------------------------ public ops
def _check_scheme(quant, shuffle, granularity) -> None:
    check(quant in QUANT_SCHEMES, "quant", "None or 'fp8'", repr(quant))
    check(isinstance(shuffle, bool), "shuffle", "a bool", repr(type(shuffle)), TypeError)
    check(not (quant == "fp8" and shuffle), "shuffle", "False with quant='fp8' (e4m3 codes are single bytes)", True)
    _check_granularity(granularity)


def _check_dtype(layout: PagedLayout, quant, shuffle) -> None:
    dt = layout.dtype
    if quant == "fp8":
        if dt in _FP8_DTYPES or dt == torch.uint8:
            fail(
                "quant",
                "None for an 8-bit cache: fp8 caches (per-layer scales) pass through raw without re-quantizing",
                f"quant='fp8' on a {dt} cache",
            )
        check(dt in FP8_SOURCE_DTYPES, "quant", "a bfloat16, float16 or float32 cache for quant='fp8'", f"a {dt} cache")
    if shuffle:
        check(
            layout.element_size == 2,
            "shuffle",
            "a cache with a 16-bit dtype (bfloat16, float16) for shuffle=True",
            f"a {dt} cache ({layout.element_size}-byte elements)",
        )


def _check_aligned(buf: torch.Tensor, name: str) -> None:
    check(buf.data_ptr() % SECTION_ALIGN == 0, name, "a 16-byte aligned buffer for quant='fp8' (fp32 scales)",
          f"address {buf.data_ptr():#x}")
    # the kernels view the buffer as int32/fp32 (torch needs the offset in its storage to be a
    # multiple of 4 too: an aligned address on a storage that starts off-alignment is refused there)
    check(int(buf.storage_offset()) % 4 == 0, name, "a buffer at a multiple of 4 bytes from its storage's start for "
          "quant='fp8' (torch views it as fp32 scales)", f"storage offset {buf.storage_offset()}")


# (direction, scheme) -> backend -> (module, function). Gathers take (layout, ids, fmt, out, err,
# cap), scatters (staging, layout, ids, fmt, err, cap); the torch references ignore err and cap.
_KERNELS = {
    ("gather", "fp8"): {"triton": ("kvkernels.triton_ops.quant_gather", "quant_gather_triton"),
                        "cuda": ("kvkernels._cuda", "quant_gather_cuda"), "torch": (__name__, "gather_fp8")},
    ("gather", "shuffle"): {"triton": ("kvkernels.triton_ops.shuffle_gather", "shuffle_gather_triton"),
                            "cuda": ("kvkernels._cuda", "shuffle_gather_cuda"), "torch": (__name__, "gather_shuffle")},
    ("scatter", "fp8"): {"triton": ("kvkernels.triton_ops.dequant_scatter", "dequant_scatter_triton"),
                         "cuda": ("kvkernels._cuda", "dequant_scatter_cuda"), "torch": (__name__, "scatter_fp8")},
    ("scatter", "shuffle"): {"triton": ("kvkernels.triton_ops.unshuffle_scatter", "unshuffle_scatter_triton"),
                             "cuda": ("kvkernels._cuda", "unshuffle_scatter_cuda"), "torch": (__name__, "scatter_shuffle")},
}


def _kernel(direction: str, quant, backend: str):
    """The implementation of ``direction`` for the scheme on ``backend`` (imported on first use),
    called with the common signature (see :data:`_KERNELS`)."""
    import importlib

    mod, name = _KERNELS[(direction, "fp8" if quant == "fp8" else "shuffle")][backend]
    fn = getattr(importlib.import_module(mod), name)
    if backend != "torch":
        return fn
    if direction == "gather":
        return lambda layout, ids, fmt, out, err, cap: fn(layout, ids, fmt, out)
    return lambda staging, layout, ids, fmt, err, cap: fn(staging, layout, ids, fmt)


def _setup(layout, block_ids, layers, validate, backend, unique, quant, shuffle, granularity, max_ctas):
    """Shared checks of gather_quant / scatter_quant: ``(layout, ids, fmt, backend, cap)``."""
    layout, ids, raw, b = _prepare(layout, block_ids, layers, validate, backend, unique=unique)
    _check_dtype(layout, quant, shuffle)
    fmt = QuantStagingFormat.from_staging(raw, granularity) if quant == "fp8" else raw
    return layout, ids, fmt, b, _caps(max_ctas)


def gather_quant(
    layout: PagedLayout,
    block_ids,
    *,
    quant: str | None = None,
    shuffle: bool = False,
    granularity: str = "token",
    out: torch.Tensor | None = None,
    layers=None,
    backend: str = "auto",
    max_ctas: int | None = None,
    validate: bool | None = None,
) -> torch.Tensor:
    """:func:`kvkernels.gather` with fused FP8 quantization or byte-plane shuffle.

    Parameters
    ----------
    layout : PagedLayout
        The cache (read only). ``quant="fp8"``: bfloat16, float16 or float32. ``shuffle=True``:
        a 16-bit dtype.
    block_ids : Tensor or sequence of int
        ``[n]`` int32/int64 (CPU or cache device); ``-1`` = padding (all-zero bytes); duplicates allowed.
    quant : {None, "fp8"}
        ``"fp8"``: write the :class:`QuantStagingFormat` (e4m3 codes + fp32 scales).
    shuffle : bool
        Write each entry as its high-byte plane then its low-byte plane (not with ``quant``).
    granularity : {"token", "block"}
        FP8 scale per (token, head) or per (block, head).
    out : Tensor, optional
        ``[>= quant_staging_nbytes]`` uint8, contiguous (16-byte aligned for fp8), on the cache
        device or pinned host memory; written in place; allocated when ``None``.
    layers, backend, max_ctas, validate
        As in :func:`kvkernels.gather`.

    Returns
    -------
    Tensor
        ``out``.

    Examples
    --------
    >>> import torch, kvkernels
    >>> from kvkernels.quant import gather_quant, scatter_quant
    >>> lay = kvkernels.PagedLayout.from_vllm([torch.randn(2, 8, 16, 2, 64).bfloat16()])
    >>> buf = gather_quant(lay, [3, 5], quant="fp8")
    >>> buf.numel()
    12288
    >>> scatter_quant(buf, lay, [0, 1], quant="fp8")
    >>> bool(((lay.views[0][0][0].float() - lay.views[0][0][3].float()).abs().max() < 0.2))
    True
    """
    _check_scheme(quant, shuffle, granularity)
    if quant is None and not shuffle:
        from .ops import gather

        return gather(layout, block_ids, out=out, layers=layers, backend=backend, max_ctas=max_ctas, validate=validate)
    layout, ids, fmt, b, cap = _setup(layout, block_ids, layers, validate, backend, False, quant, shuffle, granularity, max_ctas)
    if out is None:
        out = torch.empty(fmt.nbytes, dtype=torch.uint8, device=layout.device)
    else:
        _check_buffer(out, "out", layout, fmt.nbytes)
    if quant == "fp8":
        _check_aligned(out, "out")
    if fmt.nbytes == 0:
        return out
    err = _err_counter(layout.device)
    if b == "torch":
        err += ((ids < -1) | (ids >= layout.num_blocks)).sum().to(torch.int32)
    with on_cache_device(layout):
        _kernel("gather", quant, b)(layout, ids, fmt, out, err, cap)
    return out


def scatter_quant(
    staging: torch.Tensor,
    layout: PagedLayout,
    block_ids,
    *,
    quant: str | None = None,
    shuffle: bool = False,
    granularity: str = "token",
    layers=None,
    backend: str = "auto",
    max_ctas: int | None = None,
    validate: bool | None = None,
    scheme: str | None = None,
) -> None:
    """:func:`kvkernels.scatter` of a buffer written by :func:`gather_quant` with the same
    ``quant`` / ``shuffle`` / ``granularity`` / ``layers``: dequantizes (RNE into the cache dtype)
    or un-shuffles in the same pass, in place.

    Parameters
    ----------
    staging : Tensor
        ``[>= quant_staging_nbytes]`` uint8 (16-byte aligned for fp8), cache device or pinned host.
    layout : PagedLayout
        Destination cache (written in place); same dtype rules as :func:`gather_quant`.
    block_ids : Tensor or sequence of int
        ``[n]`` distinct destination blocks; ``-1`` skips the slot.
    quant, shuffle, granularity, layers, backend, max_ctas, validate
        As in :func:`gather_quant`. The scheme is not recorded in the buffer: the caller must
        pass the one the buffer was written with, or ``scheme``.
    scheme : str, optional
        The store header's scheme (``header.meta.scheme``: ``"raw"``, ``"shuffle"``,
        ``"fp8-token"``, ``"fp8-block"``): sets ``quant`` / ``shuffle`` / ``granularity``. An
        explicit ``quant`` or ``shuffle`` that contradicts it raises ``ValueError`` before
        anything is written (a buffer written with FP8 restored as raw, or the reverse).
    """
    if scheme is not None:
        want = scheme_args(scheme)
        # granularity's default ("token") cannot be told from an explicit "token"; "block" can
        if ((quant is not None and quant != want["quant"]) or (shuffle and not want["shuffle"])
                or (granularity != "token" and granularity != want["granularity"])):
            fail("scheme", f"quant={want['quant']!r}, shuffle={want['shuffle']} for a buffer stored as {scheme!r}",
                 f"quant={quant!r}, shuffle={shuffle}, granularity={granularity!r}")
        quant, shuffle, granularity = want["quant"], want["shuffle"], want["granularity"]
    _check_scheme(quant, shuffle, granularity)
    if quant is None and not shuffle:
        from .ops import scatter

        return scatter(staging, layout, block_ids, layers=layers, backend=backend, max_ctas=max_ctas, validate=validate)
    layout, ids, fmt, b, cap = _setup(layout, block_ids, layers, validate, backend, True, quant, shuffle, granularity, max_ctas)
    _check_buffer(staging, "staging", layout, fmt.nbytes)
    if quant == "fp8":
        _check_aligned(staging, "staging")
    if fmt.nbytes == 0:
        return None
    err = _err_counter(layout.device)
    if b == "torch":
        err += ((ids < -1) | (ids >= layout.num_blocks)).sum().to(torch.int32)
    with on_cache_device(layout):
        _kernel("scatter", quant, b)(staging, layout, ids, fmt, err, cap)
    return None
