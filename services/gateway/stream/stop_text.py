"""Cutting streamed text at a stop string, which must never reach the client.

The engine stops generating once a stop string appears in its decoded output, but the
characters leading up to it may already have been streamed. So the gateway holds back
the last `len(longest stop) - 1` characters of every delta until they can no longer be
the start of a stop string, and cuts the text at the first stop it finds (after it, when
the request asked for `include_stop_str_in_output`).
"""

from __future__ import annotations


class StopTrimmer:
    def __init__(self, stops: tuple[str, ...], *, include_stop: bool = False) -> None:
        self._stops = stops
        self._include = include_stop
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def push(self, delta: str) -> str:
        """Text safe to emit now; empty once a stop string was found."""
        if self.stopped:
            return ""
        self._pending += delta
        found = [(i, s) for s in self._stops if (i := self._pending.find(s)) >= 0]
        if found:
            at, stop = min(found)
            cut = at + len(stop) if self._include else at
            self.stopped = True
            out, self._pending = self._pending[:cut], ""
            return out
        if self._hold == 0:
            out, self._pending = self._pending, ""
            return out
        out, self._pending = self._pending[: -self._hold], self._pending[-self._hold :]
        return out

    def flush(self) -> str:
        out = "" if self.stopped else self._pending
        self._pending = ""
        return out
