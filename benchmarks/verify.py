"""What checking a step's outputs against its manifest costs on a real-size checkpoint.

Commits a random MindFormers checkpoint of a real config (fp32, ~2.8 GB for qwen35_dense) as
step 1 of a run in a temporary store, then times, each after ``sync`` and a drop of this file's
pages where the system allows it (else the page cache is warm for all of them alike):

* the size check that runs whenever a step's completion is asked (a stat per output);
* the sha256 check of a retry or a rerun (every output read and hashed);
* the baseline: reading the same bytes (``cat > /dev/null``), which no check can beat.

    .venv/bin/python benchmarks/verify.py [--config qwen35_dense] [--workdir DIR] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path


def _drop_cache(paths: list[Path]) -> None:
    os.sync()
    for path in paths:
        with open(path, "rb") as handle:
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _timed(action, paths: list[Path]) -> float:
    _drop_cache(paths)
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="qwen35_dense")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from crossalign.models.layout import random_mindformers_state
    from crossalign.sides.mindformers.checkpoint import default_common, write_mindformers_checkpoint
    from crossalign.config import load_config
    from crossalign.store import RunStore

    workdir = Path(tempfile.mkdtemp(prefix="crossalign-verify-", dir=args.workdir))
    try:
        config = load_config(args.config)
        run = RunStore(workdir / "store").create_run("verify", config, config_source=args.config, parameters={},
                                                   code_version={})
        run.update_info(dataset={"prefix": "none", "tokenizer": "none", "fingerprint": "none"})
        with run.commit("base-train", command="benchmark") as out:
            write_mindformers_checkpoint(out.dir / "checkpoint", 100, random_mindformers_state(config.model, seed=1),
                                         None, default_common(100, 8))
        outputs = [run.step_dir("base-train") / o["path"] for o in run.manifest("base-train")["outputs"]]
        size = sum(p.stat().st_size for p in outputs)

        best: dict[str, float] = {}
        for _ in range(args.repeats):
            for name, action in (
                ("read (cat)", lambda: subprocess.run(["cat", *map(str, outputs)], stdout=subprocess.DEVNULL,
                                                      check=True)),
                ("sizes", lambda: run.damaged_outputs("base-train")),
                ("sha256", lambda: run.damaged_outputs("base-train", checksums=True)),
            ):
                best[name] = min(best.get(name, float("inf")), _timed(action, outputs))
        assert not run.damaged_outputs("base-train", checksums=True)

        print(f"{args.config}: step 1 checkpoint, {len(outputs)} files, {size / 2**30:.2f} GiB")
        print(f"{'check':<12} {'s':>8} {'GiB/s':>8} {'x read':>8}")
        for name, seconds in best.items():
            print(f"{name:<12} {seconds:8.3f} {size / 2**30 / seconds:8.2f} {seconds / best['read (cat)']:8.2f}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
