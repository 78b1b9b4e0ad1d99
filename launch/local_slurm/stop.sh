#!/bin/bash
# Stop the local Slurm cluster that start.sh started: cancel its jobs (their batch scripts get
# SIGTERM and tear their Ray down), wait for them to end, then stop every slurmd, slurmctld and
# munged by the pids they wrote. Each wait has a deadline, after which the process is killed.
#
#   LOCAL_SLURM_DIR     its folder (default: /tmp/gymrl-local-slurm)
#   LOCAL_SLURM_STOP_S  deadline of each wait (default: 60)
set -uo pipefail

DIR="${LOCAL_SLURM_DIR:-/tmp/gymrl-local-slurm}"
STOP_S="${LOCAL_SLURM_STOP_S:-60}"
export SLURM_CONF="$DIR/slurm.conf"

log() {
  printf '[local_slurm %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2
}

# The pid in file $1 when that process runs, else nothing.
live_pid() {
  local pid
  pid="$(cat "$1" 2>/dev/null)" || return 1
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

# SIGTERM to the process whose pid is in file $1 (named $2), SIGKILL at the deadline.
stop_daemon() {
  local pid deadline
  pid="$(live_pid "$1")" || return 0
  kill -TERM "$pid" 2>/dev/null
  deadline=$((SECONDS + STOP_S))
  while kill -0 "$pid" 2>/dev/null; do
    if ((SECONDS >= deadline)); then
      log "$2 (pid $pid) still running ${STOP_S} s after SIGTERM: killed"
      kill -KILL "$pid" 2>/dev/null
      break
    fi
    sleep 0.2
  done
}

if [[ -f "$SLURM_CONF" ]] && live_pid "$DIR/slurmctld.pid" >/dev/null; then
  jobs="$(squeue --noheader --format=%i 2>/dev/null)"
  if [[ -n "$jobs" ]]; then
    log "cancelling job(s) $(echo $jobs)"
    scancel --full $jobs 2>/dev/null
    deadline=$((SECONDS + STOP_S))
    while [[ -n "$(squeue --noheader --format=%i 2>/dev/null)" ]] && ((SECONDS < deadline)); do
      sleep 0.5
    done
    [[ -z "$(squeue --noheader --format=%i 2>/dev/null)" ]] ||
      log "job(s) still listed after ${STOP_S} s: $(squeue --noheader --format='%i %T' | tr '\n' ' ')"
  fi
fi

for pid_file in "$DIR"/slurmd.*.pid; do
  [[ -e "$pid_file" ]] || continue
  node="${pid_file#"$DIR"/slurmd.}"
  stop_daemon "$pid_file" "slurmd of ${node%.pid}"
done
stop_daemon "$DIR/slurmctld.pid" slurmctld
stop_daemon "$DIR/munge/munged.pid" munged
log "stopped (logs kept in $DIR/log)"
