"""Ordinary work that a job, a session worker and a model replica each must be able to do as an
ordinary user's uid: processes that share memory, and files in the home folder. Sent by value."""

from __future__ import annotations

import math
import multiprocessing
import os
from multiprocessing import shared_memory


def ordinary_work() -> dict[str, object]:
    """Each piece's result, or raises the first failure (its message names what failed)."""
    import joblib
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    done: dict[str, object] = {"uid": os.getuid(), "home": os.path.expanduser("~")}
    with multiprocessing.Pool(2) as pool:
        done["pool"] = pool.map(
            math.factorial, range(5)
        )  # a function any process imports: sent by value, this module is not
    lock = multiprocessing.Lock()
    with lock:
        done["lock"] = True
    memory = shared_memory.SharedMemory(create=True, size=1 << 20)
    try:
        memory.buf[:3] = b"abc"
        done["shared_memory"] = bytes(memory.buf[:3]).decode()
    finally:
        memory.close()
        memory.unlink()
    done["joblib"] = joblib.Parallel(n_jobs=2, backend="loky")(joblib.delayed(math.factorial)(i) for i in range(5))
    data = TensorDataset(torch.arange(8, dtype=torch.float32))
    done["dataloader"] = sorted(int(x) for (batch,) in DataLoader(data, batch_size=2, num_workers=2) for x in batch)
    cache = os.path.join(os.path.expanduser("~"), ".cache", "gpuport-test")
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, "kept"), "w") as f:
        f.write("ok")
    done["home_owner"] = os.stat(os.path.expanduser("~")).st_uid
    done["shm_owner"] = os.stat("/dev/shm").st_uid
    return done


class OrdinaryModel:
    """A model replica that does the ordinary work when it loads, and answers with its result's size."""

    inputs = [("x", "FP32", (-1, 1))]
    outputs = [("y", "FP32", (-1, 1))]

    def load(self) -> None:
        self.done = ordinary_work()

    def predict(self, batch: dict) -> dict:
        import numpy as np

        return {"y": np.full_like(batch["x"], float(self.done["uid"]))}


if __name__ == "__main__":
    import json

    print("ORDINARY", json.dumps(ordinary_work()))
