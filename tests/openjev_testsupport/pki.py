"""The multi-host test PKI: a CA and the certificates deploy/openjev_certs.sh makes, laid out as each
host's TLS_DIR. Used by tests/_deployment_multihost_support.py and benchmarks/bench_multihost.py."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

# tests/openjev_testsupport/ -> the repository
CERTS = Path(__file__).resolve().parents[2] / "deploy" / "openjev_certs.sh"


def make_host_tls(base: Path, certs: Callable[..., object], peers: dict[str, tuple[str, str]],
                  front: str = "front") -> dict[str, Path]:
    """The CA in base/ca and a TLS_DIR base/HOST/tls for the front host and each peer host.

    Every TLS_DIR gets the CA's ca.crt; the front's also gateway-client.pem (CN openjev-gateway),
    each peer's peer.pem, a server certificate for peers[HOST] = (CN, IP address). certs(*args)
    runs `openjev_certs.sh ARGS...` (the caller decides how a failure is reported). A CA or
    TLS_DIR left by an earlier run under base is removed first. Returns {host: TLS_DIR}.
    """
    ca = base / "ca"
    shutil.rmtree(ca, ignore_errors=True)
    certs("ca", ca)
    tls = {name: base / name / "tls" for name in (front, *peers)}
    for d in tls.values():
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True, mode=0o700)
        shutil.copy(ca / "ca.crt", d / "ca.crt")
    certs("client", ca, "openjev-gateway", tls[front] / "gateway-client.pem")
    for name, (cn, ip) in peers.items():
        certs("server", ca, cn, tls[name] / "peer.pem", "--ip", ip)
    return tls
