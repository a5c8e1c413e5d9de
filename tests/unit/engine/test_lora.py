"""Multi-LoRA in the engine: PEFT parity in batches mixing the base model and two
adapters (one engine, and prefill -> decode through a KV hand-off); in bf16, adapter rows
through the fused decode (nearer float32 than torch, the same alone or batched). The
bookkeeping (residency, cache keys, refusals) is in
test_lora_bookkeeping.py.

The adapters are random, written by PEFT itself (tests/lora_adapters.py), and the
reference is transformers + PEFT generating greedily one prompt at a time.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import fused_decode
from engine.adapter_ref import AdapterRef
from engine.engine import LLMEngine
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from engine.tokenizer import ChatMessage
from tests.conftest import EngineFactory, assert_no_leaks
from tests.lora_adapters import RECIPES, peft_greedy, write_adapter
from tests.prompts import CHAT, SHORT, long_prompt
from tests.unit.engine.step_logits import distances_to_float32

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


def test_adapter_rows_fuse_nearer_float32_than_torch(
    make_engine: EngineFactory, lora_dir: dict[str, Any]
) -> None:
    """bf16: decode steps whose rows name an adapter fuse (every one of them, checked in
    `distances_to_float32`), and their logits are no farther from the float32 engine's
    with the same adapter than the torch bf16 forward's are (measured: 0.67x and 0.53x
    of its distance for alpha and beta on an AVX-512 BF16 host). With the delta left
    out, the fused distance was 2.3x the torch path's."""
    for name in ("alpha", "beta"):
        errors = distances_to_float32(make_engine, name, str(lora_dir[""]))
        fused, plain = statistics.fmean(errors["fused"]), statistics.fmean(errors["torch"])
        assert fused <= plain, (name, fused, plain)


def test_a_lora_row_is_the_same_alone_or_in_a_mixed_batch(
    make_engine: EngineFactory, lora_dir: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16, fused: rows of the base model and of two adapters decode together with the
    same tokens as each alone (a row's delta is its own adapter's, computed alone).
    Prefill is kept out as in test_fused_decode.py's batch test: each prompt's two full
    blocks are cached by a run of its own first (under its adapter's keys), so both
    runs prefill one token per request from the same KV."""
    engine = make_engine(dtype="bfloat16", kv_cache_bytes=128 << 20, lora_dir=str(lora_dir[""]))
    assert engine.model.fused is not None
    # Without AVX-512 BF16 the engine fuses at most FALLBACK_MAX_ROWS rows: lifted, so
    # the float32 fallback's products are tested in a batch too.
    monkeypatch.setattr(engine.model.fused, "max_rows", fused_decode.MAX_ROWS)
    length = 2 * engine.config.block_size + 1
    texts = (SHORT + CHAT)[:9]
    prompts = [(engine.tokenizer.encode(p) * length)[:length] for p in texts]
    names = [MIX[i % len(MIX)] for i in range(len(prompts))]
    for p, name in zip(prompts, names, strict=True):
        engine.generate([p], SamplingParams(max_tokens=1), [name])
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    before = engine.runner.fused_steps
    together = engine.generate(prompts, params, names)
    # Every step fused, all nine rows: the one-token prefill from the cache, 5 decodes.
    assert engine.runner.fused_steps - before == 6
    alone = [engine.generate([p], params, [n])[0] for p, n in zip(prompts, names, strict=True)]
    assert together == alone
    assert len({tuple(t) for t in together}) > 3  # the adapters changed something
    assert_no_leaks(engine)
