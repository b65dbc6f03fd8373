"""Sampling on the device: per-slot sampling state (sample/state.py) and the sampler that
reads it (sample/sampler.py). The user's SamplingParams live in paged_jax/sampling_params.py."""
