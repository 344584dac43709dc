"""The prediction protocols' messages: KServe v2 (Triton's) and TensorFlow Serving's, on the server side.

``kserve`` holds package ``inference`` (``kserve.ModelInferRequest``, nested types by attribute:
``kserve.ModelInferRequest.InferInputTensor``); ``tfs`` holds packages ``tensorflow.serving`` and
``tensorflow`` (``tfs.PredictRequest``, ``tfs.TensorProto``, ``tfs.SignatureDefMap``) and the
``DataType`` values as ints (``tfs.DT_FLOAT == 1``; ``tfs.DataType.Name(1) == "DT_FLOAT"``).

The messages are built from ``serving.desc`` (compiled from the ``.proto`` files beside it: ``make
proto``) into a descriptor pool of their own, not the default pool: tritonclient,
tensorflow-serving-api and TensorFlow register these same message names there, and a second
registration of a name fails. Only names and field numbers travel on the wire, so the private
copies interoperate with theirs; ``google.protobuf.Any`` and ``Int64Value`` are the pool's own
copies too, and ``Any.Pack``/``Unpack`` work across pools because they go by full name.

>>> spec = tfs.ModelSpec(name="resnet", signature_name="serving_default")
>>> spec.version.value = 3
>>> tfs.TensorProto(dtype=tfs.DT_FLOAT, float_val=[1.0]).dtype
1
"""

from __future__ import annotations

from importlib import resources
from types import SimpleNamespace
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

# The gRPC service names; a method's path is f"/{service}/{method}".
KSERVE_SERVICE = "inference.GRPCInferenceService"
TFS_SERVICE = "tensorflow.serving.PredictionService"


def _load_pool() -> tuple[descriptor_pool.DescriptorPool, list[str]]:
    data = resources.files(__name__).joinpath("serving.desc").read_bytes()
    pool = descriptor_pool.DescriptorPool()
    files = descriptor_pb2.FileDescriptorSet.FromString(data).file
    # protoc writes the files of a --include_imports set with every dependency before its dependents.
    for file in files:
        pool.Add(file)
    return pool, [file.name for file in files if file.name.startswith("gpuport/")]


# Every descriptor of both protocols (services included: POOL.FindServiceByName(KSERVE_SERVICE)).
POOL, _FILES = _load_pool()


def _namespace(*packages: str) -> SimpleNamespace:
    """Each top-level message of these packages as a class, each enum with its values as ints."""
    members: dict[str, Any] = {}
    for file in map(POOL.FindFileByName, _FILES):
        if file.package not in packages:
            continue
        for message_name, message in file.message_types_by_name.items():
            members[message_name] = message_factory.GetMessageClass(message)
        for enum_name, enum in file.enum_types_by_name.items():
            members[enum_name] = EnumTypeWrapper(enum)
            members.update((value.name, value.number) for value in enum.values)
    return SimpleNamespace(**members)


kserve = _namespace("inference")
"""KServe v2 messages (package ``inference``): ``kserve.ModelInferRequest``, ``kserve.ServerLiveResponse``, ..."""

tfs = _namespace("tensorflow.serving", "tensorflow")
"""TensorFlow Serving messages (packages ``tensorflow.serving`` and ``tensorflow``) and DataType values."""


def any_type_url(message_class: Any) -> str:
    """The ``type_url`` that ``Any.Pack`` gives a message of this class (or this message).

    >>> any_type_url(tfs.SignatureDefMap)
    'type.googleapis.com/tensorflow.serving.SignatureDefMap'
    """
    return f"type.googleapis.com/{message_class.DESCRIPTOR.full_name}"
