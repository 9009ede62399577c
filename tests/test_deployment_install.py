"""Production deployment, installing it: deploy/install_units.sh (help, dry run, refusal and --force, a
missing --root), the units and haproxy.cfg it renders, systemd-analyze verify on them, and
tests/openjev_testsupport/unit_runner.py's refusal of a missing working directory. Real processes, nothing
mocked (tests/_deployment_support.py says what plays the part of systemd).

Skips (pytest -rs shows why) when haproxy (apt-get install haproxy) or systemd-analyze (apt-get
install systemd) are missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from _deployment_support import LAUNCHER, install, needs_analyze, needs_haproxy, render
from conftest import PY, REPO, error_lines, free_port, free_ports_on

from openjev_testsupport import unit_runner


# ---------------------------------------------------------------- installer and units
def test_install_units_help_dry_run_refuse_force(overlay, tmp_path):
    h = install("--help")
    assert h.stdout.startswith("usage: install_units.sh") and "--dry-run" in h.stdout
    common = ["--root", tmp_path, "--model", overlay, "--unit-dir", tmp_path / "u", "--conf-dir", tmp_path / "c",
              "--no-verify"]
    dry = install(*common, "--dry-run")
    assert "### " + str(tmp_path / "u" / "openjev-gateway.socket") in dry.stdout
    assert "ListenStream=127.0.0.1:31000" in dry.stdout and "dry run: nothing written" in dry.stdout
    assert not (tmp_path / "u").exists() and not (tmp_path / "c").exists()

    first = install(*common)
    files = sorted(p.name for p in (tmp_path / "u").iterdir()) + sorted(p.name for p in (tmp_path / "c").iterdir())
    assert files == ["openjev-gateway.service", "openjev-gateway.socket", "openjev-replica@.service", "openjev.target",
                     "haproxy.cfg", "replica-0.env", "replica-1.env"], files
    assert "systemctl --user enable openjev.target openjev-gateway.socket" in first.stdout
    again = install(*common)
    assert again.stdout.count("unchanged: ") == 7

    (tmp_path / "c" / "replica-1.env").write_text((tmp_path / "c" / "replica-1.env").read_text() + "X=1\n")
    refused = install(*common, "--port", "31010", check=False)
    lines = error_lines(refused.stderr)
    assert refused.returncode == 1 and len(lines) == 1 and "--force" in lines[0] and "replica-1.env" in lines[0]
    assert "ListenStream=127.0.0.1:31000" in (tmp_path / "u" / "openjev-gateway.socket").read_text()
    forced = install(*common, "--port", "31010", "--force")
    assert "replaced: " in forced.stdout
    assert "ListenStream=127.0.0.1:31010" in (tmp_path / "u" / "openjev-gateway.socket").read_text()

    bad = install(*common, "--gpus", "0,0", check=False)
    assert bad.returncode == 2 and len(error_lines(bad.stderr)) == 1


def test_rendered_units_say_what_the_deployment_needs(overlay, tmp_path):
    install("--root", tmp_path, "--model", overlay, "--unit-dir", tmp_path / "u", "--conf-dir", tmp_path / "c",
            "--gpus", "0,1", "--no-verify", "--system", "--user", os.environ.get("USER", "root"))
    sock = (tmp_path / "u" / "openjev-gateway.socket").read_text()
    gw = (tmp_path / "u" / "openjev-gateway.service").read_text()
    rep = (tmp_path / "u" / "openjev-replica@.service").read_text()
    tgt = (tmp_path / "u" / "openjev.target").read_text()
    cfg = (tmp_path / "c" / "haproxy.cfg").read_text()
    for line in ["ListenStream=127.0.0.1:31000", "ReusePort=no", "Accept=no"]:
        assert line in sock.splitlines()
    for line in ["Type=notify", "KillSignal=SIGUSR1", "KillMode=mixed", "Restart=always",
                 "ExecReload=/bin/kill -USR2 $MAINPID", "Requires=openjev-gateway.socket"]:
        assert line in gw.splitlines()
    assert f"-Ws -f {tmp_path / 'c' / 'haproxy.cfg'}" in gw
    for line in ["Type=exec", "Environment=CUDA_VISIBLE_DEVICES=%i", "Restart=on-failure", "KillSignal=SIGTERM",
                 "TimeoutStartSec=20min", f"EnvironmentFile={tmp_path / 'c'}/replica-%i.env",
                 f"ExecStart=/bin/bash {LAUNCHER} ${{OPENJEV_MODEL}} ${{OPENJEV_REPLICA_PORT}} $OPENJEV_REPLICA_ARGS"]:
        assert line in rep.splitlines(), line
    assert "Wants=openjev-gateway.socket openjev-gateway.service openjev-replica@0.service openjev-replica@1.service" in tgt
    for line in ["    bind fd@3", "    balance leastconn", "    option httpchk GET /health", "    http-check expect status 200",
                 "    option redispatch 1", "    option http-buffer-request", "    option http-server-close",
                 "    retry-on conn-failure empty-response junk-response response-timeout 503",
                 "    server replica0 127.0.0.1:31100", "    server replica1 127.0.0.1:31101",
                 "    bind 127.0.0.1:31090", "    http-request use-service prometheus-exporter if { path /metrics }",
                 "    stats uri /stats"]:
        assert line in cfg.splitlines(), line
    assert "OPENJEV_REPLICA_PORT=31101" in (tmp_path / "c" / "replica-1.env").read_text()


@needs_analyze
@needs_haproxy
@pytest.mark.parametrize("mode", ["user", "system"])
def test_systemd_analyze_verify_passes_on_rendered_units(overlay, tmp_path, mode):
    extra = ["--system", "--user", os.environ.get("USER") or "root"] if mode == "system" else []
    out = install("--root", tmp_path, "--model", overlay, "--unit-dir", tmp_path / "u", "--conf-dir", tmp_path / "c",
                  "--dry-run", *extra)
    flag = "--user " if mode == "user" else ""
    assert f"checked: systemd-analyze {flag}verify passed for openjev-gateway.socket openjev-gateway.service " \
           "openjev.target openjev-replica@0.service openjev-replica@1.service" in out.stdout, out.stdout
    assert "checked: haproxy -c" in out.stdout


@needs_analyze
@needs_haproxy
def test_verify_catches_a_broken_unit(overlay, tmp_path):
    """The check is real: a template with a typo'd key fails the install, nothing is written."""
    copy = tmp_path / "deploy"
    shutil.copytree(REPO / "deploy", copy, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "openjev").mkdir()
    shutil.copy(REPO / "openjev" / "common.sh", tmp_path / "openjev")  # what the deploy scripts source
    svc = copy / "systemd" / "openjev-replica@.service"
    svc.write_text(svc.read_text().replace("KillSignal=SIGTERM", "KilSignal=SIGTERM"))
    proc = subprocess.run(["bash", str(copy / "install_units.sh"), "--bundle", REPO, "--root", tmp_path, "--model",
                           overlay, "--unit-dir", tmp_path / "u", "--conf-dir", tmp_path / "c"],
                          capture_output=True, text=True, timeout=120)
    lines = error_lines(proc.stderr)
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "systemd-analyze" in lines[0] and "KilSignal" in lines[0]
    assert not (tmp_path / "u").exists()


# ---------------------------------------------------------------- a missing root
@needs_haproxy
def test_install_units_creates_a_missing_root(overlay, tmp_path):
    root = tmp_path / "new" / "root"  # neither it nor its parent exists
    args = ["--root", root, "--model", overlay, "--unit-dir", tmp_path / "units", "--conf-dir", tmp_path / "conf",
            "--gpus", "0", "--backend", "transformers", "--no-verify"]
    dry = install(*args, "--dry-run")
    assert f"would create the missing --root {root}" in dry.stdout and not root.exists()
    done = install(*args)
    assert f"created: {root} (--root)" in done.stdout and root.is_dir() and (root.stat().st_mode & 0o777) == 0o755
    assert install(*args).stdout.count("created:") == 0  # a second run finds it
    (tmp_path / "file").write_text("x")
    swap = {root: tmp_path / "file", tmp_path / "units": tmp_path / "units2", tmp_path / "conf": tmp_path / "conf2"}
    bad = install(*[swap.get(a, a) for a in args], check=False)
    assert bad.returncode != 0 and len(error_lines(bad.stderr)) == 1 and "not a directory" in bad.stderr


@needs_haproxy
def test_unit_runner_names_a_missing_working_directory_in_one_line(overlay, tmp_path):
    r = render(tmp_path, overlay, free_port(), free_port(), free_ports_on("127.0.0.1", 2))
    r["root"].rmdir()  # the root went away after the install (or was never made)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}  # the test support package
    proc = subprocess.run([PY, "-m", "openjev_testsupport.unit_runner", str(r["units"])], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("unit_runner.py: error: openjev-replica@0.service: "
                                                   f"WorkingDirectory={r['root']} does not exist"), proc.stderr
    # the same through the Python API the tests and benchmarks use
    mgr = unit_runner.Manager(r["units"], tmp_path / "run2", tmp_path / "journal2")
    try:
        with pytest.raises(unit_runner.UnitError, match="WorkingDirectory=.* does not exist"):
            mgr.start_target("openjev.target")
    finally:
        mgr.close()
