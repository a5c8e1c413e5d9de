"""The LoRA adapters one served model offers, as a gateway names and keys them.

Lifecycle: the gateway builds an `AdapterCatalog` on `--lora-dir` (the same adapters
the model's workers were started with) at start; it is read, never written, by every
request after. `names()` lists the directory as it is now (an adapter copied in later is
served without a restart: the workers load it on first use); `resolve(name)` gives the
adapter's `AdapterRef`: its name and its digest (`engine.adapter_ref.adapter_digest`). The
digest goes into the request's routing key, so requests of one adapter meet the prefix
caches of their own adapter, and to the workers, which refuse a request made for
another copy of the adapter than theirs (FAILED_PRECONDITION). The adapters present at
start are hashed then. Digests are cached per adapter with the model identity's rule
(`engine.model_identity.still_current`: the files' size, mtime and inode, and trusted only
if they had settled when hashed), so only an adapter added or replaced later is hashed on
a request's path.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from engine.adapter_ref import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterRef,
    adapter_digest,
    adapter_path,
    available_adapters,
)
from engine.errors import AdapterFormatError
from engine.model_identity import file_stamp, still_current
from services.common.status import UnknownModelError

log = logging.getLogger(__name__)

#: The files whose bytes an adapter's digest covers (`engine.adapter_ref.adapter_digest`).
_FILES = (CONFIG_FILE, WEIGHTS_FILE)


class AdapterCatalog:
    def __init__(self, directory: Path) -> None:
        if not directory.is_dir():
            raise ValueError(f"lora_dir {directory} is not a directory")
        self.directory = directory
        self._lock = threading.Lock()
        # name -> a cache entry per file of `_FILES` (`engine.model_identity`'s kind: its
        # stamp, the adapter's digest, when it was hashed)
        self._digests: dict[str, list[dict[str, object]]] = {}
        for name in self.names():  # hashed now, at start, not on a request's event loop
            try:
                self.resolve(name, "")
            except UnknownModelError as exc:  # its requests will say so; the rest serve
                log.warning("LoRA adapter %s cannot be served: %s", name, exc)

    def names(self) -> list[str]:
        return available_adapters(self.directory)

    def __contains__(self, name: str) -> bool:
        return adapter_path(self.directory, name) is not None

    def check(self, name: str, model: str) -> None:
        """UnknownModelError, listing the adapters there are, unless `name` is one of
        served model `model`'s."""
        if name not in self:
            have = ", ".join(self.names()) or "none"
            raise UnknownModelError(
                f"model: {model!r} has no LoRA adapter {name!r} (adapters: {have})"
            )

    def resolve(self, name: str, model: str) -> AdapterRef:
        """The adapter `name` of served model `model` (`check`, then `ref`)."""
        self.check(name, model)
        return self.ref(name)

    def ref(self, name: str) -> AdapterRef:
        """The name and digest of adapter `name`, which exists; UnknownModelError when
        it cannot be read."""
        path = self.directory / name
        return AdapterRef(name, self._cached(name, path) or self._hash(name, path))

    def _cached(self, name: str, path: Path) -> str | None:
        """The digest hashed before, while no file of the adapter changed since."""
        with self._lock:
            entries = self._digests.get(name)
        if not entries:
            return None
        try:
            fresh = all(still_current(e, path / f) for e, f in zip(entries, _FILES, strict=True))
        except OSError:  # a file is gone: hashing says what
            return None
        return str(entries[0]["digest"]) if fresh else None

    def _hash(self, name: str, path: Path) -> str:
        try:
            stamps = [file_stamp(path / f) for f in _FILES]
            digest = adapter_digest(path)
        except (AdapterFormatError, OSError) as exc:  # to the client: not to be had here
            raise UnknownModelError(f"model: adapter {name!r} cannot be served: {exc}") from exc
        hashed_ns = time.time_ns()
        with self._lock:
            self._digests[name] = [s | {"digest": digest, "hashed_ns": hashed_ns} for s in stamps]
        return digest
