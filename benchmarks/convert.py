"""Benchmark of the checkpoint steps on the real configs: bf16 cast and MindSpore -> Megatron conversion.

For each config it writes a random MindFormers checkpoint (fp32, ~2.8 GB) into a temporary
folder, then runs each step in a subprocess of its own and compares

* its time with ``cp`` of the same input and output bytes, in the same run (target <= 1.5x),
  every timed operation starting after ``sync`` so that none pays for another's writeback,
  the step and the copy alternating ``--repeats`` times with the fastest of each kept; the
  step's time starts once its modules are imported (importing torch takes 1-3 s whatever the
  model), and the time of the whole process, imports included, is shown next to it ("proc s");
* its peak RSS (the child's ru_maxrss) with 1.25x the largest output file + 300 MB.

The cast reads the fp32 checkpoint and writes bf16 (DAG step 2); the conversion reads that
bf16 checkpoint and writes fp32 Megatron (DAG step 3, the default --dtype).

    .venv/bin/python benchmarks/convert.py [--configs qwen35_dense qwen35_moe] [--workdir DIR] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NEEDED_DISK = 12 * 2**30  # input fp32 + bf16 + Megatron fp32 + the largest copy, one config at a time
NEEDED_MEMORY = 5 * 2**30

CHILD = """
import json, os, sys, time
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the crossalign commands set it
from pathlib import Path
step, config, source, target = sys.argv[1:5]
from crossalign.checkpoint.cast import cast_bf16
from crossalign.checkpoint.convert import convert_checkpoint
from crossalign.models.layout import random_mindformers_state
from crossalign.sides.mindformers.checkpoint import default_common, write_mindformers_checkpoint
from crossalign.config import load_config
model = load_config(config).model
start = time.perf_counter()  # after the imports (torch: 1-3 s), which "proc s" includes
if step == "generate":
    write_mindformers_checkpoint(Path(target), 100, random_mindformers_state(model, seed=1), None,
                                 default_common(100, 8))
elif step == "cast":
    cast_bf16(Path(source), Path(target))
else:
    convert_checkpoint(model, "ms2mg", Path(source), Path(target))
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def run_child(step: str, config: str, source: Path, target: Path) -> tuple[float, float, int]:
    """(seconds of the step once imported, seconds of the whole process, peak RSS in bytes) of one step."""
    os.sync()  # start from a clean page cache: no step pays for the writeback of the one before
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", CHILD, step, config, str(source), str(target)],
                             stdout=subprocess.PIPE, text=True)
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"{step} of {config} failed with exit code {child.returncode}")
    return json.loads(output.splitlines()[-1])["seconds"], time.perf_counter() - start, usage.ru_maxrss * 1024


def copy_seconds(files: list[Path], scratch: Path) -> float:
    """Time of ``cp`` of every file (each copy removed right after)."""
    total = 0.0
    for file in files:
        target = scratch / f"copy-{file.name}"
        os.sync()
        start = time.perf_counter()
        subprocess.run(["cp", str(file), str(target)], check=True)
        total += time.perf_counter() - start
        target.unlink()
    return total


def copy_seconds_in_one_go(files: list[Path], scratch: Path) -> float:
    """Time of ``cp`` of every file one after the other, as one copy job: one sync before the first and none
    between them, as a conversion writes its files (each copy is removed after its time is taken).

    ``copy_seconds`` syncs before every file, which empties the dirty page cache each time: a
    copy of many GB then never meets the kernel's writeback throttling that a conversion of the
    same bytes meets, and the baseline is a different, faster job.
    """
    total = 0.0
    os.sync()
    for file in files:
        target = scratch / f"copy-{file.name}"
        start = time.perf_counter()
        subprocess.run(["cp", str(file), str(target)], check=True)
        total += time.perf_counter() - start
        target.unlink()
    return total


def files_of(folder: Path, pattern: str) -> list[Path]:
    return sorted(p for p in folder.rglob(pattern) if p.is_file())


def memory_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def benchmark(config: str, workdir: Path, repeats: int) -> list[dict]:
    source, bf16, megatron = workdir / "ms-fp32", workdir / "ms-bf16", workdir / "megatron"
    print(f"[{config}] generating a random MindFormers checkpoint ...", flush=True)
    run_child("generate", config, source, source)
    rows = []
    for step, inp, out, pattern_in, pattern_out in (("cast-bf16", source, bf16, "*.safetensors", "*.safetensors"),
                                                    ("convert", bf16, megatron, "*.safetensors", "*.pt")):
        runs, copies = [], []
        for attempt in range(repeats):  # the step and its cp baseline alternate; the best of each is kept
            print(f"[{config}] {step} ({attempt + 1}/{repeats}) ...", flush=True)
            if out.exists():
                shutil.rmtree(out)
            runs.append(run_child("cast" if step == "cast-bf16" else "convert", config, inp, out))
            inputs, outputs = files_of(inp, pattern_in), files_of(out, pattern_out)
            copies.append(copy_seconds(inputs + outputs, workdir))
        seconds, process_seconds = min(r[0] for r in runs), min(r[1] for r in runs)
        rss, cp = max(r[2] for r in runs), min(copies)
        largest = max(f.stat().st_size for f in outputs)
        budget = 1.25 * largest + 300e6
        rows.append({
            "config": config, "step": step,
            "bytes_in": sum(f.stat().st_size for f in inputs), "bytes_out": sum(f.stat().st_size for f in outputs),
            "seconds": seconds, "process_seconds": process_seconds, "cp_seconds": cp, "time_ratio": seconds / cp,
            "process_ratio": process_seconds / cp,
            "peak_rss": rss, "rss_budget": budget, "rss_ratio": rss / budget,
        })
    for folder in (source, bf16, megatron):
        shutil.rmtree(folder)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["qwen35_dense", "qwen35_moe"])
    parser.add_argument("--workdir", type=Path, default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each step and of its cp baseline; "
                        "the fastest of each counts (a shared machine is noisy)")
    args = parser.parse_args()
    base = args.workdir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(base).free
    if free < NEEDED_DISK:
        raise SystemExit(f"{base}: {free / 2**30:.1f} GiB free, the benchmark needs {NEEDED_DISK / 2**30:.0f} GiB")
    if memory_available() < NEEDED_MEMORY:
        raise SystemExit(f"{memory_available() / 2**30:.1f} GiB of memory available, "
                         f"the benchmark needs {NEEDED_MEMORY / 2**30:.0f} GiB")
    rows = []
    with tempfile.TemporaryDirectory(dir=base, prefix="crossalign-bench-") as workdir:
        for config in args.configs:
            rows += benchmark(config, Path(workdir), args.repeats)
    print()
    print(f"{'config':<14}{'step':<11}{'in MB':>8}{'out MB':>8}{'step s':>8}{'proc s':>8}{'cp s':>7}"
          f"{'time/cp':>9}{'proc/cp':>9}{'RSS MB':>8}{'budget':>8}{'RSS/bud':>9}")
    for r in rows:
        print(f"{r['config']:<14}{r['step']:<11}{r['bytes_in'] / 1e6:>8.0f}{r['bytes_out'] / 1e6:>8.0f}"
              f"{r['seconds']:>8.2f}{r['process_seconds']:>8.2f}{r['cp_seconds']:>7.2f}{r['time_ratio']:>9.2f}"
              f"{r['process_ratio']:>9.2f}"
              f"{r['peak_rss'] / 1e6:>8.0f}{r['rss_budget'] / 1e6:>8.0f}{r['rss_ratio']:>9.2f}")
    print("targets: time/cp <= 1.5 (cp of the step's input and output files), RSS/budget <= 1.0 "
          "(budget = 1.25 x largest output file + 300 MB)")
    failed = [r for r in rows if r["time_ratio"] > 1.5 or r["rss_ratio"] > 1.0]
    for r in failed:
        print(f"MISSED: {r['config']} {r['step']}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
