"""A model directory's identity (`engine.model_identity`): the weights' bytes, the
tokenizer and the chat template are in the fingerprint, so two fine-tunes of one shape
never pass for each other (their KV layouts and prefix-hash seeds differ); the weight
digests are cached per file and a file is hashed again only once it changed."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import model_identity
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.kv_layout import KvLayout
from engine.model_identity import CACHE_NAME, IdentityPart, ModelIdentity
from engine.model_spec import ModelSpec
from engine.prefix_hash import hash_seed
from engine.tokenizer import Tokenizer
from kvtransfer.config import TransferConfig
from kvtransfer.errors import LayoutMismatchError
from kvtransfer.exporter import KvExporter
from kvtransfer.importer import handshake, handshake_offer
from kvtransfer.layout import check_layout, layout_to_proto
from tests.tiny_models import write_tiny_model

CPU = torch.device("cpu")
TCP = TransferConfig(kv_backend="tcp", kv_transfer_timeout_s=10.0)
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


@pytest.fixture
def base(tmp_path: Path) -> Path:
    path = tmp_path / "base"
    write_tiny_model("llama3", path)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return path


def _copy(src: Path, name: str) -> Path:
    dst = src.parent / name
    shutil.copytree(src, dst)
    return dst


def _perturb(model_dir: Path) -> None:
    """One weight nudged: same names, shapes and file size, different bytes."""
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 0.5
    save_file(tensors, path, metadata={"format": "pt"})


def test_a_copy_has_the_same_identity(base: Path) -> None:
    assert ModelIdentity.of_dir(_copy(base, "copy")) == ModelIdentity.of_dir(base)


def test_same_shape_different_weights_differ_in_weights_alone(base: Path) -> None:
    tuned = _copy(base, "tuned")
    _perturb(tuned)
    sizes = {(d / "model.safetensors").stat().st_size for d in (base, tuned)}
    assert len(sizes) == 1
    a, b = ModelIdentity.of_dir(base), ModelIdentity.of_dir(tuned)
    assert a.differences(b) == [IdentityPart.WEIGHTS]
    spec_a, spec_b = ModelSpec.from_dir(base), ModelSpec.from_dir(tuned)
    assert spec_a.fingerprint != spec_b.fingerprint
    # So their workers never exchange KV (the handshake compares layouts) ...
    layout_a = KvLayout.from_spec(spec_a, torch.float32, 16, CPU)
    layout_b = KvLayout.from_spec(spec_b, torch.float32, 16, CPU)
    with pytest.raises(LayoutMismatchError, match="model_fingerprint"):
        check_layout(layout_a, layout_to_proto(layout_b))
    # ... nor prefix-cache hits or router keys (both are seeded by the fingerprint).
    assert hash_seed(spec_a.fingerprint) != hash_seed(spec_b.fingerprint)


def test_tokenizer_and_chat_template_are_parts_of_the_identity(base: Path) -> None:
    retok = _copy(base, "retok")
    vocab = json.loads((retok / "tokenizer.json").read_text())
    vocab["model"]["vocab"]["w1"], vocab["model"]["vocab"]["w2"] = 2, 1
    (retok / "tokenizer.json").write_text(json.dumps(vocab))
    templated = _copy(base, "templated")
    (templated / "chat_template.jinja").write_text(TEMPLATE + "<assistant>")
    ident = ModelIdentity.of_dir(base)
    assert ident.differences(ModelIdentity.of_dir(retok)) == [IdentityPart.TOKENIZER]
    assert ident.differences(ModelIdentity.of_dir(templated)) == [IdentityPart.CHAT_TEMPLATE]
    # The template file wins over the config's, as the tokenizer renders it.
    assert Tokenizer(templated).chat_template == TEMPLATE + "<assistant>"
    assert ModelSpec.from_dir(retok).fingerprint != ModelSpec.from_dir(base).fingerprint


class Hashes:
    """Counts the weight files hashed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.files: list[str] = []
        real = model_identity._hash_file

        def counted(path: Path, advance: object) -> str:
            self.files.append(path.name)
            return real(path, advance)  # type: ignore[arg-type]

        monkeypatch.setattr(model_identity, "_hash_file", counted)


def _settle(model_dir: Path) -> None:
    """Date the weights a minute back, as files that have not changed lately are."""
    weights = model_dir / "model.safetensors"
    past = time.time() - 60
    os.utime(weights, (past, past))


def test_weight_digests_are_cached_until_a_file_changes(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hashes = Hashes(monkeypatch)
    _settle(base)
    first = ModelIdentity.of_dir(base)
    assert hashes.files == ["model.safetensors"] and (base / CACHE_NAME).is_file()
    assert ModelIdentity.of_dir(base) == first and hashes.files == ["model.safetensors"]
    _perturb(base)  # rewritten: a new modification time
    assert ModelIdentity.of_dir(base).weights != first.weights
    assert hashes.files == ["model.safetensors"] * 2


def test_a_file_hashed_before_it_settled_is_hashed_again(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Just written when hashed: a rewrite within the same clock tick could keep its
    size, mtime and inode, so the digest is not trusted until the file has settled."""
    hashes = Hashes(monkeypatch)
    first = ModelIdentity.of_dir(base)  # the tiny model was written a moment ago
    assert ModelIdentity.of_dir(base) == first and len(hashes.files) == 2


def test_who_saved_the_config_is_not_part_of_it_and_a_gateway_skips_the_weights(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    resaved = _copy(base, "resaved")
    config = json.loads((resaved / "config.json").read_text())
    config["transformers_version"] = "0.0.1"
    (resaved / "config.json").write_text(json.dumps(config, indent=4))
    assert ModelIdentity.of_dir(resaved) == ModelIdentity.of_dir(base)
    hashes = Hashes(monkeypatch)
    light = ModelIdentity.of_dir(base, hash_weights=False)
    assert light.weights == "" and hashes.files == []
    assert light.differences(ModelIdentity.of_dir(base)) == [IdentityPart.WEIGHTS]


def test_a_stale_cache_entry_is_not_trusted(base: Path) -> None:
    """A cache whose entry no longer matches the file (same size, other time) is
    ignored, whatever digest it holds."""
    first = ModelIdentity.of_dir(base)
    cache = json.loads((base / CACHE_NAME).read_text())
    cache["files"]["model.safetensors"]["digest"] = "0" * 32
    cache["files"]["model.safetensors"]["mtime_ns"] -= 1
    (base / CACHE_NAME).write_text(json.dumps(cache))
    assert ModelIdentity.of_dir(base) == first


def test_an_unwritable_model_directory_caches_in_the_user_cache(
    base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache file cannot be written beside the weights (a directory of that name
    stands in for a read-only mount, which root would write through): the digests go to
    the user's cache directory and are found there next time."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    hashes = Hashes(monkeypatch)
    (base / CACHE_NAME).mkdir()
    _settle(base)
    first = ModelIdentity.of_dir(base)
    assert ModelIdentity.of_dir(base) == first and len(hashes.files) == 1
    assert list((tmp_path / "xdg" / "pdserve" / "identity").glob("*.json"))


def test_engines_of_two_fine_tunes_refuse_each_others_kv(base: Path) -> None:
    """Real engines on the two copies: the tuned one's importer is refused at the
    handshake by the base one's exporter (the KV layout fingerprints differ in the
    model's), and the prefix-cache seeds the engines hash blocks with differ."""
    tuned = _copy(base, "tuned")
    _perturb(tuned)
    engines = [
        LLMEngine(EngineConfig(model=str(d), dtype="float32", num_kv_blocks=16))
        for d in (base, tuned)
    ]  # fmt: skip
    exporter = KvExporter(engines[0].handoff, TCP, engine_id="base").start()
    try:
        with pytest.raises(LayoutMismatchError, match="layout"):
            handshake(
                exporter.address, handshake_offer(engines[1].layout, "tuned"), time.monotonic() + 10
            )
        handshake(
            exporter.address, handshake_offer(engines[0].layout, "base-too"), time.monotonic() + 10
        )
    finally:
        exporter.close()
    assert engines[0].hash_seed_for("") != engines[1].hash_seed_for("")
