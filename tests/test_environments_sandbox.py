"""An environment's build is sandboxed (issue 34, point 3): a package's build script reaches no host
but the package index, and cannot change uv's cache, which later builds of other users read."""

from __future__ import annotations

import functools
import http.server
import os
import socket
import tarfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuport.server.environments import Environments, EnvRequest
from gpuport.server.index_proxy import PYPI_HOSTS, IndexProxy, index_hosts
from gpuport.server.isolation import detect
from gpuport.server.worker.wire import _reachable
from tests.conftest import RunningServer, needs_users, server_env, start_server
from tests.test_environments import INDEX, UV, _absent, _log, _wheel

pytestmark = pytest.mark.skipif(not Path(UV).exists(), reason="uv is not installed (gpuport[server] brings it)")

# What the sdist's setup.py tries, as the build uid, before it writes its module: each attempt's outcome
# goes into the module (RESULT), so that the job that imports it shows what the build could do.
_SETUP = """
import os, socket
from setuptools import setup
results = {}
try:
    socket.create_connection(("127.0.0.1", OTHER), timeout=5).close()
    results["direct"] = "CONNECTED"
except OSError as e:
    results["direct"] = type(e).__name__
proxy = os.environ.get("HTTPS_PROXY", "")
if proxy:
    host, port = proxy.rsplit("/", 1)[-1].rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=10) as s:
            # CR LF written so: setuptools turns each backslash-r-backslash-n of a setup.py into one -n.
            s.sendall(b"CONNECT 127.0.0.1:%d HTTP/1.1\\x0d\\x0aHost: 127.0.0.1\\x0d\\x0a\\x0d\\x0a" % OTHER)
            results["proxy"] = s.recv(200).split(b"\\x0d")[0].decode()
    except OSError as e:
        results["proxy"] = "%s: %s" % (proxy, type(e).__name__)
cache = os.environ.get("UV_CACHE_DIR", "")
try:
    with open(os.path.join(cache, "planted-MARK"), "w") as f:
        f.write("MARK")
    results["plant"] = "WROTE"
except OSError as e:
    results["plant"] = type(e).__name__
results["alter"] = "nothing to alter"
for top, _, names in os.walk(cache):
    for name in names:
        path = os.path.join(top, name)
        if os.path.isfile(path) and not os.path.islink(path) and "planted" not in name:
            try:
                with open(path, "a") as f:
                    f.write("MARK")
                results["alter"] = "ALTERED"
            except OSError as e:
                results["alter"] = type(e).__name__
            break
    if results["alter"] != "nothing to alter":
        break
with open("gpuport_build_probe.py", "w") as f:
    f.write("RESULT = %r\\n" % results)
setup(name="gpuport-build-probe", version="VERSION", py_modules=["gpuport_build_probe"])
"""


def _sdist(folder: Path, version: str, mark: str, other: int) -> Path:
    """An sdist of ``gpuport-build-probe`` whose setup.py tries the network and uv's cache."""
    folder.mkdir(parents=True, exist_ok=True)
    source = _SETUP.replace("OTHER", str(other)).replace("MARK", mark).replace("VERSION", version)
    path = folder / f"gpuport_build_probe-{version}.tar.gz"
    top = f"gpuport_build_probe-{version}"
    staged = folder / top
    staged.mkdir()
    (staged / "setup.py").write_text(source)
    (staged / "PKG-INFO").write_text(f"Metadata-Version: 2.1\nName: gpuport-build-probe\nVersion: {version}\n")
    with tarfile.open(path, "w:gz") as tar:
        tar.add(staged, arcname=top)
    for name in ("setup.py", "PKG-INFO"):
        (staged / name).unlink()
    staged.rmdir()
    return path


class _Listener:
    """A port on this machine's loopback that counts the connections it gets."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()


@pytest.fixture(scope="module")
def other() -> Iterator[_Listener]:
    listener = _Listener()
    yield listener
    listener.sock.close()


@pytest.fixture(scope="module")
def http_links(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A find-links folder served over HTTP on 127.0.0.1 (its listing is the page uv reads)."""
    folder = tmp_path_factory.mktemp("links")
    folder.chmod(0o755)
    handler = functools.partial(_QuietHandler, directory=str(folder))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/", folder
    httpd.shutdown()
    httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def net_server(tmp_path_factory: pytest.TempPathFactory, http_links: tuple[str, Path]) -> Iterator[RunningServer]:
    """A server whose index has a part over HTTP (find-links): its builds need the network."""
    _absent()
    needs_users()
    state = tmp_path_factory.mktemp("envs-net") / "gpuport"
    env = server_env(GPUPORT_FAKE_GPUS="1x16GiB", UV_INDEX_URL=INDEX, UV_FIND_LINKS=http_links[0])
    running = start_server(state, env=env)
    yield running
    running.stop()


def _cache_holds(cache: Path, mark: str) -> list[str]:
    """The files of uv's shared cache named after ``mark`` or holding it."""
    found = []
    for top, _, names in os.walk(cache):
        for name in names:
            path = Path(top, name)
            if mark in name or (path.is_file() and not path.is_symlink() and mark.encode() in path.read_bytes()):
                found.append(str(path))
    return found


_SHOW = "import gpuport_build_probe as p, importlib.metadata as m; print('RESULT', p.RESULT); print(m.version({!r}))"


def test_a_build_reaches_only_the_index_and_leaves_uvs_cache_alone(
    net_server: RunningServer, http_links: tuple[str, Path], other: _Listener, tmp_path: Path
) -> None:
    """Over an index served by HTTP: a wheel installs, an sdist builds, and its setup.py can neither
    connect to another port of this machine (directly or through the build's proxy) nor change uv's
    cache; a user's job."""
    url, folder = http_links
    mark = uuid.uuid4().hex
    version = f"0.{int(mark[:6], 16)}"
    wheel = f"gpuport_http_{mark[:8]}"
    _wheel(folder, wheel, "1.0")
    _sdist(folder, version, mark, other.port)
    (tmp_path / "requirements.txt").write_text(f"{wheel.replace('_', '-')}==1.0\ngpuport-build-probe=={version}\n")
    with net_server.connect() as admin:
        token = admin.create_token(f"net-{mark[:8]}").token
    with net_server.connect(token) as gpu:
        job = gpu.submit(["python", "-c", _SHOW.format(wheel)], tmp_path, requirements="auto").wait(timeout=300)
        log = _log(gpu.job(job.id))
    assert job.info.state == "succeeded", log
    assert "1.0" in log.splitlines()
    result = next(line for line in log.splitlines() if line.startswith("RESULT "))
    assert "'direct': 'ConnectionRefusedError'" in result, result
    assert "'proxy': 'HTTP/1.1 403 Forbidden'" in result, result
    assert "'plant': 'WROTE'" in result and "'alter': 'ALTERED'" in result, result  # in a throw-away overlay
    assert other.accepted == 0
    assert f"--find-links {url}" in log  # the packages came over HTTP, through the build's proxy
    assert f"127.0.0.1:{other.port} refused: an environment build reaches only the package index" in log
    assert "building again, uv's cache read-only to it" in log
    assert _cache_holds(net_server.state_dir / "envs" / "cache", mark) == []


def test_a_build_from_source_cannot_change_the_cache_with_a_local_index(tmp_path: Path, other: _Listener) -> None:
    """With the index on this machine's disk (no network at all): the sdist's build script finds uv's
    cache unchangeable for good; the environment works, and a second user's build of the same
    requirements reuses it."""
    _absent()
    needs_users()
    state = tmp_path / "state"
    running = start_server(state, env=server_env(GPUPORT_FAKE_GPUS="1x16GiB", UV_INDEX_URL=INDEX))
    try:
        mark = uuid.uuid4().hex
        project = tmp_path / "project"
        _wheel(project / "wheels", "gpuport_local_whl", "2.0")
        _sdist(project / "wheels", "0.1", mark, other.port)
        (project / "requirements.txt").write_text(
            "--find-links ./wheels\ngpuport-local-whl==2.0\ngpuport-build-probe==0.1\ntabulate\n"
        )
        with running.connect() as admin:
            token = admin.create_token(f"cache-{mark[:8]}").token
        with running.connect(token) as gpu:
            code = _SHOW.format("gpuport-local-whl")
            job = gpu.submit(["python", "-c", code], project, requirements="auto").wait(timeout=300)
            log = _log(gpu.job(job.id))
        assert job.info.state == "succeeded", log
        result = next(line for line in log.splitlines() if line.startswith("RESULT "))
        assert "'direct': 'ConnectionRefusedError'" in result, result
        assert "'alter': 'ALTERED'" in result, result  # it found an entry to alter: the overlay's copy
        assert "2.0" in log.splitlines()
        assert _cache_holds(state / "envs" / "cache", mark) == []
        assert other.accepted == 0
    finally:
        running.stop()


def test_a_failed_build_from_source_says_uvs_words(net_server: RunningServer, tmp_path: Path) -> None:
    """An sdist whose setup.py fails: the job fails with uv's own error about that build."""
    project = tmp_path / "project"
    mark = uuid.uuid4().hex[:12]
    (project / "wheels" / "gpuport_broken-0.1").mkdir(parents=True)
    staged = project / "wheels" / "gpuport_broken-0.1"
    (staged / "setup.py").write_text(f"raise SystemExit('broken on purpose {mark}')\n")
    (staged / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: gpuport-broken\nVersion: 0.1\n")
    with tarfile.open(project / "wheels" / "gpuport_broken-0.1.tar.gz", "w:gz") as tar:
        tar.add(staged, arcname="gpuport_broken-0.1")
    for name in ("setup.py", "PKG-INFO"):
        (staged / name).unlink()
    staged.rmdir()
    (project / "requirements.txt").write_text("--find-links ./wheels\ngpuport-broken==0.1\n")
    with net_server.connect() as gpu:
        job = gpu.submit(["python", "-c", "print('ran')"], project, requirements="auto").wait(timeout=300)
        log = _log(gpu.job(job.id))
    assert job.info.state == "failed", log
    assert "ran" not in log.splitlines()
    assert "gpuport-broken" in (job.info.message or "") and "--no-build" not in (job.info.message or ""), job.info
    assert f"broken on purpose {mark}" in log


def test_the_index_proxy_lets_through_only_the_index(tmp_path: Path, other: _Listener) -> None:
    """The proxy itself: a plain GET to the index's host is carried, a CONNECT elsewhere is refused."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "page.html").write_text("the index")
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]
    long = tmp_path / ("a-state-dir-deep-down-" * 4) / "proxy.sock"  # longer than a socket's address may be
    long.parent.mkdir()
    try:
        with IndexProxy(long, frozenset({("127.0.0.1", port)}), {}) as proxy:

            def ask(request: bytes) -> bytes:
                with socket.socket(socket.AF_UNIX) as s:
                    s.settimeout(10)
                    with _reachable(str(proxy.path)) as address:  # through its folder: the path is too long
                        s.connect(address)
                    s.sendall(request)
                    data = b""
                    while chunk := s.recv(65536):
                        data += chunk
                    return data

            got = ask(f"GET http://127.0.0.1:{port}/page.html HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert got.startswith(b"HTTP/1.0 200") and got.endswith(b"the index"), got[:200]
            refused = ask(f"CONNECT 127.0.0.1:{other.port} HTTP/1.1\r\n\r\n".encode())
            assert refused.startswith(b"HTTP/1.1 403"), refused
            assert b"reaches only the package index" in refused
            plain = ask(f"GET http://127.0.0.1:{other.port}/ HTTP/1.1\r\n\r\n".encode())
            assert plain.startswith(b"HTTP/1.1 403")
            assert len(proxy.refused) == 2
        assert other.accepted == 0
        assert not long.exists()
    finally:
        httpd.shutdown()
        httpd.server_close()


class _UpstreamProxy:
    """The admin's own proxy, as far as a test needs one: it records each request's first line,
    answers a CONNECT with 200 and then echoes, and a plain request with a page of its own."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.seen: list[str] = []
        self.heads: list[bytes] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data and (chunk := conn.recv(4096)):
                data += chunk
            line = data.split(b"\r\n")[0].decode()
            self.seen.append(line)
            self.heads.append(data)
            if line.startswith("CONNECT"):
                conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                while chunk := conn.recv(4096):
                    conn.sendall(chunk)
            else:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\nConnection: close\r\n\r\nupstream")


def test_the_index_proxy_goes_through_the_admins_proxy(tmp_path: Path) -> None:
    """Where the admin set HTTPS_PROXY/HTTP_PROXY, the index is reached through it: a CONNECT to the
    index is tunnelled through it, a plain request goes to it in absolute form; other hosts are still
    refused without reaching it."""
    upstream = _UpstreamProxy()
    hosts = frozenset({("index.example", 443), ("plain.example", 80)})
    env = {"HTTPS_PROXY": f"http://user:pw@127.0.0.1:{upstream.port}", "HTTP_PROXY": f"127.0.0.1:{upstream.port}"}
    try:
        with IndexProxy(tmp_path / "proxy.sock", hosts, env) as proxy, socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(str(proxy.path))
            s.sendall(b"CONNECT index.example:443 HTTP/1.1\r\nHost: index.example:443\r\n\r\n")
            assert s.recv(100).startswith(b"HTTP/1.1 200")
            s.sendall(b"tls bytes")
            assert s.recv(100) == b"tls bytes"
            with socket.socket(socket.AF_UNIX) as plain:
                plain.settimeout(10)
                plain.connect(str(proxy.path))
                plain.sendall(b"GET http://plain.example/simple/ HTTP/1.1\r\nHost: plain.example\r\n\r\n")
                answer = b""
                while chunk := plain.recv(4096):
                    answer += chunk
            assert answer.endswith(b"upstream"), answer
            with socket.socket(socket.AF_UNIX) as other:
                other.settimeout(10)
                other.connect(str(proxy.path))
                other.sendall(b"CONNECT elsewhere.example:443 HTTP/1.1\r\n\r\n")
                assert other.recv(100).startswith(b"HTTP/1.1 403")
        assert upstream.seen == ["CONNECT index.example:443 HTTP/1.1", "GET http://plain.example/simple/ HTTP/1.1"]
        assert b"Proxy-Authorization: Basic dXNlcjpwdw==\r\n" in upstream.heads[0]  # user:pw of HTTPS_PROXY
    finally:
        upstream.sock.close()


def test_the_index_hosts_are_those_configured(tmp_path: Path) -> None:
    """The hosts a build may reach: the index's, its extra indexes', its find-links' (http and https,
    their ports), a uv.toml's; PyPI's only where nothing takes its place."""
    assert index_hosts((), {}) == frozenset(PYPI_HOSTS)
    args = ("--index-url", "https://pkgs.corp:8443/simple", "--extra-index-url", "http://mirror.corp/simple")
    args += ("--find-links", "/opt/wheels", "--find-links", "https://Wheels.Corp/links/")
    assert index_hosts(args, {}) == {("pkgs.corp", 8443), ("mirror.corp", 80), ("wheels.corp", 443)}
    config = tmp_path / "uv.toml"
    config.write_text('[[index]]\nurl = "https://extra.corp/simple"\n')
    assert index_hosts((), {"UV_CONFIG_FILE": str(config)}) == {("extra.corp", 443), *PYPI_HOSTS}
    config.write_text('[[index]]\nurl = "https://only.corp/simple"\ndefault = true\n')
    assert index_hosts((), {"UV_CONFIG_FILE": str(config)}) == {("only.corp", 443)}


def test_without_a_build_uid_a_build_from_source_gets_a_cache_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other: _Listener
) -> None:
    """A sandbox without a uid of its own (a server that is not root) has no overlay: a build from
    source gets an empty uv cache in its scratch, and the shared one is not even shown to it."""
    _absent()
    sandbox = detect(copies=tmp_path / "python")
    if not sandbox.isolated:
        pytest.skip(f"no sandbox here: {sandbox.why}")
    monkeypatch.setenv("UV_INDEX_URL", INDEX)
    tmp_path.chmod(0o755)
    mark = uuid.uuid4().hex
    project = tmp_path / "project"
    _sdist(project / "wheels", "0.1", mark, other.port)
    (project / "requirements.txt").write_text(f"--find-links {project / 'wheels'}\ngpuport-build-probe==0.1\n")
    store = Environments(tmp_path / "envs", sandbox)
    with open(tmp_path / "build.log", "wb") as log_file:
        built = store.ensure(EnvRequest(), project, [], log_file, None)
    log = (tmp_path / "build.log").read_text()
    assert built is not None, log
    module = next(built.path.glob("lib/python*/site-packages/gpuport_build_probe.py")).read_text()
    assert "'plant': 'WROTE'" in module and "'direct': 'ConnectionRefusedError'" in module, module
    assert _cache_holds(tmp_path / "envs" / "cache", mark) == []
    assert "building again, uv's cache read-only to it" in log
