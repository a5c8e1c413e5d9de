"""The models one gateway serves, by name.

Lifecycle: `add` adds the primary model first (`--model`, named by `--served-model-name`,
or by its path or the default model's name), then each of `--extra-models`, at start; the
catalog does not change after. `get(name)` resolves a request's `model` field (empty:
the primary) or raises UnknownModelError listing what is served.
"""

from __future__ import annotations

from collections.abc import Iterator

from services.common.status import UnknownModelError
from services.gateway.served_model import ServedModel


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
        """The model a request's `model` field names ("" or None: the primary)."""
        if not name:
            return self.primary
        model = self._by_name.get(name)
        if model is None:
            served = ", ".join(repr(n) for n in self._by_name)
            raise UnknownModelError(f"model: {name!r} is not served here (serving {served})")
        return model

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)
