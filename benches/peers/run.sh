#!/usr/bin/env bash
# Drives rotary and its peers with the same OpenMessaging workload, one after
# another on this machine, and prints one table.
#
#   benches/peers/run.sh [WORKLOAD.yaml] [OUT_DIR]
#
# Installs the peers from the package registries only (Debian: nats-server,
# redis-server; crates.io: tansu), builds rotary once, then for each system:
# starts the server on 127.0.0.1 with a data directory under a temporary
# directory, pinned to SERVER_CPU; runs `rotary bench --workload` against it
# pinned to CLIENT_CPU; stops the server by its PID. Every process this
# script starts is stopped by its PID on exit, whatever the exit.
#
# Environment (all optional):
#   SYSTEMS        systems to run, in order (default: rotary rotary-fsync nats redis-always
#                  redis-everysec kafka)
#   PERIOD         seconds per point of the throughput series (default 1)
#   SERVER_CPU     core of the servers (default: the one CPU that takes the
#                  temporary directory's disk interrupts, as `rotary doctor`
#                  reports them; else 0)
#   CLIENT_CPU     core of the load generator (default: another core, 1 or 0)
#   NO_INSTALL=1   do not install anything; skip systems that are missing
#   TANSU_VERSION  tansu from crates.io (default 0.6.0)
#   TANSU_FEATURES its features (default dynostore)
#   TANSU_STORAGE  its --storage-engine (default memory://tansu/; dynostore
#                  has only memory:// and s3://)
#
# See benches/peers/README.md for what each system's acknowledgement means.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"

workload=${1:-benches/workloads/1-topic-4-partitions-1kb-10k.yaml}
out=${2:-target/peers/$(date -u +%Y%m%dT%H%M%SZ)}
systems=${SYSTEMS:-rotary rotary-fsync nats redis-always redis-everysec kafka}
period=${PERIOD:-1}
server_cpu=${SERVER_CPU:-}
client_cpu=${CLIENT_CPU:-}
tansu_version=${TANSU_VERSION:-0.6.0}
tansu_features=${TANSU_FEATURES:-dynostore}
tansu_storage=${TANSU_STORAGE:-memory://tansu/}

[ -f "$workload" ] || { echo "no workload file $workload" >&2; exit 2; }
for tool in taskset python3; do
  command -v "$tool" >/dev/null || { echo "needs $tool" >&2; exit 2; }
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
tmp=$(mktemp -d -t rotary-peers.XXXXXX)

# PIDs of the servers still running; the trap stops each by its PID.
pids=()
cleanup() {
  local pid
  for pid in "${pids[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in "${pids[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say() { echo "peers: $*" >&2; }

# A port nothing listens on now.
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# Waits up to 30 s for 127.0.0.1:$1 to accept connections while PID $2 lives.
wait_port() {
  local port=$1 pid=$2 i
  for i in $(seq 300); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}

# Stops the server PID $1 and forgets it.
stop() {
  local pid=$1 kept=() p
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  for p in "${pids[@]}"; do
    [ "$p" = "$pid" ] || kept+=("$p")
  done
  pids=("${kept[@]}")
}

# ---- install ---------------------------------------------------------------

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi
}

want() { case " $systems " in *" $1"*) return 0 ;; *) return 1 ;; esac; }

tansu_bin=$(command -v tansu || echo "${CARGO_HOME:-$HOME/.cargo}/bin/tansu")
if [ "${NO_INSTALL:-0}" != 1 ]; then
  missing=()
  want nats && ! command -v nats-server >/dev/null && missing+=(nats-server)
  want redis && ! command -v redis-server >/dev/null && missing+=(redis-server)
  if [ ${#missing[@]} -gt 0 ]; then
    say "installing ${missing[*]} from Debian"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq || true
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}" ||
      say "could not install ${missing[*]}; those systems are skipped"
  fi
  if want kafka && ! [ -x "$tansu_bin" ]; then
    say "installing tansu $tansu_version --features $tansu_features from crates.io (a long build)"
    cargo install tansu --version "$tansu_version" --features "$tansu_features" --locked ||
      say "could not install tansu; the kafka row is skipped"
    tansu_bin=$(command -v tansu || echo "${CARGO_HOME:-$HOME/.cargo}/bin/tansu")
  fi
fi

say "building rotary (release)"
cargo build --release
rotary=$repo/target/release/rotary
# The build leaves dirty pages behind, and their writeback may share the
# disk with the first system's writes (a rotary row right after a rebuild
# had 54-128 ms write stalls, and none in the next run). Flush them first.
sync

# Servers go where the disk's completion interrupts land when that is one
# CPU: a write that completes there wakes its server without a cross-CPU hop
# (docs/BENCHMARKS.md, "Where the disk's interrupts land"). Every system gets
# the same CPU.
if [ -z "$server_cpu" ]; then
  server_cpu=$("$rotary" doctor --data "$tmp/probe" 2>/dev/null |
    sed -n 's/.*disk_irqs: .* land on CPU \([0-9][0-9]*\) of .*/\1/p' | head -n 1 || true)
  server_cpu=${server_cpu:-0}
fi
if [ -z "$client_cpu" ]; then
  if [ "$server_cpu" = 0 ]; then client_cpu=1; else client_cpu=0; fi
fi

# ---- the systems -----------------------------------------------------------

# Each start_* starts one server pinned to SERVER_CPU, appends its PID to
# pids, and sets: port, driver, setting (the durability this script
# configured, in words, also handed to the driver as ROTARY_PEER_FSYNC).

# start_rotary [replicated|fsync]: the durability of the journals the driver
# creates.
start_rotary() {
  local mode=${1:-replicated}
  local dir=$tmp/rotary-$mode
  mkdir -p "$dir"
  port=$(free_port)
  driver=rotary
  durability=$mode
  if [ "$mode" = fsync ]; then
    setting="journals created by the driver: durability fsync (O_DIRECT spool write, commit record and fdatasync of both before the ack), replication 1; one shard"
  else
    setting="journals created by the driver: durability replicated (O_DIRECT spool write and commit record before the ack, no fdatasync), replication 1; one shard"
  fi
  taskset -c "$server_cpu" "$rotary" serve --data "$dir/data" --listen "127.0.0.1:$port" \
    --cores 1 --cpus "$server_cpu" >"$out/rotary.server.log" 2>&1 &
  pids+=($!)
}

start_nats() {
  command -v nats-server >/dev/null || return 1
  local dir=$tmp/nats
  mkdir -p "$dir"
  port=$(free_port)
  driver=nats
  # sync_interval (fsync on every write) exists from nats-server 2.10 on;
  # older servers refuse the field, so it is set only where it is known.
  local version sync=""
  version=$(nats-server --version | sed 's/.*v//')
  if [ "$(printf '%s\n2.10.0\n' "$version" | sort -V | head -n1)" = 2.10.0 ]; then
    sync="sync_interval: always"
    setting="nats-server $version: sync_interval always (fsync before ack)"
  else
    setting="written to the OS before the ack, no fsync (nats-server $version has no sync_interval; its file store fsyncs on a 2-minute timer)"
  fi
  cat >"$dir/nats.conf" <<EOF
listen: 127.0.0.1:$port
max_payload: 8MB
jetstream {
  store_dir: "$dir/jetstream"
  $sync
}
EOF
  taskset -c "$server_cpu" nats-server -c "$dir/nats.conf" >"$out/nats.server.log" 2>&1 &
  pids+=($!)
}

# $1: always | everysec
start_redis() {
  command -v redis-server >/dev/null || return 1
  local dir=$tmp/redis-$1
  mkdir -p "$dir"
  port=$(free_port)
  driver=redis
  case $1 in
    always) setting="AOF appendfsync always: fsync before the reply, group-committed per event-loop round" ;;
    everysec) setting="AOF appendfsync everysec: write() before the reply, fsync once a second in the background" ;;
  esac
  taskset -c "$server_cpu" redis-server --bind 127.0.0.1 --port "$port" --protected-mode yes \
    --dir "$dir" --save "" --appendonly yes --appendfsync "$1" \
    >"$out/redis-$1.server.log" 2>&1 &
  pids+=($!)
}

start_kafka() {
  [ -x "$tansu_bin" ] || return 1
  local dir=$tmp/tansu
  mkdir -p "$dir"
  port=$(free_port)
  driver=kafka
  case $tansu_storage in
    memory://*) setting="tansu $tansu_version, storage $tansu_storage: records in process memory, no disk" ;;
    *) setting="tansu $tansu_version, storage $tansu_storage" ;;
  esac
  (cd "$dir" && exec taskset -c "$server_cpu" "$tansu_bin" broker \
    --listener-url "tcp://127.0.0.1:$port" \
    --advertised-listener-url "tcp://127.0.0.1:$port" \
    --storage-engine "$tansu_storage" --silent) >"$out/kafka.server.log" 2>&1 &
  pids+=($!)
}

{
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(nproc) CPUs, $(uname -sr)"
  echo "revision: $(git rev-parse --short HEAD 2>/dev/null || echo '?')" \
    "($(git status --porcelain --untracked-files=no 2>/dev/null | wc -l) files with uncommitted changes)"
  echo "workload: $workload"
  echo "servers on CPU $server_cpu, load generator on CPU $client_cpu"
  command -v nats-server >/dev/null && echo "nats-server: $(nats-server --version)"
  command -v redis-server >/dev/null && echo "redis-server: $(redis-server --version)"
  [ -x "$tansu_bin" ] && echo "tansu: $("$tansu_bin" --version 2>/dev/null || echo "$tansu_version")"
} >"$out/run.txt"

failed=()
for system in $systems; do
  durability=replicated
  case $system in
    rotary) start_rotary replicated ;;
    rotary-fsync) start_rotary fsync ;;
    nats) start_nats ;;
    redis-always) start_redis always ;;
    redis-everysec) start_redis everysec ;;
    kafka) start_kafka ;;
    *) say "unknown system $system"; false ;;
  esac || { say "$system: not installed, skipped"; failed+=("$system (not installed)"); continue; }
  server=${pids[-1]}
  if ! wait_port "$port" "$server"; then
    say "$system: the server did not listen; see $out/$system.server.log"
    failed+=("$system (server did not start)")
    stop "$server"
    continue
  fi
  echo "$system: $setting" >>"$out/run.txt"
  echo "$system load before the run: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$out/run.txt"
  say "$system on 127.0.0.1:$port (server PID $server, CPU $server_cpu; load generator CPU $client_cpu)"
  if ! ROTARY_PEER_FSYNC=$setting taskset -c "$client_cpu" "$rotary" bench \
      --workload "$workload" --driver "$driver" --broker "127.0.0.1:$port" \
      --journal-durability "$durability" --period "$period" \
      --output "$out/$system.json" 2>&1 | tee "$out/$system.log" >&2; then
    say "$system: the run failed; see $out/$system.log"
    failed+=("$system (run failed)")
  fi
  stop "$server"
done

echo
python3 "$repo/benches/peers/table.py" "$out/run.txt" $(for s in $systems; do
  [ -f "$out/$s.json" ] && echo "$out/$s.json"
done)
if [ ${#failed[@]} -gt 0 ]; then
  echo
  echo "not measured: ${failed[*]}"
fi
echo
echo "results, server logs and run.txt in $out"
