# shellcheck shell=bash
# install_units.sh for several hosts (--remote / --peer-listen): sourced by it, reads and sets its
# variables; never run alone.

# A front gateway (--remote) or a peer listener (--peer-listen), mutual TLS between them; every
# function below is only about that (DEPLOYMENT-eva01.md §12).
is_ipv4() {
    local o
    [[ $1 =~ ^([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})$ ]] || return 1
    for o in "${BASH_REMATCH[@]:1}"; do ((10#$o <= 255)) || return 1; done
}

is_hostname() {
    [[ $1 =~ ^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$ ]]
}

# Validate the multi-host options; sets TLS_DIR, REMOTE_SERVERS, PEER_ADDR, PEER_PORT, REPLICA_HOST_ARGS.
multihost_settings() {
    local spec name hostport host port
    is_ipv4 "$LOCAL_ADDRESS" && [[ $LOCAL_ADDRESS == 127.* ]] ||
        usage_error "--local-address must be an IPv4 address in 127.0.0.0/8 (replicas, endpoint and stats stay on loopback), got '$LOCAL_ADDRESS'"
    REPLICA_HOST_ARGS=""
    [[ $LOCAL_ADDRESS == 127.0.0.1 ]] || REPLICA_HOST_ARGS="--host $LOCAL_ADDRESS"
    { [[ $PREFIX_AFFINITY =~ ^[0-9]{1,4}$ ]] && ((10#$PREFIX_AFFINITY <= 8192)); } ||
        usage_error "--prefix-affinity must be a number of tokens from 0 (off) to 8192, got '$PREFIX_AFFINITY'"
    PREFIX_AFFINITY=$((10#$PREFIX_AFFINITY))
    { [[ $HASH_BALANCE_FACTOR =~ ^[0-9]{1,5}$ ]] && { ((10#$HASH_BALANCE_FACTOR == 0)) || ((10#$HASH_BALANCE_FACTOR > 100)); }; } ||
        usage_error "--hash-balance-factor must be 0 (no bound) or a percentage above 100, got '$HASH_BALANCE_FACTOR'"
    HASH_BALANCE_FACTOR=$((10#$HASH_BALANCE_FACTOR))
    is_hostname "$PEER_CLIENT_CN" || usage_error "--peer-client-cn must be a plain name (letters, digits, '.', '-'), got '$PEER_CLIENT_CN'"
    if ((${#REMOTES[@]})) && [[ -n $PEER_LISTEN ]]; then
        usage_error "--remote and --peer-listen exclude each other: a peer listener forwards to its own replicas only"
    fi
    TLS_DIR=$(abspath "${TLS_DIR_ARG:-$ROOT/tls}")
    check_path --tls-dir "$TLS_DIR"
    REMOTE_SERVERS=""
    local -A seen=()
    for spec in "${REMOTES[@]}"; do
        name="" hostport=$spec
        if [[ $spec == *=* ]]; then name=${spec%%=*} hostport=${spec#*=}; fi
        [[ $hostport =~ ^([A-Za-z0-9.-]+):([0-9]+)$ ]] || usage_error "--remote wants [NAME=]HOST:PORT, got '$spec'"
        host=${BASH_REMATCH[1]} port=${BASH_REMATCH[2]}
        check_port "--remote $spec: PORT" "$port"
        if [[ -z $name ]]; then
            ! is_ipv4 "$host" || usage_error "--remote $spec: HOST is an IP address; name the host its certificate names: --remote NAME=$hostport"
            name=$host
        fi
        { is_hostname "$name" && ! is_ipv4 "$name"; } || usage_error "--remote $spec: NAME '$name' must be the DNS name in the peer's certificate"
        [[ -z ${seen[$name]:-} ]] || usage_error "--remote names $name twice"
        seen[$name]=1
        # ssl + verify required: the peer must show a certificate of our CA naming NAME (verifyhost);
        # crt: our client certificate, which the peer listener requires. Checks inherit the TLS settings.
        # init-addr last,libc,none: a peer whose name does not resolve at start-up stays out of
        # rotation instead of stopping the whole gateway (re-resolved on the next reload).
        # observe layer4 ...: 10 failed connections in a row in live traffic take a peer out at
        # once, without waiting for 3 failed checks (each failure is retried elsewhere anyway).
        REMOTE_SERVERS+=$'\n'"    server peer-$name $host:$((10#$port)) ssl verify required ca-file $TLS_DIR/ca.crt crt $TLS_DIR/gateway-client.pem verifyhost $name sni str($name) ssl-min-ver TLSv1.2 alpn http/1.1 init-addr last,libc,none observe layer4 error-limit 10 on-error mark-down"
    done
    PEER_ADDR="" PEER_PORT=""
    if [[ -n $PEER_LISTEN ]]; then
        { [[ $PEER_LISTEN =~ ^([0-9.]+):([0-9]+)$ ]] && PEER_ADDR=${BASH_REMATCH[1]} PEER_PORT=${BASH_REMATCH[2]} &&
            is_ipv4 "$PEER_ADDR"; } || usage_error "--peer-listen wants ADDR:PORT with an IPv4 address of this host, got '$PEER_LISTEN'"
        check_port "--peer-listen PORT" "$PEER_PORT"
        PEER_PORT=$((10#$PEER_PORT))
        if [[ $PEER_ADDR == "$LOCAL_ADDRESS" || $PEER_ADDR == 0.0.0.0 ]] && [[ -n ${SEEN_PORT[$PEER_PORT]:-} ]]; then
            usage_error "--peer-listen port $PEER_PORT collides with ${SEEN_PORT[$PEER_PORT]}"
        fi
    fi
}

# The certificate files the rendered configuration names must exist (haproxy -c loads them) and
# private keys must not be readable by others.
multihost_check_tls() {
    local f mode need=()
    ((${#REMOTES[@]})) && need=(ca.crt gateway-client.pem)
    [[ -n $PEER_LISTEN ]] && need=(ca.crt peer.pem)
    for f in "${need[@]}"; do
        if [[ ! -r $TLS_DIR/$f ]]; then
            if ((DRY_RUN && !VERIFY)); then
                printf '%s: warning: %s does not exist yet\n' "$PROG" "$TLS_DIR/$f" >&2
                continue
            fi
            die "$TLS_DIR/$f is missing (make it with deploy/openjev_certs.sh, DEPLOYMENT-eva01.md §12, or give --tls-dir)"
        fi
        if [[ $f == *.pem ]]; then
            mode=$(stat -L -c %a -- "$TLS_DIR/$f")  # -L: a symlink's target is what HAProxy reads
            (((8#$mode & 8#077) == 0)) || die "$(readlink -f -- "$TLS_DIR/$f") ($TLS_DIR/$f) holds a private key but has mode $mode: chmod 600 it"
            multihost_check_certificate "$TLS_DIR/$f"
        fi
    done
    [[ ! -e $TLS_DIR/ca.key ]] || die "$TLS_DIR/ca.key: the CA's private key is in the serving TLS directory; keep it on the machine that signs certificates (move it away)"
}

# A certificate in a .pem the configuration names: valid now and signed by TLS_DIR/ca.crt.
multihost_check_certificate() {
    local pem=$1 out
    command -v openssl >/dev/null || return 0  # haproxy -c still loads the files
    [[ -r $TLS_DIR/ca.crt ]] || return 0
    out=$(openssl x509 -in "$pem" -noout -checkend 0 2>&1) ||
        die "$pem: its certificate has expired ($(openssl x509 -in "$pem" -noout -enddate 2>/dev/null || echo unreadable)); make a new one with deploy/openjev_certs.sh"
    out=$(openssl verify -CAfile "$TLS_DIR/ca.crt" "$pem" 2>&1) ||
        die "$pem: its certificate does not chain to $TLS_DIR/ca.crt (another CA, or not yet valid): ${out##*$'\n'}"
}

# Placeholders of the multi-host parts (render() maps every exported R_* variable).
multihost_render_vars() {
    SERVERS+=$REMOTE_SERVERS
    export R_LOCAL_ADDRESS=$LOCAL_ADDRESS R_TLS_DIR=$TLS_DIR R_PEER_CLIENT_CN=$PEER_CLIENT_CN \
        R_PEER_ADDR=$PEER_ADDR R_PEER_PORT=$PEER_PORT
    local lines
    if ((PREFIX_AFFINITY == 0)); then
        lines="    balance leastconn"
    else
        # The key: the first N ids of the first row of {"input_ids": [[...], ...]} or [...] (also
        # "input"), whitespace removed; a body without ids hashes whole. '.' stands for the quotes,
        # [,] avoids a bare comma and there is no '$' (HAProxy would expand it) in the expression.
        local rx='(?s)^.*?.input(?:_ids)?.[[:space:]]*:[[:space:]]*[[][[:space:]]*[[]?[[:space:]]*((?:[0-9]+[[:space:]]*[,][[:space:]]*){0,'$((PREFIX_AFFINITY - 1))'}[0-9]+).*'
        lines="    # --prefix-affinity $PREFIX_AFFINITY: requests whose first row starts with the same $PREFIX_AFFINITY ids go to
    # the same server (consistent hash: a server leaving moves only its own keys).
    http-request set-var(txn.openjev_prefix) \"req.body,regsub('$rx','\\\\1'),regsub('[[:space:]]+','','g')\"
    balance hash var(txn.openjev_prefix)
    hash-type consistent"
        if ((HASH_BALANCE_FACTOR)); then
            lines+="
    # Bounded load: a server holding more than $HASH_BALANCE_FACTOR% of the average is skipped for the
    # next one on the ring, so a hot prefix cannot pile up on one replica (--hash-balance-factor).
    hash-balance-factor $HASH_BALANCE_FACTOR"
        fi
    fi
    if ((${#REMOTES[@]})); then
        # Front gateway: keep server connections open and reuse them (a peer listener is HAProxy,
        # which sets TCP_NODELAY; the embedded backend does too). A new connection per request
        # would cost a TLS handshake per request on both hosts (benchmarks/bench_multihost.py).
        # A reused connection that turns out closed is retried like any failed connection.
        lines+="
    # Front gateway (--remote): server connections stay open between requests and are shared
    # (a TLS handshake per request to a peer costs more than the hop itself; /classify is safe
    # to send on any open connection, and one found closed is retried, see retry-on).
    no option http-server-close
    option http-keep-alive
    http-reuse always"
        # The connection mode is the stronger of frontend and backend: the frontend must not
        # carry http-server-close (from defaults) either.
        export R_FRONTEND_MODE="    # Front gateway (--remote): no http-server-close here either, or it would win over the
    # backend's keep-alive (HAProxy applies the stronger mode of frontend and backend).
    no option http-server-close"
    else
        export R_FRONTEND_MODE="    # Connections to replicas: one per request (option http-server-close in defaults)."
    fi
    export R_BALANCE=$lines
}

# After installing: what the other hosts need to know.
multihost_next_steps() {
    if [[ -n $PEER_LISTEN ]]; then
        printf '\nPeer listener: %s:%s, mutual TLS (shows %s, accepts client CN=%s of %s).\n' \
            "$PEER_ADDR" "$PEER_PORT" "$TLS_DIR/peer.pem" "$PEER_CLIENT_CN" "$TLS_DIR/ca.crt"
        printf 'On the front host: install_units.sh ... --remote NAME=%s:%s (NAME: the DNS name in peer.pem)\n' \
            "$PEER_ADDR" "$PEER_PORT"
    fi
    if ((${#REMOTES[@]})); then
        printf '\nRemote hosts over mutual TLS: %s\n' "${REMOTES[*]}"
        printf 'Check: curl -s http://%s:%s/stats\\;csv | awk -F, '"'"'$2 ~ /^peer-/ {print $2, $18, $37}'"'"'\n' \
            "$LOCAL_ADDRESS" "$STATS_PORT"
    fi
    return 0
}

# The peer listener: the frontend of deploy/haproxy/openjev-peer.cfg appended to haproxy.cfg.
multihost_render_peer() {
    [[ -n $PEER_LISTEN ]] || return 0
    [[ -f $SCRIPT_DIR/haproxy/openjev-peer.cfg ]] || die "template $SCRIPT_DIR/haproxy/openjev-peer.cfg is missing"
    { printf '\n'; cat -- "$SCRIPT_DIR/haproxy/openjev-peer.cfg"; } >"$STAGE/tmpl"
    render "$STAGE/tmpl" "$STAGE/peer.cfg"
    cat -- "$STAGE/peer.cfg" >>"$STAGE/conf/haproxy.cfg"
}
