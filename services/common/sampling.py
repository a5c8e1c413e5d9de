"""Proto SamplingParams <-> engine SamplingParams, with the documented defaults; engine
log-probabilities <-> proto TokenLogprobs."""

from __future__ import annotations

from collections.abc import Iterable

from engine.errors import InvalidRequestError
from engine.finish_reason import FinishReason
from engine.logprobs import Logprob, TokenLogprobs
from engine.sampling_params import GuidedKind, GuidedSpec, SamplingParams
from pdserve.v1 import common_pb2

DEFAULT_MAX_TOKENS = 16
FINISH_REASONS = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.DEADLINE: common_pb2.FINISH_REASON_DEADLINE,
}
GUIDED_KINDS = {
    common_pb2.GUIDED_KIND_JSON_OBJECT: GuidedKind.JSON_OBJECT,
    common_pb2.GUIDED_KIND_JSON_SCHEMA: GuidedKind.JSON_SCHEMA,
    common_pb2.GUIDED_KIND_REGEX: GuidedKind.REGEX,
    common_pb2.GUIDED_KIND_CHOICE: GuidedKind.CHOICE,
    common_pb2.GUIDED_KIND_GRAMMAR: GuidedKind.GRAMMAR,
}
GUIDED_PROTO = {kind: value for value, kind in GUIDED_KINDS.items()}


def _opt(p: common_pb2.SamplingParams, name: str, default: object) -> object:
    return getattr(p, name) if p.HasField(name) else default


def from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """Raises InvalidRequestError naming the field (with a `sampling.` prefix)."""
    try:
        return SamplingParams(
            max_tokens=p.max_tokens if p.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
            temperature=p.temperature if p.HasField("temperature") else 0.0,
            top_p=p.top_p if p.HasField("top_p") else 1.0,
            top_k=p.top_k if p.HasField("top_k") else 0,
            seed=p.seed if p.HasField("seed") else None,
            stop=tuple(p.stop),
            stop_token_ids=tuple(p.stop_token_ids),
            ignore_eos=p.ignore_eos,
            presence_penalty=p.presence_penalty if p.HasField("presence_penalty") else 0.0,
            frequency_penalty=p.frequency_penalty if p.HasField("frequency_penalty") else 0.0,
            repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
            logit_bias=tuple(sorted(p.logit_bias.items())),
            min_tokens=p.min_tokens if p.HasField("min_tokens") else 0,
            min_p=p.min_p if p.HasField("min_p") else 0.0,
            logprobs=p.logprobs if p.HasField("logprobs") else None,
            prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
            n=p.n if p.HasField("n") else 1,
            include_stop_str_in_output=p.include_stop_str_in_output,
            skip_special_tokens=p.skip_special_tokens
            if p.HasField("skip_special_tokens")
            else True,
            guided=_guided(p.guided),
        )
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"sampling.{exc.field}", exc.limit, exc.value) from exc


def _guided(g: common_pb2.GuidedDecoding) -> GuidedSpec | None:
    if g.kind == common_pb2.GUIDED_KIND_UNSPECIFIED:
        return None
    kind = GUIDED_KINDS.get(g.kind)
    if kind is None:
        raise InvalidRequestError("guided.kind", "is not a known GuidedKind", g.kind)
    return GuidedSpec(kind, g.spec, tuple(g.choices))


def to_proto(s: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        logit_bias=dict(s.logit_bias),
        min_tokens=s.min_tokens,
        min_p=s.min_p,
        n=s.n,
        include_stop_str_in_output=s.include_stop_str_in_output,
        skip_special_tokens=s.skip_special_tokens,
    )
    if s.seed is not None:
        msg.seed = s.seed
    if s.logprobs is not None:
        msg.logprobs = s.logprobs
    if s.prompt_logprobs is not None:
        msg.prompt_logprobs = s.prompt_logprobs
    if s.guided is not None:
        msg.guided.CopyFrom(
            common_pb2.GuidedDecoding(
                kind=GUIDED_PROTO[s.guided.kind], spec=s.guided.spec, choices=s.guided.choices
            )
        )
    return msg


def finish_reason(reason: FinishReason | None) -> int:
    """The proto enum for an engine finish reason (UNSPECIFIED while not finished)."""
    return common_pb2.FINISH_REASON_UNSPECIFIED if reason is None else FINISH_REASONS[reason]


# -- log-probabilities -----------------------------------------------------------------
def logprobs_to_proto(values: Iterable[TokenLogprobs]) -> list[common_pb2.TokenLogprobs]:
    return [
        common_pb2.TokenLogprobs(
            chosen=common_pb2.Logprob(token_id=v.chosen.token_id, logprob=v.chosen.logprob),
            top=[common_pb2.Logprob(token_id=t.token_id, logprob=t.logprob) for t in v.top],
            rank=v.rank,
        )
        for v in values
    ]


def logprobs_from_proto(values: Iterable[common_pb2.TokenLogprobs]) -> list[TokenLogprobs]:
    return [
        TokenLogprobs(
            Logprob(v.chosen.token_id, v.chosen.logprob),
            v.rank,
            tuple(Logprob(t.token_id, t.logprob) for t in v.top),
        )
        for v in values
    ]
