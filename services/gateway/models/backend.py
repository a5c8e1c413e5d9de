"""One version of a served model, as a gateway reaches it: the placement on the pool
namespace the version's workers register in (`services.router.keyspace.pool_namespace`),
an admission controller that reads the load signals of those workers alone, and the
gateway's keepers and conditional-disaggregation policy on them.

Lifecycle: made by `GatewayService.backend` at start (a model's unversioned pool) or when
a rollout first names the version (`ServedModel.ensure_version`); kept until the gateway
stops, which closes its admission and placement.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.flow.admission import Admission
from services.gateway.flow.prefill_site import SitePolicy
from services.gateway.stream.request_record import Keepers
from services.router.placement import Placement


@dataclass
class Backend:
    """One version of a model: where its requests are placed and admitted."""

    version: str  # "" for the unversioned pool
    placement: Placement
    admission: Admission
    keepers: Keepers  # the gateway's, with this version's placement
    sites: SitePolicy  # conditional disaggregation, on this version's pools
