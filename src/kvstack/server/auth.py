"""API keys -> tenants. Each key is a tenant, and tenants never share prefix-cache blocks.

A request's cache salt is sha256(tenant key, user cache_salt): block hashes include it, so one
tenant's prompt can never hit another tenant's cached prefix. Without configured keys every
request is the one anonymous tenant, whose salt is the user's cache_salt alone.
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


@dataclass(frozen=True)
class Tenant:
    key: str  # "" for the anonymous tenant

    def cache_salt(self, user_salt: str | None) -> str | None:
        if not self.key:
            return user_salt
        # A separator keeps ("ab", "c") and ("a", "bc") apart.
        return hashlib.sha256(f"{self.key}\x00{user_salt or ''}".encode()).hexdigest()


class KeyRing:
    def __init__(self, api_keys: Sequence[str]) -> None:
        keys = [k for k in api_keys if k]
        if len(keys) != len(api_keys):
            raise InvalidRequestError("an API key is empty; give non-empty keys")
        self._keys = [k.encode() for k in dict.fromkeys(keys)]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

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
