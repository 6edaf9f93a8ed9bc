"""Every fault of ``crossalign/checkpoint/faults.py`` through msprobe dumps of both embedded trainers: MindSpore at
TP 1 against megatron-core at TP 2 x EP 2 (the MoE config; the dense config at TP 2 for dense-only faults), then
``crossalign diagnose --npu-dump --gpu-dump``. One row per fault: the module the diagnosis names, the module expected,
pass or fail, seconds. A fault passes where the first divergence (a weight row, else an activation) lies in the
expected module, the forward's first divergence in it or its parent (MindSpore's MoE cell is the first activation
paired around the routed experts), and crossalign's likely cause names the fault.

A fault that renames a tensor (``a_log_not_renamed``, ``wrong_mtp_prefix``) stops megatron-core's strict load, as
Megatron-LM's strict load stops: there the load's own error naming the tensor is the expected outcome.

    PYTHONPATH=. python scripts/msprobe_fault_matrix.py [--out DIR] [--task tensor|statistics] [FAULT ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from crossalign.checkpoint.faults import FAULTS, LAYOUT_FAULTS
from crossalign.diagnose.msprobe_match import _module_of_key
from crossalign.diagnose.msprobe_run import diagnose_msprobe
from tests.helpers.embedded_msprobe_dumps import embedded_dump_pair

MOE, DENSE = "qwen35_moe_tiny", "qwen35_dense_tiny"
# fault -> (config, the module (prefix) it must be named at; for a renaming fault: the tensor the load must name)
EXPECTED = {
    "routed_expert_not_transposed": (MOE, "decoder.layers.0.mlp.experts"),
    "shared_fc1_not_deinterleaved": (MOE, "decoder.layers.0.mlp.shared_experts.linear_fc1"),
    "dense_fc1_not_deinterleaved": (DENSE, "decoder.layers.0.mlp.linear_fc1"),
    "in_proj_wrong_order": (MOE, "decoder.layers.0.self_attention.in_proj"),
    "conv1d_wrong_axis": (MOE, "decoder.layers.0.self_attention"),
    "a_log_not_renamed": (MOE, "decoder.layers.0.self_attention.a_log"),
    "wrong_mtp_prefix": (MOE, "mtp.layers.0."),
    "gate_up_swapped": (MOE, "decoder.layers.0.mlp"),
    "in_proj_split_as_one_block": (MOE, "decoder.layers.0.self_attention.in_proj"),
    "experts_not_renumbered": (MOE, "decoder.layers.0.mlp.experts"),
}
RENAMING = ("a_log_not_renamed", "wrong_mtp_prefix")


def named_module(diagnosis) -> str:
    """The module of the first divergence: a weight's module, or the activation's."""
    first = diagnosis.first_divergence
    if first is None:
        return "(none)"
    return first.megatron.rsplit(".", 1)[0] if first.section in ("weights", "weight gradients") else \
        _module_of_key(first.megatron)


def run_one(fault: str, out: Path, task: str, clean: dict) -> tuple[str, str, bool, str]:
    """(named, expected, passed, note) for one fault."""
    config, expected = EXPECTED[fault]
    try:
        pair = embedded_dump_pair(config, out / fault, task=task, fault=fault, npu_of=clean.get(config))
    except RuntimeError as exc:
        text = str(exc)
        # the load's own message (the last line that says so: the traceback above it quotes the source)
        refusals = [line for line in text.splitlines() if "McoreLoadError: " in line]
        if fault in RENAMING and refusals:
            words = [word.strip(",;:") for word in refusals[-1].split()]
            named = next((word for word in words if word.startswith(expected)), "(not named)")
            return named, expected, named != "(not named)", ("megatron-core's strict load stops, naming it (the "
                                                             "expected outcome): " + refusals[-1].split("does not load the checkpoint: ")[-1][:160])
        return "(no dump)", expected, False, text.strip().splitlines()[-1][:120]
    if fault in RENAMING:
        return "(loaded)", expected, False, "the load did not stop"
    diagnosis = diagnose_msprobe(pair.npu, pair.gpu, pair.config, out / fault / "diagnosis", precision="fp32").diagnosis
    named = named_module(diagnosis)
    forward = diagnosis.first["forward"]
    forward_at = _module_of_key(forward.megatron) if forward is not None else "(none)"
    caused = any(fault in cause.faults for cause in diagnosis.causes)
    passed = named.startswith(expected) and (forward is None or forward_at.startswith(expected.rsplit(".", 1)[0]))
    note = f"{diagnosis.first_divergence.section}; forward first at {forward_at}; " \
           f"{'cause names it' if caused else 'cause does NOT name it'}"
    return named, expected, passed and caused, note


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("faults", nargs="*", default=list(FAULTS) + list(LAYOUT_FAULTS))
    parser.add_argument("--out", type=Path, default=None, help="where the dumps go (default: a temporary folder)")
    parser.add_argument("--task", default="tensor", choices=("tensor", "statistics"))
    args = parser.parse_args()
    unknown = [fault for fault in args.faults if fault not in EXPECTED]
    if unknown:
        parser.error(f"unknown faults {unknown}; known: {', '.join(EXPECTED)}")
    out = args.out or Path(tempfile.mkdtemp(prefix="msprobe-fault-matrix-"))
    started = time.monotonic()
    clean = {}
    for config in sorted({EXPECTED[fault][0] for fault in args.faults}):
        t0 = time.monotonic()
        pair = embedded_dump_pair(config, out / f"clean_{config}", task=args.task)
        diagnosis = diagnose_msprobe(pair.npu, pair.gpu, pair.config, out / f"clean_{config}" / "diagnosis",
                                     precision="fp32").diagnosis
        clean[config] = pair
        print(f"clean {config}: {'DIVERGES ' + diagnosis.hint() if diagnosis.diverged else 'no divergence'} "
              f"({time.monotonic() - t0:.0f} s)", flush=True)
    rows, failed = [], 0
    print(f"| fault | config | named | expected | pass | s | note |\n|---|---|---|---|---|---|---|", flush=True)
    for fault in args.faults:
        t0 = time.monotonic()
        named, expected, passed, note = run_one(fault, out, args.task, clean)
        failed += not passed
        row = f"| {fault} | {EXPECTED[fault][0]} | {named} | {expected} | {'pass' if passed else 'FAIL'} | " \
              f"{time.monotonic() - t0:.0f} | {note} |"
        rows.append(row)
        print(row, flush=True)
    print(f"{len(rows) - failed}/{len(rows)} pass in {time.monotonic() - started:.0f} s; dumps in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
