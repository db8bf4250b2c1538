"""LMCache storage-backend plugin backed by :class:`kvkernels.io.KVStore` (docs/lmcache.md).

``import kvkernels.integrations.lmcache`` works without lmcache installed; the plugin class
(:class:`KVKernelsBackend`, a ``StoragePluginInterface``) imports lmcache when first accessed.
Enable it with LMCache configuration alone::

    storage_plugins: [kvkernels]
    extra_config:
      storage_plugin.kvkernels.module_path: kvkernels.integrations.lmcache
      storage_plugin.kvkernels.class_name: KVKernelsBackend
      kvkernels.paths: /mnt/nvme0/kvkernels

Tested with ``lmcache==0.5.6`` (the plugin API moves between minor versions).
"""

from __future__ import annotations

import os

from .config import (CLASS_NAME, KEYS, MODULE_PATH, PLUGIN_NAME, PluginConfigError, PluginSettings, parse_extra_config,
                     path_text)
from .convert import ChunkShape, chunk_to_staging, staging_to_chunk

__all__ = ["KVKernelsBackend", "key_string", "PluginConfigError", "PluginSettings", "parse_extra_config",
           "lmcache_extra_config", "ChunkShape", "chunk_to_staging", "staging_to_chunk", "KEYS", "PLUGIN_NAME",
           "MODULE_PATH", "CLASS_NAME", "TESTED_LMCACHE", "KVKernelsL2Adapter", "KVKernelsL2AdapterConfig"]

TESTED_LMCACHE = "0.5.6"


def lmcache_extra_config(paths, **kvkernels_keys) -> dict:
    """The ``extra_config`` entries that enable the plugin (add ``storage_plugins: [kvkernels]``).

    >>> lmcache_extra_config("/tmp/kv", capacity_bytes=1 << 30)["kvkernels.capacity_bytes"]
    1073741824
    """
    out = {f"storage_plugin.{PLUGIN_NAME}.module_path": MODULE_PATH,
           f"storage_plugin.{PLUGIN_NAME}.class_name": CLASS_NAME,
           "kvkernels.paths": path_text(paths if isinstance(paths, (str, os.PathLike)) or not
                                        hasattr(paths, "__iter__") else list(paths))}
    out.update({f"kvkernels.{k}": v for k, v in kvkernels_keys.items()})
    parse_extra_config(out)  # fail here, not in LMCache's launcher
    return out


def __getattr__(name):
    if name in ("KVKernelsBackend", "key_string"):
        from . import backend  # imports lmcache

        return getattr(backend, name)
    if name in ("KVKernelsL2Adapter", "KVKernelsL2AdapterConfig"):  # MP mode (docs/lmcache-mp.md)
        from . import l2_adapter  # imports lmcache

        return getattr(l2_adapter, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
