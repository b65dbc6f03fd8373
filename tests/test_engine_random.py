"""Hypothesis: random request mixes (lengths, params, aborts, arrivals) keep every allocator
invariant after every step and finish every request that was not aborted."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_jax.invariants import check_invariants
from paged_jax.sampling_params import SamplingParams
from tests.engine_helpers import all_free, engine

request = st.tuples(
    st.integers(1, 60),                     # prompt length (bytes)
    st.integers(1, 20),                     # max_tokens
    st.sampled_from([0.0, 0.8]),            # temperature
    st.integers(1, 3),                      # n
    st.integers(0, 4),                      # arrival step
    st.booleans(),                          # aborted?
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(request, min_size=1, max_size=10), tight=st.booleans())
def test_random_mixes_keep_invariants_and_finish(reqs, tight):
    eng = engine(num_kv_blocks=40 if tight else 160)
    pending = {str(i): r for i, r in enumerate(reqs)}
    finished, aborted, t = set(), set(), 0
    while pending or eng.has_unfinished():
        for rid, (plen, mt, temp, n, arrive, _) in list(pending.items()):
            if arrive <= t:
                n = 1 if temp == 0.0 else n
                eng.add_request(rid, "z" * plen, SamplingParams(
                    temperature=temp, n=n, max_tokens=mt, seed=int(rid), ignore_eos=True))
                del pending[rid]
        for out in eng.step():
            if out.finished:
                finished.add(out.request_id)
                assert all(len(c.token_ids) == reqs[int(out.request_id)][1] for c in out.outputs)
        check_invariants(eng.state.pool, eng.state.table)
        if t == 2:
            for rid, r in enumerate(reqs):
                if r[5] and str(rid) not in finished and str(rid) not in pending:
                    eng.abort(str(rid))
                    aborted.add(str(rid))
        t += 1
    assert finished | aborted == {str(i) for i in range(len(reqs))}
    assert all_free(eng)
    assert eng.refused_steps == 0, "the scheduler planned more blocks than were free"
