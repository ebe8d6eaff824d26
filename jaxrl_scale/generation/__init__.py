"""Completions from a policy: prefill, decode and the KV cache (sampler.py) and the slot
engine's continuous batching (engine.py). Imports models/ and parallel/."""
