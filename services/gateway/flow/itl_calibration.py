"""How far streams' token gaps run past the decode step admission predicted for them.

Lifecycle: `Capacity` keeps one `ItlCalibration`. When admission lets a stream in with a
predicted step (`Pass.itl_estimate_s`), the request's record gets an `ItlMeter` from
`Capacity.itl_meter`; the meter times the tokens handed towards the client, and when the
stream finishes it reports the p90 of its gaps against the prediction. Admission then
compares `predicted step x factor` with the class's ITL limit.

Why: the prediction is a worker's mean step at a batch size, but a stream's SLO is on
its own gaps, whose tail is longer: steps that also prefill the arrivals' prompts,
verification steps, a busy host. In the decode-heavy overload the critical class's ITL
p90 read 85 ms against a 72 ms SLO with the gateway's budget at 58 ms of mean step
(docs/history.md, "ITL admission standing aside"); the factor puts that tail back, as
`capacity.Calibration` does for TTFT.
"""

from __future__ import annotations

import math
import time

MIN_FACTOR, MAX_FACTOR = 0.5, 4.0  # bounds of one sample
MIN_GAPS = 8  # a stream with fewer gaps says little about its tail


class ItlCalibration:
    """The mean of (a finished stream's p90 gap) / (the step predicted when it was
    admitted), over recent streams. Starts at 1."""

    def __init__(self, alpha: float = 0.1) -> None:
        self.alpha = alpha
        self.factor = 1.0

    def observe(self, predicted_s: float, p90_gap_s: float) -> None:
        if predicted_s <= 0 or p90_gap_s <= 0:
            return
        ratio = min(MAX_FACTOR, max(MIN_FACTOR, p90_gap_s / predicted_s))
        self.factor += self.alpha * (ratio - self.factor)


class ItlMeter:
    """One admitted stream's token gaps, reported to `calibration` once it finishes."""

    def __init__(self, calibration: ItlCalibration, predicted_s: float) -> None:
        self.calibration = calibration
        self.predicted_s = predicted_s
        self.gaps: list[float] = []
        self._last: float | None = None

    def took(self, tokens: int, now: float | None = None) -> None:
        """`tokens` tokens went towards the client at `now` (monotonic; default now); a
        message of n tokens after a gap g adds n gaps of g / n."""
        if tokens <= 0:
            return
        now = time.monotonic() if now is None else now
        if self._last is not None:
            self.gaps.extend([(now - self._last) / tokens] * tokens)
        self._last = now

    def report(self) -> None:
        """The stream finished: its p90 gap against the prediction (ignored with fewer
        than `MIN_GAPS` gaps)."""
        if len(self.gaps) >= MIN_GAPS:
            ordered = sorted(self.gaps)
            p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
            self.calibration.observe(self.predicted_s, p90)
