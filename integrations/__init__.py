"""Adapters to host libraries (LMCache, vLLM); each imports its host lazily."""
