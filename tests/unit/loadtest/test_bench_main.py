"""The shared benchmark command line: flags and env vars from the config dataclasses,
aliases, usage errors, and the JSON every benchmark writes (with its provenance)."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from loadtest.engine import bench as engine_bench
from loadtest.flow import decode_overload_bench, fairness_bench, overload_bench
from loadtest.harness.bench_main import Alias, BenchSpec, parse_args, run_main
from loadtest.harness.settings import RunSettings, parse_ints, parse_names, recorded_env
from loadtest.overhead import gateway_bench, tracing_bench
from loadtest.router import bench as router_bench
from loadtest.transfer import bench as transfer_bench


@dataclass(frozen=True)
class ToyConfig:
    size: str = field(default="small", metadata={"help": "small or big"})
    counts: str = field(default="1,2", metadata={"help": "comma-separated"})
    warmup: bool = field(default=True, metadata={"help": "warm up first"})

    def __post_init__(self) -> None:
        parse_names(self.size, "size", ("small", "big"))
        parse_ints(self.counts, "counts")


@dataclass(frozen=True)
class ToyReport:
    schema: str
    settings: RunSettings
    config: ToyConfig
    total: int
    ratio: float


def _run(settings: RunSettings, cfg: ToyConfig) -> ToyReport:
    total = sum(parse_ints(cfg.counts, "counts")) + settings.seed
    return ToyReport("pdserve.toy/1", settings, cfg, total, float("nan"))


def _signalled(settings: RunSettings, cfg: ToyConfig) -> ToyReport:
    os.kill(os.getpid(), signal.SIGTERM)
    raise AssertionError("SIGTERM did not unwind the run")


TOY = BenchSpec(
    name="toy",
    module="loadtest.toy_bench",
    description="a toy benchmark",
    config=ToyConfig,
    run=_run,
    table=lambda r: f"total {r.total}",
    settings=("out", "seed"),
    aliases=(
        Alias("--big", "size", "big", "= --size big"),
        Alias("--tiny", "size", "small", "= --size small"),
        Alias("--no-warmup", "warmup", False, "= --warmup false"),
    ),
)


def test_flags_defaults_and_aliases() -> None:
    settings, cfg = parse_args(TOY, [])
    assert settings == RunSettings(out=Path("bench-results/toy.json"))
    assert cfg == ToyConfig()
    settings, cfg = parse_args(TOY, ["--big", "--no-warmup", "--seed", "3", "--counts", "4,5"])
    assert cfg == ToyConfig(size="big", counts="4,5", warmup=False) and settings.seed == 3
    assert parse_args(TOY, ["--size", "big"])[1].size == "big"
    assert parse_args(TOY, ["--warmup", "false"])[1].warmup is False


def test_settings_not_taken_are_not_flags() -> None:
    with pytest.raises(SystemExit):
        parse_args(TOY, ["--model-cache-dir", "/tmp"])  # toy takes only out and seed


def test_env_vars_feed_the_defaults_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_COUNTS", "7,8")
    monkeypatch.setenv("PDSERVE_OUT", "/tmp/from-env.json")
    settings, cfg = parse_args(TOY, [])
    assert cfg.counts == "7,8" and settings.out == Path("/tmp/from-env.json")
    assert parse_args(TOY, ["--counts", "9"])[1].counts == "9"


def test_bad_values_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--counts", "1,x"], ["--size", "huge"], ["--big", "--tiny"]):
        with pytest.raises(SystemExit) as exc:
            parse_args(TOY, argv)
        assert exc.value.code == 2
    assert "counts must be comma-separated integers" in capsys.readouterr().err


def test_run_main_writes_the_report_with_its_provenance(tmp_path: Path) -> None:
    out = tmp_path / "toy.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert run_main(TOY, ["--out", str(out), "--seed", "1"]) == 0
    data = json.loads(out.read_text())
    assert list(data)[:2] == ["schema", "provenance"]
    assert data["total"] == 4 and data["ratio"] is None  # NaN is written as null
    assert data["settings"] == {"out": str(out), "seed": 1, "model": None,
                                "model_cache_dir": str(RunSettings().model_cache_dir)}  # fmt: skip
    assert data["config"] == {"size": "small", "counts": "1,2", "warmup": True}
    p = data["provenance"]
    assert p["command"] == f"python -m loadtest.toy_bench --out {out} --seed 1"
    assert p["host"]["cpu_count"] >= p["host"]["usable_cpus"] >= 1
    lines = printed.getvalue().splitlines()
    assert lines[0] == "total 4" and p["taken_at"] in lines[1] and lines[2] == f"wrote {out}"
    assert not list(tmp_path.glob("*.tmp"))


def test_sigterm_unwinds_the_run(tmp_path: Path) -> None:
    spec = BenchSpec("toy", "loadtest.toy_bench", "", ToyConfig, _signalled, lambda r: "")
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exc:
        run_main(spec, ["--out", str(tmp_path / "x.json")])
    assert exc.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == previous  # the handler is put back
    assert not (tmp_path / "x.json").exists()


def test_every_benchmark_parses_its_defaults() -> None:
    for spec, name in ((router_bench.SPEC, "router"), (gateway_bench.SPEC, "gateway"),
                       (tracing_bench.SPEC, "tracing")):  # fmt: skip
        settings, _ = parse_args(spec, [])
        assert settings.out == Path(f"bench-results/{name}.json")
    settings, cfg = parse_args(gateway_bench.SPEC, ["--placement", "static", "--reps", "3"])
    assert cfg == gateway_bench.GatewayBenchConfig(reps=3, placement="static")
    with pytest.raises(SystemExit):
        parse_args(gateway_bench.SPEC, ["--placement", "ring"])
    _, tracing = parse_args(tracing_bench.SPEC, ["--rounds", "1", "--round-s", "2"])
    assert tracing == tracing_bench.TracingBenchConfig(rounds=1, round_s=2.0)


def test_every_spec_names_the_module_that_runs_it() -> None:
    """The command a result file records (`spec.prog`) runs the benchmark it came from."""
    for module in (engine_bench, transfer_bench, router_bench, overload_bench, fairness_bench,
                   gateway_bench, tracing_bench, decode_overload_bench):  # fmt: skip
        assert importlib.import_module(module.SPEC.module) is module
        assert module.SPEC.prog == f"python -m {module.__name__}"


def test_list_parsers() -> None:
    assert parse_ints("512, 2048", "tokens") == (512, 2048)
    with pytest.raises(ValueError):
        parse_ints("1,2,3", "range", count=2)
    with pytest.raises(ValueError):
        parse_ints("0", "tokens")
    assert parse_names("pd,mixed", "pools", ("mixed", "pd")) == ("pd", "mixed")
    with pytest.raises(ValueError):
        parse_names("", "pools", ("mixed",))
    env = {"UCX_TLS": "sm", "NIXL_X": "1", "HOME": "/root"}
    assert recorded_env(("UCX_", "NIXL_"), env) == {"NIXL_X": "1", "UCX_TLS": "sm"}
