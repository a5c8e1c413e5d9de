"""The check that the registered workers' model is the one a caller (the gateway) holds,
in the parts the caller uses.

Lifecycle: `Router.expect_identity(identity, parts)` once at gateway start; afterwards
`IdentityCheck.check(view)` runs on every placement, and compares (and logs a mismatch)
only when the workers' published identity changed. A view
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
        self._checked: ModelIdentity | None = None
        self._error: str | None = None

    def check(self, view: MembershipView) -> None:
        """Raises ModelMismatchError naming the parts that differ."""
        with self._lock:
            if view.identity != self._checked:  # a new view mostly has the same identity
                self._checked, self._error = view.identity, self._verdict(view)
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
            "them tokens their model does not read the same way: give the gateway the "
            "workers' tokenizer, chat template and config"
        )
