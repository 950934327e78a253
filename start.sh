#!/usr/bin/env bash
# start.sh: benchmark every training backend of this project that can run on this machine.
# Run `bash start.sh -h` for the options. Outputs: results/benchmark.{csv,md,png} and, per
# backend, results/runs/NAME/{run.log,stats.csv,metrics.jsonl}.
set -euo pipefail

PROG=${0##*/}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$ROOT"

# the network benchmark's defaults: communication-bound rows at both rates, a 4-host row (at 32 px:
# 4 processes share 2 cores), and at 224 px a row whose all-reduce is shorter than its backward
# pass at 1gbit; the DDP rows beside their no-overlap baseline
NET_LINKS=300mbit,1gbit
NET_ROWS=distributed,distributed+onebucket,distributed+bf16,distributed+accum4,multiprocessing,apex
NET_ROWS+=,fsdp,distributed+4hosts+32px,distributed+224px,distributed+224px+onebucket
usage() {
    cat <<EOF
Usage: [VAR=value ...] bash $PROG [-h] [-o RESULTS_DIR] [-e EPOCHS] [-b BATCH] [-j WORKERS] [--only a,b,...]
       [VAR=value ...] bash $PROG --hosts N [--link RATE,...] [--rows ROW,...] [--steps N] [-o DIR] [-b BATCH]

Trains with each backend in turn, each under statistics.sh, and writes
RESULTS_DIR/benchmark.csv, benchmark.md and benchmark.png (default RESULTS_DIR: results).
Backends: dataparallel, distributed (torchrun), distributed-launch (python -m
torch.distributed.launch), multiprocessing (mp.spawn), apex (torchrun, --amp auto: mixed
precision + channels_last where the hardware runs it natively, else fp32), fsdp (torchrun
fsdp_distributed.py: FSDP2, each process holding 1/N of the parameters, gradients and momentum;
tools/fsdp_memory.py measures the memory it saves), horovod (horovodrun, when horovod.torch
imports), slurm (srun, when sinfo shows an idle node).
Those that cannot run are listed with the reason. On CPU, the report tool first measures
the matmul peak, for the MFU column.

CPU (default without GPUs): ResNet-18, 224 px, global batch 32, demo JPEGs (data/demo,
made if absent), EPOCHS=1, WORKERS=1 loader process per training process, PROCS=2
processes x (nproc / PROCS) threads for the multi-process backends, one process x nproc
threads for dataparallel. A full run takes about 5 minutes on 2 cores.

ImageNet-shaped data: DATA=data/imagenet-shaped bash $PROG makes it if absent (1000 classes,
20 training and 5 validation JPEGs per class, ImageNet's image and file sizes; a few minutes
on 2 cores; tools/make_demo_data.py --imagenet). On CPU, IMAGE_SIZE=64 keeps an epoch short.
Before the runs, tools/loader_bench.py --quick times one loader process on DATA; the table's
"loader img/s per core" column shows it, and "loader cores needed" the cores each run's loader
workers need in all to keep up (divide by the GPUs for cores per GPU).

GPU nodes: DATA=/path/to/imagenet GPUS=0,1,2,3 bash $PROG
  one process per GPU (DataParallel: one process driving all of them), nccl; defaults
  ResNet-18, 224 px, global batch 256 (64 per GPU with 4 GPUs), EPOCHS=1,
  WORKERS=min(8, nproc / GPUs) per process, statistics from nvidia-smi. Without GPUS,
  every GPU that nvidia-smi -L lists is used; GPUS=none forces the CPU configuration.

Across test hosts over shaped links (as root; RESULTS_DIR/benchmark-network.{csv,md}):
  bash $PROG --hosts 2 --link 300mbit,1gbit
  N test hosts (tools/hosts.sh: network namespaces on this machine, HOSTS_PREFIX nb, HOSTS_NET
  10.213.9), one training process in each, every host's eth0 shaped with tc to each RATE in turn
  (kbit, mbit or gbit; 'unshaped' for the bare virtual link). Per rate, tools/allreduce_bench.py
  measures the link first (from 2 to the most hosts a row uses); then each row runs at each rate,
  and once in one process (one host) with the same work per process. A row is a backend
  (distributed, apex, fsdp, multiprocessing) with optional +TAGs: bf16 or fp16
  (--grad-compression), accumK (--gradient-accumulation-steps K, global batch x K: the same
  micro-batch per process), SIZEpx (--image-size SIZE), Mhosts (M hosts instead of N, the same
  micro-batch per process), onebucket (DDP's gradients in one bucket: no overlap with the backward
  pass), timeline (tools/scaling_model.py timeline: each DDP bucket's all-reduce timed, per rank,
  in the row's folder), or a script option as one word (distributed+--amp=bf16).
  tools/scaling_model.py measures one process's compute first, and the report sets its
  predictions beside the measured images/s. Defaults: ResNet-18, 64 px, global batch 16 (8 per
  process), STEPS=8 steps (the first 2 left out of images/s), -j 0, links $NET_LINKS, rows
  $NET_ROWS.
  About 10 minutes on 2 cores.

Options and environment (flags win over environment):
  -o DIR        RESULTS (default: results)
  -e N          EPOCHS (last epoch is reported)
  -b N          BATCH, global batch
  -j N          WORKERS, data loader processes per training process
  --only LIST   BACKENDS, comma-separated subset of the names above
  --hosts N     NHOSTS: the benchmark across N test hosts (above)
  --link LIST   LINKS, rates for --hosts
  --rows LIST   ROWS, rows for --hosts
  --steps N     STEPS, training steps per run with --hosts
  HOSTS_PREFIX, HOSTS_NET  the test hosts' names and /24 with --hosts (default nb, 10.213.9)
  ALLREDUCE_MAX the largest all-reduce tools/allreduce_bench.py times per link with --hosts (16M)
  NET_TIMEOUT   seconds one run may take with --hosts before it counts as failed (900)
  NET_FIT       with --hosts: a results folder of an earlier --hosts run at one rate; the report's
                predictions are then out of sample, fitted on that run (docs/scaling.md)
  DATA, ARCH (resnet18), IMAGE_SIZE (224), PROCS, GPUS, PRINT_FREQ,
  PYTHON (default: .venv/bin/python if present, else python3), TORCHRUN
  PEAK_TFLOPS   peak TFLOP/s of the hardware one run uses, in all, for the MFU column (default: on
                GPUs, the dense bf16 tensor-core peak of the GPUs used, from a table by nvidia-smi
                name, in tools/benchmark_report.py; on CPU, the matmul peak its cpu-peak
                measures first, in the precision each run used)
EOF
}

die() { echo "$PROG: $*" >&2; exit 2; }

# The command that reproduces this run, for the report: the settings that came through the
# environment (they change the results as much as the flags do), then the flags.
shell_word() {  # $1 as the shell reads it back: bare when safe, else quoted
    if [[ $1 =~ ^[A-Za-z0-9_./,:=+@%-]+$ ]]; then printf '%s' "$1"; else printf '%q' "$1"; fi
}
CMDLINE=
for v in ONEDNN_MAX_CPU_ISA ATEN_CPU_CAPABILITY \
         DATA ARCH IMAGE_SIZE PROCS GPUS EPOCHS BATCH WORKERS PRINT_FREQ BACKENDS RESULTS PEAK_TFLOPS \
         NHOSTS LINKS ROWS STEPS HOSTS_PREFIX HOSTS_NET ALLREDUCE_MAX NET_FIT; do
    [[ -n ${!v+set} ]] && CMDLINE+="$v=$(shell_word "${!v}") "
done
CMDLINE+="bash $PROG"
for a in "$@"; do CMDLINE+=" $(shell_word "$a")"; done
RESULTS=${RESULTS:-results}
BACKENDS=${BACKENDS:-dataparallel,distributed,distributed-launch,multiprocessing,apex,fsdp,horovod,slurm}
while (($#)); do
    case $1 in
        -h|--help) usage; exit 0 ;;
        -o) (($# >= 2)) || die "-o needs a value"; RESULTS=$2; shift 2 ;;
        -e) (($# >= 2)) || die "-e needs a value"; EPOCHS=$2; shift 2 ;;
        -b) (($# >= 2)) || die "-b needs a value"; BATCH=$2; shift 2 ;;
        -j) (($# >= 2)) || die "-j needs a value"; WORKERS=$2; shift 2 ;;
        --only) (($# >= 2)) || die "--only needs a value"; BACKENDS=$2; BACKENDS_GIVEN=1; shift 2 ;;
        --hosts) (($# >= 2)) || die "--hosts needs a value"; NHOSTS=$2; shift 2 ;;
        --link) (($# >= 2)) || die "--link needs a value"; LINKS=$2; shift 2 ;;
        --rows) (($# >= 2)) || die "--rows needs a value"; ROWS=$2; shift 2 ;;
        --steps) (($# >= 2)) || die "--steps needs a value"; STEPS=$2; shift 2 ;;
        *) die "unknown argument '$1' (see -h)" ;;
    esac
done

if [[ -z ${PYTHON:-} ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=$(command -v python3); fi
fi
if [[ -z ${TORCHRUN:-} ]]; then
    if [[ -x $(dirname "$PYTHON")/torchrun ]]; then TORCHRUN=$(dirname "$PYTHON")/torchrun; else TORCHRUN=torchrun; fi
fi
CORES=$(nproc)

# ---- configuration: across test hosts, GPU node or CPU ----
if [[ -n ${NHOSTS:-} ]]; then
    [[ $NHOSTS =~ ^[0-9]+$ ]] && ((NHOSTS >= 2 && NHOSTS <= 16)) || die "--hosts wants 2 to 16 hosts, not '$NHOSTS'"
    # the hosts share this machine's CPUs: one process each, gloo, the CPU configuration below; small
    # images, so that a step's compute and its all-reduce at 100mbit to 1gbit span comm- to compute-bound
    GPUS=none
    IMAGE_SIZE=${IMAGE_SIZE:-64}
    BATCH=${BATCH:-16}
    WORKERS=${WORKERS:-0}  # the loader in the training process: no second process contends for its core
    PRINT_FREQ=${PRINT_FREQ:-1}
    STEPS=${STEPS:-8}
    LINKS=${LINKS:-$NET_LINKS}
    ROWS=${ROWS:-$NET_ROWS}
    [[ $STEPS =~ ^[0-9]+$ ]] && ((STEPS >= 3)) || die "--steps wants 3 or more (2 are warm-up), not '$STEPS'"
    for rate in ${LINKS//,/ }; do
        [[ $rate == unshaped || $rate =~ ^[0-9]+(\.[0-9]+)?(kbit|mbit|gbit)$ ]] ||
            die "--link: '$rate' is not a rate such as 100mbit or 1gbit, or unshaped"
    done
    [[ -n ${LINKS//,/} ]] || die "--link needs at least one rate"
    [[ -n ${ROWS//,/} ]] || die "--rows needs at least one row"
    [[ -z ${NET_FIT:-} || -f $NET_FIT/benchmark-network.csv ]] || die "NET_FIT=$NET_FIT: no benchmark-network.csv there"
    [[ -z ${BACKENDS_GIVEN:-} && ${EPOCHS:-1} == 1 ]] || die "--only and -e do not go with --hosts: --rows and --steps do that"
elif [[ -n ${LINKS:-}${ROWS:-}${STEPS:-} ]]; then
    die "--link, --rows and --steps go with --hosts N"
fi
if [[ -z ${GPUS+set} ]] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep '^GPU' >/dev/null; then  # not grep -q: under pipefail its early exit can fail nvidia-smi with SIGPIPE
    GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, -)
fi
GPUS=${GPUS:-none}
if [[ $GPUS != none ]]; then
    MODE=gpu
    IFS=, read -r -a GPU_LIST <<<"$GPUS"
    NGPU=${#GPU_LIST[@]}
    export CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=$GPUS  # nvidia-smi's indices, in the same order
    PROCS=$NGPU
    THREADS=$(((CORES / NGPU) > 0 ? CORES / NGPU : 1))
    DP_THREADS=0                    # 0: PyTorch's default
    BATCH=${BATCH:-256}
    w=$((CORES / NGPU)); ((w > 8)) && w=8; ((w < 1)) && w=1
    WORKERS=${WORKERS:-$w}
    PRINT_FREQ=${PRINT_FREQ:-20}
    DATA=${DATA:-data/demo}
    SHAPE_DP="1 process x $NGPU GPUs"
else
    MODE=cpu
    export CUDA_VISIBLE_DEVICES=""  # the CPU configuration, even on a machine with GPUs
    NGPU=0
    PROCS=${PROCS:-2}
    THREADS=$(((CORES / PROCS) > 0 ? CORES / PROCS : 1))
    DP_THREADS=$CORES
    BATCH=${BATCH:-32}
    WORKERS=${WORKERS:-1}
    PRINT_FREQ=${PRINT_FREQ:-5}
    DATA=${DATA:-data/demo}
    SHAPE_DP="1 process x $CORES threads"
fi
ARCH=${ARCH:-resnet18}
IMAGE_SIZE=${IMAGE_SIZE:-224}
EPOCHS=${EPOCHS:-1}
for v in EPOCHS BATCH WORKERS PROCS IMAGE_SIZE PRINT_FREQ; do
    [[ ${!v} =~ ^[0-9]+$ ]] || die "$v must be a number, not '${!v}'"
done
if [[ -n ${PEAK_TFLOPS:-} ]]; then
    [[ $PEAK_TFLOPS =~ ^[0-9]*\.?[0-9]+$ && ! $PEAK_TFLOPS =~ ^[0.]+$ ]] ||
        die "PEAK_TFLOPS must be a positive number of TFLOP/s, not '$PEAK_TFLOPS'"
    export PEAK_TFLOPS
fi

free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

IS_TTY=0
[[ -t 1 ]] && IS_TTY=1
CHILD=
on_signal() {
    [[ -n $CHILD ]] && kill -TERM "$CHILD" 2>/dev/null || true
    [[ -n $CHILD ]] && wait "$CHILD" 2>/dev/null || true
    ((IS_TTY)) && printf '\n'
    echo "$PROG: interrupted" >&2
    exit 130
}
trap on_signal INT TERM

record() {  # name label status procs threads gpus rc wall command-or-reason
    local IFS=$'\t'
    echo "$*" >>"$MANIFEST"
}

skip() {  # name label reason
    printf '%-20s not run: %s\n' "$1" "$3"
    record "$1" "$2" skipped - - - - - "$3"
}

progress_text() {  # name log start-seconds
    local name=$1 log=$2 start=$3 line ep step n sps ips el status
    el=$((SECONDS - start))
    line=$(grep -a -o 'Epoch \[[0-9]*\]\[[0-9]*/[0-9]*\].*s/step' "$log" 2>/dev/null | tail -n 1 || true)
    if [[ $line =~ Epoch\ \[([0-9]+)\]\[([0-9]+)/([0-9]+)\].*\ ([0-9.]+)\ s/step ]]; then
        ep=${BASH_REMATCH[1]}; step=${BASH_REMATCH[2]}; n=${BASH_REMATCH[3]}; sps=${BASH_REMATCH[4]}
        ips=$(awk -v b="${PROGRESS_BATCH:-$BATCH}" -v s="$sps" 'BEGIN { if (s > 0) printf "%.1f", b / s; else print "?" }')
        status="epoch $((ep + 1))/$EPOCHS  step $step/$n  $ips img/s"
        if ((step == n)); then
            if grep -aq ' \* Acc@1' "$log" && (($(grep -ac ' \* Acc@1' "$log") > ep)); then
                status="epoch $((ep + 1))/$EPOCHS  done  $ips img/s"
            else
                status="epoch $((ep + 1))/$EPOCHS  validating  $ips img/s"
            fi
        fi
    else
        status="starting"
    fi
    printf '%-20s %-48s %3d:%02d' "$name" "$status" $((el / 60)) $((el % 60))
}

FAILED=0
run_backend() {  # name label procs threads gpus -- command...
    local name=$1 label=$2 procs=$3 threads=$4 gpus=$5
    shift 6
    local dir=$RUNS/$name start=$SECONDS rc=0 text last=""
    mkdir -p "$dir"
    local -a cmd=("$@" --output-dir "$dir")
    printf '%q ' "${cmd[@]}" >"$dir/command.txt"
    bash "$ROOT/statistics.sh" -o "$dir/stats.csv" -i 500 -- "${cmd[@]}" >"$dir/run.log" 2>&1 </dev/null &
    CHILD=$!
    while kill -0 "$CHILD" 2>/dev/null; do
        text=$(progress_text "$name" "$dir/run.log" "$start")
        if ((IS_TTY)); then
            printf '\r\033[K%s' "$text"
        elif [[ ${text% *} != "${last% *}" ]]; then
            echo "$text"
        fi
        last=$text
        sleep 1
    done
    wait "$CHILD" || rc=$?
    CHILD=
    local wall=$((SECONDS - start))
    text=$(progress_text "$name" "$dir/run.log" "$start")
    if ((IS_TTY)); then printf '\r\033[K'; fi
    if ((rc == 0)); then
        if ((IS_TTY)) || [[ ${text% *} != "${last% *}" ]]; then echo "$text"; fi
        record "$name" "$label" ok "$procs" "$threads" "$gpus" "$rc" "$wall" "$(cat "$dir/command.txt")"
    else
        echo "$name: FAILED with exit status $rc after ${wall}s; last lines of $dir/run.log:"
        tail -n 15 "$dir/run.log" | sed 's/^/    /'
        record "$name" "$label" failed "$procs" "$threads" "$gpus" "$rc" "$wall" "$(cat "$dir/command.txt")"
        FAILED=1
    fi
}

wanted() { [[ ,$BACKENDS, == *",$1,"* ]]; }

if [[ -n ${NHOSTS:-} ]]; then  # the benchmark across test hosts: its own data, runs and report
    source "$ROOT/tools/netbench.sh"
    network_benchmark  # exits
fi

if [[ $DATA == data/demo && ! -d data/demo ]]; then
    echo "$PROG: creating the demo data set in data/demo"
    "$PYTHON" tools/make_demo_data.py --out data/demo
fi
if [[ $DATA == data/imagenet-shaped && ! -d data/imagenet-shaped ]]; then
    echo "$PROG: creating the ImageNet-shaped data set in data/imagenet-shaped (a few minutes)"
    "$PYTHON" tools/make_demo_data.py --imagenet --out data/imagenet-shaped --train-images 20000 --val-images 5000
fi
[[ -d $DATA ]] || die "data folder $DATA does not exist"
# one loader process's images/s per core on this data: the scripts' decode + training transform
LOADER_IPS=$("$PYTHON" -W ignore tools/loader_bench.py --data "$DATA" --paths tv --quick --images 200 --rounds 1 \
             --image-size "$IMAGE_SIZE" 2>/dev/null) || LOADER_IPS=""
[[ $LOADER_IPS =~ ^[0-9]+$ ]] || LOADER_IPS=""

RUNS=$RESULTS/runs
rm -rf -- "$RUNS"
mkdir -p "$RUNS"
MANIFEST=$RUNS/manifest.tsv
: >"$MANIFEST"

COMMON=(--data "$DATA" -a "$ARCH" -b "$BATCH" --epochs "$EPOCHS" -j "$WORKERS" --image-size "$IMAGE_SIZE"
        -p "$PRINT_FREQ")
THREAD_ARGS=()
[[ $MODE == cpu ]] && THREAD_ARGS=(--threads "$THREADS")


LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
if [[ $MODE == gpu ]]; then
    CONFIG="$ARCH, ${IMAGE_SIZE}px, global batch $BATCH, $EPOCHS epoch(s), $DATA, GPUs $GPUS (one process each, nccl), -j $WORKERS per process"
    DP_SHAPE=(1 - "$GPUS"); MP_SHAPE=("$PROCS" - "$GPUS")
else
    CONFIG="$ARCH, ${IMAGE_SIZE}px, global batch $BATCH, $EPOCHS epoch(s), $DATA, CPU: $PROCS processes x $THREADS thread(s) (dataparallel: 1 x $DP_THREADS), -j $WORKERS per process, gloo"
    DP_SHAPE=(1 "$DP_THREADS" -); MP_SHAPE=("$PROCS" "$THREADS" -)
fi
echo "$PROG: $CONFIG"
echo "$PROG: load average before: $LOAD_BEFORE; logs in $RUNS/"
echo "$PROG: data loader: ${LOADER_IPS:-?} images/s per core on $DATA (tools/loader_bench.py --quick)"
if awk -v l="${LOAD_BEFORE%% *}" -v c="$CORES" 'BEGIN { exit !(l > c / 2) }'; then
    echo "$PROG: warning: the machine is busy (load ${LOAD_BEFORE%% *} on $CORES cores): other processes' CPU use" \
         "will lower and skew images/s; the 'images per core-s' column is less sensitive to it" >&2
fi
if [[ $MODE == cpu ]]; then  # the CPU's capability and matmul peak at the runs' thread counts, for MFU
    "$PYTHON" tools/benchmark_report.py cpu-peak --threads "$THREADS,$DP_THREADS" --json "$RUNS/cpu_peak.json" |
        sed "s/^/$PROG: /"
fi
T0=$SECONDS

DP_ARGS=()
[[ $MODE == cpu ]] && DP_ARGS=(--threads "$DP_THREADS")
# DataParallel's one process feeds every GPU: it gets the loader workers of all of them
[[ $MODE == gpu ]] && DP_ARGS=(-j $((WORKERS * NGPU > CORES ? CORES : WORKERS * NGPU)))
wanted dataparallel && run_backend dataparallel "python dataparallel.py ($SHAPE_DP)" "${DP_SHAPE[@]}" -- \
    "$PYTHON" dataparallel.py "${COMMON[@]}" "${DP_ARGS[@]}"
wanted distributed && run_backend distributed "torchrun distributed.py" "${MP_SHAPE[@]}" -- \
    "$TORCHRUN" --standalone --nproc_per_node="$PROCS" distributed.py "${COMMON[@]}" "${THREAD_ARGS[@]}"
# apex right after dataparallel and distributed: the three runs the bars compare go first, back to back
wanted apex && run_backend apex "torchrun apex_distributed.py (--amp auto)" "${MP_SHAPE[@]}" -- \
    "$TORCHRUN" --standalone --nproc_per_node="$PROCS" apex_distributed.py "${COMMON[@]}" "${THREAD_ARGS[@]}"
wanted distributed-launch && run_backend distributed-launch "python -m torch.distributed.launch distributed.py" \
    "${MP_SHAPE[@]}" -- "$PYTHON" -m torch.distributed.launch --nproc_per_node="$PROCS" --master_addr=127.0.0.1 \
    --master_port="$(free_port)" distributed.py "${COMMON[@]}" "${THREAD_ARGS[@]}"
wanted multiprocessing && run_backend multiprocessing "multiprocessing_distributed.py --nprocs $PROCS (mp.spawn)" \
    "${MP_SHAPE[@]}" -- "$PYTHON" multiprocessing_distributed.py --nprocs "$PROCS" "${COMMON[@]}" "${THREAD_ARGS[@]}"
wanted fsdp && run_backend fsdp "torchrun fsdp_distributed.py (FSDP2)" "${MP_SHAPE[@]}" -- \
    "$TORCHRUN" --standalone --nproc_per_node="$PROCS" fsdp_distributed.py "${COMMON[@]}" "${THREAD_ARGS[@]}"

if wanted horovod; then
    HVDRUN=$(dirname "$PYTHON")/horovodrun
    [[ -x $HVDRUN ]] || HVDRUN=$(command -v horovodrun || true)
    if ! "$PYTHON" -c 'import horovod.torch' >/dev/null 2>&1; then
        skip horovod "horovodrun" "horovod: not installed — PYTHON=$PYTHON bash tools/install-horovod.sh"
    elif [[ -z $HVDRUN ]]; then
        skip horovod "horovodrun" "horovod: horovod.torch imports but horovodrun is not on PATH"
    else
        HVD_ARGS=(-np "$PROCS" -H "localhost:$PROCS")
        [[ $MODE == cpu ]] && HVD_ARGS+=(--gloo)
        run_backend horovod "horovodrun ${HVD_ARGS[*]}" "${MP_SHAPE[@]}" -- \
            "$HVDRUN" "${HVD_ARGS[@]}" "$PYTHON" horovod_distributed.py "${COMMON[@]}" "${THREAD_ARGS[@]}"
    fi
fi

if wanted slurm; then
    if ! command -v sinfo >/dev/null 2>&1 || ! command -v srun >/dev/null 2>&1; then
        skip slurm "srun" "slurm: no cluster (sinfo/srun not installed) — bash tools/slurm-local.sh up"
    elif ! SINFO=$(timeout 15 sinfo -h -o '%T %D %n' 2>&1); then
        skip slurm "srun" "slurm: no cluster (sinfo: ${SINFO//$'\n'/ }) — bash tools/slurm-local.sh up"
    elif ! grep -q '^idle' <<<"$SINFO"; then
        skip slurm "srun" "slurm: no idle node (sinfo: ${SINFO//$'\n'/; }) — bash tools/slurm-local.sh up"
    else
        SRUN_ARGS=(-N1 -n"$PROCS" --kill-on-bad-exit=1)
        [[ $MODE == cpu ]] && SRUN_ARGS+=(--cpus-per-task="$THREADS")
        [[ $MODE == gpu ]] && SRUN_ARGS+=(--gpus-per-node="$NGPU")  # all of the node's GPUs visible to each task
        run_backend slurm "srun ${SRUN_ARGS[*]}" "${MP_SHAPE[@]}" -- \
            srun "${SRUN_ARGS[@]}" "$PYTHON" distributed_slurm_main.py "${COMMON[@]}" "${THREAD_ARGS[@]}"
    fi
fi

WALL=$((SECONDS - T0))
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)
echo "$PROG: all runs took ${WALL}s; load average after: $LOAD_AFTER"
"$PYTHON" tools/benchmark_report.py --results "$RESULTS" --wall "$WALL" --config "$CONFIG" \
    --arch "$ARCH" --image-size "$IMAGE_SIZE" \
    --command "${START_COMMAND:-$CMDLINE}" --title "$( [[ $MODE == gpu ]] && echo "GPU ($GPUS)" || echo "CPU ($CORES cores)")" \
    --load-before "$LOAD_BEFORE" --load-after "$LOAD_AFTER" ${LOADER_IPS:+--loader-ips "$LOADER_IPS"}
exit "$FAILED"
