#!/usr/bin/env bash
# Start a one-node SLURM (Debian's slurmctld, slurmd and munge) for the real
# `srun -n 2` test. Needs root and apt-get; prints why and exits 1 otherwise
# (tests/test_srun.py then skips, naming the reason). Idempotent: a running
# controller is left as it is.
set -euo pipefail
if sinfo >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "start_slurm: needs root and apt-get; SLURM not started"
    exit 1
fi
apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
host=$(hostname)
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
cat >/etc/slurm/slurm.conf <<CONF
ClusterName=ci
SlurmctldHost=${host}
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
ReturnToService=2
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
MpiDefault=none
NodeName=${host} CPUs=$(nproc) State=UNKNOWN
PartitionName=ci Nodes=${host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
pgrep -x munged >/dev/null || munged --force
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
for _ in $(seq 30); do
    if sinfo -h -o %t 2>/dev/null | grep -q idle; then
        exit 0
    fi
    sleep 1
done
echo "start_slurm: the node did not become idle within 30 s"
exit 1
