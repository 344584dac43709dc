"""A deployment's model worker: one process that loads the model and answers batches.

Started as the command of a job of kind "model" (so it queues, holds its GPU slice, is capped and
watched like any job): ``python -m gpuport.server.worker.model``, with ``GPUPORT_MODEL_DIR`` naming
the deployment's folder (the model's files under ``files/``, ``deployment.json``: the model's path
in it and its format) and ``GPUPORT_MODEL_REPLICA`` its replica number. The folder is the server's,
shared by the replicas, where jobs run on the server's machine; on a cluster's node it is the job's
own workdir (``.``), where the deployment's files arrived as a job's code does. It loads the model (``serving/formats.py``), then
listens on ``replica.sock`` in its job's run folder (``GPUPORT_RUN_DIR``) for the server's batches
(wire.py's frames):

- ``{"op": "metadata"}`` → ``{"format", "inputs": [spec...], "outputs": [spec...]}``;
- ``{"op": "predict", "tensors": [{"name", "dtype", "shape"}...]}`` and one buffer per tensor →
  ``{"tensors": [...]}`` and the outputs' buffers, or ``{"error": [class name, message]}``.

Numeric tensors travel as their raw bytes; byte strings (numpy object arrays) as the binary tensor
format of the prediction protocols: each element a 4-byte little-endian length, then its bytes.
A model that does not load ends the process with exit code 3 after writing the loader's message to
``error`` in its run folder, which the deployment shows as its reason for ``failed``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from gpuport.defaults import ENV_RUN_DIR
from gpuport.protocol.errors import GpuportError
from gpuport.server.serving.tensors import pack_bytes, unpack_bytes
from gpuport.server.worker import wire

ENV_MODEL_DIR = "GPUPORT_MODEL_DIR"
ENV_MODEL_REPLICA = "GPUPORT_MODEL_REPLICA"
LOAD_FAILED = 3
_ORPHAN_CHECK = 10.0  # seconds between looks at whether the deployment still exists, while no server is connected


def encode_tensors(tensors: dict[str, np.ndarray]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Tensor headers and buffers for a frame."""
    heads: list[dict[str, Any]] = []
    buffers: list[Any] = []
    for name, array in tensors.items():
        array = np.asarray(array)
        if array.dtype.kind in "OSU":
            heads.append({"name": name, "dtype": "bytes", "shape": list(array.shape)})
            buffers.append(pack_bytes(array))
        else:
            array = np.ascontiguousarray(array)
            heads.append({"name": name, "dtype": array.dtype.str, "shape": list(array.shape)})
            buffers.append(array.data.cast("B") if array.size else b"")
    return heads, buffers


def decode_tensors(heads: list[dict[str, Any]], buffers: list[memoryview]) -> dict[str, np.ndarray]:
    out = {}
    for head, buffer in zip(heads, buffers):
        shape = tuple(head["shape"])
        if head["dtype"] == "bytes":
            out[head["name"]] = unpack_bytes(buffer, f"tensor {head['name']!r}").reshape(shape)
        else:
            out[head["name"]] = np.frombuffer(buffer, dtype=np.dtype(head["dtype"])).reshape(shape)
    return out


class Worker:
    def __init__(self, model: Any) -> None:
        self.model = model

    def handle(self, frame: wire.Frame) -> tuple[dict[str, Any], list[Any]]:
        op = frame.header.get("op")
        if op == "metadata":
            return {
                "format": self.model.format,
                "inputs": [s.as_dict() for s in self.model.inputs],
                "outputs": [s.as_dict() for s in self.model.outputs],
            }, []
        if op != "predict":
            return {"error": ["InvalidRequest", f"unknown operation {op!r}"]}, []
        from gpuport.server.serving import formats

        try:
            inputs = formats.check_inputs(self.model, decode_tensors(frame.header["tensors"], frame.buffers))
            outputs = self.model.predict(inputs)
            heads, buffers = encode_tensors(outputs)
        except GpuportError as e:
            return {"error": [type(e).__name__, str(e)]}, []
        except Exception as e:  # the model's own failure: the request fails, the worker lives on
            traceback.print_exc()
            return {"error": ["ServerError", f"the model failed: {type(e).__name__}: {e}"]}, []
        return {"tensors": heads}, buffers

    def serve(self, listener: socket.socket, folder: Path) -> None:
        """Answer the server's connection (one at a time; it reconnects after its own restart). A
        deployment outlives a server restart; one whose folder is gone (undeployed while this worker
        was cut off, a state dir removed) ends its worker."""
        listener.settimeout(_ORPHAN_CHECK)
        while True:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                if not (folder / "deployment.json").exists():
                    print("gpuport: the deployment's folder is gone: ending", file=sys.stderr, flush=True)
                    return
                continue
            conn.settimeout(None)
            with conn:
                while True:
                    try:
                        frame = wire.recv(conn)
                    except (EOFError, OSError):
                        break
                    header, buffers = self.handle(frame)
                    try:
                        wire.send(conn, header, buffers)
                    except OSError:
                        break


def main() -> None:
    folder = Path(os.environ[ENV_MODEL_DIR]).absolute()  # "." on a node: the job's workdir
    run = Path(os.environ[ENV_RUN_DIR])
    spec = json.loads((folder / "deployment.json").read_text())
    device = "gpu" if os.environ.get("CUDA_VISIBLE_DEVICES") else "cpu"
    from gpuport.server.serving import formats

    try:
        model = formats.load(folder / spec["path"], spec.get("format") or None, device=device)
    except Exception as e:
        message = str(e) if isinstance(e, GpuportError) else f"{type(e).__name__}: {e}"
        message = message.replace(str(folder), "<model>")  # the node's paths are no user's business
        (run / "error").write_text(message)
        print(f"gpuport: the model did not load: {message}", file=sys.stderr, flush=True)
        sys.exit(LOAD_FAILED)
    print(f"gpuport: {model.format} model loaded on the {device}", file=sys.stderr, flush=True)
    Worker(model).serve(wire.listen(str(run), "replica.sock"), folder)


if __name__ == "__main__":
    main()
