"""Reading an HTTP request body as JSON without letting a malformed one become a 500.

Lifecycle: the HTTP API calls `read_json(raw_bytes)` once per request. It refuses, with a
`SchemaError` naming the place (HTTP 400), what Python's `json` would turn into a server
error or pass on to break later: bytes that are not UTF-8, JSON that does not parse,
nesting deeper than `MAX_DEPTH` (the decoder recurses and would raise RecursionError),
numbers too large to be finite, and strings holding a lone UTF-16 surrogate (JSON's
`\\ud800` escapes decode to a Python string that cannot be encoded, so the tokenizer
would fail on it). The walk that checks depth and strings is iterative, so it cannot
overflow the stack itself.
"""

from __future__ import annotations

import json
import math

from services.gateway.openai.sampling import SchemaError

MAX_DEPTH = 64


def read_json(raw: bytes) -> object:
    """The decoded body; SchemaError (param: where, when known) for a bad one."""
    if not raw.strip():
        raise SchemaError(None, "the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SchemaError(
            None, f"the request body is not UTF-8: {exc.reason} at byte {exc.start}"
        ) from None
    _check_nesting(text)
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise SchemaError(None, f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        raise SchemaError(None, f"the request body is not valid JSON: {exc}") from None
    _check_values(body)
    return body


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _check_nesting(text: str) -> None:
    """Refuse deep nesting before the recursive decoder sees it (brackets inside strings
    are skipped)."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise SchemaError(None, f"the request body nests deeper than {MAX_DEPTH} levels")
        elif ch in "]}":
            depth -= 1


def _check_values(body: object) -> None:
    """Every string encodable as UTF-8, every number finite; names the first bad one."""
    stack: list[tuple[str, object]] = [("", body)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                _check_string(where or None, key)
                stack.append((f"{where}.{key}" if where else str(key), item))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_string(where or None, value)
        elif isinstance(value, float) and not math.isfinite(value):
            raise SchemaError(where or None, "must be a finite number")


def _check_string(where: str | None, value: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise SchemaError(where, "holds invalid Unicode (a lone UTF-16 surrogate)") from None
