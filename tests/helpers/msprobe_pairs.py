"""Pairs of dumps written by msprobe's own writer (mindstudio-probe 26.2.0) from crossalign's two reference models.

The PyTorch side runs crossalign's torch reference model (Megatron's parameter layout), the MindSpore side
crossalign's MindSpore reference model (MindFormers' parameter layout, PyNative), one forward and backward each under
msprobe's ``PrecisionDebugger``; nothing here writes the msprobe format itself. On MindSpore's CPU backend msprobe's
statistics need ``msprobe_norm_on_cpu()`` (``crossalign/sides/mindformers/dump.py`` says what it replaces).

Both sides load the same seeded random MindFormers checkpoint; the PyTorch side loads its conversion (optionally with
a fault of ``checkpoint/faults.py``, into a (tp, pp, ep) layout) the way Megatron loads it, so a conversion fault
shows in the PyTorch dump exactly as a real Megatron run would carry it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from crossalign.config import load_config
from crossalign.diagnose.ranks import read_as_megatron_loads
from crossalign.diagnose.references import Batch, build_megatron, random_batch
from crossalign.diagnose.selfcheck import make_checkpoints
from crossalign.sides.mindformers.checkpoint import read_mindformers_checkpoint
from tests.helpers.msprobe_dumps import write_msprobe_config

REPO = Path(__file__).resolve().parents[2]
CHECKPOINT_SEED = 7
BATCH_SEED = 5


class MegatronWrappers(torch.nn.Module):
    """The model under two wrappers, as Megatron hands it to msprobe (DDP around Float16Module): msprobe names its
    modules ``module.module.decoder...``."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.module = torch.nn.ModuleDict({"module": net})

    def forward(self, *args):
        return self.module["module"](*args)


def _torch_step(net, batch: Batch) -> None:
    _, loss, mtp, aux = net(torch.from_numpy(batch.input_ids), torch.from_numpy(batch.labels),
                            torch.from_numpy(batch.loss_mask))
    (loss + mtp.sum() + aux).backward()


class ScaledGradient(torch.autograd.Function):
    """The identity forward; the backward scales the gradient."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def perturb(net: torch.nn.Module, change: str) -> torch.nn.Module:
    """A change to one side's computation, made before msprobe hooks the model (so that msprobe records what it
    makes), the weights untouched; ``change`` is ``KIND:NAME*FACTOR``:

    - ``output:MODULE*F``: the module computes its output scaled by F (its forward wrapped: msprobe's forward hook
      runs before any other, msprobe/pytorch/dump/module_dump/module_processor.py ``move_to_end(last=False)``);
    - ``grad:PARAMETER*F``: the parameter's gradient scaled by F (a tensor hook, before accumulation: the weight,
      the forward and every activation gradient stay as they are);
    - ``grad_input:MODULE*F``: the gradient the module's backward passes on to its input scaled by F (its forward
      wrapped to take its input through :class:`ScaledGradient`, inside the module msprobe hooks)."""
    kind, _, target = change.partition(":")
    name, _, factor = target.partition("*")
    scale = float(factor)
    if kind == "output":
        module = net.get_submodule(name)
        forward = module.forward
        module.forward = lambda *args, **kwargs: forward(*args, **kwargs) * scale
    elif kind == "grad":
        net.get_parameter(name).register_hook(lambda grad: grad * scale)
    elif kind == "grad_input":
        module = net.get_submodule(name)
        forward = module.forward
        module.forward = lambda x, *args, **kwargs: forward(ScaledGradient.apply(x, scale), *args, **kwargs)
    else:
        raise ValueError(f"unknown change {change!r}")
    return net


def torch_dumps(runs: list, out: Path, task: str = "statistics", level: str = "L0") -> Path:
    """One training step of the torch reference model per (model, Megatron state, batch, core version), dumped as
    msprobe steps 0, 1, ... of one PrecisionDebugger (one per process:
    msprobe/core/dump/debugger/precision_debugger.py:27-38)."""
    from msprobe.pytorch import PrecisionDebugger  # heavy optional framework, imported only when dumping


    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = write_msprobe_config(out / "config.json", out / "dump", task, level, list(range(len(runs))))
    debugger = PrecisionDebugger(config_path=str(config))
    for model, state, batch, core_version, changes in runs:
        net, _ = build_megatron(model, state, core_version, strict=False)
        for change in changes:
            net = perturb(net, change)
        net = MegatronWrappers(net)
        net.train()
        debugger.start(model=net)
        _torch_step(net, batch)
        debugger.stop()
        debugger.step()
    return out / "dump"


def mindspore_dumps(runs: list, out: Path, task: str = "statistics", level: str = "L0") -> Path:
    """One forward+backward (``mindspore.grad`` of the same loss as the PyTorch side) of the MindSpore reference
    model per (model, MindFormers state, batch) under msprobe, PyNative on CPU, as msprobe steps 0, 1, ..."""
    import mindspore as ms  # heavy optional framework, imported only when dumping the MindSpore side
    from msprobe.mindspore import PrecisionDebugger

    from crossalign.models.ms_model import Qwen35Model, load_mindformers_state  # MindSpore, likewise
    from crossalign.sides.mindformers.dump import msprobe_norm_on_cpu  # imports msprobe's MindSpore side

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = write_msprobe_config(out / "config.json", out / "dump", task, level, list(range(len(runs))))
    debugger = PrecisionDebugger(config_path=str(config))
    for model, state, batch in runs:
        net = Qwen35Model(model)
        load_mindformers_state(net, state)
        net.set_train(True)
        ids, labels, mask = ms.Tensor(batch.input_ids), ms.Tensor(batch.labels), ms.Tensor(batch.loss_mask)

        def total_loss(ids, labels, mask, net=net):
            _, loss, mtp, aux = net(ids, labels, mask)
            return loss + mtp.sum() + aux

        grad = ms.grad(total_loss, grad_position=None, weights=net.trainable_params())
        with msprobe_norm_on_cpu():
            debugger.start(net)
            grad(ids, labels, mask)
            debugger.stop()
            debugger.step()
    return out / "dump"


def _states(config_name: str, fault: str | None, layout: tuple[int, int, int]):
    """(MindFormers state, Megatron state as Megatron loads it) of the seeded random checkpoint and its conversion."""
    config = load_config(config_name)
    with tempfile.TemporaryDirectory(prefix="msprobe-ckpt-") as tmp:
        ms_ckpt, mg_ckpt = make_checkpoints(config, Path(tmp), None, fault, CHECKPOINT_SEED, layout)
        ms_state = read_mindformers_checkpoint(ms_ckpt).model_state()
        mg_state = read_as_megatron_loads(mg_ckpt, config.model, config.training.megatron_core_version).state
    return config, ms_state, mg_state


def conversions(spec: str) -> tuple[str | None, tuple[int, int, int]]:
    """``clean``, ``FAULT`` or ``FAULT@tp,pp,ep`` (each optionally ``|CHANGE|...``, see ``perturb``) -> (fault or
    None, the layout it is converted into)."""
    fault, _, layout = spec.split("|")[0].partition("@")
    return (None if fault == "clean" else fault), tuple(int(n) for n in (layout or "1,1,1").split(","))


def run_dumps(side: str, items: list[tuple[str, str]], out: Path, task: str = "statistics", level: str = "L0",
              seq: int = 8, batch: int = 1) -> dict[tuple[str, str], Path]:
    """Dumps in one fresh process (msprobe's PrecisionDebugger is a process-wide singleton), one per (config name,
    conversion spec; see ``conversions``, and ``perturb`` for the changes a PyTorch spec may add after ``|``). The
    MindSpore side runs the MindFormers checkpoint itself, so its only spec is 'clean'. Returns (config, spec) -> a
    dump
    root holding ``step0/`` (msprobe's step i of the process, moved to a folder of its own)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, "-m", "tests.helpers.msprobe_pairs", side, str(out), task, level, str(seq), str(batch),
            *(f"{name}:{spec}" for name, spec in items)]
    result = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"msprobe {side} dumps ({task}, {level}, {items}) failed:\n{result.stderr[-4000:]}")
    roots = {}
    for step, (name, spec) in enumerate(items):
        root = out / name / "".join(c if c.isalnum() or c in "._-" else "_" for c in spec)
        root.mkdir(parents=True)
        shutil.move(str(out / "dump" / f"step{step}"), root / "step0")
        roots[name, spec] = root
    return roots


def main(argv: list[str]) -> None:
    side, folder, task, level, seq, batch, *items = argv
    runs = []
    for item in items:
        name, _, spec = item.partition(":")
        config = load_config(name)
        the_batch = random_batch(config.model, int(seq), int(batch), seed=BATCH_SEED)
        core_version = config.training.megatron_core_version
        if side == "mindspore":
            if spec != "clean":
                raise SystemExit("the MindSpore side runs the MindFormers checkpoint itself: its only spec is 'clean'")
            runs.append((config.model, _states(name, None, (1, 1, 1))[1], the_batch))
        else:
            runs.append((config.model, _states(name, *conversions(spec))[2], the_batch, core_version,
                         spec.split("|")[1:]))
    if side == "mindspore":
        mindspore_dumps(runs, Path(folder), task, level)
    else:
        torch_dumps(runs, Path(folder), task, level)


if __name__ == "__main__":
    main(sys.argv[1:])
