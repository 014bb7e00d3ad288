#!/usr/bin/env bash
# A cluster of N nodes on this machine, for running weft across "machines" as users do: each node
# is a network namespace with its own loopback and one interface, eth0 (10.99.0.<i+1>/24), cabled
# to a bridge in a switch namespace of its own. Each node's link can be rate-limited in both
# directions (tc's tbf: on the node's eth0 and on its switch port). Nothing is added to the
# machine's own network namespace, and no traffic leaves the cluster's namespaces.
#
#   tools/cluster.sh check                  exit 0 where namespaces can be made here; otherwise exit 2
#                                           and print why on stdout (tests skip with that reason)
#   tools/cluster.sh up NAME N [RATE]       make NAME's N nodes (RATE as tc writes it: 1gbit,
#                                           100mbit; none: unlimited); removes NAME's old nodes
#                                           first; prints "node I NAMESPACE ADDRESS" per node
#   tools/cluster.sh down NAME              kill every process in NAME's namespaces, remove them
#   tools/cluster.sh exec NAME I CMD...     run CMD in node I
#   tools/cluster.sh link NAME I up|down    bring node I's cable (its switch port) up or down
#   tools/cluster.sh kill NAME I            kill every process in node I (SIGKILL), as a node dying
#   tools/cluster.sh rate NAME I RATE|none  change node I's rate
#   tools/cluster.sh bytes NAME I           bytes node I's eth0 has sent and received: "TX RX"
#
# NAME: 1-12 of [a-z0-9]; namespaces are NAME-n0 ... NAME-n(N-1) and NAME-sw. Needs root and
# iproute2 (ip, tc).
set -euo pipefail

die() { echo "cluster: $*" >&2; exit 1; }
node_ns() { echo "$1-n$2"; }
switch_ns() { echo "$1-sw"; }
address() { echo "10.99.0.$(($1 + 1))"; }
check_name() { [[ "$1" =~ ^[a-z0-9]{1,12}$ ]] || die "cluster name '$1' must be 1-12 of [a-z0-9]"; }
check_node() { [[ "$2" =~ ^[0-9]+$ ]] && ip netns list | grep -q "^$(node_ns "$1" "$2")\b" ||
                 die "cluster '$1' has no node '$2'"; }

# tbf on one device: RATE, a bucket of ~4 ms at that rate (at least 16 KiB), up to 100 ms queued.
limit() {  # NAMESPACE DEVICE RATE|none
  ip netns exec "$1" tc qdisc del dev "$2" root 2>/dev/null || true
  [[ "$3" == none ]] && return 0
  [[ "$3" =~ ^([0-9]+)(kbit|mbit|gbit)$ ]] || die "rate '$3' is not NUMBER followed by kbit, mbit or gbit"
  local scale=1000
  case "${BASH_REMATCH[2]}" in mbit) scale=1000000 ;; gbit) scale=1000000000 ;; esac
  local bytes_per_s=$((BASH_REMATCH[1] * scale / 8))
  local burst=$((bytes_per_s / 250))
  ((burst >= 16384)) || burst=16384
  ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "$3" burst "$burst" latency 100ms
}

down() {
  local ns
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^$1-(n[0-9]+|sw)$" || true); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
  done
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^$1-(n[0-9]+|sw)$" || true); do
    local tries=0
    while [[ -n "$(ip netns pids "$ns" 2>/dev/null)" ]] && ((tries++ < 50)); do sleep 0.1; done
    ip netns del "$ns"
  done
}

command=${1:-}
case "$command" in
  check)
    if [[ $(id -u) -ne 0 ]]; then echo "network namespaces need root (uid $(id -u))"; exit 2; fi
    for tool in ip tc; do
      command -v "$tool" >/dev/null || { echo "'$tool' (iproute2) is not installed"; exit 2; }
    done
    probe="weftprobe$$"
    if ! out=$(ip netns add "$probe" 2>&1); then echo "cannot make a network namespace: $out"; exit 2; fi
    ok=1
    ip netns exec "$probe" ip link add br0 type bridge 2>/dev/null || ok=0
    ip netns exec "$probe" ip link add vpa type veth peer name vpb 2>/dev/null || ok=0
    ip netns exec "$probe" tc qdisc add dev vpa root tbf rate 1gbit burst 32768 latency 100ms 2>/dev/null || ok=0
    ip netns del "$probe"
    if ((ok == 0)); then echo "this kernel lacks bridges, veth pairs or tc's tbf inside a namespace"; exit 2; fi
    ;;
  up)
    [[ $# -ge 3 ]] || die "usage: cluster.sh up NAME N [RATE]"
    name=$2 n=$3 rate=${4:-none}
    check_name "$name"
    [[ "$n" =~ ^[0-9]+$ ]] && ((n >= 2 && n <= 200)) || die "N must be 2..200 nodes, not '$n'"
    down "$name"
    trap 'down "$name"' ERR
    sw=$(switch_ns "$name")
    ip netns add "$sw"
    ip -n "$sw" link set lo up
    ip -n "$sw" link add br0 type bridge
    ip -n "$sw" link set br0 up
    for ((i = 0; i < n; i++)); do
      ns=$(node_ns "$name" "$i")
      ip netns add "$ns"
      ip -n "$ns" link set lo up
      ip -n "$sw" link add "p$i" type veth peer name eth0 netns "$ns"
      ip -n "$sw" link set "p$i" master br0
      ip -n "$sw" link set "p$i" up
      ip -n "$ns" addr add "$(address "$i")/24" dev eth0
      ip -n "$ns" link set eth0 up
      limit "$ns" eth0 "$rate"
      limit "$sw" "p$i" "$rate"
      echo "node $i $ns $(address "$i")"
    done
    ;;
  down)
    [[ $# -eq 2 ]] || die "usage: cluster.sh down NAME"
    check_name "$2"
    down "$2"
    ;;
  exec)
    [[ $# -ge 4 ]] || die "usage: cluster.sh exec NAME I CMD..."
    check_name "$2"; check_node "$2" "$3"
    ns=$(node_ns "$2" "$3"); shift 3
    exec ip netns exec "$ns" "$@"
    ;;
  link)
    [[ $# -eq 4 && ( "$4" == up || "$4" == down ) ]] || die "usage: cluster.sh link NAME I up|down"
    check_name "$2"; check_node "$2" "$3"
    ip -n "$(switch_ns "$2")" link set "p$3" "$4"
    ;;
  kill)
    [[ $# -eq 3 ]] || die "usage: cluster.sh kill NAME I"
    check_name "$2"; check_node "$2" "$3"
    ip netns pids "$(node_ns "$2" "$3")" | xargs -r kill -9
    ;;
  rate)
    [[ $# -eq 4 ]] || die "usage: cluster.sh rate NAME I RATE|none"
    check_name "$2"; check_node "$2" "$3"
    limit "$(node_ns "$2" "$3")" eth0 "$4"
    limit "$(switch_ns "$2")" "p$3" "$4"
    ;;
  bytes)
    [[ $# -eq 3 ]] || die "usage: cluster.sh bytes NAME I"
    check_name "$2"; check_node "$2" "$3"
    ns=$(node_ns "$2" "$3")
    echo "$(ip netns exec "$ns" cat /sys/class/net/eth0/statistics/tx_bytes)" \
         "$(ip netns exec "$ns" cat /sys/class/net/eth0/statistics/rx_bytes)"
    ;;
  *)
    die "usage: cluster.sh check | up NAME N [RATE] | down NAME | exec NAME I CMD... | link NAME I up|down | kill NAME I | rate NAME I RATE | bytes NAME I"
    ;;
esac
