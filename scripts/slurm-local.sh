#!/usr/bin/env bash
# A real SLURM cluster on this one machine, for tests and CI: slurmctld + three slurmd + munged.
#   scripts/slurm-local.sh start    install slurm-wlm, munge and procps if missing, write slurm.conf and gres.conf,
#                                   make the fake GPU devices, add n1/n2 to /etc/hosts, start whatever is not
#                                   running, then wait (up to ~30 s) until every node is usable; idempotent
#   scripts/slurm-local.sh stop     stop slurmctld and every slurmd (munged stays up)
#   scripts/slurm-local.sh status   sinfo -N -l; exits non-zero, saying why, if any node is missing or not usable
#
# What the cluster looks like (ClusterName=scaleout-local, controller <host>:6817, host = `hostname -s`):
#
#   partition  default  nodes   per node                          slurmd                      GRES
#   debug      YES      <host>  CPUs=nproc (2 here)               `slurmd -N <host>`, :6818   none
#   gpu        no       n1,n2   CPUs=2, 2 fake GPUs (Gres=gpu:2)  `slurmd -N n1`, :6821       gpu:2 File=/dev/fakegpu/n1/gpu[0-1]
#                                                                 `slurmd -N n2`, :6822       gpu:2 File=/dev/fakegpu/n2/gpu[0-1]
#
# - n1 and n2 are extra slurmd daemons on this same host (NodeHostname=<host>, their own Port, `%n` in the
#   spool/log/pid paths); their names resolve to 127.0.0.1 through a line in /etc/hosts, so a node list such
#   as n[1-2] works for MASTER_ADDR / the JAX coordinator from inside tasks.
# - Every node declares its own CPUs, so SLURM schedules them independently (CR_Core): a 2-node x 2-task job
#   on `gpu` fills n1 and n2 while jobs on `debug` keep <host>. All of it shares the host's real cores
#   (oversubscribed on purpose). Both partitions are OverSubscribe=YES (jobs asking --oversubscribe may share).
# - The fake GPUs are character devices (major 195, NVIDIA's, minor = index) that nothing opens. Each node's are
#   numbered 0 and 1, as /dev/nvidia0, /dev/nvidia1 are on every node of a real GPU cluster, so SLURM sets
#   CUDA_VISIBLE_DEVICES / SLURM_STEP_GPUS to per-node indices (0, 1), as it does there without device cgroups.
# - Unlike a real cluster, `hostname` inside a task on n1/n2 is this host's name: a node's name comes from
#   SLURMD_NODENAME or the job's node list (`scontrol show hostnames "$SLURM_JOB_NODELIST"`), never `hostname`.
# - No device or CPU cgroups (task/none, proctrack/linuxproc): CUDA_VISIBLE_DEVICES is SLURM's own setting.
# - Files: /etc/slurm/{slurm,gres}.conf, state /var/spool/slurmctld, spool /var/spool/slurmd/<node>,
#   logs /var/log/slurm/{slurmctld,slurmd-<node>}.log, pids /run/slurmctld.pid, /run/slurmd-<node>.pid.
# Needs root (it installs Debian packages, writes /etc and runs the daemons as root). Accounting is disabled,
# as on many small clusters: job state comes from squeue (scaleout falls back to sacct only if it works).
# No PreemptType: nothing is preempted by the scheduler here; tests preempt with `scancel --signal` / requeue.
set -euo pipefail

if [ "$(id -u)" != 0 ] && [ "${1:-}" != status ]; then
  if command -v sudo >/dev/null; then exec sudo -E bash "$0" "$@"; fi
  echo "slurm-local: must run as root (it installs packages and runs the SLURM daemons)" >&2; exit 1
fi

CONF_DIR=/etc/slurm
STATE=/var/spool/slurmctld
SPOOL=/var/spool/slurmd
LOG=/var/log/slurm
HOST=$(hostname -s 2>/dev/null || uname -n | cut -d. -f1)
CPUS=$(nproc)
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 8 / 10 ))
GPU_NODES=(n1 n2)
declare -A PORT=([n1]=6821 [n2]=6822)
GPUS_PER_NODE=2
GPU_NODE_CPUS=2
FAKEGPU_DIR=/dev/fakegpu
USABLE='^(idle|mixed|allocated|completing)$'
WAIT_S=30

all_nodes() { echo "$HOST" "${GPU_NODES[@]}"; }

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
     && command -v sbatch >/dev/null && command -v pgrep >/dev/null; then return; fi
  echo "slurm-local: installing slurm-wlm, munge and procps" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq slurm-wlm munge procps >/dev/null
}

# Replace $1 by $1.new if they differ; sets CONF_CHANGED=1 then.
commit_file() {
  if ! cmp -s "$1.new" "$1" 2>/dev/null; then mv "$1.new" "$1"; CONF_CHANGED=1; else rm -f "$1.new"; fi
}

write_conf() {
  mkdir -p "$CONF_DIR" "$STATE" "$SPOOL" "$LOG"
  {
    cat <<CONF
ClusterName=scaleout-local
SlurmctldHost=$HOST
AuthType=auth/munge
AuthInfo=cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$STATE
SlurmdSpoolDir=$SPOOL/%n
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobRequeue=1
KillWait=10
SchedulerParameters=defer_batch=0
GresTypes=gpu
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
CONF
    for n in "${GPU_NODES[@]}"; do
      echo "NodeName=$n NodeHostname=$HOST Port=${PORT[$n]} CPUs=$GPU_NODE_CPUS RealMemory=$MEM_MB Gres=gpu:$GPUS_PER_NODE State=UNKNOWN"
    done
    cat <<CONF
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
PartitionName=gpu Nodes=$(IFS=,; echo "${GPU_NODES[*]}") Default=NO MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
  } > "$CONF_DIR/slurm.conf.new"
  commit_file "$CONF_DIR/slurm.conf"
  for n in "${GPU_NODES[@]}"; do
    echo "NodeName=$n Name=gpu File=$FAKEGPU_DIR/$n/gpu[0-$((GPUS_PER_NODE - 1))]"
  done > "$CONF_DIR/gres.conf.new"
  commit_file "$CONF_DIR/gres.conf"
}

make_fake_gpus() {
  local n i dev
  for n in "${GPU_NODES[@]}"; do
    mkdir -p "$FAKEGPU_DIR/$n" "$SPOOL/$n"
    for i in $(seq 0 $((GPUS_PER_NODE - 1))); do
      dev=$FAKEGPU_DIR/$n/gpu$i
      [ -c "$dev" ] || { rm -f "$dev"; mknod -m 0666 "$dev" c 195 "$i"; }
    done
  done
  mkdir -p "$SPOOL/$HOST"
}

# n1 n2 -> 127.0.0.1, idempotently (a line is added only for names that /etc/hosts does not map yet).
add_hosts() {
  local missing=() n
  for n in "${GPU_NODES[@]}"; do
    awk -v n="$n" '$1 == "127.0.0.1" { for (i = 2; i <= NF; i++) if ($i == n) found = 1 } END { exit !found }' /etc/hosts \
      || missing+=("$n")
  done
  if [ ${#missing[@]} -gt 0 ]; then echo "127.0.0.1 ${missing[*]}" >> /etc/hosts; fi
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

# The pid in pid file $1 if that process is alive and is $2 (slurmctld/slurmd), else nothing.
live_pid() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] && echo "$pid"
}

# Stop every slurmctld and slurmd: the ones in our pid files, then any stray one (e.g. from the old one-node
# layout, whose slurmd wrote /run/slurmd.pid), and wait until they are gone.
stop_daemons() {
  local pids=() f p
  for f in /run/slurmctld.pid /run/slurmd.pid /run/slurmd-*.pid; do
    [ -e "$f" ] || continue
    p=$(live_pid "$f" slurmctld || live_pid "$f" slurmd || true)
    [ -n "$p" ] && pids+=("$p")
  done
  pids+=($(pgrep -x slurmctld || true) $(pgrep -x slurmd || true))
  if [ ${#pids[@]} -gt 0 ]; then kill "${pids[@]}" 2>/dev/null || true; fi
  for _ in $(seq 1 40); do pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null || return 0; sleep 0.25; done
  echo "slurm-local: slurmctld/slurmd still running after 10 s" >&2; return 1
}

# "node state" lines for every node we expect, from the controller.
node_states() { sinfo -h -N -o '%N %T' 2>/dev/null | sort -u; }

# Empty when every expected node is usable; otherwise one line per problem.
problems() {
  local states n s
  states=$(node_states) || true
  if [ -z "$states" ]; then echo "slurmctld does not answer (sinfo failed)"; return; fi
  for n in $(all_nodes); do
    live_pid "/run/slurmd-$n.pid" slurmd >/dev/null || echo "slurmd -N $n is not running (no live pid in /run/slurmd-$n.pid)"
    s=$(awk -v n="$n" '$1 == n { print $2 }' <<<"$states")
    if [ -z "$s" ]; then echo "node $n is not in the cluster"
    elif ! [[ $s =~ $USABLE ]]; then echo "node $n is $s${s:+ }($(scontrol show node "$n" 2>/dev/null | sed -n 's/^ *Reason=//p' | head -1))"
    fi
  done
  if ! sinfo -h -p gpu -o '%G' 2>/dev/null | grep -q "gpu:$GPUS_PER_NODE"; then echo "partition gpu shows no gpu:$GPUS_PER_NODE GRES"; fi
}

# A line for each node in $2... whose slurmd has not registered with slurmctld since epoch $1 (a restarted
# slurmctld shows the saved state of a node, idle, before its new slurmd has registered).
unregistered() {
  local t0=$1 n t; shift
  for n in "$@"; do
    t=$(scontrol show node "$n" 2>/dev/null | sed -n 's/.*SlurmdStartTime=\([^ ]*\).*/\1/p')
    t=$(date -d "$t" +%s 2>/dev/null || echo 0)
    [ "$t" -ge "$t0" ] || echo "slurmd -N $n has not registered with slurmctld yet"
  done
}

start() {
  install
  CONF_CHANGED=0
  write_conf
  make_fake_gpus
  add_hosts
  start_munge
  if [ "$CONF_CHANGED" = 1 ] && { pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null; }; then
    echo "slurm-local: configuration changed, restarting the daemons" >&2
    stop_daemons
  fi
  live_pid /run/slurmctld.pid slurmctld >/dev/null || pgrep -x slurmctld >/dev/null || slurmctld
  local n started=() t0
  t0=$(( $(date +%s) - 1 ))
  for n in $(all_nodes); do
    live_pid "/run/slurmd-$n.pid" slurmd >/dev/null || { slurmd -N "$n"; started+=("$n"); }
  done
  local left
  for _ in $(seq 1 $WAIT_S); do
    left=$(problems; unregistered "$t0" ${started[@]+"${started[@]}"})
    if [ -z "$left" ]; then
      echo "slurm-local: up: partition debug (default) = $HOST ($CPUS CPUs); partition gpu = ${GPU_NODES[*]} ($GPU_NODE_CPUS CPUs, gpu:$GPUS_PER_NODE each)"
      return 0
    fi
    # ReturnToService=2 brings back nodes that registered fine; a node DOWN/DRAINED from an earlier run needs this.
    for n in $(all_nodes); do
      if grep -q "^node $n is .*\(down\|drain\|fail\)" <<<"$left"; then
        scontrol update nodename="$n" state=resume >/dev/null 2>&1 || true
      fi
    done
    sleep 1
  done
  echo "slurm-local: FAILED: not every node is usable after ${WAIT_S} s:" >&2
  sed 's/^/  /' <<<"$left" >&2
  echo "  see $LOG/slurmctld.log and $LOG/slurmd-<node>.log" >&2
  sinfo -N -l >&2 || true
  return 1
}

stop() {
  stop_daemons
  echo "slurm-local: stopped"
}

status() {
  if ! command -v sinfo >/dev/null; then echo "slurm-local: FAILED: SLURM is not installed (run: $0 start)" >&2; return 1; fi
  sinfo -N -l || true
  local left
  left=$(problems)
  if [ -n "$left" ]; then
    echo "slurm-local: FAILED: the cluster is not fully up (run: $0 start):" >&2
    sed 's/^/  /' <<<"$left" >&2
    return 1
  fi
  echo "slurm-local: up"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
