"""Loading each model format and describing its tensors (serving/formats.py), on real small models
built here: a Keras MLP (.keras and exported SavedModel), a scripted torch module (TorchScript and
ONNX), and a pickled Python class."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest

from gpuport.protocol.datatypes import numpy_dtype
from gpuport.protocol.errors import InvalidRequest, RemoteError
from gpuport.server.serving import formats
from gpuport.server.serving.formats import SPEC_FILE, TensorSpec

# TensorFlow 2.21's variables lack numpy 2's __array__(copy=...); Keras converts them with np.array().
pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)
ROWS = 3
rng = np.random.default_rng(7)


def write_spec(folder: Path, inputs: list[Any], outputs: list[Any]) -> None:
    (folder / SPEC_FILE).write_text(json.dumps({"inputs": inputs, "outputs": outputs}))


def assert_checks_refuse(model: formats.Model, good: dict[str, np.ndarray]) -> None:
    """check_inputs accepts ``good`` and refuses it with an input missing, an extra one, the wrong
    dtype or the wrong shape, saying what it expected and what it received."""
    checked = formats.check_inputs(model, good)
    assert set(checked) == set(good) and all(a.flags.c_contiguous for a in checked.values())
    first = model.inputs[0]
    expected = ", ".join(repr(s.name) for s in model.inputs)
    with pytest.raises(InvalidRequest, match=f"missing input\\(s\\) '{first.name}': the model takes {expected}"):
        formats.check_inputs(model, {k: v for k, v in good.items() if k != first.name})
    with pytest.raises(InvalidRequest, match=f"unknown input\\(s\\) 'nope': the model takes {expected}"):
        formats.check_inputs(model, {**good, "nope": good[first.name]})
    wrong = "INT32" if first.datatype != "INT32" else "FP32"
    cast = good[first.name].astype(numpy_dtype(wrong))
    with pytest.raises(InvalidRequest, match=f"input '{first.name}': expected {first.datatype}, received {wrong}"):
        formats.check_inputs(model, {**good, first.name: cast})
    short = good[first.name][..., :-1]
    shape = ", ".join(map(str, first.shape))
    received = ", ".join(map(str, short.shape))
    with pytest.raises(
        InvalidRequest, match=rf"input '{first.name}': expected shape \[{shape}\], received \[{received}\]"
    ):
        formats.check_inputs(model, {**good, first.name: short})


# --- Keras and SavedModel ---------------------------------------------------------------------


@dataclass
class KerasModels:
    keras_file: Path
    saved_model: Path
    model: Any  # the keras.Model both were saved from


@pytest.fixture(scope="module")
def keras_models(tmp_path_factory: pytest.TempPathFactory) -> KerasModels:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    folder = tmp_path_factory.mktemp("keras")
    keras.utils.set_random_seed(1)
    features = keras.Input(shape=(8,), name="features")
    model = keras.Model(features, keras.layers.Dense(4, name="scores")(features))
    model.save(folder / "mlp.keras")
    model.export(folder / "exported", verbose=False)
    return KerasModels(folder / "mlp.keras", folder / "exported", model)


def test_keras_file_names_tensors_after_its_layers(keras_models: KerasModels) -> None:
    assert formats.detect(keras_models.keras_file) == "keras"
    model = formats.load(keras_models.keras_file)
    assert (model.format, model.device) == ("keras", "cpu")
    assert [s.as_dict() for s in model.inputs] == [{"name": "features", "datatype": "FP32", "shape": [-1, 8]}]
    assert [s.as_dict() for s in model.outputs] == [{"name": "scores", "datatype": "FP32", "shape": [-1, 4]}]
    x = rng.random((ROWS, 8), dtype=np.float32)
    out = model.predict(formats.check_inputs(model, {"features": x}))
    assert list(out) == ["scores"] and out["scores"].shape == (ROWS, 4) and out["scores"].dtype == np.float32
    assert np.allclose(out["scores"], np.asarray(keras_models.model(x, training=False)), atol=1e-6)
    assert_checks_refuse(model, {"features": x})


def test_savedmodel_serves_its_serving_default_signature(keras_models: KerasModels) -> None:
    assert formats.detect(keras_models.saved_model) == "savedmodel"
    model = formats.load(keras_models.saved_model)
    assert model.format == "savedmodel"
    # model.export names inputs after the input layers, and outputs output_0, output_1 ...
    assert [s.as_dict() for s in model.inputs] == [{"name": "features", "datatype": "FP32", "shape": [-1, 8]}]
    assert [s.as_dict() for s in model.outputs] == [{"name": "output_0", "datatype": "FP32", "shape": [-1, 4]}]
    x = rng.random((ROWS, 8), dtype=np.float32)
    out = model.predict(formats.check_inputs(model, {"features": x}))
    assert np.allclose(out["output_0"], np.asarray(keras_models.model(x, training=False)), atol=1e-6)
    assert_checks_refuse(model, {"features": x})


def test_spec_file_renames_and_retypes_a_savedmodel(keras_models: KerasModels, tmp_path: Path) -> None:
    # A folder holding the SavedModel and a spec file beside it: outputs renamed, the input taken as FP64.
    (tmp_path / "sm").symlink_to(keras_models.saved_model, target_is_directory=True)
    write_spec(tmp_path, [{"name": "features", "datatype": "FP64", "shape": [-1, 8]}],
               [{"name": "scores", "datatype": "FP32", "shape": [-1, 4]}])  # fmt: skip
    assert formats.detect(tmp_path) == "savedmodel"
    model = formats.load(tmp_path)
    assert [(s.name, s.datatype) for s in model.inputs + model.outputs] == [("features", "FP64"), ("scores", "FP32")]
    x = rng.random((ROWS, 8))
    out = model.predict(formats.check_inputs(model, {"features": x}))
    expected = np.asarray(keras_models.model(x.astype(np.float32), training=False))
    assert list(out) == ["scores"] and np.allclose(out["scores"], expected, atol=1e-6)
    write_spec(tmp_path, [{"name": "features", "datatype": "FP32", "shape": [-1, 8]}] * 2, [])
    with pytest.raises(InvalidRequest, match="'features' named more than once"):
        formats.load(tmp_path)


# --- TorchScript and ONNX ---------------------------------------------------------------------


@dataclass
class TorchModels:
    module: Any  # the torch.nn.Module
    scripted: Path  # its TorchScript file, alone in a folder
    onnx: Path  # its ONNX export, alone in a folder


TORCH_SPEC = (
    [{"name": "x", "datatype": "FP32", "shape": [-1, 8]}, {"name": "scale", "datatype": "FP32", "shape": [-1, 1]}],
    [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}, {"name": "total", "datatype": "FP32", "shape": [-1]}],
)


@pytest.fixture(scope="module")
def torch_models(tmp_path_factory: pytest.TempPathFactory) -> TorchModels:
    import torch

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 4)

        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = self.linear(x) * scale
            return y, y.sum(dim=1)

    torch.manual_seed(0)
    module = Scaled().eval()
    scripted, exported = tmp_path_factory.mktemp("torchscript"), tmp_path_factory.mktemp("onnx")
    with warnings.catch_warnings():
        # torch 2.13 deprecates TorchScript and the TorchScript-based ONNX exporter; both still work.
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message="You are using the legacy TorchScript-based ONNX export",
                                category=DeprecationWarning)  # fmt: skip
        warnings.filterwarnings("ignore", message="The feature will be removed", category=DeprecationWarning)
        torch.jit.script(module).save(str(scripted / "scaled.pt"))
        torch.onnx.export(
            module,
            (torch.zeros(2, 8), torch.ones(2, 1)),
            str(exported / "scaled.onnx"),
            input_names=["x", "scale"],
            output_names=["y", "total"],
            dynamic_axes={name: {0: "batch"} for name in ("x", "scale", "y", "total")},
            dynamo=False,
        )
    return TorchModels(module, scripted / "scaled.pt", exported / "scaled.onnx")


def run_torch(module: Any, x: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    import torch

    with torch.no_grad():
        y, total = module(torch.from_numpy(x), torch.from_numpy(scale))
    return y.numpy(), total.numpy()


def test_torchscript_with_a_spec_file(torch_models: TorchModels) -> None:
    write_spec(torch_models.scripted.parent, *TORCH_SPEC)
    folder = torch_models.scripted.parent
    assert formats.detect(torch_models.scripted) == "torchscript" and formats.detect(folder) == "torchscript"
    model = formats.load(folder)
    assert model.format == "torchscript"
    assert [s.as_dict() for s in model.inputs] == TORCH_SPEC[0]
    assert [s.as_dict() for s in model.outputs] == TORCH_SPEC[1]
    x, scale = rng.random((ROWS, 8), dtype=np.float32), rng.random((ROWS, 1), dtype=np.float32)
    x.flags.writeable = False  # as the worker's request buffers are
    out = model.predict(formats.check_inputs(model, {"x": x, "scale": scale}))
    y, total = run_torch(torch_models.module, x.copy(), scale)
    assert np.allclose(out["y"], y, atol=1e-6) and np.allclose(out["total"], total, atol=1e-6)
    assert out["total"].shape == (ROWS,)
    assert_checks_refuse(model, {"x": x, "scale": scale})
    with pytest.raises(InvalidRequest, match=r"differ in their number of rows .*'x' 3, 'scale' 2"):
        formats.check_inputs(model, {"x": x, "scale": scale[:2]})


def test_torchscript_without_a_spec_file_says_how_to_declare_one(torch_models: TorchModels, tmp_path: Path) -> None:
    alone = tmp_path / "scaled.pt"
    alone.write_bytes(torch_models.scripted.read_bytes())
    with pytest.raises(InvalidRequest) as raised:
        formats.load(alone)
    message = str(raised.value)
    assert f"declare them in {SPEC_FILE} beside scaled.pt" in message
    # The example names forward()'s own arguments, in order, and is valid JSON.
    example = json.loads(message[message.index("e.g. ") + 5 :])
    assert [i["name"] for i in example["inputs"]] == ["x", "scale"]
    write_spec(tmp_path, TORCH_SPEC[0][:1], TORCH_SPEC[1])
    with pytest.raises(InvalidRequest, match=r"declares 1 inputs but scaled.pt's forward\(\) takes 'x', 'scale'"):
        formats.load(alone)


def test_onnx_names_tensors_as_its_graph_does(torch_models: TorchModels) -> None:
    assert formats.detect(torch_models.onnx) == "onnx"
    model = formats.load(torch_models.onnx, device="gpu")  # no GPU here: onnxruntime runs it on the CPU
    assert (model.format, model.device) == ("onnx", "cpu")
    assert [s.as_dict() for s in model.inputs] == TORCH_SPEC[0]  # symbolic "batch" dimensions: -1
    assert [s.as_dict() for s in model.outputs] == TORCH_SPEC[1]
    x, scale = rng.random((ROWS, 8), dtype=np.float32), rng.random((ROWS, 1), dtype=np.float32)
    out = model.predict(formats.check_inputs(model, {"x": x, "scale": scale}))
    y, total = run_torch(torch_models.module, x, scale)
    assert np.allclose(out["y"], y, atol=1e-5) and np.allclose(out["total"], total, atol=1e-5)
    assert_checks_refuse(model, {"x": x, "scale": scale})


def test_a_corrupt_onnx_file_fails_with_the_loaders_message(tmp_path: Path) -> None:
    (tmp_path / "broken.onnx").write_bytes(b"not a protobuf at all")
    with pytest.raises(InvalidRequest, match="cannot load the ONNX model broken.onnx: .*Protobuf parsing failed"):
        formats.load(tmp_path / "broken.onnx")


def test_serving_onnx_imports_neither_tensorflow_nor_torch(torch_models: TorchModels) -> None:
    script = f"""
        import sys
        from gpuport.server.serving import formats
        model = formats.load({str(torch_models.onnx)!r})
        print(sorted(m for m in ("tensorflow", "keras", "torch") if m in sys.modules))
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# --- Python classes ---------------------------------------------------------------------------


def pickle_model(folder: Path, obj: object) -> Path:
    path = folder / "model.pkl"
    path.write_bytes(cloudpickle.dumps(obj))
    return path


def test_python_class_with_a_load_hook(tmp_path: Path) -> None:
    weights = rng.random(3)
    np.save(tmp_path / "weights.npy", weights)

    class Weighted:  # defined here, so cloudpickle pickles it by value as a user's class would be
        inputs = [("values", "FP64", [-1, 3])]
        outputs = [{"name": "weighted", "datatype": "FP64", "shape": [-1, 3]}, TensorSpec("label", "BYTES", (-1,))]

        def __init__(self, weights_path: str) -> None:
            self.weights_path = weights_path
            self.weights: np.ndarray | None = None

        def load(self) -> None:
            self.weights = np.load(self.weights_path)

        def predict(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            weighted = batch["values"] * self.weights
            return {"weighted": weighted, "label": np.array([b"big" if w.sum() > 1 else b"small" for w in weighted])}

    pickle_model(tmp_path, Weighted(str(tmp_path / "weights.npy")))
    assert formats.detect(tmp_path) == "python" and formats.detect(tmp_path / "model.pkl") == "python"
    model = formats.load(tmp_path)
    assert [s.as_dict() for s in model.inputs] == [{"name": "values", "datatype": "FP64", "shape": [-1, 3]}]
    assert [s.as_dict() for s in model.outputs] == [
        {"name": "weighted", "datatype": "FP64", "shape": [-1, 3]},
        {"name": "label", "datatype": "BYTES", "shape": [-1]},
    ]
    values = rng.random((ROWS, 3))
    out = model.predict(formats.check_inputs(model, {"values": values}))
    assert np.allclose(out["weighted"], values * weights)
    assert out["label"].dtype == object and set(out["label"]) <= {b"big", b"small"}
    assert_checks_refuse(model, {"values": values})


def test_python_class_errors_are_the_users_to_see(tmp_path: Path) -> None:
    class Broken:
        inputs = [("x", "FP32", [-1])]
        outputs = [("y", "FP32", [-1])]

        def load(self) -> None:
            raise FileNotFoundError("weights.bin is not there")

        def predict(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            return batch

    pickle_model(tmp_path, Broken())
    with pytest.raises(InvalidRequest, match=r"(?s)Broken.load\(\) failed:.*Traceback.*weights.bin is not there"):
        formats.load(tmp_path)
    Broken.load = lambda self: None  # type: ignore[method-assign]
    pickle_model(tmp_path, Broken())
    model = formats.load(tmp_path)
    with pytest.raises(RemoteError, match=r"the model returned no output 'y' \(it returned 'x'\)"):
        model.predict({"x": np.zeros(2, np.float32)})
    Broken.inputs = [("x", "FLOAT", [-1])]
    pickle_model(tmp_path, Broken())
    with pytest.raises(InvalidRequest, match=r"Broken.inputs\[0\] \('x'\): unknown datatype 'FLOAT': use one of"):
        formats.load(tmp_path)
    (tmp_path / "model.pkl").write_bytes(b"\x80\x05garbage")
    with pytest.raises(InvalidRequest, match="cannot unpickle model.pkl: UnpicklingError"):
        formats.load(tmp_path)


# --- finding models, and spec files -----------------------------------------------------------


def test_detect_says_what_it_found_and_what_it_accepts(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InvalidRequest, match=r"no model in .*empty \(it is empty\): deploy a SavedModel folder"):
        formats.detect(empty)
    (empty / "notes.txt").write_text("hi")
    (empty / "data").mkdir()
    with pytest.raises(InvalidRequest, match=r"\(found data/, notes.txt\): deploy .* a Keras .keras file"):
        formats.detect(empty)
    with pytest.raises(InvalidRequest, match=r"cannot tell the format of notes.txt: .*or name its format"):
        formats.detect(empty / "notes.txt")
    with pytest.raises(InvalidRequest, match="no model at .*missing: no such file or folder"):
        formats.detect(tmp_path / "missing")
    (empty / "a.onnx").write_bytes(b"")
    assert formats.detect(empty) == "onnx"
    (empty / "b.keras").write_bytes(b"")
    with pytest.raises(InvalidRequest, match=r"holds several models \(a.onnx, b.keras\): deploy one file"):
        formats.detect(empty)
    with pytest.raises(InvalidRequest, match="unknown model format 'tflite': use one of savedmodel, keras, "):
        formats.load(empty, "tflite")
    # Naming the format picks the one model of that format.
    with pytest.raises(InvalidRequest, match="cannot load the Keras model b.keras"):
        formats.load(empty, "keras")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("{", f"{SPEC_FILE} is not readable JSON"),
        ('{"inputs": [], "extra": 1}', 'unknown key\\(s\\) \'extra\': use "inputs" and "outputs"'),
        ('{"inputs": []}', '"inputs" must be a non-empty list'),
        ('{"inputs": [{"name": "x", "datatype": "FP32", "shape": [8]}]}', "must start with -1, the batch dimension"),
        ('{"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, "8"]}]}', "the shape must be a list of sizes"),
        ('{"inputs": [{"name": "x", "datatype": "F32", "shape": [-1]}]}', "unknown datatype 'F32'"),
        ('{"inputs": [{"name": "x", "dtype": "FP32", "shape": [-1]}]}', "unknown key\\(s\\) dtype"),
    ],
)
def test_spec_files_are_checked(tmp_path: Path, spec: str, message: str) -> None:
    (tmp_path / "model.onnx").write_bytes(b"")
    (tmp_path / SPEC_FILE).write_text(spec)
    with pytest.raises(InvalidRequest, match=message):
        formats.load(tmp_path / "model.onnx")
