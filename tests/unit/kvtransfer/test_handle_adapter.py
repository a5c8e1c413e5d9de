"""A KV hand-off agrees on the LoRA adapter: the request's adapter is reserved with the
exporter's digest (so the engine refuses another copy of it), and a request and a
handle that disagree on having an adapter at all are refused before anything is held."""

from __future__ import annotations

import pytest

from engine.adapter_ref import AdapterRef
from engine.errors import AdapterMismatchError
from kvtransfer.handle import handle_adapter
from pdserve.v1 import common_pb2


def test_the_exporters_digest_goes_with_the_adapter() -> None:
    handle = common_pb2.KvHandle(adapter_digest="d" * 32)
    assert handle_adapter(handle, "alpha") == AdapterRef("alpha", "d" * 32)
    assert handle_adapter(common_pb2.KvHandle(), "") is None


@pytest.mark.parametrize(
    ("digest", "adapter", "message"),
    [("d" * 32, "", "runs the base model but the handle carries KV of a LoRA adapter"),
     ("", "alpha", "runs adapter 'alpha' but the handle carries base-model KV")],
)  # fmt: skip
def test_a_request_and_its_kv_must_agree(digest: str, adapter: str, message: str) -> None:
    with pytest.raises(AdapterMismatchError, match=message):
        handle_adapter(common_pb2.KvHandle(adapter_digest=digest), adapter)
