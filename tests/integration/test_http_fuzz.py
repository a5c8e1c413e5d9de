"""Bad input against the OpenAI HTTP API of a running cluster, as test_fuzz.py does for
gRPC: hypothesis-generated bodies for /v1/completions, /v1/chat/completions, /tokenize
and /detokenize (wrong types, nesting, invalid Unicode, huge values, unknown roles, null
content, every new parameter with good and bad values), then raw bytes (random,
truncated JSON, bad UTF-8, deep nesting).

Every answer must be 200, or a 4xx in OpenAI's error shape with a message (400 naming
the parameter where there is one; 404 unknown model; 429 a refusal), or a 503 refusal
with Retry-After: never another 5xx and never a hang (a client timeout fails the test).
Afterwards /health is 200 and the leak probe finds nothing held. Valid generations are
capped at two tokens so the run stays short.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.cluster.config import ClusterConfig
from services.cluster.local_cluster import LocalCluster
from tests.conftest import MODEL_CACHE
from tests.integration.leak_check import assert_cluster_clean, start_probe

# Runs beside one other pairable file in make test (tests/conftest.py).
pytestmark = pytest.mark.pairable

COMPLETION_CASES = 650
CHAT_CASES = 650
TOKENIZE_CASES = 300
RAW_CASES = 450
assert COMPLETION_CASES + CHAT_CASES + TOKENIZE_CASES + RAW_CASES >= 2000
TIMEOUT_S = 60.0
ALLOWED = {200, 400, 404, 413, 429, 503}
FUZZ = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(
        ClusterConfig(
            gateway_port=0, num_prefill=0, num_decode=1, model_cache_dir=MODEL_CACHE,
            worker_kv_cache_bytes=96 << 20,
        )
    )  # fmt: skip
    c.start()
    probe = start_probe(c)
    yield c
    assert _post(c, "/health", None, method="GET")[0] == 200
    assert_cluster_clean(probe)
    c.stop()


def _post(
    cluster: LocalCluster, path: str, body: bytes | None, method: str = "POST"
) -> tuple[int, bytes, dict[str, str]]:
    assert cluster.http_address
    host, port = cluster.http_address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        reply = conn.getresponse()
        return reply.status, reply.read(), dict(reply.getheaders())
    finally:
        conn.close()


def _check(status: int, data: bytes, headers: dict[str, str]) -> None:
    assert status in ALLOWED, (status, data[:300])
    if status == 200:
        return
    error = json.loads(data)["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"]
    if status == 503 and "Retry-After" not in headers:
        assert error["type"] == "service_unavailable_error"


# -- strategies -------------------------------------------------------------------------
TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
LEAF = st.none() | st.booleans() | st.integers() | st.floats() | TEXT
JSON = st.recursive(LEAF, lambda c: st.lists(c, max_size=3) | st.dictionaries(TEXT, c, max_size=3),
                    max_leaves=8)  # fmt: skip
SMALL = st.integers(1, 2)
PARAMS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["", "nope"]) | JSON,
    "max_tokens": SMALL | JSON,
    "temperature": st.floats(0, 2) | JSON,
    "top_p": st.floats(0, 1) | JSON,
    "top_k": st.integers(-2, 50) | JSON,
    "min_p": st.floats(0, 1) | JSON,
    "seed": st.integers(-(2**64), 2**64) | JSON,
    "stop": TEXT | st.lists(TEXT, max_size=3) | JSON,
    "stream": st.booleans() | JSON,
    "n": st.integers(0, 4) | JSON,
    "logprobs": st.integers(-1, 21) | st.booleans() | JSON,
    "top_logprobs": st.integers(-1, 21) | JSON,
    "echo": st.booleans() | JSON,
    "best_of": st.integers(0, 4) | JSON,
    "presence_penalty": st.floats(-3, 3) | JSON,
    "frequency_penalty": st.floats(-3, 3) | JSON,
    "repetition_penalty": st.floats(0, 3) | JSON,
    "logit_bias": st.dictionaries(st.integers(-5, 60000).map(str), st.floats(-150, 150), max_size=3)
    | JSON,
    "min_tokens": st.integers(-1, 3) | JSON,
    "ignore_eos": st.booleans() | JSON,
    "stop_token_ids": st.lists(st.integers(-1, 60000), max_size=3) | JSON,
    "skip_special_tokens": st.booleans() | JSON,
    "include_stop_str_in_output": st.booleans() | JSON,
    "response_format": st.sampled_from(
        [
            {"type": "text"},
            {"type": "json_object"},
            {"type": "xml"},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
            {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}},
        ]
    )
    | JSON,
    "guided_choice": st.lists(TEXT, max_size=3) | JSON,
    "guided_regex": st.sampled_from(["[0-9]", "[", "a|b"]) | JSON,
    "tools": st.just([{"type": "function", "function": {"name": "f"}}]) | JSON,
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function"}]) | JSON,
}
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "robot"]) | JSON},
    optional={"content": TEXT | st.none() | JSON, "tool_calls": JSON, "tool_call_id": JSON},
)


def _clamp(body: dict[str, Any]) -> dict[str, Any]:
    """Valid generations stay short: at most two tokens per fork."""
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > 2:
            body[key] = 2
    body.setdefault("max_tokens", 2)
    return body


def _body(prompt: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(prompt, optional=PARAMS).map(_clamp)


COMPLETION = _body({"prompt": TEXT | st.lists(st.integers(-1, 50000), max_size=4) | JSON})
CHAT = _body({"messages": st.lists(MESSAGE, max_size=3) | JSON})


def _send(cluster: LocalCluster, path: str, body: object) -> None:
    _check(*_post(cluster, path, json.dumps(body).encode()))


# -- the groups ----------------------------------------------------------------------------
@settings(max_examples=COMPLETION_CASES, **FUZZ)  # type: ignore[arg-type]
@given(body=COMPLETION)
def test_completions(cluster: LocalCluster, body: dict[str, Any]) -> None:
    _send(cluster, "/v1/completions", body)


@settings(max_examples=CHAT_CASES, **FUZZ)  # type: ignore[arg-type]
@given(body=CHAT)
def test_chat(cluster: LocalCluster, body: dict[str, Any]) -> None:
    _send(cluster, "/v1/chat/completions", body)


@settings(max_examples=TOKENIZE_CASES, **FUZZ)  # type: ignore[arg-type]
@given(
    path=st.sampled_from(["/tokenize", "/detokenize"]),
    body=st.fixed_dictionaries(
        {},
        optional={
            "prompt": TEXT | JSON,
            "messages": JSON,
            "tokens": st.lists(st.integers(-1, 60000)) | JSON,
            "model": JSON,
        },
    ),
)
def test_tokenize(cluster: LocalCluster, path: str, body: dict[str, Any]) -> None:
    _send(cluster, path, body)


VALID = json.dumps({"prompt": "Hello", "max_tokens": 1}).encode()
RAW = (
    st.binary(max_size=64)
    | st.integers(0, len(VALID)).map(lambda k: VALID[:k])
    | st.integers(1, 5000).map(lambda d: b"[" * d + b"]" * d)
    | st.integers(1, 5000).map(lambda d: b'{"prompt": ' + b"[" * d + b'"x"' + b"]" * d + b"}")
    | st.binary(min_size=1, max_size=8).map(lambda b: b'{"prompt": "' + b + b'"}')
    | st.sampled_from(
        [
            b'{"prompt": "\\ud800"}',
            b'{"prompt": "a", "max_tokens": 1e400}',
            b'{"prompt": "a", "max_tokens": 99999999999999999999999}',
            b"null",
            b'"just a string"',
            b"\xef\xbb\xbf{}",
        ]
    )
)


@settings(max_examples=RAW_CASES, **FUZZ)  # type: ignore[arg-type]
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize"]), raw=RAW)
def test_raw_bytes(cluster: LocalCluster, path: str, raw: bytes) -> None:
    _check(*_post(cluster, path, raw))
