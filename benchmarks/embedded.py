"""Benchmark of the embedded megatron-train step: megatron-core on CPU against our PyTorch trainer as baseline.

The DAG's step 4 used to train our PyTorch Qwen3.5 (``backends/local/torch_trainer.py``); it
now trains megatron-core's GPTModel with megatron-core's DDP, optimizer and scheduler
(``backends/local/mcore_trainer.py``). Both train the same converted checkpoint on the same
batches for the config's ``train_iters`` steps, each in a fresh process (imports, model build,
checkpoint load and training all counted, as the step pays them), alternating, ``--repeat``
times; the medians are compared. Target: megatron-core no slower than the baseline
(ratio <= 1.0, with ``--tolerance`` for the noise of a shared machine). The last logged
losses of both are printed with their largest relative difference after ``train_iters``
steps (fp32 on both; the two gated-delta-rule forms round differently).

    .venv/bin/python benchmarks/embedded.py [--configs qwen35_dense_tiny ...] [--repeat 3] [--tolerance 0.1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

TINY = ("qwen35_dense_tiny", "qwen35_moe_tiny")

CHILD = """
import json, sys, time
start = time.perf_counter()
from pathlib import Path
import numpy as np
trainer, name, workdir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
from crossalign.sides.protocol import DatasetFiles, TrainRequest
from crossalign.checkpoint.convert import mindformers_to_megatron
from crossalign.models.layout import random_mindformers_state
from crossalign.config import load_config
if trainer == "megatron-core":
    from crossalign.sides.megatron.embedded.trainer import run_training
else:
    from crossalign.sides.megatron.embedded.torch_trainer import run_training
config = load_config(name)
t = config.training
state = mindformers_to_megatron(random_mindformers_state(config.model, seed=1), config.model)
batches = np.random.default_rng(0).integers(0, config.model.vocab_size,
                                            (t.train_iters, t.global_batch_size, t.seq_length + 1), dtype=np.int64)
request = TrainRequest(config=config, side="megatron", mode="align",
                       data=DatasetFiles(workdir / "data", workdir / "tokenizer.json"),
                       output_dir=workdir / trainer, init_checkpoint=workdir / "checkpoint")
result = run_training(request, state, 1, batches)
last = [line for line in request.log_path.read_text().splitlines() if "| learning rate:" in line][-1]
fields = dict(part.strip().split(": ", 1) for part in last.split("|") if ": " in part)
print(json.dumps({"train_seconds": result.seconds, "iterations": result.iterations,
                  "last": {k: v for k, v in fields.items() if "loss" in k or k == "grad norm"},
                  "child_seconds": time.perf_counter() - start}))
"""


def measure(trainer: str, name: str, workdir: str) -> dict:
    """One training run in a fresh process; its own timings plus the wall time of the whole process."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, trainer, name, workdir], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{trainer} on {name} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_seconds"] = time.perf_counter() - start
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", default=list(TINY), help="configs (default: both tiny ones)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each trainer, alternating (default 3)")
    parser.add_argument("--tolerance", type=float, default=0.1, help="ratio allowed above 1.0 (default 0.1)")
    args = parser.parse_args()

    rows = []
    for name in args.configs:
        times: dict[str, list[float]] = {"PyTorch reference": [], "megatron-core": []}
        last: dict[str, dict] = {}
        with tempfile.TemporaryDirectory(prefix="crossalign-bench-embedded-") as workdir:
            for run in range(args.repeat):
                for trainer in times:
                    result = measure("torch" if trainer == "PyTorch reference" else trainer, name, workdir)
                    times[trainer].append(result["process_seconds"])
                    last[trainer] = result["last"]
                    print(f"{name} run {run + 1}: {trainer} {result['process_seconds']:.1f} s "
                          f"(training loop and setup {result['train_seconds']:.1f} s, {result['iterations']} "
                          f"iterations)", flush=True)
        base, mcore = (statistics.median(times[t]) for t in ("PyTorch reference", "megatron-core"))
        print(f"{name}: last iteration, PyTorch reference {last['PyTorch reference']}\n"
              f"{' ' * len(name)}  last iteration, megatron-core     {last['megatron-core']}", flush=True)
        ours, theirs = last["PyTorch reference"], last["megatron-core"]
        drift = max(abs(float(theirs[k]) - float(ours[k])) / abs(float(ours[k])) for k in ours if "loss" in k)
        rows.append((name, base, mcore, drift))

    print(f"\n{'config':<20} {'baseline s':>11} {'megatron-core s':>16} {'x baseline':>11} {'loss drift':>11}  verdict")
    for name, base, mcore, drift in rows:
        ratio = mcore / base
        verdict = "ok" if ratio <= 1.0 + args.tolerance else "SLOW"
        print(f"{name:<20} {base:>11.1f} {mcore:>16.1f} {ratio:>11.2f} {drift:>11.1e}  {verdict}")


if __name__ == "__main__":
    main()
