#!/usr/bin/env bash
# A real SLURM cluster on this one machine, for tests and for trying submission locally (run as root).
#
#   bash cluster/local_slurm.sh up      # install (Debian packages) if needed, configure, start; waits for 2 idle nodes
#   bash cluster/local_slurm.sh down    # stop the daemons
#   bash cluster/local_slurm.sh status
#
# Two slurmd daemons (nodes n1 and n2, one CPU each, partition "debug") act as two nodes: Debian's SLURM is built
# with MULTIPLE_SLURMD. Authentication is munge with a key generated here.
set -euo pipefail

NODES=(n1 n2)
PARTITION=debug
CONF_DIR=/etc/slurm
HOST=$(hostname -s)

install_packages() {
  if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null || ! command -v sbatch >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q slurmctld slurmd slurm-client munge
  fi
}

configure() {
  mkdir -p "$CONF_DIR" /var/spool/slurmctld /var/log/slurm /var/run/munge /etc/munge
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
  fi
  chown -R munge:munge /etc/munge /var/run/munge
  chmod 400 /etc/munge/munge.key
  grep -q " n1 n2" /etc/hosts || echo "127.0.0.1 n1 n2" >> /etc/hosts
  local memory_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / ${#NODES[@]} / 2 ))
  {
    echo "ClusterName=distrain-local"
    echo "SlurmctldHost=$HOST"
    echo "SlurmUser=root"
    echo "AuthType=auth/munge"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    echo "ReturnToService=2"
    echo "MpiDefault=none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "StateSaveLocation=/var/spool/slurmctld"
    echo "SlurmdSpoolDir=/var/spool/slurmd/%n"
    echo "SlurmdPidFile=/var/run/slurmd-%n.pid"
    echo "SlurmdLogFile=/var/log/slurm/slurmd-%n.log"
    echo "SlurmctldLogFile=/var/log/slurm/slurmctld.log"
    echo "SlurmctldPidFile=/var/run/slurmctld.pid"
    echo "KillWait=10"
    echo "MinJobAge=600"
    local port=17001
    for node in "${NODES[@]}"; do
      echo "NodeName=$node NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$port CPUs=1 RealMemory=$memory_mb State=UNKNOWN"
      port=$((port + 1))
    done
    echo "PartitionName=$PARTITION Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP"
  } > "$CONF_DIR/slurm.conf"
  for node in "${NODES[@]}"; do mkdir -p "/var/spool/slurmd/$node"; done
}

start() {
  pgrep -x munged >/dev/null || runuser -u munge -- munged
  pgrep -x slurmctld >/dev/null || slurmctld
  for node in "${NODES[@]}"; do
    pgrep -f "slurmd -N $node" >/dev/null || slurmd -N "$node"
  done
  for _ in $(seq 1 60); do
    if [ "$(sinfo -h -p "$PARTITION" -t idle -o '%D' 2>/dev/null | head -1)" = "${#NODES[@]}" ]; then
      sinfo -N
      return 0
    fi
    for node in "${NODES[@]}"; do scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true; done
    sleep 1
  done
  echo "local SLURM: nodes did not become idle" >&2
  sinfo -N >&2 || true
  return 1
}

stop() {
  pkill -x slurmd || true
  pkill -x slurmctld || true
  pkill -x munged || true
}

case "${1:-up}" in
  up) install_packages; configure; start ;;
  down) stop ;;
  status) sinfo -N; squeue ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
