"""A process that calls a remote function and exits without closing it: its workers must end anyway."""

from __future__ import annotations

import json
import os

import gpuport


def main() -> None:
    gpu = gpuport.connect()
    where = gpu.function()(lambda: os.environ["GPUPORT_JOB_ID"])  # the worker's job
    print(json.dumps({"worker": where()}), flush=True)


if __name__ == "__main__":
    main()
