"""Benchmark of the conversion at the real per-layer size of Qwen3.5-397B-A17B: one MoE layer, 512 experts, EP 8.

The layer has the published model's widths (hidden 4096, 512 routed experts of width 1024, a
shared expert of 1024, 32 query heads in 2 groups of head dim 256; ``model_configs/qwen35_moe.yaml``
is the alignment config at reduced width). One of its MoE layers holds 6.4 G routed-expert
parameters: 12.9 GB in bf16. The vocabulary is cut to 2048 rows (the real one is 248320: 2 GB
per copy of the embedding in bf16, which belongs to the model, not to a layer) and there is no
MTP block, so the files hold the layer. Steps, each in a subprocess of its own:

* ms2mg --ep 8: a bf16 MindFormers checkpoint of the layer into 8 expert-parallel Megatron rank files;
* mg2ms: those 8 files back into one MindFormers checkpoint;
* mg2ms --tp 2: those 8 files into a MindFormers checkpoint saved by 2 tensor ranks (one file per
  rank and metadata.json, each tensor cut into its rank slices as it streams; the real model's 2
  query groups allow no more ranks). ``--tp 1`` leaves this step out.

``--format torch_dist`` writes Megatron's torch_dist checkpoint instead of the EP 8 rank files (one
copy of the layer, a chunk per routed expert, streamed without the model), reads it back a chunk
at a time, and with ``--parts N`` (default 2) also writes it as N parts at the same time, each in
a process of its own (as the cpu pool's workers do), then the index: one worker against N.

Both write ``--dtype`` (bf16 by default, so that the disk holds it: fp32 doubles every output).
Each step's time is compared with ``cp`` of its input and output files in one go (target <= 1.5x,
the best of ``--repeats``) and its peak RSS (the child's ru_maxrss) with its largest file. The runs
at other expert and layer counts show that the RSS does not grow with either (the slope is
printed), and the 512-expert layer is projected to the model's 60 layers.

The benchmark sizes itself to the free disk: it needs about 4.2x the layer's bf16 bytes (input,
Megatron output, one MindFormers output at a time, one copy), shrinks the expert count of a run that does not
fit (saying so), and stops when not even 64 experts fit.

    .venv/bin/python benchmarks/convert_real_layer.py [--runs 512x1 128x1 128x2] [--tp 2] [--workdir DIR] [--repeats 3]
                                                      [--format torch_dist [--parts 2]]
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

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import copy_seconds_in_one_go, files_of, memory_available  # noqa: E402  (the same cp baseline)

ROOT = Path(__file__).resolve().parents[1]
LAYERS_OF_THE_MODEL = 60
# Qwen3.5-397B-A17B (the published config.json): what one layer holds.
REAL_WIDTHS = dict(hidden_size=4096, num_attention_heads=32, num_query_groups=2, kv_channels=256,
                   linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128,
                   linear_value_head_dim=128, moe_ffn_hidden_size=1024, moe_shared_expert_intermediate_size=1024,
                   moe_router_topk=10, ffn_hidden_size=1024)
DISK_FACTOR = 4.2  # input + Megatron output (+ the non-expert part on 8 ranks) + MindFormers output + one copy
NEEDED_MEMORY = 4 * 2**30

CHILD = """
import json, os, sys, time
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the crossalign commands set it
from pathlib import Path
step, config, source, target, ep, dtype, tp, ckpt_format, part = sys.argv[1:10]
import torch
from crossalign.checkpoint.convert import convert_checkpoint
from crossalign.config import load_config
from crossalign.models.layout import mindformers_shapes
from crossalign.sides.mindformers.checkpoint import default_common, stream_mindformers_checkpoint
from crossalign.tensorio.blocks import RowBlocks
from crossalign.tensorio.torch_file import TensorSpec
model = load_config(config).model
start = time.perf_counter()  # after the imports
if step == "generate":  # random bf16 weights, written a block of rows at a time (an expert tensor is GBs)
    shapes = mindformers_shapes(model)
    generator = torch.Generator().manual_seed(1)
    def blocks(shape):
        rows = max(1, 2**25 // max(1, (torch.Size(shape).numel() // shape[0]) * 2)) if shape else 1
        for first in range(0, shape[0] if shape else 1, rows):
            part = (min(rows, shape[0] - first), *shape[1:]) if shape else ()
            yield (torch.randn(part, generator=generator) * 0.02).bfloat16()
    specs = {key: TensorSpec(tuple(shape), torch.bfloat16) for key, shape in shapes.items()}
    stream_mindformers_checkpoint(Path(target), 100, specs, ((key, RowBlocks(blocks(tuple(shape))))
                                                             for key, shape in shapes.items()), default_common(100, 8))
elif step == "ms2mg":
    convert_checkpoint(model, "ms2mg", Path(source), Path(target), ep=int(ep) if ckpt_format == "torch" else 1,
                       dtype=dtype, ckpt_format=ckpt_format)
elif step == "ms2mg-part":  # part P/N into TARGET.parts
    from crossalign.checkpoint.convert import convert_part, parts_folder
    number, parts = (int(x) for x in part.split("/"))
    convert_part(model, Path(source), parts_folder(Path(target)), number, parts, dtype=dtype)
elif step == "finish":
    from crossalign.checkpoint.convert import finish_parts, parts_folder
    finish_parts(model, Path(source), parts_folder(Path(target)), Path(target), int(part.split("/")[1]), dtype=dtype)
elif step == "mg2ms":
    convert_checkpoint(model, "mg2ms", Path(source), Path(target), dtype=dtype)
elif step == "mg2ms-tp":
    convert_checkpoint(model, "mg2ms", Path(source), Path(target), dtype=dtype, tp=int(tp))
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def layer_config(folder: Path, experts: int, layers: int) -> Path:
    """The 397B-A17B's layer widths with ``experts`` routed experts and ``layers`` layers, as a config file."""
    config = yaml.safe_load((ROOT / "model_configs" / "qwen35_moe.yaml").read_text())
    config["model"].update(REAL_WIDTHS, name=f"qwen35_397b_layer_{experts}e_{layers}l", num_experts=experts,
                           num_layers=layers, linear_attention_freq=1, mtp_num_layers=0, vocab_size=2048,
                           padded_vocab_size=2048)
    path = folder / f"layer_{experts}e_{layers}l.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def layer_bytes(experts: int, layers: int) -> int:
    """The bf16 bytes of the layers' weights (routed and shared experts, attention, router; the small rest)."""
    h, i = REAL_WIDTHS["hidden_size"], REAL_WIDTHS["moe_ffn_hidden_size"]
    heads, groups, head = REAL_WIDTHS["num_attention_heads"], REAL_WIDTHS["num_query_groups"], REAL_WIDTHS["kv_channels"]
    attention = h * head * (2 * heads + 2 * groups) + heads * head * h
    per_layer = experts * 3 * h * i + 3 * h * REAL_WIDTHS["moe_shared_expert_intermediate_size"] + experts * h + attention
    return 2 * (layers * per_layer + 2 * 2048 * h)


def _start(step: str, config: Path, source: Path, target: Path, ep: int, dtype: str, tp: int, ckpt_format: str,
           part: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, step, str(config), str(source), str(target), str(ep),
                             dtype, str(tp), ckpt_format, part], stdout=subprocess.PIPE, text=True)


def _finish(step: str, child: subprocess.Popen) -> tuple[float, int]:
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{step} failed with exit code {os.waitstatus_to_exitcode(status)}")
    return json.loads(output.splitlines()[-1])["seconds"], usage.ru_maxrss * 1024


def run_child(step: str, config: Path, source: Path, target: Path, ep: int, dtype: str,
              tp: int = 1, ckpt_format: str = "torch", part: str = "0/1") -> tuple[float, int]:
    """(seconds of the step once imported, peak RSS in bytes) of one step in a process of its own."""
    os.sync()
    return _finish(step, _start(step, config, source, target, ep, dtype, tp, ckpt_format, part))


def run_parts(config: Path, source: Path, target: Path, dtype: str, parts: int) -> tuple[float, int]:
    """ms2mg torch_dist as ``parts`` processes at the same time (the cpu pool's workers), then the index: (the
    slowest part's seconds once imported plus the index's, the largest peak RSS of any of them)."""
    os.sync()
    children = [_start("ms2mg-part", config, source, target, 1, dtype, 1, "torch_dist", f"{part}/{parts}")
                for part in range(parts)]
    done = [_finish("ms2mg-part", child) for child in children]
    index = run_child("finish", config, source, target, 1, dtype, 1, "torch_dist", f"0/{parts}")
    return max(seconds for seconds, _ in done) + index[0], max(rss for _, rss in done + [index])


def import_rss() -> int:
    """Peak RSS of a process that only imports what a step imports (torch and crossalign)."""
    child = subprocess.Popen([sys.executable, "-c", "import torch, crossalign.checkpoint.convert"])
    _, _, usage = os.wait4(child.pid, 0)
    return usage.ru_maxrss * 1024


def fitting_experts(experts: int, layers: int, free: int) -> int:
    """The most experts (halving from ``experts``, at least 64) whose run fits ``free`` bytes of disk; 0 if none."""
    while experts >= 64:
        if DISK_FACTOR * layer_bytes(experts, layers) < free:
            return experts
        experts //= 2
    return 0


def benchmark(work: Path, experts: int, layers: int, ep: int, dtype: str, repeats: int, tp: int,
              ckpt_format: str = "torch", parts: int = 1) -> list[dict]:
    config = layer_config(work, experts, layers)
    source, megatron, back, back_tp = work / "ms-bf16", work / "megatron", work / "ms-back", work / "ms-back-tp"
    print(f"[{experts} experts x {layers} layer(s)] generating a random bf16 MindFormers checkpoint "
          f"({layer_bytes(experts, layers) / 1e9:.1f} GB) ...", flush=True)
    run_child("generate", config, source, source, ep, dtype)
    rows = []
    files = "*.pt" if ckpt_format == "torch" else "*.distcp"
    steps = [("ms2mg", source, megatron, "*.safetensors", files), ("mg2ms", megatron, back, files, "*.safetensors")]
    if ckpt_format == "torch_dist" and parts > 1:  # first, into the folder the one-process ms2mg then writes
        steps.insert(0, (f"ms2mg {parts} parts", source, megatron, "*.safetensors", files))
    if tp > 1:
        steps.append(("mg2ms-tp", megatron, back_tp, files, "*.safetensors"))
    for step, inp, out, pattern_in, pattern_out in steps:
        runs, copies = [], []
        for attempt in range(repeats):
            print(f"[{experts} experts x {layers} layer(s)] {step} ({attempt + 1}/{repeats}) ...", flush=True)
            if out.exists():
                shutil.rmtree(out)
            if step.endswith(" parts"):
                runs.append(run_parts(config, inp, out, dtype, parts))
            else:
                runs.append(run_child(step, config, inp, out, ep, dtype, tp, ckpt_format))
            inputs, outputs = files_of(inp, pattern_in), files_of(out, pattern_out)
            copies.append(copy_seconds_in_one_go(inputs + outputs, work))
        rows.append({"experts": experts, "layers": layers, "step": step if step != "mg2ms-tp" else f"mg2ms tp{tp}",
                     "bytes_in": sum(f.stat().st_size for f in inputs),
                     "bytes_out": sum(f.stat().st_size for f in outputs),
                     "seconds": min(r[0] for r in runs), "cp_seconds": min(copies),
                     "peak_rss": max(r[1] for r in runs),
                     "largest": max(f.stat().st_size for f in inputs + outputs)})
        if out in (back, back_tp) or step.endswith(" parts"):  # no later step reads it: its disk is free
            shutil.rmtree(out)
    for folder in (source, megatron):
        shutil.rmtree(folder)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", default=["512x1", "128x1", "128x2"],
                        help="EXPERTSxLAYERS of each run; the first is the real layer, projected to the model")
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--tp", type=int, default=2, help="tensor ranks of the mg2ms --tp step (1: no such step)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--workdir", type=Path, default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each step and of its cp baseline")
    parser.add_argument("--format", dest="ckpt_format", default="torch", choices=["torch", "torch_dist"],
                        help="the Megatron checkpoint format (torch_dist: one copy, no --ep)")
    parser.add_argument("--parts", type=int, default=2, help="with torch_dist: also ms2mg as this many parts in "
                        "processes of their own at the same time, then the index (1: no such step)")
    args = parser.parse_args()
    base = args.workdir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    if memory_available() < NEEDED_MEMORY:
        raise SystemExit(f"{memory_available() / 2**30:.1f} GiB of memory available, the benchmark needs "
                         f"{NEEDED_MEMORY / 2**30:.0f} GiB")
    baseline = import_rss()
    rows = []
    with tempfile.TemporaryDirectory(dir=base, prefix="crossalign-bench-layer-") as tmp:
        for spec in args.runs:
            experts, layers = (int(x) for x in spec.split("x"))
            free = shutil.disk_usage(base).free
            fitting = fitting_experts(experts, layers, free)
            if fitting == 0:
                raise SystemExit(f"{base}: {free / 1e9:.0f} GB free; not even 64 experts x {layers} layer(s) fit "
                                 f"({DISK_FACTOR * layer_bytes(64, layers) / 1e9:.0f} GB needed): cannot run")
            if fitting != experts:
                print(f"{base}: {free / 1e9:.0f} GB free, {experts} experts x {layers} layer(s) need "
                      f"{DISK_FACTOR * layer_bytes(experts, layers) / 1e9:.0f} GB: running {fitting} experts instead")
            rows += benchmark(Path(tmp), fitting, layers, args.ep, args.dtype, args.repeats, args.tp,
                              args.ckpt_format, args.parts)
    print()
    print(f"{'experts':>8}{'layers':>7}{'step':>15}{'in GB':>8}{'out GB':>8}{'step s':>8}{'cp s':>8}{'time/cp':>9}"
          f"{'RSS MB':>8}{'largest MB':>11}{'RSS/largest':>12}")
    for r in rows:
        print(f"{r['experts']:>8}{r['layers']:>7}{r['step']:>15}{r['bytes_in'] / 1e9:>8.2f}{r['bytes_out'] / 1e9:>8.2f}"
              f"{r['seconds']:>8.1f}{r['cp_seconds']:>8.1f}{r['seconds'] / r['cp_seconds']:>9.2f}"
              f"{r['peak_rss'] / 1e6:>8.0f}{r['largest'] / 1e6:>11.0f}{r['peak_rss'] / r['largest']:>12.2f}")
    print(f"RSS of a process that only imports torch and crossalign: {baseline / 1e6:.0f} MB")
    for step in dict.fromkeys(r["step"] for r in rows):
        mine = [r for r in rows if r["step"] == step]
        one_layer = sorted((r for r in mine if r["layers"] == 1), key=lambda r: r["experts"])
        if len(one_layer) > 1:
            low, high = one_layer[0], one_layer[-1]
            slope = (high["peak_rss"] - low["peak_rss"]) / (high["experts"] - low["experts"]) * 128
            print(f"{step}: RSS {low['peak_rss'] / 1e6:.0f} MB at {low['experts']} experts, "
                  f"{high['peak_rss'] / 1e6:.0f} MB at {high['experts']}: {slope / 1e6:+.0f} MB per 128 experts "
                  f"(the largest file grows by {(high['largest'] - low['largest']) / (high['experts'] - low['experts']) * 128 / 1e6:.0f} MB)")
        by_layers = {r["layers"]: r for r in mine if r["experts"] == min(x["experts"] for x in mine)}
        if 1 in by_layers and 2 in by_layers:
            print(f"{step}: RSS {by_layers[1]['peak_rss'] / 1e6:.0f} MB with 1 layer, {by_layers[2]['peak_rss'] / 1e6:.0f} "
                  f"MB with 2: {(by_layers[2]['peak_rss'] - by_layers[1]['peak_rss']) / 1e6:+.0f} MB per layer")
    real = [r for r in rows if r["layers"] == 1 and r["experts"] == rows[0]["experts"]]
    for r in real:
        n = LAYERS_OF_THE_MODEL
        print(f"projected to {n} layers of {r['experts']} experts, {r['step']}: {n * r['bytes_in'] / 1e9:.0f} GB in, "
              f"{n * r['bytes_out'] / 1e9:.0f} GB out, {n * r['seconds'] / 60:.1f} min (cp {n * r['cp_seconds'] / 60:.1f} "
              f"min), peak RSS {r['peak_rss'] / 1e6:.0f} MB as for one layer")
        if r["step"] == "ms2mg" and args.ckpt_format == "torch_dist":
            for workers in (4, 8, 15):  # machines of their own, each writing 60/N layers as one part
                print(f"projected to {n} layers on {workers} workers (a part of {n / workers:.0f} layers each, "
                      f"machines of their own sharing the store): {n * r['seconds'] / workers / 60:.1f} min each, "
                      f"peak RSS {r['peak_rss'] / 1e6:.0f} MB each")
    print("target: time/cp <= 1.5 (cp of the step's input and output files in one go, one sync before); "
          "RSS flat in experts and layers")
    failed = [r for r in rows if r["seconds"] / r["cp_seconds"] > 1.5]
    for r in failed:
        print(f"MISSED: {r['experts']} experts x {r['layers']} layer(s) {r['step']}")
    print(f"load average (1, 5, 15 min) at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())} on "
          f"{os.cpu_count()} CPUs")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
