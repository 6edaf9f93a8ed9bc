"""Peak memory of ms2mg into Megatron's torch_dist format, against the model's bytes and against legacy ``--format torch``.

ms2mg ``--format torch_dist`` holds the converted model in memory and hands it to megatron-core's
own ``dist_checkpointing.save`` (``crossalign/sides/megatron/torch_dist.py``), which builds the
GPTModel on the CPU; legacy ``--format torch`` streams (memory about one rule's tensors). For each
config a random bf16 MindFormers checkpoint is written, then each format converted in a process of
its own (``--dtype``, bf16 by default), and its peak RSS (ru_maxrss) printed against the model's
bytes in the output dtype, after the RSS of a process that only imports what a step imports.
The ratio is what ``convert`` warns with (``TORCH_DIST_MEMORY`` in ``checkpoint/convert.py``).

    .venv/bin/python benchmarks/convert_torch_dist.py [--configs qwen35_moe_tiny qwen35_dense] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import memory_available  # noqa: E402

CHILD = """
import json, os, sys, time
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the crossalign commands set it
from pathlib import Path
step, config, source, target, dtype = sys.argv[1:6]
from crossalign.checkpoint.convert import convert_checkpoint
from crossalign.models.layout import random_mindformers_state
from crossalign.sides.mindformers.checkpoint import default_common, write_mindformers_checkpoint
from crossalign.config import load_config
model = load_config(config).model
start = time.perf_counter()
if step == "generate":
    state = {key: value.bfloat16() for key, value in random_mindformers_state(model, seed=1).items()}
    write_mindformers_checkpoint(Path(target), 100, state, None, default_common(100, 8))
    bytes_out = 0
else:
    report = convert_checkpoint(model, "ms2mg", Path(source), Path(target), dtype=dtype, ckpt_format=step)
    bytes_out = report.bytes_out
print(json.dumps({"seconds": time.perf_counter() - start, "bytes_out": bytes_out}))
"""
IMPORTS = ("import torch, crossalign.checkpoint.convert, crossalign.sides.megatron.torch_dist, "
           "megatron.core.dist_checkpointing, megatron.core.models.gpt")


def run_child(step: str, config: str, source: Path, target: Path, dtype: str) -> tuple[dict, int]:
    """(what the child printed, its peak RSS in bytes)."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, step, config, str(source), str(target), dtype],
                             stdout=subprocess.PIPE, text=True)
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{step} of {config} failed with exit code {os.waitstatus_to_exitcode(status)}")
    return json.loads(output.splitlines()[-1]), usage.ru_maxrss * 1024


def import_rss() -> int:
    child = subprocess.Popen([sys.executable, "-c", IMPORTS])
    _, _, usage = os.wait4(child.pid, 0)
    return usage.ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["qwen35_moe_tiny", "qwen35_dense"])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--workdir", type=Path, default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    base = args.workdir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    baseline = import_rss()
    rows = []
    with tempfile.TemporaryDirectory(dir=base, prefix="crossalign-bench-torch-dist-") as tmp:
        for config in args.configs:
            source = Path(tmp) / f"{config}-ms"
            print(f"{config}: generating a random bf16 MindFormers checkpoint ...", flush=True)
            run_child("generate", config, source, source, args.dtype)
            for step in ("torch", "torch_dist"):
                print(f"{config}: ms2mg --format {step} --dtype {args.dtype} ...", flush=True)
                out = Path(tmp) / f"{config}-{step}"
                result, rss = run_child(step, config, source, out, args.dtype)
                rows.append({"config": config, "format": step, "model": result["bytes_out"], "rss": rss,
                             "seconds": result["seconds"]})
                shutil.rmtree(out)
            shutil.rmtree(source)
    print()
    print(f"{'config':<18}{'format':>11}{'model MB':>10}{'RSS MB':>9}{'RSS-imports MB':>16}{'/model':>8}{'s':>7}")
    for r in rows:
        above = r["rss"] - baseline
        print(f"{r['config']:<18}{r['format']:>11}{r['model'] / 1e6:>10.0f}{r['rss'] / 1e6:>9.0f}{above / 1e6:>16.0f}"
              f"{above / r['model']:>8.2f}{r['seconds']:>7.1f}")
    print(f"RSS of a process that only imports torch, crossalign and megatron-core: {baseline / 1e6:.0f} MB; "
          f"memory available now: {memory_available() / 1e9:.1f} GB")


if __name__ == "__main__":
    main()
