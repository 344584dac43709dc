"""The rules every path inside a snapshot obeys, checked by the client before upload and by the server.

A snapshot path is relative, '/'-separated and normalized: no leading '/', no '.' or '..'
component, no empty component, no NUL. A symlink's target is relative too and, read from the
link's folder, stays inside the snapshot. Nothing may sit below a symlink (the server would write
through it).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable
from typing import Protocol

from gpuport.defaults import MAX_PATH_BYTES
from gpuport.protocol.errors import InvalidRequest


def check_path(path: str, *, what: str = "path") -> str:
    """Return ``path`` if it is a valid snapshot path (a trailing '/' is dropped); raise ``InvalidRequest``."""
    if path.endswith("/") and len(path) > 1:
        path = path.rstrip("/")
    if not path:
        raise InvalidRequest(f"empty {what}")
    if len(path.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise InvalidRequest(f"{what} {path[:80]!r}... is longer than {MAX_PATH_BYTES} bytes")
    if "\0" in path:
        raise InvalidRequest(f"{what} {path!r} contains a NUL byte")
    if path.startswith("/"):
        raise InvalidRequest(f"{what} {path!r} is absolute — paths must be relative to the workdir")
    parts = path.split("/")
    if ".." in parts:
        raise InvalidRequest(f"{what} {path!r} contains '..' — paths must stay inside the workdir")
    if "." in parts or "" in parts:
        raise InvalidRequest(f"{what} {path!r} is not normalized (use {posixpath.normpath(path)!r})")
    return path


def check_link(path: str, target: str) -> str:
    """Return ``target`` if a symlink at ``path`` pointing there stays inside the snapshot; raise ``InvalidRequest``."""
    if not target or target.startswith("/") or "\0" in target:
        raise InvalidRequest(
            f"symlink {path!r} points to {target!r}, outside the workdir — only relative links stay inside"
        )
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(path), target))
    if resolved == ".." or resolved.startswith("../"):
        raise InvalidRequest(f"symlink {path!r} points to {target!r}, outside the workdir")
    return target


class _Entry(Protocol):
    @property
    def path(self) -> str: ...
    @property
    def blob(self) -> str: ...
    @property
    def link(self) -> str: ...


def check_entries(entries: Iterable[_Entry]) -> None:
    """Check every entry of a manifest: valid paths and links, no duplicates, nothing below a symlink."""
    seen: set[str] = set()
    links: set[str] = set()
    for entry in entries:
        path = check_path(entry.path)
        if path != entry.path:
            raise InvalidRequest(f"path {entry.path!r} is not normalized (use {path!r})")
        if path in seen:
            raise InvalidRequest(f"path {path!r} appears twice in the manifest")
        seen.add(path)
        if entry.link:
            check_link(path, entry.link)
            links.add(path)
    if links:
        for path in seen:
            parent = posixpath.dirname(path)
            while parent:
                if parent in links:
                    raise InvalidRequest(f"path {path!r} lies below the symlink {parent!r}")
                parent = posixpath.dirname(parent)
