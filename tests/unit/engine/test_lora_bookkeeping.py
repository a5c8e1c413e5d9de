"""LoRA bookkeeping on a tiny model: residency, eviction and busy slots, the cache keyed
by adapter, forks and aborts letting go, refusals naming what is wrong, adapters
replaced on disk."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.adapter_ref import WEIGHTS_FILE, AdapterRef, adapter_digest
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.errors import (
    AdapterFormatError,
    AdapterMismatchError,
    AdaptersBusyError,
    UnknownAdapterError,
)
from engine.lora_batch import LoraStacks
from engine.lora_set import LoraSet
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from tests.conftest import assert_no_leaks
from tests.lora_adapters import RECIPES, write_adapter
from tests.tiny_models import VOCAB_SIZE, build_hf_model, write_tiny_model, write_tokenizer

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

MAX_TOKENS = 16
MIX = (None, "alpha", "beta")  # each prompt runs as the base model and as both adapters


# -- the engine's bookkeeping, on a tiny model -------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny Llama with adapters alpha, beta and gamma; {"model", "loras", name: PEFT}."""
    root = tmp_path_factory.mktemp("tiny-lora")
    hf = write_tiny_model("llama3", root / "model")
    out: dict[str, Any] = {"model": root / "model", "loras": root / "loras"}
    for name in ("alpha", "beta", "gamma"):
        out[name] = write_adapter(hf, root / "loras" / name, RECIPES[name])
    return out


def _tiny_engine(tiny: dict[str, Any], **overrides: object) -> LLMEngine:
    settings: dict[str, object] = {
        "model": str(tiny["model"]),
        "dtype": "float32",
        "kv_cache_bytes": 1 << 20,
        "lora_dir": str(tiny["loras"]),
    }
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))  # type: ignore[arg-type]


def _prompt(seed: int, length: int = 40) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB_SIZE, (length,), generator=gen).tolist()


def _run(engine: LLMEngine, prompt: list[int], adapter: str | None) -> str:
    ref = None if adapter is None else AdapterRef(adapter)
    rid = engine.add_request(RequestSpec(prompt, SamplingParams(max_tokens=2), adapter=ref))
    while engine.has_unfinished():
        engine.step()
    return rid


def test_tiny_model_logits_match_peft(tiny: dict[str, Any]) -> None:
    """Every projection (q, k, v, o, gate, up, down) through the fused matmuls, rsLoRA
    included: the logits of a mixed batch at each position within float32 noise."""
    engine = _tiny_engine(tiny)
    prompt = _prompt(0)
    names: list[str | None] = ["alpha", None, "beta", "gamma"]
    got = _sampled_logits(engine, [prompt] * 4, names)
    ids = torch.tensor([prompt])
    for i, name in enumerate(names):
        with torch.inference_mode():
            if name is None:
                with tiny["alpha"].disable_adapter():
                    want = tiny["alpha"](ids).logits[0, -1]
            else:
                want = tiny[name](ids).logits[0, -1]
        torch.testing.assert_close(got[i], want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got[0], got[1], atol=1e-2)  # the adapter mattered
    assert_no_leaks(engine)


def test_lru_residency_and_busy_slots(tiny: dict[str, Any]) -> None:
    engine = _tiny_engine(tiny, max_loras=2)
    loras = engine.loras
    assert loras.available() == ["alpha", "beta", "gamma"]
    _run(engine, _prompt(1), "alpha")
    _run(engine, _prompt(1), "beta")
    _run(engine, _prompt(1), "alpha")  # alpha most recent: beta goes first
    _run(engine, _prompt(1), "gamma")
    counts = loras.counts()
    assert counts.resident == ("alpha", "gamma") and counts.loads == 3 and counts.evictions == 1
    # Both slots held by queued requests: a third adapter is refused, nothing leaks.
    engine.add_request(
        RequestSpec(_prompt(2), SamplingParams(max_tokens=2), adapter=AdapterRef("alpha"))
    )
    engine.add_request(
        RequestSpec(_prompt(3), SamplingParams(max_tokens=2), adapter=AdapterRef("gamma"))
    )
    with pytest.raises(AdaptersBusyError, match="max-loras"):
        engine.add_request(
            RequestSpec(_prompt(4), SamplingParams(max_tokens=2), adapter=AdapterRef("beta"))
        )
    assert loras.held() == {"alpha": 1, "gamma": 1}
    while engine.has_unfinished():
        engine.step()
    _run(engine, _prompt(4), "beta")  # free again
    assert_no_leaks(engine)


def test_cache_is_shared_within_an_adapter_and_never_across(tiny: dict[str, Any]) -> None:
    engine = _tiny_engine(tiny)
    prompt = _prompt(5, 64)

    def cached(adapter: str | None) -> int:
        ref = None if adapter is None else AdapterRef(adapter)
        rid = engine.add_request(RequestSpec(prompt, SamplingParams(max_tokens=1), adapter=ref))
        n = 0
        while engine.has_unfinished():
            for o in engine.step():
                if o.request_id == rid and o.finished:
                    n = o.num_cached_tokens
        return n

    assert cached("alpha") == 0
    assert cached("alpha") == 48  # every full block but the one holding the last token
    assert cached("beta") == 0
    assert cached(None) == 0
    assert cached(None) == 48
    lora = engine.loras.acquire("alpha")
    assert engine.hash_seed_for("", lora) != engine.hash_seed_for("")
    engine.loras.release(lora)
    assert_no_leaks(engine)


def test_forks_and_aborts_let_go_of_the_adapter(tiny: dict[str, Any]) -> None:
    engine = _tiny_engine(tiny)
    params = SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=7)
    engine.generate([_prompt(6)], params, ["alpha"])
    assert_no_leaks(engine)
    rid = engine.add_request(
        RequestSpec(_prompt(7), SamplingParams(max_tokens=50), adapter=AdapterRef("beta"))
    )
    engine.step()
    engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    assert_no_leaks(engine)


def test_refusals_name_what_is_wrong(tiny: dict[str, Any], tmp_path: Path) -> None:
    engine = _tiny_engine(tiny)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(UnknownAdapterError, match="adapters: alpha, beta, gamma"):
        engine.add_request(RequestSpec(_prompt(8), params, adapter=AdapterRef("nope")))
    with pytest.raises(UnknownAdapterError, match="adapters: alpha"):
        engine.add_request(RequestSpec(_prompt(8), params, adapter=AdapterRef("../loras/alpha")))
    with pytest.raises(AdapterMismatchError, match="copies differ"):
        engine.add_request(RequestSpec(_prompt(8), params, adapter=AdapterRef("alpha", "0" * 32)))
    with pytest.raises(AdapterMismatchError):
        engine.handoff.reserve_import(
            RequestSpec(_prompt(8), params, request_id="imp", adapter=AdapterRef("beta", "0" * 32)),
            3,
        )
    plain = _tiny_engine(tiny, lora_dir=None)
    with pytest.raises(UnknownAdapterError, match="--lora-dir"):
        plain.add_request(RequestSpec(_prompt(8), params, adapter=AdapterRef("alpha")))
    small = _tiny_engine(tiny, max_lora_rank=4)
    with pytest.raises(AdapterFormatError, match="rank 8 is above max_lora_rank 4"):
        small.add_request(RequestSpec(_prompt(8), params, adapter=AdapterRef("alpha")))
    for engine_ in (engine, plain, small):
        assert_no_leaks(engine_)


def _broken(tiny: dict[str, Any], root: Path, name: str) -> Path:
    path = root / name
    shutil.copytree(tiny["loras"] / "alpha", path)
    return path


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        ("dora", "DoRA"),
        ("pickle", "only safetensors"),
        ("embedding", "not a LoRA A/B of a layer"),
        ("shape", "do not fit the model"),
        ("half", "needs both lora_A and lora_B"),
    ],
)
def test_unservable_adapters_are_refused(
    tiny: dict[str, Any], tmp_path: Path, breakage: str, message: str
) -> None:
    path = _broken(tiny, tmp_path, "broken")
    weights = load_file(str(path / WEIGHTS_FILE))
    if breakage == "dora":
        config = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    elif breakage == "pickle":
        (path / WEIGHTS_FILE).rename(path / "adapter_model.bin")
    else:
        key = next(k for k in weights if "lora_A" in k)
        if breakage == "embedding":
            weights["base_model.model.model.embed_tokens.lora_embedding_A"] = weights[key].clone()
        elif breakage == "shape":
            weights[key] = torch.zeros(weights[key].shape[0], 7)
        else:
            del weights[key]
        save_file(weights, str(path / WEIGHTS_FILE))
    engine = _tiny_engine(tiny, lora_dir=str(tmp_path))
    with pytest.raises(AdapterFormatError, match=message):
        engine.add_request(
            RequestSpec(_prompt(9), SamplingParams(max_tokens=2), adapter=AdapterRef("broken"))
        )
    assert_no_leaks(engine)


def test_the_digest_is_what_the_adapter_computes(tiny: dict[str, Any], tmp_path: Path) -> None:
    alpha = tiny["loras"] / "alpha"
    copy = _broken(tiny, tmp_path, "copy")
    assert adapter_digest(copy) == adapter_digest(alpha)
    config = json.loads((copy / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "/somewhere/else"  # where it was saved: no matter
    (copy / "adapter_config.json").write_text(json.dumps(config))
    assert adapter_digest(copy) == adapter_digest(alpha)
    weights = load_file(str(copy / WEIGHTS_FILE))
    key = next(iter(weights))
    weights[key] = weights[key] + 1e-3  # same shapes, other weights
    save_file(weights, str(copy / WEIGHTS_FILE))
    assert adapter_digest(copy) != adapter_digest(alpha)
    assert adapter_digest(tiny["loras"] / "beta") != adapter_digest(alpha)


def _sampled_logits(
    engine: LLMEngine, prompts: list[list[int]], adapters: list[str | None]
) -> torch.Tensor:
    """The logits rows the one token of each prompt (run together, each with its
    adapter) was sampled from, in order."""
    rows: list[torch.Tensor] = []
    logits = engine.model.logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(logits(hidden))
        return rows[-1]

    engine.model.logits = capture  # type: ignore[method-assign]
    engine.generate(prompts, SamplingParams(max_tokens=1), adapters)
    engine.model.logits = logits  # type: ignore[method-assign]
    return torch.cat(rows)


def _last_logits(engine: LLMEngine, prompt: list[int], adapter: str | None) -> torch.Tensor:
    return _sampled_logits(engine, [prompt], [adapter])[0]


def test_int8_weights_fold_the_norm_gains_into_the_adapter_too(tmp_path: Path) -> None:
    """The int8 kernel folds each RMSNorm's gain into the projections after it, so the
    adapter's A must carry the same gains: the adapter's effect on the logits then
    matches PEFT's, and it does not with the gains left out. (The norms get random gains
    here: transformers initialises them to ones, where folding changes nothing.)"""
    hf = build_hf_model("llama3")
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("layernorm.weight"):
                param.uniform_(0.3, 3.0)
    hf.save_pretrained(str(tmp_path / "model"))
    write_tokenizer(tmp_path / "model")
    peft_model = write_adapter(hf, tmp_path / "loras" / "beta", RECIPES["beta"])
    prompt = _prompt(10)
    with torch.inference_mode():
        want = peft_model(torch.tensor([prompt])).logits[0, -1]
        with peft_model.disable_adapter():
            delta = want - peft_model(torch.tensor([prompt])).logits[0, -1]
    tiny = {"model": tmp_path / "model", "loras": tmp_path / "loras"}
    engine = _tiny_engine(tiny, quantization="int8")
    assert engine.model.folded_gains  # the int8 kernel folds
    base = _last_logits(engine, prompt, None)
    folded = _last_logits(engine, prompt, "beta") - base
    engine.loras = LoraSet(engine.loras.directory, 8, replace(engine.loras.target, gains={}))
    engine.intake.parts = replace(engine.intake.parts, loras=engine.loras)  # intake holds it
    engine.runner.lora_stacks = LoraStacks()  # its stacks are cached by digest
    unfolded = _last_logits(engine, prompt, "beta") - base
    err_folded = (folded - delta).abs().max().item()
    err_unfolded = (unfolded - delta).abs().max().item()
    assert err_folded < 0.5 * err_unfolded, (err_folded, err_unfolded)


def test_a_replaced_adapter_is_read_again_once_nothing_holds_it(
    tiny: dict[str, Any], tmp_path: Path
) -> None:
    """A request made for the new copy (the gateway re-hashed it) gets the new copy: the
    resident old one is replaced when free, and the request is refused (busy) while
    running requests still use the old one."""
    path = _broken(tiny, tmp_path, "alpha")  # a copy to change
    engine = _tiny_engine(tiny, lora_dir=str(tmp_path))
    old = adapter_digest(path)
    held = engine.add_request(
        RequestSpec(_prompt(11), SamplingParams(max_tokens=4), adapter=AdapterRef("alpha"))
    )
    weights = load_file(str(path / WEIGHTS_FILE))
    save_file({k: v * 2 for k, v in weights.items()}, str(path / WEIGHTS_FILE))
    new = adapter_digest(path)
    assert new != old
    with pytest.raises(AdaptersBusyError, match="changed on disk"):
        engine.add_request(
            RequestSpec(_prompt(12), SamplingParams(max_tokens=2), adapter=AdapterRef("alpha", new))
        )
    while engine.has_unfinished():
        engine.step()
    assert held not in engine.requests
    _run_with(engine, AdapterRef("alpha", new))
    assert engine.loras.digest("alpha") == new and engine.loras.counts().evictions == 0
    with pytest.raises(AdapterMismatchError):  # made for the old copy, which is gone
        engine.add_request(
            RequestSpec(_prompt(13), SamplingParams(max_tokens=2), adapter=AdapterRef("alpha", old))
        )
    assert_no_leaks(engine)


def test_a_broken_adapter_costs_no_resident_one_its_slot(
    tiny: dict[str, Any], tmp_path: Path
) -> None:
    _broken(tiny, tmp_path, "good")
    broken = _broken(tiny, tmp_path, "broken")
    (broken / WEIGHTS_FILE).write_bytes(b"not safetensors")
    engine = _tiny_engine(tiny, lora_dir=str(tmp_path), max_loras=1)
    _run_with(engine, AdapterRef("good"))
    with pytest.raises(AdapterFormatError, match="unreadable"):
        engine.add_request(
            RequestSpec(_prompt(14), SamplingParams(max_tokens=2), adapter=AdapterRef("broken"))
        )
    assert engine.loras.counts().resident == ("good",)
    assert_no_leaks(engine)


def _run_with(engine: LLMEngine, adapter: AdapterRef) -> None:
    engine.add_request(RequestSpec(_prompt(15), SamplingParams(max_tokens=2), adapter=adapter))
    while engine.has_unfinished():
        engine.step()


def test_imports_cancelled_or_aborted_while_landing_let_go_of_the_adapter(
    tiny: dict[str, Any],
) -> None:
    engine = _tiny_engine(tiny)
    params = SamplingParams(max_tokens=4)
    alpha = AdapterRef("alpha")
    engine.handoff.reserve_import(
        RequestSpec(_prompt(16), params, request_id="a", adapter=alpha), 3
    )
    assert engine.loras.held() == {"alpha": 1}
    assert engine.handoff.cancel_import("a")
    engine.handoff.reserve_import(
        RequestSpec(_prompt(17), params, request_id="b", adapter=alpha), 3
    )
    engine.abort("b")
    engine.step()  # the abort waits for the bytes: the commit frees it
    assert engine.loras.held() == {"alpha": 1}
    engine.handoff.commit_import("b")
    assert_no_leaks(engine)
