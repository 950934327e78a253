#!/usr/bin/env bash
# hosts.sh: make N test "hosts" on this machine, to try multi-node jobs without a cluster.
#
#   tools/hosts.sh up N              make hosts node0 .. node(N-1) (idempotent; removes extra ones)
#   tools/hosts.sh down              remove the hosts, their bridge and their /etc/hosts entries
#   tools/hosts.sh status            list the hosts; exit 0 only if all are complete
#   tools/hosts.sh exec NAME CMD...  run CMD on host NAME (its network, hostname and /etc/hosts)
#   tools/hosts.sh shape RATE|off    limit what each host sends to RATE (e.g. 100mbit, 1gbit)
#
# Hosts are network and UTS namespaces on a bridge (docs/slurm-and-multinode.md); HOSTS_PREFIX and
# HOSTS_NET (default node, 10.213.7) make another set beside it. Needs root and iproute2.
set -euo pipefail

PROG=${0##*/}
PREFIX=${HOSTS_PREFIX:-node}
NET=${HOSTS_NET:-10.213.7}
GATEWAY=$NET.254
STATE=/run/test-hosts        # UTS namespace files, one per host, of every prefix
# The default set keeps the names it always had; another prefix gets its own bridge and its own
# mark on this machine's /etc/hosts lines, so that neither set's up or down touches the other
BRIDGE=br-$PREFIX
MARK="# tools/hosts.sh $PREFIX"
if [[ $PREFIX == node ]]; then
    BRIDGE=hostsbr0
    MARK="# tools/hosts.sh"
fi

usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0" >&2; }
log() { echo "$PROG: $*" >&2; }
die() { echo "$PROG: error: $*" >&2; exit 1; }

# Our hosts, from the UTS files (the one record that survives a half-finished 'up'): those of
# this prefix only (PREFIX and a number; node0 is not a host of the prefix nod)
existing_hosts() {
    local f
    for f in "$STATE/$PREFIX"*.uts; do
        f=$(basename "$f" .uts)
        [[ ${f#"$PREFIX"} =~ ^[0-9]+$ ]] && echo "$f"
    done
    return 0
}

hosts_block() {
    local i
    for ((i = 0; i < $1; i++)); do
        echo "$NET.$((i + 1)) $PREFIX$i $MARK"
    done
}

# Rewrite /etc/hosts in place (in containers it is often a bind mount that cannot be replaced),
# from what was read before: only the lines that end in this prefix's mark are ours.
set_etc_hosts() {
    local kept
    kept=$(awk -v m=" $MARK" 'length($0) < length(m) || substr($0, length($0) - length(m) + 1) != m' /etc/hosts)
    printf '%s\n%s\n' "$kept" "$1" | sed '/^$/d' >/etc/hosts
}

make_host() {
    local name=$PREFIX$1 n=$2
    ((${#name} <= 10)) || die "interface name veth-$name is too long: use a shorter HOSTS_PREFIX"
    ip netns list | grep -qw "^$name" || ip netns add "$name"
    if ! ip link show "veth-$name" >/dev/null 2>&1; then
        ip netns exec "$name" ip link del eth0 2>/dev/null || true
        ip link add "veth-$name" type veth peer name eth0 netns "$name"
    fi
    ip link set "veth-$name" master "$BRIDGE" up
    ip -n "$name" link set lo up
    ip -n "$name" addr replace "$NET.$(($1 + 1))/24" dev eth0
    ip -n "$name" link set eth0 up
    # the names of all hosts, on every host; the host's own name resolves to its own address
    # (not to 127.0.1.1, which would make gloo pick the loopback interface)
    install -d -m 0755 "/etc/netns/$name" "$STATE"
    {
        echo "127.0.0.1 localhost"
        echo "$GATEWAY $(hostname -s) $MARK: this machine"
        hosts_block "$n"
    } >"/etc/netns/$name/hosts"
    if ! nsenter --uts="$STATE/$name.uts" true 2>/dev/null; then
        touch "$STATE/$name.uts"
        unshare --uts="$STATE/$name.uts" hostname "$name"
    fi
}

remove_host() {
    local name=$1 pids
    pids=$(ip netns pids "$name" 2>/dev/null || true)
    if [[ -n $pids ]]; then
        log "killing what still runs on $name: $(echo $pids)"
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null || true
    fi
    ip link del "veth-$name" 2>/dev/null || true
    ip netns del "$name" 2>/dev/null || true
    umount "$STATE/$name.uts" 2>/dev/null || true
    rm -rf "$STATE/$name.uts" "/etc/netns/$name"
}

cmd_up() {
    local n=${1:-} other i name
    [[ $n =~ ^[1-9][0-9]?$ ]] || die "up wants a host count from 1 to 99, got '$n'"
    # another route to our /24 (a real network) would make the hosts' traffic leave the machine
    other=$(ip -4 route show "$NET.0/24" | grep -v "dev $BRIDGE" || true)
    [[ -z $other ]] || die "$NET.0/24 is already routed here ($other): set HOSTS_NET to a free /24"
    ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
    ip addr replace "$GATEWAY/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for ((i = 0; i < n; i++)); do
        make_host "$i" "$n"
    done
    for name in $(existing_hosts); do  # hosts beyond N from an earlier 'up'
        ((10#${name#"$PREFIX"} < n)) || remove_host "$name"
    done
    set_etc_hosts "$(hosts_block "$n")"
    log "up: $(hosts_block "$n" | awk '{printf "%s%s %s", sep, $2, $1; sep=", "}'), bridge $BRIDGE $GATEWAY"
}

cmd_down() {
    local name
    for name in $(existing_hosts); do remove_host "$name"; done
    ip link del "$BRIDGE" 2>/dev/null || true
    set_etc_hosts ""
    log "down"
}

cmd_status() {
    local name ok=0 addr uts rate names
    names=$(existing_hosts)
    if [[ -z $names ]]; then
        echo "no hosts (tools/hosts.sh up N makes them)"
        return 1
    fi
    for name in $names; do
        addr=$(ip -n "$name" -4 -br addr show eth0 2>/dev/null | awk '{print $3}')
        uts=$(nsenter --uts="$STATE/$name.uts" hostname 2>/dev/null || echo '?')
        if [[ -n $addr && $uts == "$name" ]] && ip link show "veth-$name" 2>/dev/null | grep -q 'state UP'; then
            rate=$(ip netns exec "$name" tc qdisc show dev eth0 2>/dev/null | sed -n 's/.* tbf .*rate \([^ ]*\) .*/\1/p')
            echo "$name: ${addr%/*}, hostname $uts, link up${rate:+, sends at most $rate}"
        else
            echo "$name: incomplete or cut off (address '${addr}', hostname '$uts'; veth-$name down or missing)"
            ok=1
        fi
    done
    return $ok
}

# tc tbf on a host's eth0: what the host sends leaves at RATE at most, so with every host shaped
# each direction of every host-to-host path runs at RATE. The bucket holds 256 KiB or 2 ms of
# RATE, whichever is larger (a burst below one 64 KiB GSO packet, or below what the timer can
# refill between two wake-ups at high rates, would lower the rate achieved), and up to 50 ms of
# queue, after which packets drop and TCP slows down as on a congested link.
cmd_shape() {
    local rate=${1:-} name names bytes burst
    [[ $rate == off || $rate =~ ^[0-9]+(\.[0-9]+)?(kbit|mbit|gbit)$ ]] ||
        die "shape wants a rate such as 100mbit or 1gbit (kbit, mbit, gbit), or off; got '$rate'"
    names=$(existing_hosts)
    [[ -n $names ]] || die "no hosts of prefix $PREFIX (tools/hosts.sh up N makes them)"
    for name in $names; do
        ip netns exec "$name" tc qdisc del dev eth0 root 2>/dev/null || true
    done
    if [[ $rate == off ]]; then
        log "shape: $(echo $names | tr ' ' ','): unshaped"
        return
    fi
    bytes=$(awk -v r="$rate" 'BEGIN { n = r + 0; u = substr(r, length(r) - 3, 1);
                                       printf "%d", n * (u == "k" ? 1e3 : u == "m" ? 1e6 : 1e9) / 8 }')
    ((bytes >= 1000)) || die "shape: $rate is below 8kbit"
    burst=$((bytes / 500 > 262144 ? bytes / 500 : 262144))
    for name in $names; do
        ip netns exec "$name" tc qdisc add dev eth0 root tbf rate "$rate" burst "$burst" latency 50ms ||
            die "tc could not shape $name's eth0 to $rate (is the sch_tbf kernel module available?)"
    done
    log "shape: $(echo $names | tr ' ' ','): each sends at most $rate (tbf, burst $burst bytes, latency 50ms)"
}

cmd_exec() {
    local name=${1:-}
    [[ -n $name ]] && (($# >= 2)) || die "usage: $PROG exec NAME CMD..."
    shift
    [[ -e $STATE/$name.uts ]] || die "no host $name (hosts: $(existing_hosts | tr '\n' ' '))"
    # Like `ip netns exec`, which mounts /etc/netns/NAME/hosts over /etc/hosts in a mount
    # namespace of its own, but without its remount of /sys: that would hide this machine's
    # cgroup mounts, which slurmd needs.
    exec nsenter --net="/run/netns/$name" --uts="$STATE/$name.uts" -- \
        unshare --mount --propagation slave -- \
        sh -c 'mount --bind "$0" /etc/hosts && exec "$@"' "/etc/netns/$name/hosts" "$@"
}

case ${1:-} in
    up | down | status | exec | shape) ;;
    -h | --help) usage; exit 0 ;;
    *) usage; exit 2 ;;
esac
[[ $EUID -eq 0 ]] || die "must run as root (network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN)"
"cmd_$1" "${@:2}"
