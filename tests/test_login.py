"""`gpuport login`: trust on first use, pinning, profiles, env overrides, a changed certificate."""

from __future__ import annotations

import json
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import gpuport

from .conftest import RunningServer, restartable_ports, start_server


def test_login_with_yes_pins_and_saves_a_private_profile(server: RunningServer, cli, client_config: Path) -> None:
    done = cli("login", server.url, "--token", server.admin_token, "--yes")
    assert done.code == 0, done.output
    assert "as admin (admin)" in done.stdout and server.fingerprint in done.stdout
    path = client_config / "config.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    saved = json.loads(path.read_text())["profiles"]["default"]
    assert saved["url"] == server.url and saved["fingerprint"] == server.fingerprint
    assert "BEGIN CERTIFICATE" in saved["certificate"]
    # Later commands use the profile with no flags at all.
    assert cli("gpus").code == 0
    with gpuport.connect() as client:
        assert client.user == "admin" and client.profile == "default"


def test_login_with_the_right_fingerprint_needs_no_question(server: RunningServer, cli) -> None:
    done = cli("login", server.url, "--token", server.admin_token, "--fingerprint", server.fingerprint.upper())
    assert done.code == 0, done.output


def test_login_asks_and_a_yes_on_stdin_trusts(server: RunningServer, cli) -> None:
    done = cli("login", server.url, "--token", server.admin_token, input="y\n")
    assert done.code == 0, done.output
    assert server.fingerprint in done.stderr and "Trust this certificate?" in done.stderr


def test_login_without_an_answer_saves_nothing(server: RunningServer, cli, client_config: Path) -> None:
    done = cli("login", server.url, "--token", server.admin_token)
    assert done.code == 1
    assert "was not trusted, so nothing was saved" in done.stderr and "--fingerprint" in done.stderr
    assert not (client_config / "config.json").exists()


def test_login_with_a_wrong_fingerprint_saves_nothing(server: RunningServer, cli, client_config: Path) -> None:
    wrong = "sha256:" + "ab" * 32
    done = cli("login", server.url, "--token", server.admin_token, "--fingerprint", wrong)
    assert done.code == 1
    assert wrong in done.stderr and server.fingerprint in done.stderr
    assert not (client_config / "config.json").exists()


def test_login_with_a_bad_token_saves_nothing(server: RunningServer, cli, client_config: Path) -> None:
    done = cli("login", server.url, "--token", "gp_not-a-real-token", "--yes")
    assert done.code == 1 and "token rejected" in done.stderr
    assert not (client_config / "config.json").exists()


def test_login_from_python(server: RunningServer) -> None:
    with gpuport.login(server.url, server.admin_token, fingerprint=server.fingerprint, profile="box") as client:
        assert client.admin
    with gpuport.connect(profile="box") as client:
        assert client.url == server.url


def test_profiles_are_chosen_by_flag_and_env(server: RunningServer, cli, user_token: str) -> None:
    assert cli("login", server.url, "--token", server.admin_token, "--yes").code == 0
    assert cli("--profile", "alt", "login", server.url, "--token", user_token, "--yes").code == 0
    listed = json.loads(cli("profiles", "--json").stdout)
    assert [p["name"] for p in listed] == ["alt", "default"]
    as_default = json.loads(cli("status", "--json").stdout)
    as_alt = json.loads(cli("status", "--json", GPUPORT_PROFILE="alt").stdout)
    assert as_default["admin"] is True and as_alt["admin"] is False
    assert json.loads(cli("--profile", "alt", "status", "--json").stdout)["admin"] is False
    missing = cli("--profile", "nope", "gpus")
    assert missing.code == 1 and "no profile named 'nope'" in missing.stderr and "alt, default" in missing.stderr
    assert cli("logout", "--profile", "alt").code == 0
    assert [p["name"] for p in json.loads(cli("profiles", "--json").stdout)] == ["default"]


def test_environment_overrides_without_any_profile(server: RunningServer, cli, user_token: str) -> None:
    env = {"GPUPORT_URL": server.url, "GPUPORT_TOKEN": user_token, "GPUPORT_FINGERPRINT": server.fingerprint}
    done = cli("status", "--json", **env)
    assert done.code == 0, done.output
    assert json.loads(done.stdout)["admin"] is False
    # The token from the environment beats the profile's.
    assert cli("login", server.url, "--token", server.admin_token, "--yes").code == 0
    assert json.loads(cli("status", "--json", GPUPORT_TOKEN=user_token).stdout)["admin"] is False
    # The same server written another way still matches the profile, and uses its token and pin.
    assert json.loads(cli("status", "--json", GPUPORT_URL=server.url.upper() + "/").stdout)["admin"] is True


def test_a_corrupted_config_is_reported_and_left_alone(server: RunningServer, cli, client_config: Path) -> None:
    client_config.mkdir()
    path = client_config / "config.json"
    path.write_text('{"profiles": {"default": {"url": ')
    for args in (("gpus",), ("login", server.url, "--token", server.admin_token, "--yes")):
        done = cli(*args)
        assert done.code == 1
        assert f"the gpuport config {path} is corrupted" in done.stderr and "delete it" in done.stderr
    assert path.read_text() == '{"profiles": {"default": {"url": '
    with pytest.raises(gpuport.ConfigError, match="corrupted"):
        gpuport.connect()


def test_nothing_configured_says_how_to_log_in(cli) -> None:
    done = cli("gpus")
    assert done.code == 1 and "run `gpuport login https://HOST:7600 --token gp_...`" in done.stderr
    with pytest.raises(gpuport.ConfigError, match="GPUPORT_URL"):
        gpuport.connect()


@contextmanager
def _certificate_replaced_after_login(tmp_path: Path, cli) -> Iterator[tuple[RunningServer, RunningServer]]:
    """Log in to a server, then restart it on the same port with a new certificate, as an admin
    who deleted tls/ would. Yields (before, after); the second one is stopped afterwards."""
    port = restartable_ports(4)
    first = start_server(tmp_path / "state", "--port", str(port))
    try:
        assert cli("login", first.url, "--token", first.admin_token, "--yes").code == 0
    finally:
        first.stop()
    shutil.rmtree(tmp_path / "state" / "tls")
    second = start_server(tmp_path / "state", "--port", str(port))
    try:
        assert second.url == first.url and second.fingerprint != first.fingerprint
        yield first, second
    finally:
        second.stop()


def test_a_changed_certificate_is_refused_everywhere_with_both_fingerprints(tmp_path: Path, cli) -> None:
    with _certificate_replaced_after_login(tmp_path, cli) as (first, second):
        for args in (("gpus",), ("status",), ("token", "list")):
            done = cli(*args)
            assert done.code == 1
            assert first.fingerprint in done.stderr and second.fingerprint in done.stderr
            assert f"gpuport login {first.url} --fingerprint {second.fingerprint}" in done.stderr
        with pytest.raises(gpuport.FingerprintMismatch) as caught:
            gpuport.connect()
        assert (caught.value.pinned, caught.value.presented) == (first.fingerprint, second.fingerprint)
        # Re-pinning without saying so is refused too; with the new fingerprint it works.
        assert cli("login", first.url, "--token", first.admin_token).code == 1
        done = cli("login", first.url, "--token", first.admin_token, "--fingerprint", second.fingerprint)
        assert done.code == 0, done.output
        assert cli("gpus").code == 0


def test_a_changed_certificate_warns_loudly_when_asked(tmp_path: Path, cli) -> None:
    with _certificate_replaced_after_login(tmp_path, cli) as (first, second):
        done = cli("login", first.url, "--token", first.admin_token, input="n\n")
        assert done.code == 1
        assert "has CHANGED" in done.stderr and first.fingerprint in done.stderr and second.fingerprint in done.stderr
