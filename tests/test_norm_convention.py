"""model.norm_convention: Megatron's zero-centred gammas (--apply-layernorm-1p) against MindFormers' plain ones."""

from pathlib import Path

import numpy as np
import torch

from crossalign.preflight.config import preflight_config
from crossalign.checkpoint.convert import convert_checkpoint, megatron_to_mindformers, mindformers_to_megatron
from crossalign.models.layout import NORM_SUFFIXES, random_mindformers_state
from crossalign.sides.megatron.checkpoint import read_megatron_checkpoint
from crossalign.sides.mindformers.checkpoint import default_common, read_mindformers_checkpoint, write_mindformers_checkpoint
from crossalign.checkpoint.norms import MEGATRON_NORM_SUFFIXES, norm_convention_problem, stored_norm_convention
from crossalign.config import load_config
from crossalign.diagnose.references import build_megatron, random_batch, run_megatron

PLAIN = load_config("qwen35_moe_tiny")
ZERO = PLAIN.model_copy(update={"model": PLAIN.model.model_copy(update={"norm_convention": "zero_centred"})})


def _state(seed=41):
    state = random_mindformers_state(PLAIN.model, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    for key in state:
        if key.endswith(NORM_SUFFIXES):  # trained-looking gammas in [0.5, 2]
            state[key] = (1 + 0.2 * torch.randn(state[key].shape, generator=gen)).clamp(0.5, 2.0)
    return state


def test_zero_centred_megatron_gammas_are_the_plain_ones_minus_one_and_round_trip_exactly():
    state = _state()
    plain = mindformers_to_megatron(state, PLAIN.model)
    zero = mindformers_to_megatron(state, ZERO.model)
    norms = [key for key in plain if key.endswith(MEGATRON_NORM_SUFFIXES)]
    assert len(norms) > 20 and any("out_norm" in key for key in norms)
    assert all(torch.equal(zero[key], plain[key] - 1) for key in norms)
    assert all(torch.equal(zero[key], plain[key]) for key in plain if key not in norms)
    for dtype in (torch.float32, torch.bfloat16):
        source = {key: value.to(dtype) for key, value in state.items()}
        back = megatron_to_mindformers(mindformers_to_megatron(source, ZERO.model), ZERO.model)
        assert all(torch.equal(back[key], source[key]) for key in source)


def test_the_megatron_reference_computes_the_same_function_under_either_convention():
    state = _state()
    batch = random_batch(PLAIN.model, 16, 1, seed=3)
    version = PLAIN.training.megatron_core_version
    plain_net, _ = build_megatron(PLAIN.model, mindformers_to_megatron(state, PLAIN.model), version)
    zero_net, _ = build_megatron(ZERO.model, mindformers_to_megatron(state, ZERO.model), version)
    wrong_net, _ = build_megatron(PLAIN.model, mindformers_to_megatron(state, ZERO.model), version)
    plain, zero, wrong = (np.asarray(run_megatron(net, batch).logits) for net in (plain_net, zero_net, wrong_net))
    assert np.array_equal(plain, zero)
    assert not np.allclose(plain, wrong, atol=1e-2)  # zero-centred gammas read as plain: every norm off by 1


def test_a_checkpoint_of_the_other_convention_is_named_with_the_flag(tmp_path):
    state = _state()
    plain, zero = mindformers_to_megatron(state, PLAIN.model), mindformers_to_megatron(state, ZERO.model)
    assert stored_norm_convention(plain)[0] == "plain" and stored_norm_convention(zero)[0] == "zero_centred"
    assert norm_convention_problem(plain, PLAIN.model, "ckpt") is None
    assert norm_convention_problem(zero, ZERO.model, "ckpt") is None
    problem = norm_convention_problem(zero, PLAIN.model, "ckpt")
    assert "stored zero_centred" in problem and "model.norm_convention: zero_centred" in problem
    assert "--apply-layernorm-1p" in problem
    assert "without --apply-layernorm-1p" in norm_convention_problem(plain, ZERO.model, "ckpt")
    # Through files: ms2mg follows the config's convention.
    write_mindformers_checkpoint(tmp_path / "ms", 1, state, None, default_common(1, 4))
    convert_checkpoint(ZERO.model, "ms2mg", tmp_path / "ms", tmp_path / "mg")
    assert norm_convention_problem(read_megatron_checkpoint(tmp_path / "mg", ZERO.model).state, PLAIN.model, "x")
    convert_checkpoint(ZERO.model, "mg2ms", tmp_path / "mg", tmp_path / "back")
    back = read_mindformers_checkpoint(tmp_path / "back")
    assert all(torch.equal(back.tensor(key), state[key]) for key in state)


def test_megatron_launch_carries_the_flag_and_preflight_expects_the_difference():
    zero = preflight_config(ZERO)
    row = next(r for r in zero.rows if r.name == "norm weight form")
    assert (row.megatron, row.mindformers, row.ok) == ("1+w", "plain w", True) and "zero_centred" in row.note
    plain = preflight_config(PLAIN)
    assert next(r for r in plain.rows if r.name == "norm weight form").megatron == "plain w"
    from crossalign.sides.megatron.args import megatron_args

    args = megatron_args(ZERO, data_prefix=Path("DATA") / "corpus_text_document", tokenizer=None,
                         load_dir=Path("CKPT"))
    assert "--apply-layernorm-1p" in args
    bad = preflight_config(PLAIN, megatron_args=args)  # a plain config given a launch with the flag
    assert "norm weight form" in bad.mismatches
