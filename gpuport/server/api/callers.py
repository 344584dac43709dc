"""Who is calling, on every port: a Bearer token, or else a client certificate the TLS layer verified.

gRPC gives the certificate in the call's auth context (on the port that takes client certificates);
the HTTP port puts it in the ASGI scope as the ASGI TLS extension says
(``scope["extensions"]["tls"]["client_cert_chain"]``, see ``with_client_certificate``).
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from gpuport.protocol.tls import fingerprint
from gpuport.server.services.auth import AuthService, Identity, NoCredentials

if TYPE_CHECKING:
    from gpuport.server.services.serving import ServingService


def grpc_credentials(context: grpc.aio.ServicerContext) -> tuple[str | None, str | None]:
    """What a gRPC call authenticates with: its ``authorization`` metadata, else the fingerprint of
    its client certificate (one of the two, or neither)."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return str(value), None
    pem = context.auth_context().get("x509_pem_cert")
    return None, fingerprint(pem[0]) if pem else None


def grpc_caller(auth: AuthService, context: grpc.aio.ServicerContext) -> Identity:
    """The identity behind a gRPC call's ``authorization`` metadata, or its client certificate."""
    return auth.authenticate(*grpc_credentials(context))


def asgi_caller(auth: AuthService, scope: dict[str, Any], authorization: str | None) -> Identity:
    """The identity behind an HTTP request's ``Authorization`` value, or its client certificate."""
    if authorization:
        return auth.authenticate(authorization)
    tls = scope.get("extensions", {}).get("tls") or {}
    chain = tls.get("client_cert_chain") or ()
    return auth.authenticate(None, tls.get("gpuport.fingerprint") if chain else None)


def model_caller(authenticate: Callable[[], Identity], serving: ServingService, name: str) -> Identity:
    """``authenticate()``'s caller, for a request about model ``name`` that is not public (or not
    there): a caller that sent no credentials at all is told the model is unknown, as a missing one
    is, so a private model is no more known to it than a missing one; a wrong token is still refused."""
    try:
        return authenticate()
    except NoCredentials:
        raise serving.unknown_to_anonymous(name) from None


class _WithClientCertificate:
    """An ASGI app that tells ``app`` the connection's client certificate in every request's scope."""

    def __init__(self, app: Any, der: bytes) -> None:
        self.app = app
        self.tls = {
            "client_cert_chain": [ssl.DER_cert_to_PEM_cert(der)],
            "gpuport.fingerprint": fingerprint(der),
        }

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        scope.setdefault("extensions", {})["tls"] = self.tls
        await self.app(scope, receive, send)


def with_client_certificate(protocol_class: type) -> type:
    """A subclass of uvicorn's HTTP protocol ``protocol_class`` whose connections, once TLS has
    verified a client certificate, put it in their requests' scope (uvicorn itself does not)."""

    class Protocol(protocol_class):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            tls = transport.get_extra_info("ssl_object")
            der = tls.getpeercert(binary_form=True) if tls is not None else None
            if der:
                self.app = _WithClientCertificate(self.app, der)

    return Protocol
