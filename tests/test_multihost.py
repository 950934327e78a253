"""Multi-node jobs across two hosts with their own addresses and hostnames, on this machine.

tools/hosts.sh makes the hosts node0, node1 and node2: network namespaces on a bridge (10.213.7.1,
.2, .3; no route anywhere else), each with its own hostname and an /etc/hosts that names all. Every
process of a node runs in its host's namespaces (`tools/hosts.sh exec nodeN ...`), so the ranks
meet over the bridge, by name, as on two machines: a master address that resolves only locally,
a store bound to 127.0.0.1 or gloo on the loopback interface would fail here.

Each multi-node run must end with the parameters of one process (`python distributed.py`, float64,
helpers.EXACT) and count every validation image once; the fault runs cut a host's link or kill
all of a host's processes mid-epoch, and then the other host must give up within --dist-timeout
with one line saying why, and the job resumed from its checkpoint must end where an
uninterrupted run ends. Hosts that each write into an output folder of their own (no shared
storage) must refuse to resume in one line, and resume exactly once the folder is shared.

All runs are independent and mostly wait on each other, so the first test that needs one starts them
all (Runs) and each test waits for its own; the one-process reference is helpers.reference_run, made
once for the whole session. Needs root (namespaces; the Slurm part reconfigures the local cluster of
tools/slurm-local.sh to two nodes and puts the one-node cluster back): without root these tests
skip, saying so (with CI=true they fail). The hosts and the cluster are one per machine: this file
runs in the "cluster" group, holds the hosts' lock while it runs and the cluster's, exclusive, while
it has two nodes.
"""

import concurrent.futures
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time

import pytest
from helpers import (
    BIN,
    CLUSTER,
    EXACT,
    PARAM_TOL,
    PY,
    ROOT,
    TINY,
    cluster_lock,
    env,
    hosts_lock,
    max_param_diff,
    metrics,
    needs_root,
    params,
    reference_run,
    script,
)

HOSTS_SH = os.path.join(ROOT, "tools", "hosts.sh")
SLURM_LOCAL = os.path.join(ROOT, "tools", "slurm-local.sh")
HOROVODRUN = os.path.join(BIN, "horovodrun")
HOSTS = ["node0", "node1"]
# The link-cut run uses node0 and node2, so that cutting node2 off disturbs no other run
CUT_HOSTS = ["node0", "node2"]
ALL_HOSTS = ["node0", "node1", "node2"]
VAL_IMAGES = 101
TIMEOUT = 300  # any one run; a hang shows as a failure, not as a stuck suite
DIST = ["--dist-timeout", "120"]
# Faults: 48 images in batches of 6 make 8 steps an epoch; the fault comes in epoch 1, after the
# checkpoint of epoch 0. A lost peer must end the run within FAULT_TIMEOUT seconds (+ slack for
# the launcher's exit on a loaded machine).
FAULT_TIMEOUT = 20
FAULT = [
    "--image-size",
    "16",
    "-j",
    "0",
    "-b",
    "6",
    "--epochs",
    "2",
    "-p",
    "1",
    "--lr-step",
    "1",
    *EXACT,
]
FAULT_AT = "Epoch [1][2/"
SLACK = 25
PORTS = itertools.count(29400)  # ports in node0's namespace, where only these tests listen
pytestmark = CLUSTER


def on(host, cmd):
    return ["bash", HOSTS_SH, "exec", host, *cmd]


def kill_tagged(tag):
    """SIGKILLs every process whose command line holds `tag` (torchrun starts its workers in
    sessions of their own, so killing a process group is not enough)."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if tag.encode() in f.read():
                    os.kill(int(entry), signal.SIGKILL)


class Node:
    """One node's command, started in its host; its output is collected line by line with times."""

    def __init__(self, host, cmd, **extra_env):
        self.host, self.cmd, self.lines = host, cmd, []
        self.p = subprocess.Popen(
            on(host, cmd),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=env(**extra_env),
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.end = None

    def _read(self):
        for line in self.p.stdout:
            self.lines.append((time.monotonic(), line))
        self.p.wait()
        self.end = time.monotonic()

    def log(self):
        return "".join(line for _, line in self.lines)

    def wait_for(self, text, deadline):
        while time.monotonic() < deadline:
            if any(text in line for _, line in self.lines):
                return True
            if self.end is not None:
                return False
            time.sleep(0.05)
        return False

    def finish(self, deadline):
        self.reader.join(max(0.0, deadline - time.monotonic()))
        if self.reader.is_alive():
            os.killpg(self.p.pid, signal.SIGKILL)
            self.reader.join(30)
            return "timeout"
        return self.p.returncode


class Result:
    def __init__(self, name, nodes, rcs, seconds, **info):
        self.name, self.nodes, self.rcs, self.seconds, self.info = name, nodes, rcs, seconds, info
        self.logs = [n.log() for n in nodes]

    def report(self):
        return f"{self.name}: exit {self.rcs} after {self.seconds:.0f} s\n" + "\n".join(
            f"--- {n.host}: {' '.join(n.cmd)}\n{log[-3000:]}"
            for n, log in zip(self.nodes, self.logs, strict=True)
        )

    def check(self):
        assert self.rcs == [0] * len(self.rcs), self.report()
        return self


def run_nodes(name, cmds, tag, timeout=TIMEOUT, **extra_env):
    """Runs {host: command} at once, each in its host; waits for all."""
    t = time.monotonic()
    nodes = [Node(host, cmd, **extra_env) for host, cmd in cmds.items()]
    try:
        rcs = [n.finish(t + timeout) for n in nodes]
    finally:
        kill_tagged(tag)
    return Result(name, nodes, rcs, time.monotonic() - t)


def torchrun_nodes(name, target, out, data, args, rdzv=None, hosts=HOSTS):
    """torchrun --nnodes=2, one process per node: static rendezvous at node0 by name, or c10d."""
    port = next(PORTS)
    cmds = {}
    for rank, host in enumerate(hosts):
        launcher = [os.path.join(BIN, "torchrun"), "--nnodes=2", "--nproc_per_node=1"]
        if rdzv == "c10d":
            launcher += [
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={HOSTS[0]}:{port}",
                f"--rdzv-id={name}",
            ]
        else:
            launcher += [
                f"--node-rank={rank}",
                f"--master-addr={HOSTS[0]}",
                f"--master-port={port}",
            ]
        cmds[host] = launcher + [script(target), "--data", data, *args, "--output-dir", out]
    return cmds


class Runs:
    """Every run of this module, started together on first use; get(name) waits for one."""

    def __init__(self, data, tmp):
        self.data, self.tmp, self.futures = data, tmp, None
        # the runs to start ("slurm_srun" and the like: that job of the Slurm run), from the tests
        # selected (the runs fixture)
        self.wanted = set()

    def out(self, name):
        return str(self.tmp / name)

    def get(self, name):
        if self.futures is None:
            jobs = {
                "fault_cut": self.fault_cut,
                "fault_kill": self.fault_kill,
                "slurm": self.slurm,
                "horovod": self.horovod,
                "torchrun": self.torchrun,
                "apex": self.apex,
                "c10d": self.c10d,
                "spawn": self.spawn,
                "ref": self.ref,
                "ref_fault": self.ref_fault,
            }
            jobs = {k: job for k, job in jobs.items() if k in self.wanted}
            pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs))
            self.futures = {k: pool.submit(job) for k, job in jobs.items()}
            pool.shutdown(wait=False)
        if name not in self.futures:  # a run no test in NEEDS named: started now, on its own
            self.futures[name] = concurrent.futures.ThreadPoolExecutor(1).submit(
                getattr(self, name)
            )
        return self.futures[name].result(timeout=3 * TIMEOUT)

    # ---- one process, the reference ----
    def ref(self):
        return reference_run(self.data)

    def ref_fault(self):
        return self._local("ref_fault", FAULT)

    def _local(self, name, args):
        t = time.monotonic()
        p = subprocess.run(
            [
                PY,
                script("distributed.py"),
                "--data",
                self.data,
                *args,
                "--output-dir",
                self.out(name),
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env(),
            timeout=TIMEOUT,
        )
        assert p.returncode == 0, f"{name}: {p.stdout[-2000:]}\n{p.stderr[-3000:]}"
        return time.monotonic() - t

    # ---- launchers across the two hosts ----
    def torchrun(self):
        out = self.out("torchrun")
        return run_nodes(
            "torchrun",
            torchrun_nodes("torchrun", "distributed.py", out, self.data, [*TINY, *EXACT, *DIST]),
            out,
        )

    def apex(self):
        out = self.out("apex")
        return run_nodes(
            "apex",
            torchrun_nodes("apex", "apex_distributed.py", out, self.data, [*TINY, *EXACT, *DIST]),
            out,
        )

    def c10d(self):
        out = self.out("c10d")
        return run_nodes(
            "c10d",
            torchrun_nodes(
                "c10d", "distributed.py", out, self.data, [*TINY, *EXACT, *DIST], rdzv="c10d"
            ),
            out,
        )

    def spawn(self):
        out, port = self.out("spawn"), next(PORTS)
        cmds = {
            host: [
                PY,
                script("multiprocessing_distributed.py"),
                "--world-size",
                "2",
                "--rank",
                str(rank),
                "--nprocs",
                "1",
                "--dist-url",
                f"tcp://{HOSTS[0]}:{port}",
                "--data",
                self.data,
                *TINY,
                *EXACT,
                *DIST,
                "--output-dir",
                out,
            ]
            for rank, host in enumerate(HOSTS)
        }
        return run_nodes("spawn", cmds, out)

    def horovod(self):
        """horovodrun on node0 starts node1's rank through ssh: an sshd in each host, with a host
        key and a client key made here, for root, on a port of the hosts' own."""
        if not os.path.isfile(HOROVODRUN):
            pytest.fail(
                f"{HOROVODRUN} does not exist: run `bash tools/install-horovod.sh`", pytrace=False
            )
        ssh = self.tmp / "ssh"
        (ssh / "bin").mkdir(parents=True)
        for key in ("client_key", "host_key"):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ssh / key)], check=True
            )
        (ssh / "authorized_keys").write_text((ssh / "client_key.pub").read_text())
        (ssh / "sshd_config").write_text(
            f"Port 2222\nHostKey {ssh / 'host_key'}\nAuthorizedKeysFile {ssh / 'authorized_keys'}\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nLogLevel ERROR\n"
            "StrictModes no\n"  # the keys are in a private folder under the world-writable /tmp
        )
        # horovodrun's ssh accepts unknown host keys; this keeps them out of root's known_hosts
        client = shutil.which("ssh")
        assert client, "no ssh client: apt-get install openssh-client"
        (ssh / "bin" / "ssh").write_text(
            f'#!/bin/sh\nexec {client} -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR "$@"\n'
        )
        os.chmod(ssh / "bin" / "ssh", 0o755)
        os.makedirs("/run/sshd", exist_ok=True)
        sshd = "/usr/sbin/sshd"
        assert os.path.isfile(sshd), (
            f"{sshd} is missing: apt-get install openssh-server (dev/test.sh does)"
        )
        for host in HOSTS:
            subprocess.run(
                on(
                    host,
                    [sshd, "-f", str(ssh / "sshd_config"), "-o", f"PidFile={ssh}/sshd-{host}.pid"],
                ),
                check=True,
                timeout=30,
            )
        out = self.out("horovod")
        try:
            cmd = [
                HOROVODRUN,
                "-np",
                "2",
                "-H",
                ",".join(f"{h}:1" for h in HOSTS),
                "--gloo",
                "-p",
                "2222",
                "-i",
                str(ssh / "client_key"),
                "--start-timeout",
                "120",
                PY,
                script("horovod_distributed.py"),
                "--data",
                self.data,
                *TINY,
                *EXACT,
                "--output-dir",
                out,
            ]
            return run_nodes(
                "horovod",
                {HOSTS[0]: cmd},
                out,
                PATH=f"{ssh / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
            )
        finally:
            for host in HOSTS:
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(open(f"{ssh}/sshd-{host}.pid").read()), signal.SIGTERM)

    # ---- Slurm with one slurmd per host ----
    def slurm(self):
        t = time.monotonic()
        # the cluster is shared: hold it, alone, while it has two nodes
        with cluster_lock(exclusive=True, timeout=TIMEOUT):
            waited = time.monotonic() - t
            try:
                up = subprocess.run(
                    ["bash", SLURM_LOCAL, "up", "--nodes", "2"],
                    capture_output=True,
                    text=True,
                    timeout=180,
                )
                assert up.returncode == 0, (
                    f"slurm-local.sh up --nodes 2 failed:\n{up.stderr[-3000:]}"
                )
                return dict(waited=waited, **self._slurm_jobs())
            finally:
                back = subprocess.run(
                    ["bash", SLURM_LOCAL, "up"], capture_output=True, text=True, timeout=180
                )
                assert back.returncode == 0, (
                    f"slurm-local.sh up (back to one node) failed:\n{back.stderr[-3000:]}"
                )

    def _slurm_jobs(self):
        def slurm(cmd):
            p = subprocess.run(
                cmd, capture_output=True, text=True, cwd=ROOT, env=env(PYTHON=PY), timeout=TIMEOUT
            )
            return dict(rc=p.returncode, stdout=p.stdout, stderr=p.stderr)

        srun = ["srun", "--quiet", "--kill-on-bad-exit=1", "-N2", "--ntasks-per-node=1"]
        train = ["--data", self.data, *TINY, *EXACT, *DIST]
        cmds = {
            "hostname": ["srun", "--quiet", "-N2", "-n2", "hostname"],
            "srun": srun
            + [PY, script("distributed_slurm_main.py"), *train, "--output-dir", self.out("srun")],
            "sbatch": [
                "sbatch",
                "--wait",
                "--nodes=2",
                "--ntasks-per-node=1",
                f"--output={self.tmp / 'sbatch.out'}",
                os.path.join(ROOT, "slurm", "train-cpu.sbatch"),
                self.data,
                self.out("sbatch"),
                *train[2:],
            ],
        }
        # those the selected tests read (NEEDS), or every one for a test NEEDS does not name
        cmds = {k: c for k, c in cmds.items() if f"slurm_{k}" in self.wanted} or cmds
        with concurrent.futures.ThreadPoolExecutor(len(cmds)) as pool:
            futures = {k: pool.submit(slurm, c) for k, c in cmds.items()}
            return {k: f.result() for k, f in futures.items()}

    # ---- faults ----
    def fault_cut(self):
        return self._fault("cut")

    def fault_kill(self):
        return self._fault("kill")

    def _fault(self, kind):
        """torchrun on two hosts; at FAULT_AT node2 is cut off (its link down: node2 serves this run
        only) or node1 loses every process of the job; then the same job, resumed from the
        checkpoint on both hosts."""
        out, hosts = self.out(f"fault_{kind}"), CUT_HOSTS if kind == "cut" else HOSTS
        cmds = torchrun_nodes(
            f"fault_{kind}",
            "distributed.py",
            out,
            self.data,
            [*FAULT, "--dist-timeout", str(FAULT_TIMEOUT)],
            hosts=hosts,
        )
        t = time.monotonic()
        nodes = [Node(host, cmd) for host, cmd in cmds.items()]
        victim = hosts[1]
        try:
            saw = nodes[0].wait_for(FAULT_AT, t + TIMEOUT)
            t_fault = time.monotonic()
            if saw and kind == "cut":
                subprocess.run(["ip", "link", "set", f"veth-{victim}", "down"], check=True)
            elif saw:
                pids = subprocess.run(
                    ["ip", "netns", "pids", victim], capture_output=True, text=True
                ).stdout.split()
                for pid in pids:  # every process of this job on the host: launcher and worker
                    with contextlib.suppress(OSError):
                        with open(f"/proc/{pid}/cmdline", "rb") as f:
                            if out.encode() in f.read():
                                os.kill(int(pid), signal.SIGKILL)
            rcs = [n.finish(t_fault + FAULT_TIMEOUT + 3 * SLACK) for n in nodes]
        finally:
            kill_tagged(out)
            if kind == "cut":
                subprocess.run(["ip", "link", "set", f"veth-{victim}", "up"], check=True)
        faulted = Result(
            f"fault_{kind}",
            nodes,
            rcs,
            time.monotonic() - t,
            saw=saw,
            t_fault=t_fault,
            exit_s=[(n.end or time.monotonic()) - t_fault for n in nodes],
        )
        ckpt = os.path.join(out, "checkpoint.pth.tar")
        epoch = params_epoch(ckpt)
        resumed = run_nodes(
            f"resume_{kind}",
            torchrun_nodes(
                f"resume_{kind}",
                "distributed.py",
                out,
                self.data,
                [*FAULT, *DIST, "--resume", ckpt],
                hosts=hosts,
            ),
            out,
        )
        return faulted, epoch, resumed


def params_epoch(path):
    import torch

    if not os.path.exists(path):
        return None
    return torch.load(path, map_location="cpu", weights_only=True)["epoch"]


@pytest.fixture(scope="module")
def hosts():
    needs_root("network namespaces for the test hosts (tools/hosts.sh)")
    # another session's multi-host tests wait: the link cut would disturb their runs
    with hosts_lock():
        before = subprocess.run(["bash", HOSTS_SH, "status"], capture_output=True, text=True)
        p = subprocess.run(
            ["bash", HOSTS_SH, "up", str(len(ALL_HOSTS))],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 0, f"tools/hosts.sh up {len(ALL_HOSTS)} failed: {p.stderr}"
        yield ALL_HOSTS
        if before.returncode != 0:  # made here: removed here
            subprocess.run(["bash", HOSTS_SH, "down"], capture_output=True, timeout=60)


# The runs each test reads (the references aside): Runs starts those of the selected tests only
NEEDS = {
    "test_two_hosts_train_the_one_process_model": lambda name: [name],
    "test_horovodrun_starts_the_second_host_through_ssh": lambda: ["horovod"],
    "test_slurm_two_nodes_run_one_task_each": lambda: ["slurm", "slurm_hostname"],
    "test_slurm_two_nodes_train_the_one_process_model": lambda how: ["slurm", f"slurm_{how}"],
    "test_a_lost_host_ends_the_job_in_bounded_time_and_the_resumed_job_matches": lambda kind: [
        f"fault_{kind}",
        "ref_fault",
    ],
}


@pytest.fixture(scope="module")
def runs(request, hosts, tiny_data, tmp_path_factory):
    r = Runs(tiny_data, tmp_path_factory.mktemp("multihost"))
    r.wanted = {"ref"}
    for item in request.session.items:
        if item.module is request.module and item.originalname in NEEDS:
            params = getattr(item, "callspec", None)
            r.wanted.update(NEEDS[item.originalname](**(params.params if params else {})))
    yield r
    if r.futures:
        concurrent.futures.wait(r.futures.values(), timeout=3 * TIMEOUT)


# ---- the hosts ----


def test_each_host_has_its_own_name_and_address_and_knows_the_others(hosts):
    for i, host in enumerate(hosts):
        p = subprocess.run(
            on(
                host,
                ["sh", "-c", f"hostname; getent hosts {' '.join(hosts)}; ip -4 -br addr show eth0"],
            ),
            capture_output=True,
            text=True,
            timeout=30,
        )
        lines = p.stdout.splitlines()
        assert lines[0] == host, p.stdout + p.stderr
        assert [line.split() for line in lines[1:-1]] == [
            [f"10.213.7.{j + 1}", h] for j, h in enumerate(hosts)
        ], p.stdout
        assert f"10.213.7.{i + 1}/24" in lines[-1], p.stdout
    # no route leaves the hosts: an outside address is unreachable, not merely unanswered
    p = subprocess.run(
        on(hosts[1], [PY, "-c", "import socket; socket.create_connection(('192.0.2.1', 53), 3)"]),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "Network is unreachable" in p.stderr, p.stderr


def test_hosts_tool_is_idempotent(hosts):
    p = subprocess.run(
        ["bash", HOSTS_SH, "up", str(len(hosts))], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    status = subprocess.run(
        ["bash", HOSTS_SH, "status"], capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 0 and status.stdout.count("link up") == len(hosts), status.stdout


def test_hosts_tool_says_in_one_line_when_not_root():
    """Run as another user (root drops to nobody; anyone else runs it as themselves). The checkout
    may be unreadable to nobody (a clone under a 0700 home), so the tool runs from a copy in a
    folder everyone can read, as a user's own copy would."""
    with tempfile.TemporaryDirectory(
        prefix="hosts-not-root-", dir="/tmp"
    ) as d:  # not $TMPDIR: may be private
        os.chmod(d, 0o755)
        tool = os.path.join(d, "hosts.sh")
        shutil.copy(HOSTS_SH, tool)
        os.chmod(tool, 0o755)
        as_other = (
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
            if os.geteuid() == 0
            else []
        )
        p = subprocess.run(
            [*as_other, "bash", tool, "up", "2"], capture_output=True, text=True, timeout=60, cwd=d
        )
    assert p.returncode != 0
    assert p.stderr.count("\n") == 1 and "must run as root" in p.stderr, p.stderr


# ---- training across the hosts ----


def assert_like_one_process(runs, out, world_size=2):
    ref = runs.get("ref")
    diff = max_param_diff(params(ref), params(out))
    assert diff < PARAM_TOL, f"{out} differs from one process by {diff:.3g}"
    m, r = metrics(out)[-1], metrics(ref)[-1]
    assert m["world_size"] == world_size
    assert (m["val_images"], m["val_acc1"], m["val_acc5"]) == (
        VAL_IMAGES,
        r["val_acc1"],
        r["val_acc5"],
    )


@pytest.mark.parametrize("name", ["torchrun", "apex", "c10d", "spawn"])
def test_two_hosts_train_the_one_process_model(runs, name):
    r = runs.get(name).check()
    log = "\n".join(r.logs)
    for rank, host in enumerate(HOSTS):  # each node's first process names its host
        assert f"rank {rank} on {host}:" in log, r.report()
    assert_like_one_process(runs, runs.out(name))


def test_horovodrun_starts_the_second_host_through_ssh(runs):
    r = runs.get("horovod").check()
    assert "]<stdout>:rank 1 on node1:" in r.logs[0], r.report()
    assert_like_one_process(runs, runs.out("horovod"))


def test_slurm_two_nodes_run_one_task_each(runs):
    s = runs.get("slurm")
    h = s["hostname"]
    assert h["rc"] == 0, h
    assert sorted(h["stdout"].split()) == HOSTS, h


@pytest.mark.parametrize("how", ["srun", "sbatch"])
def test_slurm_two_nodes_train_the_one_process_model(runs, how):
    job = runs.get("slurm")[how]
    log = job["stdout"] + job["stderr"]
    if how == "sbatch":
        log += open(runs.tmp / "sbatch.out").read()
    assert job["rc"] == 0, log[-4000:]
    assert "rank 0 on node0:" in log and "rank 1 on node1:" in log, log[-4000:]
    assert_like_one_process(runs, runs.out(how))


# ---- faults ----


@pytest.mark.parametrize("kind", ["cut", "kill"])
def test_a_lost_host_ends_the_job_in_bounded_time_and_the_resumed_job_matches(runs, kind):
    faulted, epoch, resumed = runs.get(f"fault_{kind}")
    assert faulted.info["saw"], faulted.report()
    # a cut-off host is a survivor too
    survivors = faulted.nodes if kind == "cut" else faulted.nodes[:1]
    for node, rc, exit_s in zip(faulted.nodes, faulted.rcs, faulted.info["exit_s"], strict=True):
        if node not in survivors:
            continue
        assert rc not in (0, "timeout"), faulted.report()  # it failed, it did not hang
        assert exit_s < FAULT_TIMEOUT + SLACK, (
            f"{node.host} ended {exit_s:.0f} s after the fault\n{faulted.report()}"
        )
        after = "".join(line for t, line in node.lines if t > faulted.info["t_fault"])
        assert "Epoch [1][8/" not in after, faulted.report()
        ours = [line for line in after.splitlines() if line.startswith("distributed.py: error: ")]
        assert len(ours) == 1, faulted.report()
        expected = (
            "no answer from another process within --dist-timeout"
            if kind == "cut"
            else "lost another process"
        )
        assert expected in ours[0], faulted.report()
        assert "[rank" not in after, faulted.report()  # no traceback from the training process
    assert epoch == 1, f"checkpoint after the fault is of epoch {epoch}, not the end of epoch 0"
    resumed.check()
    assert "start epoch 1" in resumed.logs[0], resumed.report()
    runs.get("ref_fault")
    diff = max_param_diff(params(runs.out("ref_fault")), params(runs.out(f"fault_{kind}")))
    assert diff < PARAM_TOL, (
        f"resumed after a {kind}: differs from the uninterrupted run by {diff:.3g}"
    )


# ---- resuming where each host has an output folder of its own ----

# one epoch of FAULT's 8 steps; SIGUSR1 at its second step stops both processes mid-epoch
ONE_EPOCH = [*FAULT, "--epochs", "1"]
STOP_AT = "Epoch [0][2/"
# A refused restart ends within REFUSAL_TIMEOUT, start-up included (~30-50 s on a loaded machine),
# under its --dist-timeout: a process waiting in a collective cannot give up in time
REFUSAL_TIMEOUT = 180
REFUSAL_DIST = ["--dist-timeout", "300"]


def training_pids(host, out):
    """The training processes (not torchrun) on `host` of the job that writes into `out`."""
    pids = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True).stdout
    found = []
    for pid in pids.split():
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
            if out in argv and not any(a.endswith("torchrun") for a in argv):
                found.append(int(pid))
    return found


def own_folders_job(name, outs, data, extra, dist=DIST):
    """A two-host torchrun job of distributed.py whose hosts write into outs[host]."""
    cmds = torchrun_nodes(name, "distributed.py", "-", data, [*ONE_EPOCH, *dist])
    return {host: [*cmd[:-1], outs[host], *extra[host]] for host, cmd in cmds.items()}


def assert_refused(name, outs, data, tag, extra, path):
    """The job stops before its first step, soon, on both hosts, in one line naming `path`."""
    r = run_nodes(
        name, own_folders_job(name, outs, data, extra, REFUSAL_DIST), tag, REFUSAL_TIMEOUT
    )
    assert all(rc not in (0, "timeout") for rc in r.rcs), r.report()
    log = "\n".join(r.logs)
    ours = [line for line in log.splitlines() if line.startswith("distributed.py: error: ")]
    assert len(ours) == 1, r.report()
    assert f"only 1 of 2 processes see {path}:" in ours[0], r.report()
    assert "storage that every node reads" in ours[0], r.report()
    assert "Epoch [" not in log and "start epoch" not in log, r.report()  # nothing trained


def test_a_checkpoint_that_one_host_lacks_is_refused_in_one_line(
    hosts, reference, tiny_data, tmp_path
):
    """Each host writes into a folder of its own, as nodes without shared storage do, and only
    node0's holds a checkpoint (here the one-process reference run's). Restarted with
    --auto-resume, the job must stop before its first step, on both hosts, soon: not resume on
    node0 while node1 starts afresh. (The full run makes that checkpoint by stopping a two-host
    job, refuses an explicit --resume too, and resumes once the folder is shared.)"""
    own = {host: str(tmp_path / host) for host in HOSTS}
    os.makedirs(own[HOSTS[0]])
    ckpt = shutil.copy(os.path.join(reference, "checkpoint.pth.tar"), own[HOSTS[0]])
    auto = {h: ["--auto-resume"] for h in HOSTS}
    assert_refused("auto", own, tiny_data, str(tmp_path), auto, ckpt)


def test_a_stopped_job_with_a_folder_per_host_refuses_to_resume_then_resumes_once_shared(
    hosts, tiny_data, tmp_path, tmp_path_factory
):
    """Each host writes into a folder of its own, as nodes without shared storage do, so rank 0's
    checkpoint is on node0 alone. Restarted with --auto-resume (or --resume of a file node1 lacks),
    the job must stop before its first step, in one line naming the checkpoint, soon, on both hosts:
    not resume on node0 while node1 starts afresh. With the folder shared, the same restart resumes
    and ends where a run that never stopped ends."""
    own = {host: str(tmp_path / host) for host in HOSTS}
    ckpt = {host: os.path.join(out, "checkpoint.pth.tar") for host, out in own.items()}

    def job(name, outs, extra):
        return own_folders_job(name, outs, tiny_data, extra)

    def refused(name, extra, path):
        assert_refused(name, own, tiny_data, str(tmp_path), extra, path)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the run that never stops, meanwhile
        straight = str(tmp_path_factory.mktemp("straight"))  # not under tmp_path: the tag below
        cmd = [PY, script("distributed.py"), "--data", tiny_data, *ONE_EPOCH, "--output-dir"]
        uninterrupted = pool.submit(
            subprocess.run, [*cmd, straight], capture_output=True, text=True, env=env(), cwd=ROOT
        )
        t = time.monotonic()
        nodes = [
            Node(h, c) for h, c in job("stop", own, {h: ["--auto-resume"] for h in HOSTS}).items()
        ]
        try:
            saw = nodes[0].wait_for(STOP_AT, t + TIMEOUT)
            for pid in training_pids(HOSTS[1], own[HOSTS[1]]) if saw else []:
                os.kill(pid, signal.SIGUSR1)
            rcs = [n.finish(t + TIMEOUT) for n in nodes]
        finally:
            kill_tagged(str(tmp_path))
        stopped = Result("stop", nodes, rcs, time.monotonic() - t)
        assert saw and stopped.rcs == [0, 0], stopped.report()
        assert "stopped on SIGUSR1 after sample" in stopped.logs[0], stopped.report()
        assert os.path.isfile(ckpt["node0"]) and not os.path.exists(ckpt["node1"])

        refused("auto", {h: ["--auto-resume"] for h in HOSTS}, ckpt["node0"])
        refused("explicit", {h: ["--resume", ckpt[h]] for h in HOSTS}, ckpt["node0"])

        shared = {host: own[HOSTS[0]] for host in HOSTS}
        resumed = run_nodes(
            "shared", job("shared", shared, {h: ["--auto-resume"] for h in HOSTS}), str(tmp_path)
        ).check()
        assert "start epoch 0 at sample " in resumed.logs[0], resumed.report()
        p = uninterrupted.result(timeout=TIMEOUT)
        assert p.returncode == 0, p.stderr[-3000:]
    diff = max_param_diff(params(straight), params(own[HOSTS[0]]))
    assert diff < PARAM_TOL, f"resumed from the shared folder: differs by {diff:.3g}"
