"""Who looks at the page and what they may read.

A block's tenant is the cache salt of the request that published (or holds) it. A tenant
reads the text, hashes and request ids of its own blocks only; everyone else's blocks show
as anonymous cells of the pool map (state and tier marks, nothing that derives from their
tokens). The admin (`--admin-key`) reads everything, with each block's tenant label.
Requests sent with a `cache_salt` of their own have another salt, so they stay anonymous to
their tenant's page too: hiding is the safe side of that mistake.
"""

from __future__ import annotations

from dataclasses import dataclass

ADMIN, TENANT, OPEN = "admin", "tenant", "open"


@dataclass(frozen=True)
class Viewer:
    role: str  # ADMIN, TENANT (a key of a server with keys) or OPEN (a server without keys)
    label: str  # shown on the page: "admin", the tenant id, or "public"
    salt: str | None  # the cache salt of this viewer's own requests (the playground's too)

    @property
    def admin(self) -> bool:
        return self.role == ADMIN

    def owns(self, cache_salt: str | None) -> bool:
        """May this viewer read blocks and requests with this cache salt?"""
        return self.role == ADMIN or cache_salt == self.salt

    def public(self) -> dict[str, str]:
        return {"role": self.role, "label": self.label}
