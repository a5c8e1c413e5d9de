"""The models one gateway serves, by name.

Lifecycle: `build_catalog` adds the primary model first (`--model`, named by
`--served-model-name`, or by its path or the default model's name), then each of
`--extra-models`, at start; the catalog does not change after. `resolve(name)` resolves
a request's `model` field (empty: the primary) to the model and, when it names one of
the model's LoRA adapters ("<model>:<adapter>", or the adapter's own name), that
adapter; or raises UnknownModelError listing what is served. A model's own name wins
over an adapter's; model names cannot hold ':', so "<model>:<adapter>" is never a
model's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from engine.adapter_ref import AdapterRef
from services.common.status import UnknownModelError
from services.gateway.models.backend import Backend, SharedParts
from services.gateway.models.served_model import ServedModel, ServedModelSpec
from services.router.placement import Placement


@dataclass(frozen=True)
class ModelCard:
    """One entry of the model list: a model (`parent` "") or a LoRA adapter of one."""

    id: str
    parent: str
    max_model_len: int


class Resolved(NamedTuple):
    """What a request's `model` names: a served model, and one of its LoRA adapters
    (None: the model itself)."""

    served: ServedModel
    adapter: AdapterRef | None


class ModelCatalog:
    def __init__(self) -> None:
        self._by_name: dict[str, ServedModel] = {}  # in the order added: the primary first

    @property
    def primary(self) -> ServedModel:
        return next(iter(self._by_name.values()))

    def add(self, model: ServedModel) -> None:
        if model.name in self._by_name:
            raise ValueError(f"extra_models: the model name {model.name!r} is served already")
        self._by_name[model.name] = model

    def get(self, name: str) -> ServedModel:
        """The model a request's `model` field names ("" or None: the primary; an
        adapter's name: the model it adapts)."""
        return self._find(name)[0]

    def resolve(self, name: str) -> Resolved:
        """The model and the LoRA adapter (None: the model itself) `name` names."""
        model, adapter = self._find(name)
        if adapter is None or model.adapters is None:
            return Resolved(model, None)
        return Resolved(model, model.adapters.ref(adapter))

    def card(self, name: str) -> ModelCard:
        """The model list's entry of what `name` names (under the name asked for)."""
        model, adapter = self._find(name)
        if adapter is None:
            return ModelCard(model.name, "", model.max_model_len)
        return ModelCard(name, model.name, model.max_model_len)

    def _find(self, name: str) -> tuple[ServedModel, str | None]:
        """The model `name` names, and the name of its adapter it names (None: none);
        UnknownModelError when it names neither."""
        if not name:
            return self.primary, None
        model = self._by_name.get(name)
        if model is not None:
            return model, None
        base, sep, adapter = name.partition(":")
        if sep:
            model = self._by_name.get(base)
            if model is not None and model.adapters is not None:
                model.adapters.check(adapter, model.name)
                return model, adapter
            if model is not None:
                raise UnknownModelError(f"model: {base!r} serves no LoRA adapters")
        for model in self:
            if model.adapters is not None and name in model.adapters:
                return model, name
        served = ", ".join(repr(n) for n in self._by_name)
        raise UnknownModelError(f"model: {name!r} is not served here (serving {served})")

    def cards(self) -> list[ModelCard]:
        """What /v1/models and ListModels list: each model, then its adapters (each
        under its own name, with the model as its parent)."""
        out = []
        for model in self:
            out.append(ModelCard(model.name, "", model.max_model_len))
            if model.adapters is not None:
                out += [
                    ModelCard(a, model.name, model.max_model_len) for a in model.adapters.names()
                ]
        return out

    def backends(self) -> list[Backend]:
        """Every version of every model served now."""
        return [b for m in self for b in m.backends()]

    def placements(self) -> list[Placement]:
        """The placement of every version served now (the metrics read their routers)."""
        return [b.placement for b in self.backends()]

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)


def build_catalog(specs: Iterable[ServedModelSpec], parts: SharedParts) -> ModelCatalog:
    """The catalog of the models `specs` names, the primary first, each served with the
    gateway's shared `parts`."""
    catalog = ModelCatalog()
    for spec in specs:
        catalog.add(spec.serve(parts))
    return catalog
