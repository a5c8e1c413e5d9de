"""The engine's DEADLINE outcome at the service boundary: every engine finish reason has
a proto value, and an output that ended on its deadline becomes DEADLINE_EXCEEDED (HTTP
504) with a message that says what happened and what to do."""

from __future__ import annotations

import grpc
import pytest

from engine.errors import DeadlineExceededError
from engine.finish_reason import FinishReason
from engine.request import RequestOutput
from pdserve.v1 import common_pb2
from services.common import sampling
from services.common.status import status_for
from services.gateway.openai.schema import http_for_status


def test_every_finish_reason_has_a_proto_value() -> None:
    values = {sampling.finish_reason(r) for r in FinishReason}
    assert len(values) == len(FinishReason)
    assert common_pb2.FINISH_REASON_UNSPECIFIED not in values
    assert sampling.finish_reason(FinishReason.DEADLINE) == common_pb2.FINISH_REASON_DEADLINE


def test_an_output_ended_on_its_deadline_is_deadline_exceeded() -> None:
    out = RequestOutput("r1", [], True, FinishReason.DEADLINE)
    with pytest.raises(DeadlineExceededError) as info:
        out.raise_for_deadline()
    code, message = status_for(info.value)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert http_for_status(code)[0] == 504
    assert "r1" in message and "deadline" in message and "retry" in message
    RequestOutput("r2", [7], True, FinishReason.LENGTH).raise_for_deadline()  # no error
