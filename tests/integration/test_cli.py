"""The commands a user types, run as processes: `pdserve up --generate` (what `make demo`
runs) end to end, `pdserve generate` and `pdserve status` against a running cluster,
`pdserve run` and `pdserve model info` on the default model and on a tiny random Llama-3
directory (checked against transformers), and the one-line errors of bad arguments."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.model_spec import ModelSpec
from engine.model_store import prepare_default_model
from services.cli.main import main
from services.cluster.config import ClusterConfig
from services.cluster.local_cluster import LocalCluster
from tests.conftest import MODEL_CACHE
from tests.integration.pins import Pin
from tests.tiny_models import ORIGINAL_CONTEXT, VOCAB_SIZE, word, write_tiny_model

# Runs beside one other pairable file in make test (tests/conftest.py).
# Pins (tests/integration/pins.py): `pdserve generate --trace` must show the prefill
# worker's phases for a short prompt.
pytestmark = [pytest.mark.pairable, pytest.mark.pins(Pin.PREFILL_HOP)]

PDSERVE = [sys.executable, "-m", "services.cli.main"]
REPO = Path(__file__).resolve().parents[2]
TINY_KV = str(1 << 20)  # the default 1 GiB KV pool would take seconds to allocate
INFO_FIELDS = (
    "model_type",
    "num_layers",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "fingerprint",
)


def test_up_generate_streams_and_stops_everything() -> None:
    done = subprocess.run(
        [*PDSERVE, "up", "--gateway-port", "0", "--model-cache-dir", str(MODEL_CACHE),
         "--worker-kv-cache-bytes", str(96 << 20), "--generate", "Say hello.",
         "--max-tokens", "6"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip()  # the streamed text
    assert re.search(r"completion [1-6] tokens", done.stderr), done.stderr[-2000:]
    assert "stopping the cluster" in done.stderr


def test_generate_and_status_against_a_running_cluster() -> None:
    cluster = LocalCluster(
        ClusterConfig(gateway_port=0, model_cache_dir=MODEL_CACHE, worker_kv_cache_bytes=96 << 20)
    )
    address = cluster.start()
    try:
        gen = subprocess.run(
            [*PDSERVE, "generate", "--gateway", address, "--max-tokens", "4", "--trace", "Hi!"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert gen.returncode == 0, gen.stderr[-2000:]
        assert re.search(r"completion [1-4] tokens", gen.stderr), gen.stderr[-2000:]
        assert "prefill.compute" in gen.stderr  # --trace: the phase timeline
        status = subprocess.run(
            [*PDSERVE, "status", "--gateway", address],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr[-2000:]
        assert "prefill-0" in status.stdout and "decode-0" in status.stdout
        assert status.stdout.splitlines()[1].endswith("tier")  # no tier asked for: "-"
        assert all(line.endswith("-") for line in status.stdout.splitlines()[2:4])
    finally:
        cluster.stop()


def _pdserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PDSERVE, *args], capture_output=True, text=True, timeout=180, cwd=REPO)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A tiny random Llama-3 (RoPE-scaled) model directory and its transformers model."""
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("cli") / "llama3"
    return path, write_tiny_model("llama3", path)


def _info(stdout: str) -> dict[str, str]:
    pairs = (line.split(": ", 1) for line in stdout.splitlines())
    return {key: value for key, value in pairs}


def _expected_info(model_dir: Path) -> dict[str, str]:
    spec = ModelSpec.from_dir(model_dir)
    assert spec.identity is not None
    parts = {f"identity.{k}": v for k, v in spec.identity.to_json().items()}
    return {"path": str(model_dir), **{f: str(getattr(spec, f)) for f in INFO_FIELDS}, **parts}


def test_model_info_describes_the_default_model() -> None:
    done = _pdserve("model", "info", "--model-cache-dir", str(MODEL_CACHE))
    assert done.returncode == 0, done.stderr[-2000:]
    info = _info(done.stdout)
    assert info == _expected_info(prepare_default_model(MODEL_CACHE, progress=False))
    # SmolLM2-135M's published shape, not only whatever the spec read.
    assert (info["model_type"], info["num_layers"], info["hidden_size"]) == ("llama", "30", "576")
    assert (info["num_heads"], info["num_kv_heads"], info["vocab_size"]) == ("9", "3", "49152")
    assert re.fullmatch(r"[0-9a-f]{16}", info["fingerprint"])


def test_model_info_describes_a_model_directory(tiny: tuple[Path, Any]) -> None:
    model_dir, _ = tiny
    done = _pdserve("model", "info", "--model", str(model_dir))
    assert done.returncode == 0, done.stderr[-2000:]
    info = _info(done.stdout)
    assert info == _expected_info(model_dir)
    assert info["num_layers"] == "2" and info["head_dim"] == "16"
    assert info["vocab_size"] == str(VOCAB_SIZE)


def test_run_streams_the_chat_completion_on_the_default_model() -> None:
    done = _pdserve(
        "run", "What is the capital of France?", "--max-tokens", "8", "--stats",
        "--model-cache-dir", str(MODEL_CACHE), "--kv-cache-bytes", str(16 << 20),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Paris" in done.stdout
    # --stats: the engine's counters at the end, with nothing left behind.
    assert "EngineStats(" in done.stderr
    assert "used_blocks=0" in done.stderr and "running=0, waiting=0" in done.stderr


def _hf_greedy(hf: Any, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(hf(torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


def test_run_raw_prints_the_transformers_greedy_text(tiny: tuple[Path, Any]) -> None:
    model_dir, hf = tiny
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB_SIZE, (ORIGINAL_CONTEXT + 8,), generator=gen).tolist()
    prompt = " ".join(word(i) for i in ids)
    done = _pdserve(
        "run", prompt, "--raw", "--max-tokens", "10", "--model", str(model_dir),
        "--dtype", "float32", "--max-num-batched-tokens", "16", "--kv-cache-bytes", TINY_KV,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    expected = " ".join(word(t) for t in _hf_greedy(hf, ids, 10))
    assert done.stdout == expected + "\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["model", "info", "--model", "/nonexistent/model"], "model directory /nonexistent/model"),
        (["run", "hello", "--model", "/nonexistent/model"], "does not exist"),
        (["run", "w1 w2", "--raw", "--max-tokens", "0"], "max_tokens: must be > 0"),
        (["run", "w1 w2", "--raw", "--temperature", "-1"], "temperature: must be >= 0"),
        (["run", "w1 w2"], "this model has no chat template; send a prompt"),
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(
    argv: list[str], message: str, tiny: tuple[Path, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    if "--model" not in argv:  # a `run` on the tiny model
        argv = [*argv, "--model", str(tiny[0]), "--kv-cache-bytes", TINY_KV]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert not out
    assert err.startswith("pdserve: error: ") and err.count("\n") == 1, err
    assert message in err


def test_a_model_that_is_not_llama_is_refused(tmp_path: Path, tiny: tuple[Path, Any]) -> None:
    other = tmp_path / "gpt2"
    other.mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        (other / name).write_bytes((tiny[0] / name).read_bytes())
    (other / "config.json").write_text(
        '{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}'
    )
    done = _pdserve("model", "info", "--model", str(other))
    assert done.returncode == 2
    assert "must be a Llama-family model" in done.stderr
    assert not done.stdout


def test_a_missing_prompt_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["run", "--max-tokens", "4"])
    assert exited.value.code == 2
    assert "the following arguments are required: prompt" in capsys.readouterr().err
