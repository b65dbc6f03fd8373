"""Load balancing across replicas of one model: which engine gets the next request.

    round_robin   replicas in turn, blind to load and cache
    least_tokens  the replica with the fewest outstanding tokens (prompt tokens still to
                  compute + output tokens still to generate, counted at dispatch)
    kv_aware      the replica whose prefix cache holds the longest prefix of the prompt,
                  among those whose load is within `slack` tokens of the least loaded and
                  whose free KV blocks cover what the request still needs; otherwise
                  least_tokens (cache-aware routers, e.g. SGLang's, do the same: affinity
                  first, unless it would overload a replica)

A replica never drops a request: a busy one queues it (its scheduler waits or preempts), and
the balancer only chooses where it queues. `Balancer` only reads the engines (their prefix
caches and free blocks); the caller adds the request to the engine it names and reports
finishes with `done`.
"""

from __future__ import annotations

from paged_jax.engine.engine import Engine
from paged_jax.sizes import cdiv

POLICIES = ("round_robin", "least_tokens", "kv_aware")


class Balancer:
    """Chooses a replica per request under one policy.

    Args:
      replicas: the engines (same model, each with its own KV pool).
      policy: one of POLICIES.
      slack: kv_aware's allowed extra load, in outstanding tokens, for a cache hit.
    """

    def __init__(self, replicas: list[Engine], policy: str, slack: int = 512):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if not replicas:
            raise ValueError("a balancer needs at least one replica")
        self.replicas, self.policy, self.slack = replicas, policy, slack
        self.outstanding = [0] * len(replicas)
        self._cost: dict[str, tuple[int, int]] = {}  # request id -> (replica, tokens)
        self._next = 0

    def pick(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> int:
        """The replica for this request; its load is counted until `done(request_id)`."""
        hit = 0
        if self.policy == "round_robin":
            r = self._next % len(self.replicas)
            self._next += 1
        else:
            hits = [self.cached_tokens(e, prompt_ids) for e in self.replicas]
            r = self._least(hits)
            if self.policy == "kv_aware":
                affine = self._affine(hits, prompt_ids, max_tokens)
                r = r if affine is None else affine
            hit = hits[r]
        tokens = len(prompt_ids) - hit + max_tokens
        self.outstanding[r] += tokens
        self._cost[request_id] = (r, tokens)
        return r

    def done(self, request_id: str) -> None:
        """A request finished (or was aborted): its tokens no longer load its replica."""
        r, tokens = self._cost.pop(request_id)
        self.outstanding[r] -= tokens

    def holds(self, request_id: str) -> bool:
        """Whether a request's load is counted (picked, not yet done)."""
        return request_id in self._cost

    @staticmethod
    def cached_tokens(engine: Engine, prompt_ids: list[int]) -> int:
        """Prompt tokens the engine's prefix cache would serve (0 without prefix caching)."""
        return engine.kv.cached_tokens(prompt_ids)

    def _least(self, hits: list[int] | None = None) -> int:
        """Fewest outstanding tokens; ties go to the longer cache hit, then the lower index."""
        hits = hits or [0] * len(self.replicas)
        return min(range(len(self.replicas)), key=lambda i: (self.outstanding[i], -hits[i], i))

    def _affine(self, hits: list[int], prompt_ids: list[int], max_tokens: int) -> int | None:
        """The longest-hit replica within slack of the least load whose free blocks cover the
        request's uncached tokens, or None (no hit anywhere, or none qualifies)."""
        floor = min(self.outstanding)
        ok = [i for i, e in enumerate(self.replicas)
              if hits[i] > 0 and self.outstanding[i] <= floor + self.slack
              and free_blocks(e) >= cdiv(len(prompt_ids) - hits[i] + max_tokens,
                                         e.config.block_size)]
        return max(ok, key=lambda i: (hits[i], -self.outstanding[i])) if ok else None


def free_blocks(engine: Engine) -> int:
    """Blocks the engine could hand out now: free ones plus cached ones nobody uses."""
    return engine.kv.free_total()
