"""Fixtures and hooks of the test suite; what the tests share otherwise (how to start a script, the
tiny settings, shared runs, locks) is in helpers.py, whose docstring says how a new test stays
correct and fast in parallel.

Two runs: the default (`bash dev/test.sh`) proves every guarantee the README states, each at least
once, in few processes; the full run (`bash dev/test.sh --all`, pytest's --all, which CI runs)
adds the tests marked `full` or listed in FULL_ONLY: sweeps (every architecture, launcher and
precision of a check the default makes once), the slow-link and multi-host benchmarks, and
Horovod's tests where Horovod is not installed (only the full run builds it). The default run
leaves them out and says so in one line. A test naming a full-only test (`file.py::name`) runs it.

The suite runs with pytest-xdist's `--dist loadgroup` (dev/test.sh passes it, with
`--no-loadscope-reorder`): tests with the same xdist_group mark run on one worker, one after
another, and the tests go out in the order pytest_collection_modifyitems leaves them in.
"""

import os

import pytest
from helpers import (
    ROOT_SKIP,
    cluster_lock,
    horovod_problem,
    make_tiny_data,
    once,
    reference_run,
    shared_runs,
)

# The tests that take longest, started first so that none of them is left to run alone at the
# end (node id prefixes, relative to tests/). The "cluster" group goes first anyway: it is the
# largest unit of work.
SLOW_FIRST = [
    "test_compile.py",
    "test_fsdp.py",
    "test_scripts.py::test_demo_training",
    "test_benchmark.py::test_start_sh_times",
    "test_benchmark.py::test_gpu_benchmark_times_every_mode",
    "test_reliability.py",
    "test_horovod.py",
    "test_batch_scaling.py",
]

# Full-only tests besides those marked `full` (node id prefixes, relative to tests/): what the
# default run proves once already, or costs minutes for a bar no README sentence rests on.
FULL_ONLY = [
    # the same guarantee at one more process count, launcher or precision than the default's
    "test_parallel_math.py::test_training_gives_the_single_process_parameters[python-1-dataparallel.py-extra6]",
    "test_parallel_math.py::test_two_torchrun_nodes",  # test_multihost.py: torchrun on 2 hosts
    "test_parallel_math.py::test_same_seed_gives_identical_runs",
    "test_fsdp.py::test_sharded_training_gives_the_single_process_parameters_and_momentum[3]",
    "test_fsdp.py::test_a_resumed_fsdp_run_ends_bit_for_bit",  # DDP's: test_reliability.py
    "test_fsdp.py::test_batchnorm_over_shards",  # test_parallel_math.py's, for DDP, runs
    "test_fsdp.py::test_compiled_fsdp",  # test_compile.py compiles by default
    "test_fsdp.py::test_validation_pads",
    "test_fsdp.py::test_bf16_policy",
    "test_horovod.py::test_training_gives_the_single_process_parameters[3]",
    "test_horovod.py::test_resumed_training",
    "test_batch_scaling.py::test_compressed_gradients_are_the_average_to_the_types_precision[torchrun-fsdp",
    "test_snippets.py::test_the_checks_fail_for_the_ddp_program",
    "test_snippets.py::test_program_trains_alike_in_every_process_and_counts_each_item_once[fsdp]",
    "test_precision.py::test_explicit_bf16_without_native_support",
    "test_bad_input.py::test_corrupt_jpeg_is_named[0]",
    "test_reliability.py::test_back_to_back_launches",
    # a killed rank's job resumed by hand: --max-restarts resumes the same kill by itself, exactly
    "test_reliability.py::test_run_killed_mid_epoch",
    "test_reliability.py::test_a_diverging_run",
    "test_requeue.py::test_run_stopped_mid_epoch_resumes_with_half_the_processes",
    "test_edges.py::test_resume_with_a_larger_batch",
    "test_cli_compat.py::test_googlenet_with_auxiliary_outputs_trains",
    "test_bad_input.py::test_image_over_the_pixel_limit_is_named_in_one_line_before_it_is_decoded[huge.png",
    "test_batch_scaling.py::test_compressed_gradients_are_the_average_to_the_types_precision[horovodrun",
    "test_horovod.py::test_evaluation_takes_no_optimizer_step",
    # shown by the default run in another form: mid-epoch resume after SIGUSR1 through Slurm's
    # requeue (test_slurm_requeue.py); warmup's default from the global batch (in-process); the
    # index read by the scripts (test_data.py); a failed rank's exception in one line
    "test_requeue.py::test_usr1_to_one_rank",
    "test_batch_scaling.py::test_warmup_rates_follow_the_formula_and_survive_a_stop_and_resume",
    "test_seeding.py::test_processes_list_the_folders",
    "test_cli_compat.py::test_torchrun_summary_names_the_failed_ranks_exception",
    # one-line errors: the default run keeps a case of each kind (a missing folder, a bad image, an
    # option, a checkpoint, a launch that cannot start); these are the others
    "test_bad_input.py::test_a_35_byte_gif",
    "test_bad_input.py::test_different_classes_in_train_and_val",
    "test_bad_input.py::test_train_without_val",
    "test_bad_input.py::test_empty_data_folder",
    "test_bad_input.py::test_slurm_script_names_an_unreadable_data_folder",
    "test_bad_input.py::test_nccl_without_cuda",
    "test_bad_input.py::test_fp64_and_an_explicit_mixed_precision",
    "test_bad_input.py::test_checkpoint_of_another_arch",
    "test_bad_input.py::test_mid_epoch_resume_with_another_seed",
    "test_bad_input.py::test_numeric_options_are_checked_before_anything_starts",  # in-process too
    "test_bad_input.py::test_output_folder_that_cannot_be_made",
    # BatchNorm's statistics averaged before validation; resuming across precisions; training with
    # compressed gradients (their average is checked by default); Horovod's default path (its
    # equivalence at 2 processes runs by default)
    "test_parallel_math.py::test_validation_during_training_equals_evaluating_the_checkpoint",
    "test_cli_compat.py::test_fp32_checkpoint_resumes_with_fp16_grad_scaler",
    "test_batch_scaling.py::test_compressed_training_reaches_the_uncompressed_accuracy",
    "test_horovod.py::test_horovodrun_2_processes_trains_and_writes_metrics",
    # accumulation: spawn's, FSDP's and Horovod's equivalence runs accumulate by default
    "test_parallel_math.py::test_training_gives_the_single_process_parameters[torchrun-2-distributed.py-extra0]",
    # the peak start.sh measures (test_benchmark.py runs it by default)
    "test_precision.py::test_cpu_peak_tool",
    # tools: Horovod's build configurations (dry runs), FSDP's memory against DDP's, the GPU
    # benchmark (on CPU)
    "test_benchmark.py::test_gpu_benchmark_times",
    "test_horovod.py::test_install_horovod",
    "test_fsdp.py::test_fsdp_memory_tool",
    # the architecture sweep: ten model families sharded in fp32 and bf16
    "test_fsdp.py::test_any_architecture",
    "test_fsdp.py::test_a_backward_that_raises_inside_no_sync",
    "test_fsdp.py::test_vit_and_googlenet",
    # the slow-link and all-reduce benchmarks
    "test_network_bench.py::test_slow_link",
    "test_network_bench.py::test_allreduce_bench_reports_busbw",
    "test_network_bench.py::test_latency_grows",
    "test_network_bench.py::test_one_bucket",
    "test_network_bench.py::test_the_timeline_of_a_two_process_run",  # its summary runs in-process
    "test_network_bench.py::test_allreduce_bench_times_fsdps_collectives",
    # --compile equals eager (an option, not a guarantee; Inductor's compile costs minutes of CPU)
    "test_compile.py",
    # across test hosts: the default runs torchrun and srun (bounded waits for a lost process:
    # test_bad_input.py); horovodrun through ssh only here, so the default needs no sshd
    "test_multihost.py::test_horovodrun",
    "test_multihost.py::test_two_hosts_train_the_one_process_model[apex]",
    "test_multihost.py::test_two_hosts_train_the_one_process_model[c10d]",
    "test_multihost.py::test_two_hosts_train_the_one_process_model[spawn]",  # test_parallel_math.py
    "test_multihost.py::test_slurm_two_nodes_train_the_one_process_model[sbatch]",
    "test_multihost.py::test_a_lost_host_ends_the_job_in_bounded_time_and_the_resumed_job_matches",
    # a checkpoint one host lacks is refused by default from a copied file; this one makes it by
    # stopping a two-host job, refuses --resume too and resumes from a shared folder
    "test_multihost.py::test_a_stopped_job_with_a_folder_per_host",
    # srun by hand, accumulating, and a batch too small for the tasks: the default's Slurm jobs run
    # srun inside sbatch (3 tasks) and across two test hosts; spawn's run accumulates; the small
    # batch's one line is test_bad_input.py's
    "test_slurm.py::test_srun_2_tasks",
    "test_slurm.py::test_training_gives_the_single_process_parameters[srun-n2]",
    "test_slurm.py::test_batch_smaller_than_the_task_count",
]
# The tests that start Horovod's processes or import horovod.torch: without Horovod, full-only
# (dev/test.sh --all builds it); with it, they run by default. A new one: @pytest.mark.horovod.
NEEDS_HOROVOD = [
    "test_horovod.py::test_horovodrun",
    "test_horovod.py::test_training_gives",
    "test_horovod.py::test_metrics",
    "test_horovod.py::test_evaluation",
    "test_horovod.py::test_resumed",
    "test_batch_scaling.py::test_compressed_gradients_are_the_average_to_the_types_precision[horovodrun",
    "test_cli_compat.py::test_horovod_sync_bn",
    "test_parallel_math.py::test_validation_during_training_equals_evaluating_the_checkpoint_anywhere[horovodrun",
    "test_snippets.py::test_horovod_program",
    "test_bad_input.py::test_each_script_on_an_older_torch",  # horovod_distributed.py's check
    "test_multihost.py::test_horovodrun",
]
FULL_RUN = "bash dev/test.sh --all"


def pytest_addoption(parser):
    parser.addoption(
        "--all",
        action="store_true",
        dest="full_run",
        help=f"the full run ({FULL_RUN}): also the tests marked full (tests/conftest.py)",
    )


# ---- fixtures ----


@pytest.fixture(scope="session", autouse=True)
def shared_runs_folder(tmp_path_factory):
    """The folder once() keeps the session's shared runs in, one for all workers: an xdist
    worker's basetemp is <the session's basetemp>/popen-gwN."""
    base = tmp_path_factory.getbasetemp()
    shared_runs["folder"] = (
        base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    ) / "shared"
    shared_runs["folder"].mkdir(exist_ok=True)


@pytest.fixture(scope="session")
def tiny_data():
    """The tiny data set (helpers.make_tiny_data), made once per session; read-only."""
    return once("tiny_data", make_tiny_data)


@pytest.fixture(scope="session")
def reference(tiny_data):
    """The one-process run every launcher and backend must reproduce (helpers.reference_run)."""
    return reference_run(tiny_data)


@pytest.fixture(scope="module")
def slurm_cluster():
    """Holds the cluster, as it is, for a module's jobs: nobody reconfigures it meanwhile."""
    with cluster_lock(exclusive=False):
        yield


# ---- scheduling ----


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"full: runs only in the full run ({FULL_RUN}); see tests/conftest.py"
    )
    config.addinivalue_line(
        "markers", "horovod: needs Horovod; without it, runs only in the full run, which builds it"
    )
    dist = config.getoption("dist", "no")  # absent with -p no:xdist
    if dist not in ("no", "loadgroup"):
        raise pytest.UsageError(
            f"--dist {dist}: the suite runs with --dist loadgroup (dev/test.sh passes it), "
            "which keeps each xdist_group (the Slurm cluster's tests, a module's shared runs) on "
            "one worker"
        )


def group(item):
    return next(
        (m.args[0] if m.args else m.kwargs.get("name") for m in item.iter_markers("xdist_group")),
        None,
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The cluster group first (its files run one after another: the longest chain), then
    SLOW_FIRST, then the others in file order. Each xdist worker collects and sorts the same way,
    and pytest-xdist hands the tests out in this order (--no-loadscope-reorder)."""

    def start(item):
        nodeid = item.nodeid.removeprefix("tests/")
        if group(item) == "cluster":
            return 0, 0
        slow = [i for i, prefix in enumerate(SLOW_FIRST) if nodeid.startswith(prefix)]
        return (1, slow[0]) if slow else (2, 0)

    items.sort(key=start)  # stable: file order otherwise
    leave_out_full_only(config, items)


def marked(item, name, prefixes):
    nodeid = item.nodeid.removeprefix("tests/")
    return item.get_closest_marker(name) is not None or nodeid.startswith(tuple(prefixes))


def leave_out_full_only(config, items):
    """Outside the full run, deselects the full-only tests (and Horovod's, where it is missing),
    unless the command line names them; pytest_terminal_summary says how many, in one line."""
    if config.getoption("full_run"):
        return
    named = tuple(a for a in config.args if "::" in a)  # relative to the checkout, as node ids
    no_horovod = horovod_problem() is not None
    kept, left = [], []
    for item in items:
        full = marked(item, "full", FULL_ONLY) or (
            no_horovod and marked(item, "horovod", NEEDS_HOROVOD)
        )
        explicit = any(item.nodeid.endswith(n) or item.nodeid.startswith(n) for n in named)
        (left if full and not explicit else kept).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept
    config._full_only = (len(left), no_horovod)
    if hasattr(config, "workeroutput"):  # an xdist worker: the controller prints the summary
        config.workeroutput["full_only"] = config._full_only


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: what a worker left out (every worker collects alike)."""
    if "full_only" in getattr(node, "workeroutput", {}):
        node.config._full_only = tuple(node.workeroutput["full_only"])


# ---- the summary ----


def pytest_unconfigure(config):
    """Under dev/test.sh --census, every pytest process counts itself too: tests that import torch
    in-process (to call a script's functions) do it here."""
    if os.environ.get("TESTS_CENSUS_DIR"):
        import census

        census.record_this_process(os.environ["TESTS_CENSUS_DIR"], "(pytest)")


def skip_reason(report):
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def pytest_terminal_summary(terminalreporter, config):
    left, no_horovod = getattr(config, "_full_only", (0, False))
    if left:
        terminalreporter.write_line(
            f"{left} test(s) of the full run not run (architecture and precision sweeps, "
            "slow-link and multi-host benchmarks"
            + (", Horovod's: not installed here" if no_horovod else "")
            + f"): `{FULL_RUN}` runs them"
            + (" and builds Horovod" if no_horovod else "")
        )
    needing_root = [
        r for r in terminalreporter.stats.get("skipped", []) if ROOT_SKIP in skip_reason(r)
    ]
    if needing_root:
        terminalreporter.write_line(
            f"{len(needing_root)} test(s) skipped because they need root (reasons above, with "
            "-rs): as root, `bash dev/test.sh` runs them too (CI=true makes them fail instead "
            "of skipping)"
        )
