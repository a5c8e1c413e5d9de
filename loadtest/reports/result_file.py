"""The one JSON writer of every benchmark: a report dataclass plus where it came from.

Lifecycle: a benchmark builds its report (a dataclass tree) and calls
`write_result(path, report, provenance)`, as often as it likes (the sweeps rewrite
theirs after every point, so an interrupted run keeps what it measured). The file is
written atomically: a reader (or `loadtest.reports.results`) never sees half of one. Its
top-level keys are the report's `schema`, then `provenance` (commit, dirty flag, UTC
time, command, host: `loadtest.reports.provenance`), then the report's own fields.
`ResultFile` binds a path to a run's provenance for those rewrites; `read_result` loads
a file back for `loadtest.reports.results`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.reports.provenance import Provenance


def jsonable(obj: object) -> object:
    """A JSON-ready copy: NaN/inf -> null (JSON has neither), numpy scalars -> Python
    numbers, anything else JSON lacks (Path, torch dtype or device) -> its str."""
    if obj is None or isinstance(obj, bool | str):
        return obj
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        value = float(obj)
        return value if math.isfinite(value) else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    return str(obj)


def result_dict(report: object, provenance: Provenance) -> dict[str, object]:
    """The file's content: schema first, provenance next, then the report's fields."""
    if not dataclasses.is_dataclass(report) or isinstance(report, type):
        raise TypeError(f"a report must be a dataclass instance, got {type(report).__name__}")
    fields = dataclasses.asdict(report)
    head: dict[str, object] = {"schema": fields.pop("schema")} if "schema" in fields else {}
    return {**head, "provenance": dataclasses.asdict(provenance), **fields}


def write_result(path: Path, report: object, provenance: Provenance) -> Path:
    """Write the report and its provenance as JSON, atomically; returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    text = json.dumps(jsonable(result_dict(report, provenance)), indent=1, allow_nan=False)
    tmp.write_text(text + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def read_result(path: Path) -> dict[str, Any]:
    """A result file as written; ValueError (naming the file) if it is not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("provenance"), dict):
        raise ValueError(
            f"{path}: no provenance: write it with loadtest.reports.result_file.write_result "
            "(rerun the benchmark on the current code)"
        )
    return data


@dataclass(frozen=True)
class ResultFile:
    """One run's result file: the sweeps rewrite it after every point, with the
    provenance collected once when the run started."""

    path: Path
    provenance: Provenance

    def write(self, report: object) -> Path:
        return write_result(self.path, report, self.provenance)
