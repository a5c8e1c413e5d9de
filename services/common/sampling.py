"""Proto SamplingParams <-> engine SamplingParams, with the documented defaults."""

from __future__ import annotations

from engine.errors import InvalidRequestError
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from pdserve.v1 import common_pb2

DEFAULT_MAX_TOKENS = 16
FINISH_REASONS = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.DEADLINE: common_pb2.FINISH_REASON_DEADLINE,
}


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
        )
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"sampling.{exc.field}", exc.limit, exc.value) from exc


def to_proto(s: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
    )
    if s.seed is not None:
        msg.seed = s.seed
    return msg


def finish_reason(reason: FinishReason | None) -> int:
    """The proto enum for an engine finish reason (UNSPECIFIED while not finished)."""
    return common_pb2.FINISH_REASON_UNSPECIFIED if reason is None else FINISH_REASONS[reason]
