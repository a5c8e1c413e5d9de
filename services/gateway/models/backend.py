"""One version of a served model, as a gateway reaches it: the placement on the pool
namespace the version's workers register in (`services.router.keyspace.pool_namespace`),
an admission controller that reads the load signals of those workers alone, and the
gateway's keepers and conditional-disaggregation policy on them.

Lifecycle: made by `SharedParts.backend` at start (a model's unversioned pool) or when
a rollout first names the version (`ServedModel.ensure_version`); kept until the gateway
stops, which closes its admission and placement.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.access.gate import Access
from services.gateway.access.usage_ledger import UsageLedger
from services.gateway.flow.admission import Admission
from services.gateway.flow.prefill_site import SitePolicy
from services.gateway.stream.record_book import RecordBook
from services.gateway.stream.request_record import Keepers, RequestRecord
from services.gateway.stream.worker_stubs import WorkerStubs
from services.router.placement import Placement


@dataclass
class Backend:
    """One version of a model: where its requests are placed and admitted."""

    version: str  # "" for the unversioned pool
    placement: Placement
    admission: Admission
    keepers: Keepers  # the gateway's, with this version's placement
    sites: SitePolicy  # conditional disaggregation, on this version's pools


@dataclass(frozen=True)
class SharedParts:
    """What every version of every model one gateway serves shares: the keys and quotas
    (`access`), the connections to workers (`stubs`), the book of live requests and the
    usage ledger (None: no Redis, or turned off)."""

    access: Access = field(default_factory=Access.open)
    stubs: WorkerStubs = field(default_factory=WorkerStubs)
    book: RecordBook[RequestRecord] = field(default_factory=RecordBook)
    ledger: UsageLedger | None = None

    def backend(self, version: str, placement: Placement, admission: Admission) -> Backend:
        """One version of a model, served with these keys, stubs and book."""
        keepers = Keepers(placement, self.access, self.stubs, self.book, self.ledger)
        # Routing's site policy is admission's, with its live queue lengths.
        return Backend(version, placement, admission, keepers, admission.capacity.sites)
