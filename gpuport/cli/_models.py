"""``gpuport deploy``, ``gpuport models``, ``gpuport undeploy``: models served over KServe v2 and TF Serving."""

from __future__ import annotations

from pathlib import Path

import click

from gpuport.cli._common import client, json_option
from gpuport.cli._output import err, escape, new_table, out, print_json
from gpuport.defaults import DEFAULT_MAX_BATCH_SIZE
from gpuport.protocol.units import format_duration, format_size


@click.command("deploy")
@click.argument("name")
@click.argument("source")
@click.option("--version", type=int, help="Version number (default: the next one).")
@click.option(
    "--format",
    "model_format",
    type=click.Choice(["savedmodel", "keras", "torchscript", "onnx", "python"]),
    help="Default: found from the files.",
)
@click.option("--gpus", type=int, default=0, show_default=True, help="Whole GPUs per replica.")
@click.option("--gpu-memory", help="A slice of one GPU per replica, e.g. 2GiB.")
@click.option("--cpus", type=float, default=0.0, help="CPUs reserved per replica.")
@click.option("--memory", help="RAM per replica, e.g. 4GiB.")
@click.option("--max-batch-size", type=int, default=DEFAULT_MAX_BATCH_SIZE, show_default=True, help="0: no batching.")
@click.option("--max-queue-delay", default="2ms", show_default=True, help="Longest wait for a batch to fill.")
@click.option("--replicas", type=int, default=1, show_default=True, help="Model workers behind one queue.")
@click.option(
    "--public",
    is_flag=True,
    help="Predictions and metadata need no credentials (TLS still on); deploying and undeploying still do.",
)
@click.option("--label", help="A version label for the new version (TensorFlow Serving's), e.g. stable.")
@click.option(
    "--requirements",
    type=click.Path(exists=True, dir_okay=False),
    help="A requirements file: the replicas' Python environment, built on the server (as a job's).",
)
@click.option("--no-wait", is_flag=True, help="Return once deploying started, not once the model is ready.")
@json_option
@click.pass_context
def deploy_command(
    ctx: click.Context,
    name: str,
    source: str,
    version: int | None,
    model_format: str | None,
    gpus: int,
    gpu_memory: str | None,
    cpus: float,
    memory: str | None,
    max_batch_size: int,
    max_queue_delay: str,
    replicas: int,
    public: bool,
    label: str | None,
    requirements: str | None,
    no_wait: bool,
    as_json: bool,
) -> None:
    """Serve the model in SOURCE as NAME, over KServe v2 and TensorFlow Serving's APIs.

    SOURCE is a local file or folder (uploaded), a job's output (job:<id>:model/) or a pushed
    snapshot's name (NAME or NAME:path/in/it).
    """
    info = client(ctx).deploy(
        name,
        source,
        version=version,
        format=model_format,
        gpus=gpus,
        gpu_memory=gpu_memory,
        cpus=cpus,
        memory=memory,
        max_batch_size=max_batch_size,
        max_queue_delay=max_queue_delay,
        replicas=replicas,
        public=public,
        label=label,
        requirements=Path(requirements) if requirements else None,
        wait=not no_wait,
    )
    if as_json:
        print_json(info)
        return
    err.print(f"model {escape(info.name)} version {info.version} {info.state} ({info.format or 'format pending'})")
    for spec in info.inputs:
        err.print(f"  input  {escape(spec.name)}: {spec.datatype} {list(spec.shape)}")
    for spec in info.outputs:
        err.print(f"  output {escape(spec.name)}: {spec.datatype} {list(spec.shape)}")


@click.command("models")
@json_option
@click.pass_context
def models_command(ctx: click.Context, as_json: bool) -> None:
    """List the deployed models, each version apart."""
    models = client(ctx).models()
    if as_json:
        print_json(models)
        return
    if not models:
        err.print("no models deployed — `gpuport deploy NAME SOURCE`")
        return
    table = new_table()
    nodes = len({n for m in models for n in m.nodes if n}) > 1  # a cluster's: each replica's node is said
    columns = ("NAME", "VERSION", "STATE", "FORMAT", "OWNER", "REPLICAS", "NODES", "GPU", "BATCH")
    for column in (*columns, "REQUESTS", "ROWS/BATCH"):
        if column != "NODES" or nodes:
            table.add_column(column, no_wrap=column == "NAME")
    for m in models:
        gpu = format_size(m.gpu_memory) if m.gpu_memory else str(m.gpus) if m.gpus else "-"
        batch = f"{m.max_batch_size} / {format_duration(m.max_queue_delay)}" if m.max_batch_size > 1 else "off"
        state = m.state if not m.message else f"{m.state}: {m.message}"
        requests = f"{m.requests:,}" + (f" ({m.failed_batches:,} batches failed)" if m.failed_batches else "")
        table.add_row(
            escape(m.name),
            str(m.version) + (f" ({escape(', '.join(m.labels))})" if m.labels else ""),
            escape(state),
            m.format,
            escape(m.owner),
            str(m.replicas),
            *([escape(", ".join(n or "-" for n in m.nodes)) or "-"] if nodes else []),
            gpu,
            batch,
            requests,
            f"{m.mean_batch_size:.1f}" if m.batches else "-",
        )
    out.print(table)


@click.command("label")
@click.argument("name")
@click.argument("label")
@click.argument("version", type=click.IntRange(1))
@click.pass_context
def label_command(ctx: click.Context, name: str, label: str, version: int) -> None:
    """Point version label LABEL of model NAME at VERSION (TensorFlow Serving's labels).

    Clients that ask for the label (/v1/models/NAME/labels/LABEL:predict, or gRPC's
    model_spec.version_label) reach that version from now on: move "stable" to roll out."""
    m = client(ctx).label(name, label, version)
    err.print(f"model {escape(m.name)}: {escape(label)} is version {m.version}")


@click.command("undeploy")
@click.argument("name")
@click.option("--version", type=int, help="Just this version (default: every version).")
@click.pass_context
def undeploy_command(ctx: click.Context, name: str, version: int | None) -> None:
    """Stop serving model NAME and free its workers."""
    for m in client(ctx).undeploy(name, version):
        err.print(f"model {escape(m.name)} version {m.version} undeployed")
