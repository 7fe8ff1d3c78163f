"""Bearer API-key check, a router dependency of every guarded route.

Open routes (/health, /metrics, /version) do not take it. Keys are compared with
`hmac.compare_digest` against every configured key, so timing does not reveal which key
(or how much of one) matched.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from plait.server.errors import APIError
from plait.server.state import get_state

MISSING_KEY = ("You didn't provide an API key. You need to provide your API key in an "
               "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
WRONG_KEY = "Incorrect API key provided."
_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def require_api_key(request: Request) -> None:
    """Raise 401 unless no key is configured or the request carries a configured one."""
    keys = get_state(request).settings.api_keys
    if not keys:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise APIError(401, MISSING_KEY, headers=_CHALLENGE)
    given = token.encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key.encode())
    if not matched:
        raise APIError(401, WRONG_KEY, code="invalid_api_key", headers=_CHALLENGE)
