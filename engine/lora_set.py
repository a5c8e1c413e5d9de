"""The LoRA adapters one engine may serve, and which of them are resident.

Lifecycle: the engine builds one `LoraSet` from `--lora-dir` (each subdirectory holding
an `adapter_config.json` is an adapter named after it) and `--max-loras`. A request that
names an adapter `acquire`s it when it is added (or its import reserved): a resident one
is shared, another is read from disk (`engine/lora.py`), evicting the least recently
used adapter that no live request holds; every request the scheduler retires
`release`s it again, and a fork that joins the batch `retain`s its parent's. So an
adapter is never dropped under a request that uses it, and `held()` is empty once the
engine is idle (the leak checks assert it).

When all `max_loras` slots are held by live requests and the request names another
adapter, `acquire` raises AdaptersBusyError (RESOURCE_EXHAUSTED): the engine does not
queue requests behind adapter slots, and the router already prefers workers that hold
the adapter. An adapter is read (from disk, onto the model's projections) in the
calling thread, outside the set's lock and never inside a step, and only then does it
evict anything: a broken adapter costs no resident one its slot.

A request names the digest of the copy it was made for (the gateway's). A resident
copy with another digest (the adapter was replaced on disk) is read again and replaced
once no request holds it; a request that finds the disk's copy differing from its own
is refused (AdapterMismatchError). Without a digest, the resident copy serves.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from engine.adapter_ref import adapter_digest, adapter_path, available_adapters
from engine.errors import AdapterMismatchError, AdaptersBusyError, UnknownAdapterError
from engine.lora import LoraAdapter, LoraTarget, read_adapter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraCounts:
    """Counters for stats and metrics."""

    resident: tuple[str, ...]  # least recently used first
    held: int  # of those, adapters live requests hold
    loads: int
    evictions: int


class LoraSet:
    def __init__(self, directory: Path | None, max_loras: int, target: LoraTarget) -> None:
        if max_loras <= 0:
            raise ValueError(f"max_loras must be > 0, got {max_loras}")
        if directory is not None and not directory.is_dir():
            raise FileNotFoundError(f"lora_dir {directory} is not a directory")
        self.directory = directory
        self.max_loras = max_loras
        self.target = target
        self._lock = threading.Lock()
        self._resident: OrderedDict[str, LoraAdapter] = OrderedDict()  # LRU order
        self._holds: dict[str, int] = {}  # name -> live requests holding it
        self._loads = 0
        self._evictions = 0

    # -- what exists -----------------------------------------------------------------
    def available(self) -> list[str]:
        """The adapters on disk, by name (empty without a directory)."""
        return available_adapters(self.directory)

    def digest(self, name: str) -> str:
        """The identity of adapter `name` (the resident copy's, if it is resident)."""
        with self._lock:
            resident = self._resident.get(name)
        return resident.digest if resident is not None else adapter_digest(self._path(name))

    # -- holding -------------------------------------------------------------------
    def acquire(self, name: str, digest: str = "") -> LoraAdapter:
        """Adapter `name`, resident and held for one request until `release`. With a
        `digest`, only that copy of it: a resident copy with another digest is read again
        from disk (replaced, if nothing holds it), and AdapterMismatchError if the disk
        holds yet another."""
        with self._lock:
            resident = self._resident.get(name)
            if resident is not None and digest in ("", resident.digest):
                return self._hold(resident)
        path = self._path(name)
        # Read outside the lock: a load takes milliseconds to seconds, and steps (stats,
        # releases) and other requests' resident adapters must not wait for it.
        fresh = read_adapter(path, self.target, name=name)
        if digest and fresh.digest != digest:
            raise AdapterMismatchError(
                f"model: adapter {name!r} here has digest {fresh.digest[:16]}, the request "
                f"was made for {digest[:16]}: the --lora-dir copies differ; deploy one copy "
                "everywhere"
            )
        with self._lock:
            return self._hold(self._install(fresh))

    def retain(self, adapter: LoraAdapter) -> None:
        """One more request (a fork) holds an adapter another request already holds."""
        with self._lock:
            self._holds[adapter.name] += 1

    def release(self, adapter: LoraAdapter) -> None:
        with self._lock:
            left = self._holds[adapter.name] - 1
            if left:
                self._holds[adapter.name] = left
            else:
                del self._holds[adapter.name]

    def held(self) -> dict[str, int]:
        """Adapters held by live requests, with how many hold each."""
        with self._lock:
            return dict(self._holds)

    def counts(self) -> LoraCounts:
        with self._lock:
            return LoraCounts(tuple(self._resident), len(self._holds), self._loads, self._evictions)

    # -- internals -----------------------------------------------------------------
    def _path(self, name: str) -> Path:
        if self.directory is None:
            raise UnknownAdapterError(
                f"model: adapter {name!r} asked, but this worker serves no adapters "
                "(start it with --lora-dir)"
            )
        path = adapter_path(self.directory, name)
        if path is None:
            have = ", ".join(self.available()) or "none"
            raise UnknownAdapterError(
                f"model: adapter {name!r} is not in {self.directory} (adapters: {have})"
            )
        return path

    def _hold(self, adapter: LoraAdapter) -> LoraAdapter:
        """(Under the lock.) One more holder; most recently used."""
        self._resident.move_to_end(adapter.name)
        self._holds[adapter.name] = self._holds.get(adapter.name, 0) + 1
        return adapter

    def _install(self, fresh: LoraAdapter) -> LoraAdapter:
        """(Under the lock.) Make `fresh` resident, unless another thread made the same
        copy resident meanwhile (then that one). A resident copy of another digest is
        replaced if nothing holds it; a full set evicts its least recently used unheld
        adapter. AdaptersBusyError when neither is possible."""
        name = fresh.name
        current = self._resident.get(name)
        if current is not None and current.digest == fresh.digest:
            return current
        if current is not None and name in self._holds:
            raise AdaptersBusyError(
                f"model: adapter {name!r} changed on disk, and running requests still "
                "use the copy loaded before; retry once they end"
            )
        if current is None and len(self._resident) >= self.max_loras:
            self._evict_one(name)
        self._resident[name] = fresh
        self._loads += 1
        log.info(
            "LoRA adapter %s loaded (rank %d, %d projections, %.1f MiB, digest %s)",
            name, fresh.rank, len(fresh.pairs), fresh.nbytes / 2**20, fresh.digest[:12],
        )  # fmt: skip
        return fresh

    def _evict_one(self, wanted: str) -> None:
        for old in self._resident:  # least recently used first
            if old not in self._holds:
                del self._resident[old]
                self._evictions += 1
                log.info("LoRA adapter %s evicted to make room for %s", old, wanted)
                return
        raise AdaptersBusyError(
            f"model: adapter {wanted!r} cannot be loaded now: all {self.max_loras} adapter "
            f"slots (--max-loras) hold adapters of running requests "
            f"({', '.join(self._resident)}); retry shortly"
        )
