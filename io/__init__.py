"""SSD store for staging buffers (kvkernels.io): file format, kvikio and POSIX engines, KVStore."""


def engine_info() -> dict:
    """Which I/O engines work here (filled in by the store implementation)."""
    return {"engines": [], "status": "store not implemented yet"}
