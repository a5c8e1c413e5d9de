"""The request contract on the wire: a spec survives the hop to a worker unchanged."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from engine.adapter_ref import AdapterRef
from engine.errors import InvalidRequestError
from engine.priority import Priority
from engine.request_check import RequestLimits, check_request
from engine.request_spec import RequestSpec
from engine.sampling_params import GuidedKind, GuidedSpec, SamplingParams
from pdserve.v1 import common_pb2, worker_pb2
from services.common import request_codec

SPEC = RequestSpec(
    (5, 6, 7),
    SamplingParams(
        max_tokens=9, temperature=0.5, seed=3, stop=("x",), logit_bias=((4, 1.5),), n=2,
        guided=GuidedSpec(GuidedKind.CHOICE, choices=("a", "b")),
    ),
    request_id="r.1",
    cache_salt="tenant-a",
    cache_weight=2.5,
    priority=Priority.CRITICAL,
    adapter=AdapterRef("alpha", "d" * 32),
)  # fmt: skip


def test_prefill_round_trip_keeps_every_field() -> None:
    assert request_codec.spec_of(request_codec.prefill_request(SPEC)) == SPEC


def test_decode_round_trip_keeps_resume_tokens_and_the_handle() -> None:
    spec = replace(SPEC, sampling=replace(SPEC.sampling, n=1), resume_token_ids=(8, 9))
    handle = common_pb2.KvHandle(lease_id="l", first_token_id=11)
    msg = request_codec.decode_request(spec, handle)
    assert msg.kv_handle.lease_id == "l"
    assert request_codec.spec_of(msg) == spec
    assert not request_codec.decode_request(spec).HasField("kv_handle")


def test_the_deadline_rides_as_the_calls_time_remaining() -> None:
    before = time.monotonic()
    spec = request_codec.spec_of(request_codec.prefill_request(SPEC), 2.0)
    assert spec.deadline is not None and before + 2.0 <= spec.deadline <= time.monotonic() + 2.0
    assert request_codec.spec_of(request_codec.prefill_request(SPEC)).deadline is None


@pytest.mark.parametrize("priority", list(Priority))
def test_every_class_reaches_the_engine_unchanged(priority: Priority) -> None:
    # SHEDDABLE is 0: a falsy class must not turn into the default on the worker.
    msg = request_codec.prefill_request(replace(SPEC, priority=priority))
    assert request_codec.spec_of(msg).priority is priority


@pytest.mark.parametrize("value", [common_pb2.PRIORITY_UNSPECIFIED, 99])
def test_unspecified_and_unknown_run_at_standard_on_a_worker(value: int) -> None:
    msg = request_codec.prefill_request(SPEC)
    msg.priority = value  # type: ignore[assignment]
    assert request_codec.spec_of(msg).priority is Priority.STANDARD


def test_unknown_value_from_a_client_names_the_field() -> None:
    assert request_codec.priority_from_proto(common_pb2.PRIORITY_UNSPECIFIED) is None
    with pytest.raises(InvalidRequestError, match="priority"):
        request_codec.priority_from_proto(99)


def test_an_unset_cache_weight_is_an_even_share_and_a_bad_one_is_refused() -> None:
    msg = request_codec.prefill_request(SPEC)
    msg.ClearField("cache_weight")  # an older gateway
    assert request_codec.spec_of(msg).cache_weight == 1.0
    msg.cache_weight = -2.0
    limits = RequestLimits(max_model_len=64, vocab_size=100)
    with pytest.raises(InvalidRequestError) as info:
        check_request(request_codec.spec_of(msg), limits)
    assert info.value.field == "cache_weight"


def test_a_bad_sampling_field_is_named_with_its_path() -> None:
    msg = worker_pb2.PrefillRequest(request_id="r", prompt_token_ids=[1])
    msg.sampling.temperature = -1.0
    with pytest.raises(InvalidRequestError) as info:
        request_codec.spec_of(msg)
    assert info.value.field == "sampling.temperature"


def test_no_adapter_is_the_base_model() -> None:
    spec = replace(SPEC, adapter=None)
    msg = request_codec.prefill_request(spec)
    assert not msg.HasField("adapter")
    assert request_codec.spec_of(msg).adapter is None
