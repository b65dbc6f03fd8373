"""RoutedLLM: each request goes to a weak (cheap) or a strong model, chosen per request by
trained heads (routing/head.py), under one of three policies (routing/policies.py):

    prompt           the prompt head, from the prompt's text alone, before either model runs
    cascade          (the default) the answer head, from how the weak model began to answer:

    request --> weak LLM: prefill, then up to `window` output tokens (its top-20 logprobs and
                  |  the prompt's last hidden state asked for); or its whole answer if shorter
                  |  features(prompt, that output) --> head.gain() > threshold?
                  |-- no:  the weak request simply goes on (nothing recomputed)
                  '-- yes: the weak request is aborted (its full prompt blocks stay in the
                           weak model's prefix cache) and the request goes to the strong LLM

    cascade_routing  the prompt head first sends the requests it is surest about straight
                     to the strong model (a fraction `direct` of the strong share); the rest
                     cascade

A cascade over a short window: a request that stays on the weak model pays nothing for being
routed but the classifier (numpy, microseconds) and the logprobs and hidden state read from
its own run; one that moves has paid the weak model's prefill and window (the "probe" cost).
Both engines are stepped in turn in this process, so moved requests run on the strong model
while the weak one serves the rest. The window is the head's (head.metrics["window"], what it
was trained on).

The threshold comes from `strong_share` (the share of requests the head's training set would
send to the strong model at it), from `cost_budget` (the share whose expected cost per
request is that fraction of always-strong's, on the head's modeled GPU clock) or is given
directly. In latency-SLA mode (`ttft_slo` /
`tpot_slo`, seconds) a request the head would move stays on the weak model when the strong
model is not expected to meet the bounds given its current queue (routing/sla.py).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as Seq

import numpy as np

from paged_jax.llm import LLM, as_requests
from paged_jax.outputs import RequestOutput
from paged_jax.routing import features as feat
from paged_jax.routing import sla
from paged_jax.routing.head import DEFAULT_PAIR, Head, load, pair_folder, threshold_for_share
from paged_jax.routing.policies import POLICIES
from paged_jax.sampling_params import SamplingParams

_ROUTERS = itertools.count()


@dataclasses.dataclass
class Route:
    """Why a request went where it went (`stage`: "prompt" when the prompt head decided
    before any model ran, "answer" when the answer head did after the weak model's window)."""

    model: str
    gain: float
    features: list[float]
    held_by_slo: bool = False  # the head chose the strong model; its queue was too long
    stage: str = "answer"


class RoutedLLM:
    """Routes each request of `generate` / `chat` to `weak` or `strong` (two LLM instances).

    Args:
      weak, strong: the engines; `names` labels them in outputs (RequestOutput.model).
      head: the trained answer head (routing.head.load(...)): the cascade's.
      policy: "cascade" (default), "prompt" or "cascade_routing" (module docstring).
      prompt_head: the prompt head (the pair folder's prompt_head), for the other two.
      direct: cascade routing's share of the strong traffic sent straight there (default:
        the prompt head's trained choice, metrics["direct"]).
      strong_share: the share of traffic to send to the strong model, in [0, 1], turned into
        thresholds with the heads' saved training gains; or
      threshold: the deciding head's expected-gain threshold itself (the answer head's;
        the prompt head's under "prompt"; overrides strong_share).
      cost_budget: spend at most this fraction (> 0) of always-strong's cost per request:
        the share is the largest whose mean cost (weak requests, plus moved ones paying the
        probe and the strong model) fits, with the costs the head was trained with
        (head.metrics["cost"]["modeled_gpu"]); overrides strong_share.
      ttft_slo, tpot_slo: latency bounds in seconds (None: none) the strong model must be
        expected to meet for a request to move to it.
    """

    def __init__(self, weak: LLM, strong: LLM, head: Head, *, strong_share: float = 0.5,
                 threshold: float | None = None, names: tuple[str, str] = ("weak", "strong"),
                 ttft_slo: float | None = None, tpot_slo: float | None = None,
                 cost_budget: float | None = None, policy: str = "cascade",
                 prompt_head: Head | None = None, direct: float | None = None):
        if not 0 <= strong_share <= 1:
            raise ValueError(f"strong_share must be in [0, 1], got {strong_share}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if policy != "cascade" and prompt_head is None:
            raise ValueError(f"policy {policy!r} needs the prompt head (prompt_head=; the "
                             "pair folder's prompt_head, routing/train.py)")
        for name, v in (("ttft_slo", ttft_slo), ("tpot_slo", tpot_slo)):
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {v}")
        width = head.center.shape[0] if head.components.size else None
        if width is not None and width != weak.llm_engine.model_config.hidden_size:
            raise ValueError(f"the router head reads a hidden state of {width} values, the weak "
                             f"model's is {weak.llm_engine.model_config.hidden_size}: use the "
                             "head trained for this pair (routing/head.pair_folder)")
        self.weak, self.strong, self.head, self.names = weak, strong, head, names
        self.policy, self.prompt_head, self.slo = policy, prompt_head, (ttft_slo, tpot_slo)
        self.direct = (1.0 if policy == "prompt" else 0.0 if policy == "cascade"
                       else direct if direct is not None else _trained_direct(prompt_head))
        if cost_budget is not None:
            strong_share = share_for_budget(head, cost_budget, self.direct)
        d = self.direct * strong_share  # the share sent straight to the strong model
        self.prompt_threshold = (threshold if policy == "prompt" and threshold is not None
                                 else None if prompt_head is None
                                 else head_threshold(prompt_head, d))
        rest = (strong_share - d) / (1 - d) if d < 1 else 0.0  # escalated, of the rest
        self.threshold = threshold if threshold is not None else head_threshold(head, rest)
        self.window = int(head.metrics.get("window", feat.WINDOW))
        self.routes: dict[str, Route] = {}
        self._id, self._counter = next(_ROUTERS), 0

    def generate(self, prompts: str | dict | Seq, sampling_params: SamplingParams | Seq | None
                 = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """As LLM.generate; each output's `model` names the model that served it, and
        `self.routes[request_id]` keeps the decision."""
        prompts, sps = as_requests(prompts, sampling_params)
        asked = {}
        try:
            for p, sp in zip(prompts, sps, strict=True):
                rid = f"routed-{self._id}-{self._counter}"  # unique across routers of an LLM
                self._counter += 1
                asked[rid] = (p, sp)
                route = self.pre_route(self._prompt_text(p))
                if route is not None:
                    self.routes[rid] = route
                engine = self.strong if route and route.model == self.names[1] else self.weak
                engine.llm_engine.add_request(rid, p, sp if route else self.probe_params(sp))
        except Exception:  # a bad request: none of this call's requests stays queued
            for rid in asked:
                self.weak.llm_engine.abort(rid)
                self.strong.llm_engine.abort(rid)
            raise
        return self._serve(asked)

    def pre_route(self, prompt_text: str) -> Route | None:
        """The prompt head's decision before any model runs: a Route to the strong model (the
        prompt and cascade-routing policies, gain above the prompt threshold), to the weak
        one (the prompt policy otherwise), or None: the request cascades."""
        if self.policy == "cascade":
            return None
        x = feat.prompt_only(prompt_text)
        gain = float(self.prompt_head.gain(x[None])[0])
        go_strong = gain > self.prompt_threshold
        held = go_strong and any(self.slo) and not sla.estimate(
            self.strong.llm_engine, len(self.strong.get_tokenizer().encode(prompt_text))
        ).meets(*self.slo)
        if go_strong and not held:
            return Route(self.names[1], gain, x.tolist(), False, "prompt")
        if self.policy == "prompt":
            return Route(self.names[0], gain, x.tolist(), held, "prompt")
        return None

    def _prompt_text(self, p) -> str:
        if isinstance(p, str):
            return p
        if isinstance(p, dict) and "prompt" in p:
            return p["prompt"]
        return self.weak.get_tokenizer().decode(p["prompt_token_ids"])

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None,
             chat_template: str | None = None) -> list[RequestOutput]:
        """As LLM.chat, with the weak model's chat template (or `chat_template`) for both."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.weak.get_tokenizer()
        return self.generate([tok.apply_chat_template(c, True, chat_template) for c in convs],
                             sampling_params)

    def _serve(self, asked: dict[str, tuple]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        weak, strong = self.weak.llm_engine, self.strong.llm_engine
        while len(done) < len(asked):
            for out in weak.step() if weak.has_unfinished() else []:
                self._on_weak(out, asked, done)
            for out in strong.step() if strong.has_unfinished() else []:
                if out.finished and out.request_id in asked:
                    done[out.request_id] = dataclasses.replace(out, model=self.names[1])
            if not weak.has_unfinished() and not strong.has_unfinished() and \
                    len(done) < len(asked):
                raise RuntimeError("engines idle with unfinished routed requests")  # a bug
        return [done[r] for r in asked]

    def probe_params(self, sp: SamplingParams) -> SamplingParams:
        """`sp` with the logprobs and hidden state the head's features need."""
        return dataclasses.replace(sp, logprobs=max(sp.logprobs or 0, feat.TOP_K),
                                   return_hidden_states=True)

    def decide(self, prompt_text: str, out: RequestOutput) -> Route:
        """Where a request goes, from the weak model's output so far (asked with
        `probe_params`; `features.ready`). In SLA mode it reads the strong engine's queue and
        recent steps (a server calls this off the engine's thread: a racy read of counts, good
        enough for an estimate)."""
        x = feat.features(prompt_text, out, self.window)
        gain = float(self.head.gain(x[None])[0])
        go_strong = gain > self.threshold
        held = go_strong and not sla.estimate(
            self.strong.llm_engine, len(out.prompt_token_ids)).meets(*self.slo)
        go_strong &= not held
        return Route(self.names[int(go_strong)], gain, x.tolist(), held)

    def _on_weak(self, out: RequestOutput, asked: dict, done: dict) -> None:
        rid = out.request_id
        if rid not in asked:
            return
        if rid not in self.routes and feat.ready(out, self.window):
            prompt, sp = asked[rid]
            self.routes[rid] = route = self.decide(self._text(out), out)
            if route.model == self.names[1]:
                if not out.finished:
                    self.weak.llm_engine.abort(rid)
                self.strong.llm_engine.add_request(rid, prompt, sp)
                return
            # kept: the rest of its tokens need only what the caller asked (the probe's
            # top-TOP_K logprobs cost every later step a top-k over the vocabulary)
            self.weak.llm_engine.narrow_outputs(rid, sp.logprobs, sp.return_hidden_states)
        if out.finished and self.routes.get(rid) and self.routes[rid].model == self.names[0]:
            done[rid] = as_asked(dataclasses.replace(out, model=self.names[0]), asked[rid][1])

    def _text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.weak.get_tokenizer().decode(
            out.prompt_token_ids)


def head_threshold(head: Head, share: float) -> float:
    """The gain threshold that sent `share` of the head's training requests to the strong
    model (its metrics keep the training set's gains)."""
    gains = np.asarray(head.metrics.get("train_gains", [0.0]), np.float32)
    return threshold_for_share(gains, share)


def _trained_direct(prompt_head: Head) -> float:
    return float(prompt_head.metrics.get("direct", 0.5))


def share_for_budget(head: Head, budget: float, direct: float = 0.0,
                     clock: str = "modeled_gpu") -> float:
    """The strong share whose expected cost per request is `budget` times always-strong's
    (routing/policies.cost): (1 - s) weak + s strong + s (1 - direct) probe = budget *
    strong, clipped to [0, 1]; `direct` is the share of the strong traffic that skips the
    weak model (1: the prompt policy, 0: the cascade)."""
    if not budget > 0:
        raise ValueError(f"cost_budget must be a positive fraction of always-strong's cost, "
                         f"got {budget}")
    cost = head.metrics.get("cost", {}).get(clock)
    if cost is None:
        raise ValueError("this head has no per-model costs (head.metrics['cost']); retrain it "
                         "with `python -m paged_jax.routing.train` or give strong_share")
    (weak, strong), probe = (cost[m] for m in head.metrics["models"]), cost["probe"]
    return float(np.clip((budget * strong - weak) / (strong + (1 - direct) * probe - weak),
                         0.0, 1.0))


def as_asked(out: RequestOutput, sp: SamplingParams) -> RequestOutput:
    """The output without the logprobs and hidden state the router asked for and the caller
    did not."""
    k = sp.logprobs
    outs = []
    for c in out.outputs:
        if k is None:
            c = dataclasses.replace(c, logprobs=None, cumulative_logprob=None)
        else:
            # zip, not strict: a server reads a running request's output while the engine
            # thread may be appending to it (one of its lists can be a position ahead)
            c = dataclasses.replace(c, logprobs=[_top(pos, tok, k) for pos, tok in zip(
                c.logprobs, c.token_ids, strict=False)])
        outs.append(c)
    hidden = out.hidden_states if sp.return_hidden_states else None
    return dataclasses.replace(out, outputs=outs, hidden_states=hidden)


def _top(pos: dict, token: int, k: int) -> dict:
    """The sampled token and the k best of one position's logprobs."""
    return {t: lp for t, lp in pos.items() if t == token or (lp.rank or 0) <= k}


def shipped_router(strong_share: float = 0.5, models: tuple[str, str] = DEFAULT_PAIR,
                   policy: str = "cascade_routing", **llm_kwargs) -> RoutedLLM:
    """A (weak, strong) pair of shipped models with the heads trained on them (paged_jax/
    routing/trained/<weak>+<strong>): Qwen2.5-Coder 0.5B / 1.5B Instruct by default (the 1.5B
    comes with `make models`), or ("smollm2", "gemma3"); `llm_kwargs` go to both LLMs. The
    policy defaults to the one results/routing.json found best (the CLI's default too)."""
    folder = pair_folder(*models)
    head = load(folder / "head")
    prompt_head = load(folder / "prompt_head")  # both shipped pairs have one
    weak, strong = (LLM(m, **llm_kwargs) for m in models)
    return RoutedLLM(weak, strong, head, strong_share=strong_share, names=models,
                     policy=policy, prompt_head=prompt_head)
