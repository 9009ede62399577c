#!/usr/bin/env bash
# openjev_certs.sh: the private CA and the certificates of a multi-host OpenJEV deployment, with
# plain OpenSSL commands (each one is printed before it runs). See --help and DEPLOYMENT-eva01.md §12.
set -euo pipefail

readonly PROG=openjev_certs.sh

# die, usage_error, expand_home
# shellcheck disable=SC1091
source "$(dirname -- "${BASH_SOURCE[0]}")/../openjev/common.sh"

usage() {
    cat <<'EOF'
usage: openjev_certs.sh ca CA_DIR [--cn NAME] [--days N]
       openjev_certs.sh server CA_DIR NAME OUT_PEM [--ip ADDR]... [--dns NAME]... [--days N] [--force]
       openjev_certs.sh client CA_DIR NAME OUT_PEM [--days N] [--force]
       openjev_certs.sh --help

Certificates for the mutual-TLS hop between the front gateway and the peer listeners of a
multi-host deployment (DEPLOYMENT-eva01.md §12). ECDSA P-256 keys, SHA-256 signatures.

  ca       make a private CA in CA_DIR (created with mode 0700): ca.key (0600, keep it off the
           serving hosts) and ca.crt (0644, copied to every host as TLS_DIR/ca.crt).
           Refuses a CA_DIR that already holds ca.key.
  server   a server certificate for one peer host: subject CN=NAME, subjectAltName DNS:NAME
           (plus every --dns and --ip), extendedKeyUsage serverAuth. The gateway verifies the
           peer against the CA and checks NAME (`verifyhost`): give the gateway
           `--remote NAME=ADDR:PORT`.
  client   the gateway's client certificate: CN=NAME (the peer listeners accept only
           CN=openjev-gateway unless told otherwise), extendedKeyUsage clientAuth.

OUT_PEM gets the certificate followed by its private key (the form HAProxy's `crt` reads), mode
0600, written to a temporary file in the same directory and renamed into place, so a running
HAProxy never sees half a file and a reload picks up the whole new one (rotation). An existing
OUT_PEM is replaced only with --force.

Options
  --cn NAME    CA subject [openjev private CA]
  --days N     validity in days [3650 for the CA, 825 for server and client certificates]
  --ip ADDR    extra IP subjectAltName (server)          --dns NAME   extra DNS subjectAltName (server)
  --force      replace an existing OUT_PEM
  -h, --help   this help

Exit status: 0 on success; 1 with one line on stderr when refused or OpenSSL fails; 2 for usage
errors. Needs: openssl (Debian package openssl).

Example (three hosts: front eva01, peers eva02 and eva03; run on an admin machine):
  deploy/openjev_certs.sh ca ~/openjev-ca
  deploy/openjev_certs.sh client ~/openjev-ca openjev-gateway eva01-tls/gateway-client.pem
  deploy/openjev_certs.sh server ~/openjev-ca eva02 eva02-tls/peer.pem --ip 10.0.0.2
  deploy/openjev_certs.sh server ~/openjev-ca eva03 eva03-tls/peer.pem --ip 10.0.0.3
EOF
}

run() {  # print the OpenSSL command, run it, and keep its output for the error line
    local out
    printf '+ %s\n' "$*"
    out=$("$@" 2>&1) || die "$1 failed: $(printf '%s' "$out" | tr '\n' ' ' | cut -c1-400)"
}

check_name() {
    [[ $2 =~ ^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$ ]] ||
        usage_error "$1 '$2' must be a host name (letters, digits, '.', '-')"
}

check_days() {
    { [[ $1 =~ ^[0-9]{1,5}$ ]] && ((10#$1 >= 1)); } || usage_error "--days must be a whole number of days >= 1, got '$1'"
}

(($#)) || usage_error "give a command: ca, server or client"
case $1 in
    -h | --help) usage; exit 0 ;;
    ca | server | client) CMD=$1; shift ;;
    *) usage_error "unknown command '$1' (ca, server or client)" ;;
esac

POS=() CN="openjev private CA" DAYS="" FORCE=0 SANS=()
while (($#)); do
    case $1 in
        -h | --help) usage; exit 0 ;;
        --cn | --days | --ip | --dns)
            (($# >= 2)) && [[ -n $2 && $2 != --* ]] || usage_error "$1 needs a value"
            case $1 in
                --cn) CN=$2 ;;
                --days) check_days "$2"; DAYS=$2 ;;
                --ip)
                    [[ $CMD == server ]] || usage_error "--ip is for server certificates"
                    [[ $2 =~ ^[0-9]{1,3}(\.[0-9]{1,3}){3}$ || $2 =~ ^[0-9A-Fa-f:]+$ ]] || usage_error "--ip '$2' is not an IP address"
                    SANS+=("IP:$2") ;;
                --dns)
                    [[ $CMD == server ]] || usage_error "--dns is for server certificates"
                    check_name --dns "$2"; SANS+=("DNS:$2") ;;
            esac
            shift ;;
        --force) FORCE=1 ;;
        --*) usage_error "unknown option '$1'" ;;
        *) POS+=("$1") ;;
    esac
    shift
done
command -v openssl >/dev/null || die "openssl is not installed (Debian: apt-get install openssl)"
[[ $CN =~ ^[A-Za-z0-9\ ._-]+$ ]] || usage_error "--cn '$CN' may hold letters, digits, spaces, '.', '_', '-' only"

umask 077
if [[ $CMD == ca ]]; then
    ((${#POS[@]} == 1)) || usage_error "ca takes one argument, CA_DIR"
    CA_DIR=${POS[0]}
    [[ ! -e $CA_DIR/ca.key ]] || die "$CA_DIR/ca.key exists: refusing to replace a CA (its certificates would stop verifying)"
    mkdir -p -- "$CA_DIR" || die "cannot create $CA_DIR"
    chmod 700 -- "$CA_DIR"
    run openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$CA_DIR/ca.key"
    run openssl req -x509 -new -key "$CA_DIR/ca.key" -sha256 -days "${DAYS:-3650}" -subj "/CN=$CN" \
        -addext basicConstraints=critical,CA:TRUE,pathlen:0 -addext keyUsage=critical,keyCertSign,cRLSign \
        -out "$CA_DIR/ca.crt"
    chmod 600 -- "$CA_DIR/ca.key"
    chmod 644 -- "$CA_DIR/ca.crt"
    printf 'made the CA: %s/ca.crt (copy to every host as TLS_DIR/ca.crt); %s/ca.key stays here (0600)\n' "$CA_DIR" "$CA_DIR"
    exit 0
fi

((${#POS[@]} == 3)) || usage_error "$CMD takes CA_DIR NAME OUT_PEM"
CA_DIR=${POS[0]} NAME=${POS[1]} OUT=${POS[2]}
check_name NAME "$NAME"
[[ -f $CA_DIR/ca.key && -f $CA_DIR/ca.crt ]] || die "no CA in $CA_DIR (make one with: $PROG ca $CA_DIR)"
[[ ! -e $OUT ]] || ((FORCE)) || die "$OUT exists (re-run with --force to replace it, e.g. for a rotation)"
OUT_DIR=$(dirname -- "$OUT")
mkdir -p -- "$OUT_DIR" || die "cannot create $OUT_DIR"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/openjev-certs.XXXXXX")
trap 'rm -rf -- "$WORK"' EXIT
if [[ $CMD == server ]]; then
    EXT="basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth
subjectAltName=$(IFS=,; echo "DNS:$NAME${SANS[*]:+,${SANS[*]}}")"
else
    EXT="basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=clientAuth"
fi
printf '%s\n' "$EXT" >"$WORK/ext.cnf"
printf '+ cat > ext.cnf <<EOF\n%s\nEOF\n' "$EXT"
run openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$WORK/key.pem"
run openssl req -new -key "$WORK/key.pem" -subj "/CN=$NAME" -out "$WORK/req.csr"
run openssl x509 -req -in "$WORK/req.csr" -CA "$CA_DIR/ca.crt" -CAkey "$CA_DIR/ca.key" \
    -set_serial "0x$(openssl rand -hex 16)" -days "${DAYS:-825}" -sha256 -extfile "$WORK/ext.cnf" -out "$WORK/cert.pem"
run openssl verify -CAfile "$CA_DIR/ca.crt" -purpose "$([[ $CMD == server ]] && echo sslserver || echo sslclient)" "$WORK/cert.pem"
TMP=$(mktemp "$OUT_DIR/.$(basename -- "$OUT").XXXXXX") || die "cannot write in $OUT_DIR"
cat -- "$WORK/cert.pem" "$WORK/key.pem" >"$TMP"
chmod 600 -- "$TMP"
mv -f -- "$TMP" "$OUT" || die "cannot write $OUT"
printf 'wrote %s (%s certificate CN=%s, serial %s, then its key; mode 0600)\n' "$OUT" "$CMD" "$NAME" \
    "$(openssl x509 -in "$OUT" -noout -serial | cut -d= -f2)"
