"""transformers' Qwen3.5 beside our models: a Hugging Face checkpoint as the selfcheck source, fp32 parity of all
four implementations on the tiny dense and MoE configs, and the CLI's --hf."""

import pytest
import torch
from helpers.hf_tiny import make_hf_checkpoint
from typer.testing import CliRunner

from crossalign.cli import app
from crossalign.diagnose.references import SideError
from crossalign.diagnose.selfcheck import IMPLEMENTATIONS, selfcheck

SEQ, BATCH = 32, 2


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_all_implementations_agree_on_a_hugging_face_checkpoint(tmp_path, kind):
    hf = make_hf_checkpoint(tmp_path / "hf", kind, dtype=torch.float32)
    report = selfcheck(f"qwen35_{kind}_tiny", seq=SEQ, batch=BATCH, hf_ckpt=hf)
    assert report.passed, report.failures()
    assert [r.name for r in report.implementations] == ["MindSpore", "PyTorch", "megatron-core", "transformers"]
    assert report.huggingface_checkpoint == str(hf) and report.mindspore_checkpoint == "converted here"
    for pair in report.pairs:
        checks = {c.name: c for c in pair.checks}
        assert checks["lm loss"].max_rel <= 1e-5 and checks["mtp_1 loss"].max_rel <= 1e-5, pair.name
        if kind == "moe":  # transformers' routers scored with Megatron's switch loss: the same choices
            assert checks["aux loss"].reference > 0 and checks["aux loss"].max_rel <= 1e-5, pair.name


def test_hf_source_excludes_the_other_sources_and_the_cli_runs_it(tmp_path):
    hf = make_hf_checkpoint(tmp_path / "hf", "dense")
    with pytest.raises(SideError, match="--hf is the source checkpoint"):
        selfcheck("qwen35_dense_tiny", tmp_path, seq=SEQ, batch=BATCH, hf_ckpt=hf)
    result = CliRunner().invoke(app, ["selfcheck", "--model", "qwen35_dense_tiny", "--hf", str(hf), "--seq", str(SEQ),
                                      "--batch", "1"])
    assert result.exit_code == 0, result.output
    assert "transformers" in result.output and "4 implementations agree" in result.output
    wrong = CliRunner().invoke(app, ["selfcheck", "--model", "qwen35_moe_tiny", "--hf", str(hf)])
    assert wrong.exit_code == 2 and "does not match model qwen35_moe_tiny" in wrong.output


def test_where_transformers_and_pytorch_part_is_named(tmp_path):
    """A shared-expert fc1 left interleaved by the Megatron conversion: the first module to differ is layer 0's MLP."""
    from crossalign.checkpoint.convert import convert_checkpoint
    from crossalign.models.layout import random_mindformers_state
    from crossalign.sides.mindformers.checkpoint import default_common, write_mindformers_checkpoint
    from crossalign.config import load_config

    model = load_config("qwen35_moe_tiny").model
    write_mindformers_checkpoint(tmp_path / "ms", 1, random_mindformers_state(model, seed=3), None, default_common(1))
    convert_checkpoint(model, "ms2mg", tmp_path / "ms", tmp_path / "mg", fault="shared_fc1_not_deinterleaved")
    two = [i for i in IMPLEMENTATIONS if i.name in ("PyTorch", "transformers")]  # MindSpore's forward adds nothing here
    report = selfcheck("qwen35_moe_tiny", tmp_path / "ms", tmp_path / "mg", seq=SEQ, batch=1, implementations=two)
    assert not report.passed and report.pairs[0].name == "PyTorch vs transformers"
    assert report.departure.startswith("first at transformers lm.model.layers.0.mlp / PyTorch decoder.layers.0.mlp")
