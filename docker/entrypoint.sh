#!/usr/bin/env bash
# The one entrypoint of the swarmtrain images: shape this container's link, then exec `swarmtrain ARGS`.
#
#   SHAPE_RATE=100mbit  SHAPE_DELAY_MS=40  SHAPE_LOSS_PCT=0.5  SHAPE_DEV=eth0
#       shape the egress of SHAPE_DEV with htb (rate) and netem (delay/loss); needs cap_add NET_ADMIN.
#       Only this container's upload is shaped: every byte it downloads was uploaded by another
#       shaped container, so downloads are bounded by the senders' uplinks.
#   SWARMTRAIN_READY_FILE=/rendezvous/coordinator.ready
#       copy stdout (the READY line) to this file, for peers to find the coordinator.
#   SWARMTRAIN_JOIN_FILE=/rendezvous/coordinator.ready  [SWARMTRAIN_JOIN_TIMEOUT_S=120]
#       wait for a READY line there; `{join}` in ARGS becomes its first non-loopback multiaddr.
#   `{ip}` in ARGS becomes this container's IPv4 address on SHAPE_DEV.
set -euo pipefail

die() { echo "swarmtrain-entrypoint: error: $*" >&2; exit 2; }

dev=${SHAPE_DEV:-eth0}

shape() {
  local rate=${SHAPE_RATE:-} delay=${SHAPE_DELAY_MS:-0} loss=${SHAPE_LOSS_PCT:-0} netem=()
  if [ -z "$rate" ]; then
    if [ "$delay" != 0 ] || [ "$loss" != 0 ]; then
      die "SHAPE_DELAY_MS/SHAPE_LOSS_PCT need SHAPE_RATE (e.g. SHAPE_RATE=100mbit)"
    fi
    return 0
  fi
  [ "$delay" != 0 ] && netem+=(delay "${delay}ms")
  [ "$loss" != 0 ] && netem+=(loss "${loss}%")
  # A restarted container keeps its network namespace: start from the device's default qdisc.
  tc qdisc del dev "$dev" root 2>/dev/null || true
  tc qdisc add dev "$dev" root handle 1: htb default 10 \
    || die "tc could not shape $dev: give the container cap_add: [NET_ADMIN]"
  tc class add dev "$dev" parent 1: classid 1:10 htb rate "$rate" ceil "$rate" \
    || die "tc rejected SHAPE_RATE=$rate (use e.g. 100mbit, 20mbit)"
  if [ ${#netem[@]} -gt 0 ]; then
    tc qdisc add dev "$dev" parent 1:10 handle 10: netem "${netem[@]}" limit 10000 \
      || die "the host kernel has no netem qdisc: SHAPE_DELAY_MS/SHAPE_LOSS_PCT cannot be emulated"
  fi
  echo "swarmtrain-entrypoint: $dev egress shaped: rate $rate ${netem[*]}" >&2
}

container_ip() {
  ip -4 -o addr show dev "$dev" | awk '{print $4}' | cut -d/ -f1 | head -n1
}

coordinator_maddr() {
  local file=$1 timeout_s=${SWARMTRAIN_JOIN_TIMEOUT_S:-120} waited=0
  until grep -q '^READY ' "$file" 2>/dev/null; do
    [ "$waited" -ge "$timeout_s" ] && die "no READY line in $file after ${timeout_s}s (is the coordinator up?)"
    sleep 1
    waited=$((waited + 1))
  done
  python3 - "$file" <<'PY'
import json, sys
line = next(l for l in open(sys.argv[1], encoding="utf-8") if l.startswith("READY "))
maddrs = [m for m in json.loads(line[len("READY "):]).get("maddrs", []) if "/127.0.0.1/" not in m]
if not maddrs:
    sys.exit(f"swarmtrain-entrypoint: error: the coordinator's READY line has no non-loopback maddrs: {line}")
print(maddrs[0])
PY
}

shape

ip_addr=""
join=""
args=()
for a in "$@"; do
  if [[ "$a" == *"{ip}"* ]]; then
    [ -n "$ip_addr" ] || ip_addr=$(container_ip)
    [ -n "$ip_addr" ] || die "{ip} used but $dev has no IPv4 address"
    a=${a//\{ip\}/$ip_addr}
  fi
  if [[ "$a" == *"{join}"* ]]; then
    [ -n "${SWARMTRAIN_JOIN_FILE:-}" ] || die "{join} used but SWARMTRAIN_JOIN_FILE is not set"
    [ -n "$join" ] || join=$(coordinator_maddr "$SWARMTRAIN_JOIN_FILE")
    a=${a//\{join\}/$join}
  fi
  args+=("$a")
done

if [ -n "${SWARMTRAIN_READY_FILE:-}" ]; then
  rm -f "$SWARMTRAIN_READY_FILE"  # a stale READY from an earlier run must never be joined
  exec > >(tee "$SWARMTRAIN_READY_FILE")
fi
exec swarmtrain "${args[@]}"
