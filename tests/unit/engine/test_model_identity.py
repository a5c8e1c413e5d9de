"""A model directory's identity (`engine.model_identity`): the weights' bytes, the
tokenizer and the chat template are in the fingerprint, so two fine-tunes of one shape
never pass for each other (their KV layouts and prefix-hash seeds differ); the weight
digests are cached per file and a file is hashed again only once it changed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import model_identity
from engine.kv_cache import KvLayout
from engine.model_identity import CACHE_NAME, IdentityPart, ModelIdentity
from engine.model_spec import ModelSpec
from engine.prefix_hash import hash_seed
from engine.tokenizer import Tokenizer
from kvtransfer.errors import LayoutMismatchError
from kvtransfer.layout import check_layout, layout_to_proto
from tests.tiny_models import write_tiny_model

CPU = torch.device("cpu")
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


def test_weight_digests_are_cached_until_a_file_changes(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hashes = Hashes(monkeypatch)
    first = ModelIdentity.of_dir(base)
    assert hashes.files == ["model.safetensors"] and (base / CACHE_NAME).is_file()
    assert ModelIdentity.of_dir(base) == first and hashes.files == ["model.safetensors"]
    _perturb(base)  # rewritten: a new modification time
    assert ModelIdentity.of_dir(base).weights != first.weights
    assert hashes.files == ["model.safetensors"] * 2


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
    first = ModelIdentity.of_dir(base)
    assert ModelIdentity.of_dir(base) == first and len(hashes.files) == 1
    assert list((tmp_path / "xdg" / "pdserve" / "identity").glob("*.json"))
