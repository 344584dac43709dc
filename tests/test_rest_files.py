"""REST without the CLI, as an ML platform posts it: a project uploaded as one archive body, a script
run with hyperparameters argparse reads, and the job's outputs listed and downloaded (one file, or
all of them as one .tar.gz), through curl-like HTTP calls and nothing else."""

from __future__ import annotations

import gzip
import io
import re
import ssl
import tarfile
import threading
import time
import urllib.parse
import zipfile
from typing import Any

import httpx
import psutil
import pytest

from gpuport.defaults import MAX_ARCHIVE_MEMBERS, MAX_ARCHIVE_UNPACKED_FLOOR
from tests.conftest import RunningServer, rest_job_ended

TRAIN = """\
import argparse, json, os
parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int)
parser.add_argument("--augment", action="store_true")
parser.add_argument("--no-shuffle", action="store_true")
parser.add_argument("--layers", type=int, nargs="+")
parser.add_argument("--name")
args = parser.parse_args()
os.makedirs("out/weights", exist_ok=True)
with open("out/result.json", "w") as f:
    json.dump(vars(args), f)
with open("out/weights/w.bin", "wb") as f:
    f.write(bytes(range(256)) * 4096)
print("trained", open("data/notes.txt").read().strip())
"""


def _tar(files: dict[str, bytes], gz: bool = True, extra: list[tarfile.TarInfo] | None = None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz" if gz else "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
        for info in extra or []:
            tar.addfile(info)
    return buffer.getvalue()


def _zip(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def _upload(server: RunningServer, token: str, body: bytes, content_type: str, name: str = "") -> Any:
    path = "/v1/snapshots" + (f"?name={name}" if name else "")
    return server.rest("POST", path, token, content=body, headers={"content-type": content_type})


def _upload_slowly(server: RunningServer, token: str, body: bytes, content_type: str, name: str = "") -> Any:
    """``_upload``, waiting as long as a hostile archive takes to be read and refused on a busy box."""
    trust = ssl.create_default_context(cafile=str(server.state_dir / "tls" / "cert.pem"))
    with httpx.Client(verify=trust, timeout=300) as http:
        return http.post(
            f"{server.http_url}/v1/snapshots" + (f"?name={name}" if name else ""),
            content=body,
            headers={"authorization": f"Bearer {token}", "content-type": content_type},
        )


@pytest.mark.parametrize("kind", ["tar.gz", "zip"])
def test_upload_run_and_download_with_nothing_but_http(server: RunningServer, user_token: str, kind: str) -> None:
    files = {"train.py": TRAIN.encode(), "data/notes.txt": b"from an archive\n"}
    body, content_type = (_tar(files), "application/gzip") if kind == "tar.gz" else (_zip(files), "application/zip")
    uploaded = _upload(server, user_token, body, content_type, name=f"rest-{kind.replace('.', '-')}")
    assert uploaded.status_code == 201, uploaded.text
    assert uploaded.json()["files"] == 2 and len(uploaded.json()["snapshot_id"]) == 64

    job = {
        "script": "train.py",
        "project": f"rest-{kind.replace('.', '-')}",
        "hyperparameters": {"epochs": 2, "augment": True, "no-shuffle": False, "layers": [64, 32], "name": "a b"},
        "outputs": ["out/"],
    }
    created = server.rest("POST", "/v1/jobs", user_token, json=job)
    assert created.status_code == 201, created.text
    info = rest_job_ended(server, user_token, created.json()["job_id"])
    logs = server.rest("GET", f"/v1/jobs/{info['job_id']}/logs", user_token).json()["data"]
    assert info["state"] == "succeeded", logs
    assert "trained from an archive" in logs
    assert info["command"] == [
        "python", "train.py", "--epochs", "2", "--augment", "--layers", "64", "32", "--name", "a b",
    ]  # fmt: skip

    listed = server.rest("GET", f"/v1/jobs/{info['job_id']}/outputs", user_token)
    assert listed.status_code == 200
    by_path = {e["path"]: e for e in listed.json()}
    assert set(by_path) == {"out/result.json", "out/weights/w.bin"}
    assert by_path["out/weights/w.bin"]["size"] == 256 * 4096

    result = server.rest("GET", f"/v1/jobs/{info['job_id']}/outputs/out/result.json", user_token)
    assert result.status_code == 200
    assert result.json() == {"epochs": 2, "augment": True, "no_shuffle": False, "layers": [64, 32], "name": "a b"}
    weights = server.rest("GET", f"/v1/jobs/{info['job_id']}/outputs/out/weights/w.bin", user_token)
    assert weights.content == bytes(range(256)) * 4096

    whole = server.rest("GET", f"/v1/jobs/{info['job_id']}/outputs.tar.gz", user_token)
    assert whole.status_code == 200 and whole.headers["content-type"] == "application/gzip"
    with tarfile.open(fileobj=io.BytesIO(whole.content), mode="r:gz") as tar:
        assert sorted(tar.getnames()) == ["out/result.json", "out/weights/w.bin"]
        extracted = tar.extractfile("out/weights/w.bin")
        assert extracted is not None and extracted.read() == bytes(range(256)) * 4096

    missing = server.rest("GET", f"/v1/jobs/{info['job_id']}/outputs/out/nope", user_token)
    assert missing.status_code == 404 and "no output 'out/nope'" in missing.json()["error"]["message"]
    escaping = server.rest("GET", f"/v1/jobs/{info['job_id']}/outputs/out/%2E%2E/%2E%2E/etc", user_token)
    assert escaping.status_code in (400, 404)


def _link(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info


def _hard(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.LNKTYPE, target
    return info


@pytest.mark.parametrize(
    ("body", "content_type", "problem"),
    [
        (_tar({"../evil.py": b"x"}), "application/gzip", "contains '..'"),
        (_tar({"/etc/evil": b"x"}), "application/gzip", "is absolute"),
        (_tar({"ok.py": b"x"}, extra=[_link("out", "../../etc/passwd")]), "application/gzip", "outside the workdir"),
        (_tar({"ok.py": b"x"}, extra=[_hard("h", "ok.py")]), "application/gzip", "is a hard link"),
        (_zip({"../up.py": b"x"}), "application/zip", "contains '..'"),
        (b"not an archive at all", "application/gzip", "not a readable tar archive"),
        (b"PK not a zip", "application/zip", "not a readable zip archive"),
        (_tar({"a.py": b"x"}), "text/plain", "post the archive as application/x-tar"),
    ],
    ids=["dotdot", "absolute", "link-out", "hard-link", "zip-dotdot", "garbage-tar", "garbage-zip", "content-type"],
)
def test_bad_archives_are_refused_saying_why_and_change_nothing(
    server: RunningServer, user_token: str, body: bytes, content_type: str, problem: str
) -> None:
    before = server.rest("GET", "/v1/snapshots", user_token).json()
    refused = _upload(server, user_token, body, content_type, name="bad-archive")
    assert refused.status_code == 400 and problem in refused.json()["error"]["message"], refused.text
    assert server.rest("GET", "/v1/snapshots", user_token).json() == before


def test_an_archive_needs_a_token_and_a_script_must_be_in_the_project(server: RunningServer, user_token: str) -> None:
    assert _upload(server, "", _tar({"a.py": b""}), "application/gzip").status_code == 401
    assert (
        _upload(server, user_token, _tar({"a.py": b"", "lib/b.py": b""}), "application/x-tar", "has-a").status_code
        == 201
    )
    job = {"script": "train.py", "project": "has-a"}
    refused = server.rest("POST", "/v1/jobs", user_token, json=job)
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]
    assert "script 'train.py' is not in project 'has-a'" in message and "a.py" in message
    no_project = server.rest("POST", "/v1/jobs", user_token, json={"script": "a.py"})
    assert no_project.status_code == 400 and "has no project" in no_project.json()["error"]["message"]


# Output names a download's Content-Disposition must carry whole without breaking the header (a name
# with a line break has no route of its own: it comes in outputs.tar.gz).
ODD_NAMES = ['say "hi".txt', "a;b=c.txt", "résumé ü €.txt", "with space.txt", "back\\slash 100%.txt", "tab\there.txt"]


def test_an_odd_output_name_is_a_safe_content_disposition_with_the_name_whole(
    server: RunningServer, user_token: str
) -> None:
    script = f"import os\nos.makedirs('out')\nfor i, name in enumerate({ODD_NAMES!r}):\n"
    script += "    open('out/' + name, 'w').write(str(i))\n"
    assert _upload(server, user_token, _tar({"odd.py": script.encode()}), "application/gzip", "odd").status_code == 201
    created = server.rest(
        "POST", "/v1/jobs", user_token, json={"script": "odd.py", "project": "odd", "outputs": ["out/"]}
    )
    info = rest_job_ended(server, user_token, created.json()["job_id"])
    assert info["state"] == "succeeded", info
    for i, name in enumerate(ODD_NAMES):
        got = server.rest("GET", f"/v1/jobs/{info['job_id']}/outputs/out/{urllib.parse.quote(name)}", user_token)
        assert got.status_code == 200 and got.text == str(i), got.text
        # Two parameters, in RFC 6266's order: an ASCII stand-in that nothing in it ends early (no
        # quote, backslash or line break) or that a client would decode (%), then the name whole.
        disposition = got.headers["content-disposition"]
        parsed = re.fullmatch(r'attachment; filename="([ -~]*)"; filename\*=UTF-8\'\'([A-Za-z0-9%._~-]+)', disposition)
        assert parsed is not None, disposition
        fallback, encoded = parsed.groups()
        assert not set(fallback) & set('"\\%') and len(fallback) == len(name), disposition
        assert urllib.parse.unquote(encoded, errors="strict") == name
    whole = server.rest("GET", f"/v1/jobs/{info['job_id']}/outputs.tar.gz", user_token)
    assert whole.headers["content-disposition"] == (
        f"attachment; filename=\"{info['job_id']}-outputs.tar.gz\"; filename*=UTF-8''{info['job_id']}-outputs.tar.gz"
    )


def folders_bomb(count: int) -> bytes:
    """A .tar.gz of ``count`` folder headers and nothing else, small and quick to make: a block of
    1,000 distinct ones gzipped once and repeated (a gzip stream may be many members), then the end."""
    block = b""
    for i in range(1000):
        info = tarfile.TarInfo(f"d{i:06d}")
        info.type = tarfile.DIRTYPE
        block += info.tobuf(format=tarfile.USTAR_FORMAT)
    return gzip.compress(block, mtime=0) * (count // 1000) + gzip.compress(b"\0" * 1024, mtime=0)


def zeros_bomb(gigabytes: int) -> bytes:
    """A .tar.gz of about a megabyte per GiB holding one file of ``gigabytes`` GiB of zeros: a 64 MiB
    block gzipped once and repeated."""
    info = tarfile.TarInfo("zeros.bin")
    info.size = gigabytes << 30
    block = gzip.compress(bytes(64 << 20), mtime=0)
    return gzip.compress(info.tobuf(format=tarfile.USTAR_FORMAT), mtime=0) + block * (gigabytes * 16)


def test_a_tar_of_folder_headers_is_refused_at_the_member_limit_in_bounded_memory_while_others_run(
    server: RunningServer, user_token: str
) -> None:
    bomb = folders_bomb(MAX_ARCHIVE_MEMBERS + 50_000)
    assert len(bomb) < 4 * 1024 * 1024
    process = psutil.Process(server.pid or server.process.pid)
    before = process.memory_info().rss
    peak, answers = before, []
    uploads = [
        threading.Thread(target=lambda: answers.append(_upload_slowly(server, user_token, bomb, "application/gzip")))
        for _ in range(3)  # more than the archive threads: one waits its turn
    ]
    for upload in uploads:
        upload.start()
    started = time.monotonic()
    created = server.rest("POST", "/v1/jobs", server.admin_token, json={"command": ["true"]})
    assert created.status_code == 201, created.text
    job = rest_job_ended(server, server.admin_token, created.json()["job_id"], timeout=60)
    latency = time.monotonic() - started
    while any(upload.is_alive() for upload in uploads):
        peak = max(peak, process.memory_info().rss)
        time.sleep(0.05)
    assert job["state"] == "succeeded", job
    assert latency < 20, f"another user's `true` took {latency:.1f} s beside archive bombs"
    assert len(answers) == 3
    for refused in answers:
        assert refused.status_code == 400, refused.text
        message = refused.json()["error"]["message"]
        assert f"more than {MAX_ARCHIVE_MEMBERS} entries" in message and "gpuport push" in message, message
    assert peak - before < 128 * 1024 * 1024, f"the server grew by {(peak - before) >> 20} MiB"


def test_a_gzip_bomb_is_refused_at_its_expansion_limit_and_a_plain_tar_of_the_same_passes(
    server: RunningServer, user_token: str
) -> None:
    before = server.rest("GET", "/v1/snapshots", user_token).json()
    bomb = zeros_bomb(1)
    assert len(bomb) < 2 * 1024 * 1024
    refused = _upload_slowly(server, user_token, bomb, "application/gzip", name="bomb")
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert "unpacks to more than 256MiB, its limit" in message and "100x its size" in message, message
    assert "uncompressed (application/x-tar)" in message, message
    assert server.rest("GET", "/v1/snapshots", user_token).json() == before

    # The same kind of content, uncompressed, is as large as it unpacks: taken.
    plain = _tar({"zeros.bin": bytes(MAX_ARCHIVE_UNPACKED_FLOOR // 64)}, gz=False)
    taken = _upload_slowly(server, user_token, plain, "application/x-tar", name="plain-zeros")
    assert taken.status_code == 201 and taken.json()["files"] == 1, taken.text


def test_a_zip_with_too_many_entries_is_refused_before_it_is_opened(server: RunningServer, user_token: str) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for i in range(MAX_ARCHIVE_MEMBERS + 1):
            archive.writestr(zipfile.ZipInfo(f"d{i}/"), b"")
    refused = _upload_slowly(server, user_token, buffer.getvalue(), "application/zip")
    assert refused.status_code == 400, refused.text
    assert f"more than {MAX_ARCHIVE_MEMBERS} entries" in refused.json()["error"]["message"]
