"""One model a gateway serves, by the name clients send as `model`, and the versions of
it that take its requests.

Lifecycle: built at gateway start from its `ServedModelSpec` (`build_catalog`; the
`ModelCatalog` holds them all), with its own tokenizer and limits and one `Backend` per
version that serves it. A model starts with its
unversioned backend; a named model's `RolloutFollower` has the backends of the versions a
rollout names made as it sees them (`ensure_version`), and `pick(tenant)` returns the
backend a request goes to. What belongs to the gateway as a whole is shared: keys and
quotas, worker stubs, the record book and the stream cap.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.grammar import GrammarCompiler, LazyGrammarCompiler
from engine.tokenizer import Tokenizer
from services.gateway.flow.admission import Admission
from services.gateway.flow.prefill_site import SitePolicy
from services.gateway.models.adapter_catalog import AdapterCatalog
from services.gateway.models.backend import Backend, SharedParts
from services.gateway.models.rollout_follower import RolloutFollower
from services.gateway.stream.request_record import Keepers
from services.router.placement import Placement


@dataclass(frozen=True)
class ServedModelSpec:
    """What serving one model takes: the name clients send as `model`, its tokenizer and
    limits, and where the requests of its base version are placed and admitted."""

    name: str
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    placement: Placement
    admission: Admission

    def serve(self, parts: SharedParts) -> ServedModel:
        """The model, its base version served with the gateway's shared `parts`."""
        base = parts.backend("", self.placement, self.admission)
        return ServedModel(self.name, self.tokenizer, self.max_model_len, self.vocab_size, base)


@dataclass
class ServedModel:
    name: str
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    base: Backend  # the version the gateway started with
    # Makes the backend of another version (a rollout's); None: this model has one.
    make_backend: Callable[[str], Backend] | None = None
    follower: RolloutFollower | None = None
    versions: dict[str, Backend] = field(default_factory=dict)
    adapters: AdapterCatalog | None = None  # its LoRA adapters (--lora-dir); None: none
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _grammars: LazyGrammarCompiler = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.versions.setdefault(self.base.version, self.base)
        self._grammars = LazyGrammarCompiler(self.tokenizer, self.vocab_size)

    # The base version's parts, as the gateway's single-model callers knew them.
    @property
    def placement(self) -> Placement:
        return self.base.placement

    @property
    def admission(self) -> Admission:
        return self.base.admission

    @property
    def keepers(self) -> Keepers:
        return self.base.keepers

    @property
    def sites(self) -> SitePolicy:
        return self.base.sites

    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler, built on first use (it indexes the vocabulary)."""
        return self._grammars()

    def ensure_version(self, version: str) -> Backend:
        """The backend of `version`, made on first call (Redis I/O: off the event loop)."""
        with self._lock:
            backend = self.versions.get(version)
        if backend is not None:
            return backend
        if self.make_backend is None:
            raise ValueError(f"model {self.name!r} has no versions")
        made = self.make_backend(version)
        with self._lock:
            return self.versions.setdefault(version, made)

    def pick(self, tenant: str) -> Backend:
        """The backend a request of `tenant` goes to: the rollout's choice once its
        backend exists, else the base version's."""
        if self.follower is None:
            return self.base
        return self.versions.get(self.follower.pick(tenant), self.base)

    def stable(self) -> Backend:
        """The backend of the version that takes what a rollout does not split off."""
        if self.follower is None:
            return self.base
        return self.versions.get(self.follower.rollout.stable, self.base)

    def backends(self) -> list[Backend]:
        with self._lock:
            return list(self.versions.values())
