#!/bin/bash
# A real Slurm cluster of two nodes on this one host, for the tests marked `slurm` and for trying
# `sbatch launch/ray.sub` before a real cluster:
#
#   make local-slurm-install            # Debian's slurm-wlm 22.05 and munge (apt-get), once
#   bash launch/local_slurm/start.sh    # prints `export SLURM_CONF=...`: run it, then sbatch away
#   bash launch/local_slurm/stop.sh
#
# Everything lives under LOCAL_SLURM_DIR (its own slurm.conf, munge key and socket, state, spool
# and logs); nothing in /etc is read or written, so it never meets a system Slurm. Two `NodeName`
# lines share this host (`NodeHostname`, `NodeAddr`) and differ by `Port`; one `slurmd -N <name>`
# runs per node. Starting again first stops what an earlier start left (stop.sh).
#
# Environment (all optional):
#   LOCAL_SLURM_DIR     its folder                         (default: /tmp/gymrl-local-slurm)
#   LOCAL_SLURM_PORT    slurmctld's port; the nodes' slurmd take the next ones  (default: 16817)
#   LOCAL_SLURM_NODES   how many nodes                      (default: 2)
#   LOCAL_SLURM_CPUS    CPUs each node declares             (default: this host's, `nproc`)
#   LOCAL_SLURM_KILL_WAIT_S  Slurm's KillWait: from SIGTERM to SIGKILL when a job is cancelled
#                       or requeued                         (default: 120)
#   LOCAL_SLURM_WAIT_S  deadline for the nodes to be idle   (default: 60)
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
DIR="${LOCAL_SLURM_DIR:-/tmp/gymrl-local-slurm}"
PORT="${LOCAL_SLURM_PORT:-16817}"
NODES="${LOCAL_SLURM_NODES:-2}"
CPUS="${LOCAL_SLURM_CPUS:-$(nproc)}"
KILL_WAIT_S="${LOCAL_SLURM_KILL_WAIT_S:-120}"
WAIT_S="${LOCAL_SLURM_WAIT_S:-60}"

log() {
  printf '[local_slurm %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2
}

die() {
  log "ERROR: $*"
  exit 1
}

# The last lines of log file $1, indented, after a failure.
show_log() {
  [[ -f "$1" ]] && sed 's/^/    /' <(tail -n 20 "$1") >&2
  return 0
}

for command in munged slurmctld slurmd sinfo; do
  command -v "$command" >/dev/null || die "$command not found: install Debian's slurm-wlm and munge with \`make local-slurm-install\`"
done

if [[ -d "$DIR" ]]; then
  LOCAL_SLURM_DIR="$DIR" bash "$HERE/stop.sh"
fi
rm -rf "$DIR"
mkdir -p "$DIR"/{munge,state,log} "$DIR"/spool
chmod 700 "$DIR/munge"

# The address both nodes announce: the host's first non-loopback one, which is what Ray's head
# must listen on for nodes elsewhere (launch/ray.sub refuses a loopback head on several nodes).
ADDR="$(hostname -I 2>/dev/null | tr ' ' '\n' | grep -m1 -E '^[0-9]+(\.[0-9]+){3}$' | grep -v '^127\.' || true)"
[[ -n "$ADDR" ]] || die "this host has no non-loopback IPv4 address (hostname -I); Ray's head needs one"
HOST="$(hostname)"

# munge: a key of this cluster's own, and a socket in the folder (a system munged may run too).
head -c 1024 /dev/urandom >"$DIR/munge/munge.key"
chmod 400 "$DIR/munge/munge.key"
munged --force --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
  --pid-file="$DIR/munge/munged.pid" --seed-file="$DIR/munge/munged.seed" \
  --log-file="$DIR/log/munged.log" || {
  show_log "$DIR/log/munged.log"
  die "munged did not start; log: $DIR/log/munged.log"
}

node_names=()
for ((index = 0; index < NODES; index++)); do
  node_names+=("n${index}")
done
node_list="$(
  IFS=,
  echo "${node_names[*]}"
)"

# Plugins that need nothing from the host: processes tracked by their parents (no cgroups in
# a container), no task binding, no accounting database. config_overrides lets each slurmd
# declare LOCAL_SLURM_CPUS whatever the host has, which two nodes sharing its cores need.
{
  cat <<EOF
ClusterName=gymrl-local
SlurmctldHost=${HOST}(${ADDR})
SlurmctldPort=${PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=${DIR}/munge/munge.socket
StateSaveLocation=${DIR}/state
SlurmdSpoolDir=${DIR}/spool/%n
SlurmctldPidFile=${DIR}/slurmctld.pid
SlurmdPidFile=${DIR}/slurmd.%n.pid
SlurmctldLogFile=${DIR}/log/slurmctld.log
SlurmdLogFile=${DIR}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
KillWait=${KILL_WAIT_S}
EOF
  for ((index = 0; index < NODES; index++)); do
    echo "NodeName=${node_names[index]} NodeHostname=${HOST} NodeAddr=${ADDR} Port=$((PORT + 1 + index)) CPUs=${CPUS} State=UNKNOWN"
  done
  echo "PartitionName=local Nodes=${node_list} Default=YES MaxTime=INFINITE State=UP"
} >"$DIR/slurm.conf"
export SLURM_CONF="$DIR/slurm.conf"
echo "export SLURM_CONF=${SLURM_CONF}" >"$DIR/env"

slurmctld -f "$SLURM_CONF" || {
  show_log "$DIR/log/slurmctld.log"
  die "slurmctld did not start; log: $DIR/log/slurmctld.log"
}
for node in "${node_names[@]}"; do
  mkdir -p "$DIR/spool/$node"
  slurmd -f "$SLURM_CONF" -N "$node" || {
    show_log "$DIR/log/slurmd.$node.log"
    die "slurmd of $node did not start; log: $DIR/log/slurmd.$node.log"
  }
done

# Idle: both slurmd registered with slurmctld and took jobs.
deadline=$((SECONDS + WAIT_S))
while true; do
  states="$(sinfo --noheader --Node --format='%N %t' 2>/dev/null || true)"
  idle="$(awk '$2 == "idle"' <<<"$states" | wc -l)"
  ((idle == NODES)) && break
  if ((SECONDS >= deadline)); then
    for node in "${node_names[@]}"; do
      grep -q "^${node} idle$" <<<"$states" && continue
      log "node $node is not idle (sinfo: $(grep "^${node} " <<<"$states" || echo 'not listed')); log: $DIR/log/slurmd.$node.log"
      show_log "$DIR/log/slurmd.$node.log"
    done
    die "not every node idle within LOCAL_SLURM_WAIT_S=${WAIT_S} s; slurmctld's log: $DIR/log/slurmctld.log"
  fi
  sleep 0.5
done
log "${NODES} node(s) idle on ${HOST} (${ADDR}): ${node_list}; slurmctld on port ${PORT}; logs in $DIR/log"
echo "export SLURM_CONF=${SLURM_CONF}"
