"""A decode worker's step time at a batch size it may not have run yet.

Lifecycle: admission (`Capacity.decode_step_s_with`) asks `step_s_at(curve, batch)` for
each decode worker's published curve (`WorkerSignal.decode_curve`: mean batch and
seconds per step, by batch size) on every decision; nothing is kept between calls.

Every stream on a worker samples one token per step, so a stream's inter-token latency
is the worker's step time at the batch it joins. Within the measured batches the curve
is interpolated linearly. Below the smallest it is that point's time (conservative: a
smaller batch is not faster than measured). Above the largest it is extended along the
slope of its last two points; with one point, or a slope that is not positive (noise),
along `PRIOR_ROWS_PER_STEP`: a step costs as much as that many rows' worth of fixed
work (weights read once per step) plus one row's worth per stream, which holds the
measured point and grows with the batch as a bandwidth-bound decode does. A curve that
is empty gives None: nothing is known, and the caller fails open.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

#: With one measured point (b, t), a step at batch n is predicted at
#: t * (PRIOR_ROWS_PER_STEP + n) / (PRIOR_ROWS_PER_STEP + b): the weights' read is worth
#: this many rows. Smaller is more cautious (steps grow faster with the batch). Measured
#: on the development host (SmolLM2-135M, bf16 fused decode): 14.6 ms at 1 row, 25.0 ms
#: at 8, so 1.5 ms per row and about 9 rows' worth of fixed work; 8 errs on the slow side.
PRIOR_ROWS_PER_STEP = 8.0

Curve = Sequence[tuple[float, float]]  # (mean batch, seconds per step), batch ascending


def step_s_at(curve: Curve, batch: float) -> float | None:
    """Seconds per decode step at `batch` streams (None: nothing measured)."""
    points = sorted((b, t) for b, t in curve if b > 0 and t > 0)
    if not points:
        return None
    first_b, first_t = points[0]
    if batch <= first_b:
        return first_t
    for (b0, t0), (b1, t1) in itertools.pairwise(points):
        if batch <= b1:
            return t0 + (t1 - t0) * (batch - b0) / (b1 - b0) if b1 > b0 else max(t0, t1)
    last_b, last_t = points[-1]
    return last_t + _slope(points) * (batch - last_b)


def _slope(points: Sequence[tuple[float, float]]) -> float:
    """Seconds per added stream beyond the last point."""
    last_b, last_t = points[-1]
    prior = last_t / (PRIOR_ROWS_PER_STEP + last_b)
    if len(points) < 2:
        return prior
    (b0, t0), (b1, t1) = points[-2], points[-1]
    measured = (t1 - t0) / (b1 - b0) if b1 > b0 else 0.0
    return measured if measured > 0 else prior
