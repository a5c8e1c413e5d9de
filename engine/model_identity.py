"""What a model directory is, byte for byte: the identity that workers compare before
they share KV or prefix-cache hits, and that a gateway compares before it tokenizes for
them.

Lifecycle: `ModelIdentity.of_dir(model_dir)` once at engine or gateway start (through
`ModelSpec.from_dir`). The identity has four parts (`IdentityPart`), each a 128-bit
digest:

- config: `config.json`, less the keys that only say who saved it (`CONFIG_NOISE`);
- weights: the bytes of every `*.safetensors` file, in name order. They are read in
  large chunks, with a progress bar past `PROGRESS_MIN_BYTES`. Each file's digest is
  cached in `.pdserve-identity.json` inside the model directory, or in the user's cache
  directory when the model directory is read-only. A file is hashed again only when its
  size, modification time or inode changed (one `stat` per file), or when it had not
  settled when it was hashed, so a restart costs nothing;
- tokenizer: `tokenizer.json` and `tokenizer_config.json` without its chat template;
- chat_template: the template the `Tokenizer` renders.

`fingerprint` folds all four parts: two fine-tunes of one shape differ in it. That is
`ModelSpec.fingerprint`, which the KV layout fingerprint, prefix-block hashes and router
keys are derived from, so workers of different identities never exchange KV or cache
hits. `differences` names the parts that differ, for messages.

The digests are xxh3-128: it hashes at memory speed (a 1 GB model is hashed in well
under a second once in the page cache), and the identity guards against accidental
mix-ups (a wrong directory, a partial copy, a retrained checkpoint), not against an
attacker who can already write the model files.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import xxhash
from tqdm import tqdm

from engine.tokenizer import read_chat_template, read_tokenizer_config

log = logging.getLogger(__name__)

CACHE_NAME = ".pdserve-identity.json"  # per-file weight digests, beside the weights
CACHE_VERSION = 2
#: config.json keys that say who saved the file, not what the model is.
CONFIG_NOISE = ("transformers_version", "_name_or_path")
#: A digest is trusted later only if its file had not changed for this long when it was
#: hashed: a change within one tick of the file system's clock keeps the same mtime.
SETTLED_NS = 2_000_000_000
CHUNK_BYTES = 16 << 20
PROGRESS_MIN_BYTES = 1 << 30  # hashing less than this is too quick for a progress bar


class IdentityPart(enum.Enum):
    CONFIG = "config (config.json)"
    WEIGHTS = "weights (*.safetensors)"
    TOKENIZER = "tokenizer (tokenizer.json, tokenizer_config.json)"
    CHAT_TEMPLATE = "chat template"


@dataclass(frozen=True)
class ModelIdentity:
    config: str
    weights: str
    tokenizer: str
    chat_template: str

    @property
    def fingerprint(self) -> str:
        """One digest of every part (64 bits in hex, as fingerprints were before)."""
        parts = "|".join(self.digest(p) for p in IdentityPart)
        return xxhash.xxh3_64_hexdigest(f"pdserve-model-v2|{parts}".encode())

    def digest(self, part: IdentityPart) -> str:
        return {
            IdentityPart.CONFIG: self.config,
            IdentityPart.WEIGHTS: self.weights,
            IdentityPart.TOKENIZER: self.tokenizer,
            IdentityPart.CHAT_TEMPLATE: self.chat_template,
        }[part]

    def differences(
        self, other: ModelIdentity, parts: Iterable[IdentityPart] = IdentityPart
    ) -> list[IdentityPart]:
        """The parts among `parts` in which `other` differs from this identity."""
        return [p for p in parts if self.digest(p) != other.digest(p)]

    @classmethod
    def of_dir(
        cls, model_dir: Path, *, progress: bool = True, hash_weights: bool = True
    ) -> ModelIdentity:
        """The identity of `model_dir`. `hash_weights=False` leaves the weights part
        empty: for a process that never reads them (the gateway), whose first start
        should not read every byte of a large model."""
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        for key in CONFIG_NOISE:
            config.pop(key, None)
        tokenizer_cfg = read_tokenizer_config(model_dir)
        tokenizer_cfg.pop("chat_template", None)
        tokenizer = xxhash.xxh3_128()
        tokenizer_json = model_dir / "tokenizer.json"
        tokenizer.update(tokenizer_json.read_bytes() if tokenizer_json.is_file() else b"")
        tokenizer.update(json.dumps(tokenizer_cfg, sort_keys=True).encode())
        template = read_chat_template(model_dir) or ""
        return cls(
            config=xxhash.xxh3_128_hexdigest(json.dumps(config, sort_keys=True).encode()),
            weights=WeightDigests(model_dir).digest(progress=progress) if hash_weights else "",
            tokenizer=tokenizer.hexdigest(),
            chat_template=xxhash.xxh3_128_hexdigest(template.encode()),
        )

    def to_json(self) -> dict[str, str]:
        return {p.name.lower(): self.digest(p) for p in IdentityPart}

    @classmethod
    def from_json(cls, raw: dict[str, str]) -> ModelIdentity:
        return cls(**{p.name.lower(): str(raw.get(p.name.lower(), "")) for p in IdentityPart})


def describe_difference(parts: Iterable[IdentityPart], mine: str, theirs: str) -> str:
    """`parts` in a sentence: "<mine> and <theirs> differ in: tokenizer (...) and ..."."""
    return f"{mine} and {theirs} differ in: " + " and ".join(p.value for p in parts)


class WeightDigests:
    """The weights part of a model directory's identity, with its per-file cache."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.files = sorted(model_dir.glob("*.safetensors"))

    def digest(self, *, progress: bool) -> str:
        cached = self._load_cache()
        todo = [f for f in self.files if not still_current(cached.get(f.name), f)]
        total = sum(f.stat().st_size for f in todo)
        digests = {f.name: cached[f.name] for f in self.files if f not in todo}
        with tqdm(
            total=total, unit="B", unit_scale=True, desc=f"hashing {self.model_dir.name}",
            disable=not progress or total < PROGRESS_MIN_BYTES,
        ) as bar:  # fmt: skip
            for f in todo:
                stamp = file_stamp(f)
                digest = _hash_file(f, bar.update)
                digests[f.name] = stamp | {"digest": digest, "hashed_ns": time.time_ns()}
        if todo:
            self._save_cache(digests)
        whole = xxhash.xxh3_128()
        for f in self.files:
            whole.update(f"{f.name}={digests[f.name]['digest']};".encode())
        return whole.hexdigest()

    def _cache_paths(self) -> list[Path]:
        home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        key = xxhash.xxh3_64_hexdigest(str(self.model_dir.resolve()).encode())
        return [self.model_dir / CACHE_NAME, home / "pdserve" / "identity" / f"{key}.json"]

    def _load_cache(self) -> dict[str, dict[str, object]]:
        for path in self._cache_paths():
            with contextlib.suppress(OSError, ValueError):
                raw = json.loads(path.read_text(encoding="utf-8"))
                if raw.get("version") == CACHE_VERSION and isinstance(raw.get("files"), dict):
                    return dict(raw["files"])
        return {}

    def _save_cache(self, files: dict[str, dict[str, object]]) -> None:
        """Write the cache atomically (rename), to the first place that takes it; a
        read-only system only costs the next start a re-hash."""
        text = json.dumps({"version": CACHE_VERSION, "files": files}, indent=1, sort_keys=True)
        for path in self._cache_paths():
            tmp = ""
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=".identity-", dir=path.parent)
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(text)
                os.replace(tmp, path)
                return
            except OSError as exc:
                log.debug("cannot cache weight digests at %s: %s", path, exc)
                if tmp:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
        log.warning("could not cache the weight digests of %s anywhere", self.model_dir)


def file_stamp(path: Path) -> dict[str, object]:
    """What tells a changed file from the one hashed: size, mtime and inode (OSError if
    it is gone). A cache entry is this, plus "digest" and "hashed_ns" (`still_current`)."""
    # The inode too: a copied directory (cp -p keeps times) hashes its files once more.
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def still_current(entry: dict[str, object] | None, path: Path) -> bool:
    """Whether the cached `entry` still describes `path`: the same size, mtime and inode,
    and the file had settled when it was hashed (else a rewrite in the same clock tick
    could pass for it)."""
    if not entry or not entry.get("digest"):
        return False
    settled = int(str(entry.get("hashed_ns", 0))) - int(str(entry.get("mtime_ns", 0)))
    return settled > SETTLED_NS and all(entry.get(k) == v for k, v in file_stamp(path).items())


def _hash_file(path: Path, advance: Callable[[int], object]) -> str:
    h = xxhash.xxh3_128()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
            advance(len(chunk))
    return h.hexdigest()
