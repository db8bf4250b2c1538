"""LMCache storage-backend plugin (issue: LMCache plugin). Imports lmcache lazily."""
