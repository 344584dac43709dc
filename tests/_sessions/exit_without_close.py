"""A process that calls a remote function and exits without closing it: its workers must end anyway."""

from __future__ import annotations

import json
import os

import gpuport


def main() -> None:
    gpu = gpuport.connect()
    where = gpu.function()(os.getpid)
    print(json.dumps({"pid": where()}), flush=True)


if __name__ == "__main__":
    main()
