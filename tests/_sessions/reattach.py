"""A second process that re-attaches to a named session (argv[1]) through GPUPORT_URL / _TOKEN /
_FINGERPRINT, finds the first process's value by name, reads it, leaves one of its own, and detaches."""

from __future__ import annotations

import json
import sys

import gpuport


def main(name: str) -> None:
    with gpuport.connect() as gpu, gpu.session(name=name) as session:  # named: leaving only detaches
        weights = session.ref("weights")
        found = sorted(ref.name for ref in session.refs())
        value = session.get(weights)
        session.put(value * 2, name="doubled")
        report = {
            "id": session.id,
            "refs": found,
            "type": weights.type,
            "summary": weights.summary,
            "session_id": weights.session_id,
            "dtype": value.dtype.str,
            "value": value.tolist(),
            "state": session.info().state,
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
