#!/bin/sh
# Provisioning step of `make test`: the Debian packages the deployment tests drive for real
# (HAProxy, and systemd's systemd-socket-activate / systemd-analyze). Installed only when this
# runs as root with apt-get; otherwise nothing is changed and those tests skip with the reason.
# OPENJEV_NO_PROVISION=1 turns the step off.
if [ "${OPENJEV_NO_PROVISION:-0}" = 1 ]; then
  echo "provision: skipped (OPENJEV_NO_PROVISION=1)"; exit 0
fi
missing=""
command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || missing="$missing haproxy"
command -v systemd-socket-activate >/dev/null 2>&1 || missing="$missing systemd"
if [ -z "$missing" ]; then
  echo "provision: haproxy and systemd tools present"; exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "provision: skipped:$missing missing and not root with apt-get; the tests that need them are skipped with the reason"
  exit 0
fi
echo "provision: apt-get install$missing"
DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing >/dev/null 2>&1 \
  || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing >/dev/null 2>&1; } \
  || echo "provision: warning: could not install$missing; the tests that need them are skipped with the reason" >&2
exit 0
