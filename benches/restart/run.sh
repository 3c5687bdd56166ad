#!/usr/bin/env bash
# Time to start again after kill -9, with open spools: after a crash of the
# process (the same boot) and as after a reboot (the shards' `recovered-in`
# stamps removed, so every spool is hashed whole), in one run.
#
#   cargo build --release -p rotary
#   benches/restart/run.sh [JOURNALS] [MIB_PER_JOURNAL]     # default 16 × 1024
#
# Each journal gets MIB_PER_JOURNAL in appends of 256 MiB, then one small
# append. Needs JOURNALS × MIB_PER_JOURNAL of free disk under $WORK.
set -euo pipefail
JOURNALS=${1:-16}
MIB=${2:-1024}
R=${ROTARY:-$(cd "$(dirname "$0")/../.." && pwd)/target/release/rotary}
WORK=${WORK:-/tmp/rotary-restart}
PORT=${PORT:-7601}
B=(--broker "127.0.0.1:$PORT")
D=$WORK/data
rm -rf "$WORK"
mkdir -p "$D"
PID=
trap '[ -n "$PID" ] && kill -9 $PID 2>/dev/null; rm -rf "$WORK"' EXIT

start() { # $1: run name
  "$R" serve --data "$D" --listen "127.0.0.1:$PORT" --cores 2 >"$WORK/log.$1" 2>&1 &
  PID=$!
}
wait_recovered() { # $1: run name; both shards' `recovered` lines
  until [ "$(grep -c ' recovered ' "$WORK/log.$1")" = 2 ]; do sleep 0.02; done
  until "$R" stats "${B[@]}" >/dev/null 2>&1; do sleep 0.02; done
  echo "$1:"
  grep -h ' recovered ' "$WORK/log.$1" | sed 's/.*recovered /  /'
  echo "  STATS $("$R" stats "${B[@]}" | tr -d ' \n' | grep -o '"recovery_hashed_bytes":[0-9]*')"
}
kill9() { kill -9 "$PID"; wait "$PID" 2>/dev/null || true; PID=; sleep 0.5; }

start first
wait_recovered first >/dev/null
for i in $(seq -w 1 "$JOURNALS"); do
  printf -- '- name: restart/j-%s\n  fragment: {length: 1099511627776}\n' "$i"
done >"$WORK/specs.yaml"
"$R" journals apply -f "$WORK/specs.yaml" "${B[@]}" >/dev/null
head -c $((256 << 20)) /dev/urandom >"$WORK/chunk"
for i in $(seq -w 1 "$JOURNALS"); do
  for _ in $(seq 1 $((MIB / 256))); do
    "$R" append "restart/j-$i" -i "$WORK/chunk" "${B[@]}" >/dev/null
  done
  echo "a last small append" | "$R" append "restart/j-$i" "${B[@]}" >/dev/null
done
echo "open spools: $(du -sh "$D" | cut -f1) in $JOURNALS journals"

kill9
start same-boot
wait_recovered same-boot
kill9
rm -f "$D"/shard-*/recovered-in
start after-reboot
wait_recovered after-reboot
kill9
start same-boot-again
wait_recovered same-boot-again
kill9
