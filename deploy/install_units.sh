#!/usr/bin/env bash
# install_units.sh: render the OpenJEV production units (gateway socket + HAProxy + replicas)
# and the gateway configuration for one host, check them, install them. See --help.
set -euo pipefail

readonly PROG=install_units.sh
SCRIPT_DIR=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)
readonly SCRIPT_DIR
readonly TEMPLATE_UNITS=(openjev-gateway.socket openjev-gateway.service openjev-replica@.service openjev.target)
readonly TEMPLATE_HAPROXY=$SCRIPT_DIR/haproxy/openjev-gateway.cfg

# die, usage_error, expand_home
# shellcheck disable=SC1091
source "$SCRIPT_DIR/../openjev/common.sh"

usage() {
    cat <<'EOF'
usage: install_units.sh [--root DIR] [--bundle DIR] [--model DIR] [--user NAME] [--gpus LIST]
                        [--port N] [--replica-port-base N] [--stats-port N]
                        [--backend sglang|transformers] [--env KEY=VALUE]... [--haproxy PATH]
                        [--system] [--unit-dir DIR] [--conf-dir DIR]
                        [--force] [--dry-run] [--no-verify] [--help]
                        [--local-address ADDR] [--remote [NAME=]HOST:PORT]... [--peer-listen ADDR:PORT]
                        [--tls-dir DIR] [--peer-client-cn CN] [--prefix-affinity N] [--hash-balance-factor F]
                        [--bench-timer CALENDAR --bench-args ARGS [--bench-python PATH]]

Render the production deployment of DEPLOYMENT-eva01.md from the templates in deploy/:
  UNIT_DIR/openjev-gateway.socket    systemd holds 127.0.0.1:PORT (the production endpoint)
  UNIT_DIR/openjev-gateway.service   HAProxy (master-worker) on that socket, fd 3
  UNIT_DIR/openjev-replica@.service  one replica per GPU: app/serve_sglang_v100.sh, instance = GPU
  UNIT_DIR/openjev.target            the socket, the gateway and every replica
  CONF_DIR/haproxy.cfg               the gateway: health checks, leastconn, retries, stats
  CONF_DIR/replica-<GPU>.env         each replica's model, port, backend and extra settings
then check them (systemd-analyze verify on the units, haproxy -c on the configuration with a
stand-in socket on fd 3) and install them. Nothing is written unless every check passes.
Prints the systemctl commands that enable and start the service; starts nothing itself.

Options (defaults in brackets)
  --root DIR             bundle root [$OPENJEV_V100_ROOT or ~/storage/sglang-openjev-v100]; the replicas'
                         working directory: created when missing (mode 0755, owned by --user)
  --bundle DIR           checkout holding app/serve_sglang_v100.sh [the one holding this script]
  --model DIR            model overlay the replicas serve [ROOT/model]
  --user NAME            account the service runs as [the current user]; user units always run
                         as the user whose manager loads them, so NAME must be you there
  --gpus LIST            GPU indices, one replica each, comma-separated [0,1]
  --port N               production endpoint on 127.0.0.1 [31000]
  --replica-port-base N  replica on GPU g listens on 127.0.0.1:(N+g) [31100]
  --stats-port N         HAProxy statistics (/stats) and Prometheus (/metrics) on 127.0.0.1 [31090]
  --backend NAME         sglang, or transformers (the embedded backend; CPU hosts, tests) [sglang]
  --env KEY=VALUE        extra line for every replica-<GPU>.env, e.g. MAX_RUNNING_REQUESTS=32
                         or OPENJEV_PYTHON=/path/python (repeatable)
  --haproxy PATH         HAProxy executable [haproxy on PATH]
  --system               system units (UNIT_DIR /etc/systemd/system, User=NAME) instead of
                         user units (UNIT_DIR ~/.config/systemd/user)
  --unit-dir DIR         where the units go [see --system]
  --conf-dir DIR         where haproxy.cfg and replica-<GPU>.env go [ROOT/gateway]
  --force                replace existing files that differ (default: refuse and list them)
  --dry-run              print every rendered file and run the checks; write nothing
  --no-verify            skip systemd-analyze verify and haproxy -c (not recommended)
  --bench-timer CALENDAR opt-in scheduled benchmark: also render UNIT_DIR/openjev-bench.service
                         (oneshot: app/bench_scheduled_v100.py --checkpoint MODEL ARGS) and
                         UNIT_DIR/openjev-bench.timer (OnCalendar=CALENDAR, e.g. "*-*-* 03:17:00",
                         Persistent=true, RandomizedDelaySec=10min); enable with
                         systemctl [--user] enable --now openjev-bench.timer
  --bench-args ARGS      the rest of the bench command, split at spaces: --history DIR --gpu N --port P
                         --set NAME=INPUTS,TOKENS,REFDIR ... (required with --bench-timer)
  --bench-python PATH    Python that runs it [ROOT/venv/bin/python]
  -h, --help             this help

Several hosts (DEPLOYMENT-eva01.md §12; certificates from deploy/openjev_certs.sh)
  --remote [NAME=]HOST:PORT  front gateway: also send requests to the peer listener of another
                         host, over mutual TLS: its certificate must chain to TLS_DIR/ca.crt and
                         name NAME (default HOST; required when HOST is an IP address); this
                         gateway shows TLS_DIR/gateway-client.pem. Health-checked through the
                         tunnel, same retries/redispatch and balance as local replicas (repeatable)
  --peer-listen ADDR:PORT  peer host: accept mutual-TLS connections on ADDR:PORT (an IPv4 address
                         of this host) from the gateway's client certificate only (CA
                         TLS_DIR/ca.crt, CN --peer-client-cn) and forward them to this host's
                         replicas; this host presents TLS_DIR/peer.pem. Not with --remote
  --tls-dir DIR          ca.crt, peer.pem, gateway-client.pem; keys mode 0600 [ROOT/tls]
  --peer-client-cn CN    client certificate CN a peer listener accepts [openjev-gateway]
  --prefix-affinity N    route requests whose first row shares its first N token ids to the
                         same replica or host (consistent hash of that prefix, bounded load)
                         instead of leastconn; 0 = off [0]
  --hash-balance-factor F  with --prefix-affinity: a server holding more than F% of the average
                         load is skipped for the next one on the hash ring; 0 = no bound [150]
  --local-address ADDR   the loopback address of the endpoint socket, stats and replicas, in
                         127.0.0.0/8 [127.0.0.1]; others are for tests playing several hosts

Exit status: 0 on success; 1 with one line on stderr when refused or a check fails; 2 for
usage errors. Needs: bash, awk, systemd-analyze (Debian package systemd), haproxy >= 2.6
(Debian package haproxy), python3 (for the stand-in socket of haproxy -c).

Example (eva01, user units; then the printed systemctl commands):
  deploy/install_units.sh --gpus 0,1 --dry-run
  deploy/install_units.sh --gpus 0,1
EOF
}

# ------------------------------------------------------------------ helpers
# Absolute, normalised path (the directory need not exist).
abspath() {
    local p
    p=$(expand_home "$1")
    [[ $p == /* ]] || p=$PWD/$p
    # collapse /./ and trailing slashes; .. is refused below to keep paths literal
    p=${p//\/.\//\/}
    while [[ $p == */ && $p != / ]]; do p=${p%/}; done
    printf '%s' "$p"
}

# Paths end up in unit files and in haproxy.cfg: refuse characters either would reinterpret.
check_path() {
    local what=$1 p=$2
    [[ $p != *..* ]] || die "$what '$p' contains '..'; give a plain absolute path"
    [[ $p =~ ^/[A-Za-z0-9._+/@:-]*$ ]] ||
        die "$what '$p' has characters systemd or HAProxy would reinterpret (space, %, \$, quotes, backslash); use a plain path"
}

check_port() {
    local what=$1 v=$2
    if ! [[ $v =~ ^[0-9]{1,5}$ ]] || ((10#$v < 1 || 10#$v > 65535)); then
        usage_error "$what must be a port number 1-65535, got '$v'"
    fi
}

# ------------------------------------------------------------------ arguments
ROOT_ARG="" BUNDLE_ARG="" MODEL_ARG="" USER_ARG="" GPUS_ARG=0,1
PORT=31000 REPLICA_BASE=31100 STATS_PORT=31090 BACKEND=sglang HAPROXY_ARG=""
SYSTEM=0 UNIT_DIR_ARG="" CONF_DIR_ARG="" FORCE=0 DRY_RUN=0 VERIFY=1
EXTRA_ENV=()
# Several hosts (multihost_* below)
REMOTES=() PEER_LISTEN="" TLS_DIR_ARG="" PEER_CLIENT_CN=openjev-gateway PREFIX_AFFINITY=0 LOCAL_ADDRESS=127.0.0.1
HASH_BALANCE_FACTOR=150
BENCH_TIMER="" BENCH_ARGS="" BENCH_PYTHON_ARG=""

need_value() {
    if (($2 < 2)) || [[ -z $3 || $3 == --* ]]; then usage_error "$1 needs a value"; fi
}

while (($#)); do
    case $1 in
        -h | --help) usage; exit 0 ;;
        --root) need_value "$1" $# "${2:-}"; ROOT_ARG=$2; shift ;;
        --bundle) need_value "$1" $# "${2:-}"; BUNDLE_ARG=$2; shift ;;
        --model) need_value "$1" $# "${2:-}"; MODEL_ARG=$2; shift ;;
        --user) need_value "$1" $# "${2:-}"; USER_ARG=$2; shift ;;
        --gpus) need_value "$1" $# "${2:-}"; GPUS_ARG=$2; shift ;;
        --port) need_value "$1" $# "${2:-}"; PORT=$2; shift ;;
        --replica-port-base) need_value "$1" $# "${2:-}"; REPLICA_BASE=$2; shift ;;
        --stats-port) need_value "$1" $# "${2:-}"; STATS_PORT=$2; shift ;;
        --backend) need_value "$1" $# "${2:-}"; BACKEND=$2; shift ;;
        --env) need_value "$1" $# "${2:-}"; EXTRA_ENV+=("$2"); shift ;;
        --haproxy) need_value "$1" $# "${2:-}"; HAPROXY_ARG=$2; shift ;;
        --system) SYSTEM=1 ;;
        --unit-dir) need_value "$1" $# "${2:-}"; UNIT_DIR_ARG=$2; shift ;;
        --conf-dir) need_value "$1" $# "${2:-}"; CONF_DIR_ARG=$2; shift ;;
        --force) FORCE=1 ;;
        --dry-run) DRY_RUN=1 ;;
        --no-verify) VERIFY=0 ;;
        --remote) need_value "$1" $# "${2:-}"; REMOTES+=("$2"); shift ;;
        --peer-listen) need_value "$1" $# "${2:-}"; PEER_LISTEN=$2; shift ;;
        --tls-dir) need_value "$1" $# "${2:-}"; TLS_DIR_ARG=$2; shift ;;
        --peer-client-cn) need_value "$1" $# "${2:-}"; PEER_CLIENT_CN=$2; shift ;;
        --prefix-affinity) need_value "$1" $# "${2:-}"; PREFIX_AFFINITY=$2; shift ;;
        --hash-balance-factor) need_value "$1" $# "${2:-}"; HASH_BALANCE_FACTOR=$2; shift ;;
        --local-address) need_value "$1" $# "${2:-}"; LOCAL_ADDRESS=$2; shift ;;
        --bench-timer) need_value "$1" $# "${2:-}"; BENCH_TIMER=$2; shift ;;
        --bench-args) (($# >= 2)) && [[ -n $2 ]] || usage_error "--bench-args needs a value"; BENCH_ARGS=$2; shift ;;
        --bench-python) need_value "$1" $# "${2:-}"; BENCH_PYTHON_ARG=$2; shift ;;
        *) usage_error "unknown argument '$1'" ;;
    esac
    shift
done

# ------------------------------------------------------------------ settings
check_port --port "$PORT"
check_port --stats-port "$STATS_PORT"
check_port --replica-port-base "$REPLICA_BASE"
PORT=$((10#$PORT)) STATS_PORT=$((10#$STATS_PORT)) REPLICA_BASE=$((10#$REPLICA_BASE))
case $BACKEND in sglang | transformers) ;; *) usage_error "--backend must be sglang or transformers, got '$BACKEND'" ;; esac

[[ $GPUS_ARG =~ ^[0-9]+(,[0-9]+)*$ ]] || usage_error "--gpus must be comma-separated GPU indices such as 0,1, got '$GPUS_ARG'"
IFS=, read -r -a GPUS <<<"$GPUS_ARG"
declare -A SEEN_PORT=(["$PORT"]=--port)
[[ -z ${SEEN_PORT[$STATS_PORT]:-} ]] || usage_error "--stats-port $STATS_PORT is also the endpoint port"
SEEN_PORT[$STATS_PORT]=--stats-port
declare -A SEEN_GPU=()
for i in "${!GPUS[@]}"; do
    g=$((10#${GPUS[$i]}))
    GPUS[i]=$g
    [[ -z ${SEEN_GPU[$g]:-} ]] || usage_error "--gpus lists GPU $g twice"
    SEEN_GPU[$g]=1
    p=$((REPLICA_BASE + g))
    ((p <= 65535)) || usage_error "replica port $p for GPU $g is above 65535; lower --replica-port-base"
    [[ -z ${SEEN_PORT[$p]:-} ]] || usage_error "replica port $p (GPU $g) collides with ${SEEN_PORT[$p]}"
    SEEN_PORT[$p]="replica on GPU $g"
done

for kv in "${EXTRA_ENV[@]}"; do
    [[ $kv =~ ^[A-Za-z_][A-Za-z0-9_]*=[^\'\"\\$\`]*$ ]] ||
        usage_error "--env wants KEY=VALUE without quotes, backslashes, \$ or backticks, got '$kv'"
    case ${kv%%=*} in
        OPENJEV_MODEL | OPENJEV_REPLICA_PORT | OPENJEV_BACKEND | CUDA_VISIBLE_DEVICES | OPENJEV_V100_ROOT)
            usage_error "--env ${kv%%=*} is set by the installer itself (use --model, --gpus, --backend, --root)" ;;
    esac
done

if [[ -n $ROOT_ARG ]]; then ROOT=$ROOT_ARG
elif [[ -n ${OPENJEV_V100_ROOT:-} ]]; then ROOT=$OPENJEV_V100_ROOT
else
    [[ -n ${HOME:-} ]] || die "neither --root, OPENJEV_V100_ROOT nor HOME is set"
    ROOT=$HOME/storage/sglang-openjev-v100
fi
ROOT=$(abspath "$ROOT")
BUNDLE=$(abspath "${BUNDLE_ARG:-$(dirname -- "$SCRIPT_DIR")}")
MODEL=$(abspath "${MODEL_ARG:-$ROOT/model}")
CONF_DIR=$(abspath "${CONF_DIR_ARG:-$ROOT/gateway}")
if [[ -n $UNIT_DIR_ARG ]]; then UNIT_DIR=$(abspath "$UNIT_DIR_ARG")
elif ((SYSTEM)); then UNIT_DIR=/etc/systemd/system
else
    [[ -n ${HOME:-} ]] || die "HOME is not set; give --unit-dir"
    UNIT_DIR=${XDG_CONFIG_HOME:-$HOME/.config}/systemd/user
fi
for pair in "--root:$ROOT" "--bundle:$BUNDLE" "--model:$MODEL" "--conf-dir:$CONF_DIR" "--unit-dir:$UNIT_DIR"; do
    check_path "${pair%%:*}" "${pair#*:}"
done
# The admin socket path (RuntimeDirectory + name) must fit in sun_path; CONF_DIR paths do not matter.

# ------------------------------------------------------------------ several hosts
# is_ipv4, is_hostname, multihost_* (DEPLOYMENT-eva01.md §12)
# shellcheck disable=SC1091
source "$SCRIPT_DIR/install_units_multihost.sh"

multihost_settings

[[ -f $BUNDLE/app/serve_sglang_v100.sh ]] || die "no app/serve_sglang_v100.sh under --bundle $BUNDLE"
for t in "${TEMPLATE_UNITS[@]}"; do
    [[ -f $SCRIPT_DIR/systemd/$t ]] || die "template $SCRIPT_DIR/systemd/$t is missing"
done
[[ -f $TEMPLATE_HAPROXY ]] || die "template $TEMPLATE_HAPROXY is missing"
if [[ ! -d $MODEL ]]; then
    ((DRY_RUN)) || die "model directory $MODEL does not exist (make it with app/prepare_v100_model.py, or give --model)"
    printf '%s: warning: model directory %s does not exist yet\n' "$PROG" "$MODEL" >&2
fi

CURRENT_USER=$(id -un)
SERVICE_USER=${USER_ARG:-$CURRENT_USER}
id -u -- "$SERVICE_USER" >/dev/null 2>&1 || die "user '$SERVICE_USER' does not exist"
SERVICE_GROUP=$(id -gn -- "$SERVICE_USER")
if ((!SYSTEM)) && [[ $SERVICE_USER != "$CURRENT_USER" ]]; then
    die "user units run as the user whose systemd manager loads them ($CURRENT_USER), not '$SERVICE_USER'; run this as $SERVICE_USER or use --system"
fi

if [[ -n $HAPROXY_ARG ]]; then
    HAPROXY=$(command -v -- "$HAPROXY_ARG") || die "--haproxy '$HAPROXY_ARG' is not an executable"
elif HAPROXY=$(command -v haproxy); then :
elif [[ -x /usr/sbin/haproxy ]]; then HAPROXY=/usr/sbin/haproxy
elif ((DRY_RUN || !VERIFY)); then
    # Nothing runs haproxy here (dry run or --no-verify): render with Debian's path and say so.
    HAPROXY=/usr/sbin/haproxy
    printf '%s: warning: haproxy is not installed (apt-get install haproxy); rendering with %s\n' "$PROG" "$HAPROXY" >&2
else
    die "haproxy is not installed (Debian: apt-get install haproxy); install it, give --haproxy PATH, or render with --no-verify"
fi
HAPROXY=$(abspath "$HAPROXY")
check_path --haproxy "$HAPROXY"
HAPROXY_VERSION=unknown
if [[ -x $HAPROXY ]]; then
    HAPROXY_VERSION=$("$HAPROXY" -v 2>/dev/null | awk 'NR == 1 { print $3 }')
    [[ $HAPROXY_VERSION =~ ^([0-9]+)\.([0-9]+) ]] || die "cannot read the version of $HAPROXY"
    if ((BASH_REMATCH[1] < 2 || (BASH_REMATCH[1] == 2 && BASH_REMATCH[2] < 6))); then
        die "HAProxy $HAPROXY_VERSION is too old: the gateway configuration needs 2.6 or newer"
    fi
fi
multihost_check_tls

# ------------------------------------------------------------------ rendering
STAGE=$(mktemp -d "${TMPDIR:-/tmp}/openjev-units.XXXXXX")
cleanup() { rm -rf -- "$STAGE"; }
trap cleanup EXIT
mkdir -p "$STAGE/units" "$STAGE/conf"

SERVERS="" REPLICA_UNITS=""
for g in "${GPUS[@]}"; do
    SERVERS+="${SERVERS:+$'\n'}    server replica$g $LOCAL_ADDRESS:$((REPLICA_BASE + g))"
    REPLICA_UNITS+="${REPLICA_UNITS:+ }openjev-replica@$g.service"
done
multihost_render_vars

# Every R_NAME below replaces @NAME@; values go through the environment, never through a regex.
render() {
    R_ROOT=$ROOT R_BUNDLE=$BUNDLE R_MODEL=$MODEL R_USER=$SERVICE_USER R_GROUP=$SERVICE_GROUP \
        R_HAPROXY=$HAPROXY R_HAPROXY_VERSION=$HAPROXY_VERSION R_CONF_DIR=$CONF_DIR R_PORT=$PORT \
        R_STATS_PORT=$STATS_PORT R_GPUS=$(IFS=,; echo "${GPUS[*]}") R_REPLICA_UNITS=$REPLICA_UNITS \
        R_SERVERS=$SERVERS R_WANTED_BY=$( ((SYSTEM)) && echo multi-user.target || echo default.target) \
        awk -v sysmode="$SYSTEM" '
        function replace_all(s, key, value,   i, out) {
            out = ""
            while ((i = index(s, key)) > 0) { out = out substr(s, 1, i - 1) value; s = substr(s, i + length(key)) }
            return out s
        }
        BEGIN { for (e in ENVIRON) if (e ~ /^R_[A-Z_]+$/) map["@" substr(e, 3) "@"] = ENVIRON[e] }
        {
            line = $0
            if (substr(line, 1, 9) == "#@system@") { if (!sysmode) next; line = substr(line, 10) }
            for (k in map) line = replace_all(line, k, map[k])
            print line
        }' "$1" >"$2"
    # A placeholder left over is a template bug, never something to install.
    if grep -nE '@[A-Z][A-Z_]*@' "$2" | grep -v '^[0-9]*:#' >/dev/null; then
        die "unfilled placeholder in $(basename -- "$1"): $(grep -nE '@[A-Z][A-Z_]*@' "$2" | grep -v '^[0-9]*:#' | head -1)"
    fi
}

header() {  # first line of every rendered file
    printf '# Rendered by deploy/install_units.sh on %s from %s; edit the template and re-run.\n' \
        "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$1"
}

for t in "${TEMPLATE_UNITS[@]}"; do
    { header "deploy/systemd/$t"; cat -- "$SCRIPT_DIR/systemd/$t"; } >"$STAGE/tmpl"
    render "$STAGE/tmpl" "$STAGE/units/$t"
done
{ header deploy/haproxy/openjev-gateway.cfg; cat -- "$TEMPLATE_HAPROXY"; } >"$STAGE/tmpl"
render "$STAGE/tmpl" "$STAGE/conf/haproxy.cfg"
multihost_render_peer
for g in "${GPUS[@]}"; do
    {
        printf '# Rendered by deploy/install_units.sh: environment of openjev-replica@%s.service (GPU %s).\n' "$g" "$g"
        printf '# Edit here to change this replica only (e.g. roll a new model), then restart it.\n'
        printf 'OPENJEV_MODEL=%s\n' "$MODEL"
        printf '# Must match "server replica%s" in haproxy.cfg.\n' "$g"
        printf 'OPENJEV_REPLICA_PORT=%s\n' "$((REPLICA_BASE + g))"
        printf 'OPENJEV_BACKEND=%s\n' "$BACKEND"
        printf '# Extra launcher flags, split at spaces (e.g. --disable-radix-cache).\n'
        printf 'OPENJEV_REPLICA_ARGS=%s\n' "$REPLICA_HOST_ARGS"
        printf '# Launcher settings (defaults in app/serve_sglang_v100.sh --help), e.g.\n'
        printf '# MAX_RUNNING_REQUESTS=16\n# SCHEDULE_POLICY=lpm\n'
        for kv in "${EXTRA_ENV[@]}"; do printf '%s\n' "$kv"; done
    } >"$STAGE/conf/replica-$g.env"
done

# One ExecStart= word: % and $ escaped, quoted when it holds a space, quote or backslash.
systemd_word() {
    local w=${1//%/%%}
    w=${w//\$/\$\$}
    if [[ $w =~ [[:space:]\"\'\\] ]]; then
        w=${w//\\/\\\\}
        w=${w//\"/\\\"}
        w="\"$w\""
    fi
    printf '%s' "$w"
}

# --bench-args split as a shell would (quotes keep spaces) into BENCH_WORDS, then checked by the
# bench's own parser and input checks (--check-only), from the directory the unit will run in.
check_bench_args() {
    [[ -x $BENCH_PYTHON ]] || die "--bench-python $BENCH_PYTHON is not an executable Python (the runtime venv's)"
    local out
    # shellcheck disable=SC2016
    out=$("$BENCH_PYTHON" -c 'import shlex, sys
try:
    print("\n".join(shlex.split(sys.argv[1])))
except ValueError as exc:
    sys.exit(f"error: {exc}")' "$BENCH_ARGS" 2>&1) || die "--bench-args: cannot split ${BENCH_ARGS@Q}: ${out#error: }"
    mapfile -t BENCH_WORDS <<<"$out"
    local dir=$ROOT
    [[ -d $dir ]] || dir=/
    out=$(cd "$dir" && OPENJEV_V100_ROOT=$ROOT OPENJEV_BACKEND=$BACKEND PYTHONPATH=$BUNDLE \
        "$BENCH_PYTHON" "$BUNDLE/app/bench_scheduled_v100.py" --check-only --checkpoint "$MODEL" \
        "${BENCH_WORDS[@]}" 2>&1) || {
        out=$(grep ': error: ' <<<"$out" | tail -n 1)
        die "--bench-args: the bench refuses them: ${out#*: error: }"
    }
}

# Opt-in scheduled benchmark: a oneshot service and its timer.
BENCH_UNITS=()
if [[ -n $BENCH_TIMER ]]; then
    [[ -n $BENCH_ARGS ]] || usage_error "--bench-timer needs --bench-args (--history DIR --gpu N --port P --set ...)"
    [[ $BENCH_TIMER != *$'\n'* && $BENCH_ARGS != *$'\n'* ]] || usage_error "--bench-timer / --bench-args: one line"
    BENCH_PYTHON=${BENCH_PYTHON_ARG:-$ROOT/venv/bin/python}
    check_bench_args
    {
        header "install_units.sh --bench-timer"
        printf '[Unit]\nDescription=OpenJEV scheduled benchmark (development server, never the production port)\n'
        printf 'Documentation=file:%s/V100.md\n\n[Service]\nType=oneshot\n' "$BUNDLE"
        ((SYSTEM)) && printf 'User=%s\nGroup=%s\n' "$SERVICE_USER" "$SERVICE_GROUP"
        printf 'Environment=OPENJEV_V100_ROOT=%s\nEnvironment=OPENJEV_BACKEND=%s\nWorkingDirectory=%s\n' \
            "$ROOT" "$BACKEND" "$ROOT"
        printf '# Exit 3 = regression, 1 = failure, 75 = another run holds the lock: the unit then shows failed.\n'
        printf 'Environment=PYTHONPATH=%s\n' "$BUNDLE"
        line=ExecStart=
        for word in "$BENCH_PYTHON" "$BUNDLE/app/bench_scheduled_v100.py" --checkpoint "$MODEL" "${BENCH_WORDS[@]}"; do
            line+="$(systemd_word "$word") "
        done
        printf '%s\n' "${line% }"
        printf 'TimeoutStartSec=6h\nSyslogIdentifier=openjev-bench\n'
    } >"$STAGE/units/openjev-bench.service"
    {
        header "install_units.sh --bench-timer"
        printf '[Unit]\nDescription=OpenJEV scheduled benchmark timer\n\n[Timer]\nOnCalendar=%s\n' "$BENCH_TIMER"
        printf 'Persistent=true\nRandomizedDelaySec=10min\nUnit=openjev-bench.service\n\n[Install]\nWantedBy=timers.target\n'
    } >"$STAGE/units/openjev-bench.timer"
    BENCH_UNITS=(openjev-bench.service openjev-bench.timer)
fi

# Destination of every staged file.
declare -A DEST=()
for t in "${BENCH_UNITS[@]}"; do DEST["units/$t"]=$UNIT_DIR/$t; done
for t in "${TEMPLATE_UNITS[@]}"; do DEST["units/$t"]=$UNIT_DIR/$t; done
DEST[conf/haproxy.cfg]=$CONF_DIR/haproxy.cfg
for g in "${GPUS[@]}"; do DEST["conf/replica-$g.env"]=$CONF_DIR/replica-$g.env; done
ORDER=()
for t in "${TEMPLATE_UNITS[@]}"; do ORDER+=("units/$t"); done
for t in "${BENCH_UNITS[@]}"; do ORDER+=("units/$t"); done
ORDER+=(conf/haproxy.cfg)
for g in "${GPUS[@]}"; do ORDER+=("conf/replica-$g.env"); done

# Rendered files carry a timestamp in their first line; compare the rest.
same_content() { [[ -f $2 ]] && cmp -s <(tail -n +2 -- "$1") <(tail -n +2 -- "$2"); }

if ((DRY_RUN)); then
    for f in "${ORDER[@]}"; do
        printf '### %s\n' "${DEST[$f]}"
        cat -- "$STAGE/$f"
        printf '\n'
    done
fi

# ------------------------------------------------------------------ checks
verify_units() {
    local analyze mode=() runtime="" out rc=0 g
    analyze=$(command -v systemd-analyze) ||
        die "systemd-analyze not found (Debian: apt-get install systemd), or pass --no-verify"
    # Instances to check: the template alone cannot be verified, each openjev-replica@G can.
    mkdir -p "$STAGE/verify"
    cp -- "$STAGE"/units/* "$STAGE/verify/"
    local files=("$STAGE/verify/openjev-gateway.socket" "$STAGE/verify/openjev-gateway.service" "$STAGE/verify/openjev.target")
    for g in "${GPUS[@]}"; do
        cp -- "$STAGE/units/openjev-replica@.service" "$STAGE/verify/openjev-replica@$g.service"
        files+=("$STAGE/verify/openjev-replica@$g.service")
    done
    for g in "${BENCH_UNITS[@]}"; do files+=("$STAGE/verify/$g"); done
    if ((!SYSTEM)); then
        mode=(--user)
        if [[ -z ${XDG_RUNTIME_DIR:-} || ! -d ${XDG_RUNTIME_DIR:-/nonexistent} ]]; then
            runtime=$STAGE/xdg-runtime
            mkdir -m 700 "$runtime"
        fi
    fi
    out=$(cd "$STAGE/verify" && ${runtime:+env XDG_RUNTIME_DIR="$runtime"} "$analyze" "${mode[@]}" verify "${files[@]}" 2>&1) || rc=$?
    # Warnings (unknown keys, bad values) do not change the exit status: treat them as failures too.
    out=$(printf '%s\n' "$out" | grep -v '^$' || true)
    if ((rc != 0)) || [[ -n $out ]]; then
        die "systemd-analyze ${mode[*]:+${mode[*]} }verify failed: $(printf '%s' "$out" | tr '\n' ' ' | cut -c1-600)"
    fi
    printf 'checked: systemd-analyze %sverify passed for %s\n' "${mode[*]:+${mode[*]} }" \
        "$(for f in "${files[@]}"; do basename -- "$f"; done | tr '\n' ' ')"
}

verify_haproxy() {
    local py out rc=0
    [[ -x $HAPROXY ]] || die "cannot check haproxy.cfg: $HAPROXY is not installed (apt-get install haproxy), or pass --no-verify"
    py=$(command -v python3) || die "cannot check haproxy.cfg: python3 (for the stand-in socket on fd 3) is not on PATH, or pass --no-verify"
    # haproxy -c checks that fd 3 is a socket, as systemd will pass it: give it a bound one.
    out=$("$py" -c '
import os, socket, sys
s = socket.socket()
s.bind(("127.0.0.1", 0))
if s.fileno() != 3:
    os.dup2(s.fileno(), 3)
os.set_inheritable(3, True)
os.environ.update(LISTEN_FDS="1", OPENJEV_GATEWAY_ADMIN=sys.argv[1])
os.execv(sys.argv[2], sys.argv[2:])
' "$STAGE/admin.sock" "$HAPROXY" -c -q -f "$STAGE/conf/haproxy.cfg" 2>&1) || rc=$?
    ((rc == 0)) || die "haproxy -c rejected the rendered haproxy.cfg: $(printf '%s' "$out" | grep -v NOTICE | tr '\n' ' ' | cut -c1-600)"
    [[ -z $out ]] || die "haproxy -c warns about the rendered haproxy.cfg: $(printf '%s' "$out" | tr '\n' ' ' | cut -c1-600)"
    printf 'checked: haproxy -c (HAProxy %s) accepts haproxy.cfg\n' "$HAPROXY_VERSION"
}

if ((VERIFY)); then
    verify_units
    verify_haproxy
else
    printf '%s: warning: --no-verify: units and haproxy.cfg were not checked\n' "$PROG" >&2
fi

if ((DRY_RUN)); then
    [[ -d $ROOT ]] || printf 'dry run: would create the missing --root %s\n' "$ROOT"
    printf 'dry run: nothing written\n'
    exit 0
fi

# ------------------------------------------------------------------ install
CHANGED=()
for f in "${ORDER[@]}"; do
    d=${DEST[$f]}
    if [[ -e $d ]] && ! same_content "$STAGE/$f" "$d"; then CHANGED+=("$d"); fi
done
if ((${#CHANGED[@]})) && ((!FORCE)); then
    die "refusing to overwrite ${#CHANGED[@]} existing file(s) that differ: ${CHANGED[*]} (re-run with --force to replace them)"
fi

# The root is the replicas' WorkingDirectory= and holds their JIT caches: a missing one is created
# (owned by the service user), or the replicas would fail to start with 200/CHDIR.
if [[ ! -d $ROOT ]]; then
    [[ ! -e $ROOT ]] || die "--root $ROOT exists and is not a directory"
    # Parents with the umask's mode, the root itself 0755 (what `mkdir -p -m 0755` does, spelled out).
    { mkdir -p -- "$(dirname -- "$ROOT")" && mkdir -m 0755 -- "$ROOT"; } 2>/dev/null || die "cannot create --root $ROOT (permission denied or read-only parent)"
    if [[ $SERVICE_USER != "$CURRENT_USER" ]]; then
        chown -- "$SERVICE_USER:$SERVICE_GROUP" "$ROOT" || die "created --root $ROOT but cannot give it to $SERVICE_USER"
    fi
    printf 'created: %s (--root)\n' "$ROOT"
fi
mkdir -p -- "$UNIT_DIR" "$CONF_DIR" || die "cannot create $UNIT_DIR or $CONF_DIR"
for f in "${ORDER[@]}"; do
    d=${DEST[$f]}
    if same_content "$STAGE/$f" "$d"; then
        printf 'unchanged: %s\n' "$d"
        continue
    fi
    verb=installed
    [[ -e $d ]] && verb=replaced
    tmp=$(mktemp "$(dirname -- "$d")/.$(basename -- "$d").XXXXXX") || die "cannot write in $(dirname -- "$d")"
    cat -- "$STAGE/$f" >"$tmp"
    chmod 0644 -- "$tmp"
    mv -f -- "$tmp" "$d" || die "cannot install $d"
    printf '%s: %s\n' "$verb" "$d"
done

# ------------------------------------------------------------------ next steps
if ((SYSTEM)); then
    SC="sudo systemctl"
else
    SC="systemctl --user"
fi
cat <<EOF

Next steps (nothing was started):
  $SC daemon-reload
  $SC enable openjev.target openjev-gateway.socket
  $SC start openjev.target
$( ((SYSTEM)) || printf '  loginctl enable-linger %s   # user units keep running without a login session and start at boot\n' "$SERVICE_USER")
Check:
  $SC status openjev.target openjev-gateway.socket openjev-gateway.service $REPLICA_UNITS
  curl -s http://127.0.0.1:$STATS_PORT/stats\;csv | cut -d, -f1,2,18 ; curl -s http://127.0.0.1:$PORT/health
EOF
multihost_next_steps
