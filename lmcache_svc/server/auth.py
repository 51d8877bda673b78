"""Bearer-token check shared by the HTTP and gRPC transports.

Both pass the raw ``Authorization`` header (HTTP) or ``authorization`` metadata value (gRPC)
and the configured token; ``None`` as the token means authentication is off.
"""

from __future__ import annotations

import hmac

from lmcache_svc.errors import Unauthenticated

_SCHEME = "bearer"


def check_bearer(header_value: str | None, token: str | None) -> None:
    """Raise ``Unauthenticated`` unless ``header_value`` is ``Bearer <token>``.

    The token comparison is constant-time (``hmac.compare_digest`` on UTF-8 bytes).
    """
    if token is None:
        return
    if not header_value:
        raise Unauthenticated("missing 'Authorization: Bearer <token>' header")
    scheme, _, presented = header_value.strip().partition(" ")
    if scheme.lower() != _SCHEME or not presented.strip():
        raise Unauthenticated("the Authorization header must be 'Bearer <token>'")
    if not hmac.compare_digest(presented.strip().encode("utf-8"), token.encode("utf-8")):
        raise Unauthenticated("invalid bearer token")
