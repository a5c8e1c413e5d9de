"""The one check of a request against a model's limits, shared by the gateway and the engine.

Lifecycle: the gateway runs `check_request` once a client's prompt is tokenized (with its
operator's `max_tokens_limit`, before any worker is involved); every engine runs it again
at intake (with its KV pool's size), because a worker's RPC can come from anyone. Values
that need no model (a negative temperature, too many stop strings) are
`SamplingParams`'s own checks, made when it is built; this adds what depends on the
model and the deployment. It is pure: it reads the spec and the limits, changes nothing,
and raises `InvalidRequestError` naming the field as the request contract spells it
(`prompt`, `prompt_token_ids`, `sampling.max_tokens`, ...) and the limit it broke.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.priority import Priority
from engine.request_spec import RequestSpec


@dataclass(frozen=True)
class RequestLimits:
    """What a request must fit: the context length and vocabulary of its model, and
    where known the KV pool it runs in (an engine's) and the operator's ceiling on
    `max_tokens` (a gateway's)."""

    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int | None = None
    max_tokens_limit: int | None = None


def check_request(spec: RequestSpec, limits: RequestLimits) -> None:
    """Raise InvalidRequestError for the first thing in `spec` that breaks `limits`."""
    _check_priority(spec.priority)
    if not 0 < spec.cache_weight < float("inf"):
        raise InvalidRequestError("cache_weight", "must be a finite number > 0", spec.cache_weight)
    _check_prompt(spec.prompt_token_ids, limits)
    _check_token_fields(spec, limits.vocab_size)
    _check_length(spec, limits)
    if spec.resume_token_ids:
        _check_resume(spec, limits.vocab_size)


def _check_ids(field: str, ids: Sequence[int], vocab_size: int) -> None:
    """InvalidRequestError naming `field` unless every id is in [0, vocab_size)."""
    if any(not 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(field, f"each id must be in [0, {vocab_size})")


def _check_priority(priority: Priority) -> None:
    # A caller in this process may pass a plain int; the wire codec maps unknown values.
    try:
        Priority(priority)
    except ValueError:
        allowed = ", ".join(f"{p.label} ({p.value})" for p in Priority)
        raise InvalidRequestError("priority", f"must be one of {allowed}", priority) from None


def _check_prompt(prompt: Sequence[int], limits: RequestLimits) -> None:
    n = len(prompt)
    if n == 0:
        raise InvalidRequestError("prompt", "must not be empty")
    _check_ids("prompt_token_ids", prompt, limits.vocab_size)
    if n >= limits.max_model_len:
        raise InvalidRequestError(
            "prompt", f"has {n} tokens; must be < {limits.max_model_len} (the context length)"
        )


def _check_token_fields(spec: RequestSpec, vocab_size: int) -> None:
    sampling = spec.sampling
    if any(t >= vocab_size for t, _ in sampling.logit_bias):
        raise InvalidRequestError("sampling.logit_bias", f"each token id must be < {vocab_size}")
    if any(t >= vocab_size for t in sampling.stop_token_ids):
        raise InvalidRequestError("sampling.stop_token_ids", f"each id must be < {vocab_size}")


def _check_length(spec: RequestSpec, limits: RequestLimits) -> None:
    n, max_tokens = spec.num_prompt_tokens, spec.sampling.max_tokens
    cap = limits.max_tokens_limit
    if cap is not None and max_tokens > cap:
        raise InvalidRequestError(
            "sampling.max_tokens",
            f"must be <= {cap} (this gateway's max_tokens_limit)",
            max_tokens,
        )
    if n + max_tokens > limits.max_model_len:
        raise InvalidRequestError(
            "sampling.max_tokens",
            f"prompt ({n}) + max_tokens must be <= {limits.max_model_len} (the context length)",
            max_tokens,
        )
    capacity = limits.kv_capacity_tokens
    if capacity is not None and n + spec.sampling.n * max_tokens > capacity:
        raise InvalidRequestError(
            "sampling.max_tokens",
            f"prompt ({n}) + n x max_tokens must fit the KV pool ({capacity} tokens)",
        )


def _check_resume(spec: RequestSpec, vocab_size: int) -> None:
    """A migrated stream's tokens so far must be tokens, fewer than it may make, of a
    request that can resume (one fork, its prompt's log-probabilities already sent)."""
    params = spec.sampling
    _check_ids("resume_token_ids", spec.resume_token_ids, vocab_size)
    if len(spec.resume_token_ids) >= params.max_tokens:
        raise InvalidRequestError(
            "resume_token_ids", f"must hold fewer than max_tokens ({params.max_tokens}) ids"
        )
    if params.n != 1 or params.prompt_logprobs is not None:
        raise InvalidRequestError(
            "resume_token_ids", "only a request with n = 1 and no prompt_logprobs resumes"
        )
