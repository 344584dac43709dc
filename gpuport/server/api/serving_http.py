"""The prediction protocols over HTTP, on the server's HTTP port, behind the same Bearer tokens.

KServe v2 (the Open Inference Protocol, as Triton serves it) under ``/v2``, with JSON tensors and the
binary tensor data extension; TensorFlow Serving's REST API under ``/v1/models``. Errors come out as
each protocol has them: ``{"error": "message"}`` with 400 (bad input), 404 (unknown model or version),
401/403, 413 (over the size limit), 503 (a model still loading or failed) or 500.
"""

from __future__ import annotations

import functools
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
from gpuport.protocol.errors import GpuportError, InvalidRequest, NotFound, ResourceUnavailable, status_for
from gpuport.server.app import ServerApp
from gpuport.server.services.auth import Identity
from gpuport.server.services.serving import DeploymentRecord, version_number
from gpuport.server.serving import codecs

# What KServe's model metadata calls each format (Triton's platform names).
PLATFORMS = {
    "savedmodel": "tensorflow_savedmodel",
    "keras": "tensorflow_keras",
    "torchscript": "pytorch_libtorch",
    "onnx": "onnxruntime_onnx",
    "python": "python",
}
_HEADER_LENGTH = "inference-header-content-length"


def _error(error: Exception) -> JSONResponse:
    if not isinstance(error, GpuportError):
        raise error
    _, status = status_for(error)
    if isinstance(error, (_TooLarge, _Unsupported)):
        status = 413 if isinstance(error, _TooLarge) else 415
    elif isinstance(error, ResourceUnavailable) and "overloaded" not in str(error):
        status = 503  # loading, failed, restarting: not the caller's fault
    return JSONResponse({"error": str(error)}, status_code=status)


def _caller(request: Request) -> Identity:
    server: ServerApp = request.app.state.gpuport
    return server.auth.authenticate(request.headers.get("authorization"))


async def _body(request: Request) -> bytes:
    """The request's body, decompressed as its Content-Encoding says (gzip, deflate: tritonclient's
    request compression), within ``MAX_INFER_BYTES`` either way."""
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > MAX_INFER_BYTES:
        raise _TooLarge(int(length))
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("identity", "gzip", "deflate"):
        raise _Unsupported(f"content encoding {encoding[:40]!r}: send gzip, deflate or none")
    inflate = zlib.decompressobj(31 if encoding == "gzip" else 15) if encoding != "identity" else None
    body = bytearray()
    async for chunk in request.stream():
        if inflate is None:
            body += chunk
        else:
            try:
                body += inflate.decompress(chunk, MAX_INFER_BYTES + 1 - len(body))
            except zlib.error as e:
                raise InvalidRequest(f"the body is not valid {encoding}: {e}") from None
        if len(body) > MAX_INFER_BYTES:
            raise _TooLarge(len(body))
    return bytes(body)


class _Unsupported(InvalidRequest):
    """Answered 415."""


class _TooLarge(InvalidRequest):
    def __init__(self, size: int) -> None:
        super().__init__(
            f"request of {size} bytes is over the limit of {MAX_INFER_BYTES} bytes for a prediction: send fewer "
            "rows per request"
        )


def _answered(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """Authenticate the caller, then run ``handler``; a GpuportError becomes the protocol's error."""

    @functools.wraps(handler)
    async def answer(request: Request, **params: str) -> Response:
        try:
            _caller(request)
            return await handler(request, **params)
        except GpuportError as e:
            return _error(e)

    return answer


def _server(request: Request) -> ServerApp:
    return request.app.state.gpuport  # type: ignore[no-any-return]


def _find(request: Request, name: str) -> DeploymentRecord:
    """The deployment a URL names: /models/{name}[/versions/{version}]."""
    return _server(request).serving.find(name, version_number(request.path_params.get("version", "")))


def add_serving_routes(api: FastAPI) -> None:
    kserve: list[str | Enum] = ["KServe v2"]
    tfs: list[str | Enum] = ["TensorFlow Serving"]

    # ---- KServe v2 ------------------------------------------------------------------------------

    @api.get("/v2", summary="KServe v2: server metadata", tags=kserve)
    @_answered
    async def server_metadata(request: Request) -> Response:
        return JSONResponse({"name": "gpuport", "version": __version__, "extensions": ["binary_tensor_data"]})

    @api.get("/v2/health/live", summary="KServe v2: the server is up", tags=kserve)
    @_answered
    async def live(request: Request) -> Response:
        return JSONResponse({"live": True})

    @api.get("/v2/health/ready", summary="KServe v2: the server takes predictions", tags=kserve)
    @_answered
    async def ready(request: Request) -> Response:
        return JSONResponse({"ready": True})

    @api.get("/v2/models/{name}", summary="KServe v2: model metadata", tags=kserve)
    @api.get("/v2/models/{name}/versions/{version}", summary="KServe v2: model metadata", tags=kserve)
    @_answered
    async def model_metadata(request: Request, name: str) -> Response:
        return JSONResponse(kserve_metadata(_find(request, name), _server(request).serving.versions(name)))

    @api.get("/v2/models/{name}/ready", summary="KServe v2: the model takes predictions", tags=kserve)
    @api.get(
        "/v2/models/{name}/versions/{version}/ready", summary="KServe v2: the model takes predictions", tags=kserve
    )
    @_answered
    async def model_ready(request: Request, name: str) -> Response:
        ok = _find(request, name).state == "ready"
        return JSONResponse({"name": name, "ready": ok}, status_code=200 if ok else 400)

    @api.post("/v2/models/{name}/infer", summary="KServe v2: a prediction", tags=kserve)
    @api.post("/v2/models/{name}/versions/{version}/infer", summary="KServe v2: a prediction", tags=kserve)
    @_answered
    async def infer(request: Request, name: str) -> Response:
        d = _find(request, name)
        header = request.headers.get(_HEADER_LENGTH)
        parsed = codecs.parse_kserve(await _body(request), int(header) if header and header.isdigit() else None)
        outputs = await _server(request).serving.infer(name, d.version, {i.name: i.array for i in parsed.inputs})
        chosen = _requested(outputs, [o.name for o in parsed.outputs])
        body, length = codecs.form_kserve(name, str(d.version), parsed.id, chosen, parsed.binary_output)
        if length is None:
            return Response(body, media_type="application/json")
        return Response(
            body, media_type="application/octet-stream", headers={"Inference-Header-Content-Length": str(length)}
        )

    # ---- TensorFlow Serving REST ----------------------------------------------------------------

    @api.get("/v1/models/{name}", summary="TensorFlow Serving: model status", tags=tfs)
    @api.get("/v1/models/{name}/versions/{version}", summary="TensorFlow Serving: model status", tags=tfs)
    @_answered
    async def tfs_status(request: Request, name: str) -> Response:
        serving = _server(request).serving
        d = _find(request, name)  # NotFound for an unknown model or version
        number = d.version if "version" in request.path_params else 0
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
                            "error_message": d.message,
                        },
                    }
                    for d in sorted(found, key=lambda d: -d.version)
                ]
            }
        )

    @api.get("/v1/models/{name}/metadata", summary="TensorFlow Serving: model metadata", tags=tfs)
    @api.get("/v1/models/{name}/versions/{version}/metadata", summary="TensorFlow Serving: model metadata", tags=tfs)
    @_answered
    async def tfs_metadata(request: Request, name: str) -> Response:
        d = _find(request, name)
        return JSONResponse(
            {
                "model_spec": {"name": name, "signature_name": "", "version": str(d.version)},
                "metadata": {"signature_def": {"signature_def": {"serving_default": tfs_signature(d)}}},
            }
        )

    # NAME:predict and VERSION:predict: the verb shares the last path segment.
    @api.post("/v1/models/{target}", summary="TensorFlow Serving: NAME:predict", tags=tfs)
    @_answered
    async def tfs_predict(request: Request, target: str) -> Response:
        name, _, verb = target.rpartition(":")
        return await _tfs_predict(request, name or target, "", verb)

    @api.post("/v1/models/{name}/versions/{target}", summary="TensorFlow Serving: VERSION:predict", tags=tfs)
    @_answered
    async def tfs_version_predict(request: Request, name: str, target: str) -> Response:
        version, _, verb = target.rpartition(":")
        return await _tfs_predict(request, name, version or target, verb)

    async def _tfs_predict(request: Request, name: str, version: str, verb: str) -> Response:
        if verb != "predict":
            raise NotFound(f"unknown method {verb!r}: gpuport serves :predict (not classify or regress)")
        serving = _server(request).serving
        d = serving.find(name, version_number(version))
        signature, raw, style = codecs.parse_tfs_predict(await _body(request))
        if signature not in ("", "serving_default"):
            raise InvalidRequest(f"unknown signature {signature!r}: this model has serving_default only")
        specs = [(i["name"], numpy_dtype(i["datatype"])) for i in d.inputs]
        outputs = await serving.infer(name, d.version, codecs.tfs_to_inputs(raw, specs))
        return Response(codecs.form_tfs_predict(outputs, style), media_type="application/json")


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
        "platform": PLATFORMS.get(d.format, d.format),
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
