"""The rules every path inside a snapshot obeys, checked by the client before upload and by the server.

A snapshot path is relative, '/'-separated and normalized: no leading '/', no '.' or '..'
component, no empty component, no NUL. A symlink's target is relative too and, read from the
link's folder, stays inside the snapshot, followed as the kernel follows it: through the other
links of the manifest (``b -> .`` makes ``b/b/../..`` leave the root, which ``normpath`` would not
see). Nothing may sit below a symlink (the server would write through it), nor below a file.
"""

from __future__ import annotations

import hashlib
import json
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


_MAX_LINK_HOPS = 40  # the kernel's own limit on symlinks followed in one path lookup (ELOOP)


def _resolve_link(path: str, target: str, links: dict[str, str]) -> None:
    """Follow ``target`` from the folder of the link at ``path`` through ``links`` (path → target),
    one component at a time; raise ``InvalidRequest`` where it leaves the snapshot or loops."""
    where = path.split("/")[:-1]
    todo = target.split("/")
    hops = 0
    while todo:
        part = todo.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if not where:
                raise InvalidRequest(f"symlink {path!r} points to {target!r}, which leads outside the workdir")
            where.pop()
            continue
        where.append(part)
        inner = links.get("/".join(where))
        if inner is not None:
            hops += 1
            if hops > _MAX_LINK_HOPS:
                raise InvalidRequest(f"symlink {path!r} points to {target!r}, which loops through other links")
            where.pop()
            todo = inner.split("/") + todo


class _Entry(Protocol):
    @property
    def path(self) -> str: ...
    @property
    def blob(self) -> str: ...
    @property
    def link(self) -> str: ...


class _File(_Entry, Protocol):
    @property
    def size(self) -> int: ...
    @property
    def mode(self) -> int: ...


def snapshot_id(entries: Iterable[_File]) -> str:
    """A snapshot's id: the SHA-256 of its manifest (``entries`` in path order) in one canonical form.
    The server names snapshots by it; a client computes it alike to name an unchanged folder's
    snapshot without sending the manifest (``Snapshots.Name``)."""
    canonical = json.dumps([[e.path, e.blob, e.size, e.mode & 0o777, e.link] for e in entries], separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_entries(entries: Iterable[_Entry]) -> None:
    """Check every entry of a manifest: valid paths and links, no duplicates, nothing below a symlink
    or a file."""
    seen: set[str] = set()
    links: dict[str, str] = {}
    for entry in entries:
        path = check_path(entry.path)
        if path != entry.path:
            raise InvalidRequest(f"path {entry.path!r} is not normalized (use {path!r})")
        if path in seen:
            raise InvalidRequest(f"path {path!r} appears twice in the manifest")
        seen.add(path)
        if entry.link:
            links[path] = check_link(path, entry.link)
    for path, target in links.items():
        _resolve_link(path, target, links)
    folders: set[str] = set()  # the parents of entries, each checked once
    for path in seen:
        parent = posixpath.dirname(path)
        while parent and parent not in folders:
            if parent in links:
                raise InvalidRequest(f"path {path!r} lies below the symlink {parent!r}")
            if parent in seen:
                raise InvalidRequest(f"path {parent!r} is a file, and also the folder of {path!r}")
            folders.add(parent)
            parent = posixpath.dirname(parent)
