"""Benchmark of ``crossalign selfcheck``: the tiny configs (target < 60 s each) and the real dense config
(one sample of 512 tokens, target < 10 minutes).

Each measurement runs in a subprocess of its own (a real config's weights must not stay in
memory for the next one) and is compared with a baseline measured in the same run: the time
to build both reference models with random weights of the config (random state, MindSpore
model built and loaded, in-memory conversion, PyTorch model built and loaded), i.e. what any
check needs before its first forward.

    .venv/bin/python benchmarks/selfcheck.py [--configs qwen35_dense_tiny ...] [--no-real]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

TINY = ("qwen35_dense_tiny", "qwen35_moe_tiny")
REAL = ("qwen35_dense", 512, 1, 600.0)  # config, seq, batch, target seconds

CHILD = """
import json, sys, time
what, name, seq, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
from crossalign.config import load_config
config = load_config(name)
start = time.perf_counter()
if what == "baseline":
    from crossalign.checkpoint.convert import mindformers_to_megatron
    from crossalign.models.layout import random_mindformers_state
    from crossalign.diagnose.references import build_megatron, build_mindspore
    state = random_mindformers_state(config.model, seed=1234)
    ms_net = build_mindspore(config.model, state)
    del ms_net
    build_megatron(config.model, mindformers_to_megatron(state, config.model),
                   config.training.megatron_core_version)
    result = {}
else:
    from crossalign.diagnose.selfcheck import selfcheck
    report = selfcheck(config, seq=seq or None, batch=batch or None)
    result = {"passed": report.passed, "stages": report.seconds, "batch": list(report.batch_shape),
              "outputs": {f"{p.name}: {o.name}": o.max_rel for p in report.pairs for o in p.checks}, "failures": report.failures()}
result["seconds"] = time.perf_counter() - start
print(json.dumps(result))
"""


def measure(what: str, name: str, seq: int = 0, batch: int = 0) -> dict:
    """One measurement in a fresh process: its own result, plus the wall time of the whole process."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, what, name, str(seq), str(batch)], capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(f"{what} of {name} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_seconds"] = time.perf_counter() - start
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", default=list(TINY), help="tiny configs (default: both)")
    parser.add_argument("--no-real", action="store_true", help="skip the real dense config")
    args = parser.parse_args()

    cases = [(name, 0, 0, 60.0) for name in args.configs]
    if not args.no_real:
        cases.append(REAL)
    rows = []
    for name, seq, batch, target in cases:
        baseline = measure("baseline", name)
        check = measure("selfcheck", name, seq, batch)
        rows.append((name, check["batch"], baseline["process_seconds"], check["process_seconds"], target, check))
        stages = ", ".join(f"{k} {v:.1f}" for k, v in check["stages"].items())
        errors = ", ".join(f"{k} {v:.1e}" for k, v in check["outputs"].items())
        print(f"{name}: batch {check['batch']}, build-both baseline {baseline['process_seconds']:.1f} s, "
              f"selfcheck {check['process_seconds']:.1f} s (stages: {stages}); max rel errors: {errors}; "
              f"passed={check['passed']} {check['failures'] or ''}", flush=True)

    print(f"\n{'config':<20} {'batch':>9} {'baseline s':>11} {'selfcheck s':>12} {'x baseline':>11} "
          f"{'target s':>9}  verdict")
    for name, shape, base, total, target, check in rows:
        verdict = "ok" if total <= target and check["passed"] else "SLOW" if check["passed"] else "FAILED"
        print(f"{name:<20} {'x'.join(map(str, shape)):>9} {base:>11.1f} {total:>12.1f} {total / base:>11.2f} "
              f"{target:>9.0f}  {verdict}")


if __name__ == "__main__":
    main()
