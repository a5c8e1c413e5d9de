"""The LoRA adapters one served model offers, as a gateway names and keys them.

Lifecycle: the gateway builds an `AdapterCatalog` on `--lora-dir` (the same adapters
the model's workers were started with) at start; it is read, never written, by every
request after. `names()` lists the directory as it is now (an adapter copied in later is
served without a restart: the workers load it on first use); `resolve(name)` gives the
adapter's `AdapterRef`: its name and its digest (`engine.lora.adapter_digest`). The
digest goes into the request's routing key, so requests of one adapter meet the prefix
caches of their own adapter, and to the workers, which refuse a request made for
another copy of the adapter than theirs (FAILED_PRECONDITION). The adapters present at
start are hashed then; digests are cached per adapter on the stat of its two files, so
only an adapter added or replaced later is hashed on a request's path (once).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from engine.errors import AdapterFormatError
from engine.lora import CONFIG_FILE, NAME, WEIGHTS_FILE, AdapterRef, adapter_digest
from engine.lora_set import available_adapters
from services.common.status import UnknownModelError

log = logging.getLogger(__name__)

_Stamp = tuple[tuple[int, int, int], ...]


class AdapterCatalog:
    def __init__(self, directory: Path) -> None:
        if not directory.is_dir():
            raise ValueError(f"lora_dir {directory} is not a directory")
        self.directory = directory
        self._lock = threading.Lock()
        self._digests: dict[str, tuple[_Stamp, str]] = {}
        for name in self.names():  # hashed now, at start, not on a request's event loop
            try:
                self.resolve(name, "")
            except UnknownModelError as exc:  # its requests will say so; the rest serve
                log.warning("LoRA adapter %s cannot be served: %s", name, exc)

    def names(self) -> list[str]:
        return available_adapters(self.directory)

    def __contains__(self, name: str) -> bool:
        return bool(NAME.match(name)) and (self.directory / name / CONFIG_FILE).is_file()

    def resolve(self, name: str, model: str) -> AdapterRef:
        """The adapter `name` of served model `model`; UnknownModelError listing the
        adapters there are when it is not one."""
        if name not in self:
            have = ", ".join(self.names()) or "none"
            raise UnknownModelError(
                f"model: {model!r} has no LoRA adapter {name!r} (adapters: {have})"
            )
        path = self.directory / name
        stamp = _stamp(path)
        with self._lock:
            cached = self._digests.get(name)
        if cached is not None and cached[0] == stamp:
            return AdapterRef(name, cached[1])
        try:
            digest = adapter_digest(path)
        except AdapterFormatError as exc:  # to the client: this model cannot be had here
            raise UnknownModelError(f"model: adapter {name!r} cannot be served: {exc}") from exc
        with self._lock:
            self._digests[name] = (stamp, digest)
        return AdapterRef(name, digest)


def _stamp(path: Path) -> _Stamp:
    out = []
    for file in (path / CONFIG_FILE, path / WEIGHTS_FILE):
        try:
            st = file.stat()
        except FileNotFoundError:
            out.append((-1, -1, -1))
            continue
        out.append((st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)
