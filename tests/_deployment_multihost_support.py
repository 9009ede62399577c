"""What the several-hosts tests share (tests/test_deployment_multihost_*.py): the three loopback hosts,
their skip conditions, deploy/openjev_certs.sh and the deployment's PKI (the `pki` fixture, imported by
the test modules that use it).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from _deployment_support import HAPROXY

from openjev_testsupport.pki import CERTS, make_host_tls

OPENSSL = shutil.which("openssl")
HOSTS = {"front": "127.0.0.2", "peer3": "127.0.0.3", "peer4": "127.0.0.4"}

# Every several-hosts test module's pytestmark.
MULTIHOST_MARKS = [
    pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed: the gateway and the mutual TLS need "
                       "Debian's haproxy package (apt-get install -y haproxy)"),
    pytest.mark.skipif(OPENSSL is None, reason="openssl is not installed (apt-get install -y openssl)"),
]


def certs(*args) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", str(CERTS), *map(str, args)], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise AssertionError(f"openjev_certs.sh {args[0]} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def make_pki(base: Path) -> dict:
    """The deployment's CA and certificates, a stranger CA, and each host's TLS_DIR."""
    ca, rogue = base / "ca", base / "rogue-ca"
    tls = make_host_tls(base, certs, {name: (name, HOSTS[name]) for name in ("peer3", "peer4")})
    certs("ca", rogue, "--cn", "someone else")
    certs("client", rogue, "openjev-gateway", base / "rogue-client.pem")       # right CN, wrong CA
    certs("client", ca, "intruder", base / "intruder-client.pem")             # right CA, wrong CN
    return {"ca": ca, "rogue": rogue, "tls": tls, "base": base}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))
