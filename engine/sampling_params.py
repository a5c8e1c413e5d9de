"""Per-request sampling settings, validated once when the request is built."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

from engine.errors import InvalidRequestError

#: OpenAI's cap on top_logprobs and on the completions API's `logprobs`.
MAX_LOGPROBS = 20

#: Stop strings are matched on decoded text; longer ones would make every step slow.
MAX_STOP_STRING_CHARS = 256
MAX_STOP_STRINGS = 16
#: OpenAI's limits for the penalties and logit_bias (entries, and each bias's range).
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_LOGIT_BIAS = 100.0
#: Forks per request (n, best_of): each holds its own KV beyond the shared prompt.
MAX_FORKS = 16
#: A guided-decoding spec (schema, regex, grammar, or all choices together), in characters.
MAX_GUIDED_SPEC_CHARS = 64 * 1024
MAX_GUIDED_CHOICES = 256


class GuidedKind(enum.Enum):
    """What a structured-output constraint is given as (see engine/grammar.py)."""

    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # `spec` is a JSON schema
    REGEX = "regex"  # `spec` is a regular expression
    CHOICE = "choice"  # exactly one of `choices`
    GRAMMAR = "grammar"  # `spec` is a grammar (EBNF / Lark syntax)


@dataclass(frozen=True)
class GuidedSpec:
    """A structured-output constraint: the request samples only tokens it accepts, and
    ends (STOP) when it is complete. Compiled by the engine's grammar compiler."""

    kind: GuidedKind
    spec: str = ""
    choices: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        size = len(self.spec) + sum(len(c) for c in self.choices)
        if size > MAX_GUIDED_SPEC_CHARS:
            raise InvalidRequestError("guided", f"at most {MAX_GUIDED_SPEC_CHARS} characters")
        if self.kind is GuidedKind.CHOICE:
            if not self.choices or len(self.choices) > MAX_GUIDED_CHOICES:
                raise InvalidRequestError(
                    "guided.choices", f"must hold 1 to {MAX_GUIDED_CHOICES} strings"
                )
            if any(not c for c in self.choices):
                raise InvalidRequestError("guided.choices", "must not hold an empty string")
        needs_spec = (GuidedKind.JSON_SCHEMA, GuidedKind.REGEX, GuidedKind.GRAMMAR)
        if self.kind in needs_spec and not self.spec:
            raise InvalidRequestError("guided.spec", f"must not be empty for {self.kind.value}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    temperature 0 means greedy. top_k 0 disables top-k. `seed` makes a request's samples
    reproducible whatever else shares its batch: each request owns its generator.

    Logit processing (engine/logits_processing.py), in order: repetition, frequency and
    presence penalties over the tokens so far, `logit_bias`, EOS and `stop_token_ids`
    masked while fewer than `min_tokens` are out, the grammar mask of `guided`; then
    temperature, top-k, top-p and `min_p`. `logprobs` (None: off) asks for the chosen
    token's log-probability and the top N at each output position, `prompt_logprobs`
    the same for every prompt position (the request then skips the prefix cache, which
    holds no logits). `n` forks the request after its prompt: the forks share the
    prompt's KV blocks and each samples with its own generator (fork i seeded with
    seed + i). `skip_special_tokens` and `include_stop_str_in_output` shape the text,
    which the gateway makes; the engine carries them.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    min_tokens: int = 0
    min_p: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    guided: GuidedSpec | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidRequestError("max_tokens", "must be an integer", self.max_tokens)
        if self.max_tokens <= 0:
            raise InvalidRequestError("max_tokens", "must be > 0", self.max_tokens)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("temperature", "must be >= 0 and finite", self.temperature)
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidRequestError("top_p", "must be in (0, 1]", self.top_p)
        if self.top_k < 0:
            raise InvalidRequestError("top_k", "must be >= 0 (0 disables it)", self.top_k)
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError("seed", "must be in [0, 2**63)", self.seed)
        self._check_stops()
        self._check_processing()
        self._check_counts()

    def _check_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise InvalidRequestError(
                    name, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]", value
                )
        r = self.repetition_penalty
        if not (math.isfinite(r) and 0.0 < r <= MAX_PENALTY):
            raise InvalidRequestError("repetition_penalty", f"must be in (0, {MAX_PENALTY:g}]", r)
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError(
                "logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries", len(self.logit_bias)
            )
        for token, bias in self.logit_bias:
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise InvalidRequestError(
                    "logit_bias",
                    f"each bias must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
                    bias,
                )
            if token < 0:
                raise InvalidRequestError("logit_bias", "token ids must be >= 0", token)
        if not (math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError("min_p", "must be in [0, 1]", self.min_p)

    def _check_counts(self) -> None:
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError("min_tokens", "must be in [0, max_tokens]", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequestError(name, f"must be in [0, {MAX_LOGPROBS}]", value)
        if not 1 <= self.n <= MAX_FORKS:
            raise InvalidRequestError("n", f"must be in [1, {MAX_FORKS}]", self.n)

    def _check_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(
                    "stop", f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters", s
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether any logit processing applies (beyond temperature and truncation)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
            or self.min_tokens > 0
        )

    def fork(self, index: int) -> SamplingParams:
        """Fork `index`'s settings: one sequence (n=1), its own seed (seed + index)."""
        seed = None if self.seed is None else (self.seed + index) % 2**63
        return replace(self, n=1, seed=seed)
