"""The errors gpuport raises, and how they cross the wire.

Every error is a ``GpuportError``; catch that to catch them all. The tree::

    GpuportError
    ├── ConfigError              local settings are missing or broken (profile, config file, URL)
    ├── ConnectionFailed         the server could not be reached or spoken to
    │   ├── ServerUnreachable    nothing answers at that address and port
    │   └── TLSError             the encrypted channel could not be set up or trusted
    │       └── FingerprintMismatch  the server's certificate is not the one pinned at login
    ├── AuthenticationError      no token, an unknown token or a revoked one
    ├── PermissionDenied         a valid token, but not allowed to do this (admin only, not yours)
    ├── NotFound                 no such job, token, model ... (or not visible to you)
    ├── InvalidRequest           the request itself is wrong: bad name, size, path, option
    │   ├── IncompatibleVersions client and server Pythons cannot exchange pickles (sessions)
    │   └── Unsatisfiable        more than the server has at all (also a ResourceUnavailable)
    ├── Conflict                 the request clashes with the current state (name taken, ...)
    ├── ResourceUnavailable      asks for more than this server has or will give
    │   ├── Overloaded           too much waits already (a model's queue): retry later
    │   └── NotReady             what it needs is loading, restarting or failed (a model)
    ├── RemoteError              the user's own code failed on the server (carries its traceback)
    ├── WorkerDied               a session's worker process died in a call (signal, exit code, stderr)
    │   └── CallTimeout          a call ran past its timeout (also a ``TimeoutError``)
    ├── WaitTimeout              waited for longer than asked (also a ``TimeoutError``)
    └── ServerError              the server failed; its log says why

The server turns an error into a gRPC status (and an HTTP status) with ``ERROR_TABLE``; the client
turns it back with ``error_from_status``. The class name travels in the ``gpuport-error`` trailing
metadata, so the client rebuilds the exact class, not just the family the status code implies.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing's constant, without importing typing: every command loads this module
if TYPE_CHECKING:
    import grpc

__all__ = [
    "AuthenticationError",
    "CallTimeout",
    "ConfigError",
    "Conflict",
    "ConnectionFailed",
    "FingerprintMismatch",
    "GpuportError",
    "IncompatibleVersions",
    "InvalidRequest",
    "NotFound",
    "NotReady",
    "Overloaded",
    "PermissionDenied",
    "RemoteError",
    "ResourceUnavailable",
    "ServerError",
    "ServerUnreachable",
    "TLSError",
    "Unsatisfiable",
    "WaitTimeout",
    "WorkerDied",
]

ERROR_METADATA_KEY = "gpuport-error"


class GpuportError(Exception):
    """Root of every error gpuport raises."""


class ConfigError(GpuportError):
    """The local configuration is missing or unusable: no profile, a corrupted config file, a bad URL."""


class ConnectionFailed(GpuportError):
    """The server could not be reached or spoken to."""


class ServerUnreachable(ConnectionFailed):
    """Nothing answers at the server's address and port (refused, timed out, not a gpuport port)."""


class TLSError(ConnectionFailed):
    """The TLS channel to the server could not be set up or trusted."""


class FingerprintMismatch(TLSError):
    """The server presents a certificate other than the one pinned at ``gpuport login``.

    Either the server's certificate was regenerated, or someone sits between you and the server.
    ``pinned`` and ``presented`` hold the two ``sha256:`` fingerprints.
    """

    def __init__(self, message: str, *, pinned: str = "", presented: str = "") -> None:
        super().__init__(message)
        self.pinned = pinned
        self.presented = presented


class AuthenticationError(GpuportError):
    """The server does not accept the token: none was sent, it is unknown, or it was revoked."""


class PermissionDenied(GpuportError):
    """The token is valid but may not do this (an admin-only command, another user's object)."""


class NotFound(GpuportError):
    """The object asked for does not exist, or is not visible to this token."""


class InvalidRequest(GpuportError):
    """The request is malformed or its values are out of bounds; nothing was changed."""


class Conflict(GpuportError):
    """The request clashes with the server's current state (a name already taken, ...)."""


class ResourceUnavailable(GpuportError):
    """The request asks for more than the server has or will grant (GPUs, memory, quota, size)."""


class Overloaded(ResourceUnavailable):
    """Too much waits already (a model's queue is full): retry later (HTTP 429)."""


class NotReady(ResourceUnavailable):
    """What the request needs is loading, restarting or failed (a model): not the caller's fault,
    and no wait of the caller's own makes it ready (HTTP 503, gRPC UNAVAILABLE)."""


class Unsatisfiable(InvalidRequest, ResourceUnavailable):
    """The request asks for more than the server (or its largest node) has at all, so that no wait
    would grant it: more GPUs, CPUs or memory than exist (HTTP 422; clients do not retry it)."""


class IncompatibleVersions(InvalidRequest):
    """Client and server differ in Python minor version or cloudpickle major version, so that the
    functions and objects one pickles cannot be read by the other (sessions and remote functions)."""


class RemoteError(GpuportError):
    """The user's own code failed on the server.

    ``remote_type`` is the remote exception's type name, ``remote_traceback`` its traceback as text
    and ``exception`` the exception itself when it could be unpickled here (else None). A session call
    raises a subclass of both this and the original type where it can: ``except ZeroDivisionError``
    works as it would locally.
    """

    def __init__(
        self, message: str, *, remote_type: str = "", remote_traceback: str = "", exception: BaseException | None = None
    ) -> None:
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback
        self.exception = exception


class WorkerDied(GpuportError):
    """A session's worker process ended in the middle of a call: it crashed (a segfault), ran out of
    memory, exited, or was killed (over its GPU memory slice). ``exit_code`` is its exit code (None
    when unknown), ``signal`` the name of the signal that ended it ("SIGSEGV") or None, and
    ``stderr_tail`` the last lines it wrote to stderr. The session's values are lost;
    ``session.restart()`` starts a fresh worker.
    """

    def __init__(
        self, message: str, *, exit_code: int | None = None, signal: str | None = None, stderr_tail: str = ""
    ) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.signal = signal
        self.stderr_tail = stderr_tail


class CallTimeout(WorkerDied, TimeoutError):
    """A call ran past its ``timeout``: its worker was stopped (the session's values are lost)."""


class WaitTimeout(GpuportError, TimeoutError):
    """A wait (for a job to end, ...) lasted longer than its timeout; the thing waited for goes on."""


class ServerError(GpuportError):
    """The server failed to handle a request; the server's log says why."""


# class → (gRPC status, HTTP status). The one table both doors of the server use. The gRPC status is
# named (grpc.StatusCode.<name>): importing grpc costs a command-line tool 25 ms it may not need.
ERROR_TABLE: dict[type[GpuportError], tuple[str, int]] = {
    AuthenticationError: ("UNAUTHENTICATED", 401),
    PermissionDenied: ("PERMISSION_DENIED", 403),
    NotFound: ("NOT_FOUND", 404),
    InvalidRequest: ("INVALID_ARGUMENT", 400),
    Conflict: ("ALREADY_EXISTS", 409),
    ResourceUnavailable: ("RESOURCE_EXHAUSTED", 429),
    Overloaded: ("RESOURCE_EXHAUSTED", 429),
    NotReady: ("UNAVAILABLE", 503),
    Unsatisfiable: ("INVALID_ARGUMENT", 422),
    RemoteError: ("ABORTED", 500),
    WaitTimeout: ("DEADLINE_EXCEEDED", 504),
    ServerError: ("INTERNAL", 500),
}

_BY_NAME: dict[str, type[GpuportError]] = {cls.__name__: cls for cls in ERROR_TABLE}
_BY_CODE: dict[str, type[GpuportError]] = {}
for _cls, (_code, _) in ERROR_TABLE.items():
    _BY_CODE.setdefault(_code, _cls)  # a status code without a name: the first (most general) class


def status_for(error: GpuportError) -> tuple[grpc.StatusCode, int]:
    """Return the (gRPC status, HTTP status) for ``error``, by its nearest class in ``ERROR_TABLE``."""
    import grpc

    for cls in type(error).__mro__:
        if cls in ERROR_TABLE:
            code, http_status = ERROR_TABLE[cls]  # type: ignore[index]
            return getattr(grpc.StatusCode, code), http_status
    return grpc.StatusCode.INTERNAL, ERROR_TABLE[ServerError][1]


def error_from_status(code: grpc.StatusCode, message: str, error_name: str | None = None) -> GpuportError:
    """Rebuild the error a server sent: by class name when it names one we know, else by status code."""
    cls = _BY_NAME.get(error_name or "") or _BY_CODE.get(code.name) or ServerError
    return cls(message)


def error_from_name(error_name: str, message: str) -> GpuportError:
    """Rebuild an error a server sent by class name (its data-port channel), ServerError when unknown."""
    return (_BY_NAME.get(error_name) or ServerError)(message)
