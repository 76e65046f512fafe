"""kvmesh's worker engine: a HF model run over kvmesh's own paged KV cache (no Ray imports)."""
