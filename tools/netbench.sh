# netbench.sh: the network benchmark of start.sh (bash start.sh --hosts N --link RATES; docs/benchmark.md),
# sourced by start.sh after its configuration. Each process runs in a test host of tools/hosts.sh (a network
# namespace) whose eth0 is shaped with tc to the rate under test; network_benchmark lists the steps.
#
# Uses from start.sh: PROG ROOT PYTHON TORCHRUN RESULTS ARCH IMAGE_SIZE BATCH WORKERS PRINT_FREQ CORES
# CMDLINE FAILED IS_TTY, die, progress_text, record (to MANIFEST), NHOSTS LINKS ROWS STEPS set by its options, NET_FIT.

NET_PREFIX=${HOSTS_PREFIX:-nb}      # our own set of hosts, apart from the tests' node0, node1, ...
NET_NET=${HOSTS_NET:-10.213.9}
NET_TIMEOUT=${NET_TIMEOUT:-900}     # seconds any one run may take: a hang shows as a failure
NET_VAL_IMAGES=16
ALLREDUCE_MAX=${ALLREDUCE_MAX:-16M}  # the largest all-reduce timed per link: enough to fit its bandwidth
BACKENDS_NET="distributed apex fsdp multiprocessing"

hosts_sh() { HOSTS_PREFIX=$NET_PREFIX HOSTS_NET=$NET_NET bash "$ROOT/tools/hosts.sh" "$@"; }
shape() { hosts_sh shape "${1/#unshaped/off}" >/dev/null 2>&1 || die "could not shape the hosts' links to $1"; }
host() { echo "$NET_PREFIX$1"; }

# ---- rows: BACKEND[+TAG...], the tags as docs/benchmark.md lists them ----
# Sets R_BACKEND, R_SCRIPT, R_K, R_SIZE, R_HOSTS, R_WRAP and R_ARGS (arrays).
parse_row() {
    local row=$1 tag one=0 timed=0
    local -a parts
    IFS=+ read -r -a parts <<<"$row"
    R_BACKEND=${parts[0]:-}
    R_K=1 R_SIZE=$IMAGE_SIZE R_HOSTS=$NHOSTS
    R_ARGS=() R_WRAP=()
    case $R_BACKEND in
        distributed) R_SCRIPT=distributed.py ;;
        apex | fsdp | multiprocessing) R_SCRIPT=${R_BACKEND}_distributed.py ;;
        *) die "row '$row': '$R_BACKEND' does not run across hosts here (one of: ${BACKENDS_NET// /, })" ;;
    esac
    for tag in "${parts[@]:1}"; do
        case $tag in
            bf16 | fp16) R_ARGS+=(--grad-compression "$tag") ;;
            accum*)
                R_K=${tag#accum}
                [[ $R_K =~ ^[1-9][0-9]*$ ]] || die "row '$row': '$tag' is not accumK with K a whole number >= 1"
                R_ARGS+=(--gradient-accumulation-steps "$R_K") ;;
            [1-9]*px) R_SIZE=${tag%px} ;;
            [1-9]*hosts)
                R_HOSTS=${tag%hosts}
                [[ $R_HOSTS =~ ^[0-9]+$ ]] && ((R_HOSTS >= 2 && R_HOSTS <= 16)) || die "row '$row': '$tag' wants 2 to 16 hosts" ;;
            onebucket | timeline)
                [[ $R_BACKEND == distributed || $R_BACKEND == apex ]] || die "row '$row': $tag is for torchrun's DDP rows"
                [[ $tag == onebucket ]] && one=1 || timed=1 ;;
            -*) R_ARGS+=("$tag") ;;
            *) die "row '$row': unknown tag '$tag' (bf16, fp16, accumK, SIZEpx, Mhosts, onebucket, timeline, or a script option such as +--amp=bf16)" ;;
        esac
    done
    ((timed)) && R_WRAP=(tools/scaling_model.py timeline) && ((one)) && R_WRAP+=(--one-bucket)
    ((one && !timed)) && R_WRAP=(tools/scaling_model.py one-bucket)
    [[ $R_SIZE =~ ^[0-9]+$ ]] || die "row '$row': '${R_SIZE}px' is not SIZEpx"
}

# The one-process run a row is compared with: the same script and tags but those of the hosts (Mhosts,
# onebucket, timeline), except that mp.spawn's, which runs distributed.py's DDP step, and FSDP's, which in one
# process shards nothing, are distributed.py's.
ref_of() {
    local backend=${1%%+*} tag ref
    local -a parts
    IFS=+ read -r -a parts <<<"$1"
    [[ $backend == apex ]] && ref=apex || ref=distributed
    for tag in "${parts[@]:1}"; do
        [[ $tag == onebucket || $tag == timeline || $tag == *hosts ]] || ref+=+$tag
    done
    echo "$ref"
}

# ---- data: a set per global batch, STEPS steps an epoch ----
net_data() {  # global batch -> the folder (made if absent)
    local gb=$1 dir
    dir=data/netbench/train$((STEPS * gb))
    if [[ ! -f $dir/DEMO_DATA.txt ]]; then
        "$PYTHON" tools/make_demo_data.py --out "$dir" --train-images $((STEPS * gb)) --val-images "$NET_VAL_IMAGES" \
            --force >/dev/null || die "could not make the data set $dir"
    fi
    echo "$dir"
}

# ---- one run: a command per host, at once; waits for all, within NET_TIMEOUT ----
NET_PIDS=()
NET_TAG=
kill_run() {  # everything still running of the current run: what we started, and what it started in our hosts
    local tag=$NET_TAG pid h
    [[ -n $tag ]] || return 0
    for pid in "${NET_PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true; done
    for ((h = 0; h < NET_HOSTS_UP; h++)); do  # torchrun's workers run in sessions of their own: by tag
        for pid in $(ip netns pids "$(host "$h")" 2>/dev/null); do
            grep -qaF -- "$tag" "/proc/$pid/cmdline" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
        done
    done
    NET_PIDS=()
}

NET_PORT=29400
run_hosts() {  # name rate ref procs threads dir result -- command-for-host-0 [-- command-for-host-1 ...]
    # result: the file a run that worked leaves (- for DIR/metrics.jsonl)
    local name=$1 rate=$2 ref=$3 procs=$4 threads=$5 dir=$6 result=$7 start=$SECONDS rc=0 h=0 text last=""
    local label="$1 @ $2" cmdtext="" one status=ok  # cmdtext: the commands, '; ' between them
    shift 8
    [[ $result == - ]] && result=$dir/metrics.jsonl
    local -a cmd
    mkdir -p "$dir"
    NET_TAG=$dir
    while (($#)); do
        cmd=()
        while (($#)) && [[ $1 != -- ]]; do cmd+=("$1"); shift; done
        (($#)) && shift
        cmd=(tools/hosts.sh exec "$(host "$h")" "${cmd[@]}")
        printf -v one '%q ' "${cmd[@]}"
        cmdtext="${cmdtext:+${cmdtext% }; }$one"
        HOSTS_PREFIX=$NET_PREFIX HOSTS_NET=$NET_NET setsid "${cmd[@]}" >"$dir/host$h.log" 2>&1 </dev/null &
        NET_PIDS+=($!)
        h=$((h + 1))
    done
    while :; do
        local alive=0 pid
        for pid in "${NET_PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        ((alive)) || break
        if ((SECONDS - start > NET_TIMEOUT)); then
            rc=124
            break
        fi
        text=$(progress_text "$label" "$dir/host0.log" "$start")
        if ((IS_TTY)); then printf '\r\033[K%s' "$text"; elif [[ ${text% *} != "${last% *}" ]]; then echo "$text"; fi
        last=$text
        sleep 1
    done
    if ((rc == 0)); then
        for pid in "${NET_PIDS[@]}"; do wait "$pid" || rc=$?; done
    fi
    kill_run
    NET_TAG=
    local wall=$((SECONDS - start))
    ((IS_TTY)) && printf '\r\033[K'
    if ((rc == 0)) && [[ -s $result ]]; then
        text=$(progress_text "$label" "$dir/host0.log" "$start")
        if ((IS_TTY)) || [[ ${text% *} != "${last% *}" ]]; then echo "$text"; fi
    else
        ((rc == 124)) && echo "$label: TIMED OUT after ${NET_TIMEOUT}s (NET_TIMEOUT)" ||
            echo "$label: FAILED with exit status $rc after ${wall}s; last lines of $dir/host*.log:"
        for f in "$dir"/host*.log; do tail -n 8 "$f" | sed "s|^|    ${f##*/}: |"; done
        status=failed FAILED=1
    fi
    record "$name" "$rate" "$ref" "$status" "$procs" "$threads" "$rc" "$wall" "$cmdtext"
}

# ---- the rows' launchers across the hosts ----
each_host() {  # hosts word...: ALL, the command for each host in turn, @H in a word its index
    local n=$1 h word
    shift
    ALL=()
    for ((h = 0; h < n; h++)); do
        ((h > 0)) && ALL+=(--)
        for word in "$@"; do ALL+=("${word//@H/$h}"); done
    done
}

torchrun_all() {  # hosts port command...: torchrun on every host, static rendezvous at host 0 by name
    each_host "$1" "$TORCHRUN" --nnodes="$1" --nproc_per_node=1 --node-rank=@H --master-addr="$(host 0)" \
        --master-port="$2" "${@:3}"
}

launch_row() {  # name rate dir script-args...: the row of R_* at one rate, across R_HOSTS hosts
    local name=$1 rate=$2 dir=$3
    shift 3
    case $R_BACKEND in
        distributed | apex | fsdp)
            torchrun_all "$R_HOSTS" $((NET_PORT++)) "${R_WRAP[@]}" "$R_SCRIPT" "$@" --output-dir "$dir" ;;
        multiprocessing)  # the script on every host, node rank --rank, rendezvous at host 0
            each_host "$R_HOSTS" "$PYTHON" "$R_SCRIPT" --world-size "$R_HOSTS" --rank @H --nprocs 1 \
                --dist-url "tcp://$(host 0):$((NET_PORT++))" "$@" --output-dir "$dir" ;;
    esac
    run_hosts "$name" "$rate" "$(ref_of "$name")" "$R_HOSTS" "$THREADS" "$dir" - -- "${ALL[@]}"
}

# ---- the benchmark ----
NET_MADE_HOSTS=0
net_cleanup() {
    kill_run
    if [[ -n ${NET_UP:-} ]]; then
        hosts_sh shape off >/dev/null 2>&1 || true
        ((NET_MADE_HOSTS)) && hosts_sh down >/dev/null 2>&1 || true
    fi
}

net_on_signal() {
    ((IS_TTY)) && printf '\n'
    echo "$PROG: interrupted; cleaning up the test hosts" >&2
    net_cleanup
    exit 130
}

network_benchmark() {
    local row rate n size most=$NHOSTS fsdp=0
    local -A sizes=()
    for row in ${ROWS//,/ }; do  # bad rows fail here, before anything starts
        parse_row "$row"
        ((R_HOSTS > most)) && most=$R_HOSTS
        [[ $R_BACKEND == fsdp ]] && fsdp=1
        sizes[$R_SIZE]=1
    done
    ((BATCH % NHOSTS == 0)) || die "the global batch $BATCH does not split over $NHOSTS hosts (-b)"
    [[ $EUID -eq 0 ]] || die "--hosts needs root: the test hosts are network namespaces (tools/hosts.sh)"
    command -v tc >/dev/null || die "--hosts needs tc (apt-get install iproute2)"
    LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
    THREADS=$(((CORES / NHOSTS) > 0 ? CORES / NHOSTS : 1))
    local micro=$((BATCH / NHOSTS))  # images per process and micro-batch, in every row

    RUNS=$RESULTS/runs-network
    rm -rf -- "$RUNS"
    mkdir -p "$RUNS"
    MANIFEST=$RUNS/manifest.tsv
    : >"$MANIFEST"
    trap net_on_signal INT TERM
    trap net_cleanup EXIT

    hosts_sh status >/dev/null 2>&1 || NET_MADE_HOSTS=1
    hosts_sh up "$most" 2>&1 | sed "s/^/$PROG: /"
    ((PIPESTATUS[0] == 0)) || die "could not make the test hosts (HOSTS_PREFIX=$NET_PREFIX HOSTS_NET=$NET_NET)"
    NET_UP=1 NET_HOSTS_UP=$most

    local data classes
    data=$(net_data "$BATCH")
    LOADER_IPS=$("$PYTHON" -W ignore tools/loader_bench.py --data "$data" --paths tv --quick --images 200 --rounds 1 \
                 --image-size "$IMAGE_SIZE" 2>/dev/null) || LOADER_IPS=""
    [[ $LOADER_IPS =~ ^[0-9]+$ ]] || LOADER_IPS=""
    classes=$(find "$data/train" -mindepth 1 -maxdepth 1 -type d | wc -l)
    CONFIG="$ARCH, ${IMAGE_SIZE}px, global batch $BATCH ($micro per process), $STEPS steps, $data, $NHOSTS hosts x 1 process x $THREADS thread(s), -j $WORKERS, gloo; links: ${LINKS//,/, }"
    echo "$PROG: $CONFIG"
    echo "$PROG: load average before: $LOAD_BEFORE; logs in $RUNS/"
    if awk -v l="${LOAD_BEFORE%% *}" -v c="$CORES" 'BEGIN { exit !(l > c / 2) }'; then
        echo "$PROG: warning: the machine is busy (load ${LOAD_BEFORE%% *} on $CORES cores): images/s will be low and noisy" >&2
    fi
    T0=$SECONDS

    # 1. one process's compute, for the model, at each image size of the rows
    for size in $(printf '%s\n' "${!sizes[@]}" | sort -n); do
        "$PYTHON" tools/scaling_model.py profile -a "$ARCH" --image-size "$size" --batch "$micro" \
            --num-classes "$classes" --threads "$THREADS" --out "$RUNS/profile-$size.json" 2>&1 | sed "s/^/$PROG: /"
    done

    # 2. the link at each rate, as collectives see it: across 2 to the most hosts; FSDP's at N hosts
    local ops
    for rate in ${LINKS//,/ }; do
        shape "$rate"
        for ((n = 2; n <= most; n++)); do
            ops=all_reduce
            ((n == NHOSTS && fsdp)) && ops=all_reduce,all_gather,reduce_scatter
            local json=$RUNS/allreduce-$rate-n$n.json
            torchrun_all "$n" $((NET_PORT++)) tools/allreduce_bench.py -b 4K -e "$ALLREDUCE_MAX" -f 4 \
                --op "$ops" --threads "$THREADS" --json "$json"
            run_hosts allreduce "$rate" - "$n" "$THREADS" "${json%.json}" "$json" -- "${ALL[@]}"
            [[ -f $json ]] && echo "$PROG: link at $rate, $n hosts: $(grep -m1 '^# all_reduce: fit' "${json%.json}/host0.log" | sed 's/^# all_reduce: //')"
        done
    done

    # 3. each row alone in one process (one host): the work per process of the runs across hosts
    local -A ref_done=()
    local ref gb
    for row in ${ROWS//,/ }; do
        ref=$(ref_of "$row")
        [[ -n ${ref_done[$ref]:-} ]] && continue
        ref_done[$ref]=1
        parse_row "$ref"
        gb=$((micro * R_K))
        PROGRESS_BATCH=$gb
        # plain python: the script makes a world of one itself, and no launcher shares the host's core
        run_hosts "$ref" "1 host" - 1 "$THREADS" "$RUNS/1host/$ref" - -- "$PYTHON" \
            "$R_SCRIPT" --data "$(net_data "$gb")" -a "$ARCH" -b "$gb" --epochs 1 -j "$WORKERS" \
            --image-size "$R_SIZE" -p "$PRINT_FREQ" --threads "$THREADS" "${R_ARGS[@]}" --output-dir "$RUNS/1host/$ref"
    done

    # 4. every row at every rate, row by row
    for row in ${ROWS//,/ }; do
        parse_row "$row"
        gb=$((micro * R_HOSTS * R_K))
        PROGRESS_BATCH=$gb
        for rate in ${LINKS//,/ }; do
            shape "$rate"
            launch_row "$row" "$rate" "$RUNS/$rate/$row" --data "$(net_data "$gb")" -a "$ARCH" -b "$gb" --epochs 1 \
                -j "$WORKERS" --image-size "$R_SIZE" -p "$PRINT_FREQ" --threads "$THREADS" --dist-timeout 300 "${R_ARGS[@]}"
        done
    done

    WALL=$((SECONDS - T0))
    LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)
    echo "$PROG: all runs took ${WALL}s; load average after: $LOAD_AFTER"
    net_cleanup
    trap - EXIT
    "$PYTHON" tools/benchmark_report.py --network --results "$RESULTS" --wall "$WALL" --config "$CONFIG" \
        --arch "$ARCH" --image-size "$IMAGE_SIZE" --hosts "$NHOSTS" --batch "$BATCH" \
        --command "${START_COMMAND:-$CMDLINE}" --title "$NHOSTS test hosts over shaped links, CPU ($CORES cores)" \
        --load-before "$LOAD_BEFORE" --load-after "$LOAD_AFTER" ${LOADER_IPS:+--loader-ips "$LOADER_IPS"} \
        ${WORKERS:+--workers "$WORKERS"} ${NET_FIT:+--fit "$NET_FIT"}
    exit "$FAILED"
}
