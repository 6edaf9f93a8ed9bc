"""Preflight: do the two launch configurations train the same thing? Read back, side by side.

Every setting that changes the numbers is read back FROM what each framework will actually be
given, by two independent readers: :func:`read_megatron_args` interprets a ``pretrain_gpt.py``
argument list with Megatron's own defaults (megatron-core 0.16 training arguments), and
:func:`read_mindformers_yaml` interprets a pynative TrainConfig with MindFormers' defaults and
key aliases. Neither looks at our model config, so a generator bug, a hand-edited file or a
user's own script is caught the same way. Where a setting is absent the framework default is
used and shown as such: Megatron's default split 969,30,1, linear decay and dropout 0.1, and
MindFormers' norm_topk_prob False or betas (0.9, 0.95), are exactly the silent differences
this check exists for (SPEC sections 5, 6 and 9).

The learning rate is compared as applied, per step, under each side's semantics (SPEC 6):
Megatron step k uses the scheduler after k-1 increments (warmup counted in samples);
MindFormers' ConstantWarmUpLR is read at global_step k-1 before the increment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from crossalign.config import AlignmentConfig, TrainingConfig
from crossalign.sides.readings import LAYOUT, UNSET, Reading, shown_value
from crossalign.sides.megatron.args_reader import read_megatron_args
from crossalign.sides.mindformers.yaml_reader import read_mindformers_yaml
from crossalign.sides.megatron.side import MEGATRON
from crossalign.sides.mindformers.side import MINDFORMERS

LR_STEPS_SHOWN = 12



@dataclass(frozen=True)
class PreflightRow:
    name: str
    megatron: str
    mindformers: str
    ok: bool
    note: str = ""


@dataclass
class PreflightReport:
    rows: list[PreflightRow] = field(default_factory=list)

    @property
    def mismatches(self) -> list[str]:
        return [row.name for row in self.rows if not row.ok]

    @property
    def ok(self) -> bool:
        return not self.mismatches



def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return False
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b



# ---- side by side ------------------------------------------------------------------------------------


def compare_readings(megatron: Mapping[str, Reading], mindformers: Mapping[str, Reading]) -> PreflightReport:
    report = PreflightReport()
    names = [n for n in megatron if not n.startswith("_")]
    names += [n for n in mindformers if not n.startswith("_") and n not in megatron]
    for name in names:
        mg = megatron.get(name, Reading(None, "-"))
        mf = mindformers.get(name, Reading(None, "-"))
        if name == "vocab rows" and mg.value is None and mg.shown != UNSET:
            report.rows.append(PreflightRow(name, mg.shown, mf.shown, True, "not checked: a real tokenizer"))
            continue
        if name.startswith(LAYOUT):
            same = mg.value == mf.value or _same(mg.value, mf.value)
            report.rows.append(PreflightRow(name, mg.shown, mf.shown, True, "" if same else
                                            "the sides' layouts differ: expected, the loss must not depend on it"))
            continue
        note = " / ".join(o for o in (mg.origin, mf.origin) if o == "default")
        report.rows.append(PreflightRow(name, mg.shown, mf.shown, _same(mg.value, mf.value),
                                        "framework default used" if note else ""))
    mg_lr, mf_lr = megatron.get("_lr_at"), mindformers.get("_lr_at")
    if mg_lr is not None and mf_lr is not None:
        warmups = [r.value for r in (megatron.get("lr warmup steps"), mindformers.get("lr warmup steps"))
                   if r is not None and isinstance(r.value, int)]
        steps = [r.value for r in (megatron.get("train steps"), mindformers.get("train steps"))
                 if r is not None and isinstance(r.value, int)]
        last = min(max(warmups + [1]) + 2, LR_STEPS_SHOWN, *(steps or [LR_STEPS_SHOWN]))
        for k in range(1, last + 1):
            a, b = mg_lr.value(k), mf_lr.value(k)
            report.rows.append(PreflightRow(f"lr applied at step {k}", shown_value(a), shown_value(b), _same(a, b)))
    mtp = mindformers.get("MTP layers")
    recompute = mindformers.get("_recompute")
    if recompute is not None and mtp is not None and mtp.value:
        report.rows.append(PreflightRow("recompute mode (MTP)", "-", recompute.shown, recompute.value == "None",
                                        'MindFormers needs the string "None" with MTP'))
    return report


def preflight_config(config: AlignmentConfig | None = None, megatron_args: Sequence[str] | None = None,
                     mindformers_yaml: Mapping[str, Any] | None = None) -> PreflightReport:
    """Read both launch configurations back and compare them; each defaults to the one generated from config."""
    if (megatron_args is None or mindformers_yaml is None) and config is None:
        raise ValueError("preflight_config needs a config, or both megatron_args and mindformers_yaml")
    core_version = (config.training.megatron_core_version if config is not None
                    else TrainingConfig.model_fields["megatron_core_version"].default)
    worlds = ((config.parallel.megatron.world_size, config.parallel.mindformers.world_size) if config is not None
              else (None, None))
    report = compare_readings(
        MEGATRON.generated_readings(config) if megatron_args is None
        else read_megatron_args(megatron_args, core_version, worlds[0]),
        MINDFORMERS.generated_readings(config) if mindformers_yaml is None
        else read_mindformers_yaml(mindformers_yaml, worlds[1]))
    if config is not None and config.model.norm_convention == "zero_centred":
        # MindFormers has no 1+w norm: the converter stores w = g - 1 for Megatron, so the forms differ by design.
        report.rows = [replace(row, ok=True, note="expected: model.norm_convention zero_centred "
                               "(the converter shifts each gamma by 1)")
                       if row.name == "norm weight form" and row.megatron == "1+w" else row for row in report.rows]
    return report
