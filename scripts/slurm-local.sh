#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, for tests and CI: slurmctld + slurmd + munged.
#   scripts/slurm-local.sh start    install slurm-wlm and munge if missing, write slurm.conf, start the daemons (idempotent)
#   scripts/slurm-local.sh stop     stop the daemons
#   scripts/slurm-local.sh status   sinfo, or why the cluster is not up
# Needs root (it installs Debian packages and runs the daemons as root). Accounting is disabled,
# as on many small clusters: job state comes from squeue (scaleout falls back to sacct only if it works).
set -euo pipefail

CONF_DIR=/etc/slurm
STATE=/var/spool/slurmctld
SPOOL=/var/spool/slurmd
LOG=/var/log/slurm
HOST=$(hostname -s)
CPUS=$(nproc)
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 8 / 10 ))

install() {
  if command -v slurmctld >/dev/null && command -v munged >/dev/null && command -v sbatch >/dev/null; then return; fi
  echo "slurm-local: installing slurm-wlm and munge" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq slurm-wlm munge >/dev/null
}

write_conf() {
  mkdir -p "$CONF_DIR" "$STATE" "$SPOOL" "$LOG"
  cat > "$CONF_DIR/slurm.conf.new" <<CONF
ClusterName=scaleout-local
SlurmctldHost=$HOST
AuthType=auth/munge
AuthInfo=cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$STATE
SlurmdSpoolDir=$SPOOL
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobRequeue=1
KillWait=10
SchedulerParameters=defer_batch=0
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
  if ! cmp -s "$CONF_DIR/slurm.conf.new" "$CONF_DIR/slurm.conf" 2>/dev/null; then
    mv "$CONF_DIR/slurm.conf.new" "$CONF_DIR/slurm.conf"
    CONF_CHANGED=1
  else
    rm -f "$CONF_DIR/slurm.conf.new"
  fi
}

start_munge() {
  if pgrep -x munged >/dev/null; then return; fi
  mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
  fi
  chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge 2>/dev/null || true
  chmod 0700 /etc/munge; chmod 0400 /etc/munge/munge.key
  if id munge >/dev/null 2>&1; then
    su -s /bin/sh munge -c "munged --force" 2>/dev/null || munged --force
  else
    munged --force
  fi
}

start() {
  install
  CONF_CHANGED=0
  write_conf
  start_munge
  if [ "$CONF_CHANGED" = 1 ]; then
    pkill -x slurmctld || true; pkill -x slurmd || true
    for _ in $(seq 1 30); do pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null || break; sleep 0.5; done
  fi
  pgrep -x slurmctld >/dev/null || slurmctld
  pgrep -x slurmd >/dev/null || slurmd
  for _ in $(seq 1 60); do
    if sinfo -h -o "%T" 2>/dev/null | grep -qE "^(idle|mixed|allocated)"; then
      echo "slurm-local: up ($HOST, $CPUS CPUs)"; return 0
    fi
    scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
    sleep 1
  done
  echo "slurm-local: the node did not become idle; see $LOG/slurmctld.log and $LOG/slurmd.log" >&2
  sinfo >&2 || true
  return 1
}

stop() {
  pkill -x slurmd || true
  pkill -x slurmctld || true
  for _ in $(seq 1 30); do pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null || break; sleep 0.5; done
  echo "slurm-local: stopped"
}

status() {
  if ! command -v sinfo >/dev/null; then echo "slurm-local: not installed (run: $0 start)"; return 1; fi
  sinfo
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
