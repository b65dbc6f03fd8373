"""Structured outputs (sample/grammar.py; masks through the engine's steps): every output
obeys its constraint on the tiny model, whose random weights would break it at once without
the mask; the engine's paths (batches, windows, async scheduling, preemption, prefix hits,
speculation, n > 1) give the same tokens as the plain sync engine; bad constraints are
errors at submission and the engine keeps serving."""

import json
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from paged_jax.engine.batch import build
from paged_jax.models.testing import EOS, byte_tokenizer
from paged_jax.sample import grammar
from paged_jax.sampling_params import SamplingParams, StructuredOutputsParams
from tests.engine_helpers import BUCKETS, all_free, engine, run

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "kind": {"enum": ["cat", "dog"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
    "required": ["name", "kind", "age", "tags"], "additionalProperties": False}
REGEX = r"[a-c]{2,4}-[0-9]{3}"
CHOICE = ["yes", "no", "maybe"]
LARK = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'
GBNF = 'root ::= "<" [xyz] [xyz]? ">"'
CHECKS = {  # constraint -> whether an output text obeys it
    "json": (dict(json=SCHEMA, disable_any_whitespace=True),
             lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    "regex": (dict(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
    "choice": (dict(choice=CHOICE), lambda t: t in CHOICE),
    "lark": (dict(grammar=LARK), lambda t: re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", t)),
    "gbnf": (dict(grammar=GBNF), lambda t: re.fullmatch(r"<[xyz]{1,2}>", t)),
    "json_object": (dict(json_object=True, disable_any_whitespace=True),
                    lambda t: isinstance(json.loads(t), dict)),
}


HEADER = "Shared header: prefix hits. "  # 3 full blocks of 8


def constrained(kind: str, **kw) -> SamplingParams:
    kw = {"temperature": 1.0, "seed": 5, "max_tokens": 120, **kw}
    return SamplingParams(structured_outputs=CHECKS[kind][0], **kw)


def requests(n: int = 2) -> list:
    """Every constraint at temperature 1 (seeded) and greedy, beside unconstrained rows."""
    reqs = [(f"{k} {i}", f"{HEADER}prompt {i} for {k}: ", constrained(k, seed=i, **(
        {"temperature": 0.0} if i == 0 else {}))) for k in CHECKS for i in range(n)]
    return reqs + [(f"free {i}", f"free text {i}", SamplingParams(
        temperature=0.0, max_tokens=20, ignore_eos=True)) for i in range(2)]


def texts(outs: dict) -> dict:
    return {rid: [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for rid, o in outs.items()}


def assert_obeyed(outs: dict) -> None:
    for rid, out in outs.items():
        kind = rid.split()[0]
        if kind in CHECKS:
            for c in out.outputs:
                assert c.finish_reason == "stop" and c.stop_reason is None, (rid, c)
                assert obeys(kind, c.text), (rid, c.text)


@pytest.fixture(scope="module")
def plain():
    """The requests on the sync engine with buckets (the reference)."""
    return texts(run(engine(**BUCKETS, decode_window=1), requests()))


def test_every_output_obeys_its_constraint(plain):
    eng = engine(**BUCKETS, decode_window=1)
    outs = run(eng, requests())
    assert_obeyed(outs)
    assert texts(outs) == plain
    assert all_free(eng)
    # Without the masks the random model breaks every constraint (so the check can fail).
    free = run(engine(**BUCKETS), [(r, p, SamplingParams(temperature=1.0, seed=1, max_tokens=30))
                                   for r, p, _ in requests() if r.split()[0] in CHECKS])
    assert not any(obeys(r.split()[0], o.outputs[0].text) for r, o in free.items())


def obeys(kind: str, text: str) -> bool:
    try:
        return bool(CHECKS[kind][1](text))
    except (ValueError, jsonschema.ValidationError):
        return False


@pytest.mark.parametrize("overrides", [
    dict(decode_window=8), dict(async_scheduling=True), dict(static_shapes=True),
    dict(enable_prefix_caching=True), dict(num_kv_blocks=24),
    dict(num_kv_blocks=24, preemption_mode="swap", swap_space=1)],
    ids=["window", "async", "static", "prefix", "recompute", "swap"])
def test_engine_paths_give_the_sync_engine_tokens(plain, overrides):
    """Windows and async scheduling fall back to plain steps while a constrained row runs;
    preemption keeps the matcher (it follows the tokens, which survive); prefix hits."""
    eng = engine(**{**BUCKETS, "decode_window": 1, **overrides})
    outs = run(eng, requests())
    assert texts(outs) == plain
    if "num_kv_blocks" in overrides:
        assert eng.scheduler.num_preempted > 0
    if "enable_prefix_caching" in overrides:
        assert sum(o.num_cached_tokens for o in outs.values()) > 0
    assert all_free(eng)


def test_speculating_engine_gives_plain_tokens(plain):
    from paged_jax.engine.speculative import SpeculativeConfig

    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                             prompt_lookup_max=2)
    outs = run(engine(**BUCKETS, decode_window=1, speculative=spec), requests())
    assert texts(outs) == plain
    # constrained rows verified n-gram drafts (their masks per position), some kept
    drafted = [o.metrics for r, o in outs.items() if r.split()[0] in CHECKS]
    assert sum(m.num_drafts for m in drafted) > 0 and sum(
        m.num_accepted_tokens for m in drafted) > 0


def test_a_draft_model_leaves_constrained_rows_undrafted(plain):
    from paged_jax.engine.speculative import SpeculativeConfig
    from tests.engine_helpers import model

    spec = SpeculativeConfig(method="draft_model", model="tiny", num_speculative_tokens=3)
    c, params, _ = model()
    outs = run(engine(**BUCKETS, decode_window=1, speculative=spec, draft=(c, params)),
               requests())
    assert texts(outs) == plain
    assert all(o.metrics.num_drafts == 0 for r, o in outs.items() if r.split()[0] in CHECKS)
    assert sum(o.metrics.num_drafts for r, o in outs.items() if r.startswith("free")) > 0


def test_n_samples_each_obey_and_stop_strings_and_max_tokens_end_them():
    eng = engine(**BUCKETS)
    must_add = SamplingParams(  # the grammar forces a "+" after one or two digits
        temperature=0.0, max_tokens=40, stop=["+"],
        structured_outputs=dict(grammar='start: "(" num "+" num ")"\nnum: /[0-9]{1,2}/'))
    outs = run(eng, [
        ("json n", "n=3: ", constrained("json", n=3)),
        ("stop", "s: ", must_add),
        ("length", "l: ", constrained("json", max_tokens=4))])
    assert len({c.text for c in outs["json n"].outputs}) > 1
    for c in outs["json n"].outputs:
        assert obeys("json", c.text)
    stop = outs["stop"].outputs[0]  # every allowed text holds a "+": the stop string ends it
    assert stop.finish_reason == "stop" and stop.stop_reason == "+", stop
    assert re.fullmatch(r"\(\d{1,2}", stop.text), stop.text
    assert outs["length"].outputs[0].finish_reason == "length"
    assert len(outs["length"].outputs[0].token_ids) == 4


def test_a_constraint_that_allows_nothing_ends_with_its_reason_and_the_engine_serves_on():
    """allowed_token_ids leaves no token the choice allows: the request stops, saying why."""
    eng = engine(**BUCKETS)
    outs = run(eng, [("none", "x", SamplingParams(
        temperature=0.0, max_tokens=8, allowed_token_ids=[ord("z")],
        structured_outputs=dict(choice=["yes"]))), ("ok", "y", constrained("choice"))])
    none = outs["none"].outputs[0]
    assert none.finish_reason == "stop" and none.stop_reason.startswith("structured_outputs")
    assert outs["ok"].outputs[0].text in CHOICE
    assert all_free(eng)


@pytest.mark.parametrize("bad, named", [
    (dict(regex="[a-"), "regex"), (dict(json={"type": "nope"}), "json"),
    (dict(grammar="start: missing_rule"), "grammar"), (dict(grammar='root ::= "a'), "grammar")])
def test_invalid_constraints_are_errors_at_submission(bad, named):
    eng = engine(**BUCKETS)
    with pytest.raises(ValueError, match=f"structured_outputs.{named}"):
        eng.add_request("bad", "x", SamplingParams(structured_outputs=bad))
    assert not eng.has_unfinished()
    assert run(eng, [("ok", "y", constrained("choice"))])["ok"].outputs[0].text in CHOICE


@pytest.mark.parametrize("bad", [{}, {"json": "{x"}, {"choice": []}, {"regex": "a", "choice":
                                 ["b"]}, {"jsn": {}}, {"json": [1]}, {"regex": 3}])
def test_params_are_checked(bad):
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs=bad)


def grammars() -> grammar.Grammars:
    tok = byte_tokenizer()
    return grammar.Grammars(tok.backend.to_str(), EOS + 1, (EOS,))


def unpack(masks: np.ndarray, v: int) -> np.ndarray:
    return np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :v].astype(bool)


def test_masks_allow_exactly_what_the_matcher_accepts():
    g = grammars()
    m = g.matcher(g.compile(StructuredOutputsParams(regex=REGEX)))
    for ch in "ab-1":
        allowed = unpack(grammar.fill_masks([(m, 1, [])], 2, EOS + 1, (EOS,)), EOS + 1)
        assert allowed[0].all()  # a row without a matcher: all ones
        ok = [t for t in range(EOS + 1) if m.ll.deep_copy().consume_token(t)]
        assert np.flatnonzero(allowed[1]).tolist() == ok
        assert m.accept([ord(ch)])
    logits = jnp.zeros((2, EOS + 1))
    masked = grammar.apply_mask(logits, jnp.asarray(grammar.fill_masks([(m, 0, [])], 2, EOS + 1,
                                                                       (EOS,))))
    assert np.isfinite(np.asarray(masked[0])).tolist() == unpack(
        grammar.fill_masks([(m, 0, [])], 1, EOS + 1, (EOS,)), EOS + 1)[0].tolist()
    assert np.isfinite(np.asarray(masked[1])).all()


def test_draft_positions_get_the_masks_after_the_drafts_before_them():
    """A verify step's masks: position i of a row is the mask after its first i drafts,
    and the matcher is left where it was (drafts are not consumed)."""
    g = grammars()
    m = g.matcher(g.compile(StructuredOutputsParams(regex=REGEX)))
    drafts = [ord(c) for c in "ab-"]
    got = unpack(grammar.fill_masks([(m, 2, drafts)], 7, EOS + 1, (EOS,)), EOS + 1)
    assert got[:2].all() and got[6].all()
    for i in range(len(drafts) + 1):
        step = g.matcher(g.compile(StructuredOutputsParams(regex=REGEX)))
        assert step.accept(drafts[:i])
        want = unpack(grammar.fill_masks([(step, 0, [])], 1, EOS + 1, (EOS,)), EOS + 1)[0]
        assert (got[2 + i] == want).all(), i
    assert m.allows(drafts) == 3 and m.allows([ord("z")]) == 0
    assert m.accept([ord("a")])  # still at the start: "a" is allowed there


def test_a_broken_matcher_allows_only_eos_and_compiles_are_cached():
    g = grammars()
    before = grammar.STATS.compiles
    spec = StructuredOutputsParams(choice=["ab"])
    m = g.matcher(g.compile(spec))
    g.compile(StructuredOutputsParams(choice=["ab"]))
    assert grammar.STATS.compiles == before + 1
    assert not m.accept([ord("z")]) and m.error
    allowed = unpack(grammar.fill_masks([(m, 0, [])], 1, EOS + 1, (EOS,)), EOS + 1)[0]
    assert np.flatnonzero(allowed).tolist() == [EOS]


def test_steps_without_constraints_carry_no_masks():
    eng = engine(**BUCKETS)
    eng.add_request("a", "hello", SamplingParams(temperature=0.0, max_tokens=2))
    plan = eng.scheduler.schedule()
    call = build(plan, eng.config, [EOS], EOS + 1, eng.config.backend)
    assert call.batch.masks is None and not call.shape.flags.grammar


@pytest.mark.xdist_group("serve")
def test_server_response_format_guided_fields_and_bad_schemas():
    """OpenAI's response_format (json_schema, json_object), vLLM's structured_outputs and
    guided_* extra fields through the `openai` client; an invalid schema is a 400 and the
    server keeps serving; streamed text obeys too."""
    import openai

    from tests.serve_helpers import MODEL, serve

    with serve() as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=60, max_retries=0)
        # The random model would pad JSON with whitespace (allowed between tokens, as in
        # vLLM) until max_tokens: the bias keeps it compact.
        chat = dict(model=MODEL, messages=[{"role": "user", "content": "a pet?"}],
                    temperature=1.0, seed=3, max_tokens=120, logit_bias={
                        b: -100 for b in b" \t\r\n"})
        # strict=false (OpenAI: the schema is a hint) is served enforced, as strict=true is
        res = c.chat.completions.create(**chat, response_format={
            "type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA,
                                                   "strict": False}})
        jsonschema.validate(json.loads(res.choices[0].message.content), SCHEMA)
        res = c.chat.completions.create(**chat, response_format={"type": "json_object"})
        assert isinstance(json.loads(res.choices[0].message.content), dict)
        res = c.completions.create(model=MODEL, prompt="x", max_tokens=20,
                                   extra_body={"structured_outputs": {"choice": CHOICE}})
        assert res.choices[0].text in CHOICE
        res = c.completions.create(model=MODEL, prompt="x", max_tokens=20,
                                   extra_body={"guided_regex": REGEX})
        assert re.fullmatch(REGEX, res.choices[0].text)
        stream = c.completions.create(model=MODEL, prompt="y", max_tokens=40, stream=True,
                                      extra_body={"guided_grammar": LARK})
        assert obeys("lark", "".join(ch.choices[0].text for ch in stream))
        with pytest.raises(openai.BadRequestError, match="structured_outputs.json"):
            c.chat.completions.create(**chat, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no"}}})
        with pytest.raises(openai.BadRequestError, match="response_format"):
            c.chat.completions.create(**chat, response_format={"type": "xml"})
        with pytest.raises(openai.BadRequestError, match="one output constraint"):
            c.completions.create(model=MODEL, prompt="x", extra_body={
                "guided_regex": "a", "guided_choice": ["b"]})
        res = c.completions.create(model=MODEL, prompt="x", max_tokens=20,
                                   extra_body={"guided_choice": CHOICE})
        assert res.choices[0].text in CHOICE


def test_llm_generate_and_chat_take_structured_outputs():
    from tests.serve_helpers import tiny_llm

    llm = tiny_llm()
    sp = SamplingParams(temperature=0.0, max_tokens=30,
                        structured_outputs=StructuredOutputsParams(regex=REGEX))
    gen = llm.generate(["a", "b"], sp, use_tqdm=False)
    chat = llm.chat([{"role": "user", "content": "c"}], sp, use_tqdm=False)
    assert all(re.fullmatch(REGEX, o.outputs[0].text) for o in gen + chat)
