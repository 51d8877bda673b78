"""Which tenant a request acts for: the one place both transports ask.

Memories belong to the caller's tenant: the tenant of its token (``auth.Principal``). A
token that is not bound to one tenant (an admin token, or any caller while authentication
is off) acts for ``DEFAULT_TENANT``, the tenant a namespace gets when it names none.
"""

from __future__ import annotations

from lmcache_svc.server.auth import Principal

DEFAULT_TENANT = "default"


def caller_tenant(principal: Principal) -> str:
    """The tenant whose memories ``principal`` reads and writes."""
    return principal.tenant if principal.tenant is not None else DEFAULT_TENANT
