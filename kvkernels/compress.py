"""Lossless compression of staging buffers, one compressed stream per layer region.

A staging buffer (:mod:`kvkernels.staging`) is compressed region by region: region ``j`` (layer
``fmt.layers[j]``) becomes one byte string of ``stored_nbytes[j]`` bytes that decodes to the
region's ``payload_nbytes`` meaningful bytes (the zero padding up to 4096 is not stored; it is
written back as zeros). Each region decodes alone, so one layer can be restored without the
others. The exact stream formats are in ``docs/compress.md``.

Codecs
------
``"zstd"``  portable: standard Zstandard frames that any zstd library reads (the ``zstandard``
            package, the ``zstd`` CLI). On the CPU it runs through ``zstandard``; on a CUDA
            staging buffer through nvCOMP's zstd with the RAW bitstream (same format).
``"ans"``   nvCOMP's ANS (native nvCOMP bitstream, 16-bit float hint ``'<f2'`` for 16-bit
            payloads): the fast GPU default (~1.4x on bf16 KV at ~100+ GB/s on an H100).
            nvCOMP-only: a file written with it needs nvCOMP on a GPU to be read.
``"gdeflate"``, ``"lz4"``  nvCOMP native bitstreams, for comparison (LZ4 with its bitshuffle mode).
``"none"``  the payload bytes as they are.
``"auto"``  ``"ans"`` for a CUDA staging buffer when nvCOMP imports, else ``"zstd"`` (without
            nvCOMP, zstd of a CUDA buffer is encoded / decoded on the host, same format).

Raw fallback: a region whose compressed size would be >= its payload is stored as the payload
itself, so ``stored_nbytes[j] == raw_nbytes[j]`` always means "stored uncompressed" (a
compressed region is always strictly smaller). A store therefore never needs more than the
region size per region.

``byteshuffle=True`` splits each region's payload into byte planes before compressing (for
16-bit elements: the high-byte plane of every element, then the low-byte plane; in general
most significant plane first) and merges them back after decompression. It helps the portable
codecs on bf16 (zstd 1.27x -> 1.42x on real KV, field notes section 5); ANS with the ``'<f2'``
hint already models the two bytes and gains nothing from it.

Errors: an unknown codec, a GPU codec without a GPU, and a truncated or corrupted region all
raise (``ValueError`` / ``RuntimeError``) from :func:`decompress_regions` before it returns, so
nothing reaches a cache: decompress fully, then :func:`kvkernels.scatter`.

Example
-------
>>> import torch, kvkernels
>>> from kvkernels.compress import compress_regions, decompress_regions
>>> caches = [torch.randn(2, 8, 16, 2, 64).to(torch.bfloat16) for _ in range(3)]
>>> layout = kvkernels.PagedLayout.from_vllm(caches)
>>> staging = kvkernels.gather(layout, [5, 1, 7])
>>> fmt = kvkernels.StagingFormat.for_layout(layout, 3)
>>> packed = compress_regions(staging, fmt, codec="zstd", byteshuffle=True)
>>> bool(torch.equal(decompress_regions(packed), staging))
True
"""

from __future__ import annotations

import concurrent.futures as _cf
import os
import struct
import threading
from dataclasses import dataclass, field
from typing import TypeGuard

import torch

from . import config
from ._validate import check, check_index, check_int, check_tensor, describe, fail, same_device
from .quant import QuantStagingFormat, store_scheme
from .staging import StagingFormat, normalize_layers

__all__ = [
    "CODECS",
    "CompressedStaging",
    "compress_regions",
    "decompress_regions",
    "byteshuffle",
    "byteunshuffle",
    "available_codecs",
    "CHUNK_NBYTES",
]

CODECS = ("none", "zstd", "ans", "gdeflate", "lz4")
_GPU_ONLY = ("ans", "gdeflate", "lz4")
_NVCOMP_NAME = {"ans": "ANS", "gdeflate": "GDeflate", "lz4": "LZ4", "zstd": "zstd"}

#: Uncompressed bytes per zstd frame / nvCOMP chunk. 64 KiB is nvCOMP's default chunk and keeps
#: thousands of chunks in flight on a GPU; on the real-KV sample (SmolLM2-135M, bf16) zstd level 3
#: loses < 1% of ratio against one frame per region (docs/compress.md).
CHUNK_NBYTES = 1 << 16

#: zstd level of the CPU encoder (1..22). Level 3 (zstd's default) measured the same ratio as
#: level 9 on real bf16 KV within 1% at 3-4x the speed (docs/compress.md).
ZSTD_LEVEL = 3

# Skippable zstd frame carrying the frame table (docs/compress.md, "zstd region format").
_SKIP_MAGIC = 0x184D2A50
_TABLE_TAG = b"KVKZ"
# skip magic, frame size, tag, version, chunk, raw, nframes, flags. Version 1 (before 2026-11-25)
# had no flags word: it is still read, without the plane check (its frames do not say it: an entry
# whose half is a multiple of the chunk is cut the same way as planes or as one payload).
_TABLE_HEAD = struct.Struct("<II4sIIQII")
_TABLE_HEAD_V1 = struct.Struct("<II4sIIQI")
_TABLE_VERSION = 2
_TABLE_PLANES = 1  # flags: the payload's entries are stored as byte planes (scheme "shuffle")

# The kvkernels header in front of every nvCOMP native stream (ANS / GDeflate / LZ4; docs/compress.md,
# "ANS / GDeflate / LZ4 region"). nvCOMP's own header records neither the length the stream was
# stored with nor the options its decoder must be built with (element data type, bitshuffle), and
# its ANS decoder decoded a region cut to half its length without an error (H100, 2026-11-23): this
# header makes truncation, a codec mix-up and an options mismatch errors before anything is decoded.
_NV_TAG = b"KVKN"
_NV_HEAD = struct.Struct("<4sHHHHIQQ")  # tag, version, codec id, element size, flags, 0, stream bytes, raw bytes
_NV_VERSION = 1
_NV_CODEC_ID = {"ans": 1, "gdeflate": 2, "lz4": 3}
_NV_PLANES = 1  # flag: the payload was encoded as byte planes (no element data type given to nvCOMP)
_NV_CHECKSUM = 2  # flag: nvCOMP computed its checksums at encode (ChecksumPolicy.COMPUTE_AND_VERIFY)


# --------------------------------------------------------------------------------------- formats
def _is_fp8(fmt: object) -> TypeGuard[QuantStagingFormat]:
    """An FP8 staging format (``kvkernels.quant.QuantStagingFormat``)."""
    return hasattr(fmt, "granularity") and hasattr(fmt, "q_entry_nbytes")


def _esize(fmt) -> int:
    """Bytes per element of a format's payload (1 for FP8 staging: codes and scales are opaque)."""
    return 1 if _is_fp8(fmt) else int(fmt.element_size)


def _entries(fmt) -> list[tuple[int, int]]:
    """``[(offset in the region, nbytes)]`` of the entries (K, V) of one region's payload."""
    if hasattr(fmt, "entry_nbytes") and hasattr(fmt, "num_kv") and not _is_fp8(fmt):
        return [(c * fmt.entry_nbytes, fmt.entry_nbytes) for c in range(fmt.num_kv)]
    return [(0, fmt.payload_nbytes)]


def _check_fmt(fmt) -> None:
    ok = all(hasattr(fmt, a) for a in ("layers", "region_nbytes", "payload_nbytes", "num_regions", "region_index"))
    check(ok, "fmt", "a kvkernels.StagingFormat or kvkernels.quant.QuantStagingFormat", type(fmt).__name__, TypeError)


# --------------------------------------------------------------------------------------- shuffle
def _check_planes(element_size: int, name: str = "byteshuffle") -> int:
    """Byte planes (``name``: the argument asking for them) exist for 16-bit elements only."""
    check(element_size == 2, name, "16-bit elements (bf16 / fp16 staging, element_size 2)",
          f"element_size {element_size}")
    return element_size


def _check_bytes(t, name: str) -> None:
    """A byte buffer argument: a tensor, uint8, 1-D, contiguous."""
    check_tensor(t, name)
    check(t.dtype == torch.uint8, name, "dtype torch.uint8", t.dtype, TypeError)
    check(t.dim() == 1 and (t.stride(0) == 1 or t.numel() <= 1), name, "a contiguous 1-D buffer", describe(t))


def _overlaps(a_ptr: int, a_len: int, b_ptr: int, b_len: int) -> bool:
    """Whether two non-empty byte ranges share memory."""
    return a_len > 0 and b_len > 0 and a_ptr < b_ptr + b_len and b_ptr < a_ptr + a_len


def _check_out_bytes(out, src) -> None:
    """``out`` of a plane (un)shuffle: uint8, 1-D, contiguous, as long as ``src``, on its device,
    not overlapping it (the copies read ``src`` while they write ``out``)."""
    _check_bytes(out, "out")
    check(out.numel() == src.numel(), "out", f"{src.numel()} bytes (as many as the input)", out.numel())
    check(out.device == src.device, "out", f"device {src.device} (the input's)", out.device)
    check(not _overlaps(out.data_ptr(), out.numel(), src.data_ptr(), src.numel()), "out",
          "memory apart from the input (the shuffle is not in place)", "a buffer overlapping it")


def byteshuffle(payload: torch.Tensor, element_size: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Split ``payload`` into byte planes, most significant plane first (``element_size`` 2).

    Parameters
    ----------
    payload : Tensor
        ``[n * element_size]`` uint8, contiguous, little-endian elements (any device).
    element_size : int
        2 (bf16/fp16): the high-byte plane, then the low-byte plane (the definition of
        ``kvkernels.quant``'s shuffle staging, applied per entry).
    out : Tensor, optional
        ``[n * element_size]`` uint8, written in place; must not alias ``payload``.

    Returns
    -------
    Tensor
        Plane ``p`` (``p = 0`` the most significant byte of every element) occupies
        ``out[p * n:(p + 1) * n]``.
    """
    e = _check_planes(check_index(element_size, "element_size"), "element_size")
    _check_bytes(payload, "payload")
    check(payload.numel() % e == 0, "payload", f"a multiple of {e} bytes", payload.numel())
    n = payload.numel() // e
    if out is None:
        out = torch.empty(payload.numel(), dtype=torch.uint8, device=payload.device)
    else:
        _check_out_bytes(out, payload)
    for p in range(e):  # strided slice copies: ~10x faster on CPU than a flip + transpose
        out[p * n:(p + 1) * n].copy_(payload[e - 1 - p::e])
    return out


def byteunshuffle(planes: torch.Tensor, element_size: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`byteshuffle`: ``[n * element_size]`` uint8 planes -> interleaved bytes."""
    e = _check_planes(check_index(element_size, "element_size"), "element_size")
    _check_bytes(planes, "planes")
    check(planes.numel() % e == 0, "planes", f"a multiple of {e} bytes", planes.numel())
    n = planes.numel() // e
    if out is None:
        out = torch.empty(planes.numel(), dtype=torch.uint8, device=planes.device)
    else:
        _check_out_bytes(out, planes)
    for p in range(e):
        out[e - 1 - p::e].copy_(planes[p * n:(p + 1) * n])
    return out


_split_planes = byteshuffle  # (compress_regions has a `byteshuffle` flag)


# ------------------------------------------------------------------------------- compressed form
@dataclass
class CompressedStaging:
    """The compressed regions of one staging buffer.

    Attributes
    ----------
    fmt : StagingFormat
        The staging format the regions decode into (its layers are the stored layers).
    codec : str
        One of :data:`CODECS` (never ``"auto"``).
    regions : list of Tensor
        Region ``j``: ``[stored_nbytes[j]]`` uint8, contiguous, on the device that compressed it
        (CPU for the portable codec on CPU, CUDA for nvCOMP). Pass these to the store
        (``KVStore.put(key, regions, meta)``).
    stored_nbytes, raw_nbytes : tuple of int
        Bytes stored per region, and the uncompressed payload per region
        (``fmt.payload_nbytes``). ``stored == raw`` means the region is stored uncompressed.
    byteshuffle : bool
        Whether payloads were split into byte planes before compression.
    """

    fmt: StagingFormat | QuantStagingFormat
    codec: str
    regions: list
    stored_nbytes: tuple
    raw_nbytes: tuple
    byteshuffle: bool = False
    chunk_nbytes: int = CHUNK_NBYTES
    extra: dict = field(default_factory=dict)
    staging_scheme: str = "raw"  # how the staging itself was gathered: raw, shuffle, fp8-token, fp8-block

    @property
    def nbytes(self) -> int:
        """Total stored bytes."""
        return sum(self.stored_nbytes)

    @property
    def ratio(self) -> float:
        """Uncompressed payload bytes / stored bytes."""
        return sum(self.raw_nbytes) / max(1, self.nbytes)

    @property
    def scheme(self) -> str:
        """The store header's ``scheme``: what the *stored* payload bytes are.

        ``"fp8-token"`` / ``"fp8-block"`` for FP8 staging; ``"shuffle"`` when the stored bytes
        are byte planes (a staging gathered with ``shuffle=True``, or planes split here with
        ``byteshuffle=True``: the bytes are the same); ``"raw"`` otherwise. To restore the
        output of :func:`decompress_regions`, use :attr:`restore_scheme`: the decoder rejoins
        planes it split itself."""
        if self.staging_scheme.startswith("fp8"):
            return self.staging_scheme
        return "shuffle" if self.byteshuffle or self.staging_scheme == "shuffle" else "raw"

    @property
    def restore_scheme(self) -> str:
        """How the staging :func:`decompress_regions` returns must be scattered
        (``scatter_quant(..., scheme=...)``, :func:`kvkernels.quant.scheme_args` maps it back):
        the staging's own scheme — byte planes split by ``byteshuffle=True`` are rejoined by
        the decoder, so they are ``"raw"`` again; a staging gathered with ``shuffle=True`` stays
        ``"shuffle"``."""
        return self.staging_scheme

    @classmethod
    def from_buffer(cls, buf: torch.Tensor, fmt: StagingFormat | QuantStagingFormat, stored_nbytes, codec: str, *,
                    byteshuffle: bool = False, scheme: str | None = None,
                    region_stride: int | None = None) -> "CompressedStaging":
        """Wrap regions read back from a store: region ``j`` at ``buf[j * region_stride:]``.

        ``stored_nbytes`` comes from the store header (``[r.stored for r in header.regions]``).
        ``scheme``: the header's scheme, optional; with it, :attr:`restore_scheme` is right for a
        ``shuffle`` entry decoded without ``byteshuffle`` (the planes stay: ``"shuffle"``).
        ``region_stride``: bytes from one region's start to the next in ``buf``, default
        ``fmt.region_nbytes``. ``KVStore.get(key)`` lays an entry's regions out at the size of its
        raw staging format, ``header.meta.fmt.region_nbytes``: pass that (an FP8 staging format's
        regions are smaller, so its default would read the regions from the wrong places).
        With codec ``none`` a stored size up to the region size (a whole padded region) is taken
        as its payload.
        """
        _check_bytes(buf, "buf")  # contiguous too: nvCOMP takes the regions' addresses as spans
        _check_fmt(fmt)
        codec = _check_codec(codec, allow_auto=False)
        stored = tuple(check_index(s, f"stored_nbytes[{j}]") for j, s in enumerate(stored_nbytes))
        check(len(stored) == fmt.num_regions, "stored_nbytes", f"{fmt.num_regions} sizes", len(stored))
        n = fmt.payload_nbytes
        lo = 0 if n == 0 else 1  # an empty staging (no blocks) stores empty regions
        # a codec's region is never larger than its payload (one that did not shrink is stored raw)
        hi = fmt.region_nbytes if codec == "none" else n
        for j, s in enumerate(stored):
            check(lo <= s <= hi, f"stored_nbytes[{j}]", f"{lo}..{hi}", s)
        if codec == "none":  # a whole padded region: its payload, the padding is not the entry's
            stored = tuple(min(s, n) for s in stored)
        pitch = fmt.region_nbytes if region_stride is None else check_int(region_stride, "region_stride", lo=0)
        widest = max(stored, default=0)
        check(pitch >= widest, "region_stride", f"at least the largest stored region ({widest} bytes)", pitch)
        need = (fmt.num_regions - 1) * pitch + stored[-1] if stored else 0
        check(buf.numel() >= need, "buf", f"at least {need} bytes (all stored regions)", f"{buf.numel()} bytes")
        check(isinstance(byteshuffle, bool), "byteshuffle", "a bool", type(byteshuffle).__name__, TypeError)
        if byteshuffle or scheme == "shuffle":  # as compress_regions: planes of 16-bit elements only
            _check_planes(_esize(fmt), "byteshuffle" if byteshuffle else "scheme")
        regions = [buf[j * pitch: j * pitch + s] for j, s in enumerate(stored)]
        own = store_scheme(quant="fp8", granularity=fmt.granularity) if _is_fp8(fmt) else "raw"
        if scheme is not None:
            allowed = (own,) if _is_fp8(fmt) else ("raw", "shuffle")
            check(scheme in allowed, "scheme", f"one of {allowed} for this staging format", repr(scheme))
            # a raw entry's bytes are not planes: un-shuffling them would return garbage silently
            check(not (byteshuffle and scheme == "raw"), "byteshuffle", "False for a 'raw' entry (not byte planes)",
                  True)
            if scheme == "shuffle" and not byteshuffle:  # decoded as stored: the planes stay
                own = "shuffle"
        return cls(fmt, codec, regions, stored, (fmt.payload_nbytes,) * fmt.num_regions, byteshuffle,
                   staging_scheme=own)


# ------------------------------------------------------------------------------------- helpers
_NVCOMP_IMPORT: list = []  # [module] once nvCOMP imported, [ImportError] once it did not


def _nvcomp():
    """Import nvCOMP lazily (``RuntimeError`` with install hint). The outcome is kept: a missing
    nvCOMP made every CUDA call of ``_resolve_codec`` / ``available_codecs`` search the import
    path again."""
    if not _NVCOMP_IMPORT:
        try:
            import nvidia.nvcomp as nvcomp  # noqa: PLC0415
        except ImportError as exc:  # pragma: no cover - depends on the machine
            _NVCOMP_IMPORT.append(exc)
        else:
            _NVCOMP_IMPORT.append(nvcomp)
    got = _NVCOMP_IMPORT[0]
    if isinstance(got, ImportError):
        from ._wheels import hint

        raise RuntimeError(f"nvCOMP is not installed: {hint('nvidia-nvcomp')}") from got
    return got


def available_codecs(device="cpu") -> tuple[str, ...]:
    """Codecs that :func:`compress_regions` can run for a staging buffer on ``device``."""
    dev = torch.device(device)
    out = ["none"]
    if dev.type == "cuda" and _have_nvcomp():
        out += ["zstd", "ans", "gdeflate", "lz4"]
    else:  # zstd through the `zstandard` package (a CUDA buffer without nvCOMP: on a host copy)
        try:
            import zstandard  # noqa: F401, PLC0415

            out.append("zstd")
        except ImportError:
            pass
    return tuple(out)


def _have_nvcomp() -> bool:
    try:
        _nvcomp()
        return True
    except RuntimeError:
        return False


def _check_codec(codec, *, allow_auto: bool) -> str:
    if not isinstance(codec, str):
        fail("codec", "a codec name (str)", type(codec).__name__, TypeError)
    c = codec.lower()
    names = CODECS + (("auto",) if allow_auto else ())
    check(c in names, "codec", f"one of {names}", repr(codec))
    return c


def _resolve_codec(codec: str, device: torch.device) -> str:
    c = _check_codec(codec, allow_auto=True)
    if c == "auto":
        # without nvCOMP a CUDA buffer's zstd runs on the host (compress_regions copies it there)
        return "ans" if device.type == "cuda" and _have_nvcomp() else "zstd"
    if c in _GPU_ONLY and device.type != "cuda":
        raise RuntimeError(
            f"{c.upper() if c == 'ans' else c} needs nvCOMP on a GPU; use zstd for portable files "
            f"(staging buffer is on {device})"
        )
    return c


def _zstd():
    try:
        import zstandard  # noqa: PLC0415
    except ImportError as exc:
        raise RuntimeError("the portable zstd codec needs the `zstandard` package: pip install zstandard") from exc
    return zstandard


_POOL: _cf.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _new_pool_in_child() -> None:
    """A forked child has none of the pool's threads, but the executor still counts them and
    starts none: its first submit waited forever. The child builds its own on first use (and its
    lock anew: another thread may have held it at the fork)."""
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_pool_in_child)


def _pool() -> _cf.ThreadPoolExecutor:
    """Threads for the CPU codec (zstandard releases the GIL)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = _cf.ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1), thread_name_prefix="kvk-zstd")
        return _POOL


def _segments(fmt, planes: bool) -> list[tuple[int, int]]:
    """``[(offset in the region, nbytes)]`` that zstd frames never straddle: each entry's two byte
    planes when the region holds planes, else the whole payload."""
    if planes:
        return [(eo + h, en // 2) for eo, en in _entries(fmt) for h in (0, en // 2)]
    return [(0, fmt.payload_nbytes)]


def _nv_zstd_fits(fmt, planes: bool) -> bool:
    """True when nvCOMP's zstd can take this format's frames in place: its encoder wants 4-byte and
    its decoder 8-byte aligned frame data (nvcomp/zstd.h); frames start at segment starts plus
    multiples of the 4096-byte chunk, so the segments decide. Byte planes of an entry whose element
    count is not a multiple of 8 (no real head_dim: it takes an odd block size and head_dim) go
    through the host's zstd instead, on any machine (the same bytes)."""
    return all(o % 8 == 0 for o, _ in _segments(fmt, planes))


def _frames(n: int, segments, chunk: int) -> list[tuple[int, int]]:
    """``[(offset, nbytes)]`` of the frames of one region: every segment (a byte plane of an
    entry when shuffled, else the whole payload) cut into pieces of at most ``chunk`` bytes, so
    no frame mixes two planes (that costs ~7% of ratio on real KV)."""
    out = []
    for so, sn in segments:
        for k in range(0, sn, chunk):
            out.append((so + k, min(chunk, sn - k)))
    return out


def _frame_table(chunk: int, raw: int, frames: list[tuple[int, int]], planes: bool) -> bytes:
    """frames: ``[(stored, raw)]`` per frame, in payload order; ``planes``: the payload is byte
    planes (recorded: a decoder told otherwise would return the planes as values, no error)."""
    body = _TABLE_HEAD.size - 8 + 8 * len(frames)
    head = _TABLE_HEAD.pack(_SKIP_MAGIC, body, _TABLE_TAG, _TABLE_VERSION, chunk, raw, len(frames),
                            _TABLE_PLANES if planes else 0)
    return head + struct.pack(f"<{2 * len(frames)}I", *[x for f in frames for x in f])


def _table_prefix(raw: int) -> int:
    """Bytes that always cover a region's frame table (frames: >= 4096 bytes, plus one per plane)."""
    return _TABLE_HEAD.size + 8 * (-(-raw // 4096) + 8)


def _parse_table(prefix: bytes, stored: int, raw_expected: int, j: int,
                 planes: bool) -> tuple[list[tuple[int, int]], int]:
    """-> (``[(stored, raw)]`` per frame, offset of the first frame). ValueError when malformed,
    or when the table says the payload is (not) byte planes and ``planes`` says otherwise."""
    where = f"compressed region {j}"
    if len(prefix) < _TABLE_HEAD_V1.size:
        raise ValueError(f"{where}: truncated ({stored} bytes, shorter than its frame table)")
    magic, body, tag, version, chunk, raw, n = _TABLE_HEAD_V1.unpack_from(prefix)
    if magic != _SKIP_MAGIC or tag != _TABLE_TAG:
        raise ValueError(f"{where}: not a kvkernels zstd region (bad frame-table magic); corrupted or wrong codec")
    if version not in (1, _TABLE_VERSION):
        raise ValueError(f"{where}: frame table version {version}, this kvkernels reads 1 and {_TABLE_VERSION}")
    head = _TABLE_HEAD if version == _TABLE_VERSION else _TABLE_HEAD_V1
    if len(prefix) < head.size:
        raise ValueError(f"{where}: truncated ({stored} bytes, shorter than its frame table)")
    if raw != raw_expected:
        raise ValueError(f"{where}: decodes to {raw} bytes, the staging format expects {raw_expected}")
    if chunk <= 0 or n > (_table_prefix(raw) - _TABLE_HEAD.size) // 8 or body != head.size - 8 + 8 * n:
        raise ValueError(f"{where}: inconsistent frame table (chunk {chunk}, {n} frames for {raw} bytes)")
    if version == _TABLE_VERSION:
        flags = head.unpack_from(prefix)[-1]
        if flags & ~_TABLE_PLANES:
            raise ValueError(f"{where}: unknown frame-table flags {flags:#x}; corrupted, or a newer kvkernels")
        if bool(flags & _TABLE_PLANES) != planes:
            have, want = ("byte planes", "element bytes") if flags & _TABLE_PLANES else ("element bytes",
                                                                                         "byte planes")
            raise ValueError(f"{where}: stored as {have}, being decoded as {want} (the byteshuffle / scheme "
                             f"given to from_buffer differs from the encoder's)")
    end = head.size + 8 * n
    if len(prefix) < end:
        raise ValueError(f"{where}: truncated inside its frame table")
    flat = struct.unpack_from(f"<{2 * n}I", prefix, head.size)
    frames = list(zip(flat[0::2], flat[1::2]))
    if sum(r for _, r in frames) != raw or any(not 0 < r <= chunk for _, r in frames):
        raise ValueError(f"{where}: inconsistent frame table (frame sizes do not cover {raw} bytes)")
    if end + sum(c for c, _ in frames) != stored:
        raise ValueError(f"{where}: frame sizes add up to {end + sum(c for c, _ in frames)} bytes, {stored} stored "
                         f"(truncated?)")
    return frames, end


def _nv_header(codec: str, stream_nbytes: int, raw: int, element_size: int, planes: bool, checksum: bool) -> bytes:
    """The 32-byte header written in front of an nvCOMP native stream."""
    flags = (_NV_PLANES if planes else 0) | (_NV_CHECKSUM if checksum else 0)
    return _NV_HEAD.pack(_NV_TAG, _NV_VERSION, _NV_CODEC_ID[codec], element_size, flags, 0, stream_nbytes, raw)


def _parse_nv_header(head: bytes, stored: int, raw_expected: int, codec: str, element_size: int, planes: bool,
                     j: int) -> bool:
    """Check region ``j``'s header against what the decoder expects; -> whether nvCOMP checksums
    were computed at encode. ``ValueError`` naming what is wrong otherwise."""
    where = f"compressed region {j}"
    if stored < _NV_HEAD.size or len(head) < _NV_HEAD.size:
        raise ValueError(f"{where}: truncated ({stored} bytes, shorter than its {_NV_HEAD.size}-byte header)")
    tag, version, cid, esize, flags, reserved, sn, raw = _NV_HEAD.unpack_from(head)
    if tag != _NV_TAG:
        raise ValueError(f"{where}: not a kvkernels {codec} region (bad header tag); corrupted, or written by "
                         f"another codec or an older kvkernels")
    if version != _NV_VERSION:
        raise ValueError(f"{where}: header version {version}, this kvkernels reads {_NV_VERSION}")
    names = {v: k for k, v in _NV_CODEC_ID.items()}
    if cid != _NV_CODEC_ID[codec]:
        raise ValueError(f"{where}: encoded with {names.get(cid, f'codec id {cid}')!r}, being decoded as {codec!r}")
    if raw != raw_expected:
        raise ValueError(f"{where}: decodes to {raw} bytes, the staging format expects {raw_expected}")
    got_planes = bool(flags & _NV_PLANES)
    if esize != element_size or got_planes != planes:
        def opts(e, p):
            return f"{e}-byte elements" + (" as byte planes" if p else "")
        raise ValueError(f"{where}: encoded from {opts(esize, got_planes)}, the decoder expects "
                         f"{opts(element_size, planes)} (nvCOMP's decoder needs the encoder's options)")
    if flags & ~(_NV_PLANES | _NV_CHECKSUM):
        raise ValueError(f"{where}: unknown header flags {flags:#x}; corrupted or a newer kvkernels")
    if reserved:
        raise ValueError(f"{where}: reserved header bytes 12-15 hold {reserved:#x}, not 0; corrupted or a newer "
                         f"kvkernels")
    if _NV_HEAD.size + sn != stored:
        raise ValueError(f"{where}: its header records a {sn}-byte stream, {stored - _NV_HEAD.size} present "
                         f"(truncated?)")
    return bool(flags & _NV_CHECKSUM)


def _check_nv_regions(regions: list[torch.Tensor], js: list[int], raw: int, codec: str, element_size: int,
                      planes: bool, stream=None) -> bool:
    """Read and check the headers of nvCOMP regions (one D2H copy for CUDA regions, on ``stream``
    when given: the decoder's); -> whether their streams carry nvCOMP checksums (all must agree)."""
    h = _NV_HEAD.size
    for r, j in zip(regions, js):
        if r.numel() < h:
            _parse_nv_header(b"", r.numel(), raw, codec, element_size, planes, j)
    if not regions:
        return False
    heads = [r[:h] for r in regions]
    if len({t.device for t in heads}) == 1:
        cuda = heads[0].device.type == "cuda"
        _after_current(stream, heads[0].device)  # regions the caller copied in on the current stream
        with torch.cuda.stream(stream) if (stream is not None and cuda) else _nullctx():
            host = torch.stack(heads).cpu()  # host sync (CUDA regions): the headers
        rows = [bytes(host[i].numpy()) for i in range(len(heads))]
    else:
        rows = [bytes(t.cpu().numpy()) for t in heads]
    sums = {_parse_nv_header(b, r.numel(), raw, codec, element_size, planes, j)
            for b, r, j in zip(rows, regions, js)}
    if len(sums) > 1:
        raise ValueError("compressed regions: some were encoded with nvCOMP checksums and some without "
                         "(regions of different compress_regions calls mixed)")
    return sums.pop()


# ---------------------------------------------------------------------------------- CPU (zstd)
def _zstd_compress_cpu(payloads: list[torch.Tensor], frames: list[tuple[int, int]], chunk: int,
                       level: int, planes: bool) -> list[torch.Tensor]:
    zstandard = _zstd()
    local = threading.local()

    def enc(mv) -> bytes:
        c = getattr(local, "c", None)
        if c is None:
            c = local.c = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
        return c.compress(mv)

    jobs = []
    for p in payloads:
        mv = p.numpy().data  # (a memoryview of the array)
        jobs.append([_pool().submit(enc, mv[o: o + k]) for o, k in frames])
    out = []
    for p, futs in zip(payloads, jobs):
        blobs = [f.result() for f in futs]
        blob = _frame_table(chunk, p.numel(), [(len(b), k) for b, (_, k) in zip(blobs, frames)], planes) + b"".join(blobs)
        out.append(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    return out


def _zstd_decompress_cpu(region: torch.Tensor, raw: int, dst: torch.Tensor, j: int, planes: bool) -> None:
    zstandard = _zstd()
    data = region.contiguous().numpy().data.cast("B")
    frames, off = _parse_table(bytes(data[: _table_prefix(raw)]), len(data), raw, j, planes)
    local = threading.local()

    def dec(frame, want: int) -> bytes:
        # the frame's own content size is checked before anything is allocated: zstandard trusts
        # it over max_output_size, so a damaged or hostile header (one bit) could claim exabytes
        claimed = zstandard.frame_content_size(frame)  # -1: not recorded (then max_output_size bounds it)
        if claimed != -1 and claimed != want:
            raise ValueError(f"compressed region {j}: a zstd frame header claims {claimed} bytes, "
                             f"the frame table {want}")
        d = getattr(local, "d", None)  # a ZstdDecompressor is not thread-safe: one per thread
        if d is None:
            d = local.d = zstandard.ZstdDecompressor()
        # bytes after the frame are damage (a cleared checksum flag leaves its 4 bytes there)
        return d.decompress(frame, max_output_size=want, allow_extra_data=False)

    futs = []
    o = off
    for c, r in frames:
        futs.append((r, _pool().submit(dec, data[o: o + c], r)))
        o += c
    dst_np = dst.numpy()
    pos = 0
    for i, (want, f) in enumerate(futs):
        try:
            piece = f.result()
        except zstandard.ZstdError as exc:
            raise ValueError(f"compressed region {j}: zstd frame {i} is corrupted ({exc})") from exc
        if len(piece) != want:
            raise ValueError(f"compressed region {j}: zstd frame {i} decoded to {len(piece)} bytes, expected {want}")
        dst_np[pos: pos + want] = memoryview(piece)
        pos += want


# ---------------------------------------------------------------------------------- GPU (nvCOMP)
class _TorchBuffer:
    """Device memory from torch's caching allocator for nvCOMP's scratch (it needs ``.ptr``),
    allocated on the stream nvCOMP names, freed back to torch's cache when nvCOMP drops it."""

    __slots__ = ("t", "ptr")

    def __init__(self, nbytes: int, stream) -> None:
        ptr = int(getattr(stream, "ptr", 0) or 0) if stream is not None else 0
        if ptr:
            with torch.cuda.stream(torch.cuda.ExternalStream(ptr)):
                self.t = torch.empty(max(1, nbytes), dtype=torch.uint8, device="cuda")
        else:
            self.t = torch.empty(max(1, nbytes), dtype=torch.uint8, device="cuda")
        self.ptr = self.t.data_ptr()


NVCOMP_ALLOCATORS = config.NVCOMP_ALLOCATORS
_ALLOCATOR = "nvcomp"  # what nvCOMP is set to now


def _nvcomp_ready():
    """nvCOMP with the scratch allocator named by ``KVKERNELS_NVCOMP_ALLOCATOR``: ``nvcomp`` (its
    own cudaMalloc; the default) or ``torch`` (torch's caching allocator, no cudaMalloc per call).
    Every output buffer is a torch tensor passed in (``out=``) either way, so nothing nvCOMP
    allocates outlives a call. On the H100 (2026-11-22) the torch allocator was only tried together
    with a DLPack import of nvCOMP's outputs, which corrupted the host heap; the import is gone,
    and ``torch`` stays opt-in until ``.ci/gpu`` (which runs the nvCOMP tests under both) passes
    with it."""
    global _ALLOCATOR
    want = config.nvcomp_allocator()
    nvcomp = _nvcomp()
    if want != _ALLOCATOR:
        nvcomp.set_device_allocator((lambda nbytes, stream: _TorchBuffer(nbytes, stream)) if want == "torch" else None)
        _ALLOCATOR = want
    return nvcomp


_CODEC_CACHE: dict = {}


def _codec(nvcomp, codec: str, stream_ptr: int, device: int, element_size: int, chunk: int, shuffled: bool,
           checksum: str | None = None):
    """``checksum``: the name of an ``nvcomp.ChecksumPolicy`` for a native stream (None: nvCOMP's
    default, no checksums)."""
    # per thread: nvCOMP 6's Python Codec "must not be called from multiple threads concurrently"
    # (it holds its manager and scratch), and every thread on the default stream has stream_ptr 0
    key = (threading.get_ident(), codec, stream_ptr, device, element_size, chunk, shuffled, checksum)
    c = _CODEC_CACHE.get(key)
    if c is None:
        kw = dict(algorithm=_NVCOMP_NAME[codec], device_id=device, cuda_stream=stream_ptr, uncomp_chunk_size=chunk)
        if codec == "zstd":
            kw["bitstream_kind"] = nvcomp.BitstreamKind.RAW  # bare standard zstd frames
        else:
            kw["bitstream_kind"] = nvcomp.BitstreamKind.NVCOMP_NATIVE
            if checksum:  # native streams only (nvCOMP refuses a policy for RAW ones)
                kw["checksum_policy"] = getattr(nvcomp.ChecksumPolicy, checksum)
        if codec == "ans" and element_size == 2 and not shuffled:
            kw["data_type"] = "<f2"
        if codec == "lz4" and element_size in (2, 4) and not shuffled:
            # LZ4 takes integer element types only ("Illegal data type" for '<f2', seen on the H100)
            kw["data_type"] = "<u2" if element_size == 2 else "<u4"
            kw["bitshuffle_mode"] = nvcomp.BitshuffleMode.NVCOMP_BITSHUFFLE_MSB_FIRST
        if len(_CODEC_CACHE) >= 256:  # codecs of threads that are gone: dropped (a user holds its own)
            _CODEC_CACHE.clear()
        c = _CODEC_CACHE[key] = nvcomp.Codec(**kw)
    return c


def _after_current(stream, device: torch.device) -> None:
    """Order a caller-given CUDA ``stream`` after the current stream's work so far (no host
    wait): the buffers it is about to read or write were produced, or allocated, there."""
    if stream is not None and device.type == "cuda":
        cur = torch.cuda.current_stream(device)
        if stream != cur:
            stream.wait_stream(cur)


def _encode_into(c, nvcomp, base: torch.Tensor, offs: list[int], sizes: list[int], chunk: int, ptr: int,
                 s, lead: int = 0) -> tuple[torch.Tensor, list[int], list[int]]:
    """Encode ``base[offs[i] : offs[i] + sizes[i]]`` (one batch) into one torch-owned buffer: each
    entry gets nvCOMP's maximum compressed size (rounded to its alignment), after ``lead`` free
    bytes (room for a header right before the aligned start). Returns the buffer,
    entry starts and compressed lengths (a host sync). nvCOMP's own output arrays are never
    imported with ``torch.from_dlpack``: on the H100 (torch 2.11, nvCOMP 6.0) that corrupted the
    host heap."""
    align = max(16, int(c.get_required_compression_alignment()))

    def bound(nbytes: int) -> int:
        probe = torch.empty(nbytes, dtype=torch.uint8, device=base.device)
        return int(c.get_max_comp_buffer_size(nvcomp.as_array(probe, ptr)))

    # nvCOMP checks every output against the bound of a whole chunk, also for a smaller entry
    # (seen on the H100: zstd wanted 65547 bytes for a 57344-byte frame with 64 KiB chunks)
    chunk_bound = bound(chunk)
    caps: dict[int, int] = {}
    for n in set(sizes):
        m = max(bound(n), chunk_bound)
        caps[n] = (m + align - 1) // align * align
    room = (lead + align - 1) // align * align
    starts, tot = [], 0
    for n in sizes:
        starts.append(tot + room)
        tot += room + caps[n]
    with torch.cuda.stream(s):
        buf = torch.empty(max(tot, align), dtype=torch.uint8, device=base.device)
    out = nvcomp.as_arrays(buf, starts, [caps[n] for n in sizes], ptr)
    enc = c.encode(nvcomp.as_arrays(base, offs, sizes, ptr), out=out)
    lens = [int(x) for x in enc.buffer_sizes]  # host sync: the compressed sizes
    return buf, starts, lens


def _gpu_compress(codec: str, fmt, stream, chunk: int, shuffled: bool, base: torch.Tensor, offsets: list[int],
                  frames: list[tuple[int, int]], checksum: bool = True) -> list[torch.Tensor]:
    nvcomp = _nvcomp_ready()
    dev = base.device.index if base.device.index is not None else torch.cuda.current_device()
    s = stream if stream is not None else torch.cuda.current_stream(base.device)
    ptr = s.cuda_stream
    c = _codec(nvcomp, codec, ptr, dev, _esize(fmt), chunk, shuffled,
               "COMPUTE_AND_VERIFY" if checksum and codec != "zstd" else None)
    n = fmt.payload_nbytes
    if codec == "zstd":
        # one RAW zstd frame per (region, frame), every region in one batch
        offs = [o + fo for o in offsets for fo, _ in frames]
        sizes = [fn for _ in offsets for _, fn in frames]
        buf, starts, lens = _encode_into(c, nvcomp, base, offs, sizes, chunk, ptr, s)
        nper = len(frames)
        out = []
        with torch.cuda.stream(s):
            for j in range(len(offsets)):
                ls = lens[j * nper:(j + 1) * nper]
                st = starts[j * nper:(j + 1) * nper]
                fr = [buf[a: a + ln] for a, ln in zip(st, ls)]
                table = _frame_table(chunk, n, [(ln, fn) for ln, (_, fn) in zip(ls, frames)], shuffled)
                t = torch.frombuffer(bytearray(table), dtype=torch.uint8).to(base.device)
                out.append(torch.cat([t, *fr]))
        # the last region's concatenation is still queued on `s`: complete on return, on any
        # stream, as the native codecs' regions (the frame tables' copies were host syncs already)
        s.synchronize()
        return out
    h = _NV_HEAD.size
    buf, starts, lens = _encode_into(c, nvcomp, base, offsets, [n] * len(offsets), chunk, ptr, s, lead=h)
    # each stream's kvkernels header goes into the room right before it: one H2D copy of all
    # headers and one indexed write, on the codec's stream
    heads = b"".join(_nv_header(codec, ln, n, _esize(fmt), shuffled, checksum) for ln in lens)
    with torch.cuda.stream(s):
        hd = torch.frombuffer(bytearray(heads), dtype=torch.uint8).to(base.device)
        pos = (torch.tensor([a - h for a in starts], dtype=torch.int64)[:, None] + torch.arange(h)).flatten()
        buf[pos.to(base.device)] = hd
    # the regions are complete when this returns, on any stream, as before the headers (the
    # compressed sizes were a host sync already; this one waits for the few-µs header write)
    s.synchronize()
    # views of the one output buffer: header + stream, the stream at an aligned start (nvCOMP's
    # decoders need 8-16 byte aligned input; the header is 32 bytes, so a region aligned to 16
    # keeps its stream aligned): no copy; the buffer (worst-case sized, about the raw size) lives
    # as long as any region does
    return [buf[a - h: a + ln] for a, ln in zip(starts, lens)]


def _gpu_decompress(regions: list[torch.Tensor], codec: str, fmt, out: torch.Tensor, stream, chunk_hint: int,
                    element_size: int, shuffled: bool, checksum: bool = False, names: list[int] | None = None) -> None:
    """Decode ``regions`` into ``out``. ``element_size`` / ``shuffled`` must be what the encoder was
    given (``_esize(fmt)``, ``byteshuffle``): the codec options derived from them (ANS ``<f2``, LZ4
    integer type + bitshuffle) are not recorded in nvCOMP's stream, and a decoder built without
    them returns garbage without an error (seen on the H100, 2026-11-23); the kvkernels header
    records them and :func:`_check_nv_regions` has compared it. For the native codecs
    ``regions`` are the streams (after that header); ``checksum``: verify nvCOMP's checksums.
    ``names``: the stored region index of each of ``regions`` (error messages; default their
    position). When this returns, the current stream is ordered after the decode."""
    names = list(range(len(regions))) if names is None else names
    nvcomp = _nvcomp_ready()
    dev = out.device.index if out.device.index is not None else torch.cuda.current_device()
    # `out` / scratch come from the current stream's pool and the regions were copied there: the
    # codec's stream writes and reads them only after that stream's work (a scatter still
    # reading a reused `out`, a block the allocator just handed back)
    _after_current(stream, out.device)
    s = stream if stream is not None else torch.cuda.current_stream(out.device)
    ptr = s.cuda_stream
    n = fmt.payload_nbytes
    chunk = chunk_hint
    with torch.cuda.stream(s):
        if codec == "zstd":
            heads = [r[: _table_prefix(n)].cpu() for r in regions]  # host sync: the frame tables
            pieces, dst_offs, dst_sizes, where = [], [], [], []
            for j, (r, h) in enumerate(zip(regions, heads)):
                frames, o = _parse_table(bytes(h.numpy()), r.numel(), n, names[j], shuffled)
                pos = 0
                for f, (cz, rz) in enumerate(frames):
                    where.append(f"region {names[j]}, frame {f}")
                    pieces.append(r[o: o + cz])
                    dst_offs.append(j * fmt.region_nbytes + pos)
                    dst_sizes.append(rz)
                    o += cz
                    pos += rz
            # the decoder's chunk size (its scratch) must cover the largest frame: the encoder's
            # chunk_nbytes is in the frame table, not in `chunk_hint` (from_buffer cannot know it)
            chunk = max([chunk_hint] + dst_sizes)
            # frames copied to 16-byte aligned offsets of one buffer (nvCOMP input alignment)
            aoffs, tot = [], 0
            for p in pieces:
                aoffs.append(tot)
                tot += (p.numel() + 15) // 16 * 16
            src = torch.empty(max(16, tot), dtype=torch.uint8, device=out.device)
            for p, ao in zip(pieces, aoffs):
                src[ao: ao + p.numel()].copy_(p)
            src_batch = nvcomp.as_arrays(src, aoffs, [p.numel() for p in pieces], ptr)
        else:
            dst_offs = [j * fmt.region_nbytes for j in range(len(regions))]
            dst_sizes = [n] * len(regions)
            where = [f"region {names[j]}" for j in range(len(regions))]
            # nvCOMP's decoders need 8-16 byte aligned input: regions sliced out of a larger
            # buffer at other offsets are copied to 16-byte aligned ones first
            src_batch = nvcomp.as_arrays([r if r.data_ptr() % 16 == 0 else r.clone() for r in regions], ptr)
    # the header's checksum flag asks for a strict check; without it nvCOMP still verifies
    # checksums its own stream header says are there (one flipped flag bit does not turn it off)
    policy = None if codec == "zstd" else ("COMPUTE_AND_VERIFY" if checksum else "NO_COMPUTE_AND_VERIFY_IF_PRESENT")
    c = _codec(nvcomp, codec, ptr, dev, element_size, chunk, shuffled, policy)
    try:
        dec = c.decode(src_batch, out=nvcomp.as_arrays(out, dst_offs, dst_sizes, ptr))
        got = [int(x) for x in dec.buffer_sizes]  # host sync
        if policy:
            # nvCOMP checks the verification status in a deferred callback: give it the chance to
            # raise here, inside this try, before the output is used (not yet seen on a GPU)
            s.synchronize()
    except Exception as exc:  # nvCOMP raises RuntimeError/ValueError with its status
        raise ValueError(f"{codec} decompression failed (truncated or corrupted region?): {exc}") from exc
    for i, (g, w) in enumerate(zip(got, dst_sizes)):
        if g != w:
            raise ValueError(f"{codec} {where[i]} decoded to {g} bytes, expected {w} (truncated or corrupted region)")
    cur = torch.cuda.current_stream(out.device)
    if s != cur:  # the copies, raw regions and unshuffle after this run on the current stream
        cur.wait_stream(s)


# ---------------------------------------------------------------------------------- public API
def compress_regions(
    staging: torch.Tensor,
    fmt: StagingFormat | QuantStagingFormat,
    codec: str = "auto",
    *,
    stream: "torch.cuda.Stream | None" = None,
    byteshuffle: bool = False,
    chunk_nbytes: int = CHUNK_NBYTES,
    level: int | None = None,
    staging_shuffled: bool = False,
    checksum: bool = True,
) -> CompressedStaging:
    """Compress every region of a staging buffer, one independent stream per region.

    Parameters
    ----------
    staging : Tensor
        ``[>= fmt.nbytes]`` uint8, contiguous, as written by :func:`kvkernels.gather` (CPU,
        pinned or CUDA). Read only (with ``byteshuffle`` a shuffled copy is made). Regions that
        are stored raw (codec ``"none"``, or a region that did not compress and falls back to
        its bytes, ``stored == raw``) are *views of this buffer*, not copies: keep it unchanged
        until they are written or decoded (the pipeline and the LMCache plugin hold it until the
        store's future completes).
    fmt : StagingFormat
        Its format (``StagingFormat.for_layout(layout, n, layers)``).
    codec : {"auto", "zstd", "ans", "gdeflate", "lz4", "none"}
        See the module docs. CPU buffers: ``"zstd"`` / ``"none"``; the nvCOMP codecs raise
        ``RuntimeError`` there.
    stream : torch.cuda.Stream, optional
        CUDA stream for nvCOMP (default: the current stream). It first waits (a stream wait)
        for the current stream's work so far, which wrote the staging. Host syncs: reading the
        compressed sizes, and (nvCOMP codecs) after writing the region headers; the regions
        are complete when this returns.
    byteshuffle : bool
        Split payloads into byte planes first (16-bit elements only).
    chunk_nbytes : int
        Uncompressed bytes per zstd frame / nvCOMP chunk (default 64 KiB, multiple of 4096).
    level : int, optional
        zstd level for the CPU encoder (default :data:`ZSTD_LEVEL`).
    staging_shuffled : bool
        The staging was gathered with ``gather_quant(shuffle=True)`` (its payloads are byte
        planes already): recorded so that ``.scheme`` says ``"shuffle"``. Excludes
        ``byteshuffle`` (planes of planes). FP8 staging is recognised from ``fmt``.
    checksum : bool
        nvCOMP native codecs (ANS / GDeflate / LZ4): have nvCOMP compute its checksums at encode
        (``ChecksumPolicy.COMPUTE_AND_VERIFY``, recorded in the region header) so that
        :func:`decompress_regions` verifies them: a damaged region is an error, not garbage.
        ``False`` saves that pass where something else checks the bytes (the store's per-region
        checksum). No effect on zstd (the CPU encoder's frames carry zstd's content checksum;
        nvCOMP's RAW frames are not known to) or ``"none"``.

    Returns
    -------
    CompressedStaging
    """
    _check_bytes(staging, "staging")
    _check_fmt(fmt)
    check(staging.numel() >= fmt.nbytes, "staging", f"at least {fmt.nbytes} bytes", f"{staging.numel()} bytes")
    check(isinstance(byteshuffle, bool), "byteshuffle", "a bool", type(byteshuffle).__name__, TypeError)
    check(isinstance(staging_shuffled, bool), "staging_shuffled", "a bool", type(staging_shuffled).__name__, TypeError)
    check(isinstance(checksum, bool), "checksum", "a bool", type(checksum).__name__, TypeError)
    check(not (staging_shuffled and byteshuffle), "byteshuffle", "False for a staging gathered with shuffle=True "
          "(it is byte planes already)", True)
    check(not (staging_shuffled and _is_fp8(fmt)), "staging_shuffled", "False for an FP8 staging format", True)
    if staging_shuffled:  # (planes of another element size: an odd entry size lost bytes)
        _check_planes(_esize(fmt), "staging_shuffled")
    staging_scheme = (store_scheme(quant="fp8", granularity=fmt.granularity) if _is_fp8(fmt)
                      else store_scheme(shuffle=staging_shuffled))
    check_int(chunk_nbytes, "chunk_nbytes", lo=4096, hi=1 << 24)
    check(chunk_nbytes % 4096 == 0, "chunk_nbytes", "a multiple of 4096", chunk_nbytes)
    lvl = ZSTD_LEVEL if level is None else check_int(level, "level", lo=1, hi=22)
    dev = staging.device
    c = _resolve_codec(codec, dev)
    if byteshuffle:
        _check_planes(_esize(fmt))
    n = fmt.payload_nbytes
    offsets = [j * fmt.region_nbytes for j in range(fmt.num_regions)]
    if n == 0 or fmt.num_regions == 0:
        return CompressedStaging(fmt, c, [staging[:0] for _ in offsets], (0,) * len(offsets),
                                 (n,) * len(offsets), byteshuffle, chunk_nbytes, staging_scheme=staging_scheme)

    base = staging
    _after_current(stream, dev)  # the staging's writer (a gather) ran on the current stream
    if byteshuffle:
        ctx = torch.cuda.stream(stream) if (stream is not None and dev.type == "cuda") else _nullctx()
        with ctx:
            base = torch.zeros(fmt.nbytes, dtype=torch.uint8, device=dev)
            for o in offsets:  # per entry (K, V), as kvkernels.quant's shuffle staging
                for eo, en in _entries(fmt):
                    _split_planes(staging[o + eo: o + eo + en], 2, out=base[o + eo: o + eo + en])
    payloads = [base[o: o + n] for o in offsets]
    planes = byteshuffle or staging_shuffled  # (both the same planes: no zstd frame straddles two)
    frames = _frames(n, _segments(fmt, planes), chunk_nbytes)

    if c == "zstd" and dev.type == "cuda" and not (_have_nvcomp() and _nv_zstd_fits(fmt, planes)):
        # the portable codec without nvCOMP (or with frames it cannot take in place): encode a host
        # copy (ordered after ``stream``'s work), so "auto" and "zstd" still write a file on a GPU
        # machine that lacks nvCOMP
        with torch.cuda.stream(stream) if stream is not None else _nullctx():
            payloads = [p.cpu() for p in payloads]
        stored = _zstd_compress_cpu(payloads, frames, chunk_nbytes, lvl, planes)
    elif c == "none":
        stored = payloads
        if byteshuffle and dev.type == "cuda":  # the planes were split on a stream: complete when this
            (stream or torch.cuda.current_stream(dev)).synchronize()  # returns (a store thread reads them)
    elif dev.type == "cuda":
        # the codec options follow the stored bytes: byte planes (split here or at gather) get no
        # element data type, and the decoder derives the same from the recorded scheme
        # under the data's device: nvCOMP's scratch (KVKERNELS_NVCOMP_ALLOCATOR=torch) comes from
        # the current device, which must be the codec's (cuda:1 data with device 0 current would
        # hand nvCOMP cuda:0 memory)
        with torch.cuda.device(dev):
            stored = _gpu_compress(c, fmt, stream, chunk_nbytes, byteshuffle or staging_shuffled, base, offsets,
                                   frames, checksum)
    else:
        stored = _zstd_compress_cpu(payloads, frames, chunk_nbytes, lvl, planes)

    regions, sizes = [], []
    for p, s in zip(payloads, stored):
        if c != "none" and s.numel() >= n:
            s = p  # raw fallback: stored == raw marks an uncompressed region
        regions.append(s)
        sizes.append(int(s.numel()))
    return CompressedStaging(fmt, c, regions, tuple(sizes), (n,) * len(offsets), byteshuffle, chunk_nbytes,
                             staging_scheme=staging_scheme)


def _check_scheme(cs: CompressedStaging) -> None:
    """``cs``'s scheme fields against its format, before anything is decoded: a CompressedStaging
    built by hand (it is a plain dataclass) with a scheme its bytes are not would decode without
    an error into a staging that ``restore_scheme`` then scatters as something else."""
    fmt = cs.fmt
    check(isinstance(cs.byteshuffle, bool), "compressed.byteshuffle", "a bool", type(cs.byteshuffle).__name__,
          TypeError)
    if _is_fp8(fmt):
        own = store_scheme(quant="fp8", granularity=fmt.granularity)
        check(cs.staging_scheme == own, "compressed.staging_scheme", f"{own!r} for this FP8 staging format",
              repr(cs.staging_scheme))
        check(not cs.byteshuffle, "compressed.byteshuffle",
              "False for an FP8 staging format (byte planes are for 16-bit elements)", True)
        return
    check(cs.staging_scheme in ("raw", "shuffle"), "compressed.staging_scheme",
          "'raw' or 'shuffle' for this (not FP8) staging format", repr(cs.staging_scheme))
    check(not (cs.byteshuffle and cs.staging_scheme == "shuffle"), "compressed.byteshuffle",
          "False for a staging gathered with shuffle=True (planes of planes)", True)
    if cs.scheme == "shuffle":  # planes of 16-bit elements only (compress_regions and from_buffer refuse others)
        _check_planes(_esize(fmt), "compressed.byteshuffle" if cs.byteshuffle else "compressed.staging_scheme")


@dataclass(frozen=True)
class _OutFmt:
    region_nbytes: int
    num_regions: int

    @property
    def nbytes(self) -> int:
        return self.region_nbytes * self.num_regions


@dataclass(frozen=True)
class _SubFmt:
    region_nbytes: int
    payload_nbytes: int
    num_regions: int

    @property
    def nbytes(self) -> int:
        return self.region_nbytes * self.num_regions


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def decompress_regions(
    compressed: CompressedStaging,
    out: torch.Tensor | None = None,
    layers=None,
    *,
    stream: "torch.cuda.Stream | None" = None,
    device=None,
) -> torch.Tensor:
    """Decompress regions back into the staging format (ready for :func:`kvkernels.scatter`).

    Parameters
    ----------
    compressed : CompressedStaging
        From :func:`compress_regions` or :meth:`CompressedStaging.from_buffer`.
    out : Tensor, optional
        ``[>= len(layers) * fmt.region_nbytes]`` uint8, contiguous; written in place (payload
        and zero padding of every region). Allocated on ``device`` (default: the device of the
        compressed regions) when ``None``.
    layers : None, int or sequence of int
        Stored layers to decode (default all); region ``j`` of ``out`` is the ``j``-th of them,
        as :func:`kvkernels.scatter(..., layers=)` expects.
    stream : torch.cuda.Stream, optional
        nvCOMP stream (GPU codecs; default: the current stream). It first waits (a stream wait)
        for the current stream's work so far (earlier users of ``out``, regions copied in);
        ``out`` is ready for the current stream's next work when this returns.
    device : torch.device, optional
        Where to allocate ``out``.

    Returns
    -------
    Tensor
        ``out``.

    Raises
    ------
    ValueError
        A truncated or corrupted region, or a size mismatch (raised before returning; the
        cache is untouched because scatter has not run; ``out`` may hold part of the decode). For the nvCOMP codecs the region
        headers are checked first, also on a machine without a GPU (truncation, codec and
        option mismatches), then nvCOMP verifies its checksums while decoding when the
        regions were compressed with ``checksum=True``.
    RuntimeError
        An nvCOMP codec without a GPU / nvCOMP.
    """
    if not isinstance(compressed, CompressedStaging):
        fail("compressed", "a kvkernels.compress.CompressedStaging", type(compressed).__name__, TypeError)
    cs = compressed
    fmt = cs.fmt
    _check_fmt(fmt)
    codec = _check_codec(cs.codec, allow_auto=False)
    check((len(cs.regions), len(cs.stored_nbytes), len(cs.raw_nbytes)) == (fmt.num_regions,) * 3, "compressed",
          f"{fmt.num_regions} regions, stored sizes and raw sizes (the format's regions)",
          f"{len(cs.regions)} regions, {len(cs.stored_nbytes)} stored and {len(cs.raw_nbytes)} raw sizes")
    _check_scheme(cs)
    # (a format without layers has no regions: nothing to select, nothing to decode)
    sel = [] if not fmt.layers and layers is None else normalize_layers(layers, max(fmt.layers, default=-1) + 1,
                                                                        staged=fmt.layers)
    idx = [fmt.region_index(l) for l in sel]
    ofmt = _OutFmt(fmt.region_nbytes, len(idx))
    n = fmt.payload_nbytes
    for j in idx:
        r = cs.regions[j]
        check_tensor(r, f"regions[{j}]")
        check(r.dtype == torch.uint8 and r.dim() == 1, f"regions[{j}]", "a 1-D uint8 tensor", describe(r), TypeError)
        if int(cs.raw_nbytes[j]) != n:
            raise ValueError(f"compressed region {j}: records {cs.raw_nbytes[j]} uncompressed bytes, the staging "
                             f"format has {n} per region")
        if r.numel() != int(cs.stored_nbytes[j]):
            raise ValueError(f"compressed region {j}: {r.numel()} bytes present, {cs.stored_nbytes[j]} recorded "
                             f"(truncated?)")
        if r.numel() > n:
            raise ValueError(f"compressed region {j}: {r.numel()} stored bytes exceed its {n} uncompressed bytes")
        if codec == "none" and r.numel() != n:
            raise ValueError(f"region {j} (codec 'none'): {r.numel()} bytes, expected {n} (truncated?)")
    src_dev = cs.regions[idx[0]].device if idx else torch.device("cpu")
    try:
        dev = torch.device(device) if device is not None else (out.device if out is not None else src_dev)
    except (RuntimeError, TypeError):  # torch's "Expected one of cpu, cuda, ..." names no argument
        fail("device", "a torch.device or a device string", repr(device), ValueError if isinstance(device, str)
             else TypeError)
    if out is None:
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"`device`: {dev} is not available (torch {torch.__version__}, "
                               f"{'no CUDA build' if torch.version.cuda is None else 'no GPU visible'})")
        out = torch.empty(ofmt.nbytes, dtype=torch.uint8, device=dev)
    else:
        _check_bytes(out, "out")
        check(same_device(out.device, dev), "out", f"a buffer on the decode device {dev} (`device`)", out.device)
        check(out.numel() >= ofmt.nbytes, "out", f"at least {ofmt.nbytes} bytes", f"{out.numel()} bytes")
        if out.device.type == src_dev.type:  # decoding in place would overwrite frames not yet read
            for j in idx:
                r = cs.regions[j]
                if _overlaps(out.data_ptr(), ofmt.nbytes, r.data_ptr(), r.numel()):
                    fail("out", "memory apart from the compressed regions (decoding is not in place)",
                         f"a buffer overlapping region {j}")
    if ofmt.nbytes == 0:
        return out
    checksummed = False
    if codec in _GPU_ONLY:  # their kvkernels headers first: truncation and option mismatches, on any machine
        nv = [j for j in idx if int(cs.stored_nbytes[j]) != n]
        checksummed = _check_nv_regions([cs.regions[j] for j in nv], nv, n, codec, _esize(fmt),
                                        cs.scheme == "shuffle", stream)
    raw_j = [k for k, j in enumerate(idx) if int(cs.stored_nbytes[j]) == n or codec == "none"]
    comp_j = [k for k, j in enumerate(idx) if k not in set(raw_j)]
    # (regions stored raw, because they did not compress, are copied out on any machine)
    if comp_j and codec in _GPU_ONLY and (dev.type != "cuda" or not torch.cuda.is_available()):
        raise RuntimeError(f"{'ANS' if codec == 'ans' else codec} needs nvCOMP on a GPU; use zstd for portable files")

    # Decode into a scratch buffer laid out like `out` when shuffled (planes -> bytes after).
    tgt = out if not cs.byteshuffle else torch.empty(ofmt.nbytes, dtype=torch.uint8, device=dev)
    if comp_j:
        regs = [cs.regions[idx[k]] for k in comp_j]
        if dev.type == "cuda" and codec != "none" and (codec in _GPU_ONLY or (
                _have_nvcomp() and _nv_zstd_fits(fmt, cs.scheme == "shuffle"))):
            sub = _SubFmt(fmt.region_nbytes, fmt.payload_nbytes, len(comp_j))
            scratch = tgt if comp_j == list(range(len(idx))) else torch.empty(sub.nbytes, dtype=torch.uint8, device=dev)
            if codec in _GPU_ONLY:  # the native streams, after their checked headers
                regs = [r[_NV_HEAD.size:] for r in regs]
            with torch.cuda.device(dev):  # nvCOMP's scratch on the codec's device (as for compress)
                _gpu_decompress([r if same_device(r.device, dev) else r.to(dev) for r in regs], codec, sub, scratch, stream,
                                cs.chunk_nbytes, _esize(fmt), cs.scheme == "shuffle", checksummed,
                                names=[idx[k] for k in comp_j])
            if scratch is not tgt:
                for q, k in enumerate(comp_j):
                    tgt[k * ofmt.region_nbytes: k * ofmt.region_nbytes + n].copy_(
                        scratch[q * sub.region_nbytes: q * sub.region_nbytes + n])
        else:
            host = tgt if dev.type == "cpu" else torch.empty(ofmt.nbytes, dtype=torch.uint8)
            for k, r in zip(comp_j, regs):
                _zstd_decompress_cpu(r.cpu() if r.device.type != "cpu" else r, n,
                                     host[k * ofmt.region_nbytes: k * ofmt.region_nbytes + n], idx[k],
                                     cs.scheme == "shuffle")
            if host is not tgt:
                for k in comp_j:
                    tgt[k * ofmt.region_nbytes: k * ofmt.region_nbytes + n].copy_(
                        host[k * ofmt.region_nbytes: k * ofmt.region_nbytes + n])
    for k in raw_j:
        r = cs.regions[idx[k]]
        tgt[k * ofmt.region_nbytes: k * ofmt.region_nbytes + n].copy_(r)
    for k in range(len(idx)):
        if cs.byteshuffle:
            b = k * ofmt.region_nbytes
            for eo, en in _entries(fmt):
                byteunshuffle(tgt[b + eo: b + eo + en], 2, out=out[b + eo: b + eo + en])
        if ofmt.region_nbytes > n:
            out[k * ofmt.region_nbytes + n: (k + 1) * ofmt.region_nbytes].zero_()
    return out
