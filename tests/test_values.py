"""The value codec: arrays travel as raw buffers, everything else as cloudpickle with out-of-band buffers."""

from __future__ import annotations

import json
import platform
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from types import ModuleType

import cloudpickle
import numpy as np
import pytest

from gpuport.protocol.errors import InvalidRequest
from gpuport.protocol.values import Buffer, Encoded, check_compatible, decode, encode


def over_the_wire(encoded: Encoded) -> list[Buffer]:
    """The buffers as a receiver would hold them: fresh bytearrays, sharing nothing with the sender."""
    return [bytearray(buffer) for buffer in encoded.buffers]


def header_of(encoded: Encoded) -> dict[str, object]:
    header: dict[str, object] = json.loads(encoded.header)
    return header


def torch_or_skip() -> ModuleType:
    return pytest.importorskip("torch")


# --- numpy ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.array([True, False, True]),
        np.linspace(-1, 1, 7, dtype=np.float16),
        np.array([1 + 2j, -3.5j], dtype=np.complex64),
        np.arange(10, dtype=np.uint8),
        np.array(2.5, dtype=np.float64),  # 0-d
        np.zeros((0, 3), dtype=np.int32),  # empty
        np.arange(40, dtype=np.int64).reshape(5, 8)[::2, 1::3],  # not contiguous
        np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4)),
        np.arange(6, dtype=">i4").reshape(2, 3),  # big-endian
        np.array(["gpu", "port"]),
        np.array([b"raw", b""]),
        np.arange(3).astype("datetime64[s]"),
    ],
    ids=[
        "float32",
        "bool",
        "float16",
        "complex64",
        "uint8",
        "0-d",
        "empty",
        "strided",
        "fortran",
        "big-endian",
        "str",
        "bytes",
        "datetime64",
    ],
)
def test_numpy_round_trip(array: np.ndarray) -> None:
    encoded = encode(array)
    header = header_of(encoded)
    assert header["kind"] == "numpy"
    assert header["dtype"] == array.dtype.str
    assert encoded.nbytes == array.nbytes
    back = decode(encoded.header, over_the_wire(encoded))
    assert type(back) is np.ndarray
    assert back.dtype == array.dtype
    assert back.shape == array.shape
    np.testing.assert_array_equal(back, array)
    assert back.flags.writeable


def test_numpy_fortran_order_is_kept_without_a_copy() -> None:
    array = np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4))
    encoded = encode(array)
    assert np.shares_memory(np.frombuffer(encoded.buffers[0], np.uint8), array)
    back = decode(encoded.header, over_the_wire(encoded))
    assert back.flags.f_contiguous and not back.flags.c_contiguous


def test_a_strided_numpy_array_is_copied_once_into_one_buffer() -> None:
    array = np.arange(100, dtype=np.int64)[::2]
    encoded = encode(array)
    assert len(encoded.buffers) == 1
    assert encoded.nbytes == 50 * 8
    assert not np.shares_memory(np.frombuffer(encoded.buffers[0], np.uint8), array)


def test_read_only_bytes_are_copied_once_into_a_writable_array() -> None:
    array = np.arange(6, dtype=np.int16)
    encoded = encode(array)
    back = decode(encoded.header, [bytes(encoded.buffers[0])])
    assert back.flags.writeable
    back[0] = 7  # does not fail: the copy is ours
    np.testing.assert_array_equal(back[1:], array[1:])


def test_object_and_structured_arrays_go_through_pickle() -> None:
    objects = np.array([{"a": 1}, None], dtype=object)
    records = np.zeros(3, dtype=[("x", "<f4"), ("y", "<i2")])
    for array in (objects, records):
        encoded = encode(array)
        assert header_of(encoded)["kind"] == "pickle"
        back = decode(encoded.header, over_the_wire(encoded))
        assert back.dtype == array.dtype
        assert list(back) == list(array)


def test_a_100mb_array_is_encoded_and_decoded_without_a_copy() -> None:
    array = np.ones(100 * 2**20 // 8, dtype=np.float64)
    encoded = encode(array)
    (buffer,) = encoded.buffers
    assert encoded.nbytes == array.nbytes
    assert np.shares_memory(np.frombuffer(buffer, np.uint8), array)

    received = bytearray(buffer)  # what a transport would have filled
    back = decode(encoded.header, [received])
    assert np.shares_memory(back, np.frombuffer(received, np.uint8))
    back[0] = 5.0
    assert np.frombuffer(received, np.float64)[0] == 5.0
    # A slice of a larger receive buffer works in place as well.
    framed = bytearray(16) + received
    assert np.shares_memory(decode(encoded.header, [memoryview(framed)[16:]]), np.frombuffer(framed, np.uint8))


# --- torch ---------------------------------------------------------------------------------------


def test_torch_round_trips() -> None:
    torch = torch_or_skip()
    grad = torch.randn(3, 4, requires_grad=True)
    cases = {
        "float32": torch.randn(5, 6),
        "int64": torch.arange(-5, 5, dtype=torch.int64),
        "bfloat16": torch.randn(7, 3).to(torch.bfloat16),
        "bool-0d": torch.tensor(True),
        "empty": torch.zeros(0, 4, dtype=torch.float16),
        "view": torch.arange(60.0).reshape(6, 10)[1::2, ::3],
        "grad": grad * 2,  # not a leaf: comes back without its graph
    }
    for name, tensor in cases.items():
        encoded = encode(tensor)
        header = header_of(encoded)
        assert header["kind"] == "torch", name
        assert header["dtype"] == str(tensor.dtype).removeprefix("torch."), name
        assert header["device"] == "cpu"
        back = decode(encoded.header, over_the_wire(encoded))
        assert type(back) is torch.Tensor, name
        assert back.dtype == tensor.dtype and back.shape == tensor.shape, name
        assert torch.equal(back, tensor.detach()), name
        assert not back.requires_grad, name
    # A contiguous CPU tensor is not copied on the way out, nor on the way in.
    tensor = cases["float32"]
    encoded = encode(tensor)
    assert np.shares_memory(np.frombuffer(encoded.buffers[0], np.uint8), tensor.numpy())
    received = bytearray(encoded.buffers[0])
    back = decode(encoded.header, [received])
    back[0, 0] = 42.0
    assert np.frombuffer(received, np.float32)[0] == 42.0


def test_torch_tensors_inside_a_value_travel_out_of_band() -> None:
    torch = torch_or_skip()
    layer = torch.nn.Linear(256, 512)
    value = {"state": layer.state_dict(), "weight": layer.weight, "step": 3}
    encoded = encode(value)
    assert header_of(encoded)["kind"] == "pickle"
    assert len(encoded.buffers[0]) < 4096  # the pickle itself holds no tensor data
    assert encoded.nbytes >= 2 * 256 * 512 * 4
    back = decode(encoded.header, over_the_wire(encoded))
    assert torch.equal(back["state"]["weight"], layer.weight.detach())
    assert torch.equal(back["state"]["bias"], layer.bias.detach())
    assert isinstance(back["weight"], torch.nn.Parameter) and back["weight"].requires_grad
    assert back["step"] == 3


# --- pickled values ------------------------------------------------------------------------------


def test_arrays_inside_a_nested_value_leave_the_pickle() -> None:
    big = np.random.default_rng(0).standard_normal((512, 512))
    value = {"config": {"lr": 1e-3, "layers": [64, 64]}, "data": [big, {"again": big[:, :256].copy()}]}
    encoded = encode(value)
    assert header_of(encoded)["kind"] == "pickle"
    pickle_bytes, *out_of_band = encoded.buffers
    assert len(pickle_bytes) < 1024  # the arrays' bytes are not in the pickle ...
    assert any(np.shares_memory(np.frombuffer(b, np.uint8), big) for b in out_of_band)  # ... but beside it
    back = decode(encoded.header, over_the_wire(encoded))
    assert back["config"] == value["config"]
    np.testing.assert_array_equal(back["data"][0], big)
    np.testing.assert_array_equal(back["data"][1]["again"], big[:, :256])
    assert back["data"][0].flags.writeable


def test_small_arrays_stay_inside_the_pickle() -> None:
    encoded = encode({"a": np.arange(10), "b": [np.ones(3)]})
    assert len(encoded.buffers) == 1
    back = decode(encoded.header, [bytes(encoded.buffers[0])])
    np.testing.assert_array_equal(back["a"], np.arange(10))


def test_functions_and_closures_round_trip() -> None:
    offset = 10

    def shift(x: int) -> int:
        return x + offset

    back = decode(*_parts(encode(shift)))
    assert back(5) == 15
    assert decode(*_parts(encode(lambda x: x * 2)))(4) == 8


def _parts(encoded: Encoded) -> tuple[bytes, list[Buffer]]:
    return encoded.header, over_the_wire(encoded)


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda: threading.Lock(), "_thread.lock"),
        (lambda: {"conn": socket.socket()}, "socket"),
        (lambda: (x for x in range(3)), "generator"),
    ],
    ids=["lock", "socket-in-dict", "generator"],
)
def test_an_unpicklable_value_is_refused_on_encode(make: Callable[[], object], named: str) -> None:
    value = make()
    try:
        with pytest.raises(InvalidRequest, match=f"cannot send .*{named}.*open them on the other side"):
            encode(value)
    finally:
        if isinstance(value, dict):
            value["conn"].close()


def test_a_closure_over_a_socket_is_refused_naming_the_function() -> None:
    with socket.socket() as sock:
        with pytest.raises(InvalidRequest, match="cannot send function .*<lambda>: TypeError: .*socket"):
            encode(lambda: sock.fileno())


def test_a_pickle_that_needs_a_missing_module_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    # A class pickled by reference to a module the other side has and this side lacks.
    module = ModuleType("gpuport_only_over_there")
    thing = type("Thing", (), {"__module__": module.__name__})
    module.Thing = thing  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    encoded = encode({"x": thing()})
    monkeypatch.delitem(sys.modules, module.__name__)
    with pytest.raises(InvalidRequest, match="No module named 'gpuport_only_over_there'.*same packages"):
        decode(encoded.header, over_the_wire(encoded))


def test_a_pickle_from_another_python_version_says_which() -> None:
    encoded = encode({"x": 1})
    major, minor = sys.version_info[:2]
    header = json.dumps({**header_of(encoded), "python": f"{major}.{minor + 1}.0"})
    with pytest.raises(InvalidRequest, match=f"the sender runs Python {major}.{minor + 1} and this side"):
        decode(header, [b"\x80\x05garbage"])


# --- bad input and devices -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "buffers", "message"),
    [
        (b"not json", [], "not valid JSON"),
        (b'{"v":1,"kind":"arrow"}', [], "no known kind"),
        (b'{"v":9,"kind":"numpy"}', [], "upgrade gpuport"),
        (b'{"v":1,"kind":"numpy","dtype":"<f4","shape":[4]}', [bytearray(8)], "needs 16 bytes"),
        (b'{"v":1,"kind":"numpy","dtype":"|O","shape":[1]}', [bytearray(8)], "cannot travel as raw bytes"),
        (b'{"v":1,"kind":"numpy","dtype":"<f4","shape":[-1]}', [bytearray(4)], "no valid shape"),
        (b'{"v":1,"kind":"numpy","dtype":"<f4","shape":[1]}', [bytearray(4)] * 2, "1 buffer"),
        (b'{"v":1,"kind":"torch","dtype":"load","shape":[1]}', [bytearray(4)], "unknown torch dtype"),
    ],
    ids=["json", "kind", "version", "size", "object-dtype", "shape", "count", "torch-dtype"],
)
def test_a_broken_header_is_an_invalid_request(header: bytes, buffers: list[Buffer], message: str) -> None:
    if b"torch" in header:
        torch_or_skip()
    with pytest.raises(InvalidRequest, match=message):
        decode(header, buffers)


def test_an_unknown_device_lists_the_valid_ones() -> None:
    encoded = encode(np.ones(2))
    with pytest.raises(InvalidRequest, match="'gpu', 'cpu' or None"):
        decode(encoded.header, encoded.buffers, device="tpu")


def test_placing_a_torch_tensor_on_a_missing_gpu_is_an_invalid_request() -> None:
    torch = torch_or_skip()
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    encoded = encode(torch.ones(3))
    with pytest.raises(InvalidRequest, match="torch sees no CUDA device"):
        decode(encoded.header, over_the_wire(encoded), device="gpu")


@pytest.mark.gpu
def test_a_cuda_tensor_travels_and_lands_on_the_gpu() -> None:
    torch = torch_or_skip()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    tensor = torch.randn(64, 64, device="cuda").to(torch.bfloat16)
    encoded = encode(tensor)
    assert header_of(encoded)["device"] == "cuda:0"
    back = decode(encoded.header, over_the_wire(encoded), device="gpu")
    assert back.is_cuda and torch.equal(back, tensor)
    assert decode(encoded.header, over_the_wire(encoded)).device.type == "cpu"


# --- TensorFlow (importing it costs seconds: one test) ---------------------------------------------


def test_tensorflow_round_trips_and_devices() -> None:
    tf = pytest.importorskip("tensorflow")
    cases = [
        tf.constant([[1.5, -2.0], [3.25, 4.0]], dtype=tf.float32),
        tf.range(10, dtype=tf.int32),
        tf.constant(7, dtype=tf.int64),
        tf.constant([1.0, 2.0], dtype=tf.bfloat16),
        tf.constant([[b"gpu", b""], ["é".encode(), b"\x00bytes"]]),  # strings: lengths + bytes, no pickle
    ]
    for tensor in cases:
        encoded = encode(tensor)
        header = header_of(encoded)
        assert header["kind"] == "tensorflow"
        assert header["dtype"] == tensor.dtype.name
        assert "CPU" in str(header["device"])
        back = decode(encoded.header, over_the_wire(encoded))
        assert isinstance(back, tf.Tensor) and back.dtype == tensor.dtype
        assert back.shape == tensor.shape
        assert bool(tf.reduce_all(back == tensor))
    # Inside a pickle a tensor comes back too; a variable pickles.
    value = {"t": cases[0], "v": tf.Variable([1.0, 2.0])}
    back = decode(*_parts(encode(value)))
    assert bool(tf.reduce_all(back["t"] == cases[0]))
    assert back["v"].numpy().tolist() == [1.0, 2.0]
    if not tf.config.list_physical_devices("GPU"):
        encoded = encode(cases[0])
        with pytest.raises(InvalidRequest, match="TensorFlow sees no GPU"):
            decode(encoded.header, encoded.buffers, device="gpu")


# --- jax -----------------------------------------------------------------------------------------


def test_jax_round_trips() -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    for array in (jnp.arange(12.0).reshape(3, 4), jnp.ones(5, dtype=jnp.bfloat16), jnp.array(3, dtype=jnp.int32)):
        encoded = encode(array)
        assert header_of(encoded)["kind"] == "jax"
        back = decode(encoded.header, over_the_wire(encoded))
        assert isinstance(back, jax.Array) and back.dtype == array.dtype and back.shape == array.shape
        assert bool((back == array).all())


# --- versions and imports ------------------------------------------------------------------------


def test_check_compatible() -> None:
    here = platform.python_version()
    major, minor = sys.version_info[:2]
    assert check_compatible(here, cloudpickle.__version__) is None
    assert check_compatible(f"{major}.{minor}.99", cloudpickle.__version__) is None  # patch versions mix

    message = check_compatible(f"{major}.{minor + 1}.0", cloudpickle.__version__)
    assert message == (
        f"the server runs Python {major}.{minor + 1} and this client {major}.{minor}: pickled functions and "
        f"objects cannot cross minor versions — use the same Python minor version on both sides"
    )
    cp_major = int(cloudpickle.__version__.split(".")[0])
    message = check_compatible(here, f"{cp_major - 1}.2.1", remote="client", local="server")
    assert message is not None
    assert message.startswith(f"the client has cloudpickle {cp_major - 1}.2.1 and this server")
    assert f"install cloudpickle {cp_major}.x on both sides" in message

    both = check_compatible(f"{major}.{minor + 1}", f"{cp_major + 1}.0")
    assert both is not None and "Python" in both and "cloudpickle" in both

    with pytest.raises(InvalidRequest, match="like 3.12.1"):
        check_compatible("three", cloudpickle.__version__)


def test_encoding_plain_values_imports_no_array_library() -> None:
    script = (
        "import sys\n"
        "from gpuport.protocol.values import decode, encode\n"
        "e = encode({'a': [1, 2.5, 'x'], 'b': {'c': None}, 'f': len})\n"
        "assert decode(e.header, e.buffers)['a'] == [1, 2.5, 'x']\n"
        "print(sorted(m for m in ('torch', 'tensorflow', 'jax', 'numpy') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]"
