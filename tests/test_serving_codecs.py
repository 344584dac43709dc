"""The prediction protocols' codecs against the real clients' own encoders and decoders, no server:
tritonclient.http builds KServe v2 requests and reads our responses; TF Serving's REST bodies are
checked against the examples of its REST API documentation."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from gpuport.protocol.errors import InvalidRequest
from gpuport.server.serving.kserve_rest import form_kserve, parse_kserve
from gpuport.server.serving.tfs_rest import form_tfs_predict, parse_tfs_predict, tfs_error, tfs_to_inputs

httpclient = pytest.importorskip("tritonclient.http")
ml_dtypes = pytest.importorskip("ml_dtypes")
Client = httpclient.InferenceServerClient

RNG = np.random.default_rng(0)

# name → (KServe datatype, a sample array): one of each kind the protocol carries.
SAMPLES: dict[str, tuple[str, np.ndarray]] = {
    "fp32": ("FP32", RNG.standard_normal((2, 3)).astype(np.float32)),
    "fp64": ("FP64", RNG.standard_normal(4)),
    "fp16": ("FP16", RNG.standard_normal((3, 2)).astype(np.float16)),
    "int64": ("INT64", np.array([[-(2**62), 0, 2**62 + 1]], dtype=np.int64)),
    "int32_3d": ("INT32", np.arange(24, dtype=np.int32).reshape(2, 3, 4)),
    "uint8": ("UINT8", np.array([0, 7, 255], dtype=np.uint8)),
    "bool": ("BOOL", np.array([[True, False], [False, True]])),
    "bytes": ("BYTES", np.array([b"foo", b"", "h\u00e9".encode()], dtype=object)),
    "scalar_batch": ("FP32", np.array([[1.5]], dtype=np.float32)),
}


def request_body(
    arrays: dict[str, tuple[str, np.ndarray, bool]],
    outputs: list[tuple[str, bool]] | None = None,
    request_id: str = "",
    parameters: dict[str, Any] | None = None,
) -> tuple[bytes, int | None]:
    """A request body as tritonclient.http builds it: name → (datatype, array, binary)."""
    inputs = []
    for name, (datatype, array, binary) in arrays.items():
        tensor = httpclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array, binary_data=binary)
        inputs.append(tensor)
    requested = [httpclient.InferRequestedOutput(name, binary_data=binary) for name, binary in outputs or []]
    return Client.generate_request_body(inputs, outputs=requested, request_id=request_id, parameters=parameters)


def assert_same(received: np.ndarray, expected: np.ndarray) -> None:
    assert received.shape == expected.shape
    if expected.dtype == object:
        assert [x if isinstance(x, bytes) else x.encode() for x in received.ravel()] == list(expected.ravel())
    else:
        assert received.dtype == expected.dtype
        np.testing.assert_array_equal(received, expected)


# --- KServe v2: requests tritonclient builds ----------------------------------------------------------


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("sample", list(SAMPLES))
def test_kserve_request_from_tritonclient(sample: str, binary: bool) -> None:
    datatype, array = SAMPLES[sample]
    body, header_length = request_body({"x": (datatype, array, binary)})
    assert (header_length is not None) == binary

    request = parse_kserve(body, header_length)

    (item,) = request.inputs
    assert (item.name, item.datatype, item.shape) == ("x", datatype, list(array.shape))
    assert_same(item.array, array)


def test_kserve_request_mixes_binary_and_json_inputs() -> None:
    body, header_length = request_body(
        {
            "a": ("FP32", SAMPLES["fp32"][1], True),
            "b": ("BYTES", SAMPLES["bytes"][1], False),
            "c": ("INT32", SAMPLES["int32_3d"][1], True),
            "d": ("BYTES", SAMPLES["bytes"][1], True),
            "e": ("BOOL", SAMPLES["bool"][1], False),
        },
        outputs=[("y", True), ("z", False)],
        request_id="req-7",
        parameters={"temperature": 3},
    )

    request = parse_kserve(body, header_length)

    assert request.id == "req-7"
    assert request.parameters == {"temperature": 3}
    assert [i.name for i in request.inputs] == ["a", "b", "c", "d", "e"]
    for item, (_, array) in zip(request.inputs, [SAMPLES[k] for k in ("fp32", "bytes", "int32_3d", "bytes", "bool")]):
        assert_same(item.array, array)
    assert [(o.name, o.binary) for o in request.outputs] == [("y", True), ("z", False)]
    assert request.binary_output("y") and not request.binary_output("z")


def test_binary_input_is_a_view_of_the_body() -> None:
    array = np.arange(8, dtype=np.float64)
    header = json.dumps(
        {"inputs": [{"name": "x", "shape": [8], "datatype": "FP64", "parameters": {"binary_data_size": 64}}]}
    ).encode()
    header += b" " * (-len(header) % 8)  # aligned, so nothing needs copying
    body = header + array.tobytes()

    received = parse_kserve(body, len(header)).inputs[0].array

    assert np.shares_memory(received, np.frombuffer(body, dtype=np.uint8))
    np.testing.assert_array_equal(received, array)


def test_misaligned_binary_input_is_copied() -> None:
    header = json.dumps(
        {"inputs": [{"name": "x", "shape": [2], "datatype": "FP64", "parameters": {"binary_data_size": 16}}]}
    ).encode()
    header += b" " * (8 - len(header) % 8 + 1)
    body = header + np.array([1.0, 2.0]).tobytes()

    received = parse_kserve(body, len(header)).inputs[0].array

    assert received.flags.aligned
    np.testing.assert_array_equal(received, [1.0, 2.0])


def test_binary_output_precedence() -> None:
    # tritonclient sends binary_data_output: true when it names no outputs.
    body, header_length = request_body({"x": ("FP32", SAMPLES["fp32"][1], False)})
    assert parse_kserve(body, header_length).binary_output("anything")

    header = {
        "inputs": [{"name": "x", "shape": [1], "datatype": "INT32", "data": [1]}],
        "parameters": {"binary_data_output": True},
        "outputs": [{"name": "json", "parameters": {"binary_data": False}}, {"name": "unsaid"}],
    }
    request = parse_kserve(json.dumps(header).encode(), None)
    assert not request.binary_output("json")
    assert request.binary_output("unsaid")
    assert request.binary_output("unlisted")
    assert request.outputs[1].binary is None

    del header["parameters"]
    request = parse_kserve(json.dumps(header).encode(), None)
    assert not request.binary_output("unsaid")


def test_nan_and_infinity_tokens_in_requests() -> None:
    body = b'{"inputs": [{"name": "x", "shape": [3], "datatype": "FP32", "data": [NaN, Infinity, -Infinity]}]}'

    received = parse_kserve(body, None).inputs[0].array

    assert np.isnan(received[0]) and received[1] == np.inf and received[2] == -np.inf


def test_nested_data_matching_the_shape() -> None:
    body = b'{"inputs": [{"name": "x", "shape": [2, 2], "datatype": "INT16", "data": [[1, 2], [3, 4]]}]}'

    received = parse_kserve(body, None).inputs[0].array

    assert received.dtype == np.int16
    np.testing.assert_array_equal(received, [[1, 2], [3, 4]])


# --- KServe v2: responses tritonclient reads ----------------------------------------------------------


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("sample", list(SAMPLES))
def test_kserve_response_read_by_tritonclient(sample: str, binary: bool) -> None:
    datatype, array = SAMPLES[sample]

    body, header_length = form_kserve("mlp", "3", "req-1", [("y", array)], binary)

    assert (header_length is not None) == binary
    result = Client.parse_response_body(body, header_length=header_length)
    assert_same(result.as_numpy("y"), array)
    response = result.get_response()
    assert (response["model_name"], response["model_version"], response["id"]) == ("mlp", "3", "req-1")
    assert result.get_output("y")["datatype"] == datatype


def test_kserve_response_mixes_binary_and_json_outputs() -> None:
    outputs = [(name, array) for name, (_, array) in SAMPLES.items()]
    binary = {"fp32", "bytes", "bool"}

    body, header_length = form_kserve("m", "1", "", outputs, binary)

    result = Client.parse_response_body(body, header_length=header_length)
    for name, array in outputs:
        assert ("parameters" in result.get_output(name)) == (name in binary)
        assert_same(result.as_numpy(name), array)
    assert "id" not in result.get_response()  # as Triton: no id when the request had none


def test_kserve_response_binary_predicate() -> None:
    outputs = [("a", np.ones(2, np.float32)), ("b", np.zeros(2, np.float32))]

    body, header_length = form_kserve("m", "1", "", outputs, lambda name: name == "b")

    header = json.loads(body[:header_length])
    assert "data" in header["outputs"][0] and header["outputs"][1]["parameters"] == {"binary_data_size": 8}


def test_kserve_response_nan_and_infinity_in_json() -> None:
    array = np.array([np.nan, np.inf, -np.inf, 1.0], dtype=np.float32)

    body, header_length = form_kserve("m", "1", "", [("y", array)], False)

    assert header_length is None and b"[NaN,Infinity,-Infinity,1.0]" in body
    np.testing.assert_array_equal(Client.parse_response_body(body).as_numpy("y"), array)


def test_kserve_bf16_roundtrip() -> None:
    array = np.array([1.5, -2.0, 3.25], dtype=ml_dtypes.bfloat16)
    body, header_length = request_body({"x": ("BF16", array, True)})
    received = parse_kserve(body, header_length).inputs[0].array
    assert received.dtype == array.dtype and received.tolist() == array.tolist()

    body, header_length = form_kserve("m", "1", "", [("y", array)], True)
    assert Client.parse_response_body(body, header_length=header_length).as_numpy("y").tolist() == array.tolist()


def test_non_utf8_bytes_output_goes_binary() -> None:
    array = np.array([b"ok", b"\xff\xfe"], dtype=object)

    body, header_length = form_kserve("m", "1", "", [("y", array), ("t", np.array([b"text"], dtype=object))], False)

    assert header_length is not None
    result = Client.parse_response_body(body, header_length=header_length)
    assert result.get_output("y")["parameters"]["binary_data_size"] == 4 + 2 + 4 + 2
    assert list(result.as_numpy("y")) == [b"ok", b"\xff\xfe"]
    assert result.get_output("t")["data"] == ["text"]


def test_kserve_response_without_binary_is_plain_json() -> None:
    body, header_length = form_kserve("m", "2", "", [("y", np.array([1, 2], dtype=np.int64))], False)

    assert header_length is None
    assert json.loads(body) == {
        "model_name": "m",
        "model_version": "2",
        "outputs": [{"name": "y", "datatype": "INT64", "shape": [2], "data": [1, 2]}],
    }


# --- KServe v2: malformed requests ----------------------------------------------------------------------


def one_input(**fields: Any) -> bytes:
    tensor = {"name": "x", "shape": [2], "datatype": "FP32", "data": [1.0, 2.0]}
    tensor.update(fields)
    return json.dumps({"inputs": [{k: v for k, v in tensor.items() if v is not None}]}).encode()


def binary_input(size: int, data: bytes, datatype: str = "FP32", shape: list[int] | None = None) -> tuple[bytes, int]:
    header = json.dumps(
        {
            "inputs": [
                {"name": "x", "shape": shape or [2], "datatype": datatype, "parameters": {"binary_data_size": size}}
            ]
        }
    ).encode()
    return header + data, len(header)


MALFORMED: dict[str, tuple[bytes, int | None, str]] = {
    "count": (one_input(shape=[2, 2], data=[1, 2, 3]), None, "has 3 elements but shape [2, 2] needs 4"),
    "nesting": (one_input(shape=[3, 2], data=[[1, 2, 3], [4, 5, 6]]), None, "is nested as [2, 3]"),
    "ragged": (one_input(data=[[1, 2], [3]]), None, "not a rectangular tensor"),
    "datatype": (one_input(datatype="FP8"), None, "unknown datatype 'FP8'"),
    "decimal_for_int": (one_input(datatype="INT32", data=[1, 3.5]), None, "decimal numbers (such as 3.5)"),
    "int_range": (one_input(datatype="INT8", data=[1, 300]), None, "300, outside the range of INT8"),
    "number_for_bool": (one_input(datatype="BOOL", data=[1, 0]), None, "must hold true/false for BOOL"),
    "bool_for_number": (one_input(data=[True, False]), None, "must hold numbers for FP32, received true/false"),
    "string_for_number": (one_input(data=["1", "2"]), None, "received strings"),
    "number_for_bytes": (one_input(datatype="BYTES", data=[1, 2]), None, "must hold strings for BYTES"),
    "mixed": (one_input(datatype="BYTES", data=["a", 2]), None, "mixes numbers and strings"),
    "null": (one_input(data=[1.0, None]), None, "null values"),
    "fp32_overflow": (one_input(data=[1.0, 1e300]), None, "beyond the range of FP32"),
    "data_not_list": (one_input(data=5), None, "must be a list"),
    "binary_size": (*binary_input(4, b"\0" * 4), "needs 8 bytes"),
    "missing_trailing": (*binary_input(8, b"\0" * 4), "only 4 bytes are left"),
    "extra_trailing": (*binary_input(8, b"\0" * 12), "4 bytes after the last binary input"),
    "bytes_truncated_length": (*binary_input(6, b"\1\0\0\0a\0", "BYTES", [2]), "ends inside an element's 4-byte"),
    "bytes_truncated_item": (*binary_input(5, b"\5\0\0\0a", "BYTES", [1]), "says 5 bytes but only 1"),
    "bytes_count": (*binary_input(5, b"\1\0\0\0a", "BYTES", [2]), "holds 1 elements but shape [2] needs 2"),
    "bool_bytes": (*binary_input(2, b"\1\2", "BOOL"), "bytes other than 0 and 1"),
    "header_beyond_body": (one_input(), 10_000, "Inference-Header-Content-Length is 10000"),
    "header_zero": (one_input(), 0, "must be a positive integer"),
    "no_header_length": (binary_input(8, b"")[0], None, "no Inference-Header-Content-Length header"),
    "trailing_without_binary": (one_input() + b"\0\0", len(one_input()), "2 bytes after the last binary input"),
    "not_json": (b"\x89PNG not json", None, "not valid JSON"),
    "not_object": (b"[1, 2]", None, "must be a JSON object"),
    "no_inputs": (b'{"outputs": []}', None, "no 'inputs' list"),
    "input_not_object": (b'{"inputs": [3]}', None, "inputs[0] must be an object"),
    "no_name": (one_input(name=None), None, "inputs[0] has no 'name'"),
    "no_datatype": (one_input(datatype=None), None, "input 'x' has no 'datatype'"),
    "no_shape": (one_input(shape=None), None, "input 'x' has no valid 'shape'"),
    "negative_shape": (one_input(shape=[-1]), None, "input 'x' has no valid 'shape'"),
    "no_data": (one_input(data=None), None, "input 'x' has no 'data'"),
    "data_and_binary": (one_input(parameters={"binary_data_size": 8}), None, "both 'data' and binary_data_size"),
    "shared_memory": (one_input(parameters={"shared_memory_region": "r"}), None, "shared memory"),
    "id": (b'{"id": 5, "inputs": []}', None, "'id' must be a string"),
    "binary_data_output": (b'{"inputs": [], "parameters": {"binary_data_output": 1}}', None, "binary_data_output"),
    "output_binary_data": (
        b'{"inputs": [], "outputs": [{"name": "y", "parameters": {"binary_data": "yes"}}]}',
        None,
        "'binary_data' must be true or false",
    ),
    "output_no_name": (b'{"inputs": [], "outputs": [{}]}', None, "outputs[0] must be an object with a 'name'"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_kserve_request(case: str) -> None:
    body, header_length, phrase = MALFORMED[case]

    with pytest.raises(InvalidRequest) as caught:
        parse_kserve(body, header_length)

    assert phrase in str(caught.value)


def test_duplicate_input() -> None:
    tensor = {"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}
    with pytest.raises(InvalidRequest, match="input 'x' is given twice"):
        parse_kserve(json.dumps({"inputs": [tensor, tensor]}).encode(), None)


# --- TensorFlow Serving REST predict ----------------------------------------------------------------------

# The examples of https://www.tensorflow.org/tfx/serving/api_rest (its row example's typo fixed).
ROW_EXAMPLE = {
    "instances": [
        {"tag": "foo", "signal": [1, 2, 3, 4, 5], "sensor": [[1, 2], [3, 4]]},
        {"tag": "bar", "signal": [3, 4, 1, 2, 5], "sensor": [[4, 5], [6, 8]]},
    ]
}
COLUMNAR_EXAMPLE = {
    "inputs": {
        "tag": ["foo", "bar"],
        "signal": [[1, 2, 3, 4, 5], [3, 4, 1, 2, 5]],
        "sensor": [[[1, 2], [3, 4]], [[4, 5], [6, 8]]],
    }
}
EXAMPLE_SPECS = [("tag", np.dtype(object)), ("signal", np.dtype(np.int32)), ("sensor", np.dtype(np.float32))]


def tfs(body: dict[str, Any]) -> tuple[str, dict[str, np.ndarray] | np.ndarray, str]:
    return parse_tfs_predict(json.dumps(body).encode())


def test_tfs_row_unnamed() -> None:
    signature, inputs, style = tfs({"instances": [1.0, 2.0, 5.0]})

    assert (signature, style) == ("", "row")
    assert isinstance(inputs, np.ndarray)
    converted = tfs_to_inputs(inputs, [("x", np.dtype(np.float32))])
    np.testing.assert_array_equal(converted["x"], np.array([1.0, 2.0, 5.0], dtype=np.float32))
    assert converted["x"].dtype == np.float32


@pytest.mark.parametrize(
    ("instances", "expected"),
    [
        (["foo", "bar", "baz"], np.array([b"foo", b"bar", b"baz"], dtype=object)),
        ([[[1, 2]], [[3, 4]]], np.array([[[1, 2]], [[3, 4]]])),
        ([{"b64": "aW1hZ2UgYnl0ZXM="}, {"b64": "YXdlc29tZSBpbWFnZSBieXRlcw=="}], None),
    ],
    ids=["strings", "nested", "b64"],
)
def test_tfs_row_unnamed_documented_values(instances: list[Any], expected: np.ndarray | None) -> None:
    _, inputs, _ = tfs({"instances": instances})

    assert isinstance(inputs, np.ndarray)
    if expected is None:
        assert list(inputs) == [b"image bytes", b"awesome image bytes"]
    else:
        assert_same(inputs, expected)


def test_tfs_row_and_columnar_examples_agree() -> None:
    _, rows, row_style = tfs({"signature_name": "serving_default", **ROW_EXAMPLE})
    signature, columns, column_style = tfs({"signature_name": "serving_default", **COLUMNAR_EXAMPLE})

    assert (signature, row_style, column_style) == ("serving_default", "row", "columnar")
    assert isinstance(rows, dict) and isinstance(columns, dict)
    rows, columns = tfs_to_inputs(rows, EXAMPLE_SPECS), tfs_to_inputs(columns, EXAMPLE_SPECS)
    for name, dtype in EXAMPLE_SPECS:
        assert rows[name].dtype == columns[name].dtype == dtype
        assert_same(rows[name], columns[name])
    assert rows["sensor"].shape == (2, 2, 2) and rows["signal"].shape == (2, 5)
    assert list(rows["tag"]) == [b"foo", b"bar"]


def test_tfs_columnar_unnamed_and_b64() -> None:
    _, single, _ = tfs({"inputs": [[1, 2], [3, 4]]})
    assert isinstance(single, np.ndarray) and single.shape == (2, 2)

    _, scalar, _ = tfs({"inputs": 5})
    assert isinstance(scalar, np.ndarray) and scalar.shape == ()

    _, image, _ = tfs({"inputs": {"b64": "aW1hZ2UgYnl0ZXM="}})
    assert isinstance(image, np.ndarray) and image.item() == b"image bytes"

    _, named, _ = tfs({"instances": [{"image_bytes": {"b64": "aW1hZ2UgYnl0ZXM="}, "caption": "seaside"}]})
    assert isinstance(named, dict)
    assert list(named["image_bytes"]) == [b"image bytes"] and list(named["caption"]) == [b"seaside"]


MALFORMED_TFS: dict[str, tuple[Any, str]] = {
    "both": ({"instances": [1], "inputs": [1]}, "has both 'instances' and 'inputs'"),
    "neither": ({"signature_name": "x"}, "has neither 'instances' nor 'inputs'"),
    "row_shapes": (
        {"instances": [{"signal": [1, 2, 3, 4, 5]}, {"signal": [1, 2, 3]}]},
        "row 1 of input 'signal' in 'instances' has shape [3] but row 0 has [5]",
    ),
    "unnamed_row_shapes": ({"instances": [[1, 2], [3]]}, "row 1 of 'instances' has shape [1] but row 0 has [2]"),
    "row_keys": ({"instances": [{"a": 1, "b": 2}, {"a": 1}]}, "every row must name the same inputs"),
    "objects_then_values": ({"instances": [{"a": 1}, 2]}, "mixes objects and values"),
    "values_then_objects": ({"instances": [1, {"a": 2}]}, "mixes values and objects"),
    "instances_not_list": ({"instances": 3}, "'instances' must be a list"),
    "instances_empty": ({"instances": []}, "'instances' is empty"),
    "bad_b64": ({"inputs": {"b64": "not base64!"}}, "not valid base64"),
    "signature": ({"signature_name": 3, "inputs": [1]}, "'signature_name' must be a string"),
    "not_object": ([1, 2], "must be a JSON object"),
    "ragged_columns": ({"inputs": {"a": [[1, 2], [3]]}}, "input 'a' in 'inputs' is not a rectangular tensor"),
}


@pytest.mark.parametrize("case", list(MALFORMED_TFS))
def test_malformed_tfs_request(case: str) -> None:
    body, phrase = MALFORMED_TFS[case]

    with pytest.raises(InvalidRequest) as caught:
        tfs(body)

    assert phrase in str(caught.value)


def test_tfs_not_json() -> None:
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        parse_tfs_predict(b"{instances: [1]}")


@pytest.mark.parametrize(
    ("raw", "specs", "phrase"),
    [
        (np.array([1.0]), [("a", np.float32), ("b", np.float32)], "one unnamed input but the signature takes 2 (a, b)"),
        ({"a": np.array([1.0])}, [("a", np.float32), ("b", np.float32)], "missing input b"),
        ({"a": np.array([1.0]), "c": np.array([1.0])}, [("a", np.float32)], "unknown input c"),
        ({"a": np.array([1.5])}, [("a", np.int32)], "whole numbers for DT_INT32, received decimal numbers"),
        ({"a": np.array([b"x"], dtype=object)}, [("a", np.float32)], "numbers for DT_FLOAT, received strings"),
        ({"a": np.array([1])}, [("a", object)], "strings for DT_STRING, received whole numbers"),
        ({"a": np.array([2**40])}, [("a", np.int32)], "outside the range of DT_INT32"),
    ],
    ids=["unnamed", "missing", "unknown", "decimal", "strings", "numbers", "range"],
)
def test_tfs_to_inputs_errors(raw: Any, specs: list[tuple[str, Any]], phrase: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        tfs_to_inputs(raw, [(name, np.dtype(dtype)) for name, dtype in specs])

    assert phrase in str(caught.value)


def test_tfs_row_response_single_output() -> None:
    # The documented half_plus_three call: {"instances": [1.0, 2.0, 5.0]} → {"predictions": [3.5, 4.0, 5.5]}.
    body = form_tfs_predict({"y": np.array([3.5, 4.0, 5.5], dtype=np.float32)}, "row")

    assert json.loads(body) == {"predictions": [3.5, 4.0, 5.5]}


def test_tfs_row_response_several_outputs() -> None:
    outputs = {"scores": np.array([[0.5, 0.25], [1.0, 0.0]]), "label": np.array([b"cat", b"dog"], dtype=object)}

    body = form_tfs_predict(outputs, "row")

    assert json.loads(body) == {
        "predictions": [{"scores": [0.5, 0.25], "label": "cat"}, {"scores": [1.0, 0.0], "label": "dog"}]
    }


def test_tfs_columnar_response() -> None:
    one = form_tfs_predict({"y": np.array([[1, 2]], dtype=np.int64)}, "columnar")
    several = form_tfs_predict({"y": np.array([True]), "z": np.array(2.5, dtype=np.float16)}, "columnar")

    assert json.loads(one) == {"outputs": [[1, 2]]}
    assert json.loads(several) == {"outputs": {"y": [True], "z": 2.5}}


def test_tfs_binary_string_outputs() -> None:
    outputs = {
        "image_bytes": np.array([b"image bytes"], dtype=object),
        "text": np.array(["h\u00e9"], dtype=object),
        "raw": np.array([b"\xff"], dtype=object),
    }

    body = form_tfs_predict(outputs, "columnar")

    assert json.loads(body) == {
        "outputs": {"image_bytes": [{"b64": "aW1hZ2UgYnl0ZXM="}], "text": ["h\u00e9"], "raw": [{"b64": "/w=="}]}
    }


def test_tfs_nan_output_tokens() -> None:
    body = form_tfs_predict({"y": np.array([np.nan, np.inf, -np.inf])}, "row")

    assert body == b'{"predictions":[NaN,Infinity,-Infinity]}'


def test_tfs_row_response_needs_one_batch_size() -> None:
    with pytest.raises(InvalidRequest, match="has batch size 3, expecting 2"):
        form_tfs_predict({"a": np.zeros(2), "b": np.zeros(3)}, "row")
    with pytest.raises(InvalidRequest, match="is a scalar"):
        form_tfs_predict({"a": np.float32(1.0)}, "row")


def test_tfs_error_body() -> None:
    assert json.loads(tfs_error("Servable not found for request: Latest(half)")) == {
        "error": "Servable not found for request: Latest(half)"
    }
