"""The comparison's result, everything the report says: ``Summary.to_dict()`` is summary.json
(its fields are described in SUMMARY_SCHEMA.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from crossalign.report.metrics import LrCheck, SeriesMetrics

SCHEMA_VERSION = 2


@dataclass
class Summary:
    """Everything the report says; ``to_dict()`` is the content of summary.json."""

    verdict: str
    reasons: list[str]
    diagnosis: list[dict]
    notes: list[str]
    gold_standard: bool
    series: dict[str, SeriesMetrics]
    lr: LrCheck
    inputs: dict[str, dict]
    criteria: dict
    coverage: dict = field(default_factory=dict)
    megatron_iteration2: list[dict] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "verdict": self.verdict,
            "reasons": self.reasons,
            "diagnosis": self.diagnosis,
            "notes": self.notes,
            "gold_standard": self.gold_standard,
            "coverage": self.coverage,
            "megatron_iteration2": self.megatron_iteration2,
            "criteria": self.criteria,
            "series": {name: m.to_dict() for name, m in self.series.items()},
            "lr": self.lr.to_dict(),
            "inputs": self.inputs,
            "files": self.files,
            "timings": self.timings,
        }
