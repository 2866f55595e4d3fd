"""Bearer-token authentication and role checks.

Tokens are held only as sha256 digests. A presented token is hashed and compared against
*every* configured digest with ``hmac.compare_digest`` (no early exit), so response time
does not reveal how much of a token matched or which entry it was. Token values are never
logged; the principal's *name* is what appears in logs and action triggers. A credential
longer than ``MAX_TOKEN_CHARS`` is refused before it is hashed or sent anywhere (no token
the controller issues or accepts is that long; a projected service-account token is ~1 KB).

Roles: ``agent`` may only post reports; ``viewer`` may read; ``operator`` may read and write.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable
from dataclasses import dataclass

from controller.errors import Forbidden, Unauthenticated
from controller.settings import Role, TokenConfig

READ_ROLES: frozenset[Role] = frozenset({"viewer", "operator"})
WRITE_ROLES: frozenset[Role] = frozenset({"operator"})
REPORT_ROLES: frozenset[Role] = frozenset({"agent"})


@dataclass(frozen=True, slots=True)
class Principal:
    name: str
    role: Role | None  # None: anonymous read (allow_anonymous_read)
    #: The one node an agent credential may speak for (``None``: a shared agent token).
    node: str | None = None


ANONYMOUS = Principal(name="anonymous", role=None)
MISSING_TOKEN = "missing bearer token (Authorization: Bearer <token>)"
#: Longest ``Authorization`` value looked at: per-node tokens are 47 characters, configured
#: ones whatever the operator chose, Kubernetes' projected tokens ~1 KB (a JWT with many
#: claims a few KB). Anything longer is 401 at once: never hashed, never sent to a
#: TokenReview (whose cost an unauthenticated client would otherwise choose).
MAX_TOKEN_CHARS = 8192
TOO_LONG = f"bearer token longer than {MAX_TOKEN_CHARS} characters; no such token exists"


#: The only blanks around a credential that are not part of it: HTTP's optional whitespace
#: (RFC 9110 ``OWS``, space and tab). ``str.strip()`` also drops U+00A0, U+0085 and
#: ``\x1c``..``\x1f``, which a (latin-1) header value can carry: ``Bearer TOKEN\xa0`` was
#: taken as ``TOKEN``, two different header values as one credential.
OWS = " \t"
#: A credential as RFC 6750 spells it (``b64token``, widened to printable ASCII as the
#: configured tokens are: ``controller.settings.TokenConfig``). Issued tokens, configured
#: ones and Kubernetes' JWTs all fit; anything else is no token of ours.
_CREDENTIAL = re.compile(r"[!-~]+")
NOT_BEARER = "Authorization header must be 'Bearer <token>'"
BAD_CREDENTIAL = (
    "unknown token: a bearer token is one word of printable ASCII (no spaces, no other "
    "characters); check the token configured for this client"
)


def bearer_credential(authorization: str) -> str:
    """The token in an ``Authorization`` value, the one rule every reader of the header
    uses; raises ``Unauthenticated`` for a missing or malformed one."""
    if not authorization.strip(OWS):
        raise Unauthenticated(MISSING_TOKEN)
    check_length(authorization)
    scheme, _, credential = authorization.partition(" ")
    credential = credential.strip(OWS)
    if scheme.lower() != "bearer" or not credential:
        raise Unauthenticated(NOT_BEARER)
    if not _CREDENTIAL.fullmatch(credential):
        raise Unauthenticated(BAD_CREDENTIAL)
    return credential


def check_length(authorization: str) -> None:
    """Raise ``Unauthenticated`` for an ``Authorization`` value no credential can have."""
    if len(authorization) > MAX_TOKEN_CHARS + len("Bearer "):
        raise Unauthenticated(TOO_LONG)


class Authenticator:
    def __init__(self, tokens: list[TokenConfig], *, allow_anonymous_read: bool) -> None:
        self._entries = [(bytes.fromhex(t.digest()), t.name, t.role) for t in tokens]
        self.allow_anonymous_read = allow_anonymous_read
        #: Credentials kept elsewhere (per-node tokens, TokenReview answers), by sha256 digest.
        self._lookups: list[Callable[[bytes], Principal | None]] = []

    def add_lookup(self, lookup: Callable[[bytes], Principal | None]) -> None:
        self._lookups.append(lookup)

    def identify(self, authorization: str | None) -> Principal | None:
        """The principal for an ``Authorization`` header; ``None`` when there is none."""
        if authorization is None:
            return None
        return self.principal(authorization)

    def principal(self, authorization: str) -> Principal:
        """The principal for a present ``Authorization`` header; raises ``Unauthenticated``
        for anything else, an empty header included (present but carrying no token: it
        is not the absent header that anonymous reads allow)."""
        digest = hashlib.sha256(bearer_credential(authorization).encode()).digest()
        found: Principal | None = None
        for expected, name, role in self._entries:
            if hmac.compare_digest(digest, expected) and found is None:
                found = Principal(name=name, role=role)
        for lookup in self._lookups:
            if found is None:
                found = lookup(digest)
        if found is None:
            raise Unauthenticated("unknown token; check the token configured for this client")
        return found

    def authorize(
        self, authorization: str | None, allowed: frozenset[Role], *, read: bool
    ) -> Principal:
        principal = self.identify(authorization)
        if principal is None:
            if read and self.allow_anonymous_read:
                return ANONYMOUS
            raise Unauthenticated(MISSING_TOKEN)
        if principal.role not in allowed:
            raise Forbidden(
                f"token {principal.name!r} has role {principal.role!r}; "
                f"this needs one of: {', '.join(sorted(allowed))}"
            )
        return principal
