"""TLS, mTLS and basic auth from an exporter-toolkit web-config file, over real handshakes with the daemon."""

from __future__ import annotations

import ssl
import subprocess
import sys
import time

import bcrypt
import httpx
import pytest
import trustme

from gpuwarden.config.settings import ConfigError
from gpuwarden.config.web import load_web_config
from tests.helpers.common import free_port, write_yaml
from tests.helpers.daemon import Daemon, running_cli, start_daemon


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("prometheus.monitoring")
    files = {"ca": tmp / "ca.pem", "cert": tmp / "server.pem", "key": tmp / "server.key", "client": tmp / "client.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    server.cert_chain_pems[0].write_to_path(str(files["cert"]))
    server.private_key_pem.write_to_path(str(files["key"]))
    client.private_key_and_cert_chain_pem.write_to_path(str(files["client"]))
    return files


def start(tmp_path, web: dict, **options) -> Daemon:
    """The simulated exporter serving HTTPS under `web`, once `ready` answers (start_daemon's options)."""
    config = write_yaml(tmp_path / "web.yml", web)
    return start_daemon("--sim", "--nvml.scenario", "healthy", "--web.config.file", str(config), tls=True, **options)


def wait(url: str, **kwargs) -> httpx.Response:
    deadline = time.monotonic() + 20
    while True:
        try:
            return httpx.get(url, timeout=2, **kwargs)
        except httpx.HTTPError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_tls_with_basic_auth(tmp_path, pki):
    hashed = bcrypt.hashpw(b"s3cret-pass", bcrypt.gensalt(rounds=4)).decode().replace("$2b$", "$2y$")
    ca = ssl.create_default_context(cafile=str(pki["ca"]))
    exporter = start(
        tmp_path,
        {
            "tls_server_config": {"cert_file": str(pki["cert"]), "key_file": str(pki["key"])},
            "basic_auth_users": {"prometheus": hashed},
        },
        ready="/readyz",  # probes need no credentials
        verify=ca,
    )
    base = exporter.url
    try:
        assert httpx.get(base + "/healthz", verify=ca).status_code == 200
        for path in ("/metrics", "/api/v1/gpus", "/api/v1/diagnosis", "/", "/docs", "/openapi.json"):
            refused = httpx.get(base + path, verify=ca)
            assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Basic"), path
        wrong = httpx.get(base + "/metrics", verify=ca, auth=("prometheus", "nope"))
        assert wrong.status_code == 401
        started = time.monotonic()
        too_long = httpx.get(base + "/metrics", verify=ca, auth=("prometheus", "x" * 100))  # over bcrypt's 72 bytes
        assert too_long.status_code == 401 and time.monotonic() - started >= 0.9  # the refusal delay, not a 500
        ok = httpx.get(base + "/metrics", verify=ca, auth=("prometheus", "s3cret-pass"))
        assert ok.status_code == 200 and "gpuwarden_gpu_up" in ok.text
        with pytest.raises(httpx.TransportError):  # plain HTTP to a TLS port fails, it does not leak data
            httpx.get(f"http://127.0.0.1:{exporter.port}/metrics", timeout=2)
    finally:
        exporter.stop()
    logs = exporter.output()
    assert "s3cret-pass" not in logs and hashed not in logs and "Traceback" not in logs and "x" * 100 not in logs


def test_mutual_tls_requires_a_client_certificate(tmp_path, pki):
    with_cert = ssl.create_default_context(cafile=str(pki["ca"]))
    with_cert.load_cert_chain(str(pki["client"]))
    exporter = start(
        tmp_path,
        {
            "tls_server_config": {
                "cert_file": str(pki["cert"]),
                "key_file": str(pki["key"]),
                "client_auth_type": "RequireAndVerifyClientCert",
                "client_ca_file": str(pki["ca"]),
            }
        },
        ready="/metrics",  # answered 200 with the client certificate
        verify=with_cert,
    )
    try:
        without = ssl.create_default_context(cafile=str(pki["ca"]))
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            httpx.get(exporter.url + "/metrics", verify=without, timeout=3)
    finally:
        exporter.stop()


@pytest.mark.parametrize(
    ("web", "expected"),
    [
        (
            {"tls_server_config": {"cert_file": "/nope.pem", "key_file": "/nope.key"}},
            "tls_server_config: cert_file /nope.pem does not exist",
        ),
        ({"basic_auth_users": {"admin": "plaintext"}}, "basic_auth_users.admin must be a bcrypt hash"),
        (
            {"tls_server_config": {"cert_file": "CERT", "key_file": "KEY", "client_auth_type": "RequireAnyClientCert"}},
            "client_auth_type",
        ),
        (
            {
                "tls_server_config": {
                    "cert_file": "CERT",
                    "key_file": "KEY",
                    "client_auth_type": "RequireAndVerifyClientCert",
                }
            },
            "needs client_ca_file",
        ),
        ({"tls_config": {}}, "unknown key 'tls_config'; allowed here: tls_server_config, basic_auth_users"),
        ({"tls_server_config": {"cert_file": "CERT"}}, "tls_server_config.key_file: Field required"),
        ({"basic_auth_users": ["admin"]}, "basic_auth_users: Input should be a mapping"),
        ({"tls_server_config": {"cert_file": "KEY", "key_file": "KEY"}}, "cannot load cert_file/key_file"),
        # a malformed hash passed validation, then answered 500 with a traceback on the first login
        ({"basic_auth_users": {"admin": "$2y$10$tooshort"}}, "basic_auth_users.admin is not a well-formed bcrypt hash"),
        # cost 31 spun both services at 100 % CPU without ever listening, logging nothing
        ({"basic_auth_users": {"admin": "$2y$31$" + "a" * 53}}, "basic_auth_users.admin has bcrypt cost 31"),
        # a garbage CA file was a traceback and exit 1
        (
            {
                "tls_server_config": {
                    "cert_file": "CERT",
                    "key_file": "KEY",
                    "client_ca_file": "GARBAGE",
                    "client_auth_type": "RequireAndVerifyClientCert",
                }
            },
            "cannot load client_ca_file",
        ),  # fmt: skip
    ],
)
def test_bad_web_config_is_one_line_and_exit_2(tmp_path, pki, web, expected):
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    text = str(web).replace("CERT", str(pki["cert"])).replace("KEY", str(pki["key"])).replace("GARBAGE", str(garbage))
    path = tmp_path / "web.yml"
    path.write_text(text.replace("'", '"'))
    with pytest.raises(ConfigError) as caught:
        load_web_config(path)
    assert expected in str(caught.value) and "\n" not in str(caught.value)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwarden",
            "--sim",
            "--web.config.file",
            str(path),
            "--web.listen-address",
            f"127.0.0.1:{free_port()}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    fleet = subprocess.run(
        [sys.executable, "-m", "gpuwarden", "fleet", "--web.config.file", str(path), "--listen-address",
         f"127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert fleet.returncode == 2 and len(fleet.stderr.strip().splitlines()) == 1, fleet.stderr


def test_sighup_leaves_the_fleet_service_serving(tmp_path):
    """A config-management tool's reload sends SIGHUP to every service; it ended `gpuwarden fleet`."""
    import signal

    with running_cli("fleet", "--prometheus-url", f"http://127.0.0.1:{free_port()}") as (url, proc):
        proc.send_signal(signal.SIGHUP)
        assert wait(url + "/healthz").status_code == 200
        proc.send_signal(signal.SIGHUP)
        assert wait(url + "/healthz").status_code == 200 and proc.poll() is None
    assert "restart it" in proc.stderr.read()


def test_fleet_service_takes_the_same_web_config(tmp_path, pki):
    """`gpuwarden fleet --web.config.file`: TLS and basic auth as the exporter has them; probes stay open."""
    hashed = bcrypt.hashpw(b"fleet-pass", bcrypt.gensalt(rounds=4)).decode()
    config = write_yaml(
        tmp_path / "web.yml",
        {
            "tls_server_config": {"cert_file": str(pki["cert"]), "key_file": str(pki["key"])},
            "basic_auth_users": {"sre": hashed},
        },
    )
    ca = ssl.create_default_context(cafile=str(pki["ca"]))
    # waited for on /healthz without credentials: probes stay open
    fleet = start_daemon(
        "fleet", "--prometheus-url", "http://127.0.0.1:9", "--query-timeout", "0.5", "--web.config.file", str(config),
        tls=True, verify=ca,
    )  # fmt: skip
    try:
        url = fleet.url
        assert httpx.get(url + "/api/v1/fleet", verify=ca).status_code == 401
        assert httpx.get(url + "/api/v1/fleet", verify=ca, auth=("sre", "wrong")).status_code == 401
        # past the auth: Prometheus is down, which the API says as 503 JSON
        answer = httpx.get(url + "/api/v1/fleet", verify=ca, auth=("sre", "fleet-pass"))
        assert answer.status_code == 503 and answer.json()["error"] == "prometheus"
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{fleet.port}/healthz", timeout=2)  # no plain HTTP beside TLS
    finally:
        fleet.stop()
    assert "Traceback" not in fleet.output()
