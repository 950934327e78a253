"""--amp auto picks the precision the hardware runs natively, and the run's first line says
which and why, so mixed precision is never slower than fp32.

A CI machine may or may not run bf16 natively, so each kind of hardware is covered on any
machine: a CPU without native bf16 for real (ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
hide native bf16 from PyTorch on every CPU), CPUs with it and GPUs by mocking what the
decision reads (/proc/cpuinfo, PyTorch's CPU capability, torch.cuda's device queries).
"""

import importlib.util
import io
import json
import os

import pytest
import torch
from helpers import PY, ROOT, TINY, env, metrics, run, script

AVX2_ONLY = dict(ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2")


@pytest.fixture(scope="module")
def apex():
    """apex_distributed.py imported as a module, to call its decision directly."""
    spec = importlib.util.spec_from_file_location(
        "apex_distributed_under_test", script("apex_distributed.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse(apex, *argv):
    p = apex.build_parser()
    apex.add_backend_args(p)
    return p.parse_args(list(argv))


def first_lines(stdout, n=2):
    return stdout.splitlines()[:n]


# ---- for real, on a CPU without native bf16 (emulated on any CPU) ----


def test_auto_trains_in_fp32_on_a_cpu_without_native_bf16_and_says_why_first(tiny_data, tmp_path):
    p = run(
        [
            PY,
            script("apex_distributed.py"),
            "--data",
            tiny_data,
            *TINY,
            "--output-dir",
            str(tmp_path),
        ],
        env=env(**AVX2_ONLY),
    )
    first = first_lines(p.stdout)[0]
    assert first.startswith(
        "apex_distributed.py: amp: fp32 (this CPU has no native bf16: AVX2, oneDNN limited to "
        "AVX2), channels_last off, optimizer torch.optim.sgd.SGD;"
    ), first
    assert "1 process(es), backend gloo, device cpu" in first, first  # one line says it all
    assert metrics(str(tmp_path))[-1]["amp"] == "off"


def test_explicit_bf16_without_native_support_runs_with_one_warning(tiny_data, tmp_path):
    p = run(
        [
            PY,
            script("apex_distributed.py"),
            "--data",
            tiny_data,
            *TINY,
            "--amp",
            "bf16",
            "--output-dir",
            str(tmp_path),
        ],
        env=env(**AVX2_ONLY),
    )
    first = first_lines(p.stdout)[0]
    assert first.startswith("apex_distributed.py: amp: bf16 (--amp bf16; warning: AVX2"), first
    assert "no native bf16" in first and "slower than fp32" in first, first
    assert sum("warning" in line for line in (p.stdout + p.stderr).splitlines()) == 1
    assert metrics(str(tmp_path))[-1]["amp"] == "bf16"


def test_cpu_peak_tool_sees_what_the_scripts_see(tmp_path):
    out = tmp_path / "peak.json"
    run(
        [
            PY,
            os.path.join(ROOT, "tools", "benchmark_report.py"),
            "cpu-peak",
            "--threads",
            "1",
            "--seconds",
            "0.2",
            "--json",
            str(out),
        ],
        env=env(**AVX2_ONLY),
    )
    peak = json.loads(out.read_text())
    assert peak["native_bf16"] is False and peak["capability"].startswith("AVX2")
    # GFLOP/s
    assert set(peak["peak_gflops"]) == {"fp32"} and peak["peak_gflops"]["fp32"]["1"] > 0.5


# ---- the CPU capability check, on mocked CPUs ----


@pytest.mark.parametrize(
    "flags,aten,isa,expected",
    [
        ("avx2 avx512f avx512_bf16 amx_bf16 amx_tile", "AVX512", None, (True, "AMX")),
        ("avx2 avx512f avx512_bf16", "AVX512", None, (True, "AVX512_BF16")),
        # Skylake/Cascade Lake
        ("avx2 avx512f", "AVX512", None, (False, "AVX512 without AVX512_BF16")),
        ("avx2", "AVX2", None, (False, "AVX2")),  # Zen 3, Haswell..Comet Lake
        # ATEN_CPU_CAPABILITY=avx2
        ("avx2 avx512f avx512_bf16 amx_bf16", "AVX2", None, (False, "AVX2")),
        (
            "avx2 avx512f avx512_bf16 amx_bf16",
            "AVX512",
            "AVX512_CORE",
            (False, "AVX512, oneDNN limited to AVX512_CORE"),
        ),
        ("avx2 avx512f avx512_bf16 amx_bf16", "AVX512", "AVX512_CORE_AMX", (True, "AMX")),
    ],
)
def test_native_bf16_needs_the_instructions_and_permission_to_use_them(
    apex, monkeypatch, flags, aten, isa, expected
):
    cpuinfo = f"processor\t: 0\nflags\t\t: fpu sse sse2 {flags}\n"
    monkeypatch.setattr(apex, "open", lambda path, *a, **k: io.StringIO(cpuinfo), raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: aten)
    if isa:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    else:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert apex.cpu_bf16_support() == expected


# ---- the decision, on mocked hardware ----


def test_auto_picks_bf16_and_channels_last_where_the_cpu_runs_bf16_natively(apex, monkeypatch):
    monkeypatch.setattr(apex, "cpu_bf16_support", lambda: (True, "AMX"))
    amp, channels_last, why = apex.choose_precision(parse(apex), torch.device("cpu"))
    assert (amp, channels_last, why) == ("bf16", True, "this CPU runs bf16 natively: AMX")
    # an explicit choice is kept, with no warning where it is native
    assert (
        apex.choose_precision(parse(apex, "--amp", "bf16"), torch.device("cpu"))[2] == "--amp bf16"
    )
    assert apex.choose_precision(parse(apex, "--amp", "off"), torch.device("cpu"))[:2] == (
        "off",
        False,
    )
    assert apex.choose_precision(parse(apex, "--no-channels-last"), torch.device("cpu"))[:2] == (
        "bf16",
        False,
    )


def test_auto_picks_fp32_without_channels_last_where_the_cpu_lacks_native_bf16(apex, monkeypatch):
    monkeypatch.setattr(apex, "cpu_bf16_support", lambda: (False, "AVX512 without AVX512_BF16"))
    assert apex.choose_precision(parse(apex), torch.device("cpu")) == (
        "off",
        False,
        "this CPU has no native bf16: AVX512 without AVX512_BF16",
    )
    amp, _, why = apex.choose_precision(parse(apex, "--amp", "fp16"), torch.device("cpu"))
    assert amp == "fp16" and "warning" in why and "no native fp16" in why


def fake_gpu(monkeypatch, name, capability):
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: capability >= (8, 0)
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


@pytest.mark.parametrize(
    "name,capability,amp,words",
    [
        ("NVIDIA H100 80GB HBM3", (9, 0), "bf16", "no GradScaler"),
        ("NVIDIA A100-SXM4-80GB", (8, 0), "bf16", "no GradScaler"),
        ("Tesla V100-SXM2-32GB", (7, 0), "fp16", "fp16 with GradScaler"),
        ("Tesla T4", (7, 5), "fp16", "fp16 with GradScaler"),
    ],
)
def test_auto_on_gpus_picks_bf16_from_ampere_on_and_fp16_with_a_scaler_before(
    apex, monkeypatch, name, capability, amp, words
):
    fake_gpu(monkeypatch, name, capability)
    got, channels_last, why = apex.choose_precision(parse(apex), torch.device("cuda", 0))
    assert (got, channels_last) == (amp, True) and words in why, why
    explicit = apex.choose_precision(parse(apex, "--amp", "bf16"), torch.device("cuda", 0))[2]
    assert ("warning" in explicit) == (capability < (8, 0)), explicit


# ---- fp16's GradScaler and the optimizer the scripts build for CUDA ----


def test_fp16_step_that_overflows_first_leaves_the_momentum_untouched(apex):
    """GradScaler skips a step whose gradients overflow: routine on the first steps of fp16
    training, while it lowers its scale. A fused SGD creates its momentum buffers uninitialized on
    that first step and returns without writing them, so the next step read garbage. The scripts
    therefore build SGD unfused under fp16's GradScaler; here the optimizer they build for CUDA runs
    on CPU, which has the same fused kernel."""

    def train(optimizer_of):
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 8)
        optimizer = optimizer_of(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        x, y = torch.randn(32, 64), torch.randint(0, 8, (32,))
        for step in range(3):
            # step 0 overflows
            loss = torch.nn.functional.cross_entropy(model(x), y) * (1e36 if step == 0 else 1.0)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        return model, optimizer

    args = parse(apex, "--amp", "fp16", "--lr", "0.1")
    scripts_model, optimizer = train(lambda m: apex.build_optimizer(m, args, torch.device("cuda")))
    assert not optimizer.defaults.get("fused")
    # the textbook loop, parameter by parameter
    reference, _ = train(
        lambda m: torch.optim.SGD(
            m.parameters(), 0.1, momentum=0.9, weight_decay=1e-4, foreach=False
        )
    )
    for p, q in zip(scripts_model.parameters(), reference.parameters(), strict=True):
        assert torch.isfinite(p).all() and (p - q).abs().max() < 1e-6
    for state in optimizer.state.values():
        assert (
            torch.isfinite(state["momentum_buffer"]).all()
            and state["momentum_buffer"].abs().max() < 10
        )
    # where no GradScaler runs (bf16, fp32), the fused kernel stays
    assert (
        apex.build_optimizer(
            torch.nn.Linear(2, 2), parse(apex, "--amp", "bf16", "--lr", "0.1"), torch.device("cuda")
        ).defaults["fused"]
        is True
    )
