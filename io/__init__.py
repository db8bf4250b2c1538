"""kvkernels.io: the SSD tier for staging buffers.

* :class:`KVStore` — one checksummed, crash-safe, layer-addressable file per entry (docs/store.md)
* :class:`EntryMeta` — what a staging buffer holds (layers, block shape, dtype, scheme, codec)
* engines: kvikio (GPUDirect Storage / compat mode, GPU machines) and POSIX (everywhere)
"""

from .engines import KvikioEngine, PosixEngine, aligned_empty, kvikio_status, make_engine
from .format import CorruptEntryError, EntryMeta, Header, key_digest
from .store import KVStore

__all__ = ["KVStore", "EntryMeta", "Header", "CorruptEntryError", "key_digest", "PosixEngine", "KvikioEngine",
           "make_engine", "aligned_empty", "engine_info", "available_engines"]


def available_engines() -> list[str]:
    """Engines that can do I/O here: POSIX always; kvikio with CUDA and the package."""
    import torch

    out = ["posix"]
    if torch.cuda.is_available() and kvikio_status()["importable"]:
        out.insert(0, "kvikio")
    return out


def engine_info() -> dict:
    """Which engines work, which one ``engine="auto"`` picks, kvikio's mode and GDS status."""
    engines = available_engines()
    return {"engines": engines, "auto": engines[0], "kvikio": kvikio_status()}
