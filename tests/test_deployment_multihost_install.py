"""Several hosts, installing them: deploy/install_units.sh's front and peer layouts (haproxy -c,
systemd-analyze verify, the rendered lines), the options it refuses, the TLS material it checks
(expired, another CA, the CA's key beside it, modes through symlinks), and deploy/openjev_certs.sh's
certificates (OpenSSL) and refusals.

Skips (pytest -rs shows why) without haproxy (apt-get install -y haproxy) or openssl; the
verification test also needs systemd-analyze (apt-get install -y systemd).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from _deployment_multihost_support import HOSTS, MULTIHOST_MARKS, OPENSSL, certs
from _deployment_multihost_support import pki  # noqa: F401 - fixture
from _deployment_support import ANALYZE, install
from conftest import error_lines

from openjev_testsupport.pki import CERTS

pytestmark = MULTIHOST_MARKS


# ---------------------------------------------------------------- rendering and checks
def test_multihost_rendering_passes_haproxy_c_and_systemd_analyze(overlay, pki, tmp_path):
    """Front and peer layouts, rendered with every check on: haproxy -c loads the certificates."""
    if ANALYZE is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd: apt-get install -y systemd)")
    common = ["--root", tmp_path, "--model", overlay, "--unit-dir", tmp_path / "u", "--conf-dir", tmp_path / "c",
              "--dry-run"]
    front = install(*common, "--tls-dir", pki["tls"]["front"], "--remote", "peer3=127.0.0.3:31443",
                    "--remote", "peer4=127.0.0.4:31443", "--prefix-affinity", "32").stdout
    peer = install(*common, "--tls-dir", pki["tls"]["peer3"], "--peer-listen", "127.0.0.3:31443").stdout
    for out in (front, peer):
        assert "checked: systemd-analyze --user verify passed" in out and "checked: haproxy -c" in out, out[-600:]
    tls = pki["tls"]["front"]
    lines = front.splitlines()
    for line in ["    balance hash var(txn.openjev_prefix)", "    hash-type consistent", "    hash-balance-factor 150",
                 "    option http-keep-alive", "    http-reuse always", "    no option http-server-close",
                 "    server replica0 127.0.0.1:31100",
                 f"    server peer-peer3 127.0.0.3:31443 ssl verify required ca-file {tls}/ca.crt crt "
                 f"{tls}/gateway-client.pem verifyhost peer3 sni str(peer3) ssl-min-ver TLSv1.2 alpn http/1.1 "
                 "init-addr last,libc,none observe layer4 error-limit 10 on-error mark-down",
                 "    retry-on conn-failure empty-response junk-response response-timeout 503", "    option redispatch 1",
                 "    option httpchk GET /health"]:
        assert line in lines, line
    assert "frontend peer" not in front
    tls = pki["tls"]["peer3"]
    assert (f"    bind 127.0.0.3:31443 ssl crt {tls}/peer.pem ca-file {tls}/ca.crt verify required "
            "ssl-min-ver TLSv1.2 alpn http/1.1") in peer.splitlines()
    assert "    balance leastconn" in peer.splitlines() and "\n    server peer-" not in peer
    assert "    http-reuse always" not in peer.splitlines()  # a peer keeps one connection per request to its replicas
    unbounded = install(*common, "--tls-dir", pki["tls"]["peer3"], "--peer-listen", "127.0.0.3:31443",
                        "--prefix-affinity", "8", "--hash-balance-factor", "0", "--no-verify").stdout
    assert "    balance hash var(txn.openjev_prefix)" in unbounded.splitlines() and "hash-balance-factor" not in unbounded
    assert "OPENJEV_REPLICA_ARGS=\n" in peer  # replicas keep binding 127.0.0.1


def test_multihost_options_refuse_bad_input(overlay, pki, tmp_path):
    common = ["--root", tmp_path, "--model", overlay, "--unit-dir", tmp_path / "u", "--conf-dir", tmp_path / "c"]
    cases = {
        ("--remote", "127.0.0.3:31443"): (2, "name the host its certificate names"),
        ("--remote", "peer3=127.0.0.3"): (2, "[NAME=]HOST:PORT"),
        ("--remote", "a=h:1", "--remote", "a=h:2"): (2, "names a twice"),
        ("--peer-listen", "127.0.0.3:1", "--remote", "a=h:2"): (2, "exclude each other"),
        ("--peer-listen", "eva02:31443"): (2, "IPv4 address"),
        ("--local-address", "10.0.0.2"): (2, "127.0.0.0/8"),
        ("--prefix-affinity", "-1"): (2, "--prefix-affinity"),
        ("--prefix-affinity", "8", "--hash-balance-factor", "90"): (2, "--hash-balance-factor"),
        ("--remote", "peer3=127.0.0.3:31443", "--tls-dir", tmp_path / "none"): (1, "ca.crt is missing"),
    }
    for args, (rc, text) in cases.items():
        p = install(*common, *args, check=False)
        lines = error_lines(p.stderr)
        assert p.returncode == rc and len(lines) == 1 and text in lines[0], (args, p.returncode, p.stderr)
    loose = tmp_path / "loose"
    shutil.copytree(pki["tls"]["peer3"], loose)
    (loose / "peer.pem").chmod(0o644)
    p = install(*common, "--peer-listen", "127.0.0.3:31443", "--tls-dir", loose, check=False)
    assert p.returncode == 1 and "mode 644" in p.stderr and not (tmp_path / "u").exists()


def test_tls_material_is_checked_at_install(overlay, pki, tmp_path):
    """An expired certificate, one of another CA, or the CA's key beside the serving certificates is
    refused with one line; a 0600 pem reached through a symlink is accepted (its target is checked)."""
    common = ["--root", tmp_path, "--model", overlay, "--unit-dir", tmp_path / "u", "--conf-dir", tmp_path / "c",
              "--peer-listen", "127.0.0.3:31443", "--dry-run"]

    def tls_dir(name: str, pem: Path | None = None) -> Path:
        d = tmp_path / name
        shutil.copytree(pki["tls"]["peer3"], d)
        if pem is not None:
            shutil.copy(pem, d / "peer.pem")
            (d / "peer.pem").chmod(0o600)
        return d

    def refused(d: Path, *words: str) -> None:
        p = install(*common, "--tls-dir", d, check=False)
        lines = error_lines(p.stderr)
        assert p.returncode == 1 and len(lines) == 1 and all(w in lines[0] for w in words), p.stderr
        assert not (tmp_path / "u").exists()

    certs("server", pki["rogue"], "peer3", tmp_path / "rogue-peer.pem", "--ip", HOSTS["peer3"])
    refused(tls_dir("other-ca", tmp_path / "rogue-peer.pem"), "does not chain to", "ca.crt")
    refused(tls_dir("expired", expired_server_pem(pki["ca"], tmp_path / "expired-work")), "has expired")
    with_key = tls_dir("with-key")
    shutil.copy(pki["ca"] / "ca.key", with_key / "ca.key")
    refused(with_key, "ca.key", "move it away")
    linked = tls_dir("linked")
    target = tmp_path / "keys" / "peer.pem"
    target.parent.mkdir()
    (linked / "peer.pem").rename(target)
    (linked / "peer.pem").symlink_to(target)
    p = install(*common, "--tls-dir", linked, check=False)
    assert p.returncode == 0 and not error_lines(p.stderr), p.stderr
    target.chmod(0o640)
    refused(linked, str(target), "mode 640")


def expired_server_pem(ca: Path, work: Path) -> Path:
    """A server certificate of the deployment's CA whose validity ended in 2020 (openssl ca sets the
    dates that openssl x509 of OpenSSL 3.0 cannot)."""
    work.mkdir()
    (work / "index.txt").write_text("")
    (work / "serial").write_text("1000\n")
    (work / "ca.cnf").write_text(
        "[ca]\ndefault_ca = d\n[d]\ndatabase = index.txt\nnew_certs_dir = .\nserial = serial\n"
        "default_md = sha256\npolicy = p\nunique_subject = no\n[p]\ncommonName = supplied\n")
    subprocess.run(["openssl", "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-subj", "/CN=peer3", "-keyout", "key.pem", "-out", "req.csr"], cwd=work, check=True,
                   capture_output=True)
    subprocess.run(["openssl", "ca", "-batch", "-config", "ca.cnf", "-cert", str(ca / "ca.crt"), "-keyfile",
                    str(ca / "ca.key"), "-in", "req.csr", "-out", "cert.pem", "-notext", "-startdate",
                    "20200101000000Z", "-enddate", "20200201000000Z"], cwd=work, check=True, capture_output=True)
    pem = work / "peer.pem"
    pem.write_bytes((work / "cert.pem").read_bytes() + (work / "key.pem").read_bytes())
    return pem


def test_openjev_certs_makes_verifiable_certificates_and_refuses_bad_input(tmp_path):
    h = subprocess.run(["bash", str(CERTS), "--help"], capture_output=True, text=True, timeout=30)
    assert h.returncode == 0 and h.stdout.startswith("usage: openjev_certs.sh")
    ca = tmp_path / "ca"
    made = certs("ca", ca).stdout
    assert "+ openssl genpkey" in made and "+ openssl req -x509" in made  # the commands are shown
    assert (ca.stat().st_mode & 0o777, (ca / "ca.key").stat().st_mode & 0o777) == (0o700, 0o600)
    certs("server", ca, "eva02", tmp_path / "h" / "peer.pem", "--ip", "10.0.0.2", "--dns", "eva02.lan")
    certs("client", ca, "openjev-gateway", tmp_path / "h" / "client.pem")
    pem = tmp_path / "h" / "peer.pem"
    assert pem.stat().st_mode & 0o777 == 0o600
    text = subprocess.run([OPENSSL, "x509", "-noout", "-text", "-in", str(pem)], capture_output=True, text=True).stdout
    assert "DNS:eva02, IP Address:10.0.0.2, DNS:eva02.lan" in text and "TLS Web Server Authentication" in text
    assert "PRIVATE KEY" in pem.read_text()  # certificate, then its key: what HAProxy's crt reads
    for f, purpose in (("peer.pem", "sslserver"), ("client.pem", "sslclient")):
        v = subprocess.run([OPENSSL, "verify", "-CAfile", str(ca / "ca.crt"), "-purpose", purpose,
                            str(tmp_path / "h" / f)], capture_output=True, text=True)
        assert v.returncode == 0, v.stderr
    before = pem.read_bytes()
    cases = [
        (["ca", ca], 1, "refusing to replace a CA"),
        (["server", ca, "eva02", pem], 1, "--force"),
        (["server", tmp_path / "noca", "eva02", tmp_path / "x.pem"], 1, "no CA in"),
        (["server", ca, "bad name", tmp_path / "x.pem"], 2, "host name"),
        (["client", ca, "gw", tmp_path / "x.pem", "--ip", "10.0.0.1"], 2, "--ip is for server"),
        (["server", ca, "eva02", tmp_path / "x.pem", "--ip", "ten"], 2, "not an IP address"),
        (["server", ca, "eva02", tmp_path / "x.pem", "--days", "0"], 2, "--days"),
        (["renew", ca], 2, "unknown command"),
        (["server", ca, "eva02"], 2, "CA_DIR NAME OUT_PEM"),
    ]
    for args, rc, text in cases:
        p = subprocess.run(["bash", str(CERTS), *map(str, args)], capture_output=True, text=True, timeout=30)
        lines = error_lines(p.stderr)
        assert p.returncode == rc and len(lines) == 1 and text in lines[0], (args, p.returncode, p.stderr)
    assert pem.read_bytes() == before and not (tmp_path / "x.pem").exists()
