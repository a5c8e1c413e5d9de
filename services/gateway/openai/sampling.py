"""The sampling half of an OpenAI body: every parameter that shapes token choice, into
the engine's `SamplingParams`.

Lifecycle: `schema` calls `parse_sampling` once per body, after the body's shape is
checked. This module checks each parameter's JSON type and OpenAI's own range, then
builds the `SamplingParams` the gateway runs the request with (JSON -> SamplingParams,
no protobuf in between); the limits `SamplingParams` itself sets (min_tokens <=
max_tokens, top_p > 0, the size of a guided-decoding spec) refuse a value there, as a
`SchemaError` naming the OpenAI parameter (`ParamNames`) and marked `limit`, which the
gateway counts as a refused request, as it does the same refusal on gRPC. Limits that
depend on the model (context length, vocabulary) are the gateway's request check's.

Accepted: OpenAI's temperature, top_p, seed, stop, presence_penalty, frequency_penalty,
logit_bias, n, logprobs (completions: an int; chat: a bool plus top_logprobs), echo and
best_of (completions), response_format (text, json_object, json_schema); vLLM's
extensions top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
include_stop_str_in_output, skip_special_tokens, prompt_logprobs, and guided_json /
guided_regex / guided_choice / guided_grammar (or the newer `structured_outputs` object
with json / regex / choice / grammar).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.sampling_params import MAX_FORKS, MAX_LOGPROBS, GuidedKind, GuidedSpec, SamplingParams

SEED_CAP = 2**63
MAX_TOKEN_ID = 2**31 - 1


class SchemaError(ValueError):
    """A request body OpenAI's schema or pdserve refuses: HTTP 400 naming `param`.
    `limit`: a value `SamplingParams` refused (a refused request, in the gateway's
    metrics, as on gRPC), not one of the JSON's shape."""

    def __init__(self, param: str | None, message: str, *, limit: bool = False) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param
        self.limit = limit


@dataclass(frozen=True)
class ParamNames:
    """Which OpenAI parameter stands behind a field of the gateway's request: the one
    the client used for max_tokens, the one that asked for structured output, whether
    `best_of` asked for the forks."""

    chat: bool
    max_tokens: str = "max_tokens"
    guided: str = ""
    best_of: bool = False

    def param_for(self, field: str) -> str:
        """The OpenAI parameter behind a field name of the gateway's validation."""
        name = field.removeprefix("sampling.")
        if name == "max_tokens":
            return self.max_tokens
        if (self.chat and name in ("prompt", "input")) or name.startswith("messages"):
            return "messages"
        if name == "prompt_token_ids":
            return "prompt"
        if name.startswith("guided") and self.guided:
            return self.guided
        if name == "n" and self.best_of:
            return "best_of"
        if name == "logprobs" and self.chat:
            return "top_logprobs"
        return name

    def refusal(self, exc: InvalidRequestError) -> SchemaError:
        """`exc` (from building `SamplingParams`) as the 400 naming the parameter."""
        rest = str(exc)[len(exc.field) + 2 :]  # past "<field>: "
        return SchemaError(self.param_for(exc.field), rest, limit=True)


@dataclass(frozen=True)
class Sampling:
    """The parsed sampling parameters: the engine's `SamplingParams` the gateway runs
    the request with, plus what the HTTP answer needs to know (how many choices to
    return, log-probability output)."""

    params: SamplingParams
    n: int = 1  # choices returned (best_of >= n forks run)
    best_of: int = 1
    logprobs: int | None = None  # top N per output token; None: no logprobs in the answer
    echo: bool = False
    guided_param: str = ""  # the OpenAI parameter that asked for guided decoding


# -- JSON type checks -----------------------------------------------------------------
def get_bool(obj: Mapping[str, object], key: str, param: str = "") -> bool:
    value = obj.get(key)
    if value is not None and not isinstance(value, bool):
        raise SchemaError(param or key, "must be true or false")
    return bool(value)


def get_int(obj: Mapping[str, object], key: str, lo: int, hi: int) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SchemaError(key, f"must be an integer (got {_short(value)})")
    if not lo <= value <= hi:
        raise SchemaError(key, f"must be in [{lo}, {hi}] (got {_short(value)})")
    return value


def get_number(obj: Mapping[str, object], key: str, lo: float, hi: float) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SchemaError(key, f"must be a number (got {_short(value)})")
    if not (math.isfinite(value) and lo <= value <= hi):
        raise SchemaError(key, f"must be in [{lo:g}, {hi:g}] (got {_short(value)})")
    return float(value)


def get_str(obj: Mapping[str, object], key: str, param: str = "") -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise SchemaError(param or key, "must be a string")
    return value


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _token_ids(obj: Mapping[str, object], key: str) -> list[int]:
    value = obj.get(key)
    if value is None:
        return []
    ok = isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in value
    )
    if not ok:
        raise SchemaError(key, "must be a list of token ids (non-negative integers)")
    assert isinstance(value, list)
    return value


# -- the parameters ---------------------------------------------------------------------
#: What the parsers collect: `SamplingParams`'s keyword arguments, built once at the end.
Draft = dict[str, object]


def parse_sampling(obj: Mapping[str, object], *, chat: bool, max_tokens: int) -> Sampling:
    """`obj`'s sampling parameters; SchemaError naming the first bad one."""
    p: Draft = {"max_tokens": max_tokens}
    _basic(obj, p)
    _penalties(obj, p)
    _extensions(obj, p)
    n, best_of = _forks(obj, chat)
    p["n"] = best_of
    logprobs, echo = _logprobs(obj, p, chat)
    if best_of > n and logprobs is None:
        p["logprobs"] = 0  # best_of ranks the forks by their cumulative log-probability
    guided_param = _guided(obj, p)
    names = ParamNames(chat, max_tokens_param(obj, chat=chat), guided_param, best_of > n)
    return Sampling(build(p, names), n, best_of, logprobs, echo, guided_param)


def build(p: Draft, names: ParamNames) -> SamplingParams:
    """The `SamplingParams` of `p`; its refusal as the 400 naming the parameter."""
    try:
        guided = p.get("guided")
        if isinstance(guided, tuple):  # (kind, spec, choices), checked by GuidedSpec
            p = {**p, "guided": GuidedSpec(*guided)}
        return SamplingParams(**p)  # type: ignore[arg-type]
    except InvalidRequestError as exc:
        raise names.refusal(exc) from None


def max_tokens_param(obj: Mapping[str, object], *, chat: bool) -> str:
    """The name the client gave max_tokens (chat: max_completion_tokens if sent)."""
    return (
        "max_completion_tokens"
        if chat and obj.get("max_completion_tokens") is not None
        else "max_tokens"
    )


def _basic(obj: Mapping[str, object], p: Draft) -> None:
    temperature = get_number(obj, "temperature", 0.0, 2.0)
    p["temperature"] = 1.0 if temperature is None else temperature
    top_p = get_number(obj, "top_p", 0.0, 1.0)
    p["top_p"] = 1.0 if top_p is None else top_p
    seed = get_int(obj, "seed", -(2**63), SEED_CAP - 1)
    if seed is not None:
        p["seed"] = seed % SEED_CAP  # OpenAI takes any int64; the engine's generators want >= 0
    p["stop"] = tuple(_stop(obj))


def _stop(obj: Mapping[str, object]) -> list[str]:
    value = obj.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise SchemaError("stop", "must be a string or a list of strings")
    return stops


def _penalties(obj: Mapping[str, object], p: Draft) -> None:
    for key in ("presence_penalty", "frequency_penalty"):
        value = get_number(obj, key, -2.0, 2.0)
        if value is not None:
            p[key] = value
    repetition = get_number(obj, "repetition_penalty", 0.0, math.inf)
    if repetition is not None:
        p["repetition_penalty"] = repetition
    bias = obj.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise SchemaError("logit_bias", "must be an object mapping token ids to biases")
    biases: dict[int, float] = {}
    for key, value in bias.items():
        token = _token_key(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SchemaError("logit_bias", f"the bias of {key!r} must be a number")
        if not (math.isfinite(value) and -100.0 <= value <= 100.0):
            raise SchemaError("logit_bias", f"the bias of {key!r} must be in [-100, 100]")
        biases[token] = float(value)
    p["logit_bias"] = tuple(sorted(biases.items()))


def _token_key(key: str) -> int:
    if not (key.isascii() and key.isdigit()) or int(key) > MAX_TOKEN_ID:
        raise SchemaError("logit_bias", f"keys must be token ids (got {_short(key)})")
    return int(key)


def _extensions(obj: Mapping[str, object], p: Draft) -> None:
    top_k = get_int(obj, "top_k", -1, MAX_TOKEN_ID)
    if top_k is not None and top_k > 0:  # vLLM: -1 or 0 turn it off
        p["top_k"] = top_k
    min_p = get_number(obj, "min_p", 0.0, 1.0)
    if min_p is not None:
        p["min_p"] = min_p
    min_tokens = get_int(obj, "min_tokens", 0, MAX_TOKEN_ID)
    if min_tokens is not None:
        p["min_tokens"] = min_tokens
    p["ignore_eos"] = get_bool(obj, "ignore_eos")
    p["stop_token_ids"] = tuple(_token_ids(obj, "stop_token_ids"))
    p["include_stop_str_in_output"] = get_bool(obj, "include_stop_str_in_output")
    if obj.get("skip_special_tokens") is not None:
        p["skip_special_tokens"] = get_bool(obj, "skip_special_tokens")
    prompt_logprobs = get_int(obj, "prompt_logprobs", 0, MAX_LOGPROBS)
    if prompt_logprobs is not None:
        p["prompt_logprobs"] = prompt_logprobs


def _forks(obj: Mapping[str, object], chat: bool) -> tuple[int, int]:
    n = get_int(obj, "n", 1, MAX_FORKS) or 1
    best_of = None if chat else get_int(obj, "best_of", 1, MAX_FORKS)
    if best_of is None:
        return n, n
    if best_of < n:
        raise SchemaError("best_of", f"must be >= n ({n})")
    if best_of > n and get_bool(obj, "stream"):
        raise SchemaError("best_of", "cannot be streamed: send stream=false, or best_of = n")
    return n, best_of


def _logprobs(obj: Mapping[str, object], p: Draft, chat: bool) -> tuple[int | None, bool]:
    """(top N per output token or None, echo). Completions: `logprobs` is N (0-20) and
    `echo` returns the prompt too, with its log-probabilities when `logprobs` is set.
    Chat: `logprobs` is a bool and `top_logprobs` the N."""
    if chat:
        top = get_int(obj, "top_logprobs", 0, MAX_LOGPROBS)
        if not get_bool(obj, "logprobs"):
            if top:
                raise SchemaError("top_logprobs", "needs logprobs: true")
            return None, False
        p["logprobs"] = top or 0
        return top or 0, False
    n = get_int(obj, "logprobs", 0, MAX_LOGPROBS)
    echo = get_bool(obj, "echo")
    if n is not None:
        p["logprobs"] = n
        if echo:
            asked = p.get("prompt_logprobs")
            p["prompt_logprobs"] = max(n, asked if isinstance(asked, int) else 0)
    return n, echo


# -- structured output ------------------------------------------------------------------
GUIDED_FIELDS = {
    "guided_json": GuidedKind.JSON_SCHEMA,
    "guided_regex": GuidedKind.REGEX,
    "guided_choice": GuidedKind.CHOICE,
    "guided_grammar": GuidedKind.GRAMMAR,
}
STRUCTURED_KEYS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                   "grammar": "guided_grammar"}  # fmt: skip

#: A constraint as parsed: (kind, spec, choices); `GuidedSpec` checks it in `build`.
Guided = tuple[GuidedKind, str, tuple[str, ...]]


def _guided(obj: Mapping[str, object], p: Draft) -> str:
    """Put the constraint of whichever parameter asks for structured output in `p`;
    returns its name ("" when none does). At most one may."""
    asked = _guided_asks(obj)
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise SchemaError(asked[1][0], f"only one structured-output parameter at a time ({names})")
    if not asked:
        return ""
    name, value = asked[0]
    if name == "response_format":
        p["guided"] = _response_format(value)
    else:
        p["guided"] = _guided_field(name, STRUCTURED_KEYS.get(name.rsplit(".", 1)[-1], name), value)
    return name.split(".", 1)[0]


def _guided_asks(obj: Mapping[str, object]) -> list[tuple[str, object]]:
    asked = [(name, obj[name]) for name in GUIDED_FIELDS if obj.get(name) is not None]
    structured = obj.get("structured_outputs")
    if structured is not None:
        if not isinstance(structured, dict):
            raise SchemaError("structured_outputs", "must be an object")
        asked += [
            (f"structured_outputs.{key}", structured[key])
            for key in STRUCTURED_KEYS
            if structured.get(key) is not None
        ]
    fmt = obj.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        asked.append(("response_format", fmt))
    return asked


def _guided_field(param: str, kind_name: str, value: object) -> Guided:
    kind = GUIDED_FIELDS[kind_name]
    if kind_name == "guided_choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise SchemaError(param, "must be a list of strings")
        return kind, "", tuple(value)
    if kind_name == "guided_json":
        return kind, _schema_text(param, value), ()
    if isinstance(value, str):
        return kind, value, ()
    raise SchemaError(param, "must be a string")


def _response_format(value: object) -> Guided:
    if not isinstance(value, dict):
        raise SchemaError("response_format", "must be an object with a type")
    kind = value.get("type")
    if kind == "json_object":
        return GuidedKind.JSON_OBJECT, "", ()
    if kind != "json_schema":
        raise SchemaError("response_format", "type must be text, json_object or json_schema")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise SchemaError("response_format.json_schema", "must be an object with a schema")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise SchemaError("response_format.json_schema.name", "must be a string")
    schema = spec.get("schema")
    if schema is None:
        raise SchemaError("response_format.json_schema.schema", "is required")
    return GuidedKind.JSON_SCHEMA, _schema_text("response_format.json_schema.schema", schema), ()


def _schema_text(param: str, schema: object) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise SchemaError(param, "must be a JSON schema (an object)") from None
    if not isinstance(schema, dict):
        raise SchemaError(param, "must be a JSON schema (an object)")
    return json.dumps(schema, separators=(",", ":"))
