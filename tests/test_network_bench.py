"""The network benchmark (start.sh --hosts N --link RATES): links shaped with tc between test hosts,
the all-reduce benchmark, and the scaling model.

The shaped runs need root (tools/hosts.sh makes network namespaces) and are skipped, naming the
reason, without it. They use a model with small gradients (squeezenet1_1, 2.9 MB), 32 px images and
4 steps, so that a 20 Mbit/s link makes a step last about a second and the runs stay short; their
hosts (nbt0, nbt1 on 10.213.10.0/24) are apart from tests/test_multihost.py's and from start.sh's
default ones.
"""

import csv
import json
import os
import subprocess
import sys

import pytest
from helpers import BIN, CLUSTER, PY, ROOT, env, error_lines, needs_root, run

sys.path.insert(0, os.path.join(ROOT, "tools"))
import scaling_model  # noqa: E402

START = os.path.join(ROOT, "start.sh")
HOSTS_SH = os.path.join(ROOT, "tools", "hosts.sh")
PREFIX, NET = "nbt", "10.213.10"
SLOW = "20mbit"
SMALL = dict(
    ARCH="squeezenet1_1",
    IMAGE_SIZE="32",
    ALLREDUCE_MAX="1M",
    HOSTS_PREFIX=PREFIX,
    HOSTS_NET=NET,
    PYTHON=PY,
    TORCHRUN=os.path.join(BIN, "torchrun"),
)


def network_bench(out, links, rows, steps=4, batch=8):
    """start.sh --hosts 2 at the given links and rows; returns ({(row, rate): csv row}, the report's
    text)."""
    p = run(
        [
            "bash",
            START,
            "--hosts",
            "2",
            "--link",
            links,
            "--rows",
            rows,
            "--steps",
            str(steps),
            "-b",
            str(batch),
            "-o",
            str(out),
        ],
        env=env(**SMALL),
        timeout=600,
        check=False,
    )
    assert p.returncode == 0, (
        f"start.sh exited {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-3000:]}"
    )
    table = {(r["row"], r["rate"]): r for r in csv.DictReader(open(out / "benchmark-network.csv"))}
    return table, (out / "benchmark-network.md").read_text()


def our_hosts():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()


@pytest.fixture
def root():
    needs_root("the test hosts are network namespaces")


@pytest.fixture
def other_hosts():  # (only with root: needs_root comes first in the test's fixtures)
    """Another set of test hosts, as tests/test_multihost.py makes: the benchmark's must leave it
    alone."""
    e = env(HOSTS_PREFIX="nbc", HOSTS_NET="10.213.11")
    run(["bash", HOSTS_SH, "up", "1"], env=e, timeout=60)
    yield e
    run(["bash", HOSTS_SH, "down"], env=e, timeout=60)


@CLUSTER  # test hosts, as tests/test_multihost.py makes: one file of them at a time
def test_slow_link_lowers_images_per_s_compression_raises_them_and_the_model_predicts_it(
    root, tmp_path, other_hosts
):
    had = [h for h in our_hosts() if h.startswith(PREFIX)]
    compressed, unknown = "distributed+bf16", "distributed+--no-such-option=1"
    table, md = network_bench(tmp_path, SLOW, f"distributed,{compressed},{unknown}")
    # a row whose option the script lacks is listed as not run, and the rest runs
    assert table[(unknown, SLOW)]["status"] == "skipped", table[(unknown, SLOW)]
    assert "distributed.py has no --no-such-option" in table[(unknown, SLOW)]["note"]
    slow, one = table[("distributed", SLOW)], table[("distributed", "1 host")]
    assert slow["status"] == one["status"] == "ok", table
    # each step all-reduces 2.9 MB, about 1.2 s at 20 Mbit/s, against a step of ~0.1 s in one
    # process: two hosts over the slow link train fewer images a second than one process alone, a
    # large effect
    assert float(slow["images_per_s"]) < float(one["images_per_s"]), (slow, one)
    # half the bytes on a link that takes nearly all the step: close to 2x, and well above 1.3x
    bf16 = table[(compressed, SLOW)]
    assert bf16["status"] == "ok" and float(bf16["images_per_s"]) > 1.3 * float(
        slow["images_per_s"]
    ), (slow, bf16)
    # the link as the all-reduce benchmark measured it: shaped to its rate
    bench = json.loads((tmp_path / "runs-network" / f"allreduce-{SLOW}.json").read_text())
    assert bench["world_size"] == 2 and sorted(set(bench["hosts"])) == [f"{PREFIX}0", f"{PREFIX}1"]
    gbit = bench["fit"]["busbw_Bps"] * 8 / 1e9
    assert 0.014 < gbit < 0.021, f"busbw at {SLOW}: {gbit:.4f} Gbit/s"
    # where the link dominates, the model's prediction (profile + measured link) is close
    predicted = float(slow["predicted_images_per_s"])
    assert abs(predicted - float(slow["images_per_s"])) < 0.35 * float(slow["images_per_s"]), slow
    assert float(slow["exposed_s"]) > 0.5 and float(slow["efficiency"]) < 0.5, slow
    # the report: the command that made it, the link table, every row at every rate
    assert "- command: `" in md and f"--link {SLOW} " in md
    assert f"| {SLOW} |" in md and "| distributed | torchrun distributed.py |" in md
    assert os.path.isfile(tmp_path / "benchmark-network.png")
    # the hosts made for the run are gone; the other set is still there, unshaped
    if not had:
        assert not [h for h in our_hosts() if h.startswith(PREFIX)], our_hosts()
    status = run(["bash", HOSTS_SH, "status"], env=other_hosts, timeout=60, check=False)
    assert status.returncode == 0 and status.stdout.startswith(
        "nbc0: 10.213.11.1, hostname nbc0, link up\n"
    ), status.stdout


def test_a_row_is_a_backend_plus_script_arguments():
    """What each tag of a row adds to the script's command line (netbench.sh's parse_row), and
    accumK's global batch: K x BATCH, so that each process's micro-batch stays BATCH / hosts."""
    show = (
        'source tools/netbench.sh; for row in "$@"; do parse_row "$row"; '
        'echo "$R_SCRIPT $R_K ${R_ARGS[*]}"; done'
    )
    p = run(
        [
            "bash",
            "-c",
            show,
            "-",
            "distributed",
            "distributed+bf16+accum4",
            "horovod+fp16",
            "slurm+--amp=bf16+--no-augment",
            "apex+accum2",
        ],
        timeout=60,
    )
    assert p.stdout.splitlines() == [
        "distributed.py 1 ",
        "distributed.py 4 --grad-compression bf16 --gradient-accumulation-steps 4",
        "horovod_distributed.py 1 --grad-compression fp16",
        "distributed_slurm_main.py 1 --amp=bf16 --no-augment",
        "apex_distributed.py 2 --gradient-accumulation-steps 2",
    ]


def test_rows_and_links_are_checked_before_anything_runs(tmp_path):
    cases = [
        (["--hosts", "1"], "--hosts wants 2 to 16 hosts"),
        (["--hosts", "2", "--link", "10x"], "--link: '10x' is not a rate"),
        (
            ["--hosts", "2", "--rows", "dataparallel"],
            "row 'dataparallel': 'dataparallel' does not run across hosts",
        ),
        (
            ["--hosts", "2", "--rows", "distributed+accumX"],
            "row 'distributed+accumX': 'accumX' is not accumK",
        ),
        (["--hosts", "2", "--rows", "distributed+zip"], "unknown tag 'zip'"),
        (["--link", "1gbit"], "--link, --rows and --steps go with --hosts N"),
    ]
    for args, message in cases:
        p = run(
            ["bash", START, *args, "-o", str(tmp_path)], env=env(**SMALL), check=False, timeout=120
        )
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and message in p.stderr, (
            args,
            p.stderr,
        )


# ---- the all-reduce benchmark and the model, without the hosts ----


def test_allreduce_bench_reports_busbw_as_nccl_tests_does(tmp_path):
    out = tmp_path / "ar.json"
    p = run(
        [
            os.path.join(BIN, "torchrun"),
            "--standalone",
            "--nproc_per_node=2",
            os.path.join(ROOT, "tools", "allreduce_bench.py"),
            "-b",
            "64K",
            "-e",
            "1M",
            "-f",
            "4",
            "--seconds",
            "0.2",
            "--json",
            str(out),
        ]
    )
    bench = json.loads(out.read_text())
    assert [r["bytes"] for r in bench["rows"]] == [65536, 262144, 1048576]
    for r in bench["rows"]:  # algbw = size / time; busbw = algbw x 2(n-1)/n, = algbw for n = 2
        assert r["algbw_Bps"] == pytest.approx(r["bytes"] / r["time_s"])
        assert r["busbw_Bps"] == pytest.approx(r["algbw_Bps"] * 2 * (2 - 1) / 2)
    assert f"{bench['rows'][-1]['time_s'] * 1e6:.1f}" in p.stdout and "busbw" in p.stdout
    assert bench["fit"]["busbw_Bps"] > 0 and bench["fit"]["alpha_s"] >= 0


def test_allreduce_bench_outside_torchrun_says_so_in_one_line():
    e = dict(os.environ)
    e.pop("RANK", None), e.pop("WORLD_SIZE", None)
    p = subprocess.run(
        [PY, os.path.join(ROOT, "tools", "allreduce_bench.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env=e,
    )
    assert (
        p.returncode == 2
        and len(error_lines(p.stderr)) == 1
        and "start it with torchrun" in p.stderr
    ), p.stderr
    p = subprocess.run(
        [PY, os.path.join(ROOT, "tools", "allreduce_bench.py"), "-b", "1Q"],
        capture_output=True,
        text=True,
        timeout=120,
        env=e,
    )
    assert p.returncode == 2 and "not a size in bytes" in p.stderr and "Traceback" not in p.stderr


def test_the_models_buckets_are_ddps():
    """The gradients of the profile come in DDP's own buckets (read from DDP after its rebuild); the
    model's bucketing of a given model, which has no DDP to ask, must make the same buckets from the
    parameters in reverse order, DDP's assumed order, for these models whose forward runs in
    definition order."""
    code = f"""
import json, sys, torch, torch.distributed as dist, torchvision
sys.path.insert(0, {os.path.join(ROOT, "tools")!r})
import scaling_model
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
for arch in ("resnet18", "resnet50"):
    m = torchvision.models.get_model(arch, num_classes=10)
    d = torch.nn.parallel.DistributedDataParallel(m)
    # DDP rebuilds its buckets in the second iteration and logs them in the third
    for _ in range(3):
        d(torch.randn(2, 3, 32, 32)).sum().backward()
    sizes = [p.numel() * 4 for p in m.parameters()]
    rev = list(range(len(sizes)))[::-1]
    ours = [sorted(rev[j] for j in b) for b in scaling_model.ddp_buckets([sizes[i] for i in rev])]
    theirs = d._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"]
    print(json.dumps([arch, ours, [sorted(int(i) for i in b.split()) for b in theirs.split(",")]]))
"""
    p = run([PY, "-c", code], timeout=300)
    for line in p.stdout.strip().splitlines()[-2:]:
        arch, ours, theirs = json.loads(line)
        assert ours == theirs and len(ours) > 1, arch


def test_the_model_hides_what_overlaps_and_scales_compression_and_accumulation():
    """A profile whose gradients are ready early: the all-reduces hide behind the backward pass on a
    fast link; on a slow one the step is the link's time; bf16 halves the bytes; 4 micro-batches
    carry 4x the images over the same all-reduces."""
    mb = 1e6
    prof = dict(
        forward_s=0.1,
        backward_s=0.2,
        optimizer_s=0.0,
        compress_s_per_byte=0.0,
        batch=8,
        buckets=[dict(bytes=10 * mb, ready_s=0.01), dict(bytes=10 * mb, ready_s=0.02)],
    )
    fast = scaling_model.Link("fast", 0.0, 1000 * mb)  # 20 ms for all
    slow = scaling_model.Link("slow", 0.0, 10 * mb)  # 2 s for all
    hidden = scaling_model.step_time(prof, fast, 2, 1)
    assert hidden["step_s"] == pytest.approx(0.3) and hidden["efficiency"] == pytest.approx(1.0)
    bound = scaling_model.step_time(prof, slow, 2, 1)
    assert bound["step_s"] == pytest.approx(0.1 + 0.01 + 2.0) and bound["comm_s"] == pytest.approx(
        2.0
    )
    half = scaling_model.step_time(prof, slow, 2, 1, compression="bf16")
    assert half["comm_s"] == pytest.approx(1.0)
    accum = scaling_model.step_time(prof, slow, 2, 1, accum=4)
    assert accum["step_s"] == pytest.approx(3 * 0.3 + 0.1 + 0.01 + 2.0)
    assert accum["images_per_s"] / bound["images_per_s"] == pytest.approx(4 * 2.11 / 3.01)
    # N nodes x G GPUs: the ring's 2(n-1)/n over the slower of the node's link and NVLink
    link = scaling_model.Link("25gbit", 0.0, 25e9 / 8, intra_busbw=200e9)
    assert link.allreduce_s(100 * mb, 2, 8) == pytest.approx(100 * mb * 2 * 15 / 16 / (25e9 / 8))
    assert link.allreduce_s(100 * mb, 1, 8) == pytest.approx(100 * mb * 2 * 7 / 8 / 200e9)


def test_scaling_model_bad_input_is_one_line(tmp_path):
    tool = os.path.join(ROOT, "tools", "scaling_model.py")
    cases = [
        (["predict", "--profile", str(tmp_path / "none.json"), "--link", "1gbit"], "not a profile"),
        (["predict", "-a", "resnet50", "--images-per-s", "2470"], "give the link"),
        (
            ["predict", "-a", "resnet50", "--images-per-s", "2470", "--link", "fast"],
            "not a link rate",
        ),
        (
            [
                "predict",
                "-a",
                "resnet50",
                "--images-per-s",
                "2470",
                "--link",
                "1gbit",
                "--compression",
                "zip",
            ],
            "'zip' is not none, bf16 or fp16",
        ),
        (["profile", "-a", "nosuchnet"], "unknown model 'nosuchnet'"),
    ]
    for args, message in cases:
        p = subprocess.run([PY, tool, *args], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, (
            args,
            p.stderr,
        )
