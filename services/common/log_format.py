"""Log lines that carry the request id and trace id, as text or JSON.

Lifecycle: a service calls `configure_logging(fmt)` once at start; it keeps the root
logger's level and replaces its handlers' formatter, adding a `RequestContextFilter` that
stamps every record with `request_id` and `trace_id`. A request handler wraps its work
in `with log_context(request_id, trace_id):`; the ids live in a context variable, so
concurrent asyncio tasks (and threads started with `asyncio.to_thread`, which copy the
context) each log their own request. Outside a request both ids are "-".
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import time
from collections.abc import Iterator

TEXT_FORMAT = (
    "%(asctime)s %(levelname)s %(name)s [req=%(request_id)s trace=%(trace_id)s]: %(message)s"
)

_REQUEST: contextvars.ContextVar[tuple[str, str]] = contextvars.ContextVar(
    "pdserve_log_request", default=("-", "-")
)


@contextlib.contextmanager
def log_context(request_id: str, trace_id: str = "") -> Iterator[None]:
    """Tag log records emitted inside the block with this request (and trace)."""
    token = _REQUEST.set((request_id or "-", trace_id or "-"))
    try:
        yield
    finally:
        _REQUEST.reset(token)


class RequestContextFilter(logging.Filter):
    """Adds `request_id` and `trace_id` attributes to every record (never drops one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id, record.trace_id = _REQUEST.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request and trace ids."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", "-"),
            "trace_id": getattr(record, "trace_id", "-"),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(fmt: str, logger: logging.Logger | None = None) -> None:
    """Give `logger`'s (default: root) handlers the format and the request-id filter."""
    root = logger or logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.StreamHandler())
    formatter = JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT)
    for handler in root.handlers:
        handler.setFormatter(formatter)
        if not any(isinstance(f, RequestContextFilter) for f in handler.filters):
            handler.addFilter(RequestContextFilter())
