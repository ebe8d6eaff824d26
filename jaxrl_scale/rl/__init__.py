"""Reinforcement learning: advantages and losses (pure array maths), the train step, packing,
the rollout buffer and feeders (PipelineRL-k), the generator's side of a rollout (waves and the
slot engine's batch queue), scoring and the rollout worker, curriculum, warm start, checkpoints,
metrics and compute accounting. Imports generation/, models/ and parallel/."""
