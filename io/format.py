"""The on-disk entry format (documented byte by byte in docs/store.md).

One file per entry::

    [header: header_nbytes bytes, a multiple of 4096]
    [region 0: stored_nbytes[0] bytes, zero-padded to a multiple of 4096]
    [region 1 ...]

Header (little endian)::

    off  size  field
      0     8  magic  b"KVKSTOR\\0"
      8     4  format version (1)
     12     4  header_nbytes
     16     8  header checksum: xxh3_64 of the header with this field zeroed
     24    16  key digest (blake2b-128 of the key bytes)
     40     4  num_regions R
     44     4  num_blocks
     48     4  block_size
     52     4  num_heads
     56     4  head_dim
     60     4  element_size
     64     4  num_kv (2 = K, V; 1 = MLA)
     68     4  num_layers of the source cache
     72    16  dtype name, ASCII, NUL padded (e.g. "bfloat16")
     88    16  scheme, ASCII (e.g. "raw", "shuffle", "fp8-token", "fp8-block")
    104    16  codec, ASCII (e.g. "none", "zstd", "ans")
    120     8  created, unix nanoseconds
    128  40*R  region table: layer u32, pad u32, offset u64, stored u64, raw u64, xxh3_64 u64

``offset`` is the region's byte offset in the file (4096-aligned), ``stored`` the bytes on disk
(at most ``raw``: less when compressed, or when a region was put without its padding), ``raw`` the
region's size in the staging buffer.
"""

from __future__ import annotations

import hashlib
import struct
import time
from dataclasses import dataclass, field

import torch

from kvkernels._validate import check, check_int, fail
from kvkernels.staging import REGION_ALIGN, StagingFormat

__all__ = ["MAGIC", "VERSION", "EntryMeta", "RegionInfo", "Header", "key_digest", "CorruptEntryError", "checksum"]

MAGIC = b"KVKSTOR\x00"
VERSION = 1
_FIXED = struct.Struct("<8sII8s16sIIIIIIII16s16s16sQ")
_REGION = struct.Struct("<IIQQQQ")
assert _FIXED.size == 128 and _REGION.size == 40  # noqa: S101 - layout constants, not user input
MAX_REGIONS = 4096
MAX_FILE_NBYTES = 1 << 62  # far above any SSD; keeps every offset and size clear of the u64 fields


class CorruptEntryError(OSError):
    """A stored entry failed its checksum or structure checks; its bytes were not returned."""


def checksum(buf) -> int:
    """xxh3_64 of a bytes-like object (the region checksum)."""
    import xxhash

    return xxhash.xxh3_64_intdigest(buf)


def checksum_segments(bufs) -> int:
    """xxh3_64 of the concatenation of several bytes-like objects (equal to :func:`checksum` of it)."""
    bufs = list(bufs)
    if len(bufs) == 1:
        return checksum(bufs[0])
    import xxhash

    h = xxhash.xxh3_64()
    for b in bufs:
        h.update(b)
    return h.intdigest()


#: the types a store key may have (str, or bytes-like)
KEY_TYPES = (str, bytes, bytearray, memoryview)


def key_digest(key) -> bytes:
    """16-byte digest naming a key: a key never names a path (it is only ever hashed)."""
    if isinstance(key, str):
        raw = b"s" + key.encode("utf-8", "surrogatepass")
    elif isinstance(key, KEY_TYPES[1:]):
        raw = b"b" + bytes(key)
    else:
        fail("key", "a str or bytes", type(key).__name__, TypeError)
    return hashlib.blake2b(raw, digest_size=16).digest()


def _round_up(x: int, a: int = REGION_ALIGN) -> int:
    return (x + a - 1) // a * a


def _ascii(s: str, name: str) -> bytes:
    try:
        b = s.encode("ascii", "strict") if isinstance(s, str) else b""
    except UnicodeEncodeError:
        b = b""  # refused below: the error names the field, not the codec
    check(isinstance(s, str) and 0 < len(b) <= 16 and b"\x00" not in b, name, "1-16 ASCII characters", repr(s))
    return b


@dataclass(frozen=True)
class EntryMeta:
    """What a staging buffer holds: enough to check a restore against the destination cache."""

    layers: tuple[int, ...]
    num_blocks: int
    block_size: int
    num_heads: int
    head_dim: int
    element_size: int
    num_kv: int
    num_layers: int
    dtype: str
    scheme: str = "raw"
    codec: str = "none"

    @classmethod
    def for_layout(cls, layout, num_blocks: int, layers=None, *, scheme: str = "raw", codec: str = "none") -> "EntryMeta":
        """Meta of the buffer ``kvkernels.gather(layout, <num_blocks ids>, layers=layers)`` writes."""
        check_int(num_blocks, "num_blocks", lo=1)
        f = StagingFormat.for_layout(layout, num_blocks, layers)
        return cls(f.layers, f.num_blocks, f.block_size, f.num_heads, f.head_dim, f.element_size, f.num_kv,
                   num_layers=layout.num_layers, dtype=str(layout.dtype).replace("torch.", ""), scheme=scheme,
                   codec=codec)

    @property
    def fmt(self) -> StagingFormat:
        return StagingFormat(self.layers, self.num_blocks, self.block_size, self.num_heads, self.head_dim,
                             self.element_size, self.num_kv)

    def validate(self) -> "EntryMeta":
        check(isinstance(self.layers, tuple) and len(self.layers) >= 1, "meta.layers", "a non-empty tuple", self.layers)
        check(len(self.layers) <= MAX_REGIONS, "meta.layers", f"at most {MAX_REGIONS} layers", len(self.layers))
        for l in self.layers:
            check_int(l, "meta.layers", lo=0, hi=2**31 - 1)
        check(list(self.layers) == sorted(set(self.layers)), "meta.layers", "ascending distinct layers", self.layers)
        for name in ("num_blocks", "block_size", "num_heads", "head_dim", "element_size", "num_layers"):
            check_int(getattr(self, name), f"meta.{name}", lo=1, hi=2**31 - 1)
        check_int(self.num_kv, "meta.num_kv", lo=1, hi=2)  # (2.0 == 2: `in (1, 2)` let a float through)
        check(max(self.layers) < self.num_layers, "meta.layers", f"layers < num_layers={self.num_layers}", self.layers)
        # each field fits its u32, but their product must fit the header's u64 sizes and offsets
        total = self.fmt.nbytes + _round_up(_FIXED.size + _REGION.size * len(self.layers))
        check(total < MAX_FILE_NBYTES, "meta", f"a buffer of fewer than {MAX_FILE_NBYTES} bytes (2**62)",
              f"{self.fmt.nbytes} bytes ({len(self.layers)} regions of {self.fmt.region_nbytes})")
        for name in ("dtype", "scheme", "codec"):
            _ascii(getattr(self, name), f"meta.{name}")
        # what the stored bytes are: a restore follows it (scatter_quant(scheme=...)); "fp8" (the
        # quant= name) was written without a word and refused only at restore, its granularity lost
        from kvkernels.quant import STORE_SCHEMES  # (here: kvkernels.quant imports the ops, which import this)

        check(self.scheme in STORE_SCHEMES, "meta.scheme", f"one of {STORE_SCHEMES}", repr(self.scheme))
        dt = getattr(torch, self.dtype, None)  # (a name that is not a torch dtype is the caller's own)
        if isinstance(dt, torch.dtype):
            check(dt.itemsize == self.element_size, "meta.element_size",
                  f"{dt.itemsize}, the size of meta.dtype {self.dtype!r}", self.element_size)
        return self


@dataclass(frozen=True)
class RegionInfo:
    layer: int
    offset: int
    stored: int
    raw: int
    checksum: int


@dataclass(frozen=True)
class Header:
    digest: bytes
    meta: EntryMeta
    regions: tuple[RegionInfo, ...]
    created_ns: int = field(default=0)

    def __post_init__(self) -> None:
        # the fixed part packs the digest as 16 bytes: struct padded a shorter one with zeros and
        # cut a longer one, so the file's key check then failed for a header that packed fine
        check(isinstance(self.digest, bytes) and len(self.digest) == 16, "digest",
              "16 bytes (kvkernels.io.key_digest of the key)",
              f"{len(self.digest)} bytes" if isinstance(self.digest, bytes) else type(self.digest).__name__)
        check(isinstance(self.meta, EntryMeta), "meta", "an EntryMeta", type(self.meta).__name__, TypeError)
        check(isinstance(self.regions, tuple) and 0 < len(self.regions) <= MAX_REGIONS
              and all(isinstance(r, RegionInfo) for r in self.regions), "regions",
              f"a tuple of 1 to {MAX_REGIONS} RegionInfo", repr(self.regions)[:80])
        check(isinstance(self.created_ns, int) and 0 <= self.created_ns < 1 << 64, "created_ns",
              "an integer in [0, 2**64)", repr(self.created_ns))

    @property
    def nbytes(self) -> int:
        """Header size on disk."""
        return _round_up(_FIXED.size + _REGION.size * len(self.regions))

    @property
    def file_nbytes(self) -> int:
        last = self.regions[-1]
        return _round_up(last.offset + last.stored)

    @staticmethod
    def layout_regions(meta: EntryMeta, stored_sizes, checksums) -> tuple[RegionInfo, ...]:
        """Place regions after the header, each on a 4096 boundary."""
        n = len(meta.layers)
        off = _round_up(_FIXED.size + _REGION.size * n)
        raw = meta.fmt.region_nbytes
        out = []
        for layer, st, ck in zip(meta.layers, stored_sizes, checksums):
            out.append(RegionInfo(layer, off, int(st), raw, int(ck)))
            off = _round_up(off + int(st))
        return tuple(out)

    def pack(self) -> bytes:
        m = self.meta
        fixed = _FIXED.pack(
            MAGIC, VERSION, self.nbytes, b"\x00" * 8, self.digest, len(self.regions), m.num_blocks, m.block_size,
            m.num_heads, m.head_dim, m.element_size, m.num_kv, m.num_layers, _ascii(m.dtype, "meta.dtype"),
            _ascii(m.scheme, "meta.scheme"), _ascii(m.codec, "meta.codec"), self.created_ns or time.time_ns(),
        )
        table = b"".join(_REGION.pack(r.layer, 0, r.offset, r.stored, r.raw, r.checksum) for r in self.regions)
        body = bytearray(fixed + table)
        body.extend(b"\x00" * (self.nbytes - len(body)))
        body[16:24] = struct.pack("<Q", checksum(bytes(body)))
        return bytes(body)

    @classmethod
    def unpack(cls, data: bytes) -> "Header":
        """Parse and verify a header; ``CorruptEntryError`` on any inconsistency."""
        if len(data) < _FIXED.size:
            raise CorruptEntryError(f"header: expected at least {_FIXED.size} bytes, got {len(data)}")
        (magic, version, hsize, hck, digest, nreg, nblocks, bs, heads, hdim, esz, nkv, nlayers, dtype, scheme, codec,
         created) = _FIXED.unpack_from(data, 0)
        if magic != MAGIC:
            raise CorruptEntryError(f"header: bad magic {magic!r}")
        if version != VERSION:
            raise CorruptEntryError(f"header: unsupported format version {version}")
        if not (0 < nreg <= MAX_REGIONS) or hsize != _round_up(_FIXED.size + _REGION.size * nreg):
            raise CorruptEntryError(f"header: inconsistent size {hsize} for {nreg} regions")
        if len(data) < hsize:
            raise CorruptEntryError(f"header: expected {hsize} bytes, got {len(data)}")
        body = bytearray(data[:hsize])
        body[16:24] = b"\x00" * 8
        if struct.pack("<Q", checksum(bytes(body))) != hck:
            raise CorruptEntryError("header: checksum mismatch")
        try:
            regions = tuple(
                RegionInfo(layer, off, stored, raw, ck)
                for layer, _pad, off, stored, raw, ck in (
                    _REGION.unpack_from(data, _FIXED.size + i * _REGION.size) for i in range(nreg)
                )
            )
            meta = EntryMeta(
                layers=tuple(r.layer for r in regions), num_blocks=nblocks, block_size=bs, num_heads=heads,
                head_dim=hdim, element_size=esz, num_kv=nkv, num_layers=nlayers,
                dtype=dtype.rstrip(b"\x00").decode("ascii"), scheme=scheme.rstrip(b"\x00").decode("ascii"),
                codec=codec.rstrip(b"\x00").decode("ascii"),
            ).validate()
        except (ValueError, TypeError, UnicodeDecodeError) as exc:
            raise CorruptEntryError(f"header: invalid fields ({exc})") from None
        expect_off = hsize
        for r in regions:
            if r.offset != expect_off or r.raw != meta.fmt.region_nbytes or not 0 < r.stored <= r.raw:
                raise CorruptEntryError(f"header: inconsistent region table at layer {r.layer}")
            expect_off = _round_up(r.offset + r.stored)
        return cls(digest=digest, meta=meta, regions=regions, created_ns=created)
