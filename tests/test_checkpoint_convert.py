"""MindSpore <-> Megatron conversion: the SPEC section 3 rules, validation, round trips, resharding, the CLI."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from crossalign.checkpoint.convert import convert_checkpoint, megatron_to_mindformers, mindformers_to_megatron
from crossalign.tensorio.errors import CheckpointError
from crossalign.models.layout import megatron_shapes, mindformers_shapes, random_mindformers_state
from crossalign.sides.megatron.checkpoint import read_megatron_checkpoint
from crossalign.sides.mindformers.checkpoint import default_common, read_mindformers_checkpoint, write_mindformers_checkpoint
from crossalign.checkpoint.rules import conversion_plan
from crossalign.cli import app
from crossalign.config import load_config

DENSE = load_config("qwen35_dense_tiny").model
MOE = load_config("qwen35_moe_tiny").model
L0 = "decoder.layers.0."  # a GDN layer
L3 = "decoder.layers.3."  # the full-attention layer


@pytest.fixture(scope="module")
def dense_state():
    return random_mindformers_state(DENSE, seed=11)


@pytest.fixture(scope="module")
def moe_state():
    return random_mindformers_state(MOE, seed=12)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", ["qwen35_dense", "qwen35_moe", "qwen35_dense_tiny", "qwen35_moe_tiny"])
@pytest.mark.parametrize("core", ["0.16.1", "0.17.0"])
def test_plan_uses_every_key_of_both_tables_exactly_once(name, core):
    model = load_config(name).model
    for experts in ("per_expert", "stacked"):
        plan = conversion_plan(model, core, experts)
        ms = [k for p in plan for k in p.source_keys]
        mg = [k for p in plan for k in p.target_keys]
        assert sorted(ms) == sorted(mindformers_shapes(model)) and len(ms) == len(set(ms))
        assert sorted(mg) == sorted(megatron_shapes(model, core, experts)) and len(mg) == len(set(mg))


@pytest.mark.parametrize(("name", "count"), [("qwen35_dense", 91), ("qwen35_moe", 127)])
def test_real_configs_convert_to_the_known_key_counts(name, count):
    model = load_config(name).model
    meta = {k: torch.empty(s, device="meta") for k, s in mindformers_shapes(model).items()}
    out = mindformers_to_megatron(meta, model, experts="stacked")
    assert len(out) == count
    assert {k: tuple(v.shape) for k, v in out.items()} == megatron_shapes(model, experts="stacked")


def test_dense_rules_match_the_spec_table(dense_state):
    s = dense_state
    out = mindformers_to_megatron(s, DENSE)
    assert torch.equal(out[L3 + "self_attention.linear_qkv.layer_norm_weight"], s[L3 + "input_layernorm.weight"])
    assert torch.equal(out[L3 + "self_attention.linear_qkv.weight"], s[L3 + "self_attention.linear_qkv.weight"])
    assert torch.equal(out[L0 + "self_attention.in_proj.layer_norm_weight"], s[L0 + "input_layernorm.weight"])
    parts = ["in_proj_qkv", "linear_g", "linear_b", "linear_a"]
    assert torch.equal(out[L0 + "self_attention.in_proj.weight"],
                       torch.cat([s[f"{L0}self_attention.{p}.weight"] for p in parts]))
    assert torch.equal(out[L0 + "self_attention.conv1d.weight"], s[L0 + "self_attention.conv1d.weight"][:, :, 0, :])
    assert torch.equal(out[L0 + "self_attention.A_log"], s[L0 + "self_attention.a_log"])
    assert torch.equal(out[L0 + "self_attention.out_proj.weight"], s[L0 + "self_attention.linear_proj.weight"])
    fc1 = s[L0 + "mlp.linear_fc1.weight"]
    assert torch.equal(out[L0 + "mlp.linear_fc1.weight"], torch.cat([fc1[0::2], fc1[1::2]]))
    assert torch.equal(out[L0 + "mlp.linear_fc1.layer_norm_weight"], s[L0 + "pre_mlp_layernorm.weight"])
    assert torch.equal(out["mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight"],
                       s["mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight"])


def test_swiglu_and_conv_compute_the_same_function_on_both_sides(dense_state, moe_state):
    """What the rules mean: MindSpore's interleaved fc1 and (E,H,2i) experts equal Megatron's [G;U] forms."""
    x = torch.randn(5, DENSE.hidden_size)
    out = mindformers_to_megatron(dense_state, DENSE)
    h = (x @ dense_state[L0 + "mlp.linear_fc1.weight"].T).reshape(5, -1, 2)  # MindFormers: (.., ffn, 2), 0 = gate
    ms = F.silu(h[..., 0]) * h[..., 1]
    gate, up = (x @ out[L0 + "mlp.linear_fc1.weight"].T).chunk(2, dim=-1)
    torch.testing.assert_close(F.silu(gate) * up, ms)

    out = mindformers_to_megatron(moe_state, MOE)
    w1 = moe_state[L0 + "mlp.experts.weight1"]
    for e in range(MOE.num_experts):
        g_ms, u_ms = (x @ w1[e]).chunk(2, dim=-1)  # [in, out] with contiguous gate|up halves
        g_mg, u_mg = (x @ out[f"{L0}mlp.experts.linear_fc1.weight{e}"].T).chunk(2, dim=-1)
        torch.testing.assert_close((g_mg, u_mg), (g_ms, u_ms))
        y = torch.randn(5, MOE.moe_ffn_hidden_size)
        torch.testing.assert_close(y @ out[f"{L0}mlp.experts.linear_fc2.weight{e}"].T,
                                   y @ moe_state[L0 + "mlp.experts.weight2"][e])

    seq = torch.randn(1, DENSE.conv_channels, 9)
    w_ms = dense_state[L0 + "self_attention.conv1d.weight"]
    k = DENSE.linear_conv_kernel_dim
    ms_conv = F.conv2d(seq[:, :, None, :], w_ms, padding=(0, k - 1), groups=DENSE.conv_channels)[:, :, 0, :9]
    mg_conv = F.conv1d(seq, mindformers_to_megatron(dense_state, DENSE)[L0 + "self_attention.conv1d.weight"],
                       padding=k - 1, groups=DENSE.conv_channels)[..., :9]
    torch.testing.assert_close(mg_conv, ms_conv)


def test_moe_rules_and_graph_expert_layout(moe_state):
    s = moe_state
    stacked = mindformers_to_megatron(s, MOE, experts="stacked")
    assert torch.equal(stacked[L0 + "mlp.experts.linear_fc1.weight"], s[L0 + "mlp.experts.weight1"].transpose(1, 2))
    assert torch.equal(stacked[L0 + "mlp.shared_experts.gate_weight"],
                       s[L0 + "mlp.shared_experts.shared_experts_gate.weight"])
    fc1 = s[L0 + "mlp.shared_experts.linear_fc1.weight"]
    assert torch.equal(stacked[L0 + "mlp.shared_experts.linear_fc1.weight"], torch.cat([fc1[0::2], fc1[1::2]]))
    assert torch.equal(stacked[L0 + "self_attention.in_proj.weight"], s[L0 + "self_attention.in_proj.weight"])
    graph = dict(s)
    for key in [k for k in s if k.endswith(("experts.weight1", "experts.weight2"))]:
        graph[key] = s[key].reshape(-1, s[key].shape[-1])  # graph mode: [E*H, 2i] / [E*i, H]
    assert _same(mindformers_to_megatron(graph, MOE), mindformers_to_megatron(s, MOE))


@pytest.mark.parametrize("core", ["0.16.1", "0.17.0"])
@pytest.mark.parametrize("experts", ["per_expert", "stacked"])
def test_round_trip_is_bit_identical(dense_state, moe_state, core, experts):
    for model, state in ((DENSE, dense_state), (MOE, moe_state)):
        out = mindformers_to_megatron(state, model, core, experts)
        assert _same(megatron_to_mindformers(out, model, core), state)
    bf16 = {k: v.bfloat16() for k, v in moe_state.items()}
    assert _same(megatron_to_mindformers(mindformers_to_megatron(bf16, MOE, core, experts), MOE, core), bf16)


def test_mtp_prefix_follows_the_core_version(dense_state):
    old = mindformers_to_megatron(dense_state, DENSE, "0.16.1")
    new = mindformers_to_megatron(dense_state, DENSE, "0.17.0")
    assert any(k.startswith("mtp.layers.0.transformer_layer.") for k in old)
    assert any(k.startswith("mtp.layers.0.mtp_model_layer.") for k in new)
    with pytest.raises(CheckpointError, match="missing keys: mtp.layers.0.mtp_model_layer"):
        megatron_to_mindformers(old, DENSE, "0.17.0")


def test_bad_inputs_are_named_and_nothing_is_converted(dense_state):
    renamed = dict(dense_state)
    renamed["decoder.layers.0.self_attention.A_log"] = renamed.pop("decoder.layers.0.self_attention.a_log")
    with pytest.raises(CheckpointError) as err:
        mindformers_to_megatron(renamed, DENSE)
    assert "missing keys: decoder.layers.0.self_attention.a_log" in str(err.value)
    assert "unexpected keys: decoder.layers.0.self_attention.A_log" in str(err.value)
    extra = {**dense_state, "decoder.layers.9.mlp.linear_fc1.weight": torch.zeros(2)}
    with pytest.raises(CheckpointError, match="1 unexpected keys: decoder.layers.9.mlp.linear_fc1.weight"):
        mindformers_to_megatron(extra, DENSE)
    wrong = {**dense_state, "output_layer.weight": torch.zeros(DENSE.padded_vocab_size + 1, DENSE.hidden_size)}
    with pytest.raises(CheckpointError, match=r"wrong shapes: output_layer.weight \[2049, 64\] \(expected \[2048, 64\]\)"):
        mindformers_to_megatron(wrong, DENSE)
    with pytest.raises(CheckpointError, match="does not match model qwen35_moe_tiny"):
        mindformers_to_megatron(dense_state, MOE)


def _mf_checkpoint(root: Path, model, state, iteration=4) -> Path:
    write_mindformers_checkpoint(root, iteration, state, None, default_common(iteration, 4))
    return root


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)])
def test_reshard_then_merge_is_bit_identical(tmp_path, moe_state, tp, pp):
    source = _mf_checkpoint(tmp_path / "ms", MOE, moe_state)
    full = mindformers_to_megatron(moe_state, MOE)
    report = convert_checkpoint(MOE, "ms2mg", source, tmp_path / "mg", tp=tp, pp=pp)
    folders = sorted(p.name for p in (tmp_path / "mg" / "iter_0000004").iterdir())
    expected = [f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}" for t in range(tp) for p in range(pp)]
    assert folders == sorted(expected) and len(report.files) == tp * pp
    merged = read_megatron_checkpoint(tmp_path / "mg", MOE)
    assert (merged.tp, merged.pp) == (tp, pp)
    assert _same(merged.state, full)


def test_shards_follow_megatron_layout_rules(tmp_path, dense_state):
    source = _mf_checkpoint(tmp_path / "ms", DENSE, dense_state)
    convert_checkpoint(DENSE, "ms2mg", source, tmp_path / "mg", tp=2, pp=2)
    full = mindformers_to_megatron(dense_state, DENSE)

    def shard(t, p):
        return torch.load(tmp_path / "mg" / "iter_0000004" / f"mp_rank_{t:02d}_{p:03d}" / "model_optim_rng.pt",
                          weights_only=True)["model"]

    first, last = shard(1, 0), shard(1, 1)
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert {"output_layer.weight", "decoder.final_layernorm.weight", "embedding.word_embeddings.weight"} <= set(last)
    assert not any(k.startswith("mtp.") for k in first) and any(k.startswith("mtp.") for k in last)
    # Layers 2 and 3 live on stage 1 as its layers 0 and 1.
    assert torch.equal(last["decoder.layers.1.self_attention.linear_proj.weight"],
                       full["decoder.layers.3.self_attention.linear_proj.weight"][:, DENSE.attention_output_size // 2:])
    fc1 = full["decoder.layers.0.mlp.linear_fc1.weight"]
    f = DENSE.ffn_hidden_size
    assert torch.equal(first["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([fc1[f // 2:f], fc1[f + f // 2:]]))
    in_proj = full["decoder.layers.0.self_attention.in_proj.weight"]
    qk, v, nv = DENSE.gdn_key_dim, DENSE.gdn_value_dim, DENSE.linear_num_value_heads
    segments = torch.split(in_proj, [qk, qk, v, v, nv, nv])
    assert torch.equal(first["decoder.layers.0.self_attention.in_proj.weight"],
                       torch.cat([seg.chunk(2)[1] for seg in segments]))
    assert torch.equal(first["decoder.layers.0.self_attention.out_norm.weight"],
                       full["decoder.layers.0.self_attention.out_norm.weight"])
    assert first["decoder.layers.0.self_attention.A_log"].shape == (nv // 2,)


def test_parallel_sizes_that_do_not_divide_are_refused(tmp_path, dense_state):
    source = _mf_checkpoint(tmp_path / "ms", DENSE, dense_state)
    with pytest.raises(CheckpointError, match="does not divide model.num_query_groups = 2"):
        convert_checkpoint(DENSE, "ms2mg", source, tmp_path / "mg", tp=4)
    with pytest.raises(CheckpointError, match="pipeline parallel size 3"):
        convert_checkpoint(DENSE, "ms2mg", source, tmp_path / "mg", pp=3)
    assert not (tmp_path / "mg").exists()


def test_checkpoint_round_trip_through_files(tmp_path, moe_state):
    source = _mf_checkpoint(tmp_path / "ms", MOE, {k: v.bfloat16() for k, v in moe_state.items()})
    report = convert_checkpoint(MOE, "ms2mg", source, tmp_path / "mg", dtype="keep", experts="stacked")
    assert report.keys_in == len(moe_state) and report.output_validated
    loaded = torch.load(report.files[0], weights_only=True)
    assert loaded["model"]["output_layer.weight"].dtype == torch.bfloat16
    convert_checkpoint(MOE, "mg2ms", tmp_path / "mg", tmp_path / "back", dtype="keep")
    back = read_mindformers_checkpoint(tmp_path / "back")
    assert back.iteration == 4 and back.common["step_num"] == 4
    assert _same(back.model_state(), read_mindformers_checkpoint(source).model_state())
    up = convert_checkpoint(MOE, "ms2mg", source, tmp_path / "fp32")  # default: fp32, as the source converter
    assert torch.load(up.files[0], weights_only=True)["model"]["output_layer.weight"].dtype == torch.float32


@pytest.mark.parametrize("experts", ["per_expert", "stacked"])
def test_bf16_checkpoint_converts_to_the_fp32_bits_of_casting_first(tmp_path, dense_state, moe_state, experts):
    """The file is written rule by rule from reused read buffers and cast while written: same keys, order, bits."""
    for model, state in ((DENSE, dense_state), (MOE, moe_state)):
        bf16 = {k: v.bfloat16() for k, v in state.items()}
        source = _mf_checkpoint(tmp_path / model.name / "ms", model, bf16)
        report = convert_checkpoint(model, "ms2mg", source, tmp_path / model.name / "mg", experts=experts)
        written = torch.load(report.files[0], weights_only=True)["model"]
        expected = mindformers_to_megatron({k: v.float() for k, v in bf16.items()}, model, experts=experts)
        assert list(written) == list(expected) and _same(written, expected)
        assert report.bytes_out == sum(t.numel() * 4 for t in expected.values())


def test_a_mismatch_writes_nothing(tmp_path, dense_state):
    broken = dict(dense_state)
    broken["decoder.layers.1.mlp.linear_fc2.weight"] = torch.zeros(3, 3)
    source = _mf_checkpoint(tmp_path / "ms", DENSE, broken)
    with pytest.raises(CheckpointError, match="decoder.layers.1.mlp.linear_fc2.weight"):
        convert_checkpoint(DENSE, "ms2mg", source, tmp_path / "mg")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ms"]


runner = CliRunner()


def test_cli_converts_and_summarises(tmp_path, moe_state):
    source = _mf_checkpoint(tmp_path / "ms", MOE, moe_state)
    result = runner.invoke(app, ["convert", "--model", "qwen35_moe_tiny", "--direction", "ms2mg", "--input",
                                 str(source), "--output", str(tmp_path / "mg"), "--experts", "stacked"])
    assert result.exit_code == 0, result.output
    assert f"73 in -> {len(megatron_shapes(MOE, experts='stacked'))} out" in result.output
    assert read_megatron_checkpoint(tmp_path / "mg").state.keys() == megatron_shapes(MOE, experts="stacked").keys()


def test_cli_errors_are_one_line_and_exit_2(tmp_path, dense_state):
    source = _mf_checkpoint(tmp_path / "ms", DENSE, dense_state)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    cases = [
        (["--model", "qwen35_dense_tiny", "--output", str(tmp_path / "busy")], "not empty"),
        (["--model", "qwen35_moe_tiny", "--output", str(tmp_path / "o1")], "does not match model qwen35_moe_tiny"),
        (["--model", "qwen35_dense_tiny", "--output", str(tmp_path / "o2"), "--experts", "both"], "--experts"),
        (["--model", "qwen35_dense_tiny", "--output", str(tmp_path / "o3"), "--fault", "typo"], "--fault"),
    ]
    bad_config = tmp_path / "bad.yaml"
    bad_config.write_text((Path(__file__).parent.parent / "model_configs" / "qwen35_dense_tiny.yaml").read_text()
                          .replace("hidden_size: 64", "hidden_size: 64\n  hiden_size: 64"))
    cases.append((["--model", str(bad_config), "--output", str(tmp_path / "o4")], "unknown field"))
    for args, message in cases:
        result = runner.invoke(app, ["convert", "--direction", "ms2mg", "--input", str(source), *args])
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output and "Traceback" not in result.output
    assert not any((tmp_path / name).exists() for name in ("o1", "o2", "o3", "o4"))
