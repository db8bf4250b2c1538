"""The ``kvkernels.*`` keys of LMCache's ``extra_config`` (no lmcache import here).

Every key is documented in docs/lmcache.md. Parsing is strict: a missing required key, a value
of the wrong type, or an unknown ``kvkernels.*`` key (a typo) raises :class:`PluginConfigError`
whose message names the key, because LMCache only *logs* a plugin that fails to construct and
then serves without it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

__all__ = ["PLUGIN_NAME", "MODULE_PATH", "CLASS_NAME", "PREFIX", "KEYS", "PluginConfigError", "PluginSettings",
           "parse_extra_config"]

PLUGIN_NAME = "kvkernels"
MODULE_PATH = "kvkernels.integrations.lmcache"
CLASS_NAME = "KVKernelsBackend"
PREFIX = "kvkernels."

# key (without prefix) -> (python type(s) accepted, default, help)
KEYS = {
    "paths": ("str or list of str", None, "directories, one per SSD (required); comma-separated in a string"),
    "capacity_bytes": ("int", None, "LRU bound on stored bytes per worker (default unbounded)"),
    "engine": ("str", "auto", "auto | posix | kvikio"),
    "io_threads": ("int", None, "store worker threads = queue depth (default KVKERNELS_IO_THREADS or 4)"),
    "max_inflight_bytes": ("int", None, "bound on bytes of puts not yet written (default 1 GiB)"),
    "max_pending_bytes": ("int", None, "bound on LMCache memory held by puts not yet on disk; chunks beyond it are "
                                       "not stored (default unbounded, as LocalDiskBackend)"),
    "read_priority": ("bool", True, "pending reads go before pending writes"),
    "verify": ("bool", True, "verify region checksums on read (a mismatch is a miss)"),
    "fsync": ("bool", True, "fsync entry files and directories (crash safety)"),
    "compression": ("str", "none", "none | zstd: per-layer lossless codec (kvkernels.compress)"),
    "byteshuffle": ("bool", False, "split bytes into planes before the codec (helps zstd on bf16)"),
    "quant": ("str", "none", "none | fp8: store e4m3 codes + fp32 scales (lossy, ~0.52x the bytes; docs/quant.md)"),
    "quant_granularity": ("str", "token", "fp8 scales per (token, head) or per (block, head): token | block"),
    "num_kv_heads": ("int", None, "KV heads in a row of hidden size, for per-head fp8 scales (default: LMCache's "
                                  "metadata in-process; in MP mode one scale per token row)"),
    "put_threads": ("int", 2, "threads submitting chunks to the store (and converting them when a copy is needed)"),
    "inplace_io": ("bool", True, "raw CPU chunks: vectored I/O straight from/into LMCache's memory (no copy)"),
    "per_worker_subdir": ("bool", True, "store under <path>/worker<id>of<world>.v2 (one store per process)"),
}

_ENGINES = ("auto", "posix", "kvikio")
_CODECS = ("none", "zstd")


class PluginConfigError(ValueError):
    """The ``kvkernels.*`` extra_config of LMCache is missing a key or has a bad value."""


def _have_zstandard() -> bool:
    """Whether the plugin's codec runs here: its buffers are host memory, so zstd needs the
    ``zstandard`` package (what :func:`kvkernels.compress.available_codecs` says for the CPU)."""
    from kvkernels.compress import available_codecs  # noqa: PLC0415 - torch is loaded by then anyway

    return "zstd" in available_codecs("cpu")


def environment_error(exc: BaseException) -> bool:
    """Whether opening the store failed on a ``KVKERNELS_*`` variable's value (kvkernels.config's
    ``ValueError``s name it first): said as such, not blamed on the configured paths."""
    return isinstance(exc, ValueError) and str(exc).startswith("`KVKERNELS_")


def _err(key: str, expected: str, got) -> PluginConfigError:
    return PluginConfigError(f"LMCache extra_config `{PREFIX}{key}`: expected {expected}, got {got!r} "
                             f"(see docs/lmcache.md)")


def _as_bool(key: str, v) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return v.strip().lower() in ("1", "true", "yes", "on")
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    raise _err(key, "a bool", v)


def _as_int(key: str, v, lo: int = 1) -> int:
    if isinstance(v, bool):
        raise _err(key, f"an int >= {lo}", v)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, str):
        try:
            v = int(v.strip().replace("_", ""))
        except ValueError:
            raise _err(key, f"an int >= {lo}", v) from None
    if not isinstance(v, int) or v < lo:
        raise _err(key, f"an int >= {lo}", v)
    return v


@dataclass(frozen=True)
class PluginSettings:
    """Parsed ``kvkernels.*`` settings (see :data:`KEYS`)."""

    paths: tuple[str, ...]
    capacity_bytes: int | None = None
    engine: str = "auto"
    io_threads: int | None = None
    max_inflight_bytes: int | None = None
    max_pending_bytes: int | None = None
    read_priority: bool = True
    verify: bool = True
    fsync: bool = True
    compression: str = "none"
    byteshuffle: bool = False
    quant: str = "none"
    quant_granularity: str = "token"
    num_kv_heads: int | None = None
    put_threads: int = 2
    inplace_io: bool = True
    per_worker_subdir: bool = True
    unknown: tuple[str, ...] = field(default=())

    def store_paths(self, worker_id: int | None = None, world_size: int | None = None) -> list[str]:
        """Directories for this worker's store (one store per process: stores never share a folder)."""
        if not self.per_worker_subdir or worker_id is None:
            return list(self.paths)
        # ".v2": store keys are unambiguous JSON since 2026-11-23; the folder of the earlier
        # releases' keys (worker<id>of<world>) is no longer read and can be deleted whole
        sub = f"worker{int(worker_id)}of{int(world_size or 1)}.v2"
        return [os.path.join(p, sub) for p in self.paths]


def path_text(paths):
    """``pathlib.Path`` values (from Python code) as the text a YAML config would hold: a path,
    or each item of a list or tuple (a list then); anything else unchanged, for the caller to
    refuse."""
    one = lambda p: os.fspath(p) if isinstance(p, os.PathLike) else p  # noqa: E731
    return [one(p) for p in paths] if isinstance(paths, (list, tuple)) else one(paths)


def parse_extra_config(extra: dict | None) -> PluginSettings:
    """Read the ``kvkernels.*`` keys of an LMCache ``extra_config`` dict.

    Raises
    ------
    PluginConfigError
        A missing ``kvkernels.paths``, a bad value, or an unknown ``kvkernels.*`` key; the
        message names the key.
    """
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise PluginConfigError(f"LMCache `extra_config`: expected a dict, got {type(extra).__name__}")
    unknown = sorted(k for k in extra if isinstance(k, str) and k.startswith(PREFIX) and k[len(PREFIX):] not in KEYS)
    if unknown:
        raise PluginConfigError(f"LMCache extra_config: unknown key(s) {unknown}; known `{PREFIX}*` keys: "
                                f"{sorted(KEYS)} (see docs/lmcache.md)")
    get = lambda k: extra.get(PREFIX + k)  # noqa: E731

    raw = get("paths")
    if raw is None:
        raise _err("paths", "a directory or a list of directories (required)", raw)
    raw = path_text(raw)
    if isinstance(raw, str):
        paths = [p.strip() for p in raw.split(",") if p.strip()]
    elif isinstance(raw, (list, tuple)) and all(isinstance(p, str) for p in raw):
        paths = [p.strip() for p in raw if p.strip()]
    else:
        raise _err("paths", "a directory or a list of directories", raw)
    if not paths:
        raise _err("paths", "at least one directory", raw)
    kw: dict = {"paths": tuple(os.path.abspath(os.path.expanduser(p)) for p in paths)}

    if get("capacity_bytes") is not None:
        kw["capacity_bytes"] = _as_int("capacity_bytes", get("capacity_bytes"))
    if get("engine") is not None:
        e = get("engine")
        if not isinstance(e, str) or e.lower() not in _ENGINES:
            raise _err("engine", f"one of {_ENGINES}", e)
        kw["engine"] = e.lower()
    for k in ("io_threads", "max_inflight_bytes", "max_pending_bytes", "put_threads", "num_kv_heads"):
        if get(k) is not None:
            kw[k] = _as_int(k, get(k))
    for k in ("read_priority", "verify", "fsync", "byteshuffle", "per_worker_subdir", "inplace_io"):
        if get(k) is not None:
            kw[k] = _as_bool(k, get(k))
    if get("compression") is not None:
        c = get("compression")
        if not isinstance(c, str) or c.lower() not in _CODECS:
            raise _err("compression", f"one of {_CODECS}", c)
        kw["compression"] = c.lower()
        if kw["compression"] == "zstd" and not _have_zstandard():
            # at start, not as one failed put after another (the [lmcache] extra does not bring it)
            raise _err("compression", "'none', or 'zstd' with the zstandard package installed "
                       "(pip install zstandard, or the [compress] extra)", c)
    for k, allowed in (("quant", ("none", "fp8")), ("quant_granularity", ("token", "block"))):
        v = get(k)
        if v is not None:
            if not isinstance(v, str) or v.lower() not in allowed:
                raise _err(k, f"one of {allowed}", v)
            kw[k] = v.lower()
    if kw.get("byteshuffle") and kw.get("quant", "none") != "none":
        raise _err("byteshuffle", f"false with `{PREFIX}quant`: fp8 (one-byte codes have no byte planes)", True)
    if kw.get("byteshuffle") and kw.get("compression", "none") == "none":
        raise _err("byteshuffle", f"false unless `{PREFIX}compression` is a codec", True)
    if kw.get("quant_granularity") == "block" and kw.get("quant", "none") == "none":
        # (it was taken and did nothing: the chunks were stored raw)
        raise _err("quant_granularity", f"'token' or unset unless `{PREFIX}quant` is fp8", "block")
    return PluginSettings(**kw)
