"""SamplingParams and BeamSearchParams with vLLM's offline-API field names, defaults, checks.

Every validation error is a `ValueError` whose message starts with the offending field's name,
so callers (and tests) can tell which argument was wrong.
"""

from __future__ import annotations

import dataclasses
import enum
import json as json_lib
import math

_SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (vLLM's rule): dividing by them would overflow."""


@dataclasses.dataclass
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's `StructuredOutputsParams`): exactly one of
    `json`, `regex`, `choice`, `grammar`, `json_object`. The engine compiles it when the
    request is submitted (an invalid schema, regex or grammar is a ValueError there) and
    masks every token the constraint cannot continue with (paged_jax/sample/grammar.py).

    Attributes:
      json: a JSON schema (dict or JSON text) the output must validate against.
      regex: a regular expression the whole output must match.
      choice: the output is exactly one of these strings.
      grammar: a context-free grammar, Lark (llguidance's dialect) or GBNF.
      json_object: any JSON object.
      disable_any_whitespace: JSON without whitespace between its tokens (vLLM's option);
        by default JSON may hold any run of spaces, tabs and newlines there.
      whitespace_pattern: a regex for JSON's whitespace instead (vLLM's option).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(self.KINDS)}; "
                             f"got {', '.join(given) or 'none'}.")
        if isinstance(self.json, str):
            try:
                self.json = json_lib.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, got "
                             f"{type(self.json).__name__}.")
        for name in ("regex", "grammar", "whitespace_pattern"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs.{name} must be a string.")
        if self.choice is not None and not (
                isinstance(self.choice, list) and self.choice
                and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty "
                             f"strings, got {self.choice!r}.")

    @property
    def kind(self) -> str:
        """Which constraint it is: one of KINDS."""
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """The constraint as canonical text: equal constraints compile once (a cache key)."""
        value = {"json_object": True}.get(self.kind, getattr(self, self.kind))
        return json_lib.dumps([self.kind, value, self.disable_any_whitespace,
                               self.whitespace_pattern], sort_keys=True)

    @classmethod
    def of(cls, value: StructuredOutputsParams | dict) -> StructuredOutputsParams:
        """From itself or a dict of its fields (unknown keys are an error naming them)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, "
                             f"got {type(value).__name__}.")
        fields = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(value) - fields):
            raise ValueError(f"structured_outputs has unknown keys {unknown}; known: "
                             f"{sorted(fields)}.")
        return cls(**value)


class SamplingType(enum.IntEnum):
    """How a request draws its tokens (vLLM's `SamplingType`)."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclasses.dataclass
class SamplingParams:
    """Per-request sampling settings; same names and defaults as vLLM's `SamplingParams`.

    Attributes:
      n: number of output sequences returned for the prompt.
      presence_penalty: subtracted from logits of tokens already generated, in [-2, 2].
      frequency_penalty: subtracted once per occurrence of an already generated token, [-2, 2].
      repetition_penalty: > 0; logits of tokens seen in prompt or output are divided (if
        positive) or multiplied (if negative) by it. 1 = off.
      temperature: >= 0; 0 (or below 1e-5) means greedy.
      top_p: in (0, 1]; keep the smallest set of most likely tokens whose mass reaches top_p.
      top_k: keep the k most likely tokens; 0 or -1 = off (normalised to 0).
      min_p: in [0, 1]; drop tokens whose probability is below min_p * the top probability.
      seed: per-request random seed; None = the engine draws one.
      stop: strings that end generation (a single str is wrapped in a list).
      stop_token_ids: token ids that end generation (even with ignore_eos).
      ignore_eos: keep generating after EOS.
      max_tokens: most tokens generated per output; None = up to the model's context length.
      min_tokens: EOS and stop_token_ids are blocked until this many tokens are generated.
      logprobs: also return this many top log-probabilities per generated token.
      prompt_logprobs: also return this many top log-probabilities per prompt token (the
        prompt token's own logprob and rank always; 0: only those). Such requests do not
        take prefix-cache hits (every prompt token is computed), as in vLLM.
      detokenize: produce output text.
      skip_special_tokens: drop special tokens from the output text.
      spaces_between_special_tokens: vLLM's detokenizer option; only True is supported.
      include_stop_str_in_output: keep the matched stop string at the end of the text.
      logit_bias: token id -> value added to its logit before sampling (vLLM's order: after
        min_tokens, before penalties and temperature).
      allowed_token_ids: only these tokens may be sampled.
      bad_words: words never generated; each must be a single token (with and without a
        leading space), checked when the request is submitted.
      return_hidden_states: also return the prompt's last-token hidden state (after the
        final norm, [hidden_size] fp32) in RequestOutput.hidden_states: what the model's
        first output token is read from. Not in vLLM (SGLang's request option of this name);
        the router's features use it (paged_jax/routing/features.py).
      structured_outputs: a constraint on the output (StructuredOutputsParams, or a dict of
        its fields): JSON schema, regex, choice or grammar.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    return_hidden_states: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.stop = _normalise_stop(self.stop)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
        self.stop_token_ids = list(_check_list("stop_token_ids", self.stop_token_ids) or [])
        if isinstance(self.top_k, int) and self.top_k == -1:
            self.top_k = 0  # vLLM accepts both 0 and -1 for "off"; keep one spelling
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:
            self._verify_greedy()
            # Greedy ignores the filters; resetting them keeps the device state uniform.
            self.temperature, self.top_p, self.top_k, self.min_p = 0.0, 1.0, 0, 0.0

    def _verify_args(self) -> None:
        _check_int("n", self.n, low=1)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_positive("repetition_penalty", self.repetition_penalty)
        _check_range("temperature", self.temperature, 0.0, float("inf"))
        _check_positive("top_p", self.top_p)
        _check_range("top_p", self.top_p, 0.0, 1.0)
        _check_int("top_k", self.top_k, low=0)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        for name in ("ignore_eos", "detokenize", "skip_special_tokens",
                     "spaces_between_special_tokens", "include_stop_str_in_output",
                     "return_hidden_states"):
            _check_bool(name, getattr(self, name))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0)
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0)
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched in the text).")
        self._verify_bias()
        if not self.spaces_between_special_tokens:
            raise ValueError("spaces_between_special_tokens must be True: paged-jax's "
                             "tokenizer decodes special tokens as written.")

    def _verify_bias(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> float, got "
                                 f"{type(self.logit_bias).__name__}.")
            for t, b in self.logit_bias.items():
                _check_int("logit_bias", t, low=0)
                if not math.isfinite(_check_number("logit_bias", b)):
                    raise ValueError(f"logit_bias values must be finite, got {b} for {t}.")
        if _check_list("allowed_token_ids", self.allowed_token_ids) is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None allows all).")
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids", t, low=0)
        if _check_list("bad_words", self.bad_words) is not None and not all(
                isinstance(w, str) and w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words must be a list of non-empty strings, got "
                             f"{self.bad_words!r}.")

    @property
    def has_logit_bias(self) -> bool:
        """Whether sampling adds a per-token bias row (logit_bias, allowed ids, bad words)."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words)

    def _verify_greedy(self) -> None:
        if self.n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")

    @property
    def sampling_type(self) -> SamplingType:
        """GREEDY when temperature is 0, else RANDOM_SEED with a seed, else RANDOM."""
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def output_text_buffer_length(self) -> int:
        """Characters of text to hold back while streaming, so a stop string is never shown."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def clone(self) -> SamplingParams:
        """A deep copy (the list fields are not shared)."""
        return dataclasses.replace(
            self, stop=list(self.stop or []), stop_token_ids=list(self.stop_token_ids or []),
            logit_bias=None if self.logit_bias is None else dict(self.logit_bias),
            allowed_token_ids=None if self.allowed_token_ids is None
            else list(self.allowed_token_ids),
            bad_words=None if self.bad_words is None else list(self.bad_words),
        )


@dataclasses.dataclass
class BeamSearchParams:
    """Beam-search settings, as vLLM's `BeamSearchParams`.

    Attributes:
      beam_width: beams kept per step, >= 1.
      max_tokens: most tokens generated, >= 1.
      ignore_eos: keep extending beams after EOS.
      temperature: must be 0: beams are scored on unscaled log-probabilities.
      length_penalty: score = cum_logprob / len ** length_penalty.
      include_stop_str_in_output: must be False (beam search has no stop strings).
      logit_bias, allowed_token_ids, bad_words: as in SamplingParams, applied to the logits
        before the log-softmax the beams are scored on (vLLM's order), so `cum_logprob` and
        the reported logprobs are those of the biased distribution.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, low=1)
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_range("temperature", self.temperature, 0.0, float("inf"))
        _check_range("length_penalty", self.length_penalty, float("-inf"), float("inf"))
        if self.temperature != 0.0:
            raise ValueError("temperature must be 0 for paged-jax's beam search (beams are "
                             f"scored on unscaled log-probabilities), got {self.temperature}.")
        _check_bool("ignore_eos", self.ignore_eos)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        if self.include_stop_str_in_output:
            raise ValueError("include_stop_str_in_output is not supported by beam search "
                             "(it has no stop strings); pass False.")
        self.bias_params()  # SamplingParams' checks name a bad logit_bias / allowed / bad word

    @property
    def n(self) -> int:
        """Outputs per prompt: the beams (a server's `n`)."""
        return self.beam_width

    def bias_params(self) -> SamplingParams:
        """Greedy SamplingParams carrying this search's logit bias, allowed ids and bad words
        (what the engine's input checks and `bias_row` read)."""
        return SamplingParams(temperature=0.0, max_tokens=None, detokenize=False,
                              logit_bias=self.logit_bias,
                              allowed_token_ids=self.allowed_token_ids,
                              bad_words=self.bad_words)


def _normalise_stop(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if not isinstance(stop, list | tuple):  # a dict or set would pass as its keys
        raise ValueError(f"stop must be a string or a list of non-empty strings, got {stop!r}.")
    stop = list(stop)
    if not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop must be a string or a list of non-empty strings, got {stop!r}.")
    return stop


def _is_int(value: object) -> bool:
    # bool is an int subclass, but True as a seed or count is almost certainly a mistake.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, low: int | None = None) -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}.")
    if low is not None and value < low:  # type: ignore[operator]
        raise ValueError(f"{name} must be at least {low}, got {value}.")


def _check_bool(name: str, value: object) -> None:
    # A truthy string ("false") or number read as a flag would silently flip it.
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}.")


def _check_list(name: str, value: list | None) -> list | None:
    """`value` if it is None, a list or a tuple (a str or dict would be read as its letters
    or keys)."""
    if value is not None and not isinstance(value, list | tuple):
        raise ValueError(f"{name} must be a list, got {value!r}.")
    return value


def _check_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}.")
    if value != value:  # NaN compares false with everything, so the range checks would pass
        raise ValueError(f"{name} must not be NaN.")
    return float(value)


def _check_range(name: str, value: object, low: float, high: float) -> None:
    v = _check_number(name, value)
    if not low <= v <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {v}.")


def _check_positive(name: str, value: object) -> None:
    if _check_number(name, value) <= 0.0:
        raise ValueError(f"{name} must be greater than 0, got {value}.")
