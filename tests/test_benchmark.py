"""start.sh and statistics.sh do what the README says (their speed claims come from
running start.sh, never from these tests)."""
import csv
import os
import subprocess

from PIL import Image

from conftest import ROOT, env, run


def test_statistics_samples_the_command_and_returns_its_exit_status(tmp_path):
    out = tmp_path / "s.csv"
    burn = "import time; t = time.time()\nwhile time.time() - t < 2: pass"
    run(["bash", os.path.join(ROOT, "statistics.sh"), "-o", str(out), "-i", "200", "--", "python3", "-c", burn])
    rows = list(csv.DictReader(open(out)))
    assert len(rows) >= 4
    assert max(float(r["cpu_percent"]) for r in rows) > 50  # the busy loop shows up
    assert max(float(r["rss_mb"]) for r in rows) > 1
    p = subprocess.run(["bash", os.path.join(ROOT, "statistics.sh"), "-o", str(tmp_path / "f.csv"), "--",
                        "bash", "-c", "exit 7"], capture_output=True, timeout=60)
    assert p.returncode == 7


def test_start_sh_times_each_backend_and_lists_the_ones_it_could_not_run(tiny_data, tmp_path):
    fake = tmp_path / "fake" / "horovod"  # hide Horovod, to see the reason reported
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    out = tmp_path / "results"
    run(["bash", os.path.join(ROOT, "start.sh"), "-o", str(out), "--only", "dataparallel,distributed,horovod",
         "-e", "1", "-b", "12", "-j", "0"],
        env=env(PYTHONPATH=str(tmp_path / "fake"), DATA=tiny_data, IMAGE_SIZE="32"), timeout=600)
    rows = {r["backend"]: r for r in csv.DictReader(open(out / "benchmark.csv"))}
    assert rows["dataparallel"]["status"] == rows["distributed"]["status"] == "ok"
    assert float(rows["dataparallel"]["images_per_s"]) > 0 and float(rows["distributed"]["images_per_s"]) > 0
    assert rows["distributed"]["processes"] == "2"
    assert rows["horovod"]["status"] == "skipped" and "install-horovod.sh" in rows["horovod"]["note"]
    md = (out / "benchmark.md").read_text()
    assert "| dataparallel |" in md and "horovod" in md and "distributed / dataparallel" in md
    with Image.open(out / "benchmark.png") as png:
        assert png.format == "PNG" and png.width > 200
