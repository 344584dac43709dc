"""Tokens and identities: who is calling, and may they do this.

A token is ``gp_`` + 256 random bits, shown once when created. The server keeps only its SHA-256
(tokens are random, so a slow password hash would add nothing but latency to every call). Each
token names one user; every object a user creates is owned by that name, and only its owner or an
admin sees it.

Names are unique regardless of case: ``Bob`` is refused while ``bob`` is a user (a token of that name,
valid or revoked), so that no two users differ by case alone in listings, logs and quotas. A state dir
from before this rule may hold such names already; they keep working as they are.

A token may come with a client certificate signed by the server's client CA (``server/tls.py``):
the TLS layer checks the signature, and the certificate's fingerprint, kept with the token, names
the user. It is revoked with its token.

A one-time login code (``LoginCodes``, for ``gpuport dashboard``) stands for the credential it was
made with, for a minute, once: it is checked again when used, so a revoked token's codes stop working.
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpuport.defaults import DEFAULT_LOGIN_LINK_SECONDS, MAX_NAME_LENGTH, TOKEN_BYTES, TOKEN_PREFIX
from gpuport.protocol.errors import (
    AuthenticationError,
    Conflict,
    InvalidRequest,
    NotFound,
    PermissionDenied,
)
from gpuport.server.store import Store

log = logging.getLogger(__name__)

_NAME_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._@-]{{0,{MAX_NAME_LENGTH - 1}}}")
# The name of the admin token made on first start.
FIRST_ADMIN = "admin"
# What a token may be limited to: "" (none: all its user may do), "metrics" (a scrape token).
SCOPES = ("", "metrics")
# Login codes a user may hold unused at once (a new one past that ends their oldest), and how long
# a used or expired one is remembered, to tell whoever brings it back which it was; at most
# _CODES_KEPT codes are remembered in all, the oldest forgotten first.
_CODES_PER_USER = 20
_SPENT_CODE_SECONDS = 600.0
_CODES_KEPT = 10_000


class NoCredentials(AuthenticationError):
    """The caller sent no credentials at all (no token, no client certificate): an anonymous caller,
    which some routes answer as they answer anyone (a model that is not public is unknown to it)."""


@dataclass(frozen=True)
class Identity:
    """The caller behind a token."""

    name: str
    admin: bool
    scope: str = ""  # "metrics": a scrape token, for GET /metrics only

    def require_admin(self, action: str) -> None:
        if not self.admin:
            raise PermissionDenied(f"{action} needs an admin token; '{self.name}' is not an admin")


@dataclass(frozen=True)
class TokenRecord:
    name: str
    admin: bool
    created_at: float
    revoked_at: float | None
    scope: str = ""


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _record(row) -> TokenRecord:  # type: ignore[no-untyped-def]
    return TokenRecord(row["name"], bool(row["admin"]), row["created_at"], row["revoked_at"], row["scope"])


class AuthService:
    def __init__(self, store: Store, no_users_because: str = "") -> None:
        """``no_users_because``: why jobs cannot be isolated here, so that every token must be an
        admin token (any job could act as the server); empty where they are isolated."""
        self._store = store
        self._no_users_because = no_users_because
        # Called with a user's name when their token is revoked: what holds a connection open for
        # them (data-port channels, gRPC streams) closes it at once.
        self.revoked_hooks: list[Callable[[str], None]] = []
        # token hash → identity, for valid tokens only; emptied for a name when it is revoked.
        self._cache: dict[str, Identity] = {}

    def create_first_admin(self) -> str | None:
        """On a server with no tokens at all, make the first admin token and return it; else None."""
        if self._store.query_one("SELECT 1 FROM tokens LIMIT 1"):
            return None
        return self._insert(FIRST_ADMIN, admin=True)[1]

    def create_recovery_admin(self) -> str:
        """Make one more admin token, named ``admin-<n>``, for whoever starts the server with
        ``--new-admin-token``: access to the state dir is full control anyway, so this is the way
        back in when every admin token was lost."""
        taken = {r["name"] for r in self._store.query("SELECT name FROM tokens WHERE revoked_at IS NULL")}
        number = 2
        while f"{FIRST_ADMIN}-{number}" in taken or self._same_but_case(f"{FIRST_ADMIN}-{number}"):
            number += 1
        return self._insert(f"{FIRST_ADMIN}-{number}", admin=True)[1]

    def authenticate(self, authorization: str | None, client_cert: str | None = None, scope: str = "") -> Identity:
        """Return the identity behind an ``Authorization`` value (``Bearer gp_...``), or without one,
        behind ``client_cert``: the ``sha256:...`` fingerprint of the client certificate the TLS layer
        verified against the client CA. A scoped token (a scrape token) is taken only where ``scope``
        names its scope.

        Raises ``AuthenticationError`` saying whether the token was missing, malformed, unknown or
        revoked, ``PermissionDenied`` for a scoped token used elsewhere.
        """
        if not authorization:
            if client_cert:
                return self._scoped(self._by_certificate(client_cert), scope)
            raise NoCredentials("no token was sent")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token.startswith(TOKEN_PREFIX):
            raise AuthenticationError("the token is malformed: expected 'Bearer gp_...'")
        return self._scoped(self._identity("hash", _hash(token), "the token", "the token '{name}'"), scope)

    @staticmethod
    def _scoped(identity: Identity, scope: str) -> Identity:
        if identity.scope and identity.scope != scope:
            raise PermissionDenied(
                f"'{identity.name}' is a scrape token: it reads GET /metrics and nothing else — use a user's token"
            )
        return identity

    def _by_certificate(self, fingerprint: str) -> Identity:
        return self._identity(
            "cert_fingerprint", fingerprint, "the client certificate", "the client certificate of token '{name}'"
        )

    def _identity(self, column: str, value: str, unknown: str, revoked: str) -> Identity:
        """The identity of the token whose ``column`` is ``value`` (a token's hash, or its client
        certificate's fingerprint), from the cache of valid ones or the store."""
        key = f"{column}:{value}"
        identity = self._cache.get(key)
        if identity is not None:
            return identity
        row = self._store.query_one(f"SELECT name, admin, revoked_at, scope FROM tokens WHERE {column} = ?", (value,))
        if row is None:
            raise AuthenticationError(f"{unknown} is not known to this server")
        if row["revoked_at"] is not None:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(row["revoked_at"]))
            raise AuthenticationError(f"{revoked.format(name=row['name'])} was revoked on {when}")
        identity = Identity(row["name"], bool(row["admin"]), row["scope"])
        self._cache[key] = identity
        return identity

    def create(
        self, caller: Identity, name: str, admin: bool, cert_fingerprint: str | None = None, scope: str = ""
    ) -> tuple[TokenRecord, str]:
        """Make a token for user ``name``; returns its record and the token, which is never shown again.
        ``cert_fingerprint``: a client certificate that stands for the token (see ``check_create``).
        ``scope`` "metrics": a scrape token, which reads ``GET /metrics`` and nothing else."""
        self.check_create(caller, name, admin, scope)
        return self._insert(name, admin, cert_fingerprint, scope)

    def check_create(self, caller: Identity, name: str, admin: bool, scope: str = "") -> None:
        """Raise what ``create`` would for these arguments (before a client certificate is made for it)."""
        caller.require_admin("creating tokens")
        if scope not in SCOPES:
            raise InvalidRequest(f"unknown token scope {scope!r}: {', '.join(repr(s) for s in SCOPES)}")
        if scope and admin:
            raise InvalidRequest("a scrape token reads metrics only: it cannot be an admin token too")
        if not admin and not scope and self._no_users_because:
            raise InvalidRequest(
                f"this server cannot isolate jobs ({self._no_users_because}), so a job could act as the "
                "server itself: every token is an admin token here. Install what is missing and restart "
                "the server, or create an admin token (--admin) for someone you trust with the server"
            )
        if not _NAME_RE.fullmatch(name):  # not match(): its $ also matches before a final newline
            raise InvalidRequest(
                f"invalid token name {name!r}: use 1 to {MAX_NAME_LENGTH} letters, digits, '.', '_', '@' or '-', "
                "starting with a letter or digit"
            )
        self._check_free(name)

    def _check_free(self, name: str) -> None:
        """Raise ``Conflict`` when ``name`` is taken: by a valid token of that name, or by a user whose
        name differs from it only by case."""
        if self._store.query_one("SELECT 1 FROM tokens WHERE name = ? AND revoked_at IS NULL", (name,)):
            raise Conflict(f"a token named '{name}' already exists — pick another name, or revoke it first")
        other = self._same_but_case(name)
        if other is not None:
            raise Conflict(
                f"the name '{name}' is taken by the user '{other}': token and user names are the same regardless "
                f"of case — pick another name, or create '{other}' to give that user a new token"
            )

    def _same_but_case(self, name: str) -> str | None:
        """A user's name (a token's, valid or revoked) that differs from ``name`` only by case, where
        no token was ever named exactly ``name``: the user ``name`` would be mistaken for."""
        rows = self._store.query(
            "SELECT DISTINCT name FROM tokens WHERE name = ? COLLATE NOCASE ORDER BY name", (name,)
        )
        spellings = [r["name"] for r in rows]
        return spellings[0] if spellings and name not in spellings else None

    def _insert(
        self, name: str, admin: bool, cert_fingerprint: str | None = None, scope: str = ""
    ) -> tuple[TokenRecord, str]:
        token = TOKEN_PREFIX + secrets.token_urlsafe(TOKEN_BYTES)
        now = time.time()
        with self._store.transaction() as db:
            self._check_free(name)  # again, in the transaction: no other token can come between
            db.execute(
                "INSERT INTO tokens (name, hash, admin, created_at, cert_fingerprint, scope) VALUES (?, ?, ?, ?, ?, ?)",
                (name, _hash(token), int(admin), now, cert_fingerprint, scope),
            )
        return TokenRecord(name, admin, now, None, scope), token

    def list(self, caller: Identity, include_revoked: bool = False) -> list[TokenRecord]:
        caller.require_admin("listing tokens")
        where = "" if include_revoked else "WHERE revoked_at IS NULL"
        rows = self._store.query(f"SELECT * FROM tokens {where} ORDER BY created_at, id")
        return [_record(r) for r in rows]

    def revoke(self, caller: Identity, name: str) -> TokenRecord:
        """Revoke the valid token named ``name``; it stops working at once, on every connection."""
        caller.require_admin("revoking tokens")
        row = self._store.query_one("SELECT * FROM tokens WHERE name = ? AND revoked_at IS NULL", (name,))
        if row is None:
            spelled = self._store.query_one(
                "SELECT name FROM tokens WHERE name = ? COLLATE NOCASE AND revoked_at IS NULL ORDER BY name", (name,)
            )
            meant = f" — did you mean '{spelled['name']}'?" if spelled else ""
            raise NotFound(f"no valid token named '{name}'{meant} (`gpuport token list` shows them)")
        if row["admin"]:
            admins = self._store.query("SELECT COUNT(*) FROM tokens WHERE admin = 1 AND revoked_at IS NULL")[0][0]
            if admins <= 1:
                raise Conflict(
                    f"'{name}' is the last admin token; without it nobody could manage this server — "
                    "create another admin token first"
                )
        now = time.time()
        with self._store.transaction() as db:
            db.execute("UPDATE tokens SET revoked_at = ? WHERE id = ?", (now, row["id"]))
        self._cache = {h: i for h, i in self._cache.items() if i.name != name}
        for hook in self.revoked_hooks:
            try:
                hook(name)
            except Exception:  # one hook's failure must not keep the others from closing what they hold
                log.exception("closing what '%s' held open failed", name)
        return TokenRecord(row["name"], bool(row["admin"]), row["created_at"], now, row["scope"])


@dataclass
class _LoginCode:
    user: str
    authorization: str | None = field(repr=False)  # the credential it stands for: a Bearer value,
    cert: str | None  # or a client certificate's fingerprint
    expires: float
    used: bool = False


class LoginCodes:
    """One-time codes that log a browser in to the dashboard (``gpuport dashboard``): each stands for
    the credential it was made with, for ``seconds``, once. Kept in memory by their hash (a restart
    forgets them); the code itself is only ever in the reply that made it and the request that uses it.
    """

    def __init__(self, auth: AuthService, seconds: float = DEFAULT_LOGIN_LINK_SECONDS) -> None:
        self._auth = auth
        self.seconds = seconds
        self._codes: dict[str, _LoginCode] = {}  # hash → code, oldest first

    def create(self, identity: Identity, authorization: str | None, cert: str | None = None) -> str:
        """A new code for ``identity``, who was authenticated with ``authorization`` (or else the
        client certificate ``cert``)."""
        now = time.time()
        for key in [k for k, c in self._codes.items() if c.expires + _SPENT_CODE_SECONDS < now]:
            del self._codes[key]
        theirs = [k for k, c in self._codes.items() if c.user == identity.name and not c.used and c.expires >= now]
        for key in theirs[: max(0, len(theirs) + 1 - _CODES_PER_USER)]:
            del self._codes[key]
        while len(self._codes) >= _CODES_KEPT:
            del self._codes[next(iter(self._codes))]
        code = secrets.token_urlsafe(32)
        self._codes[_hash(code)] = _LoginCode(identity.name, authorization, cert, now + self.seconds)
        return code

    def redeem(self, code: str) -> tuple[Identity, str | None, str | None]:
        """Use ``code``, once: the identity it stands for and its credential (authorization, cert).

        Raises ``AuthenticationError`` for a code that is unknown, used already or expired, or whose
        token was revoked since.
        """
        found = self._codes.get(_hash(code))
        again = "run `gpuport dashboard` again for a new one"
        if found is None:
            raise AuthenticationError(f"this login link is not known to this server (a restart forgets them): {again}")
        if found.used:
            raise AuthenticationError(f"this login link was used already, and each logs in once: {again}")
        if found.expires < time.time():
            raise AuthenticationError(f"this login link expired (each lasts {self.seconds:.0f} s): {again}")
        found.used = True
        return self._auth.authenticate(found.authorization, found.cert), found.authorization, found.cert
