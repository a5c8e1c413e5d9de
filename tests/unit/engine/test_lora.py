"""Multi-LoRA in the engine: PEFT parity in batches mixing the base model and two
adapters (one engine, and prefill -> decode through a KV hand-off); adapter rows never
take the fused decode. The bookkeeping (residency, cache keys, refusals) is in
test_lora_bookkeeping.py.

The adapters are random, written by PEFT itself (tests/lora_adapters.py), and the
reference is transformers + PEFT generating greedily one prompt at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.adapter_ref import AdapterRef
from engine.engine import LLMEngine
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from engine.tokenizer import ChatMessage
from tests.conftest import EngineFactory, assert_no_leaks
from tests.lora_adapters import RECIPES, peft_greedy, write_adapter
from tests.prompts import CHAT, SHORT, long_prompt

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

MAX_TOKENS = 16
MIX = (None, "alpha", "beta")  # each prompt runs as the base model and as both adapters


# -- parity on the real model ----------------------------------------------------------
@pytest.fixture(scope="module")
def hf_base(model_dir: Path) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory, hf_base: Any) -> dict[str, Any]:
    """Adapters alpha and beta in one directory; returns {name: PEFT model} (plus the
    directory under "")."""
    root = tmp_path_factory.mktemp("loras")
    out: dict[str, Any] = {"": root}
    for name in ("alpha", "beta"):
        out[name] = write_adapter(hf_base, root / name, RECIPES[name])
    return out


@pytest.fixture(scope="module")
def engine(make_engine: EngineFactory, lora_dir: dict[str, Any]) -> LLMEngine:
    return make_engine(
        kv_cache_bytes=256 << 20, max_num_batched_tokens=512, lora_dir=str(lora_dir[""])
    )


@pytest.fixture(scope="module")
def prompts(engine: LLMEngine) -> list[list[int]]:
    """A share of the parity prompts: short ones, chats, and one over 1,000 tokens (its
    prefill spans several chunks of the 512-token step budget)."""
    tok = engine.tokenizer
    out = [tok.encode(p) for p in SHORT[:6]]
    out += [tok.encode_chat([ChatMessage("user", c)]) for c in CHAT[:3]]
    out.append(tok.encode(long_prompt(9)))
    return out


@pytest.fixture(scope="module")
def reference(
    hf_base: Any, lora_dir: dict[str, Any], prompts: list[list[int]]
) -> dict[str | None, list[list[int]]]:
    refs: dict[str | None, list[list[int]]] = {None: peft_greedy(hf_base, prompts, MAX_TOKENS)}
    for name in ("alpha", "beta"):
        refs[name] = peft_greedy(lora_dir[name], prompts, MAX_TOKENS)
    return refs


def _mixed(prompts: list[list[int]]) -> tuple[list[list[int]], list[str | None]]:
    return [p for p in prompts for _ in MIX], [a for _ in prompts for a in MIX]


def test_the_adapters_change_the_output(reference: dict[str | None, list[list[int]]]) -> None:
    """Otherwise the parity below would prove nothing about the adapters."""
    for name in ("alpha", "beta"):
        assert sum(r != b for r, b in zip(reference[name], reference[None], strict=True)) >= 3


def test_a_mixed_batch_matches_peft(
    engine: LLMEngine, prompts: list[list[int]], reference: dict[str | None, list[list[int]]]
) -> None:
    batch, names = _mixed(prompts)
    got = engine.generate(batch, SamplingParams(max_tokens=MAX_TOKENS), names)
    for i, (tokens, name) in enumerate(zip(got, names, strict=True)):
        assert tokens == reference[name][i // len(MIX)], f"prompt {i // len(MIX)}, {name}"
    assert set(engine.loras.counts().resident) == {"alpha", "beta"}
    assert_no_leaks(engine)


def test_prefill_to_decode_hand_off_matches_peft(
    make_engine: EngineFactory,
    lora_dir: dict[str, Any],
    prompts: list[list[int]],
    reference: dict[str | None, list[list[int]]],
) -> None:
    """Disaggregated: each request prefilled on one engine, its KV moved to another
    engine that decodes a batch mixing all three."""
    kw = {"num_kv_blocks": 400, "lora_dir": str(lora_dir[""])}
    prefill, decode = make_engine(**kw), make_engine(**kw)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    firsts: dict[str, int] = {}
    for i, (prompt, name) in enumerate(zip(*_mixed(prompts), strict=True)):
        adapter = None if name is None else AdapterRef(name)
        rid = prefill.add_request(
            RequestSpec(prompt, SamplingParams(max_tokens=1), request_id=f"p{i}", adapter=adapter),
            hold_kv=True,
        )
        while prefill.has_unfinished():
            prefill.step()
        held = prefill.handoff.held_kv(rid)
        assert held.adapter_digest == ("" if name is None else prefill.loras.digest(name))
        ref = None if name is None else AdapterRef(name, held.adapter_digest)
        slot = decode.handoff.reserve_import(
            RequestSpec(prompt, params, request_id=f"d{i}", adapter=ref), held.first_token_id
        )
        # The chat prompts share their template's first block: cached after the first.
        sent = held.block_ids[slot.num_cached_blocks :]
        decode.kv_blocks[slot.blocks_to_fill] = prefill.kv_blocks[sent]
        prefill.handoff.release_held(rid)
        decode.handoff.commit_import(f"d{i}")
        firsts[f"d{i}"] = held.first_token_id
    out = {rid: [tok] for rid, tok in firsts.items()}
    while decode.has_unfinished():
        for o in decode.step():
            out[o.request_id] += o.new_token_ids
    names = _mixed(prompts)[1]
    for i, name in enumerate(names):
        assert out[f"d{i}"] == reference[name][i // len(MIX)], f"prompt {i // len(MIX)}, {name}"
    assert_no_leaks(prefill)
    assert_no_leaks(decode)


def test_adapter_rows_are_never_fused(make_engine: EngineFactory, lora_dir: dict[str, Any]) -> None:
    """A bf16 engine fuses its base-model decodes; a row with an adapter runs the torch
    forward, which adds the adapter (`engine/fused_decode.py` has no LoRA)."""
    engine = make_engine(dtype="bfloat16", lora_dir=str(lora_dir[""]))
    assert engine.model.fused is not None
    prompt = engine.tokenizer.encode(SHORT[0])
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.generate([prompt], greedy, adapters=["alpha"])
    assert engine.runner.fused_steps == 0
    engine.generate([prompt], greedy)
    assert engine.runner.fused_steps == 5
    assert_no_leaks(engine)
