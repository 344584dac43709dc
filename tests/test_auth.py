"""Tokens and permissions, through the Python API, the CLI and the REST API."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
import uuid
from pathlib import Path

import pytest

import gpuport

from .conftest import RunningServer, needs_users, start_server


def test_admin_creates_lists_and_revokes_tokens(admin: gpuport.Client, server: RunningServer) -> None:
    needs_users()
    new = admin.create_token("dana")
    assert new.token.startswith("gp_") and len(new.token) >= 43 and not new.admin
    assert "token=" not in repr(new)
    names = [t.name for t in admin.tokens()]
    assert "dana" in names and "admin" in names
    with gpuport.connect(server.url, new.token, fingerprint=server.fingerprint) as dana:
        assert dana.user == "dana" and not dana.admin
        dana.ping()
        revoked = admin.revoke_token("dana")
        assert revoked.revoked_at is not None
        # Revocation takes effect at once, on a connection that is already open.
        with pytest.raises(gpuport.AuthenticationError, match="'dana' was revoked"):
            dana.ping()
    assert "dana" not in [t.name for t in admin.tokens()]
    assert "dana" in [t.name for t in admin.tokens(include_revoked=True)]
    # The name is free again once revoked.
    assert admin.create_token("dana").name == "dana"


def test_bad_token_requests_change_nothing(admin: gpuport.Client) -> None:
    needs_users()
    before = admin.tokens(include_revoked=True)
    with pytest.raises(gpuport.InvalidRequest, match="invalid token name"):
        admin.create_token("no spaces please")
    with pytest.raises(gpuport.InvalidRequest, match="invalid token name"):
        admin.create_token("mallory\n")  # a name that would end a line of a log or a listing
    with pytest.raises(gpuport.InvalidRequest):
        admin.create_token("")
    admin.create_token("erin")
    with pytest.raises(gpuport.Conflict, match="already exists"):
        admin.create_token("erin")
    with pytest.raises(gpuport.NotFound, match="no valid token named 'nobody'"):
        admin.revoke_token("nobody")
    after = admin.tokens(include_revoked=True)
    assert [t.name for t in after] == [t.name for t in before] + ["erin"]


def test_the_last_admin_token_cannot_be_revoked(admin: gpuport.Client, server: RunningServer) -> None:
    needs_users()
    with pytest.raises(gpuport.Conflict, match="last admin token"):
        admin.revoke_token("admin")
    second = admin.create_token("admin2", admin=True)
    with gpuport.connect(server.url, second.token, fingerprint=server.fingerprint) as admin2:
        assert admin2.admin
        admin2.create_token("made-by-admin2")
        admin.revoke_token("admin2")
    with pytest.raises(gpuport.Conflict, match="last admin token"):
        admin.revoke_token("admin")


@pytest.mark.parametrize("token", ["gp_unknown", "not-even-prefixed", "Bearer gp_"])
def test_wrong_tokens_are_rejected_at_connect(server: RunningServer, token: str) -> None:
    with pytest.raises(gpuport.AuthenticationError, match="gpuport login") as caught:
        gpuport.connect(server.url, token, fingerprint=server.fingerprint)
    assert server.url in str(caught.value)


def test_a_missing_token_is_said_before_connecting(server: RunningServer) -> None:
    with pytest.raises(gpuport.AuthenticationError, match="no token for"):
        gpuport.connect(server.url, fingerprint=server.fingerprint)


def test_non_admin_may_not_manage_tokens(server: RunningServer, user_token: str) -> None:
    with gpuport.connect(server.url, user_token, fingerprint=server.fingerprint) as user:
        for call in (lambda: user.create_token("x"), user.tokens, lambda: user.revoke_token("admin")):
            with pytest.raises(gpuport.PermissionDenied, match="needs an admin token"):
                call()


def test_cli_token_commands(server: RunningServer, cli, user_token: str) -> None:
    env = {"GPUPORT_URL": server.url, "GPUPORT_FINGERPRINT": server.fingerprint}
    created = cli("token", "create", "frank", GPUPORT_TOKEN=server.admin_token, **env)
    assert created.code == 0, created.output
    frank = created.stdout.strip()
    assert frank.startswith("gp_") and "shown only now" in created.stderr
    listed = cli("token", "list", "--json", GPUPORT_TOKEN=server.admin_token, **env)
    assert "frank" in [t["name"] for t in json.loads(listed.stdout)]
    assert frank not in listed.stdout
    denied = cli("token", "list", GPUPORT_TOKEN=user_token, **env)
    assert denied.code == 1 and "needs an admin token" in denied.stderr
    assert cli("token", "revoke", "frank", GPUPORT_TOKEN=server.admin_token, **env).code == 0
    revoked = cli("gpus", GPUPORT_TOKEN=frank, **env)
    assert revoked.code == 1 and "'frank' was revoked" in revoked.stderr and "gpuport login" in revoked.stderr
    wrong = cli("gpus", GPUPORT_TOKEN="gp_wrong", **env)
    assert wrong.code == 1 and "not known to this server" in wrong.stderr
    for bad in (("token", "create", "bad name"), ("token", "revoke", "nobody"), ("token", "revoke", "admin")):
        done = cli(*bad, GPUPORT_TOKEN=server.admin_token, **env)
        assert done.code == 1 and done.stderr.startswith("error:") and "Traceback" not in done.stderr


def test_rest_api_uses_the_same_tokens(server: RunningServer, user_token: str) -> None:
    assert server.rest("GET", "/v1/health").json()["status"] == "ok"
    missing = server.rest("GET", "/v1/status")
    assert missing.status_code == 401 and missing.json()["error"]["message"] == "no token was sent"
    wrong = server.rest("GET", "/v1/status", "gp_wrong")
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "AuthenticationError"
    assert server.rest("GET", "/v1/whoami", user_token).json()["admin"] is False
    assert server.rest("GET", "/v1/tokens", user_token).status_code == 403
    assert server.rest("POST", "/v1/tokens", user_token, json={"name": "gina"}).status_code == 403

    created = server.rest("POST", "/v1/tokens", server.admin_token, json={"name": "gina"})
    assert created.status_code == 201 and created.json()["token"].startswith("gp_")
    assert server.rest("GET", "/v1/whoami", created.json()["token"]).json() == {"user": "gina", "admin": False}
    malformed = server.rest("POST", "/v1/tokens", server.admin_token, json={"nam": "x"})
    assert malformed.status_code == 400 and "body.name" in malformed.json()["error"]["message"]
    assert server.rest("POST", "/v1/tokens", server.admin_token, json={"name": "gina"}).status_code == 409
    assert server.rest("DELETE", "/v1/tokens/nobody", server.admin_token).status_code == 404
    assert server.rest("DELETE", "/v1/tokens/gina", server.admin_token).status_code == 200
    assert server.rest("GET", "/v1/whoami", created.json()["token"]).status_code == 401


def test_rejected_tokens_are_logged_for_the_admin(server: RunningServer) -> None:
    with pytest.raises(gpuport.AuthenticationError):
        gpuport.connect(server.url, "gp_intruder", fingerprint=server.fingerprint)
    assert server.rest("GET", "/v1/status", "gp_intruder").status_code == 401
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        log = server.banner
        if "rejected a call to Hello" in log and "rejected GET /v1/status" in log:
            break
        time.sleep(0.05)
    assert "rejected a call to Hello from ipv4:127.0.0.1" in server.banner
    assert "rejected GET /v1/status from 127.0.0.1" in server.banner
    assert "gp_intruder" not in server.banner  # the log never repeats a token


def test_cli_says_when_no_token_was_given(server: RunningServer, cli) -> None:
    done = cli("gpus", GPUPORT_URL=server.url, GPUPORT_FINGERPRINT=server.fingerprint)
    assert done.code == 1
    assert f"no token for {server.url}" in done.stderr and "--token" in done.stderr


def test_names_are_unique_regardless_of_case(admin: gpuport.Client, server: RunningServer) -> None:
    name = f"bob-{uuid.uuid4().hex[:8]}"
    admin.create_token(name, admin=True)  # admin: the rule is the same, and needs no sandbox
    for other in (name.upper(), name.capitalize()):
        with pytest.raises(gpuport.Conflict, match=f"'{other}' is taken by the user '{name}'.* regardless of case"):
            admin.create_token(other, admin=True)
    refused = server.rest("POST", "/v1/tokens", server.admin_token, json={"name": name.upper(), "admin": True})
    assert refused.status_code == 409 and "regardless of case" in refused.json()["error"]["message"]
    with pytest.raises(gpuport.NotFound, match=f"no valid token named '{name.upper()}' — did you mean '{name}'"):
        admin.revoke_token(name.upper())
    # A revoked user's name stays theirs: a new token for them is spelled as before, and only so.
    admin.revoke_token(name)
    with pytest.raises(gpuport.Conflict, match=f"create '{name}' to give that user a new token"):
        admin.create_token(name.capitalize(), admin=True)
    assert admin.create_token(name, admin=True).name == name
    admin.revoke_token(name)
    assert [t.name for t in admin.tokens(include_revoked=True) if t.name.lower() == name] == [name, name]


def test_a_state_dir_with_names_that_differ_by_case_keeps_working(tmp_path: Path) -> None:
    """Made before names were unique regardless of case: both users go on as they were."""
    state = tmp_path / "state"
    first = start_server(state)
    first.stop()
    tokens = {"carol": "gp_" + "c" * 43, "Carol": "gp_" + "C" * 43}
    with sqlite3.connect(state / "gpuport.db") as db:
        for name, token in tokens.items():
            db.execute(
                "INSERT INTO tokens (name, hash, admin, created_at) VALUES (?, ?, 1, ?)",
                (name, hashlib.sha256(token.encode()).hexdigest(), time.time()),
            )
    second = start_server(state)
    second.admin_token = first.admin_token
    try:
        for name, token in tokens.items():
            with second.connect(token) as client:
                assert client.user == name
        with second.connect() as admin:
            assert {"carol", "Carol"} <= {t.name for t in admin.tokens()}
            admin.revoke_token("Carol")  # exactly that one
            with second.connect(tokens["carol"]) as carol:
                carol.ping()
            assert admin.create_token("Carol", admin=True).name == "Carol"  # a new token for that same user
    finally:
        second.stop()
