"""The inside end of an environment build's way to its package index: run in the build sandbox (as
``python -I -S _index_bridge.py SOCKET PORT``, the standard library only), it listens on
127.0.0.1:PORT of the sandbox's own network namespace, where uv's ``HTTPS_PROXY`` points, and
carries each connection to the server's index proxy on the Unix socket SOCKET (``index_proxy.py``),
which lets through only the index's hosts. It returns once it listens (uv may start at once) and
serves from a child process for as long as the sandbox lives."""

from __future__ import annotations

import os
import socket
import sys
import threading


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for end, how in ((sink, socket.SHUT_WR), (source, socket.SHUT_RD)):
            try:
                end.shutdown(how)
            except OSError:
                pass


def _carry(client: socket.socket, path: str) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    folder = -1
    try:
        if len(os.fsencode(path)) >= 100:  # longer than a Unix socket's address may be: through its folder
            folder = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            server.connect(f"/proc/self/fd/{folder}/{os.path.basename(path)}")
        else:
            server.connect(path)
    except OSError:
        client.close()
        server.close()
        return
    finally:
        if folder >= 0:
            os.close(folder)
    back = threading.Thread(target=_pump, args=(server, client), daemon=True)
    back.start()
    _pump(client, server)
    back.join()
    client.close()
    server.close()


def main(path: str, port: int) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    if os.fork():
        os._exit(0)  # listening: the build's shell goes on to uv
    os.closerange(0, 3)
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_carry, args=(client, path), daemon=True).start()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
