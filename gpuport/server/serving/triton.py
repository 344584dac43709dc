"""What Triton's extensions of KServe v2 answer, as the JSON of its HTTP API; the gRPC API sends the
same fields in its messages (``json_format.ParseDict``).

- model configuration (``GET /v2/models/{name}/config``, gRPC ModelConfig): name, platform,
  max_batch_size, inputs and outputs as ``model_config.proto`` has them (dims without the batch
  dimension when the model batches), dynamic batching, one instance group of the replicas;
- statistics (``GET /v2/models[/{name}]/stats``, gRPC ModelStatistics): see ``batcher.Timings``;
- the repository index (``POST /v2/repository/index``, gRPC RepositoryIndex): every deployment
  with its state, and for a failed one why, to its owner and admins.
"""

from __future__ import annotations

from typing import Any

from gpuport.server.serving.batcher import Duration, Timings
from gpuport.server.serving.records import DeploymentRecord

# What KServe's model metadata and Triton's config call each format (Triton's platform names).
PLATFORMS = {
    "savedmodel": "tensorflow_savedmodel",
    "keras": "tensorflow_keras",
    "torchscript": "pytorch_libtorch",
    "onnx": "onnxruntime_onnx",
    "python": "python",
}
# The extensions the server metadata lists: those gpuport implements whole. Shared memory cannot
# cross a network; repository load/unload is `gpuport deploy` / `undeploy`.
EXTENSIONS = ("binary_tensor_data", "statistics", "model_configuration")
# Triton's repository states, by gpuport's deployment states.
_STATES = {"ready": "READY", "loading": "LOADING", "failed": "UNAVAILABLE"}


def platform(d: DeploymentRecord) -> str:
    return PLATFORMS.get(d.format, d.format)


def _config_type(datatype: str) -> str:
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def model_config(d: DeploymentRecord) -> dict[str, Any]:
    batching = d.spec["max_batch_size"] > 1

    def tensor(spec: dict[str, Any]) -> dict[str, Any]:
        dims = spec["shape"][1:] if batching and spec["shape"] else spec["shape"]
        return {"name": spec["name"], "data_type": _config_type(spec["datatype"]), "dims": list(dims)}

    config: dict[str, Any] = {
        "name": d.name,
        "platform": platform(d),
        "backend": d.format,
        "max_batch_size": d.spec["max_batch_size"] if batching else 0,
        "input": [tensor(s) for s in d.inputs],
        "output": [tensor(s) for s in d.outputs],
        "instance_group": [
            {
                "name": f"{d.name}_0",
                "kind": "KIND_GPU" if d.spec["gpus"] or d.spec["gpu_memory"] else "KIND_CPU",
                "count": d.spec["replicas"],
            }
        ],
    }
    if batching:
        config["dynamic_batching"] = {"max_queue_delay_microseconds": round(d.spec["max_queue_delay"] * 1e6)}
    return config


def _duration(d: Duration) -> dict[str, int]:
    return {"count": d.count, "ns": d.ns}


def model_statistics(found: list[tuple[DeploymentRecord, Timings]]) -> dict[str, Any]:
    zero = _duration(Duration())
    return {
        "model_stats": [
            {
                "name": d.name,
                "version": str(d.version),
                "last_inference": t.last_inference,
                "inference_count": d.stats.rows,
                "execution_count": d.stats.batches,
                "inference_stats": {
                    "success": _duration(t.success),
                    "fail": _duration(t.fail),
                    "queue": _duration(t.queue),
                    "compute_input": _duration(t.compute_input),
                    "compute_infer": _duration(t.compute_infer),
                    "compute_output": _duration(t.compute_output),
                    "cache_hit": zero,
                    "cache_miss": zero,
                },
                "batch_stats": [
                    {
                        "batch_size": size,
                        "compute_input": _duration(joining),
                        "compute_infer": _duration(running),
                        "compute_output": _duration(splitting),
                    }
                    for size, (joining, running, splitting) in sorted(t.batches.items())
                ],
            }
            for d, t in found
        ]
    }


def repository_index(records: list[DeploymentRecord], ready_only: bool, shown: set[str]) -> list[dict[str, str]]:
    """Each deployment as the index lists it; ``shown``: the ids whose failure reason the caller may see."""
    return [
        {
            "name": d.name,
            "version": str(d.version),
            "state": _STATES.get(d.state, "UNAVAILABLE"),
            "reason": d.message if d.state == "failed" and d.id in shown else "",
        }
        for d in records
        if not ready_only or d.state == "ready"
    ]
