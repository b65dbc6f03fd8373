"""KV reservation policies: the baselines of the vLLM paper, on the same engine.

Only admission and host-side accounting change; kernel, model, step and pool are shared, so
a difference in batch size, latency or memory use comes from the reservation policy alone.

    paged        on demand (ours): a request holds ceil(len / block_size) blocks, growing as
                 it decodes; admission needs only the blocks of its first chunk.
    orca-max     Orca with contiguous KV reserved at admission for max_model_len tokens.
    orca-pow2    ... for the next power of two of the request's true length (prompt + output).
    orca-oracle  ... for exactly its true length (an oracle knowing the output length).
    static       Hugging Face-style static batching: when nothing runs, the first B waiting
                 requests form a batch, each reserving max_model_len; nobody joins until the
                 whole batch has finished.

The "true length" of a request is prompt + max_tokens: synthetic workloads set ignore_eos, so
that is exactly what it generates (with EOS it is an upper bound, i.e. still safe).

Orca reserves contiguous memory, so the baselines also place each reservation in a first-fit
contiguous arena of blocks (`Arena`): a reservation must fit one hole, which is what makes
external fragmentation possible. The device pool stays paged (same kernels); the arena only
decides admission. Because every reservation covers the request's whole life, an admitted
Orca/static request never needs more blocks than it reserved, and is never preempted.

Accounting: a running request counts as holding max(reserved, used) blocks per sequence.
"""

from __future__ import annotations

from paged_jax.engine.policy import Policy
from paged_jax.engine.sequence import Request
from paged_jax.sizes import next_pow2

POLICIES = ("paged", "static", "orca-max", "orca-pow2", "orca-oracle")


def true_len(req: Request) -> int:
    """Prompt + output tokens of a request (output = max_tokens; exact with ignore_eos)."""
    return len(req.prompt_token_ids) + int(req.params.max_tokens or 0)


class Arena:
    """First-fit allocator of contiguous block ranges, Orca's view of KV memory.

    Args:
      size: blocks in the arena.
    """

    def __init__(self, size: int):
        self.size = size
        self.used: dict[str, tuple[int, int]] = {}  # request id -> (start, length)

    def holes(self) -> list[int]:
        """Sizes of the free contiguous ranges, in address order."""
        out, at = [], 0
        for start, length in sorted(self.used.values()):
            if start > at:
                out.append(start - at)
            at = start + length
        if self.size > at:
            out.append(self.size - at)
        return out

    def find(self, length: int) -> int | None:
        """Start of the first hole that fits `length` blocks, or None."""
        at = 0
        for start, n in sorted(self.used.values()):
            if start - at >= length:
                return at
            at = start + n
        return at if self.size - at >= length else None

    def alloc(self, key: str, length: int) -> bool:
        start = self.find(length)
        if start is None:
            return False
        self.used[key] = (start, length)
        return True

    def free(self, key: str) -> None:
        self.used.pop(key, None)


class OrcaPolicy(Policy):
    """Contiguous per-request reservations, placed first fit in an `Arena`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.arena = Arena(self.usable_blocks)

    def reserved_tokens(self, req: Request) -> int:
        n = true_len(req)
        want = {"orca-oracle": n, "orca-pow2": next_pow2(n)}.get(self.name, self.max_model_len)
        # Never more than the arena can hold (else the request could never start).
        cap = self.usable_blocks // req.params.n * self.block_size
        return max(n, min(want, self.max_model_len, cap))

    def admits(self, req: Request, running: list[Request], waiting: list[Request]) -> bool:
        if req.request_id in self.arena.used:  # already reserved (e.g. preempted and back)
            return True
        return self.arena.find(self.reserved_blocks(req)) is not None

    def on_admit(self, req: Request) -> None:
        if req.request_id not in self.arena.used:
            self.arena.alloc(req.request_id, self.reserved_blocks(req))

    def on_finish(self, req: Request) -> None:
        self.arena.free(req.request_id)

    def external_fragmentation(self, head: Request | None) -> int:
        if head is None:
            return 0
        need = self.reserved_blocks(head)
        return sum(h for h in self.arena.holes() if h < need)


class StaticPolicy(OrcaPolicy):
    """Static batches of up to `max_batch` requests, chosen together when nothing runs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending: set[str] = set()  # members of the current batch not admitted yet

    def admits(self, req: Request, running: list[Request], waiting: list[Request]) -> bool:
        if not running and not self.pending:
            self._form_batch(waiting)
        # Members may take several steps to admit (token budget per step); others wait.
        return req.request_id in self.pending

    def _form_batch(self, waiting: list[Request]) -> None:
        """The first waiting requests, in order, while B is not reached and memory fits."""
        for r in waiting[: self.max_batch]:
            if not self.arena.alloc(r.request_id, self.reserved_blocks(r)):
                break
            self.pending.add(r.request_id)

    def on_admit(self, req: Request) -> None:
        self.pending.discard(req.request_id)

    def on_finish(self, req: Request) -> None:
        super().on_finish(req)
        self.pending.discard(req.request_id)


def make_policy(name: str, block_size: int, usable_blocks: int, max_model_len: int,
                max_batch: int) -> Policy:
    """The policy object for a reservation name (one of POLICIES), to pass as
    `Engine(..., policy=...)`."""
    if name not in POLICIES:
        raise ValueError(f"reservation must be one of {POLICIES}, got {name!r}")
    cls = {"paged": Policy, "static": StaticPolicy}.get(name, OrcaPolicy)
    return cls(name, block_size, usable_blocks, max_model_len, max_batch)


def policy_for(name: str, ec) -> Policy:
    """make_policy for an engine config (its block size, pool, max_model_len and batch)."""
    return make_policy(name, ec.block_size, ec.cache.usable_blocks, ec.max_model_len,
                       ec.max_num_seqs)
