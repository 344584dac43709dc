"""The serving protocols' private copies match the published protos and interoperate on the wire.

"Published" is what the clients themselves carry: tritonclient's ``service_pb2`` (Triton's
grpc_service.proto) and tensorflow-serving-api's and TensorFlow's ``_pb2`` modules. Their descriptors
are compared with ours field for field, and messages cross between their classes and ours as bytes.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
from google.protobuf import descriptor_pb2, json_format

from gpuport.protocol.serving import KSERVE_SERVICE, POOL, TFS_SERVICE, any_type_url, kserve, tfs

ROOT = Path(__file__).resolve().parents[1]
SERVING = ROOT / "gpuport" / "protocol" / "serving"

# The rpcs we serve, of all that the published services have.
SERVED = {
    KSERVE_SERVICE: {
        "ServerLive",
        "ServerReady",
        "ModelReady",
        "ServerMetadata",
        "ModelMetadata",
        "ModelInfer",
        "ModelConfig",
        "ModelStatistics",
        "RepositoryIndex",
    },
    TFS_SERVICE: {"Predict", "GetModelMetadata"},
}

# Published fields our copies leave out, each with the reason.
LEFT_OUT = {
    # Its TypeSpecProto needs all of struct.proto; composite (ragged, ...) tensors are not served.
    "tensorflow.TensorInfo.composite_tensor",
    # gpuport's statistics: no memory usage or per-response (decoupled models') figures.
    "inference.ModelStatistics.memory_usage",
    "inference.ModelStatistics.response_stats",
    # Of Triton's model configuration, what gpuport's deployments have: no reshapes, ragged or shape
    # tensors, sequence or ensemble scheduling, priorities, warmup, repository agents, caches ...
    *(
        f"inference.ModelInput.{name}"
        for name in (
            "format",
            "reshape",
            "is_shape_tensor",
            "allow_ragged_batch",
            "optional",
            "is_non_linear_format_io",
        )
    ),
    *(
        f"inference.ModelOutput.{name}"
        for name in ("reshape", "label_filename", "is_shape_tensor", "is_non_linear_format_io")
    ),
    *(
        f"inference.ModelDynamicBatching.{name}"
        for name in (
            "preserve_ordering",
            "priority_levels",
            "default_priority_level",
            "default_queue_policy",
            "priority_queue_policy",
        )
    ),
    *(
        f"inference.ModelInstanceGroup.{name}"
        for name in ("rate_limiter", "secondary_devices", "profile", "passive", "host_policy")
    ),
    *(
        f"inference.ModelConfig.{name}"
        for name in (
            "runtime",
            "version_policy",
            "batch_input",
            "batch_output",
            "optimization",
            "sequence_batching",
            "ensemble_scheduling",
            "default_model_filename",
            "cc_model_filenames",
            "metric_tags",
            "parameters",
            "model_warmup",
            "model_operations",
            "model_transaction_policy",
            "model_repository_agents",
            "response_cache",
            "model_metrics",
        )
    ),
}

# Our files' packages: a message directly in one of them is a namespace member.
OWN_PACKAGES = ("inference", "tensorflow", "tensorflow.serving")

# A Python with our module imported first, then the clients' modules, then our module once more:
# both orders in one process, since importing TensorFlow takes seconds.
IMPORT_BOTH_ORDERS = """
import importlib.util
import gpuport.protocol.serving
import tritonclient.grpc
from tensorflow_serving.apis import get_model_metadata_pb2, predict_pb2, prediction_service_pb2
spec = importlib.util.find_spec("gpuport.protocol.serving")
again = importlib.util.module_from_spec(spec)
spec.loader.exec_module(again)
assert again.kserve.ModelInferRequest is not tritonclient.grpc.service_pb2.ModelInferRequest
assert again.tfs.PredictRequest.FromString(predict_pb2.PredictRequest(output_filter=["y"]).SerializeToString())
print("ok")
"""


@pytest.fixture(scope="module", autouse=True)
def import_both_orders() -> Iterator[subprocess.Popen[str]]:
    """Starts the import-order check first, so that it imports TensorFlow while this process does."""
    process = subprocess.Popen(
        [sys.executable, "-W", "error", "-c", IMPORT_BOTH_ORDERS],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()


@pytest.fixture(scope="module")
def published() -> SimpleNamespace:
    """The clients' own generated modules (tensorflow_serving's import TensorFlow: seconds)."""
    service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
    from tritonclient.grpc import model_config_pb2

    pytest.importorskip("tensorflow_serving.apis")
    from tensorflow.core.framework import resource_handle_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
    from tensorflow.core.protobuf import meta_graph_pb2
    from tensorflow_serving.apis import get_model_metadata_pb2, model_pb2, predict_pb2, prediction_service_pb2

    modules = [
        model_config_pb2,
        service_pb2,
        model_pb2,
        predict_pb2,
        get_model_metadata_pb2,
        prediction_service_pb2,
        types_pb2,
        tensor_shape_pb2,
        resource_handle_pb2,
        tensor_pb2,
        meta_graph_pb2,
    ]
    files = [descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb) for module in modules]
    return SimpleNamespace(
        triton=service_pb2,
        predict=predict_pb2,
        metadata=get_model_metadata_pb2,
        types=types_pb2,
        index=_Index(files),
    )


def _ours() -> list[descriptor_pb2.FileDescriptorProto]:
    files = descriptor_pb2.FileDescriptorSet.FromString((SERVING / "serving.desc").read_bytes()).file
    return [file for file in files if file.name.startswith("gpuport/")]


class _Index:
    """Every message, enum and service of some files, by full name (nested messages included)."""

    def __init__(self, files: list[descriptor_pb2.FileDescriptorProto]) -> None:
        self.messages: dict[str, descriptor_pb2.DescriptorProto] = {}
        self.enums: dict[str, descriptor_pb2.EnumDescriptorProto] = {}
        self.services: dict[str, descriptor_pb2.ServiceDescriptorProto] = {}
        for file in files:
            self._add(file.package, file.message_type, file.enum_type)
            self.services.update((f"{file.package}.{s.name}", s) for s in file.service)

    def _add(self, scope: str, messages: Any, enums: Any) -> None:
        self.enums.update((f"{scope}.{e.name}", e) for e in enums)
        for message in messages:
            self.messages[f"{scope}.{message.name}"] = message
            self._add(f"{scope}.{message.name}", message.nested_type, message.enum_type)


def _signature(message: descriptor_pb2.DescriptorProto, field: descriptor_pb2.FieldDescriptorProto) -> tuple:
    oneof = message.oneof_decl[field.oneof_index].name if field.HasField("oneof_index") else None
    return (field.number, field.type, field.type_name, field.label, oneof, field.proto3_optional, field.options.packed)


def _reserved(message: descriptor_pb2.DescriptorProto) -> set[tuple[int, int]]:
    return {(r.start, r.end) for r in message.reserved_range}


def _method(method: descriptor_pb2.MethodDescriptorProto) -> tuple:
    return (method.input_type, method.output_type, method.client_streaming, method.server_streaming)


def _reachable(published: _Index) -> set[str]:
    """The published message and enum types that the served rpcs carry, less what LEFT_OUT cuts off."""
    # SignatureDefMap travels packed in GetModelMetadataResponse.metadata's Any, not as a field type.
    todo = ["tensorflow.serving.SignatureDefMap"] + [
        type_name.lstrip(".")
        for service, methods in SERVED.items()
        for method in published.services[service].method
        if method.name in methods
        for type_name in (method.input_type, method.output_type)
    ]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or name.startswith("google.protobuf."):
            continue
        seen.add(name)
        for field in published.messages[name].field if name in published.messages else []:
            if f"{name}.{field.name}" not in LEFT_OUT and field.type_name:
                todo.append(field.type_name.lstrip("."))
    return seen


def test_every_field_is_the_published_one(published: SimpleNamespace) -> None:
    theirs: _Index = published.index
    ours = _Index(_ours())
    assert set(ours.messages) | set(ours.enums) == _reachable(theirs)
    for name, message in ours.messages.items():
        their_fields = {f.name: _signature(theirs.messages[name], f) for f in theirs.messages[name].field}
        our_fields = {f.name: _signature(message, f) for f in message.field}
        assert our_fields == {k: v for k, v in their_fields.items() if f"{name}.{k}" not in LEFT_OUT}, name
        assert message.options.map_entry == theirs.messages[name].options.map_entry, name
        assert _reserved(message) >= _reserved(theirs.messages[name]), name
    for name, enum in ours.enums.items():
        assert [(v.name, v.number) for v in enum.value] == [(v.name, v.number) for v in theirs.enums[name].value]


def test_the_services_have_the_published_methods(published: SimpleNamespace) -> None:
    theirs: _Index = published.index
    ours = _Index(_ours())
    assert set(ours.services) == set(SERVED)
    for service, methods in SERVED.items():
        their_methods = {m.name: _method(m) for m in theirs.services[service].method}
        assert {m.name: _method(m) for m in ours.services[service].method} == {k: their_methods[k] for k in methods}
    paths = {f"/{s.full_name}/{m.name}" for s in map(POOL.FindServiceByName, SERVED) for m in s.methods}
    assert {"/inference.GRPCInferenceService/ModelInfer", "/tensorflow.serving.PredictionService/Predict"} <= paths


def test_the_namespaces_hold_every_message_and_data_type(published: SimpleNamespace) -> None:
    ours = _Index(_ours())
    top_level = {name.rsplit(".", 1)[1]: name for name in ours.messages if name.rsplit(".", 1)[0] in OWN_PACKAGES}
    for short, full in top_level.items():
        namespace = kserve if full.startswith("inference.") else tfs
        assert getattr(namespace, short).DESCRIPTOR.full_name == full
    assert (
        kserve.ModelInferRequest.InferInputTensor.DESCRIPTOR.full_name == "inference.ModelInferRequest.InferInputTensor"
    )
    for name, number in published.types.DataType.items():
        assert getattr(tfs, name) == number
    assert tfs.DT_FLOAT == 1 and tfs.DataType.Name(7) == "DT_STRING"


def test_the_descriptor_set_is_compiled_from_the_proto_files(tmp_path: Path) -> None:
    """serving.desc is committed; a .proto edited without `make proto` fails here."""
    protoc = pytest.importorskip("grpc_tools.protoc")
    out = tmp_path / "serving.desc"
    sources = sorted(str(path.relative_to(ROOT)) for path in SERVING.glob("*.proto"))
    # In a process of its own: protoc's C++ clashes with the TensorFlow this process has loaded.
    args = ["-I", ".", "--include_imports", f"--descriptor_set_out={out}", *sources]
    subprocess.run([sys.executable, "-m", protoc.__name__, *args], cwd=ROOT, check=True)
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    committed = descriptor_pb2.FileDescriptorSet.FromString((SERVING / "serving.desc").read_bytes())
    assert fresh == committed, "serving.desc is stale: run `make proto`"


def test_the_well_known_types_are_the_private_pool_s_own() -> None:
    version = tfs.ModelSpec.DESCRIPTOR.fields_by_name["version"].message_type
    metadata = tfs.GetModelMetadataResponse.DESCRIPTOR.fields_by_name["metadata"].message_type
    any_type = metadata.fields_by_name["value"].message_type
    assert (version.full_name, any_type.full_name) == ("google.protobuf.Int64Value", "google.protobuf.Any")
    assert version.file.pool is POOL and any_type.file.pool is POOL
    assert any_type_url(tfs.SignatureDefMap) == "type.googleapis.com/tensorflow.serving.SignatureDefMap"


def test_import_in_either_order_with_the_clients_modules(import_both_orders: subprocess.Popen[str]) -> None:
    stdout, stderr = import_both_orders.communicate(timeout=120)
    assert import_both_orders.returncode == 0, stderr
    assert stdout == "ok\n"


# KServe v2: the request tritonclient really sends, built by its own code.


def _triton_request() -> Any:
    import tritonclient.grpc as triton
    from tritonclient.grpc._utils import _get_inference_request

    images = triton.InferInput("IMAGES", [2, 3], "FP32")
    images.set_data_from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
    words = triton.InferInput("WORDS", [2], "BYTES")
    words.set_data_from_numpy(np.array([b"gpu", b"port"], dtype=np.object_))
    mapped = triton.InferInput("MAPPED", [4], "INT64")
    mapped.set_shared_memory("region0", 32, offset=8)
    outputs = [triton.InferRequestedOutput("SCORES", class_count=3), triton.InferRequestedOutput("LABELS")]
    return _get_inference_request(
        model_name="resnet",
        inputs=[images, words, mapped],
        model_version="2",
        request_id="req-1",
        outputs=outputs,
        sequence_id=7,
        sequence_start=True,
        sequence_end=False,
        priority=5,
        timeout=1000,
        parameters={"note": "hi", "scale": 0.5},
    )


def _as_dict(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def test_a_tritonclient_request_parses_in_ours_field_for_field(published: SimpleNamespace) -> None:
    theirs = _triton_request()
    ours = kserve.ModelInferRequest.FromString(theirs.SerializeToString())
    assert _as_dict(ours) == _as_dict(theirs)
    assert [tensor.name for tensor in ours.inputs] == ["IMAGES", "WORDS", "MAPPED"]
    assert list(ours.inputs[0].shape) == [2, 3] and ours.inputs[1].datatype == "BYTES"
    assert ours.inputs[2].parameters["shared_memory_region"].string_param == "region0"
    assert ours.raw_input_contents[0] == np.arange(6, dtype=np.float32).tobytes()
    assert ours.raw_input_contents[1] == b"\x03\x00\x00\x00gpu\x04\x00\x00\x00port"
    assert ours.parameters["priority"].WhichOneof("parameter_choice") == "uint64_param"
    assert ours.parameters["scale"].double_param == 0.5 and ours.parameters["sequence_start"].bool_param
    assert ours.outputs[0].parameters["classification"].int64_param == 3
    assert ours.SerializeToString(deterministic=True) == theirs.SerializeToString(deterministic=True)


def _infer_response(classes: Any) -> Any:
    response = classes.ModelInferResponse(model_name="resnet", model_version="2", id="req-1")
    response.parameters["sequence_end"].bool_param = True
    scores = response.outputs.add(name="SCORES", datatype="FP32", shape=[2, 2])
    scores.parameters["binary_data_size"].int64_param = 16
    response.raw_output_contents.append(np.array([[0.1, 0.9], [0.8, 0.2]], dtype=np.float32).tobytes())
    response.outputs.add(name="LABELS", datatype="BYTES", shape=[2])
    response.raw_output_contents.append(b"\x03\x00\x00\x00cat\x03\x00\x00\x00dog")
    # Typed contents instead of raw: tritonclient's InferResult reads only raw (and BYTES) ones.
    counts = response.outputs.add(name="COUNTS", datatype="INT32", shape=[2])
    counts.contents.int_contents.extend([1, 0])
    return response


def test_our_response_parses_in_tritonclient_and_reads_as_numpy(published: SimpleNamespace) -> None:
    import tritonclient.grpc as triton

    ours = _infer_response(kserve)
    theirs = published.triton.ModelInferResponse.FromString(ours.SerializeToString())
    assert theirs == _infer_response(published.triton)
    result = triton.InferResult(theirs)
    np.testing.assert_array_equal(result.as_numpy("SCORES"), np.array([[0.1, 0.9], [0.8, 0.2]], dtype=np.float32))
    assert list(result.as_numpy("LABELS")) == [b"cat", b"dog"]
    assert list(theirs.outputs[2].contents.int_contents) == [1, 0]


def test_our_request_parses_in_tritonclient_equal(published: SimpleNamespace) -> None:
    theirs = _triton_request()
    ours = kserve.ModelInferRequest()
    json_format.ParseDict(_as_dict(theirs), ours)  # built on our side, not copied as bytes
    assert published.triton.ModelInferRequest.FromString(ours.SerializeToString()) == theirs


def test_the_small_kserve_messages_cross_both_ways(published: SimpleNamespace) -> None:
    samples = {
        "ServerLiveResponse": {"live": True},
        "ServerReadyResponse": {"ready": True},
        "ModelReadyRequest": {"name": "resnet", "version": "2"},
        "ServerMetadataResponse": {"name": "gpuport", "version": "0.9", "extensions": ["binary_tensor_data"]},
        "ModelMetadataResponse": {
            "name": "resnet",
            "versions": ["1", "2"],
            "platform": "onnxruntime_onnx",
            "inputs": [{"name": "IMAGES", "datatype": "FP32", "shape": ["-1", "3"]}],
            "outputs": [{"name": "SCORES", "datatype": "FP32", "shape": ["-1", "2"]}],
        },
    }
    for name, fields in samples.items():
        ours = json_format.ParseDict(fields, getattr(kserve, name)())
        theirs = json_format.ParseDict(fields, getattr(published.triton, name)())
        assert getattr(published.triton, name).FromString(ours.SerializeToString()) == theirs, name
        assert getattr(kserve, name).FromString(theirs.SerializeToString()) == ours, name


# TensorFlow Serving: tensors made by TensorFlow's own make_tensor_proto / read by make_ndarray.


def test_a_tensorflow_serving_request_parses_in_ours(published: SimpleNamespace) -> None:
    import tensorflow as tf

    theirs = published.predict.PredictRequest(output_filter=["scores"])
    theirs.model_spec.name = "resnet"
    theirs.model_spec.version.value = 3
    theirs.model_spec.signature_name = "serving_default"
    theirs.inputs["images"].CopyFrom(tf.make_tensor_proto(np.arange(6, dtype=np.float32).reshape(2, 3)))
    theirs.inputs["words"].CopyFrom(tf.make_tensor_proto([b"gpu", b"port"]))
    theirs.inputs["scale"].CopyFrom(tf.make_tensor_proto(0.5, dtype=tf.float32))
    ours = tfs.PredictRequest.FromString(theirs.SerializeToString())
    assert _as_dict(ours) == _as_dict(theirs)
    images = ours.inputs["images"]
    assert images.dtype == tfs.DT_FLOAT and [d.size for d in images.tensor_shape.dim] == [2, 3]
    assert images.tensor_content == np.arange(6, dtype=np.float32).tobytes()
    assert list(ours.inputs["words"].string_val) == [b"gpu", b"port"]
    assert list(ours.inputs["scale"].float_val) == [0.5]
    assert ours.model_spec.version.value == 3 and ours.model_spec.WhichOneof("version_choice") == "version"
    assert ours.SerializeToString(deterministic=True) == theirs.SerializeToString(deterministic=True)


def _predict_response(classes: ModuleType | SimpleNamespace, tensor_classes: Any) -> Any:
    response = classes.PredictResponse()
    response.model_spec.name = "resnet"
    response.model_spec.version.value = 3
    scores = response.outputs["scores"]
    scores.dtype = tensor_classes.DT_FLOAT
    scores.tensor_shape.dim.add(size=2)
    scores.tensor_shape.dim.add(size=2)
    scores.tensor_content = np.array([[0.1, 0.9], [0.8, 0.2]], dtype=np.float32).tobytes()
    labels = response.outputs["labels"]
    labels.dtype = tensor_classes.DT_STRING
    labels.tensor_shape.dim.add(size=2)
    labels.string_val.extend([b"cat", b"dog"])
    threshold = response.outputs["threshold"]
    threshold.dtype = tensor_classes.DT_FLOAT
    threshold.float_val.append(0.25)
    return response


def test_our_predict_response_reads_in_tensorflow(published: SimpleNamespace) -> None:
    import tensorflow as tf
    from tensorflow.core.framework import types_pb2

    ours = _predict_response(tfs, tfs)
    theirs = published.predict.PredictResponse.FromString(ours.SerializeToString())
    assert theirs == _predict_response(published.predict, types_pb2)
    assert theirs.model_spec.version.value == 3
    np.testing.assert_array_equal(
        tf.make_ndarray(theirs.outputs["scores"]), np.array([[0.1, 0.9], [0.8, 0.2]], dtype=np.float32)
    )
    assert list(tf.make_ndarray(theirs.outputs["labels"])) == [b"cat", b"dog"]
    assert tf.make_ndarray(theirs.outputs["threshold"]) == np.float32(0.25)


def _signature_def_map(classes: Any, signature_classes: Any) -> Any:
    signatures = classes.SignatureDefMap()
    signature = signatures.signature_def["serving_default"]
    signature.method_name = "tensorflow/serving/predict"
    images = signature.inputs["images"]
    images.name = "serving_default_images:0"
    images.dtype = signature_classes.DT_FLOAT
    images.tensor_shape.dim.add(size=-1)
    images.tensor_shape.dim.add(size=3)
    scores = signature.outputs["scores"]
    scores.name = "StatefulPartitionedCall:0"
    scores.dtype = signature_classes.DT_FLOAT
    scores.tensor_shape.dim.add(size=-1)
    return signatures


def test_a_signature_def_map_packed_in_our_any_unpacks_in_tensorflow_serving(published: SimpleNamespace) -> None:
    from tensorflow.core.framework import types_pb2

    ours = tfs.GetModelMetadataResponse()
    ours.model_spec.name = "resnet"
    ours.model_spec.version.value = 3
    ours.metadata["signature_def"].Pack(_signature_def_map(tfs, tfs))
    assert ours.metadata["signature_def"].type_url == any_type_url(tfs.SignatureDefMap)

    theirs = published.metadata.GetModelMetadataResponse.FromString(ours.SerializeToString())
    unpacked = published.metadata.SignatureDefMap()
    assert theirs.metadata["signature_def"].Unpack(unpacked)
    assert unpacked == _signature_def_map(published.metadata, types_pb2)

    # And back: theirs packed, ours unpacks.
    back = tfs.GetModelMetadataResponse.FromString(theirs.SerializeToString())
    mine = tfs.SignatureDefMap()
    assert back.metadata["signature_def"].Unpack(mine) and mine == _signature_def_map(tfs, tfs)
    request = published.metadata.GetModelMetadataRequest(metadata_field=["signature_def"])
    request.model_spec.name = "resnet"
    assert tfs.GetModelMetadataRequest.FromString(request.SerializeToString()).metadata_field == ["signature_def"]
