"""What Prefect adds to each step of the DAG in distributed mode (target: under 5 s a step).

Starts a Prefect server on loopback, one agent per pool (``crossalign agent start``) and deploys
prefect.yaml, then runs the same tiny alignment twice in one store:

- by hand (the baseline): each step as ``python -m crossalign.tasks`` in DAG order, steps 4 and 5
  side by side as the flow runs them, timing each process from start to exit;
- through the deployments: the ``alignment/dense`` flow on the orchestrator pool, each step a flow
  run on its pool's worker. A step's time is its task run in the parent: from submitting the
  child to seeing it finished, which is what a step costs the DAG.

The overhead of a step is its time through the deployments less its time by hand. Also printed:
queued (the child's creation to Running: worker poll, process start, imports, flow load) and
noticed (the child's end to the parent's task ending: the parent's poll).

Both are done ``--repeat`` times, alternating, and each step's median is taken: on 2 cores a
step's own time varies by seconds from run to run. The server's database is a private PostgreSQL
cluster, as a site's server should have; with ``--database sqlite`` Prefect's default SQLite shows
what its "database is locked" retries add.

    .venv/bin/python benchmarks/orchestration.py [--repeat 3] [--database postgres|sqlite] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = "qwen35_dense_tiny"
# warmup below train_iters: Megatron's lr scheduler asserts lr_warmup_steps < lr_decay_steps (= train_iters)
SHORT = ["training.base_train_iters=3", "training.train_iters=5", "training.lr_warmup_iters=2",
         "training.seq_length=64", "training.global_batch_size=2", "training.micro_batch_size=2"]
TARGET_S = 5.0


def by_hand(store: Path, run_id: str, overrides: list[str], site: Path) -> dict[str, float]:
    """Each step as its own process, started as soon as the steps it reads from have exited, as the flow does."""
    from crossalign.dag import STEPS
    from crossalign.request import RunRequest
    from crossalign.tasks.command import step_argv
    from crossalign.tasks.prepare import prepare_run

    prepare_run(RunRequest(config=CONFIG, run_id=run_id, overrides=overrides, store=str(store),
                           mode="distributed").resolve())
    seconds: dict[str, float] = {}
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    while len(seconds) < len(STEPS):
        for spec in STEPS:
            if spec.name not in seconds and spec.name not in running and all(i in seconds for i in spec.inputs):
                argv = [*step_argv(str(store), run_id, spec.name), "--site", str(site)]
                running[spec.name] = (subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                       text=True), time.monotonic())
        for name, (proc, started) in list(running.items()):
            if proc.poll() is None:
                continue
            if proc.returncode != 0:
                sys.exit(f"by hand: step {name} failed ({proc.returncode}):\n{proc.stderr.read()[-3000:]}")
            seconds[name] = time.monotonic() - started
            del running[name]
        time.sleep(0.02)
    return seconds


def through_deployments(store: Path, run_id: str, overrides: list[str]) -> dict[str, dict[str, float]]:
    """The alignment flow through the deployments; per step: total (parent's task run), queued, noticed."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterName, FlowRunFilterParentFlowRunId,
                                                TaskRunFilter, TaskRunFilterFlowRunId)
    from prefect.deployments import run_deployment

    from crossalign.dag import STEP_NAMES

    parent = run_deployment("alignment/dense", timeout=900, poll_interval=1, parameters={
        "config": CONFIG, "run_id": run_id, "overrides": overrides, "store": str(store)})
    if not parent.state.is_completed():
        sys.exit(f"through the deployments: the alignment ended {parent.state.name}: {parent.state.message}")
    with get_client(sync_client=True) as client:
        tasks = {t.name: t for t in client.read_task_runs(task_run_filter=TaskRunFilter(
            flow_run_id=TaskRunFilterFlowRunId(any_=[parent.id])))}
        children = {r.name: r for r in client.read_flow_runs(flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(like_=run_id), parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent.id])))}
    timings = {}
    for step in STEP_NAMES:
        task, child = tasks[step], children[f"{run_id}-{step}"]
        timings[step] = {"total": (task.end_time - task.start_time).total_seconds(),
                         "queued": (child.start_time - child.created).total_seconds(),
                         "noticed": (task.end_time - child.end_time).total_seconds()}
    return timings


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed benchmark still stops its server and agents
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", dest="overrides", action="append", default=None,
                        help=f"a config override (default: {' '.join(SHORT)})")
    parser.add_argument("--database", choices=("postgres", "sqlite"), default="postgres",
                        help="the Prefect server's database (default: postgres)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each kind; medians are reported")
    parser.add_argument("--keep", type=Path, default=None, help="work in this folder and keep it (logs, store)")
    args = parser.parse_args()
    overrides = args.overrides if args.overrides is not None else SHORT

    from crossalign.agents.server import local_agents, local_server
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        store, site = root / "store", root / "site.yaml"
        root.mkdir(parents=True, exist_ok=True)
        site.write_text(f"store: {store}\nbackends: {{npu: local, gpu: local}}\n")
        with local_server(root / "prefect", database=args.database) as server, temporary_settings({PREFECT_API_URL: server.api_url}):
            env = {**server.env, "CROSSALIGN_SITE": str(site)}
            with local_agents(env, site, log_dir=root / "agents"):
                subprocess.run([str(Path(sys.executable).with_name("crossalign")), "deploy", "--prefect-file",
                                str(REPO / "prefect.yaml")], env=env, check=True, capture_output=True, cwd=REPO)
                print(f"config {CONFIG} {' '.join(overrides)}; store {store}; server database {args.database}",
                      flush=True)
                hands, flows = [], []
                for n in range(1, args.repeat + 1):
                    hands.append(by_hand(store, f"by-hand-{n}", overrides, site))
                    print(f"by hand {n}: " + ", ".join(f"{k} {v:.1f} s" for k, v in hands[-1].items()), flush=True)
                    flows.append(through_deployments(store, f"through-deployments-{n}", overrides))
                    print(f"deployed {n}: " + ", ".join(f"{k} {v['total']:.1f} s" for k, v in flows[-1].items()),
                          flush=True)

    def median(values) -> float:
        return statistics.median(values)

    print(f"\nmedians of {args.repeat} runs each")
    print(f"{'step':<16}{'by hand':>10}{'deployed':>10}{'overhead':>10}{'ratio':>8}{'queued':>9}{'noticed':>9}")
    overheads, report = {}, {}
    for step in hands[0]:
        hand_s = median([h[step] for h in hands])
        total, queued, noticed = (median([f[step][k] for f in flows]) for k in ("total", "queued", "noticed"))
        overheads[step] = total - hand_s
        report[step] = {"by_hand_s": hand_s, "deployed_s": total, "overhead_s": overheads[step],
                        "queued_s": queued, "noticed_s": noticed}
        print(f"{step:<16}{hand_s:>9.1f}s{total:>9.1f}s{overheads[step]:>9.1f}s{total / hand_s:>7.2f}x"
              f"{queued:>8.1f}s{noticed:>8.1f}s")
    mean = sum(overheads.values()) / len(overheads)
    print(f"\nmean overhead per step: {mean:.2f} s (target < {TARGET_S:.0f} s: {'yes' if mean < TARGET_S else 'no'}); "
          f"server database {args.database}")
    print(json.dumps({"database": args.database, "repeat": args.repeat, "steps": report, "mean_overhead_s": mean}))


if __name__ == "__main__":
    main()
