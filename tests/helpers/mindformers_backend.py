"""The pieces of a MindFormers training request the backend tests share: the fixtures folder, a small checkpoint
2.0 for the stand-in trainer, a request of either mode, and a site whose MindFormers is a given checkout."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from crossalign.config import load_config
from crossalign.data.files import DatasetFiles
from crossalign.sides.mindformers.checkpoint import default_common, write_mindformers_checkpoint
from crossalign.sides.protocol import TrainRequest
from crossalign.site import MindFormersSite, SiteConfig

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def small_checkpoint(root: Path) -> Path:
    """A two-tensor checkpoint 2.0 for the stand-in run_mindformer.py to load (its network is the checkpoint's)."""
    if not root.exists():
        generator = torch.Generator().manual_seed(0)
        tensors = {name: torch.randn(8, 4, generator=generator)
                   for name in ("embedding.word_embeddings.weight", "output_layer.weight")}
        write_mindformers_checkpoint(root, 0, tensors, None, default_common(0, 4))
    return root


def request_for(tmp_path: Path, mode: str, steps: list) -> TrainRequest:
    config = load_config("qwen35_dense_tiny")
    if mode == "align":
        small_checkpoint(tmp_path / "bf16")
    return TrainRequest(config=config, side="mindformers", mode=mode,  # type: ignore[arg-type]
                        data=DatasetFiles(prefix=tmp_path / "data" / "corpus_text_document",
                                          tokenizer=tmp_path / "tokenizer.json"),
                        output_dir=tmp_path / f"{mode}-train",
                        init_checkpoint=tmp_path / "bf16" if mode == "align" else None,
                        on_step=lambda step, total, metrics: steps.append((step, total, metrics.get("mtp_1_loss"))))


def site_for(checkout: Path, **env: str) -> SiteConfig:
    return SiteConfig(mindformers=MindFormersSite(path=checkout, python=sys.executable, nproc_per_node=1, env=env))
