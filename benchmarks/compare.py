"""How long parsing and comparing two 100,000-step logs takes (target: under 2 s in total).

Writes a MindFormers pynative log and a Megatron 0.16 log (MoE aux loss and one MTP layer) of
``--steps`` steps into a temporary folder, then times, best of ``--repeat``:

- baseline: counting the lines of both files (``sum(1 for _ in open(f))``);
- parse: both logs into DataFrames;
- compare: metrics (co-movement included), coverage of the expected steps, the iteration-2 readings
  of a Megatron log of unknown core version, lr check, verdict and diagnoses;
- outputs (reported apart, with ``--outputs``): steps.csv, loss.png, report.html/md, summary.json.

Wall time and CPU time are both printed: on a shared machine the CPU time is the steadier one.

    .venv/bin/python benchmarks/compare.py [--steps 100000] [--repeat 3] [--outputs]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from crossalign.logs.synthetic import megatron_lines, mindformers_lines, write_log
from crossalign.report.compare import CompareOptions, build_summary, parse_both
from crossalign.report.render import write_outputs


def timed(fn, repeat: int):
    """(result, best wall seconds, cpu seconds of that run)."""
    best = None
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if best is None or wall < best[1]:
            best = (result, wall, cpu)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--outputs", action="store_true", help="also time writing the report files")
    args = parser.parse_args()

    rng = np.random.default_rng(1234)
    k = np.arange(args.steps)
    gpu_lm = 12.0 - 3.0 * (1 - np.exp(-k / 5000)) + rng.normal(0, 0.02, args.steps)
    npu_lm = gpu_lm * (1 + rng.normal(0, 2e-4, args.steps))
    lr = list(1e-4 * np.minimum(k, 2000) / 2000)
    aux = list(1.0 + rng.normal(0, 0.01, args.steps))

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        npu_log = write_log(tmp / "npu.log", mindformers_lines(list(npu_lm), mtp=[list(npu_lm + 0.4)], aux=aux,
                                                               lr_applied=lr))
        gpu_log = write_log(tmp / "gpu.log", megatron_lines(list(gpu_lm), mtp=[list(gpu_lm + 0.4)], aux=aux,
                                                            lr_applied=lr))
        sizes = f"{npu_log.stat().st_size / 1e6:.1f} MB + {gpu_log.stat().st_size / 1e6:.1f} MB"
        options = CompareOptions(expect_steps=args.steps)  # core version unknown: both readings tested

        def count_lines() -> int:
            return sum(sum(1 for _ in open(f, encoding="utf-8")) for f in (npu_log, gpu_log))

        def parse():
            return parse_both(npu_log, gpu_log, options)

        lines, base_wall, base_cpu = timed(count_lines, args.repeat)
        (npu, gpu), parse_wall, parse_cpu = timed(parse, args.repeat)
        (summary, merged), cmp_wall, cmp_cpu = timed(lambda: build_summary(npu, gpu, options), args.repeat)
        total_wall, total_cpu = parse_wall + cmp_wall, parse_cpu + cmp_cpu

        print(f"logs: 2 x {args.steps} steps, {lines} lines, {sizes}; verdict {summary.verdict}")
        print(f"baseline line count : {base_wall:7.3f} s wall  {base_cpu:7.3f} s cpu")
        print(f"parse both logs     : {parse_wall:7.3f} s wall  {parse_cpu:7.3f} s cpu")
        print(f"compare             : {cmp_wall:7.3f} s wall  {cmp_cpu:7.3f} s cpu")
        print(f"parse + compare     : {total_wall:7.3f} s wall  {total_cpu:7.3f} s cpu  "
              f"= {total_wall / base_wall:.1f}x the line count  (target < 2 s: "
              f"{'met' if total_wall < 2.0 else 'NOT met'})")
        if args.outputs:
            _, out_wall, out_cpu = timed(lambda: write_outputs(summary, merged, tmp / "out"), 1)
            print(f"outputs (csv, png, html, md, json): {out_wall:7.3f} s wall  {out_cpu:7.3f} s cpu")


if __name__ == "__main__":
    main()
