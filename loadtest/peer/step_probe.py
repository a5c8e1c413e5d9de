"""The decode step time pdserve's workers report while a point runs: the engine's share
of the inter-token gap, read from where the workers already publish it.

Lifecycle: `StepProbe(redis_url).start()` starts a thread that every `interval_s`
reads each worker's load signal straight from the cluster's Redis (the `*:signal:*`
hashes the workers publish a few times a second: `services/worker/signal_publisher.py`;
`decode_step_s` there is the engine's wall time per step that decoded, smoothed over
about a second of busy time) and keeps the samples of workers that had a request
running. `stop()` ends the thread and returns the samples; `decode_step_ms(samples)`
reduces them to one number. Reading the hashes directly keeps the probe a client of
the cluster: it needs only the signal's field names, not the router's code.
"""

from __future__ import annotations

import statistics
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import redis

SIGNAL_MATCH = "*:signal:*"


@dataclass(frozen=True)
class StepSample:
    worker_id: str
    running: int
    decode_step_s: float


def parse_signal(key: str, fields: Mapping[str, str]) -> StepSample | None:
    """The sample in one signal hash; None for a hash that is not one (or has no step
    time yet, or nothing running)."""
    try:
        running = int(fields["running"])
        step = float(fields["decode_step_s"])
    except (KeyError, ValueError):
        return None
    if running < 1 or step <= 0:
        return None
    return StepSample(worker_id=key.rsplit(":signal:", 1)[-1], running=running,
                      decode_step_s=step)  # fmt: skip


def decode_step_ms(samples: Sequence[StepSample]) -> float | None:
    """The median step of the worker that was busy most often (the one decoding the
    stream); None without samples."""
    if not samples:
        return None
    busiest, _ = Counter(s.worker_id for s in samples).most_common(1)[0]
    return 1000.0 * statistics.median(s.decode_step_s for s in samples if s.worker_id == busiest)


class StepProbe:
    def __init__(self, redis_url: str, interval_s: float = 0.25) -> None:
        self.client = redis.Redis.from_url(redis_url, decode_responses=True)
        self.interval_s = interval_s
        self.samples: list[StepSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="step-probe", daemon=True)

    def start(self) -> StepProbe:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                for key in self.client.scan_iter(match=SIGNAL_MATCH):
                    fields = {str(k): str(v) for k, v in self.client.hgetall(key).items()}
                    sample = parse_signal(str(key), fields)
                    if sample is not None:
                        self.samples.append(sample)
            except (redis.RedisError, OSError):
                continue  # a missed read is a missing sample, nothing more

    def stop(self) -> list[StepSample]:
        self._stop.set()
        self._thread.join()
        self.client.close()
        return self.samples
