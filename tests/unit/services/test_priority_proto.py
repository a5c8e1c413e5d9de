"""Priority classes on the wire: every class survives the round trip to a worker."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequestError
from engine.priority import Priority
from pdserve.v1 import common_pb2
from services.common import priority_proto


@pytest.mark.parametrize("priority", list(Priority))
def test_every_class_reaches_the_engine_unchanged(priority: Priority) -> None:
    # SHEDDABLE is 0: a falsy class must not turn into the default on the worker.
    assert priority_proto.for_engine(priority_proto.to_proto(priority)) is priority


def test_unspecified_and_unknown_run_at_standard_on_a_worker() -> None:
    assert priority_proto.for_engine(common_pb2.PRIORITY_UNSPECIFIED) is Priority.STANDARD
    assert priority_proto.for_engine(99) is Priority.STANDARD


def test_unknown_value_at_the_gateway_names_the_field() -> None:
    assert priority_proto.from_proto(common_pb2.PRIORITY_UNSPECIFIED) is None
    with pytest.raises(InvalidRequestError, match="priority"):
        priority_proto.from_proto(99)
