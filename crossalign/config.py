"""Model and training configuration: one YAML file per model, validated by pydantic.

A config file has two sections, ``model`` (the architecture, SPEC section 2) and
``training`` (the settings both frameworks must share, SPEC sections 5 and 6).
Every backend (the embedded CPU models, the generated Megatron arguments and the
generated MindFormers YAML) is derived from the same file, so the two sides
cannot drift apart.

Errors name the offending field: ``model.num_query_groups: 16 attention heads
are not divisible into 5 query groups``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

CONFIG_DIR = Path(__file__).resolve().parent.parent / "model_configs"

LayerKind = Literal["attention", "gdn"]


class ConfigError(ValueError):
    """A model config file that cannot be used, with the file and field named."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def digest(self) -> str:
        """sha256 of this section as JSON, keys sorted (a whole config's is the digest the run store takes of the
        config run.json holds)."""
        text = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


class ModelConfig(_Strict):
    """The Qwen3.5 hybrid architecture (GatedDeltaNet 3:1 gated attention, MTP, optional MoE)."""

    name: str
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_query_groups: int = Field(gt=0)
    kv_channels: int = Field(gt=0, description="head dim of the full-attention layers")
    ffn_hidden_size: int = Field(gt=0, description="dense SwiGLU intermediate size")
    vocab_size: int = Field(gt=0)
    padded_vocab_size: int = Field(gt=0, description="rows of the embedding and output layer")
    max_position_embeddings: int = Field(gt=0)
    norm_epsilon: float = Field(default=1e-5, gt=0)
    rotary_base: float = Field(default=1_000_000.0, gt=0)
    rotary_percent: float = Field(default=0.25, gt=0, le=1)
    init_method_std: float = Field(default=0.02, gt=0)
    norm_convention: Literal["plain", "zero_centred"] = Field(
        default="plain",
        description="how the Megatron side stores and applies every RMSNorm gamma: plain (x * g) or zero_centred "
        "(x * (1 + w), Megatron's --apply-layernorm-1p, as Megatron-Bridge converts Hugging Face Qwen3.5). "
        "MindFormers 1.9.0-2.1.0 have no zero-centred norm (their RMSNorm multiplies by a weight initialised "
        "to ones), so the MindSpore side always stores plain gammas and the converter shifts each by 1.",
    )

    # GatedDeltaNet (linear attention)
    linear_attention_freq: int = Field(default=4, gt=0, description="layer i is full attention iff (i+1) % freq == 0")
    linear_conv_kernel_dim: int = Field(default=4, gt=0)
    linear_key_head_dim: int = Field(gt=0)
    linear_value_head_dim: int = Field(gt=0)
    linear_num_key_heads: int = Field(gt=0)
    linear_num_value_heads: int = Field(gt=0)
    gdn_in_proj_layout: Literal["fused", "split"] | None = Field(
        default=None,
        description="MindSpore-side GDN input projection: one in_proj (fused) or in_proj_qkv + linear_g/b/a "
        "(split). Default: split for dense, fused for MoE, as MindFormers stores them.",
    )

    # Multi-token prediction
    mtp_num_layers: int = Field(default=1, ge=0)
    mtp_loss_scaling_factor: float = Field(default=1.0, ge=0)

    # Mixture of experts (num_experts None means dense FFN everywhere)
    num_experts: int | None = Field(default=None, gt=0)
    moe_router_topk: int = Field(default=2, gt=0)
    moe_ffn_hidden_size: int | None = Field(default=None, gt=0)
    moe_shared_expert_intermediate_size: int | None = Field(default=None, gt=0)
    moe_shared_expert_gate: bool = True
    moe_router_score_function: Literal["softmax"] = "softmax"
    norm_topk_prob: bool = True
    moe_router_topk_scaling_factor: float = Field(default=1.0, gt=0)
    moe_router_dtype: Literal["fp32"] = "fp32"
    moe_aux_loss_coeff: float = Field(default=0.001, ge=0)

    @model_validator(mode="after")
    def _check_sizes(self) -> "ModelConfig":
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"{field}: {why}")

        if self.num_attention_heads % self.num_query_groups:
            raise bad("num_query_groups", f"{self.num_attention_heads} attention heads are not divisible "
                      f"into {self.num_query_groups} query groups")
        if self.padded_vocab_size < self.vocab_size:
            raise bad("padded_vocab_size", f"{self.padded_vocab_size} is smaller than vocab_size {self.vocab_size}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise bad("rotary_percent", f"rotary dim int({self.kv_channels} * {self.rotary_percent}) = "
                      f"{self.rotary_dim} must be even and at least 2")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise bad("linear_num_value_heads", f"{self.linear_num_value_heads} value heads are not a multiple "
                      f"of {self.linear_num_key_heads} key heads")
        if self.num_layers < self.linear_attention_freq:
            raise bad("num_layers", f"{self.num_layers} layers hold no full-attention layer with "
                      f"linear_attention_freq {self.linear_attention_freq}")
        if self.num_experts is not None:
            if self.moe_ffn_hidden_size is None:
                raise bad("moe_ffn_hidden_size", "required when num_experts is set")
            if self.moe_shared_expert_intermediate_size is None:
                raise bad("moe_shared_expert_intermediate_size", "required when num_experts is set")
            if not 0 < self.moe_router_topk <= self.num_experts:
                raise bad("moe_router_topk", f"top-{self.moe_router_topk} of {self.num_experts} experts")
        return self

    # ---- derived layout -------------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def kind(self) -> Literal["dense", "moe"]:
        return "moe" if self.is_moe else "dense"

    def layer_kind(self, index: int) -> LayerKind:
        """Layer ``index`` (0-based) is full attention iff (index+1) % linear_attention_freq == 0."""
        return "attention" if (index + 1) % self.linear_attention_freq == 0 else "gdn"

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return tuple(self.layer_kind(i) for i in range(self.num_layers))

    @property
    def layer_pattern(self) -> str:
        """The layer kinds at a glance: ``GGGAGGGA`` (G: GatedDeltaNet, A: full attention)."""
        return "".join("A" if kind == "attention" else "G" for kind in self.layer_kinds)

    @property
    def in_proj_layout(self) -> Literal["fused", "split"]:
        if self.gdn_in_proj_layout is not None:
            return self.gdn_in_proj_layout
        return "fused" if self.is_moe else "split"

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def rotary_dim(self) -> int:
        return int(self.kv_channels * self.rotary_percent)

    @property
    def qkv_rows(self) -> int:
        """Rows of linear_qkv: per query group [q heads | gate heads | k | v], each kv_channels wide."""
        return self.num_query_groups * (2 * self.heads_per_group + 2) * self.kv_channels

    @property
    def attention_output_size(self) -> int:
        return self.num_attention_heads * self.kv_channels

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_channels(self) -> int:
        """Channels of the causal conv1d: [q | k | v]."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def in_proj_rows(self) -> int:
        """Rows of the GDN in_proj: [q | k | v | z | beta | alpha]."""
        return self.conv_channels + self.gdn_value_dim + 2 * self.linear_num_value_heads


class TrainingConfig(_Strict):
    """Settings that both training runs must share (SPEC sections 5 and 6)."""

    seq_length: int = Field(gt=0)
    micro_batch_size: int = Field(default=1, gt=0)
    global_batch_size: int = Field(gt=0)
    train_iters: int = Field(gt=0, description="steps of the alignment runs (DAG steps 4 and 5)")
    base_train_iters: int = Field(gt=0, description="steps of the base run (DAG step 1)")
    seed: int = 1234
    lr: float = Field(gt=0)
    min_lr: float = Field(default=0.0, ge=0)
    lr_warmup_iters: int = Field(default=0, ge=0)
    lr_warmup_init: float = Field(default=0.0, ge=0)
    lr_decay_style: Literal["constant"] = "constant"
    weight_decay: float = Field(default=0.01, ge=0)
    adam_beta1: float = Field(default=0.9, gt=0, lt=1)
    adam_beta2: float = Field(default=0.999, gt=0, lt=1)
    adam_eps: float = Field(default=1e-8, gt=0)
    clip_grad: float = Field(default=1.0, gt=0)
    attention_dropout: float = Field(default=0.0, ge=0, le=0, description="alignment needs dropout 0")
    hidden_dropout: float = Field(default=0.0, ge=0, le=0, description="alignment needs dropout 0")
    split: str = "1,0,0"
    dataloader_type: Literal["single", "cyclic"] = "single"
    bf16: bool = True
    embedded_precision: Literal["fp32", "bf16"] = Field(
        default="fp32",
        description="the embedded megatron-train step: bf16 computes in bf16 with fp32 master weights, as "
                    "Megatron's --bf16; the embedded MindSpore side always computes in fp32 (MindSpore's CPU "
                    "kernels have no bf16 MatMul)")
    deterministic: bool = True
    embedded_device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto",
        description="where the embedded megatron-train step runs: auto takes the agent's GPU where torch sees one; "
                    "on cpu the megatron-core CPU workarounds apply")
    megatron_core_version: str = Field(default="0.16.1", description="decides the MTP key prefix and log semantics")
    megatron_ckpt_format: Literal["torch", "torch_dist"] = Field(
        default="torch",
        description="Megatron's --ckpt-format of the converted checkpoint the megatron-train step loads: torch "
                    "(legacy rank files written for the run's layout) or torch_dist (Megatron's default, one copy "
                    "resharded at load; the convert step can spread it over the cpu pool: site convert_parts)")
    mindformers_version: str = Field(default="2.1.0", description="the NPU site's MindFormers release (2.0.0 or "
                                     "later): decides how its log's mtp_1_loss is read")

    @model_validator(mode="after")
    def _check_batches(self) -> "TrainingConfig":
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"global_batch_size: {self.global_batch_size} is not a multiple of "
                             f"micro_batch_size {self.micro_batch_size}")
        parts = self.split.split(",")
        if len(parts) != 3 or not all(p.strip().replace(".", "", 1).isdigit() for p in parts):
            raise ValueError(f"split: {self.split!r} is not three comma-separated weights like '1,0,0'")
        if self.lr_warmup_iters >= self.train_iters:
            # Megatron's scheduler asserts lr_warmup_steps < lr_decay_steps (core_v0.16.1
            # megatron/core/optimizer_param_scheduler.py:157); decay steps default to train_iters
            raise ValueError(f"lr_warmup_iters: {self.lr_warmup_iters} is not below train_iters {self.train_iters} "
                             "(Megatron's OptimizerParamScheduler asserts warmup < decay steps)")
        return self

    @property
    def train_samples(self) -> int:
        return self.train_iters * self.global_batch_size


class _Layout(_Strict):
    """The sizes every parallel layout has: how the model is cut and over how many cards."""

    tensor: int = Field(default=1, gt=0)
    pipeline: int = Field(default=1, gt=0)
    expert: int = Field(default=1, gt=0)
    context: int = Field(default=1, gt=0)
    sequence_parallel: bool = False
    cards_per_node: int = Field(default=1, gt=0)
    nodes: int = Field(default=1, gt=0)

    @property
    def world_size(self) -> int:
        return self.cards_per_node * self.nodes

    @property
    def model_parallel(self) -> int:
        return self.tensor * self.pipeline * self.context

    @property
    def data_parallel(self) -> int:
        """Replicas of the model (world / (TP x PP x CP)); the config check makes it whole."""
        return self.world_size // self.model_parallel

    @property
    def expert_tensor_size(self) -> int:
        return self.tensor

    @property
    def virtual_layers(self) -> int | None:
        return None

    @property
    def ranks(self) -> str:
        """The layout at a glance: ``TP 2 x PP 2 x EP 2 (DP 2) on 2 x 4 cards``."""
        parts = [f"TP {self.tensor}", f"PP {self.pipeline}"]
        if self.virtual_layers:
            parts[-1] += f" (VPP {self.virtual_layers} layers a stage)"
        parts += [f"EP {self.expert}"] if self.expert != 1 else []
        parts += [f"ETP {self.expert_tensor_size}"] if self.expert_tensor_size != self.tensor else []
        parts += [f"CP {self.context}"] if self.context != 1 else []
        text = " x ".join(parts) + (" + SP" if self.sequence_parallel else "")
        return f"{text} (DP {self.data_parallel}) on {self.nodes} x {self.cards_per_node} cards"


class MegatronParallel(_Layout):
    """Megatron-LM's layout; each field is the flag of the same name (core_v0.16.1 megatron/training/arguments.py).

    tensor: --tensor-model-parallel-size, pipeline: --pipeline-model-parallel-size,
    virtual_pipeline_layers: --num-layers-per-virtual-pipeline-stage, expert: --expert-model-parallel-size,
    expert_tensor: --expert-tensor-parallel-size (unset: the tensor size, as Megatron defaults it),
    context: --context-parallel-size, sequence_parallel: --sequence-parallel; cards_per_node and nodes
    are torchrun's --nproc-per-node and --nnodes.
    """

    virtual_pipeline_layers: int | None = Field(default=None, gt=0)
    expert_tensor: int | None = Field(default=None, gt=0)

    @property
    def expert_tensor_size(self) -> int:
        return self.expert_tensor if self.expert_tensor is not None else self.tensor

    @property
    def virtual_layers(self) -> int | None:
        return self.virtual_pipeline_layers


class MindFormersParallel(_Layout):
    """MindFormers' pynative ``parallelism`` section (tensor_parallel, pipeline_parallel, expert_parallel,
    context_parallel, sequence_parallel; data_parallel_shard is what the cards leave); cards_per_node and
    nodes are msrun's --local_worker_num and --worker_num / --local_worker_num."""


class ParallelConfig(_Strict):
    """The layout of each side: they may differ (a loss that moves with the layout is a bug either way)."""

    megatron: MegatronParallel = MegatronParallel()
    mindformers: MindFormersParallel = MindFormersParallel()


def layout_problems(section: str, layout: _Layout, model: ModelConfig, training: TrainingConfig) -> list[str]:
    """Every reason ``layout`` cannot cut this model or batch, each naming its field (``parallel.megatron.tensor``).

    Tensor parallelism splits heads, query groups, GDN key and value heads, the vocab and the
    FFN and expert widths; pipeline stages take whole layers; expert ranks take whole experts;
    the global batch is whole micro batches on every data-parallel rank.
    """
    m, t, problems = model, training, []
    tp, etp = layout.tensor, layout.expert_tensor_size

    def need(field: str, divisor: int, sizes: dict[str, int | None]) -> None:
        for name, size in sizes.items():
            if size is not None and size % divisor:
                problems.append(f"{section}.{field}: {divisor} does not divide model.{name} = {size}")

    need("tensor", tp, {"num_attention_heads": m.num_attention_heads, "num_query_groups": m.num_query_groups,
                        "linear_num_key_heads": m.linear_num_key_heads,
                        "linear_num_value_heads": m.linear_num_value_heads,
                        "padded_vocab_size": m.padded_vocab_size, "hidden_size": m.hidden_size,
                        "ffn_hidden_size": None if m.is_moe else m.ffn_hidden_size,
                        "moe_shared_expert_intermediate_size": m.moe_shared_expert_intermediate_size})
    expert_field = "expert_tensor" if isinstance(layout, MegatronParallel) and layout.expert_tensor else "tensor"
    if m.is_moe:
        need(expert_field, etp, {"moe_ffn_hidden_size": m.moe_ffn_hidden_size})
        need("expert", layout.expert, {"num_experts": m.num_experts})
    elif layout.expert > 1:
        problems.append(f"{section}.expert: {layout.expert} expert ranks, but the model has no experts")
    need("pipeline", layout.pipeline, {"num_layers": m.num_layers})
    if layout.virtual_layers is not None:
        if layout.pipeline <= 2:
            # core_v0.16.1 megatron/training/arguments.py:580: the interleaved schedule without p2p overlap
            problems.append(f"{section}.virtual_pipeline_layers: the interleaved schedule needs pipeline > 2")
        elif m.num_layers % layout.pipeline == 0 and (m.num_layers // layout.pipeline) % layout.virtual_layers:
            problems.append(f"{section}.virtual_pipeline_layers: {layout.virtual_layers} does not divide the "
                            f"{m.num_layers // layout.pipeline} layers of a pipeline stage")
    if layout.sequence_parallel and tp == 1:
        problems.append(f"{section}.sequence_parallel: needs tensor > 1 (it splits the sequence over the tensor "
                        "ranks)")
    if m.is_moe and tp > 1 and layout.expert > 1 and not layout.sequence_parallel:
        # core_v0.16.1 megatron/core/model_parallel_config.py:440: "When using expert parallelism and tensor
        # parallelism for training, sequence parallelism must be used"
        problems.append(f"{section}.sequence_parallel: required with tensor {tp} and expert {layout.expert}")
    if (isinstance(layout, MegatronParallel) and tp > 1 and not layout.sequence_parallel
            and "gdn" in m.layer_kinds):
        # megatron-core sums a replicated weight's grads over the tensor ranks only when it is marked
        # sequence-parallel (or is a q/k layernorm): core_v0.16.1 megatron/core/distributed/
        # finalize_model_grads.py:354-356, the same test in 0.17.1 :358, 0.18.2 :403, 0.19.0 :452.
        # GatedDeltaNet's out_norm is replicated but fed by each rank's own value heads, so without
        # sequence parallelism its copies train apart rank by rank and the run stops being one model.
        problems.append(f"{section}.sequence_parallel: required with tensor {tp} on a model with GatedDeltaNet "
                        "layers (without it megatron-core never reduces the out_norm grads over the tensor ranks, "
                        "so each rank trains its own out_norm)")
    if layout.context > 1 and t.seq_length % (2 * layout.context):
        problems.append(f"{section}.context: training.seq_length {t.seq_length} is not a multiple of "
                        f"2 x {layout.context} (each context rank holds two chunks)")
    world = layout.world_size
    if world % layout.model_parallel:
        problems.append(f"{section}.cards_per_node: TP {tp} x PP {layout.pipeline} x CP {layout.context} = "
                        f"{layout.model_parallel} does not fit {layout.nodes} x {layout.cards_per_node} cards")
    elif world % (etp * layout.expert * layout.pipeline):
        problems.append(f"{section}.expert: ETP {etp} x EP {layout.expert} x PP {layout.pipeline} does not fit "
                        f"{layout.nodes} x {layout.cards_per_node} cards")
    elif t.global_batch_size % (t.micro_batch_size * layout.data_parallel):
        problems.append(f"training.global_batch_size: {t.global_batch_size} is not a multiple of micro_batch_size "
                        f"{t.micro_batch_size} x {layout.data_parallel} data-parallel ranks of {section}")
    return problems


class AlignmentConfig(_Strict):
    """One config file: the model, the shared training settings and each side's parallel layout."""

    model: ModelConfig
    training: TrainingConfig
    parallel: ParallelConfig = ParallelConfig()

    @model_validator(mode="after")
    def _check_sequence(self) -> "AlignmentConfig":
        if self.training.seq_length > self.model.max_position_embeddings:
            raise ValueError(f"training.seq_length: {self.training.seq_length} exceeds "
                             f"model.max_position_embeddings {self.model.max_position_embeddings}")
        problems = [problem for side in ("megatron", "mindformers")
                    for problem in layout_problems(f"parallel.{side}", getattr(self.parallel, side),
                                                   self.model, self.training)]
        if problems:
            raise ValueError("\n  ".join(problems))  # one line each under the file's name
        return self


def resolve_config_path(name_or_path: str | Path) -> Path:
    """A path to a YAML file, or the name of a shipped config (``qwen35_dense_tiny``)."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    shipped = CONFIG_DIR / f"{path.stem}.yaml"
    if shipped.exists():
        return shipped
    if path.exists():
        return path
    known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    raise ConfigError(f"{name_or_path}: no such config file, and no shipped config of that name (known: {known})")


class OverrideError(ConfigError):
    """A ``--set KEY=VALUE`` override that does not name a config field or gives it a bad value."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """``training.train_iters=10`` -> (["training", "train_iters"], 10); the value is read as YAML."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise OverrideError(f"--set {text!r}: expected KEY=VALUE with a dotted key, e.g. training.train_iters=10")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError as exc:
        raise OverrideError(f"--set {text!r}: value is not valid YAML: {exc}") from None
    return key.split("."), parsed


SECTIONS = ("model", "training", "parallel")


def _apply_overrides(raw: dict, overrides: Sequence[str]) -> None:
    for text in overrides:
        keys, value = parse_override(text)
        if keys[0] not in SECTIONS:
            raise OverrideError(f"--set {text!r}: keys start with 'model.', 'training.' or 'parallel.'")
        node = raw
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key) if isinstance(node, dict) else None
            if child is None and keys[0] == "parallel" and depth < 2 and isinstance(node, dict):
                child = node[key] = {}  # the parallel section and each side's layout are optional in the file
            if not isinstance(child, dict):
                raise OverrideError(f"--set {text!r}: {'.'.join(keys[:depth + 1])} is not a config section")
            node = child
        node[keys[-1]] = value


def _format_validation_error(origin: str, error: ValidationError) -> str:
    lines = [f"{origin}: invalid config"]
    for item in error.errors():
        location = ".".join(str(p) for p in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field"
        field, sep, why = message.partition(": ")
        if item["type"] == "value_error" and sep and field.isidentifier():
            # a section's own check names its field first: "training" + "lr_warmup_iters: ..." reads as one path
            location, message = ".".join(filter(None, [location, field])), why
        lines.append(f"  {location}: {message}" if location else f"  {message}")
    return "\n".join(lines)


def load_config(name_or_path: str | Path, overrides: Sequence[str] = ()) -> AlignmentConfig:
    """Read and validate a config file, with ``--set`` style overrides applied; errors name the file and field."""
    path = resolve_config_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping with 'model' and 'training' sections")
    return _validated(raw, str(path), overrides)


def with_overrides(config: AlignmentConfig, overrides: Sequence[str], origin: str) -> AlignmentConfig:
    """``config`` with ``--set`` style overrides applied, validated again (``origin``: where it came from)."""
    return _validated(config.model_dump(mode="json"), origin, overrides) if overrides else config


def _validated(raw: dict, origin: str, overrides: Sequence[str]) -> AlignmentConfig:
    _apply_overrides(raw, overrides)
    try:
        return AlignmentConfig.model_validate(raw)
    except ValidationError as exc:
        where = f"{origin} with --set {' '.join(overrides)}" if overrides else origin
        raise ConfigError(_format_validation_error(where, exc)) from None
