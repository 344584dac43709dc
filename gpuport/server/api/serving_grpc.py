"""The prediction protocols over gRPC, on the server's gRPC port, behind the same Bearer tokens.

``inference.GRPCInferenceService`` (KServe v2 / Triton: ServerLive, ServerReady, ServerMetadata,
ModelReady, ModelMetadata, ModelInfer with ``raw_input_contents``) and
``tensorflow.serving.PredictionService`` (Predict, GetModelMetadata). Their messages come from a
private descriptor pool (``protocol/serving``), so a server that loads TensorFlow, and a process with
tritonclient or tensorflow-serving-api in it, register nothing twice; the handlers are generic ones,
with those messages' own (de)serializers.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format

from gpuport._version import __version__
from gpuport.defaults import MAX_INFER_BYTES
from gpuport.protocol.datatypes import datatype_of, from_tf_enum, numpy_dtype, tf_enum
from gpuport.protocol.errors import AuthenticationError, GpuportError, InvalidRequest, NotFound, ServerError, status_for
from gpuport.protocol.serving import KSERVE_SERVICE, TFS_SERVICE, any_type_url, kserve, tfs
from gpuport.server.api.callers import grpc_caller, model_caller
from gpuport.server.app import ServerApp
from gpuport.server.services.auth import Identity
from gpuport.server.services.serving import DeploymentRecord, Endpoint, version_number
from gpuport.server.serving import triton
from gpuport.server.serving.tensors import pack_bytes, unpack_bytes

log = logging.getLogger(__name__)

# The typed fields of InferTensorContents, by datatype.
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
# The typed fields of TensorProto, by datatype (half_val holds FP16's bit patterns).
_TF_VALUES = {
    "FP32": "float_val",
    "FP64": "double_val",
    "INT8": "int_val",
    "INT16": "int_val",
    "INT32": "int_val",
    "UINT8": "int_val",
    "UINT16": "int_val",
    "INT64": "int64_val",
    "UINT32": "uint32_val",
    "UINT64": "uint64_val",
    "BOOL": "bool_val",
    "BYTES": "string_val",
    "FP16": "half_val",
}

Handler = Callable[[ServerApp, Any, Identity | None, Endpoint | None], Awaitable[Any]]
# Who may call a method: anyone (health), anyone for a public model (the deployment a request names,
# found once and handed to the method), or a caller with credentials.
ANYONE = "anyone"
_Model = Callable[[ServerApp, Any], Endpoint | None]


def _unary(
    app: ServerApp, method: Handler, request_type: Any, response_type: Any, who: str | _Model = ""
) -> grpc.RpcMethodHandler:
    @functools.wraps(method)
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            caller = endpoint = None
            name = _name_in(request) if callable(who) else ""
            if callable(who):
                try:
                    endpoint = who(app, request)
                except NotFound:  # an unknown model, version or label: told to callers with credentials
                    model_caller(lambda: grpc_caller(app.auth, context), app.serving, name)
                    raise
            if who != ANYONE and not (endpoint is not None and endpoint.public):
                if name:
                    caller = model_caller(lambda: grpc_caller(app.auth, context), app.serving, name)
                else:
                    caller = grpc_caller(app.auth, context)
            return await method(app, request, caller, endpoint)
        except Exception as e:
            if isinstance(e, AuthenticationError):
                log.warning("rejected a prediction call from %s: %s", context.peer(), e)
            elif not isinstance(e, GpuportError):
                log.exception("%s failed", method.__name__)
                e = ServerError("internal server error — the server's log has the details")
            code, _ = status_for(e)  # type: ignore[arg-type]
            await context.abort(code, str(e))

    return grpc.unary_unary_rpc_method_handler(
        handle, request_deserializer=request_type.FromString, response_serializer=response_type.SerializeToString
    )


def _name_in(request: Any) -> str:
    """The model a request names (KServe's ``name`` or ``model_name``, TF Serving's ``model_spec``), or ""."""
    for field in ("name", "model_name"):
        if hasattr(request, field):
            return str(getattr(request, field))
    return str(request.model_spec.name) if hasattr(request, "model_spec") else ""


def _named(app: ServerApp, request: Any) -> Endpoint | None:
    """The deployment ``name`` and ``version`` name; None for none named (every model's statistics)."""
    return app.serving.endpoint(request.name, version_number(request.version)) if request.name else None


def _infer_named(app: ServerApp, request: Any) -> Endpoint:
    return app.serving.endpoint(request.model_name, version_number(request.model_version))


def _spec_named(app: ServerApp, request: Any) -> Endpoint:
    return app.serving.endpoint(request.model_spec.name, _spec_version(app, request.model_spec))


def _spec_version(app: ServerApp, spec: Any) -> int:
    """The version a TF Serving ModelSpec names: by number, by label (NotFound for a label the model
    does not have, never the latest instead), or 0 (the latest) for neither."""
    choice = spec.WhichOneof("version_choice")
    if choice == "version":
        return int(spec.version.value)
    if choice == "version_label":
        return app.serving.labelled(spec.name, spec.version_label)
    return 0


def add_serving_services(server: grpc.aio.Server, app: ServerApp) -> None:
    k, t = kserve, tfs
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                KSERVE_SERVICE,
                {
                    "ServerLive": _unary(app, _server_live, k.ServerLiveRequest, k.ServerLiveResponse, ANYONE),
                    "ServerReady": _unary(app, _server_ready, k.ServerReadyRequest, k.ServerReadyResponse, ANYONE),
                    "ServerMetadata": _unary(
                        app, _server_metadata, k.ServerMetadataRequest, k.ServerMetadataResponse, ANYONE
                    ),
                    "ModelReady": _unary(app, _model_ready, k.ModelReadyRequest, k.ModelReadyResponse, _named),
                    "ModelMetadata": _unary(
                        app, _model_metadata, k.ModelMetadataRequest, k.ModelMetadataResponse, _named
                    ),
                    "ModelInfer": _unary(app, _model_infer, k.ModelInferRequest, k.ModelInferResponse, _infer_named),
                    "ModelConfig": _unary(app, _model_config, k.ModelConfigRequest, k.ModelConfigResponse, _named),
                    "ModelStatistics": _unary(
                        app, _model_statistics, k.ModelStatisticsRequest, k.ModelStatisticsResponse, _named
                    ),
                    "RepositoryIndex": _unary(
                        app, _repository_index, k.RepositoryIndexRequest, k.RepositoryIndexResponse
                    ),
                },
            ),
            grpc.method_handlers_generic_handler(
                TFS_SERVICE,
                {
                    "Predict": _unary(app, _predict, t.PredictRequest, t.PredictResponse, _spec_named),
                    "GetModelMetadata": _unary(
                        app, _get_model_metadata, t.GetModelMetadataRequest, t.GetModelMetadataResponse, _spec_named
                    ),
                },
            ),
        )
    )


# ---- KServe v2 ---------------------------------------------------------------------------------------


async def _server_live(app: ServerApp, request: Any, caller: Identity | None, endpoint: Endpoint | None) -> Any:
    return kserve.ServerLiveResponse(live=True)


async def _server_ready(app: ServerApp, request: Any, caller: Identity | None, endpoint: Endpoint | None) -> Any:
    return kserve.ServerReadyResponse(ready=app.serving.all_ready())


async def _server_metadata(app: ServerApp, request: Any, caller: Identity | None, endpoint: Endpoint | None) -> Any:
    return kserve.ServerMetadataResponse(name="gpuport", version=__version__, extensions=list(triton.EXTENSIONS))


async def _model_config(app: ServerApp, request: Any, caller: Identity | None, endpoint: Endpoint | None) -> Any:
    d = app.serving.find(request.name, version_number(request.version))
    return json_format.ParseDict({"config": triton.model_config(d)}, kserve.ModelConfigResponse())


async def _model_statistics(app: ServerApp, request: Any, caller: Identity | None, endpoint: Endpoint | None) -> Any:
    found = app.serving.statistics(request.name, version_number(request.version))
    return json_format.ParseDict(triton.model_statistics(found), kserve.ModelStatisticsResponse())


async def _repository_index(app: ServerApp, request: Any, caller: Identity | None, endpoint: Endpoint | None) -> Any:
    assert caller is not None  # the method needs credentials
    if request.repository_name:
        raise InvalidRequest(f"repository {request.repository_name!r}: gpuport has one, unnamed")
    records = app.serving.list()
    shown = {d.id for d in records if caller.admin or d.owner == caller.name}
    index = triton.repository_index(records, request.ready, shown)
    return json_format.ParseDict({"models": index}, kserve.RepositoryIndexResponse())


async def _model_ready(app: ServerApp, request: Any, caller: Identity | None, endpoint: Endpoint | None) -> Any:
    d = app.serving.find(request.name, version_number(request.version))
    return kserve.ModelReadyResponse(ready=d.state == "ready")


async def _model_metadata(app: ServerApp, request: Any, caller: Identity | None, endpoint: Endpoint | None) -> Any:
    d = app.serving.find(request.name, version_number(request.version))
    meta = kserve.ModelMetadataResponse.TensorMetadata
    return kserve.ModelMetadataResponse(
        name=d.name,
        versions=[str(v) for v in app.serving.versions(d.name)],
        platform=triton.platform(d),
        inputs=[meta(name=s["name"], datatype=s["datatype"], shape=s["shape"]) for s in d.inputs],
        outputs=[meta(name=s["name"], datatype=s["datatype"], shape=s["shape"]) for s in d.outputs],
    )


def _kserve_input(tensor: Any, raw: bytes | None) -> np.ndarray:
    shape = tuple(int(n) for n in tensor.shape)
    if any(n < 0 for n in shape):
        raise InvalidRequest(f"input {tensor.name!r}: shape {list(shape)} has a negative dimension")
    dtype = numpy_dtype(tensor.datatype)
    count = int(np.prod(shape)) if shape else 1
    if raw is not None:
        if tensor.datatype == "BYTES":
            array = unpack_bytes(raw, f"raw_input_contents of BYTES input {tensor.name!r}", count)
        else:
            if len(raw) != count * dtype.itemsize:
                raise InvalidRequest(
                    f"input {tensor.name!r}: raw_input_contents has {len(raw)} bytes; shape {list(shape)} of "
                    f"{tensor.datatype} needs {count * dtype.itemsize}"
                )
            return np.frombuffer(raw, dtype=dtype).reshape(shape)
    else:
        field = _CONTENTS.get(tensor.datatype)
        if field is None:
            raise InvalidRequest(f"input {tensor.name!r}: {tensor.datatype} travels in raw_input_contents only")
        values = list(getattr(tensor.contents, field))
        if tensor.datatype == "BYTES":
            array = np.empty(len(values), dtype=object)
            array[:] = values
        else:
            array = np.asarray(values, dtype=dtype)
    if array.size != count:
        raise InvalidRequest(f"input {tensor.name!r}: {array.size} values for shape {list(shape)} ({count} expected)")
    return array.reshape(shape)


async def _model_infer(app: ServerApp, request: Any, caller: Identity | None, endpoint: Endpoint | None) -> Any:
    if request.ByteSize() > MAX_INFER_BYTES:
        raise InvalidRequest(f"request of {request.ByteSize()} bytes is over the limit of {MAX_INFER_BYTES} bytes")
    d = endpoint
    assert d is not None  # found by _infer_named
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise InvalidRequest(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs: give one per input")
    inputs = {t.name: _kserve_input(t, raw[i] if raw else None) for i, t in enumerate(request.inputs)}
    outputs = await app.serving.infer(d, inputs)
    wanted = [o.name for o in request.outputs] or list(outputs)
    unknown = [n for n in wanted if n not in outputs]
    if unknown:
        raise InvalidRequest(f"unknown output {unknown[0]!r}: this model's outputs are {', '.join(outputs)}")
    response = kserve.ModelInferResponse(model_name=d.name, model_version=str(d.version), id=request.id)
    for name in wanted:
        array = np.asarray(outputs[name])
        datatype = datatype_of(array.dtype)
        response.outputs.add(name=name, datatype=datatype, shape=list(array.shape))
        if datatype == "BYTES":
            response.raw_output_contents.append(pack_bytes(array))
        else:
            response.raw_output_contents.append(np.ascontiguousarray(array).tobytes())
    return response


# ---- TensorFlow Serving --------------------------------------------------------------------------------


def _from_tensor_proto(name: str, proto: Any) -> np.ndarray:
    datatype = from_tf_enum(proto.dtype)
    shape = tuple(int(d.size) for d in proto.tensor_shape.dim)
    if any(n < 0 for n in shape):
        raise InvalidRequest(f"input {name!r}: shape {list(shape)} has a negative dimension")
    dtype = numpy_dtype(datatype)
    count = int(np.prod(shape)) if shape else 1
    if proto.tensor_content:
        if datatype == "BYTES":
            raise InvalidRequest(f"input {name!r}: strings travel in string_val, not tensor_content")
        if len(proto.tensor_content) != count * dtype.itemsize:
            raise InvalidRequest(
                f"input {name!r}: tensor_content has {len(proto.tensor_content)} bytes; shape {list(shape)} of "
                f"{datatype} needs {count * dtype.itemsize}"
            )
        return np.frombuffer(proto.tensor_content, dtype=dtype).reshape(shape)
    values = list(getattr(proto, _TF_VALUES.get(datatype, "float_val")))
    if datatype == "BYTES":
        array = np.empty(len(values), dtype=object)
        array[:] = values
    elif datatype == "FP16":
        array = np.asarray(values, dtype=np.uint16).view(np.float16)
    else:
        array = np.asarray(values, dtype=dtype)
    if array.size == 1 and count != 1:
        array = np.full(count, array[0], dtype=array.dtype)  # TensorFlow's rule: one value fills the tensor
    if array.size != count:
        raise InvalidRequest(f"input {name!r}: {array.size} values for shape {list(shape)} ({count} expected)")
    return array.reshape(shape)


def _tensor_proto(array: np.ndarray) -> Any:
    array = np.asarray(array)
    datatype = datatype_of(array.dtype)
    proto = tfs.TensorProto(dtype=tf_enum(datatype))
    for n in array.shape:
        proto.tensor_shape.dim.add(size=n)
    if datatype == "BYTES":
        proto.string_val.extend(x if isinstance(x, bytes) else str(x).encode() for x in array.reshape(-1))
    else:
        proto.tensor_content = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()
    return proto


async def _predict(app: ServerApp, request: Any, caller: Identity | None, endpoint: Endpoint | None) -> Any:
    if request.ByteSize() > MAX_INFER_BYTES:
        raise InvalidRequest(f"request of {request.ByteSize()} bytes is over the limit of {MAX_INFER_BYTES} bytes")
    spec, d = request.model_spec, endpoint
    assert d is not None  # found by _spec_named
    if spec.signature_name not in ("", "serving_default"):
        raise InvalidRequest(f"unknown signature {spec.signature_name!r}: this model has serving_default only")
    inputs = {name: _from_tensor_proto(name, proto) for name, proto in request.inputs.items()}
    outputs = await app.serving.infer(d, inputs)
    wanted = list(request.output_filter) or list(outputs)
    unknown = [n for n in wanted if n not in outputs]
    if unknown:
        raise InvalidRequest(f"unknown output {unknown[0]!r}: this model's outputs are {', '.join(outputs)}")
    response = tfs.PredictResponse()
    response.model_spec.name = d.name
    response.model_spec.version.value = d.version
    response.model_spec.signature_name = "serving_default"
    for name in wanted:
        response.outputs[name].CopyFrom(_tensor_proto(outputs[name]))
    return response


def signature_def(d: DeploymentRecord) -> Any:
    signature = tfs.SignatureDef(method_name="tensorflow/serving/predict")
    for specs, target in ((d.inputs, signature.inputs), (d.outputs, signature.outputs)):
        for s in specs:
            info = target[s["name"]]
            info.name = s["name"]
            info.dtype = tf_enum(s["datatype"])
            for n in s["shape"]:
                info.tensor_shape.dim.add(size=n)
    return signature


async def _get_model_metadata(app: ServerApp, request: Any, caller: Identity | None, endpoint: Endpoint | None) -> Any:
    spec = request.model_spec
    d = app.serving.find(spec.name, _spec_version(app, spec))
    fields = list(request.metadata_field)
    if fields != ["signature_def"]:
        raise InvalidRequest(
            f"metadata_field must be ['signature_def'] (the one TensorFlow Serving knows), not {fields}"
        )
    signatures = tfs.SignatureDefMap()
    signatures.signature_def["serving_default"].CopyFrom(signature_def(d))
    response = tfs.GetModelMetadataResponse()
    response.model_spec.name = d.name
    response.model_spec.version.value = d.version
    packed = response.metadata["signature_def"]
    packed.type_url = any_type_url(type(signatures))
    packed.value = signatures.SerializeToString()
    return response
