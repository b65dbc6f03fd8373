"""Hypothesis state machine over a whole engine: requests arrive (sharing prefixes, n > 1,
stop strings, random sampling), steps run, requests are aborted, in any order, in a pool
small enough to preempt. After every rule the KV manager's host mirror equals the device
(`KVManager.check`, which also checks the allocator invariants); every request that was not
aborted finishes with exactly its tokens, and at the end nothing is held."""

import string

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_jax.sampling_params import SamplingParams
from tests.engine_helpers import all_free, engine

PREFIXES = ["", "shared system prompt: ", "another, longer shared system prompt. "]


class EngineMachine(RuleBasedStateMachine):
    mode = "recompute"
    async_scheduling = False

    def __init__(self):
        super().__init__()
        # Static shapes: the machine studies the engine's states, not its shape buckets
        # (tests/test_batch.py and test_engine.py run those); a cold run compiles 4x less.
        self.eng = engine(num_kv_blocks=40, decode_window=4, preemption_mode=self.mode,
                          async_scheduling=self.async_scheduling)
        self.want: dict[str, int] = {}  # live request -> tokens it must produce (no stop)
        self.stops: set[str] = set()  # requests that may end early on a stop string
        self.ids = 0

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.text(string.ascii_lowercase, max_size=20),
          max_tokens=st.integers(1, 12), sampled=st.booleans(), n=st.integers(1, 2),
          stop=st.booleans())
    def add(self, prefix, tail, max_tokens, sampled, n, stop):
        rid = str(self.ids)
        self.ids += 1
        sp = SamplingParams(temperature=0.8 if sampled else 0.0, n=n if sampled else 1,
                            seed=self.ids, max_tokens=max_tokens, ignore_eos=True,
                            stop=list("aeiou") if stop else None)
        self.eng.add_request(rid, prefix + tail + ".", sp)
        self.want[rid] = max_tokens
        if stop:
            self.stops.add(rid)

    @rule()
    def step(self):
        for out in self.eng.step():
            if out.finished:
                self._finished(out)

    @precondition(lambda self: self.async_scheduling)
    @rule()
    def drain(self):
        """Async scheduling: read the step in flight (the mirror is exact only then)."""
        for out in self.eng.drain():
            if out.finished:
                self._finished(out)

    @precondition(lambda self: self.want)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.want)))
        self.eng.abort(rid)
        del self.want[rid]

    def _finished(self, out):
        want = self.want.pop(out.request_id)
        for c in out.outputs:
            if out.request_id in self.stops:
                assert 1 <= len(c.token_ids) <= want
            else:
                assert len(c.token_ids) == want, (out.request_id, len(c.token_ids), want)

    @invariant()
    def host_mirror_equals_device(self):
        if self.eng._in_flight is None:
            self.eng.kv.check()

    def teardown(self):
        while self.eng.has_unfinished():
            self.step()
        assert not self.want, f"requests never finished: {sorted(self.want)}"
        assert all_free(self.eng)
        assert self.eng.refused_steps == 0, "the scheduler planned more blocks than were free"


class SwapMachine(EngineMachine):
    mode = "swap"


class AsyncMachine(EngineMachine):
    async_scheduling = True


SETTINGS = settings(max_examples=15, stateful_step_count=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
EngineMachine.TestCase.settings = SETTINGS
SwapMachine.TestCase.settings = settings(SETTINGS, max_examples=6)
AsyncMachine.TestCase.settings = SETTINGS
TestEngineMachine = EngineMachine.TestCase
TestAsyncMachine = AsyncMachine.TestCase
TestSwapMachine = SwapMachine.TestCase
