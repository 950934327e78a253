#!/usr/bin/env bash
# statistics.sh: run a command and sample the machine's utilization while it runs.
#
#   bash statistics.sh [-o OUT.csv] [-i INTERVAL_MS] [-m auto|gpu|cpu] -- COMMAND ARGS...
#
# With GPUs (`nvidia-smi -L` lists one): nvidia-smi --query-gpu=timestamp,index,memory.total,
# memory.used,memory.free,utilization.gpu,utilization.memory --format=csv every INTERVAL_MS.
# Without: from /proc, the CPU use and resident memory of the command's whole process tree
# (launcher, training processes, data loader workers), one CSV row per sample:
#   timestamp,elapsed_s,cpu_percent,rss_mb,processes
# cpu_percent is in units of one core (200 = two cores busy); it counts the CPU time of the
# processes in the tree plus that of their children already reaped (cutime/cstime), so
# short-lived workers are not lost. rss_mb sums each process's RSS (shared pages counted
# once per process, so an upper bound on the tree's footprint).
# Sampling stops when the command ends; the exit status is the command's.
set -euo pipefail

PROG=${0##*/}
OUT=statistics.csv
INTERVAL_MS=500
MODE=auto

usage() {
    cat <<EOF
Usage: bash $PROG [-o OUT.csv] [-i INTERVAL_MS] [-m auto|gpu|cpu] -- COMMAND [ARGS...]

Runs COMMAND, samples utilization every INTERVAL_MS while it runs and writes the
samples to OUT.csv; exits with COMMAND's exit status.

  -o OUT.csv       where the samples go (default: $OUT)
  -i INTERVAL_MS   sampling interval in milliseconds (default: $INTERVAL_MS)
  -m MODE          gpu: nvidia-smi per-GPU samples (timestamp, index, memory.total,
                   memory.used, memory.free, utilization.gpu, utilization.memory);
                   cpu: /proc samples of the command's process tree (timestamp,
                   elapsed_s, cpu_percent [% of one core], rss_mb, processes);
                   auto (default): gpu when \`nvidia-smi -L\` lists a GPU, else cpu
  -h               this help

Example: bash $PROG -o /tmp/s.csv -- torchrun --nproc_per_node=2 distributed.py --epochs 1
EOF
}

die() { echo "$PROG: $*" >&2; exit 2; }

while getopts ":o:i:m:h" opt; do
    case $opt in
        o) OUT=$OPTARG ;;
        i) INTERVAL_MS=$OPTARG ;;
        m) MODE=$OPTARG ;;
        h) usage; exit 0 ;;
        :) die "-$OPTARG needs a value (see -h)" ;;
        *) die "unknown option -$OPTARG (see -h)" ;;
    esac
done
shift $((OPTIND - 1))
[[ ${1:-} == -- ]] && shift
(($# > 0)) || { usage >&2; exit 2; }
[[ $INTERVAL_MS =~ ^[0-9]+$ ]] && ((INTERVAL_MS >= 10)) || die "-i wants milliseconds >= 10, not '$INTERVAL_MS'"
case $MODE in
    auto) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep '^GPU' >/dev/null; then
              MODE=gpu; else MODE=cpu; fi ;;
    gpu) command -v nvidia-smi >/dev/null 2>&1 || die "-m gpu: nvidia-smi not found" ;;
    cpu) ;;
    *) die "-m wants auto, gpu or cpu, not '$MODE'" ;;
esac
mkdir -p "$(dirname -- "$OUT")"
: >"$OUT" || die "cannot write $OUT"
INTERVAL_S=$(printf '%d.%03d' $((INTERVAL_MS / 1000)) $((INTERVAL_MS % 1000)))
CLK_TCK=$(getconf CLK_TCK)
PAGE_KB=$(($(getconf PAGESIZE) / 1024))

# Process tree of $1 (itself included): pids on stdout, one per line.
declare -A PARENT
tree_pids() {
    local root=$1 f line rest pid ppid
    PARENT=()
    for f in /proc/[0-9]*/stat; do
        { read -r line <"$f"; } 2>/dev/null || continue
        pid=${line%% *}
        rest=${line##*) }       # the command name may hold spaces and parentheses
        rest=${rest#* }         # drop the state field
        ppid=${rest%% *}
        PARENT[$pid]=$ppid
    done
    local -a queue=("$root") out=()
    local -A seen=()
    while ((${#queue[@]})); do
        pid=${queue[0]}; queue=("${queue[@]:1}")
        [[ -n ${seen[$pid]:-} ]] && continue
        seen[$pid]=1; out+=("$pid")
        for f in "${!PARENT[@]}"; do
            [[ ${PARENT[$f]} == "$pid" ]] && queue+=("$f")
        done
    done
    printf '%s\n' "${out[@]}"
}

# "ticks rss_kb count" summed over the process tree of $1.
sample_tree() {
    local pid line rest ticks=0 rss=0 n=0
    local -a fields
    while read -r pid; do
        { read -r line <"/proc/$pid/stat"; } 2>/dev/null || continue
        rest=${line##*) }
        read -r -a fields <<<"$rest"
        # fields[0] is stat field 3 (state): utime=14 stime=15 cutime=16 cstime=17 rss=24
        ticks=$((ticks + fields[11] + fields[12] + fields[13] + fields[14]))
        rss=$((rss + fields[21] * PAGE_KB))
        n=$((n + 1))
    done < <(tree_pids "$1")
    echo "$ticks $rss $n"
}

now() { echo "${EPOCHREALTIME/./}"; }   # microseconds

CMD_PID=
SAMPLER_PID=
forward() {   # pass a signal on to every process of the command's tree, then keep waiting
    local sig=$1
    if [[ -n $CMD_PID ]] && kill -0 "$CMD_PID" 2>/dev/null; then
        # shellcheck disable=SC2046
        kill -TERM $(tree_pids "$CMD_PID") 2>/dev/null || true
    fi
    GOT_SIGNAL=$sig
}
cleanup() {
    [[ -n $SAMPLER_PID ]] && kill "$SAMPLER_PID" 2>/dev/null || true
}
GOT_SIGNAL=
trap 'forward INT' INT
trap 'forward TERM' TERM
trap 'forward HUP' HUP
trap cleanup EXIT

# The command keeps this shell's stdin (a background job would get /dev/null).
"$@" <&0 &
CMD_PID=$!

if [[ $MODE == gpu ]]; then
    nvidia-smi --query-gpu=timestamp,index,memory.total,memory.used,memory.free,utilization.gpu,utilization.memory \
        --format=csv -lms "$INTERVAL_MS" >"$OUT" &
    SAMPLER_PID=$!
else
    echo "timestamp,elapsed_s,cpu_percent,rss_mb,processes" >"$OUT"
    (
        trap - INT TERM HUP EXIT
        t0=$(now); t_prev=$t0
        read -r ticks_prev _ _ < <(sample_tree "$CMD_PID")
        while kill -0 "$CMD_PID" 2>/dev/null; do
            sleep "$INTERVAL_S"
            kill -0 "$CMD_PID" 2>/dev/null || break
            read -r ticks rss_kb nproc < <(sample_tree "$CMD_PID")
            t=$(now)
            dt=$((t - t_prev)); ((dt > 0)) || dt=1
            dticks=$((ticks - ticks_prev)); ((dticks >= 0)) || dticks=0
            # percent of one core, to 0.1: ticks / CLK_TCK / (dt / 1e6) * 100
            cpu10=$((dticks * 1000000000 / (CLK_TCK * dt)))
            el=$((t - t0))
            printf '%(%Y-%m-%dT%H:%M:%S)T,%d.%03d,%d.%d,%d.%d,%d\n' -1 \
                $((el / 1000000)) $((el % 1000000 / 1000)) $((cpu10 / 10)) $((cpu10 % 10)) \
                $((rss_kb / 1024)) $((rss_kb % 1024 * 10 / 1024)) "$nproc" >>"$OUT"
            ticks_prev=$ticks; t_prev=$t
        done
    ) &
    SAMPLER_PID=$!
fi

rc=0
while :; do
    wait "$CMD_PID" && rc=0 || rc=$?
    # wait returns >128 when a trapped signal interrupts it; the command may still run
    kill -0 "$CMD_PID" 2>/dev/null || break
done
if [[ $MODE == gpu ]]; then
    kill "$SAMPLER_PID" 2>/dev/null || true
fi
wait "$SAMPLER_PID" 2>/dev/null || true   # the /proc sampler stops by itself within one interval
SAMPLER_PID=
if [[ -n $GOT_SIGNAL && $rc -eq 0 ]]; then
    case $GOT_SIGNAL in INT) rc=130 ;; TERM) rc=143 ;; HUP) rc=129 ;; esac
fi
exit "$rc"
