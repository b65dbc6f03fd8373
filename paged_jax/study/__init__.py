"""Experiment support that is not serving: synthetic workloads, serving measurements, the
modeled GPU clock and the vLLM paper's KV reservation baselines (injected into an Engine as
its admission policy). The engine never imports this package."""
