"""The prediction protocols over HTTP, on the server's HTTP port, behind the same Bearer tokens.

KServe v2 (the Open Inference Protocol, as Triton serves it) under ``/v2``, with JSON tensors and the
binary tensor data extension; TensorFlow Serving's REST API under ``/v1/models``. Errors come out as
each protocol has them: ``{"error": "message"}`` with 400 (bad input), 404 (unknown model or version),
401/403, 413 (over the size limit), 503 (a model still loading or failed) or 500.

The predictions themselves (``POST .../infer`` and ``POST ...:predict``) are answered by
``Predictions``, a plain ASGI app in front of FastAPI's: a request there is a hot path, and FastAPI's
middleware, routing and request objects cost a small prediction as much as its own decoding. The
other routes (health, metadata, status) are FastAPI's, with its docs.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import zlib
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Any

import numpy as np
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from gpuport._version import __version__
from gpuport.defaults import MAX_INFER_BYTES
from gpuport.protocol.datatypes import TF_NAMES, numpy_dtype, tf_enum
from gpuport.protocol.errors import (
    AuthenticationError,
    GpuportError,
    InvalidRequest,
    NotFound,
    ServerError,
    status_for,
)
from gpuport.server.api import openapi
from gpuport.server.api.callers import asgi_caller, model_caller
from gpuport.server.app import ServerApp
from gpuport.server.services.auth import Identity
from gpuport.server.services.serving import DeploymentRecord, Endpoint, message_for, version_number
from gpuport.server.serving import kserve_rest, tfs_rest, triton

_HEADER_LENGTH = b"inference-header-content-length"  # as ASGI gives header names: lower case

log = logging.getLogger(__name__)


def _status(error: GpuportError) -> int:
    """The HTTP status of ``error`` as the prediction protocols answer it."""
    if isinstance(error, (_TooLarge, _Unsupported)):
        return 413 if isinstance(error, _TooLarge) else 415
    return status_for(error)[1]  # NotReady (loading, failed, restarting): 503; Overloaded: 429


def protocol_error(error: Exception) -> JSONResponse:
    """``error`` as the prediction protocols answer it: ``{"error": "message"}`` with their status."""
    if not isinstance(error, GpuportError):
        raise error
    return JSONResponse({"error": str(error)}, status_code=_status(error))


def _caller(request: Request) -> Identity:
    server: ServerApp = request.app.state.gpuport
    return asgi_caller(server.auth, request.scope, request.headers.get("authorization"))


def _caller_if_any(request: Request) -> Identity | None:
    """The caller where it sent valid credentials, else None (an open route's anonymous caller)."""
    try:
        return _caller(request)
    except AuthenticationError:
        return None


class _Unsupported(InvalidRequest):
    """Answered 415."""


class _TooLarge(InvalidRequest):
    def __init__(self, size: int) -> None:
        super().__init__(
            f"request of {size} bytes is over the limit of {MAX_INFER_BYTES} bytes for a prediction: send fewer "
            "rows per request"
        )


def _answered(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """Authenticate the caller (unless the model the URL names is public), then run ``handler``; a
    GpuportError becomes the protocol's error."""

    @functools.wraps(handler)
    async def answer(request: Request, **params: str) -> Response:
        try:
            name = request.path_params.get("name")
            serving = _server(request).serving
            if name is None:
                _caller(request)
            else:
                try:
                    public = serving.is_public(name, _version(request))
                except NotFound:
                    public = False  # an unknown version or label is told to callers with credentials only
                if not public:
                    model_caller(lambda: _caller(request), serving, name)
            return await handler(request, **params)
        except GpuportError as e:
            return protocol_error(e)

    return answer


def _anyone(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """Run ``handler`` for any caller, with or without credentials: health, as probes ask it."""

    @functools.wraps(handler)
    async def answer(request: Request, **params: str) -> Response:
        try:
            return await handler(request, **params)
        except GpuportError as e:
            return protocol_error(e)

    return answer


def _server(request: Request) -> ServerApp:
    return request.app.state.gpuport  # type: ignore[no-any-return]


def _version(request: Request) -> int:
    """The version a URL names: /versions/{version}, /labels/{label} (TF Serving's), or 0 (the latest)."""
    label = request.path_params.get("label")
    if label is not None:
        return _server(request).serving.labelled(request.path_params["name"], label)
    return version_number(request.path_params.get("version", ""))


def _find(request: Request, name: str) -> DeploymentRecord:
    """The deployment a URL names: /models/{name}[/versions/{version} | /labels/{label}]."""
    return _server(request).serving.find(name, _version(request))


def add_serving_routes(api: FastAPI) -> None:
    kserve: list[str | Enum] = ["KServe v2"]
    tfs: list[str | Enum] = ["TensorFlow Serving"]

    # ---- KServe v2 ------------------------------------------------------------------------------

    @api.get(
        "/v2",
        summary="KServe v2: server metadata (needs no credentials)",
        tags=kserve,
        responses={200: {"model": openapi.ServerMetadata}},
    )
    @_anyone
    async def server_metadata(request: Request) -> Response:
        return JSONResponse({"name": "gpuport", "version": __version__, "extensions": list(triton.EXTENSIONS)})

    @api.get(
        "/v2/health/live",
        summary="KServe v2: the server is up (needs no credentials)",
        tags=kserve,
        responses={200: {"model": openapi.Live}},
    )
    @_anyone
    async def live(request: Request) -> Response:
        return JSONResponse({"live": True})

    @api.get(
        "/v2/health/ready",
        summary="KServe v2: every model is ready (none loading or failed); needs no credentials",
        tags=kserve,
        responses={200: {"model": openapi.Ready}},
    )
    @_anyone
    async def ready(request: Request) -> Response:
        ok = _server(request).serving.all_ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 400)

    # Before /v2/models/{name}, which would take "stats" for a model's name.
    @api.get(
        "/v2/models/stats",
        summary="KServe v2 (Triton's statistics extension): every model",
        tags=kserve,
        responses={200: {"model": openapi.Statistics}},
    )
    @api.get(
        "/v2/models/{name}/stats",
        summary="KServe v2 (Triton's statistics extension)",
        tags=kserve,
        responses={200: {"model": openapi.Statistics}},
    )
    @api.get(
        "/v2/models/{name}/versions/{version}/stats",
        summary="KServe v2 (Triton's statistics extension)",
        tags=kserve,
        responses={200: {"model": openapi.Statistics}},
    )
    @_answered
    async def model_statistics(request: Request) -> Response:
        name = request.path_params.get("name", "")
        version = version_number(request.path_params.get("version", ""))
        return JSONResponse(triton.model_statistics(_server(request).serving.statistics(name, version)))

    @api.get(
        "/v2/models/{name}/config",
        summary="KServe v2 (Triton's model configuration extension)",
        tags=kserve,
        responses={200: {"model": openapi.ModelConfig}},
    )
    @api.get(
        "/v2/models/{name}/versions/{version}/config",
        summary="KServe v2 (Triton's model configuration extension)",
        tags=kserve,
        responses={200: {"model": openapi.ModelConfig}},
    )
    @_answered
    async def model_config(request: Request, name: str) -> Response:
        return JSONResponse(triton.model_config(_find(request, name)))

    @api.post(
        "/v2/repository/index",
        summary="KServe v2 (Triton's repository extension): the models",
        tags=kserve,
        responses={200: {"model": list[openapi.RepositoryModel]}},
        openapi_extra={
            "requestBody": {
                "required": False,
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/RepositoryIndexRequest"}}},
            }
        },
    )
    @_answered
    async def repository_index(request: Request) -> Response:
        body = await request.body()
        try:
            ready = bool(json.loads(body or b"{}").get("ready", False))
        except (ValueError, AttributeError):
            raise InvalidRequest('the body must be JSON such as {"ready": true}, or empty') from None
        caller = _caller(request)
        records = _server(request).serving.list()
        shown = {d.id for d in records if caller.admin or d.owner == caller.name}
        return JSONResponse(triton.repository_index(records, ready, shown))

    @api.post("/v2/repository/models/{name}/load", summary="Refused: deploy with gpuport deploy", tags=kserve)
    @api.post("/v2/repository/models/{name}/unload", summary="Refused: undeploy with gpuport undeploy", tags=kserve)
    @_answered
    async def repository_load(request: Request, name: str) -> Response:
        raise InvalidRequest(
            "gpuport loads and unloads models by deployment: `gpuport deploy NAME SOURCE` and "
            "`gpuport undeploy NAME` (or the Models API)"
        )

    @api.get("/v2/{kind}sharedmemory/{rest:path}", summary="Refused: shared memory cannot cross a network", tags=kserve)
    @api.post(
        "/v2/{kind}sharedmemory/{rest:path}", summary="Refused: shared memory cannot cross a network", tags=kserve
    )
    @_answered
    async def shared_memory(request: Request, kind: str, rest: str) -> Response:
        raise InvalidRequest(
            f"{kind} shared memory is refused: it cannot cross a network to a gpuport server — send the tensors "
            "in the request (binary tensor data, or gRPC's raw_input_contents)"
        )

    @api.get(
        "/v2/models/{name}",
        summary="KServe v2: model metadata",
        tags=kserve,
        responses={200: {"model": openapi.ModelMetadata}},
    )
    @api.get(
        "/v2/models/{name}/versions/{version}",
        summary="KServe v2: model metadata",
        tags=kserve,
        responses={200: {"model": openapi.ModelMetadata}},
    )
    @_answered
    async def model_metadata(request: Request, name: str) -> Response:
        return JSONResponse(kserve_metadata(_find(request, name), _server(request).serving.versions(name)))

    @api.get(
        "/v2/models/{name}/ready",
        summary="KServe v2: the model takes predictions",
        tags=kserve,
        responses={200: {"model": openapi.ModelReady}},
    )
    @api.get(
        "/v2/models/{name}/versions/{version}/ready",
        summary="KServe v2: the model takes predictions",
        tags=kserve,
        responses={200: {"model": openapi.ModelReady}},
    )
    @_answered
    async def model_ready(request: Request, name: str) -> Response:
        ok = _find(request, name).state == "ready"
        return JSONResponse({"name": name, "ready": ok}, status_code=200 if ok else 400)

    # ---- TensorFlow Serving REST ----------------------------------------------------------------

    @api.get(
        "/v1/models/{name}",
        summary="TensorFlow Serving: model status (needs no credentials)",
        tags=tfs,
        responses={200: {"model": openapi.ModelStatus}},
    )
    @api.get(
        "/v1/models/{name}/versions/{version}",
        summary="TensorFlow Serving: model status (needs no credentials)",
        tags=tfs,
        responses={200: {"model": openapi.ModelStatus}},
    )
    @api.get(
        "/v1/models/{name}/labels/{label}",
        summary="TensorFlow Serving: model status (needs no credentials)",
        tags=tfs,
        responses={200: {"model": openapi.ModelStatus}},
    )
    @_anyone
    async def tfs_status(request: Request, name: str) -> Response:
        caller = _caller_if_any(request)  # a failure's reason is for its owner and admins
        serving = _server(request).serving
        d = _find(request, name)  # NotFound for an unknown model or version
        number = d.version if "version" in request.path_params or "label" in request.path_params else 0
        found = [serving.find(name, v) for v in serving.versions(name) if not number or v == number]
        states = {"ready": "AVAILABLE", "loading": "LOADING", "failed": "END"}
        return JSONResponse(
            {
                "model_version_status": [
                    {
                        "version": str(d.version),
                        "state": states.get(d.state, "UNKNOWN"),
                        "status": {
                            "error_code": "OK" if d.state != "failed" else "UNKNOWN",
                            "error_message": message_for(d, caller),
                        },
                    }
                    for d in sorted(found, key=lambda d: -d.version)
                ]
            }
        )

    @api.get(
        "/v1/models/{name}/metadata",
        summary="TensorFlow Serving: model metadata",
        tags=tfs,
        responses={200: {"model": openapi.TfsModelMetadata}},
    )
    @api.get(
        "/v1/models/{name}/versions/{version}/metadata",
        summary="TensorFlow Serving: model metadata",
        tags=tfs,
        responses={200: {"model": openapi.TfsModelMetadata}},
    )
    @api.get(
        "/v1/models/{name}/labels/{label}/metadata",
        summary="TensorFlow Serving: model metadata",
        tags=tfs,
        responses={200: {"model": openapi.TfsModelMetadata}},
    )
    @_answered
    async def tfs_metadata(request: Request, name: str) -> Response:
        d = _find(request, name)
        return JSONResponse(
            {
                "model_spec": {"name": name, "signature_name": "", "version": str(d.version)},
                "metadata": {"signature_def": {"signature_def": {"serving_default": tfs_signature(d)}}},
            }
        )


# ---- the predictions: a plain ASGI app in front of FastAPI's -----------------------------------------

# The POST paths Predictions answers. KServe's groups: (name, version or None); TF Serving's: (name,
# None, None) with ":predict" on the name, or (name, "versions" or "labels", version or label) with it
# on the version or label.
_KSERVE_INFER = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")
_TFS_PREDICT = re.compile(r"/v1/models/([^/]+)(?:/(versions|labels)/([^/]+))?")
_Headers = list[tuple[bytes, bytes]]


class Predictions:
    """The ASGI app the HTTP port serves: ``POST /v2/models/{name}[/versions/{v}]/infer`` (KServe v2)
    and ``POST /v1/models/{name}[/versions/{v}]:predict`` (TensorFlow Serving) are answered here, every
    other request goes to ``app`` (FastAPI's). A client that hangs up while sending its body is not
    answered."""

    def __init__(self, app: Any, server: ServerApp) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        path = scope["path"]
        kserve = _KSERVE_INFER.fullmatch(path)
        tfs = None if kserve else _TFS_PREDICT.fullmatch(path)
        if kserve is None and tfs is None:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])  # ASGI's names are lower case
        try:
            if kserve is not None:
                name, version = kserve[1], kserve[2] or ""
            else:
                assert tfs is not None
                name, version, verb = _tfs_target(tfs[1], tfs[3])
            serving = self.server.serving
            try:
                number = serving.labelled(name, version) if tfs is not None and tfs[2] == "labels" else None
                endpoint = serving.endpoint(name, version_number(version) if number is None else number)
            except NotFound:  # an unknown model, version or label: told to callers with credentials
                model_caller(lambda: self._authenticate(headers, scope), serving, name)
                raise
            if not endpoint.public:
                model_caller(lambda: self._authenticate(headers, scope), serving, name)
            body = await _read_body(headers, receive)
            if body is None:
                return  # the client is gone
            if kserve is not None:
                status, extra, answer = await self._infer(endpoint, headers, body)
            else:
                status, extra, answer = await self._tfs_predict(endpoint, verb, body)
        except GpuportError as e:
            status, extra, answer = _status(e), [], _error_body(e)
        except Exception:
            log.exception("POST %s failed", path)
            error = ServerError("internal server error — the server's log has the details")
            status, extra, answer = 500, [], _error_body(error)
        content_type = b"application/octet-stream" if extra else b"application/json"
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", content_type),
                    (b"content-length", str(len(answer)).encode()),
                    *extra,
                ],
            }
        )
        await send({"type": "http.response.body", "body": answer})

    def _authenticate(self, headers: dict[bytes, bytes], scope: dict[str, Any]) -> Identity:
        try:
            authorization = headers.get(b"authorization", b"").decode("latin-1") or None
            return asgi_caller(self.server.auth, scope, authorization)
        except AuthenticationError as e:
            client = scope.get("client") or ("?",)
            log.warning("rejected POST %s from %s: %s", scope["path"], client[0], e)
            raise

    async def _infer(self, d: Endpoint, headers: dict[bytes, bytes], body: bytes) -> tuple[int, _Headers, bytes]:
        header = headers.get(_HEADER_LENGTH, b"")
        parsed = kserve_rest.parse_kserve(body, int(header) if header.isdigit() else None)
        outputs = await self.server.serving.infer(d, {i.name: i.array for i in parsed.inputs})
        chosen = _requested(outputs, [o.name for o in parsed.outputs])
        answer, length = kserve_rest.form_kserve(d.name, str(d.version), parsed.id, chosen, parsed.binary_output)
        extra = [] if length is None else [(_HEADER_LENGTH, str(length).encode())]
        return 200, extra, answer

    async def _tfs_predict(self, d: Endpoint, verb: str, body: bytes) -> tuple[int, _Headers, bytes]:
        if verb != "predict":
            raise NotFound(f"unknown method {verb!r}: gpuport serves :predict (not classify or regress)")
        signature, raw, style = tfs_rest.parse_tfs_predict(body)
        if signature not in ("", "serving_default"):
            raise InvalidRequest(f"unknown signature {signature!r}: this model has serving_default only")
        specs = [(i["name"], numpy_dtype(i["datatype"])) for i in d.inputs]
        outputs = await self.server.serving.infer(d, tfs_rest.tfs_to_inputs(raw, specs))
        return 200, [], tfs_rest.form_tfs_predict(outputs, style)


def _tfs_target(name: str, target: str | None) -> tuple[str, str, str]:
    """TF Serving's (name, version, verb) from its path's groups: NAME:predict and VERSION:predict,
    the verb sharing the last path segment."""
    if target is None:
        head, _, verb = name.rpartition(":")
        return head or name, "", verb
    head, _, verb = target.rpartition(":")
    return name, head or target, verb


async def _read_body(headers: dict[bytes, bytes], receive: Any) -> bytes | None:
    """The request's body, decompressed as its Content-Encoding says (gzip, deflate: tritonclient's
    request compression), within ``MAX_INFER_BYTES`` either way; None when the client hung up."""
    length = headers.get(b"content-length", b"")
    if length.isdigit() and int(length) > MAX_INFER_BYTES:
        raise _TooLarge(int(length))
    encoding = headers.get(b"content-encoding", b"identity").decode("latin-1").strip().lower()
    if encoding not in ("identity", "gzip", "deflate"):
        raise _Unsupported(f"content encoding {encoding[:40]!r}: send gzip, deflate or none")
    inflate = zlib.decompressobj(31 if encoding == "gzip" else 15) if encoding != "identity" else None
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        if inflate is None:
            body += chunk
        else:
            try:
                body += inflate.decompress(chunk, MAX_INFER_BYTES + 1 - len(body))
            except zlib.error as e:
                raise InvalidRequest(f"the body is not valid {encoding}: {e}") from None
        if len(body) > MAX_INFER_BYTES:
            raise _TooLarge(len(body))
        if not message.get("more_body", False):
            return bytes(body)


def _error_body(error: GpuportError) -> bytes:
    return json.dumps({"error": str(error)}).encode()


def _requested(outputs: dict[str, np.ndarray], names: list[str]) -> list[tuple[str, np.ndarray]]:
    if not names:
        return list(outputs.items())
    unknown = [n for n in names if n not in outputs]
    if unknown:
        raise InvalidRequest(f"unknown output {unknown[0]!r}: this model's outputs are {', '.join(outputs)}")
    return [(n, outputs[n]) for n in names]


def kserve_metadata(d: DeploymentRecord, versions: list[int]) -> dict[str, Any]:
    return {
        "name": d.name,
        "versions": [str(v) for v in versions],
        "platform": triton.platform(d),
        "inputs": d.inputs,
        "outputs": d.outputs,
    }


def tfs_signature(d: DeploymentRecord) -> dict[str, Any]:
    def info(spec: dict[str, Any]) -> dict[str, Any]:
        return {
            "dtype": TF_NAMES.get(tf_enum(spec["datatype"]), "DT_INVALID"),
            "tensor_shape": {"dim": [{"size": str(n), "name": ""} for n in spec["shape"]], "unknown_rank": False},
            "name": spec["name"],
        }

    return {
        "inputs": {s["name"]: info(s) for s in d.inputs},
        "outputs": {s["name"]: info(s) for s in d.outputs},
        "method_name": "tensorflow/serving/predict",
    }
