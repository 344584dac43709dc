"""Deploying tests/_serving/where.py's model (it says which node answered) and asking it over the
KServe v2 REST path: for the tests of model replicas on a cluster's nodes (Ray, Slurm)."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import pytest

from tests.conftest import RunningServer


def where_model(folder: Path) -> Path:
    """tests/_serving/where.py's model, pickled by value: it answers with its node's name."""
    cloudpickle = pytest.importorskip("cloudpickle")
    from tests._serving import where

    cloudpickle.register_pickle_by_value(where)
    try:
        path = folder / "model.pkl"
        path.write_bytes(cloudpickle.dumps(where.Where()))
    finally:
        cloudpickle.unregister_pickle_by_value(where)
    return path


def ask(server: RunningServer, model: str, seconds: float, value: float, timeout: float = 60) -> httpx.Response:
    """A KServe v2 REST prediction of one row [seconds, value] (its replica sleeps ``seconds``)."""
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [seconds, value]}]}
    trust = ssl.create_default_context(cafile=str(server.state_dir / "tls" / "cert.pem"))
    with httpx.Client(verify=trust, timeout=timeout) as http:
        return http.post(
            f"{server.http_url}/v2/models/{model}/infer",
            headers={"Authorization": f"Bearer {server.admin_token}"},
            json=body,
        )


def answer(reply: httpx.Response) -> tuple[float, str]:
    """What a KServe v2 REST prediction of the model answered: y and the node."""
    assert reply.status_code == 200, reply.text
    outputs = {o["name"]: o["data"] for o in reply.json()["outputs"]}
    return outputs["y"][0], outputs["node"][0]
