"""The peer benchmark's pure parts: the build's command lines and paths, llama-server's
command line, the streaming client's parsing, the workload, the step probe's reduction,
and the report's medians, paired ratios, targets and gap breakdown. No server starts."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest

from engine.precision import DType
from loadtest.harness.metrics import RequestRecord
from loadtest.harness.settings import RunSettings
from loadtest.peer import bench, build
from loadtest.peer.config import PeerBenchConfig
from loadtest.peer.http_client import SseEvent, apply_event, completion_body, parse_sse_line
from loadtest.peer.llama_server import LlamaServerSpec, server_command
from loadtest.peer.report import (
    LLAMA,
    PDSERVE,
    Comparison,
    GapSample,
    PeerResults,
    PointStats,
    breakdown,
    compare,
    derive,
    markdown,
    median,
    point_stats,
    targets,
    write_outputs,
)
from loadtest.peer.step_probe import StepSample, decode_step_ms, parse_signal
from loadtest.peer.workload import TEMPLATE_TOKENS, chat_prompt, peer_requests
from loadtest.reports.provenance import collect_provenance
from loadtest.workloads.prompt_text import TextSynth

# -- build -------------------------------------------------------------------------------


def test_paths_of_one_version_live_under_its_own_directory(tmp_path: Path) -> None:
    cfg = build.PeerBuildConfig(llama_cpp_python_version="9.9.9", peer_cache_dir=tmp_path)
    paths = build.PeerPaths.of(cfg)
    assert paths.root == tmp_path / "llama-cpp-python-9.9.9"
    assert paths.sdist.name == "llama_cpp_python-9.9.9.tar.gz"
    assert paths.llama_cpp.parts[-3:] == ("llama_cpp_python-9.9.9", "vendor", "llama.cpp")
    assert paths.server == paths.root / "bin" / "llama-server"
    assert paths.gguf(Path("/m/SmolLM2-135M-Instruct")).name == "SmolLM2-135M-Instruct-bf16.gguf"


def test_the_build_makes_the_server_alone_without_the_network() -> None:
    configure = build.configure_command(Path("/src"), Path("/build"))
    assert configure[:5] == ["cmake", "-S", "/src", "-B", "/build"]
    for option in ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_CUDA=OFF",
                   "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
                   "-DLLAMA_BUILD_TESTS=OFF", "-DBUILD_SHARED_LIBS=OFF"):  # fmt: skip
        assert option in configure
    assert build.build_command(Path("/build"), 2) == [
        "cmake", "--build", "/build", "--target", "llama-server", "-j", "2",
    ]  # fmt: skip
    assert build.niced(["cmake"], 19) == ["nice", "-n", "19", "cmake"]
    assert build.niced(["cmake"], 0) == ["cmake"]


def test_download_pins_the_source_distribution() -> None:
    cmd = build.download_command("0.3.36", Path("/d"), python="py")
    assert cmd[:3] == ["py", "-m", "pip"]
    assert "llama-cpp-python==0.3.36" in cmd
    assert cmd[cmd.index("--no-binary") + 1] == ":all:" and "--no-deps" in cmd


def test_the_converter_writes_bf16_with_the_vendored_gguf_first(tmp_path: Path) -> None:
    cmd = build.convert_command(tmp_path, Path("/model"), Path("/out.gguf"), python="py")
    assert cmd == ["py", str(tmp_path / "convert_hf_to_gguf.py"), "/model",
                   "--outtype", "bf16", "--outfile", "/out.gguf"]  # fmt: skip
    env = build.converter_env(tmp_path, {"PYTHONPATH": "/a:/b", "HOME": "/h"})
    assert env["PYTHONPATH"] == f"{tmp_path / 'gguf-py'}:/a:/b"
    assert env["HOME"] == "/h"
    assert build.converter_env(tmp_path, {})["PYTHONPATH"] == str(tmp_path / "gguf-py")


def test_the_gguf_remembers_which_model_it_came_from(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    plain = build.model_source(tmp_path)
    assert (
        plain["model_dir"] == str(tmp_path.resolve()) and "model.safetensors:10" in plain["source"]
    )
    (tmp_path / build.MARKER_NAME).write_text('{"sha": 1}')
    assert build.model_source(tmp_path)["source"] == '{"sha": 1}'


def test_build_config_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="build_jobs"):
        build.PeerBuildConfig(build_jobs=0)
    with pytest.raises(ValueError, match="build_nice"):
        build.PeerBuildConfig(build_nice=20)


# -- config and llama-server --------------------------------------------------------------


def test_points_send_enough_requests_for_stable_medians() -> None:
    cfg = PeerBenchConfig()
    assert cfg.stream_list == (1, 16)
    assert (cfg.requests_at(1), cfg.requests_at(16)) == (8, 32)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"rounds": 0}, "rounds"), ({"streams": "1,32"}, "llama_slots"),
     ({"llama_ctx_per_slot": 384}, "cannot hold"), ({"streams": "0"}, "streams")],
)  # fmt: skip
def test_bench_config_refuses_nonsense(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PeerBenchConfig(**kwargs)  # type: ignore[arg-type]


def test_llama_server_runs_on_loopback_with_threads_slots_and_context() -> None:
    spec = LlamaServerSpec(Path("/bin/ls"), Path("/m.gguf"), threads=2, slots=16,
                           ctx_per_slot=512, extra_args="--threads 3 --flash-attn off")  # fmt: skip
    cmd = server_command(spec, 4242)
    assert cmd[0] == "/bin/ls"

    def value(flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    assert (value("--model"), value("--host"), value("--port")) == ("/m.gguf", "127.0.0.1", "4242")
    assert (value("--threads"), value("--threads-batch"), value("--parallel")) == ("2", "2", "16")
    assert value("--ctx-size") == str(16 * 512)
    assert "--cont-batching" in cmd
    assert cmd[-4:] == ["--threads", "3", "--flash-attn", "off"]  # last: they win


# -- the client ---------------------------------------------------------------------------


def test_body_is_greedy_streamed_and_ignores_eos() -> None:
    (req,) = peer_requests(_synth(), 1, 64, 128, stream=0)
    body = completion_body(req)
    assert body["max_tokens"] == 128 and body["temperature"] == 0.0
    assert body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}


def test_sse_lines_of_both_servers_parse() -> None:
    pd = {"choices": [{"index": 0, "text": " hello", "finish_reason": None}], "usage": None}
    assert parse_sse_line(b"data: " + json.dumps(pd).encode() + b"\n") == SseEvent(text=" hello")
    usage = {"choices": [], "usage": {"prompt_tokens": 258, "completion_tokens": 128}}
    assert parse_sse_line("data: " + json.dumps(usage)) == SseEvent(
        prompt_tokens=258, completion_tokens=128
    )
    llama_last = {"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                  "usage": {"prompt_tokens": 257, "completion_tokens": 128},
                  "timings": {"predicted_per_token_ms": 12.5}}  # fmt: skip
    event = parse_sse_line("data: " + json.dumps(llama_last))
    assert event == SseEvent(prompt_tokens=257, completion_tokens=128, ms_per_token=12.5)
    assert parse_sse_line(b"data: [DONE]") == SseEvent(done=True)
    for other in (b"", b": keep-alive", b"event: x", b"data: {not json", b"data: [1]"):
        assert parse_sse_line(other) is None


def test_events_fold_into_ttft_gaps_and_usage() -> None:
    rec = RequestRecord("r", "chat", sent_s=1.0)
    last = apply_event(rec, SseEvent(text="a"), now=1.5, last=0.0)
    last = apply_event(rec, SseEvent(text=""), now=1.55, last=last)  # no text: no gap
    last = apply_event(rec, SseEvent(text="b"), now=1.6, last=last)
    last = apply_event(rec, SseEvent(text="c"), now=1.8, last=last)
    apply_event(rec, SseEvent(prompt_tokens=9, completion_tokens=3), now=1.9, last=last)
    assert rec.ttft_s == pytest.approx(0.5)
    assert rec.token_gaps_s == pytest.approx([0.1, 0.2])
    assert (rec.prompt_tokens, rec.output_tokens) == (9, 3)


# -- workload and probe -------------------------------------------------------------------


def _synth() -> TextSynth:
    return TextSynth([f" w{i:03d}" for i in range(100)])


def test_prompts_are_chat_shaped_same_per_stream_new_per_point() -> None:
    synth = _synth()
    a = peer_requests(synth, 4, 256, 128, stream=7)
    assert [r.prompt for r in a] == [r.prompt for r in peer_requests(synth, 4, 256, 128, 7)]
    assert not {r.prompt for r in a} & {r.prompt for r in peer_requests(synth, 4, 256, 128, 8)}
    assert len({r.request_id for r in a}) == 4
    for r in a:
        assert r.prompt is not None and r.max_tokens == 128
        assert r.prompt.startswith("<|im_start|>system\n")
        assert r.prompt.endswith("<|im_start|>assistant\n")
        assert len(re.findall(r"w\d{3}", r.prompt)) == 256 - TEMPLATE_TOKENS  # one word, one token
    assert chat_prompt("s", "u").count("<|im_end|>") == 2
    with pytest.raises(ValueError):
        peer_requests(synth, 1, TEMPLATE_TOKENS, 128, 0)


def test_the_step_comes_from_the_worker_that_was_decoding() -> None:
    fields = {"running": "1", "decode_step_s": "0.012", "role": "decode"}
    assert parse_signal("pdserve:signal:decode-0", fields) == StepSample("decode-0", 1, 0.012)
    assert parse_signal("ns:signal:p", {**fields, "running": "0"}) is None
    assert parse_signal("ns:signal:p", {**fields, "decode_step_s": "0.0"}) is None
    assert parse_signal("ns:signal:p", {"running": "x"}) is None
    samples = [StepSample("decode-0", 1, s) for s in (0.010, 0.012, 0.030)]
    samples.append(StepSample("prefill-0", 1, 0.5))
    assert decode_step_ms(samples) == pytest.approx(12.0)
    assert decode_step_ms([]) is None


# -- report -------------------------------------------------------------------------------


def _records(n: int, ttft: float, gap: float, tokens: int = 4) -> list[RequestRecord]:
    out = []
    for i in range(n):
        sent = float(i)
        rec = RequestRecord(f"r{i}", "chat", sent_s=sent, first_token_s=sent + ttft,
                            prompt_tokens=256, output_tokens=tokens)  # fmt: skip
        rec.token_gaps_s = [gap] * (tokens - 1)
        rec.finished_s = sent + ttft + gap * (tokens - 1)
        out.append(rec)
    return out


def _stats(server: str, streams: int, round_: int, tok_s: float, ttft_ms: float) -> PointStats:
    return PointStats(server, streams, round_, round_ % 2 == 0, 8, 8, {}, 1.0, 128, tok_s,
                      ttft_ms, 20.0, 20.0, 3000.0, 256.0, 1.0)  # fmt: skip


def test_point_stats_of_records() -> None:
    records = _records(4, ttft=0.2, gap=0.05)
    records[-1].code = "SHORT"
    s = point_stats(PDSERVE, 1, 0, True, records)
    assert (s.sent, s.ok, s.errors_by_code) == (4, 3, {"SHORT": 1})
    assert s.ttft_p50_ms == pytest.approx(200.0)
    assert s.itl_p50_ms == pytest.approx(50.0)
    assert s.tokens_per_chunk == pytest.approx(1.0)
    assert s.prompt_tokens_mean == pytest.approx(256.0)
    assert s.output_tok_s == pytest.approx(12 / s.duration_s)


def test_ratios_are_medians_of_paired_rounds() -> None:
    points = [
        _stats(PDSERVE, 16, 0, 300.0, 900.0), _stats(LLAMA, 16, 0, 200.0, 1000.0),
        _stats(PDSERVE, 16, 1, 100.0, 900.0), _stats(LLAMA, 16, 1, 50.0, 1000.0),
        _stats(PDSERVE, 16, 2, 160.0, 900.0), _stats(LLAMA, 16, 2, 100.0, 1000.0),
        _stats(PDSERVE, 16, 3, 400.0, 900.0),  # its partner never ran: unpaired, left out
    ]  # fmt: skip
    c = compare(points, 16)
    assert c.output_tok_s_ratio == pytest.approx(1.6)  # median of 1.5, 2.0, 1.6
    assert c.ttft_p50_ratio == pytest.approx(0.9)
    assert compare(points, 1) == Comparison(1, None, None, None)
    assert median([None, float("nan"), 3.0, 1.0]) == 2.0
    assert median([]) is None


@pytest.mark.parametrize(
    ("tok", "ttft", "met"),
    [(1.6, 0.9, True), (1.6, 1.1, False), (1.4, 0.9, False), (None, 0.9, False)],
)
def test_the_16_stream_target_wants_throughput_and_no_worse_ttft(
    tok: float | None, ttft: float, met: bool
) -> None:
    (t,) = targets([Comparison(16, tok, ttft, 1.0)])
    assert t.met is met and t.threshold == 1.5


def test_a_point_with_refusals_meets_no_target() -> None:
    (t,) = targets([Comparison(16, 2.0, 0.5, 1.0, pdserve_errors=3)])
    assert not t.met and "pdserve 3" in t.context
    (t,) = targets([Comparison(1, 2.0, 0.5, 1.0, llama_errors=1)])
    assert not t.met and "llama.cpp 1" in t.context
    points = [_stats(PDSERVE, 1, 0, 9.0, 1.0), _stats(LLAMA, 1, 0, 3.0, 1.0)]
    points[0] = replace(points[0], ok=5)
    assert compare(points, 1).pdserve_errors == 3


def test_the_1_stream_target_wants_parity() -> None:
    assert [t.met for t in targets([Comparison(1, 1.0, 5.0, 1.0)])] == [True]
    assert [t.met for t in targets([Comparison(1, 0.99, 0.5, 1.0)])] == [False]
    assert targets([Comparison(4, 9.0, 0.1, 1.0)]) == []  # no target at other points


def test_gap_breakdown_splits_the_mean_gap() -> None:
    gaps = [GapSample(r, 20.0 + r, 19.0, 17.0 + r, 12.0 + r, 14.0, 13.5, 13.0) for r in range(3)]
    g = breakdown(gaps)
    assert g is not None
    assert (g.tpot_http_ms, g.tpot_grpc_ms, g.decode_step_ms) == (21.0, 18.0, 13.0)
    assert g.serving_path_ms == pytest.approx(8.0)
    assert g.serving_path_share == pytest.approx(8.0 / 21.0)
    assert (g.http_front_door_ms, g.grpc_path_ms) == (pytest.approx(3.0), pytest.approx(5.0))
    assert (g.itl_http_ms, g.llama_itl_ms) == (19.0, 13.5)
    assert g.llama_serving_path_ms == pytest.approx(1.0)
    partial = breakdown([GapSample(0, 20.0, 19.0, None, None, 14.0, 13.0, None)])
    assert partial is not None and partial.serving_path_ms is None and partial.grpc_path_ms is None
    assert partial.llama_serving_path_ms is None
    assert breakdown([]) is None


def test_results_are_written_with_provenance(tmp_path: Path) -> None:
    results = PeerResults(created="now", config=PeerBenchConfig(out_dir=tmp_path),
                          llama_server=["llama-server", "-np", "16"],
                          llama_cpp_python_version="0.3.36", pdserve_cluster="1P+1D")  # fmt: skip
    for r in range(2):
        results.rounds += [_stats(PDSERVE, 1, r, 40.0, 300.0), _stats(LLAMA, 1, r, 60.0, 200.0),
                           _stats(PDSERVE, 16, r, 300.0, 900.0),
                           _stats(LLAMA, 16, r, 180.0, 1000.0)]  # fmt: skip
        results.gaps.append(GapSample(r, 25.0, 24.0, 22.0, 15.0, 16.0, 15.8, 15.5))
    md_path = write_outputs(results, collect_provenance(["test"]))
    data = json.loads((tmp_path / "peer.json").read_text())
    assert data["schema"] == "pdserve.peer_bench/1" and "provenance" in data
    assert [t["met"] for t in data["targets"]] == [False, True]
    assert len(data["summaries"]) == 4 and data["gap_breakdown"]["serving_path_ms"] == 10.0
    text = md_path.read_text()
    assert "**not met**" in text and "| 16 | pdserve | 300.0 |" in text
    assert "serving path = TPOT - step" in text
    derive(results)  # idempotent
    assert markdown(results, collect_provenance(["test"])).count("\n| 16 |") == 3


# -- the command --------------------------------------------------------------------------


def test_rounds_alternate_who_goes_first_and_points_get_new_prompts() -> None:
    assert bench.round_order(0) == (PDSERVE, LLAMA)
    assert bench.round_order(1) == (LLAMA, PDSERVE)
    streams = {bench.point_stream(r, n) for r in range(5) for n in (1, 16)}
    assert len(streams) == 10 and bench.WARMUP_STREAM not in streams


def test_the_cluster_is_one_prefill_one_decode_pinned_with_the_gateways_defaults() -> None:
    c = bench.cluster_config(RunSettings(), PeerBenchConfig())
    assert (c.num_prefill, c.num_decode, c.worker_threads, c.pin_workers) == (1, 1, 1, True)
    assert (c.gateway_port, c.http_port, c.placement, c.gateway_args) == (0, 0, "redis", "")
    assert c.dtype is None  # the workers' own default
    assert "dtype auto" in bench.cluster_words(PeerBenchConfig())
    cfg = PeerBenchConfig(pdserve_gateway_args="--x 1", pdserve_dtype=DType.BFLOAT16)
    c = bench.cluster_config(RunSettings(), cfg)
    assert (c.gateway_args, c.dtype) == ("--x 1", DType.BFLOAT16)
    assert "`--x 1`" in bench.cluster_words(cfg) and "dtype bfloat16" in bench.cluster_words(cfg)


def test_without_a_built_server_it_says_how_to_build_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = bench.main(["--llama-server", str(tmp_path / "none"), "--gguf", str(tmp_path / "g"),
                     "--out-dir", str(tmp_path / "out")])  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err
    assert "python -m loadtest.peer.build" in err and str(tmp_path / "none") in err
    assert not (tmp_path / "out").exists()


def test_a_point_without_records_is_unmeasured_not_zero() -> None:
    s = point_stats(LLAMA, 1, 0, True, [])
    assert math.isnan(s.ttft_p50_ms) and s.sent == 0 and s.tokens_per_chunk == 0.0
