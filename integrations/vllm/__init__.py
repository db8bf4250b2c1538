"""vLLM KV connector adapter over kvkernels.pipeline (planned). Imports vllm lazily."""
