"""Train a tiny model with PyTorch DistributedDataParallel (gloo) across the processes of one job.

Run as ``nprocs`` processes under gpuport's supervisor, which gives each one MASTER_ADDR,
MASTER_PORT, RANK and WORLD_SIZE (``init_method="env://"``). Each rank trains on its own synthetic
data; the all-reduce of the gradients keeps the parameters the same everywhere. Each rank saves its
final parameters, flattened and concatenated, to ``torch-params-<rank>.npy`` in $GPUPORT_OUTPUT_DIR
(or the working directory), for a test to compare.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

STEPS = 20
BATCH = 16

if os.environ.get("MASTER_ADDR") == "127.0.0.1":
    # Every rank on this machine: gloo's connections on loopback too. Left to itself, gloo uses the
    # address the hostname resolves to, which in containers is often one the ranks cannot reach.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)  # the ranks share the machine's cores
print(f"rank {rank} of {world}", flush=True)

torch.manual_seed(rank)  # different initial values: DDP must broadcast rank 0's
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
# Different data on every rank: equal parameters at the end are the all-reduce's doing, not chance.
data = torch.Generator().manual_seed(100 + rank)
target = torch.arange(1, 9, dtype=torch.float32)[:, None]
for step in range(STEPS):
    x = torch.randn(BATCH, 8, generator=data)
    loss = torch.nn.functional.mse_loss(model(x), x @ target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step in (0, STEPS - 1):
        print(f"step {step} loss {loss.item():.4f}", flush=True)

params = torch.cat([p.detach().flatten() for p in model.module.parameters()]).numpy()
out = Path(os.environ.get("GPUPORT_OUTPUT_DIR") or ".")
np.save(out / f"torch-params-{rank}.npy", params)
print(f"saved {params.size} parameters, sha256 {hashlib.sha256(params.tobytes()).hexdigest()}", flush=True)
dist.barrier()  # no rank leaves, taking down what the others still use (rank 0 holds the rendezvous store)
dist.destroy_process_group()
