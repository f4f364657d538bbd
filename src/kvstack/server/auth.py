"""API keys -> tenants. Each key is a tenant, and tenants never share prefix-cache blocks.

A request's cache salt is sha256(tenant key, user cache_salt): block hashes include it, so one
tenant's prompt can never hit another tenant's cached prefix. Without configured keys every
request is the one anonymous tenant, whose salt is the user's cache_salt alone.

The admin key (`--admin-key`) is not an API key: it opens the live view (`/ui`) on everyone's
blocks. Its own playground requests are a tenant of their own.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from kvstack.errors import InvalidRequestError
from kvstack.server.errors import ApiError
from kvstack.ui.access import ADMIN, OPEN, TENANT, Viewer


@dataclass(frozen=True)
class Tenant:
    key: str  # "" for the anonymous tenant

    def cache_salt(self, user_salt: str | None) -> str | None:
        if not self.key:
            return user_salt
        # A separator keeps ("ab", "c") and ("a", "bc") apart.
        return hashlib.sha256(f"{self.key}\x00{user_salt or ''}".encode()).hexdigest()


def tenant_id(tenant: Tenant) -> str:
    """A tenant's id in the semantic cache, its admin route and the live view: never the API
    key itself."""
    if not tenant.key:
        return "public"
    return "t-" + hashlib.sha256(tenant.key.encode()).hexdigest()[:16]


class KeyRing:
    def __init__(self, api_keys: Sequence[str], admin_key: str | None = None) -> None:
        keys = [k for k in api_keys if k]
        if len(keys) != len(api_keys):
            raise InvalidRequestError("an API key is empty; give non-empty keys")
        if admin_key is not None and not admin_key:
            raise InvalidRequestError("the admin key is empty; give a non-empty key")
        if admin_key is not None and admin_key in keys:
            raise InvalidRequestError("the admin key is also an API key; give it a key of its own")
        self._keys = [k.encode() for k in dict.fromkeys(keys)]
        self._admin = admin_key.encode() if admin_key else None

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def viewer(self, presented: str | None) -> Viewer | None:
        """Who a presented key shows the live view to: the admin, a tenant, or (without API
        keys) the open server's public; None for a key that is no one's."""
        if presented and self._admin is not None and hmac.compare_digest(
                self._admin, presented.encode()):
            admin = Tenant(self._admin.decode())
            return Viewer(ADMIN, "admin", admin.cache_salt(None))
        tenant = self.tenant(presented)
        if tenant is None:
            return None
        if not tenant.key:
            return Viewer(OPEN, "public", None)
        return Viewer(TENANT, tenant_id(tenant), tenant.cache_salt(None))

    def labels(self) -> dict[str | None, str]:
        """Each tenant's cache salt (without a user cache_salt) -> its id, for the admin."""
        labels: dict[str | None, str] = {None: "public"}
        for key in self._keys:
            tenant = Tenant(key.decode())
            labels[tenant.cache_salt(None)] = tenant_id(tenant)
        if self._admin is not None:
            labels[Tenant(self._admin.decode()).cache_salt(None)] = "admin"
        return labels

    def tenant(self, presented: str | None) -> Tenant | None:
        """The tenant of a presented key, or None; every key is compared in constant time."""
        if not self._keys:
            return Tenant("")
        if not presented:
            return None
        given = presented.encode()
        match = None
        for key in self._keys:  # no early exit: timing must not tell which key came close
            if hmac.compare_digest(key, given):
                match = key
        return Tenant(match.decode()) if match is not None else None


def presented_key(request: Request) -> str | None:
    """`Authorization: Bearer K` (OpenAI SDK) or `x-api-key: K` (Anthropic SDK)."""
    auth = request.headers.get("authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.headers.get("x-api-key") or None


async def authenticate(request: Request) -> Tenant:
    """FastAPI dependency: the request's tenant, or a 401 in the API's shape."""
    ring: KeyRing = request.app.state.kvstack.keys
    key = presented_key(request)
    tenant = ring.tenant(key)
    if tenant is None:
        what = "no API key given" if not key else "the API key is not valid"
        raise ApiError(401, f"{what}; send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                       code="invalid_api_key")
    return tenant


# A route parameter of this type requires a valid key and receives its tenant.
AuthTenant = Annotated[Tenant, Depends(authenticate)]
