"""The HTTP port's OpenAPI document, complete enough for client generators.

FastAPI writes most of it. This module adds what FastAPI cannot see: the predictions
(``POST .../infer``, ``POST ...:predict``), which ``Predictions`` answers in front of FastAPI; the
prediction protocols' request and response schemas (KServe v2 and TensorFlow Serving, as their
specifications give them); every path parameter of a route that serves several paths; the bearer
security scheme on the protocols' routes (optional where a model may be public); and the errors as
gpuport answers them, in place of FastAPI's 422 validation error, which gpuport never sends.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field, TypeAdapter

# ---- KServe v2 -------------------------------------------------------------------------------------


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class Live(BaseModel):
    live: bool


class Ready(BaseModel):
    ready: bool


class ModelReady(BaseModel):
    name: str
    ready: bool


class TensorMetadata(BaseModel):
    name: str
    datatype: str = Field(description="BOOL, UINT8 .. UINT64, INT8 .. INT64, FP16, FP32, FP64, BYTES")
    shape: list[int] = Field(description="-1: any size")


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class InferInput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = Field(None, description='{"binary_data_size": N}: the data is in the body')
    data: list[Any] | None = Field(None, description="Row-major, flat or nested; absent with binary data")


class InferRequestedOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = Field(None, description='{"binary_data": true}: sent after the JSON')


class InferRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[InferInput]
    outputs: list[InferRequestedOutput] | None = None


class InferOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class InferResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[InferOutput]


class Duration(BaseModel):
    count: int
    ns: int


class InferStatistics(BaseModel):
    success: Duration
    fail: Duration
    queue: Duration
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration
    cache_hit: Duration
    cache_miss: Duration


class BatchStatistics(BaseModel):
    batch_size: int
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration


class ModelStatistics(BaseModel):
    name: str
    version: str
    last_inference: int = Field(description="Milliseconds since the epoch")
    inference_count: int
    execution_count: int
    inference_stats: InferStatistics
    batch_stats: list[BatchStatistics]


class Statistics(BaseModel):
    model_stats: list[ModelStatistics]


class ConfigTensor(BaseModel):
    name: str
    data_type: str = Field(description="TYPE_FP32, TYPE_INT64, TYPE_STRING, ...")
    dims: list[int]


class DynamicBatching(BaseModel):
    max_queue_delay_microseconds: int


class InstanceGroup(BaseModel):
    name: str
    kind: str
    count: int


class ModelConfig(BaseModel):
    name: str
    platform: str
    backend: str
    max_batch_size: int
    input: list[ConfigTensor]
    output: list[ConfigTensor]
    dynamic_batching: DynamicBatching | None = None
    instance_group: list[InstanceGroup]


class RepositoryIndexRequest(BaseModel):
    ready: bool = False


class RepositoryModel(BaseModel):
    name: str
    version: str
    state: str = Field(description="READY, LOADING or UNAVAILABLE")
    reason: str


class ProtocolError(BaseModel):
    error: str


# ---- TensorFlow Serving ---------------------------------------------------------------------------


class PredictRequest(BaseModel):
    signature_name: str | None = None
    instances: list[Any] | None = Field(None, description="Row format: one item per row")
    inputs: Any | None = Field(None, description="Columnar format: a tensor, or tensors by name")


class PredictResponse(BaseModel):
    predictions: list[Any] | None = Field(None, description="In answer to instances")
    outputs: Any | None = Field(None, description="In answer to inputs")


class VersionStatus(BaseModel):
    error_code: str
    error_message: str


class ModelVersionStatus(BaseModel):
    version: str
    state: str = Field(description="AVAILABLE, LOADING, END or UNKNOWN")
    status: VersionStatus


class ModelStatus(BaseModel):
    model_version_status: list[ModelVersionStatus]


class TfsModelSpec(BaseModel):
    name: str
    signature_name: str
    version: str


class TfsModelMetadata(BaseModel):
    model_spec: TfsModelSpec
    metadata: dict[str, Any] = Field(description="signature_def: the SignatureDefMap as JSON")


# ---- gpuport's own errors -------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    type: str = Field(description="The error's class: NotFound, InvalidRequest, ...")
    message: str


class Error(BaseModel):
    error: ErrorDetail


_SERVING = ("/v2", "/v1/models")
_OPEN = {"/v2", "/v2/health/live", "/v2/health/ready"}  # health: no credentials at all
_PARAM = re.compile(r"{([^}:]+)(?::path)?}")
_REF = "#/components/schemas/{model}"


def _schemas(*models: type[BaseModel]) -> dict[str, Any]:
    """The JSON schemas of ``models`` and of what they refer to, by name, for components.schemas."""
    found: dict[str, Any] = {}
    for model in models:
        schema = TypeAdapter(model).json_schema(ref_template=_REF)
        found.update(schema.pop("$defs", {}))
        found[model.__name__] = schema
    return found


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _json(model: type[BaseModel] | None, description: str, array: bool = False) -> dict[str, Any]:
    schema = _ref(model) if model is not None else {}
    return {
        "description": description,
        "content": {"application/json": {"schema": {"type": "array", "items": schema} if array else schema}},
    }


# The predictions Predictions answers, documented here: path → (request, response, summary, tag).
_PREDICTIONS = {
    "/v2/models/{name}/infer": (InferRequest, InferResponse, "KServe v2: a prediction", "KServe v2"),
    "/v2/models/{name}/versions/{version}/infer": (
        InferRequest,
        InferResponse,
        "KServe v2: a prediction of one version",
        "KServe v2",
    ),
    "/v1/models/{name}:predict": (
        PredictRequest,
        PredictResponse,
        "TensorFlow Serving: a prediction",
        "TensorFlow Serving",
    ),
    "/v1/models/{name}/versions/{version}:predict": (
        PredictRequest,
        PredictResponse,
        "TensorFlow Serving: a prediction of one version",
        "TensorFlow Serving",
    ),
    "/v1/models/{name}/labels/{label}:predict": (
        PredictRequest,
        PredictResponse,
        "TensorFlow Serving: a prediction of the version a label names",
        "TensorFlow Serving",
    ),
}


def build_openapi(api: FastAPI) -> dict[str, Any]:
    """The document for ``api`` (built once, then kept by FastAPI)."""
    document = get_openapi(title=api.title, version=api.version, description=api.description, routes=api.routes)
    components = document.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    schemas.update(
        _schemas(
            Error,
            ProtocolError,
            InferRequest,
            InferResponse,
            PredictRequest,
            PredictResponse,
            ServerMetadata,
            Live,
            Ready,
            ModelReady,
            ModelMetadata,
            Statistics,
            ModelConfig,
            RepositoryIndexRequest,
            RepositoryModel,
            ModelStatus,
            TfsModelMetadata,
        )
    )
    components.setdefault("securitySchemes", {})["HTTPBearer"] = {"type": "http", "scheme": "bearer"}
    paths = document.setdefault("paths", {})
    for path, (request, response, summary, tag) in _PREDICTIONS.items():
        paths[path] = {
            "post": {
                "tags": [tag],
                "summary": summary,
                "operationId": "predict_" + re.sub(r"\W+", "_", path).strip("_"),
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
                "responses": {"200": _json(response, "The prediction")},
            }
        }
    for path, operations in paths.items():
        serving = path.startswith(_SERVING)
        declared = _PARAM.findall(path)
        for operation in operations.values():
            parameters = operation.setdefault("parameters", [])
            named = {p["name"] for p in parameters if p.get("in") == "path"}
            for name in declared:
                if name not in named:
                    parameters.append({"name": name, "in": "path", "required": True, "schema": {"type": "string"}})
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            error = ProtocolError if serving else Error
            responses.setdefault("400", _json(error, "Bad input: what was wrong and what to do"))
            if path in ("/v1/health",) or path in _OPEN:
                operation.pop("security", None)
                continue
            responses.setdefault("401", _json(error, "No credentials, or unknown or revoked ones"))
            if serving:
                responses.setdefault("404", _json(error, "Unknown model, version or label"))
                # A public model's routes take a call without credentials too.
                operation["security"] = [{"HTTPBearer": []}, {}]
    return document
