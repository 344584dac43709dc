"""Multi-process jobs through the server: `gpuport run --nprocs N`, the ranks' environment, their
logs, fail-fast, and real distributed training with TensorFlow (MultiWorkerMirroredStrategy) and
PyTorch (DDP over gloo) on the CPU."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

import gpuport
from tests.conftest import RunningServer, client_env

SCRIPTS = Path(__file__).parent / "_distributed"

# Prints what the rank sees; a chief then waits for the others to have done so, since the job ends
# (and the others are stopped) when its chief has finished.
SHOW_ENV = textwrap.dedent(
    """
    import json, os, time
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"]
    print(json.dumps({k: os.environ.get(k) for k in keys}))
    print(os.environ["TF_CONFIG"], flush=True)
    open(f"shown-{os.environ['RANK']}", "w").close()
    others = [f"shown-{r}" for r in range(int(os.environ["WORLD_SIZE"])) if str(r) != os.environ["RANK"]]
    deadline = time.monotonic() + 30
    if json.loads(os.environ["TF_CONFIG"])["task"]["type"] == "chief":
        while not all(os.path.exists(o) for o in others) and time.monotonic() < deadline:
            time.sleep(0.01)
    """
)


def _by_rank(lines: list[str]) -> dict[int, list[str]]:
    ranks: dict[int, list[str]] = {}
    for line in lines:
        prefix, _, text = line.partition("] ")
        ranks.setdefault(int(prefix.lstrip("[")), []).append(text)
    return ranks


def test_nprocs_gives_each_rank_its_environment_and_gpus_and_prefixes_its_lines(
    admin: gpuport.Client, tmp_path: Path
) -> None:
    (tmp_path / "show.py").write_text(SHOW_ENV)
    job = admin.submit(["python", "show.py"], workdir=tmp_path, gpus=2, nprocs=2).wait(60)
    assert job.info.state == "succeeded" and job.info.nprocs == 2
    ranks = _by_rank(list(job.logs()))
    assert sorted(ranks) == [0, 1]
    envs = {r: json.loads(lines[0]) for r, lines in ranks.items()}
    for rank, env in envs.items():
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["CUDA_VISIBLE_DEVICES"] == str(rank)  # one GPU each
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
    configs = {r: json.loads(lines[1]) for r, lines in ranks.items()}
    workers = configs[0]["cluster"]["worker"]
    assert len(workers) == 2 and len(set(workers)) == 2 and configs[1]["cluster"] == configs[0]["cluster"]
    assert [configs[r]["task"] for r in (0, 1)] == [{"type": "worker", "index": 0}, {"type": "worker", "index": 1}]


def test_tf_roles_from_the_cli(server: RunningServer, cli: object, tmp_path: Path) -> None:
    (tmp_path / "show.py").write_text(SHOW_ENV)
    result = cli(  # type: ignore[operator]
        "run", "--tf-roles", "chief=1,worker=2", "-w", str(tmp_path), "--", "python", "show.py", **client_env(server)
    )
    assert result.code == 0, result.output
    ranks = _by_rank([line for line in result.stdout.splitlines() if line.startswith("[")])
    tasks = [json.loads(ranks[r][1])["task"] for r in range(3)]
    assert tasks == [{"type": "chief", "index": 0}, {"type": "worker", "index": 0}, {"type": "worker", "index": 1}]
    assert len(json.loads(ranks[0][1])["cluster"]["worker"]) == 2


def test_one_failing_rank_stops_the_others_and_fails_the_job_with_its_code(
    server: RunningServer, cli: object, tmp_path: Path
) -> None:
    (tmp_path / "fail.py").write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    print('rank 1 fails', flush=True); sys.exit(3)\n"
        "time.sleep(120)\n"
    )
    result = cli(  # type: ignore[operator]
        "run", "--nprocs", "2", "-w", str(tmp_path), "--", "python", "fail.py", **client_env(server)
    )
    assert result.code == 3, result.output
    assert "[1] rank 1 fails" in result.stdout
    assert "rank 1 exited with code 3" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("script", "saved"),
    [("tf_multiworker.py", "tf-weights"), ("torch_ddp.py", "torch-params")],
    ids=["keras-multiworker-mirrored", "torch-ddp-gloo"],
)
def test_distributed_training_ends_with_identical_weights_on_both_ranks(
    admin: gpuport.Client, tmp_path: Path, script: str, saved: str
) -> None:
    job = admin.submit(["python", script], workdir=SCRIPTS, nprocs=2).wait(240)
    assert job.info.state == "succeeded", "\n".join(job.logs())
    job.download(tmp_path)
    first, second = (np.load(tmp_path / f"{saved}-{i}.npy") for i in (0, 1))
    assert first.size > 100 and np.array_equal(first, second)


def test_a_job_over_several_nodes_needs_a_server_in_front_of_a_cluster(admin: gpuport.Client) -> None:
    with pytest.raises(gpuport.InvalidRequest, match="a job over 2 nodes needs a server in front of a cluster"):
        admin.submit(["true"], workdir=None, nodes=2)
