"""The wire: generated stubs match the .proto, and errors survive the trip through the table."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

import gpuport
from gpuport.protocol.errors import ERROR_TABLE, error_from_status, status_for

ROOT = Path(__file__).resolve().parents[1]


def _drop_json_names(messages) -> None:  # type: ignore[no-untyped-def]
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        _drop_json_names(message.nested_type)


def test_generated_stubs_match_the_proto(tmp_path: Path) -> None:
    """Compares descriptors, not generated text, so a newer grpcio-tools does not fail it."""
    protoc = pytest.importorskip("grpc_tools.protoc")
    from google.protobuf import descriptor_pb2

    from gpuport.protocol import gpuport_pb2

    source = tmp_path / "gpuport" / "protocol"
    source.mkdir(parents=True)
    shutil.copy(ROOT / "gpuport" / "protocol" / "gpuport.proto", source)
    out = tmp_path / "descriptor.pb"
    # In a process of its own: protoc's C++ clashes with a TensorFlow that another test may have loaded.
    args = [f"-I{tmp_path}", f"--descriptor_set_out={out}", "gpuport/protocol/gpuport.proto"]
    subprocess.run([sys.executable, "-m", protoc.__name__, *args], check=True)
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    _drop_json_names(fresh.message_type)  # protoc adds them; the generated module leaves them out
    committed = descriptor_pb2.FileDescriptorProto.FromString(gpuport_pb2.DESCRIPTOR.serialized_pb)
    assert fresh == committed, "gpuport_pb2.py is stale: run `make proto`"


@pytest.mark.parametrize("cls", list(ERROR_TABLE))
def test_every_error_class_comes_back_as_itself(cls: type[gpuport.GpuportError]) -> None:
    code, http_status = status_for(cls("x"))
    assert 400 <= http_status < 600
    assert type(error_from_status(code, "x", cls.__name__)) is cls
    # Without the trailer (a plain gRPC peer), the status code alone still picks the family.
    assert isinstance(error_from_status(code, "x"), gpuport.GpuportError)


def test_an_unknown_status_is_a_server_error() -> None:
    assert type(error_from_status(grpc.StatusCode.DATA_LOSS, "x")) is gpuport.ServerError
