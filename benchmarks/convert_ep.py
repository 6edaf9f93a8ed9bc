"""Benchmark of the conversion of a many-expert MoE checkpoint into expert parallel 8 and back.

The model is qwen35_moe with 128 routed experts (top-8) at a small width (hidden 512, expert
ffn 256, vocab 32768): the real config's 9 MoE layers (8 decoder + MTP) hold 2,304 routed
expert tensors in Megatron's per-expert form, so the per-tensor cost of the converter shows,
while the bytes (about 1 GB bf16 in) stay manageable. Two steps, each in a subprocess of its own:

* ms2mg --ep 8: the bf16 MindFormers checkpoint into 8 expert-parallel Megatron rank files (fp32);
* mg2ms: those 8 files merged back into one MindFormers checkpoint (fp32).

``--format torch_dist`` writes Megatron's torch_dist checkpoint instead (one copy of the model, a
chunk per routed expert, streamed without the model) and reads it back a chunk at a time.

Each is compared, in the same run, with ``cp`` of its input and output files in one go (time,
target <= 1.5x, the best of ``--repeats``; ``convert.copy_seconds_in_one_go`` says why not a sync
before each file, which is shown too), and its peak RSS with its largest output file (printed:
a streaming writer needs little more than the largest file, a merging reader holds the model).

    .venv/bin/python benchmarks/convert_ep.py [--experts 128] [--ep 8] [--format torch_dist] [--workdir DIR]
                                              [--repeats N]
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

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import copy_seconds, copy_seconds_in_one_go, files_of, memory_available  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NEEDED_DISK = 8 * 2**30
NEEDED_MEMORY = 5 * 2**30

CHILD = """
import json, os, sys, time
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the crossalign commands set it
from pathlib import Path
step, config, source, target, ep, ckpt_format = sys.argv[1:7]
from crossalign.checkpoint.convert import convert_checkpoint
from crossalign.models.layout import random_mindformers_state
from crossalign.sides.mindformers.checkpoint import default_common, write_mindformers_checkpoint
from crossalign.config import load_config
model = load_config(config).model
start = time.perf_counter()  # after the imports, which "proc s" includes
if step == "generate":
    state = {key: value.bfloat16() for key, value in random_mindformers_state(model, seed=1).items()}
    write_mindformers_checkpoint(Path(target), 100, state, None, default_common(100, 8))
elif step == "ms2mg":
    convert_checkpoint(model, "ms2mg", Path(source), Path(target), ep=int(ep) if ckpt_format == "torch" else 1,
                       ckpt_format=ckpt_format)
else:
    convert_checkpoint(model, "mg2ms", Path(source), Path(target))
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def many_expert_config(folder: Path, experts: int) -> Path:
    """qwen35_moe with ``experts`` routed experts at a small width, as a config file."""
    config = yaml.safe_load((ROOT / "model_configs" / "qwen35_moe.yaml").read_text())
    config["model"].update(name=f"qwen35_moe_{experts}e", num_experts=experts, moe_router_topk=8, hidden_size=512,
                           moe_ffn_hidden_size=256, moe_shared_expert_intermediate_size=256, vocab_size=32768,
                           padded_vocab_size=32768)
    path = folder / f"qwen35_moe_{experts}e.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_child(step: str, config: Path, source: Path, target: Path, ep: int,
              ckpt_format: str = "torch") -> tuple[float, float, int]:
    """(seconds of the step once imported, seconds of the whole process, peak RSS in bytes) of one step."""
    os.sync()
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", CHILD, step, str(config), str(source), str(target), str(ep),
                              ckpt_format], stdout=subprocess.PIPE, text=True)
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{step} failed with exit code {os.waitstatus_to_exitcode(status)}")
    return json.loads(output.splitlines()[-1])["seconds"], time.perf_counter() - start, usage.ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--ep", type=int, default=8, help="expert-parallel ranks of the legacy checkpoint")
    parser.add_argument("--format", dest="ckpt_format", default="torch", choices=["torch", "torch_dist"],
                        help="the Megatron checkpoint format (torch_dist: one copy, no --ep)")
    parser.add_argument("--workdir", type=Path, default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each step and of its cp baseline")
    args = parser.parse_args()
    base = args.workdir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(base).free < NEEDED_DISK:
        raise SystemExit(f"{base}: the benchmark needs {NEEDED_DISK / 2**30:.0f} GiB free")
    if memory_available() < NEEDED_MEMORY:
        raise SystemExit(f"the benchmark needs {NEEDED_MEMORY / 2**30:.0f} GiB of memory available")
    rows = []
    with tempfile.TemporaryDirectory(dir=base, prefix="crossalign-bench-ep-") as tmp:
        work = Path(tmp)
        config = many_expert_config(work, args.experts)
        source, megatron, back = work / "ms-bf16", work / "megatron", work / "ms-back"
        print(f"generating a random {args.experts}-expert MindFormers checkpoint (bf16) ...", flush=True)
        run_child("generate", config, source, source, args.ep)
        megatron_files = "*.pt" if args.ckpt_format == "torch" else "*.distcp"
        for step, inp, out, pattern_in, pattern_out in (("ms2mg", source, megatron, "*.safetensors", megatron_files),
                                                        ("mg2ms", megatron, back, megatron_files, "*.safetensors")):
            runs, copies, synced = [], [], []
            for attempt in range(args.repeats):
                where = f"ep={args.ep}" if args.ckpt_format == "torch" else "torch_dist"
                print(f"{step} {where} ({attempt + 1}/{args.repeats}) ...", flush=True)
                if out.exists():
                    shutil.rmtree(out)
                runs.append(run_child(step, config, inp, out, args.ep, args.ckpt_format))
                inputs, outputs = files_of(inp, pattern_in), files_of(out, pattern_out)
                copies.append(copy_seconds_in_one_go(inputs + outputs, work))
                synced.append(copy_seconds(inputs + outputs, work))
            largest = max(f.stat().st_size for f in outputs)
            rows.append({"step": step, "files_out": len(outputs),
                         "bytes_in": sum(f.stat().st_size for f in inputs),
                         "bytes_out": sum(f.stat().st_size for f in outputs),
                         "seconds": min(r[0] for r in runs), "process_seconds": min(r[1] for r in runs),
                         "cp_seconds": min(copies), "cp_synced": min(synced), "peak_rss": max(r[2] for r in runs), "largest": largest})
    print()
    print(f"{'step':<7}{'files':>6}{'in MB':>8}{'out MB':>8}{'step s':>8}{'proc s':>8}{'cp s':>7}{'time/cp':>9}"
          f"{'cp sync s':>10}{'t/cp sync':>10}{'RSS MB':>8}{'largest':>9}{'RSS/largest':>12}")
    for r in rows:
        print(f"{r['step']:<7}{r['files_out']:>6}{r['bytes_in'] / 1e6:>8.0f}{r['bytes_out'] / 1e6:>8.0f}"
              f"{r['seconds']:>8.2f}{r['process_seconds']:>8.2f}{r['cp_seconds']:>7.2f}"
              f"{r['seconds'] / r['cp_seconds']:>9.2f}{r['cp_synced']:>10.2f}{r['seconds'] / r['cp_synced']:>10.2f}"
              f"{r['peak_rss'] / 1e6:>8.0f}{r['largest'] / 1e6:>9.0f}"
              f"{r['peak_rss'] / r['largest']:>12.2f}")
    print("target: time/cp <= 1.5, cp of the step's input and output files in one go (one sync before, as the step "
          "writes them); 'cp sync' syncs before each file (no writeback throttling), shown for comparison; "
          "RSS/largest output file is printed")
    print(f"load average (1, 5, 15 min) at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())} on "
          f"{os.cpu_count()} CPUs (mg2ms checks EP replicas on a second core: a busy machine slows it more than cp)")
    failed = [r["step"] for r in rows if r["seconds"] / r["cp_seconds"] > 1.5]
    for step in failed:
        print(f"MISSED: {step}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
