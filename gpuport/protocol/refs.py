"""Refs inside pickled values: a client's ``Ref`` pickles as a call to ``held(ref_id)``, which a
session's worker answers from the values it holds — so a Ref anywhere among a call's arguments
(in a list, a dict, an object's attribute) becomes the value itself, without a transfer."""

from __future__ import annotations

from typing import Any

# The worker's values by Ref id; None outside a worker.
table: dict[str, Any] | None = None


class UnknownRef(LookupError):
    """A Ref the worker does not hold (deleted, or from an earlier worker of the session)."""


def held(ref_id: str) -> Any:
    if table is None:
        raise RuntimeError("a gpuport Ref is resolved only inside its session's worker; use session.get(ref)")
    try:
        return table[ref_id]
    except KeyError:
        raise UnknownRef(ref_id) from None
