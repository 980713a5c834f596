"""The Temporal connection as the SDK and the `temporal` CLI configure it (temporalio.envconfig):
the standard variable names and `temporal.toml` profiles; the project's older names still work."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.config import Settings

TEMPORAL_VARS = (
    "TEMPORAL_ADDRESS",
    "TEMPORAL_NAMESPACE",
    "TEMPORAL_API_KEY",
    "TEMPORAL_TLS",
    "TEMPORAL_TLS_CERT",
    "TEMPORAL_TLS_KEY",
    "TEMPORAL_TLS_CA",
    "TEMPORAL_TLS_CLIENT_CERT_PATH",
    "TEMPORAL_TLS_CLIENT_KEY_PATH",
    "TEMPORAL_TLS_SERVER_CA_CERT_PATH",
    "TEMPORAL_TLS_SERVER_NAME",
    "TEMPORAL_PROFILE",
    "TEMPORAL_CONFIG_FILE",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in TEMPORAL_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLEANUP_STATE_DIR", str(tmp_path / "state"))  # no dev env file
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", str(tmp_path / "absent.toml"))


def test_the_sdk_standard_tls_variables_are_read(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TEMPORAL_TLS_CLIENT_CERT_PATH", str(tmp_path / "client.pem"))
    monkeypatch.setenv("TEMPORAL_TLS_CLIENT_KEY_PATH", str(tmp_path / "client.key"))
    monkeypatch.setenv("TEMPORAL_TLS_SERVER_CA_CERT_PATH", str(tmp_path / "ca.pem"))
    monkeypatch.setenv("TEMPORAL_TLS_SERVER_NAME", "temporal.internal")
    settings = Settings.from_env()
    assert settings.temporal_tls_cert == tmp_path / "client.pem"
    assert settings.temporal_tls_key == tmp_path / "client.key"
    assert settings.temporal_tls_ca == tmp_path / "ca.pem"
    assert settings.temporal_tls_server_name == "temporal.internal"


def test_a_temporal_toml_profile_is_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = tmp_path / "temporal.toml"
    config.write_text(
        '[profile.prod]\naddress = "temporal.prod.internal:7233"\nnamespace = "games"\napi_key = "k-123"\n'
        '[profile.prod.tls]\nserver_name = "temporal.prod.internal"\n'
    )
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", str(config))
    monkeypatch.setenv("TEMPORAL_PROFILE", "prod")
    settings = Settings.from_env()
    assert (settings.temporal_address, settings.temporal_namespace) == ("temporal.prod.internal:7233", "games")
    assert settings.temporal_api_key is not None and settings.temporal_api_key.get_secret_value() == "k-123"
    assert settings.temporal_tls_server_name == "temporal.prod.internal"
    monkeypatch.setenv("TEMPORAL_NAMESPACE", "staging")
    assert Settings.from_env().temporal_namespace == "staging", "a variable overrides the profile"


def test_the_older_names_still_work_with_a_deprecation_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TEMPORAL_TLS_CERT", str(tmp_path / "old.pem"))
    monkeypatch.setenv("TEMPORAL_TLS_KEY", str(tmp_path / "old.key"))
    with caplog.at_level("WARNING"):
        settings = Settings.from_env()
    assert settings.temporal_tls_cert == tmp_path / "old.pem"
    assert any("TEMPORAL_TLS_CLIENT_CERT_PATH" in r.getMessage() for r in caplog.records)
