"""Model routing: send each request to the model that fits it (weak and cheap, or strong).

    tasks.py     an evaluation set made by code, with checkable answers at graded difficulty
    features.py  what the router sees: the weak model's first-token logprobs and last hidden
                 state, + prompt features
    head.py      the complexity classifier (averaged optax MLPs over named features and PCA
                 of the hidden state, calibrated), saved as .npz
    train.py     `python -m paged_jax.routing.train`: labels, features, the inputs chosen
                 by cross-validation, the shipped head, out-of-fold predictions
    curves.py    quality vs strong-model share per policy; cost saved at 95% quality
    router.py    RoutedLLM(weak, strong, head).generate / chat (strong_share, cost_budget,
                 latency SLOs)
    balance.py   load balancing across replicas: round-robin, least tokens, KV-aware
    replicas.py  replicas behind a balancer on a modeled GPU clock (latency, throughput)
"""

from paged_jax.routing.head import Head, load
from paged_jax.routing.router import RoutedLLM, shipped_router

__all__ = ["Head", "RoutedLLM", "load", "shipped_router"]
