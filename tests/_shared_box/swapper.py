"""A model whose replicas attack the server while it restarts them (sent by value).

Replica 0 fills its writable model folder with folders ``d0``..``dN`` and swaps each, over and over,
with a symlink to the host folder ``target`` (renameat2 RENAME_EXCHANGE): a server that walks the
folder by path as root, as it starts a replica, follows the link. Replica 1 crashes soon after it
loads, ``crashes`` times, so that the server starts it again and again meanwhile."""

from __future__ import annotations

import ctypes
import os
import threading
import time

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


class Swapper:
    inputs = [("x", "FP32", (-1, 1))]
    outputs = [("y", "FP32", (-1, 1))]

    def __init__(self, target: str, crashes: int, seconds: float, pairs: int = 20) -> None:
        self.target, self.crashes, self.seconds, self.pairs = target, crashes, seconds, pairs

    def load(self) -> None:
        folder = os.environ["GPUPORT_MODEL_DIR"]
        if os.environ["GPUPORT_MODEL_REPLICA"] == "0":
            threading.Thread(target=self._swap, args=(folder,), daemon=True).start()
            return
        made = len([n for n in os.listdir(folder) if n.startswith("crashed-")])
        if made < self.crashes:
            open(os.path.join(folder, f"crashed-{made}"), "w").close()
            threading.Timer(0.5, os._exit, (7,)).start()

    def _swap(self, folder: str) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        pairs = []
        for i in range(self.pairs):
            real, link = os.path.join(folder, f"d{i}"), os.path.join(folder, f"l{i}")
            if not os.path.lexists(real):
                os.makedirs(os.path.join(real, "inner"))
                open(os.path.join(real, "file"), "w").close()
            if not os.path.lexists(link):
                os.symlink(self.target, link)
            pairs.append((real.encode(), link.encode()))
        end = time.monotonic() + self.seconds
        while time.monotonic() < end:
            for real, link in pairs:
                libc.renameat2(_AT_FDCWD, real, _AT_FDCWD, link, _RENAME_EXCHANGE)
        open(os.path.join(folder, "swapped"), "w").close()

    def predict(self, batch: dict) -> dict:
        return {"y": batch["x"]}
