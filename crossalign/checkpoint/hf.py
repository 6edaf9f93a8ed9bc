"""Hugging Face checkpoint folders: ``config.json`` plus one ``model.safetensors`` or shards listed in
``model.safetensors.index.json``, read one tensor at a time and written whole or not at all.

Released Qwen3.5 checkpoints are vision-language models: the text model sits under
``model.language_model.``, the vision tower under ``model.visual.`` (not part of the language
model: skipped, and counted), ``lm_head`` and ``mtp.*`` at the top. ``save_pretrained`` of
``Qwen3_5ForCausalLM`` writes the text model under ``model.``. Both are read; the text form is
written (it loads into ``Qwen3_5ForCausalLM`` as it is). The shape table at the end lists
every text-model key of a config; the rules that map them live in ``rules.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping

import torch

from crossalign.tensorio.atomic import atomic_directory
from crossalign.tensorio.blocks import ReusedBuffer
from crossalign.tensorio.errors import CheckpointError
from crossalign.models.layout import Shape
from crossalign.tensorio.safetensors_io import TensorInfo, read_header, read_tensor, write_safetensors
from crossalign.config import ConfigError, ModelConfig
from crossalign.hf_config import model_config_from_hf, read_config_json

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SKIPPED_PREFIXES = ("model.visual.",)
SHARD_BYTES = 2 * 2**30  # shards of at most about 2 GiB, a size every loader takes
HFExperts = Literal["per_expert", "packed"]
ROOTS = ("model.language_model.", "model.")  # vision-language releases, then save_pretrained of *ForCausalLM


def root_of(keys: Iterable[str], what: str) -> str:
    """The prefix of the trunk (``model.language_model.`` in releases, ``model.`` from save_pretrained)."""
    keys = set(keys)
    for root in ROOTS:
        if f"{root}embed_tokens.weight" in keys:
            return root
    raise CheckpointError(f"{what}: no embed_tokens.weight under {' or '.join(ROOTS)}")


def experts_of(keys: Iterable[str]) -> HFExperts:
    """Routed experts packed in one tensor per projection (Qwen3.6) or saved one module per expert."""
    return "packed" if any(key.endswith("mlp.experts.gate_up_proj") for key in keys) else "per_expert"


@dataclass
class HFCheckpoint:
    """A Hugging Face checkpoint folder: its text config and where each language-model tensor lies."""

    directory: Path
    config: dict[str, Any]
    entries: dict[str, TensorInfo]
    files: dict[str, Path]
    skipped: list[str] = field(default_factory=list)

    @property
    def root(self) -> str:
        return root_of(self.entries, str(self.directory))

    @property
    def experts(self) -> HFExperts:
        return experts_of(self.entries)

    @property
    def has_mtp(self) -> bool:
        return "mtp.fc.weight" in self.entries

    def model_config(self, name: str) -> ModelConfig:
        return model_config_from_hf(self.config, name, self.has_mtp, str(self.directory / "config.json"))

    def tensor(self, key: str, buffer: ReusedBuffer | None = None) -> torch.Tensor:
        return read_tensor(self.files[key], self.entries[key], buffer=buffer)


def _shard_map(directory: Path) -> dict[Path, set[str] | None]:
    """Each safetensors file of the folder and the keys the index puts there (None: no index, take all)."""
    index = directory / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index with a weight_map ({exc})") from None
        files: dict[Path, set[str] | None] = {}
        for key, name in weight_map.items():
            keys = files.setdefault(directory / name, set())
            assert keys is not None
            keys.add(key)
        return files
    if (directory / SINGLE).exists():
        return {directory / SINGLE: None}
    raise CheckpointError(f"{directory}: neither {INDEX} nor {SINGLE}: not a Hugging Face checkpoint folder")


def read_hf_checkpoint(path: Path) -> HFCheckpoint:
    """Read the index (or the single file's header) and config.json; no tensor is loaded."""
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a folder")
    try:
        config = read_config_json(directory)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    entries: dict[str, TensorInfo] = {}
    files: dict[str, Path] = {}
    skipped: list[str] = []
    for file, listed in _shard_map(directory).items():
        if not file.exists():
            raise CheckpointError(f"{directory / INDEX}: lists {file.name}, which is missing")
        infos, _ = read_header(file)
        found = {info.name: info for info in infos}
        if listed is not None and listed - found.keys():
            missing = sorted(listed - found.keys())
            raise CheckpointError(f"{file}: the index puts {missing[0]!r} (and {len(missing) - 1} more) here, "
                                  "but the file does not hold it")
        for name, info in found.items():
            if listed is not None and name not in listed:
                continue
            if name.startswith(SKIPPED_PREFIXES):
                skipped.append(name)
                continue
            entries[name] = info
            files[name] = file
    return HFCheckpoint(directory, config, entries, files, skipped)


def _shards(state: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def write_hf_checkpoint(directory: Path, state: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                        max_shard_bytes: int = SHARD_BYTES) -> list[Path]:
    """Write config.json and the tensors (in ``state``'s order) as ``save_pretrained`` lays them out; all or nothing."""
    directory = Path(directory)
    shards = _shards(state, max_shard_bytes)
    names = [SINGLE] if len(shards) == 1 else [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                               for i in range(1, len(shards) + 1)]
    with atomic_directory(directory) as staging:
        (staging / "config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
        total = 0
        for name, keys in zip(names, shards):
            total += write_safetensors(staging / name, {key: state[key] for key in keys}, {"format": "pt"})
        if len(shards) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {key: name for name, keys in zip(names, shards) for key in keys}}
            (staging / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [directory / name for name in names]


# ---- the Hugging Face shape table ----------------------------------------------------------------


def _attention(m: ModelConfig) -> dict[str, Shape]:
    h, d = m.hidden_size, m.kv_channels
    return {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (2 * m.num_attention_heads * d, h),
        "self_attn.k_proj.weight": (m.num_query_groups * d, h),
        "self_attn.v_proj.weight": (m.num_query_groups * d, h),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "self_attn.o_proj.weight": (h, m.attention_output_size),
    }


def _gdn(m: ModelConfig) -> dict[str, Shape]:
    h, nv = m.hidden_size, m.linear_num_value_heads
    return {
        "input_layernorm.weight": (h,),
        "linear_attn.in_proj_qkv.weight": (m.conv_channels, h),
        "linear_attn.in_proj_z.weight": (m.gdn_value_dim, h),
        "linear_attn.in_proj_b.weight": (nv, h),
        "linear_attn.in_proj_a.weight": (nv, h),
        "linear_attn.conv1d.weight": (m.conv_channels, 1, m.linear_conv_kernel_dim),
        "linear_attn.A_log": (nv,),
        "linear_attn.dt_bias": (nv,),
        "linear_attn.norm.weight": (m.linear_value_head_dim,),
        "linear_attn.out_proj.weight": (h, m.gdn_value_dim),
    }


def _ffn(m: ModelConfig, hf_experts: HFExperts) -> dict[str, Shape]:
    h = m.hidden_size
    if not m.is_moe:
        f = m.ffn_hidden_size
        return {"post_attention_layernorm.weight": (h,), "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h),
                "mlp.down_proj.weight": (h, f)}
    e, i, s = m.num_experts, m.moe_ffn_hidden_size, m.moe_shared_expert_intermediate_size
    assert e is not None and i is not None and s is not None
    if hf_experts == "packed":
        routed = {"mlp.experts.gate_up_proj": (e, 2 * i, h), "mlp.experts.down_proj": (e, h, i)}
    else:
        routed = {}
        for j in range(e):
            routed.update({f"mlp.experts.{j}.gate_proj.weight": (i, h), f"mlp.experts.{j}.up_proj.weight": (i, h),
                           f"mlp.experts.{j}.down_proj.weight": (h, i)})
    gate = {"mlp.shared_expert_gate.weight": (1, h)} if m.moe_shared_expert_gate else {}
    return {"post_attention_layernorm.weight": (h,), "mlp.gate.weight": (e, h), **routed,
            "mlp.shared_expert.gate_proj.weight": (s, h), "mlp.shared_expert.up_proj.weight": (s, h),
            "mlp.shared_expert.down_proj.weight": (h, s), **gate}


def hf_shapes(model: ModelConfig, hf_experts: HFExperts = "per_expert", root: str = "model.") -> dict[str, Shape]:
    """Every HF text-model key (MTP included) and its shape, in model order."""
    m, h = model, model.hidden_size
    shapes: dict[str, Shape] = {f"{root}embed_tokens.weight": (m.vocab_size, h)}
    for i, kind in enumerate(m.layer_kinds):
        mixer = _attention(m) if kind == "attention" else _gdn(m)
        shapes.update({f"{root}layers.{i}.{k}": v for k, v in {**mixer, **_ffn(m, hf_experts)}.items()})
    shapes[f"{root}norm.weight"] = (h,)
    shapes["lm_head.weight"] = (m.vocab_size, h)
    if m.mtp_num_layers:
        shapes.update({"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
                       "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)})
        shapes.update({f"mtp.layers.0.{k}": v for k, v in {**_attention(m), **_ffn(m, hf_experts)}.items()})
    return shapes
