"""A session's worker: one Python process holding the session's allocation, its values and its functions.

Started as the command of a job of kind "session" (so it queues, holds its GPUs, is capped and
watched like any job): ``python -m gpuport.server.worker.session``. In its job's run folder
(``GPUPORT_RUN_DIR``, the executor's) it writes its output (``stdout``, ``stderr``, starting where the
session's earlier worker's ended, ``GPUPORT_SESSION_OUTPUT``, so that offsets only grow) and listens
on ``worker.sock`` for the server: its own connection and one per
data-port channel, answered one request at a time (see wire.py for the frames). The server reconnects
after its own restart; the values stay here.

Values arrive as the codec's header and buffers (protocol/values.py): inline, or as a memfd the server
filled from the client's upload, mapped here without a copy. Results larger than ``_INLINE_BYTES`` go
back the same way, unless the request says ``inline``: a server on another machine (the worker runs on
a node of a cluster, reached through its agent) shares no memory with it, and gets every byte inline.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import selectors
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

import cloudpickle

from gpuport.defaults import ENV_RUN_DIR, ENV_SESSION_DIR, ENV_SESSION_IDLE_TIMEOUT, ENV_SESSION_OUTPUT
from gpuport.defaults import SESSION_INLINE_BYTES as _INLINE_BYTES  # larger results go back in a memfd
from gpuport.protocol import refs, values
from gpuport.server.worker import wire

# A call with no arguments, and a result of None, as the codec writes them: the no-op fast path.
_NO_ARGS = values.encode(((), {}))
_NO_ARGS_HEADER, _NO_ARGS_PICKLE = _NO_ARGS.header.decode(), _NO_ARGS.buffers[0].tobytes()
_NONE = values.encode(None)


def describe(value: Any) -> tuple[str, str]:
    """A value's type name and a short summary, for a Ref's repr."""
    kind = type(value)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        try:
            dims = tuple(int(d) if d is not None else None for d in shape)
        except TypeError:
            dims = shape
        return name, f"{getattr(dtype, 'name', dtype)} {dims}"
    try:
        return name, f"{len(value)} items"
    except Exception:
        return name, ""


class Worker:
    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.values: dict[str, Any] = {}
        self.names: dict[str, str] = {}  # name → ref id
        self.functions: dict[str, Any] = {}  # sha256 of the pickle → function
        self.mappings: dict[str, _Mapping] = {}  # ref id → the memfd its value was put in
        self.releasing: list[_Mapping] = []  # memfds whose values are gone, once nothing uses them
        self.count = 0
        self.inline = False  # the request being answered wants its result inline (no memfd)
        refs.table = self.values

    # ---- requests ---------------------------------------------------------------------------------

    def handle(self, frame: wire.Frame) -> tuple[dict[str, Any], list[Any], list[int]]:
        header = frame.header
        self.inline = bool(header.get("inline"))
        buffers: list[Any] = list(frame.buffers)
        kept: _Mapping | None = None
        for fd, size in zip(frame.fds, header.get("fd_sizes", [])):
            mapping = _Mapping(fd, size)  # the map stays valid once the descriptor is closed
            at = 0
            for part in header.get("staged_sizes", [size]):
                buffers.append(mapping.view[at : at + part])
                at += part
            if header["op"] == "put" and kept is None:
                kept = mapping
            else:
                self.releasing.append(mapping)
        op = header["op"]
        try:
            if op == "call":
                return self._call(header, buffers)
            if op == "put":
                try:
                    value = self._put_value(header["value"], buffers, header.get("device") or None)
                except refs.UnknownRef:
                    raise
                except Exception as e:  # the worker lives on: nothing was kept
                    return {"error": ["InvalidRequest", f"the worker cannot take this value: {e}"]}, [], []
                del buffers
                reply = self._keep(value, header.get("name", ""))
                if kept is not None:  # sent back from the same memory, while the value is that memory
                    self.mappings[reply["ref"]["ref_id"]] = kept
                    kept = None
                return reply, [], []
            if op == "get":
                return self._reply(self._lookup(header["ref_ids"][0]))
            if op == "delete":
                for ref_id in header["ref_ids"]:
                    self._lookup(ref_id)
                for ref_id in header["ref_ids"]:
                    self._drop(ref_id)
                    for name, held in list(self.names.items()):
                        if held == ref_id:
                            del self.names[name]
                return {}, [], []
            if op == "refs":
                return {"refs": [self._ref_info(r) for r in self.values]}, [], []
            return {"error": ["InvalidRequest", f"unknown operation {op!r}"]}, [], []
        except refs.UnknownRef as e:
            return {"error": ["NotFound", self._unknown(str(e))]}, [], []
        except LookupError as e:
            return {"error": ["NotFound", str(e.args[0]) if e.args else str(e)]}, [], []
        finally:
            if kept is not None:
                self.releasing.append(kept)

    def _drop(self, ref_id: str) -> None:
        self.values.pop(ref_id, None)
        mapping = self.mappings.pop(ref_id, None)
        if mapping is not None:
            self.releasing.append(mapping)

    def released(self) -> list[tuple[int, int]]:
        """(descriptor, size) of each memfd that no value uses any more: they go back to the server,
        which receives the session's next large values into them (their pages already made)."""
        out, still = [], []
        for mapping in self.releasing:
            if mapping.unmap():
                if mapping.fd >= 0:
                    out.append((mapping.fd, mapping.size))
                    mapping.fd = -1
            else:
                still.append(mapping)
        self.releasing = still
        return out

    def _unknown(self, ref_id: str) -> str:
        owner = ref_id.split("/")[0]
        if owner != self.job_id:
            return (
                f"the value {ref_id} was held by an earlier worker of this session ({owner}), which has ended; "
                "put it again"
            )
        return f"the session holds no value {ref_id} (deleted?)"

    def _lookup(self, ref_id: str) -> Any:
        if ref_id not in self.values:
            raise refs.UnknownRef(ref_id)
        return self.values[ref_id]

    def _decode(self, header: str, buffers: list[Any], device: str | None = None) -> Any:
        return values.decode(header, buffers, device=device)

    def _put_value(self, header: str, buffers: list[Any], device: str | None) -> Any:
        if device == "gpu" and not os.environ.get("CUDA_VISIBLE_DEVICES"):
            # A session holding no GPU runs on the CPU, as everything does on a machine without one.
            print("gpuport: this session holds no GPU: the value stays on the CPU", file=sys.stderr)
            device = "cpu"
        return self._decode(header, buffers, device)

    def _call(self, header: dict[str, Any], buffers: list[Any]) -> tuple[dict[str, Any], list[Any], list[int]]:
        digest = header["function"]
        function = self.functions.get(digest)
        if header.get("function_pickle"):
            data = buffers.pop(0)
            if function is None:
                if hashlib.sha256(data).hexdigest() != digest:
                    return {"error": ["InvalidRequest", "the function's pickle does not match its hash"]}, [], []
                try:
                    function = self.functions[digest] = cloudpickle.loads(data)
                except Exception as e:
                    return self._failure(e, "the function could not be unpickled in the worker: ")
        if function is None:
            return {"unknown_function": True}, [], []
        try:
            if len(buffers) == 1 and buffers[0] == _NO_ARGS_PICKLE and header["value"] == _NO_ARGS_HEADER:
                args, kwargs = (), {}
            else:
                args, kwargs = self._decode(header["value"], buffers)
        except refs.UnknownRef:
            raise
        except Exception as e:
            return self._failure(e, "the arguments could not be unpickled in the worker: ")
        try:
            result = function(*args, **kwargs)
        except BaseException as e:  # SystemExit and KeyboardInterrupt too: the worker stays up
            return self._failure(e)
        finally:
            del args, kwargs
        if header.get("keep"):
            return self._keep(result, header.get("name", "")), [], []
        return self._reply(result)

    def _keep(self, value: Any, name: str) -> dict[str, Any]:
        self.count += 1
        ref_id = f"{self.job_id}/{self.count}"
        self.values[ref_id] = value
        if name:
            old = self.names.get(name)
            if old is not None:
                self._drop(old)  # a name holds one value: the newest
            self.names[name] = ref_id
        return {"ref": self._ref_info(ref_id)}

    def _ref_info(self, ref_id: str) -> dict[str, str]:
        name = next((n for n, r in self.names.items() if r == ref_id), "")
        kind, summary = describe(self.values[ref_id])
        return {"ref_id": ref_id, "name": name, "type": kind, "summary": summary}

    def _reply(self, value: Any) -> tuple[dict[str, Any], list[Any], list[int]]:
        if value is None:
            return {"value": _NONE.header.decode()}, list(_NONE.buffers), []
        try:
            encoded = values.encode(value)
        except Exception as e:
            return self._failure(e, "the result cannot be sent back (keep it in the session with keep=True): ")
        header: dict[str, Any] = {"value": encoded.header.decode()}
        total = sum(b.nbytes for b in encoded.buffers)
        if total <= _INLINE_BYTES or self.inline:
            return header, list(encoded.buffers), []
        shared = self._in_mappings(encoded.buffers)
        if shared is not None:  # a value that was put: no copy, the server reads the same memory
            fds = sorted({fd for fd, _, _ in shared})
            header["parts"] = [[fds.index(fd), offset, size] for fd, offset, size in shared]
            return header, [], [os.dup(fd) for fd in fds]
        fd, mapped = wire.staging_file(total, "gpuport-result")
        try:
            at = 0
            for b in encoded.buffers:
                mapped[at : at + b.nbytes] = b.cast("B")  # type: ignore[index]
                at += b.nbytes
        except BaseException:
            os.close(fd)
            raise
        finally:
            if mapped is not None:
                mapped.close()
        parts, at = [], 0
        for b in encoded.buffers:
            parts.append([0, at, b.nbytes])
            at += b.nbytes
        header["parts"] = parts
        return header, [], [fd]

    def _in_mappings(self, buffers: list[memoryview]) -> list[tuple[int, int, int]] | None:
        """(descriptor, offset, size) of each buffer when every one lies in a memfd a value was put in."""
        if not self.mappings:
            return None
        out = []
        for b in buffers:
            address = _address(b)
            if address is None:
                return None
            for mapping in self.mappings.values():
                if mapping.fd >= 0 and mapping.base <= address and address + b.nbytes <= mapping.base + mapping.size:
                    out.append((mapping.fd, address - mapping.base, b.nbytes))
                    break
            else:
                return None
        return out

    def _failure(self, error: BaseException, prefix: str = "") -> tuple[dict[str, Any], list[Any], list[int]]:
        kind = type(error)
        name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        tb = error.__traceback__
        if tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next  # the worker's own frame says nothing to the user
        text = "".join(traceback.format_exception(kind, error, tb))
        try:
            pickled = cloudpickle.dumps(error, protocol=5)
        except Exception:
            pickled = b""
        failure = {"kind": "raised", "type": name, "message": prefix + str(error), "traceback": text}
        return {"failure": failure}, [pickled] if pickled else [], []

    # ---- the loop ---------------------------------------------------------------------------------

    def serve(self, listener: socket.socket, idle_timeout: float | None) -> None:
        """Answer the server's connections (its own, and one per data-port channel), one request at a
        time. The server ends an idle session; a worker whose server is gone (stopped for good, or a
        crashed test) ends itself once idle a while longer."""
        with selectors.DefaultSelector() as selector:
            selector.register(listener, selectors.EVENT_READ)
            while True:
                ready = selector.select(idle_timeout)
                if not ready:
                    for key in list(selector.get_map().values()):
                        if key.fileobj is not listener:
                            key.fileobj.close()  # type: ignore[union-attr]
                    return
                for key, _ in ready:
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if sock is listener:
                        conn, _ = listener.accept()
                        conn.settimeout(idle_timeout)
                        selector.register(conn, selectors.EVENT_READ)
                    elif not self._answer(sock):
                        selector.unregister(sock)
                        sock.close()  # the server went away (it restarts), or a channel closed

    def _answer(self, conn: socket.socket) -> bool:
        """Answer one request on ``conn``; False once the other side has gone."""
        try:
            frame = wire.recv(conn)
        except (EOFError, OSError):
            return False
        header, buffers, fds = self.handle(frame)
        del frame
        if self.releasing and not self.inline:  # inline: the server cannot take descriptors
            released = self.released()
            if released:  # after the descriptors of the reply's own parts
                header["released"] = [[len(fds) + i, size] for i, (_, size) in enumerate(released)]
                fds = fds + [fd for fd, _ in released]
        sys.stdout.flush()
        sys.stderr.flush()
        header["stdout"] = os.fstat(1).st_size
        header["stderr"] = os.fstat(2).st_size
        header["values"] = len(self.values)  # the server's count (`gpuport sessions`) is this one
        try:
            wire.send(conn, header, buffers, fds)
        except OSError:
            return False
        finally:
            for fd in fds:
                os.close(fd)
        return True


class _Mapping:
    """A memfd a value arrived in, mapped; its descriptor is kept while a Ref's value may live there."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self.view = wire.map_file(fd, size)
        self.mapped = self.view.obj if size else None
        self.base = _address(self.view) or 0 if size else 0

    def unmap(self) -> bool:
        """Unmap the memory, once no value uses it any more (False while one does)."""
        try:
            self.view.release()
            if isinstance(self.mapped, mmap.mmap):
                self.mapped.close()
        except BufferError:  # arrays still point into it
            return False
        return True


def _address(buffer: memoryview) -> int | None:
    """Where a buffer's bytes start in memory, or None when that cannot be told."""
    if not buffer.nbytes:
        return None
    numpy = sys.modules.get("numpy")
    try:
        if numpy is not None:
            return int(numpy.frombuffer(buffer, dtype=numpy.uint8).ctypes.data)
        return ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    except (TypeError, ValueError, BufferError):
        return None


def _output(folder: Path, starts: str) -> None:
    """Point fds 1 and 2 at the session's output files, which the server follows: each starts (a hole)
    where the earlier worker's ended, so that an offset names the same byte whichever worker wrote it."""
    at = [int(n) for n in starts.split(",")] if starts else [0, 0]
    for fd, name, start in ((1, "stdout", at[0]), (2, "stderr", at[1])):
        target = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        if os.fstat(target).st_size < start:
            os.ftruncate(target, start)
        os.dup2(target, fd)
        os.close(target)


def main() -> None:
    folder = Path(os.environ[ENV_RUN_DIR])
    os.environ[ENV_SESSION_DIR] = str(folder)  # where code in the session opens its own endpoints (tunnels)
    _output(folder, os.environ.pop(ENV_SESSION_OUTPUT, ""))
    listener = wire.listen(str(folder), "worker.sock")
    # The user's functions import their modules from the session's workdir, as a script's would.
    sys.path.insert(0, os.getcwd())
    idle = float(os.environ.get(ENV_SESSION_IDLE_TIMEOUT, "0")) or None
    Worker(os.environ.get("GPUPORT_JOB_ID", "w")).serve(listener, idle * 1.5 + 60 if idle else None)


if __name__ == "__main__":
    main()
