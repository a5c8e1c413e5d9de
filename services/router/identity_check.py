"""The check that the registered workers' model is the one a caller (the gateway) holds,
in the parts the caller uses.

Lifecycle: `Router.expect_identity(identity, parts)` once at gateway start; afterwards
`IdentityCheck.check(view)` runs on every placement, and compares only when the
membership view changed (a view is immutable, so the last verdict holds for it). A view
whose workers published no identity (none registered yet, or workers of an older
release) passes: the model fingerprint still keeps KV and cache keys apart.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from engine.model_identity import IdentityPart, ModelIdentity, describe_difference
from services.common.status import ModelMismatchError
from services.router.membership import MembershipView

log = logging.getLogger(__name__)

#: What a gateway takes from its own copy of the model: token ids, the chat prompt, and
#: the context length and vocabulary size it validates requests against.
GATEWAY_PARTS = (IdentityPart.TOKENIZER, IdentityPart.CHAT_TEMPLATE, IdentityPart.CONFIG)


class IdentityCheck:
    def __init__(self, expected: ModelIdentity, parts: Sequence[IdentityPart], who: str) -> None:
        self.expected = expected
        self.parts = tuple(parts)
        self.who = who
        self._lock = threading.Lock()
        self._checked: MembershipView | None = None
        self._error: str | None = None

    def check(self, view: MembershipView) -> None:
        """Raises ModelMismatchError naming the parts that differ."""
        with self._lock:
            if view is not self._checked:
                self._checked, self._error = view, self._verdict(view)
                if self._error:
                    log.error("%s", self._error)
            error = self._error
        if error:
            raise ModelMismatchError(error)

    def _verdict(self, view: MembershipView) -> str | None:
        if view.identity is None:
            return None
        differ = self.expected.differences(view.identity, self.parts)
        if not differ:
            return None
        return (
            f"model: {describe_difference(differ, self.who, 'the workers')}; it would send "
            "them tokens their model does not read the same way: start both from the same "
            "model directory"
        )
