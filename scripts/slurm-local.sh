#!/usr/bin/env bash
# A real single-node SLURM cluster on this machine, for the SLURM launcher's tests.
#
#   scripts/slurm-local.sh start    install slurm-wlm + munge (apt-get) if missing, write the
#                                   configuration, start munged, slurmctld and slurmd; wait until
#                                   the node is idle (idempotent: a running cluster is left as is)
#   scripts/slurm-local.sh stop     stop the three daemons by the PIDs they recorded
#   scripts/slurm-local.sh status   daemons and node state; exit 0 only when the node takes jobs
#
# Needs root and Debian/Ubuntu. No systemd and no cgroups: processes are tracked through /proc
# (proctrack/linuxproc) and tasks are not confined (task/none). The one node is this machine under
# its own hostname with its real CPU count and memory (`slurmd -C`), partition `debug`.
# Everything the daemons write lives under $MESHRL_SLURM_DIR (default /var/lib/meshrl-slurm); the
# configuration is /etc/slurm/slurm.conf, where every client command finds it, and a
# slurm.conf this script did not write is never replaced.
set -euo pipefail

DIR=${MESHRL_SLURM_DIR:-/var/lib/meshrl-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# written by meshrl scripts/slurm-local.sh"
MUNGE_PID=/run/munge/munged.pid
CTLD_PID=$DIR/slurmctld.pid
SLURMD_PID=$DIR/slurmd.pid
READY_TIMEOUT_S=${MESHRL_SLURM_READY_TIMEOUT_S:-60}

die() { echo "slurm-local: $*" >&2; exit 1; }

running() {  # running PIDFILE: the process the file names is alive
    [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null; then
        return
    fi
    command -v apt-get >/dev/null || die "slurm-wlm and munge are missing and there is no apt-get"
    echo "slurm-local: installing slurm-wlm munge"
    local t0=$SECONDS
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurm-wlm munge >/dev/null \
        || { apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurm-wlm munge >/dev/null; } \
        || die "apt-get install slurm-wlm munge failed"
    echo "slurm-local: installed in $((SECONDS - t0)) s"
}

write_conf() {
    if [[ -f $CONF ]] && ! grep -qF "$MARK" "$CONF"; then
        die "$CONF exists and was not written by this script; not replacing it"
    fi
    mkdir -p "$DIR/state" "$DIR/spool" /etc/slurm
    local node
    node=$(slurmd -C | head -n1)  # NodeName=<hostname> CPUs=.. Boards=.. ... RealMemory=..
    [[ $node == NodeName=* ]] || die "slurmd -C did not describe this node: $node"
    cat >"$CONF.tmp" <<EOF
$MARK
ClusterName=meshrl-local
SlurmctldHost=$(hostname)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
KillWait=5
$node State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$CONF.tmp" "$CONF"
}

start_munge() {
    running "$MUNGE_PID" && return
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    chmod 0755 /run/munge
    [[ -s /etc/munge/munge.key ]] || { mungekey --create --force && chown munge:munge /etc/munge/munge.key; }
    runuser -u munge -- munged --pid-file="$MUNGE_PID"
}

node_state() {
    sinfo -h -N -o %T 2>/dev/null | head -n1
}

start() {
    [[ $(id -u) == 0 ]] || die "start needs root"
    install
    write_conf
    start_munge
    running "$CTLD_PID" || slurmctld
    running "$SLURMD_PID" || slurmd
    local t0=$SECONDS state=""
    while (( SECONDS - t0 < READY_TIMEOUT_S )); do
        state=$(node_state)
        case $state in
            idle|mixed|allocated|completing) echo "slurm-local: node $(hostname) $state"; return 0;;
            down*|drain*) scontrol update nodename="$(hostname)" state=resume >/dev/null 2>&1 || true;;
        esac
        sleep 1
    done
    die "the node is not ready after ${READY_TIMEOUT_S} s (state '${state:-none}'; see $DIR/slurmctld.log, $DIR/slurmd.log)"
}

stop_pid() {  # stop_pid NAME PIDFILE: SIGTERM, then SIGKILL after 10 s
    local name=$1 file=$2 pid
    running "$file" || return 0
    pid=$(cat "$file")
    kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || { echo "slurm-local: stopped $name ($pid)"; return 0; }; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    echo "slurm-local: killed $name ($pid)"
}

stop() {
    stop_pid slurmd "$SLURMD_PID"
    stop_pid slurmctld "$CTLD_PID"
    stop_pid munged "$MUNGE_PID"
}

status() {
    local ok=0 name file
    for name in munged slurmctld slurmd; do
        case $name in munged) file=$MUNGE_PID;; slurmctld) file=$CTLD_PID;; slurmd) file=$SLURMD_PID;; esac
        if running "$file"; then echo "$name: running ($(cat "$file"))"; else echo "$name: stopped"; ok=1; fi
    done
    local state
    state=$(node_state || true)
    echo "node $(hostname): ${state:-unknown}"
    [[ $ok == 0 && $state =~ ^(idle|mixed|allocated|completing)$ ]]
}

case ${1:-} in
    start) start;;
    stop) stop;;
    status) status;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2;;
esac
