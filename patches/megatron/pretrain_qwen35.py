"""Qwen3.5's layer specs for megatron-core, and a launcher that runs Megatron-LM's pretrain_gpt.py with them.

One builder, for the GPU and the CPU. The decoder is [GDN, GDN, GDN, attention] x N
(``linear_attention_freq``), each layer dense or MoE (``moe_layer_freq``); the MTP layer is
built from the model's last layer (full attention, since ``linear_attention_freq`` divides
``num_layers``). Two users build megatron-core's model through the functions of this file:

- this launcher on a GPU, with TransformerEngine modules (``use_te=True``): the per-part specs
  come from megatron-core's own helpers for the hybrid block
  (``experimental_attention_variant_module_specs``: ``get_gated_delta_net_module_spec``,
  ``_get_self_attention_module_spec``, ``_get_dense_mlp_module_spec``, ``_get_moe_module_spec``),
  composed as ``get_transformer_block_with_experimental_attention_variant_spec`` composes them,
  so the decoder is the one stock ``pretrain_gpt.py`` builds;
- crossalign's embedded CPU backend and selfcheck (``crossalign/sides/megatron/embedded/mcore_model.py``
  loads this file), with megatron-core's local modules (``use_te=False``). That upstream block
  function asserts TransformerEngine (its ``_get_backend_spec_provider``, core 0.16.1 to 0.19.0),
  and its GDN spec asks the backend for a fused norm+linear that the local provider lacks
  (``column_parallel_layer_norm_linear()`` is None), so there the GDN ``in_proj`` is a
  ``ColumnParallelLinear`` after a separate input norm and the attention is
  ``get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")``'s. The parameters are
  the TE ones under other names (norms not fused): ``crossalign/sides/megatron/te_local.py`` maps them.
So the layer specs a GPU run builds are the ones the CPU tests built and trained.

What the launcher changes in Megatron, and why. Stock ``gpt_builders.gpt_builder`` (core 0.16.0
.. 0.18.x) builds the MTP layer from ``get_gpt_decoder_layer_specs(...)[-1]`` (core_v0.16.1
``gpt_builders.py`` lines 71-93): a standard full-attention layer with the TE modules, which
for Qwen3.5 has the same modules as the hybrid block's last layer. Core 0.19.0 takes
``get_transformer_layer_with_experimental_attention_variant_spec(config)[-1]``, the unsliced
list, without an assert (core_v0.19.0 ``gpt_builders.py`` lines 56-84). Run in place of
pretrain_gpt.py with the same arguments, the launcher makes gpt_builder take both the decoder
block and the MTP layer from the functions here: the MTP layer is the decoder's GLOBAL last
layer, as 0.19 takes it, also with pipeline parallelism (``patches/megatron/mtp_gdn.yaml``, for
people who run pretrain_gpt.py by hand, takes the last layer of the local pipeline stage). No
file of the checkout is edited; everything else (argument parsing, data, training loop,
logging, checkpointing) is Megatron's own pretrain(). With ``CROSSALIGN_LOAD_DIGEST_DIR`` set,
the launcher also writes a digest of every tensor the model holds right after pretrain() loads
the checkpoint (:func:`write_load_digest`), which the step compares with the checkpoint it gave. With
``CROSSALIGN_MSPROBE_CONFIG`` set (msprobe's config.json, written by the step when a dump is asked), every
iteration runs under msprobe's ``PrecisionDebugger`` (:func:`dump_each_iteration`), which needs mindstudio-probe
in the framework's Python; with ``CROSSALIGN_MSPROBE_RECORD`` set too, each dumping rank writes the record of the
run beside msprobe's files.

Usage:
    torchrun --nproc_per_node N /path/to/pretrain_qwen35.py <pretrain_gpt.py arguments>

The Megatron-LM checkout is found through MEGATRON_LM_PATH, else the current directory, else
wherever ``gpt_builders`` is importable (PYTHONPATH). Needs only megatron-core (0.16.0 ..
0.19.x) and the framework's own Python (and mindstudio-probe for a dump): it imports nothing from crossalign.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys


# ---- Qwen3.5's layer specs -------------------------------------------------------------------------

def _part_specs(config, use_te: bool) -> dict:
    """The module spec of each part a layer can have ("gdn", "attention", "dense", "moe"), for the backend.

    Each spec's metainfo says whether the norm before it is fused into it (TE) or separate (local).
    """
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as hybrid

    if use_te:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        backend = TESpecProvider()
        parts = {"gdn": hybrid.get_gated_delta_net_module_spec(config=config, backend=backend),
                 "attention": hybrid._get_self_attention_module_spec(config=config, backend=backend)}
        if config.num_moe_experts is not None:
            parts["moe"] = hybrid._get_moe_module_spec(config=config, backend=backend)
        parts["dense"] = hybrid._get_dense_mlp_module_spec(config=config, backend=backend)
        return parts

    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_mlp_module_spec_for_backend
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    backend = LocalSpecProvider()
    norm = backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=False)
    parts = {
        "gdn": ModuleSpec(module=GatedDeltaNet,
                          submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=norm,
                                                             out_proj=RowParallelLinear),
                          metainfo={"fuse_input_layernorm": False}),
        "attention": get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm,
                                              normalization=config.normalization).submodules.self_attention,
        "dense": get_mlp_module_spec_for_backend(backend=backend, num_experts=None),
    }
    parts["attention"].metainfo["fuse_input_layernorm"] = False
    parts["dense"].metainfo["fuse_pre_mlp_layernorm"] = False
    if config.num_moe_experts is not None:
        parts["moe"] = get_moe_module_spec_for_backend(backend=backend, num_experts=config.num_moe_experts,
                                                       moe_grouped_gemm=False)
        parts["moe"].metainfo["fuse_pre_mlp_layernorm"] = False
    return parts


def _norm(config, use_te: bool):
    """The separate (unfused) norm module of the backend: TENorm, or megatron-core's torch RMSNorm."""
    if use_te:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        backend = TESpecProvider()
    else:
        from megatron.core.models.backends import LocalSpecProvider

        backend = LocalSpecProvider()
    return backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=False)


def decoder_layer_specs(config, use_te: bool) -> list:
    """One TransformerLayer spec per decoder layer of the whole model (every pipeline stage), in order."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_linear_attention_pattern, get_moe_layer_pattern)
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    parts, norm = _part_specs(config, use_te), _norm(config, use_te)
    linear = get_linear_attention_pattern(config=config)
    moe = get_moe_layer_pattern(config=config) if config.num_moe_experts is not None else [0] * config.num_layers
    specs = []
    for index in range(config.num_layers):
        mixer = parts["gdn"] if linear[index] == 1 else parts["attention"]
        mlp = parts["moe"] if moe[index] == 1 else parts["dense"]
        specs.append(ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp if mixer.metainfo["fuse_input_layernorm"] else norm,
            self_attention=mixer,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=IdentityOp if mlp.metainfo["fuse_pre_mlp_layernorm"] else norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        )))
    return specs


def decoder_block_spec(config, use_te: bool, vp_stage=None, pp_rank=None):
    """This pipeline stage's layers of :func:`decoder_layer_specs`, sliced as upstream slices the hybrid block."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    specs = decoder_layer_specs(config, use_te)
    if config.pipeline_model_parallel_layout is not None:
        local_ids = config.pipeline_model_parallel_layout.get_layer_id_list(
            layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank)
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        local_ids = range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))
    return TransformerBlockSubmodules(layer_specs=[specs[i] for i in local_ids], layer_norm=_norm(config, use_te))


def mtp_block_spec(config, use_te: bool, vp_stage=None, pp_rank=None):
    """The MTP block (None without MTP, or on a stage without MTP layers) from the model's global last layer."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    if not config.mtp_num_layers:
        return None
    return get_gpt_mtp_block_spec(config, decoder_layer_specs(config, use_te)[-1], use_transformer_engine=use_te,
                                  vp_stage=vp_stage, pp_rank=pp_rank)


# ---- the launcher --------------------------------------------------------------------------------


def wrap_builder(builders_module):
    """A gpt_builder that, for GatedDeltaNet models, builds the decoder and MTP specs with the functions above.

    During the build only, it answers the spec functions gpt_builder calls by name: the hybrid
    block for this stage, and the whole model's layer list (whose last entry is the MTP layer's
    spec) for ``get_gpt_decoder_layer_specs`` (<= 0.18) and
    ``get_transformer_layer_with_experimental_attention_variant_spec`` (0.19).
    """
    original_builder = builders_module.gpt_builder

    def gpt_builder(args, *builder_args, **builder_kwargs):
        if getattr(args, "experimental_attention_variant", None) != "gated_delta_net":
            return original_builder(args, *builder_args, **builder_kwargs)
        use_te = getattr(args, "transformer_impl", "transformer_engine") == "transformer_engine"

        def block(config, vp_stage=None, pp_rank=None):
            return decoder_block_spec(config, use_te, vp_stage=vp_stage, pp_rank=pp_rank)

        def whole_model(config, *args, **kwargs):
            return decoder_layer_specs(config, use_te)

        swaps = {"get_transformer_block_with_experimental_attention_variant_spec": block,
                 "get_gpt_decoder_layer_specs": whole_model,
                 "get_transformer_layer_with_experimental_attention_variant_spec": whole_model}
        saved = {name: getattr(builders_module, name) for name in swaps if hasattr(builders_module, name)}
        for name in saved:
            setattr(builders_module, name, swaps[name])
        try:
            return original_builder(args, *builder_args, **builder_kwargs)
        finally:
            for name, function in saved.items():
                setattr(builders_module, name, function)

    gpt_builder.__wrapped__ = original_builder
    return gpt_builder


# ---- the load digest ------------------------------------------------------------------------------

DIGEST_ENV = "CROSSALIGN_LOAD_DIGEST_DIR"


def tensor_sha256(tensor) -> str:
    """sha256 of a tensor's bytes in its own dtype, C order (crossalign/tensorio/digest.py hashes the same way)."""
    import hashlib

    import torch

    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def _unwrapped(module):
    """The GPTModel inside DDP and Float16Module (both hold it as ``.module``)."""
    while hasattr(module, "module"):
        module = module.module
    return module


def write_load_digest(model, folder: str) -> str | None:
    """Name, shape, dtype and sha256 of every tensor the model holds, as this rank loaded it.

    Megatron's own load cannot be trusted to say: when the strict load fails it reloads
    non-strictly and prints ``load_return: None`` (the DDP and Float16Module wrappers drop the
    result: core_v0.16.1 megatron/training/checkpointing.py:1759-1767,
    megatron/core/distributed/data_parallel_base.py:90-96, megatron/core/transformer/module.py:511-514),
    and the weights it did not find stay random. One file per checkpoint folder, named like it
    (``mp_rank_TT[_PPP][_EEE]``, core_v0.16.1 megatron/training/checkpointing.py:162-201), written by
    the ranks that would save that folder: expert-data-parallel rank 0 (checkpointing.py:583-585).
    """
    import json

    import torch

    if torch.distributed.is_initialized():
        from megatron.core import parallel_state as mpu

        if mpu.get_expert_data_parallel_rank() != 0:
            return None
        tp, pp = mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank()
        pp_size = mpu.get_pipeline_model_parallel_world_size()
        ep, ep_size = mpu.get_expert_model_parallel_rank(), mpu.get_expert_model_parallel_world_size()
    else:  # no process group: one process holds the whole model
        tp, pp, pp_size, ep, ep_size = 0, 0, 1, 0, 1
    name = f"mp_rank_{tp:02d}" if pp_size == 1 else f"mp_rank_{tp:02d}_{pp:03d}"
    if ep_size > 1:
        name += f"_{ep:03d}"
    tensors = {}
    for chunk in model:
        for key, value in _unwrapped(chunk).state_dict().items():
            if key.endswith("_extra_state") or not hasattr(value, "dtype"):
                continue
            tensors[key] = {"shape": list(value.shape), "dtype": str(value.dtype).replace("torch.", ""),
                            "sha256": tensor_sha256(value)}
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name + ".json")
    with open(path + ".tmp", "w") as out:
        json.dump({"rank": name, "tensors": tensors}, out, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)
    print(f"crossalign: load digest of {len(tensors)} tensors written to {path}", flush=True)
    return path


def digest_after_load(training_module, folder: str) -> None:
    """Make pretrain()'s load_checkpoint write the load digest right after it loads, before the first step."""
    original = training_module.load_checkpoint

    def load_checkpoint(ddp_model, *args, **kwargs):
        result = original(ddp_model, *args, **kwargs)
        write_load_digest(ddp_model if isinstance(ddp_model, list) else [ddp_model], folder)
        return result

    load_checkpoint.__wrapped__ = original
    training_module.load_checkpoint = load_checkpoint


# ---- the msprobe dump ------------------------------------------------------------------------------

DUMP_ENV = "CROSSALIGN_MSPROBE_CONFIG"
RECORD_ENV = "CROSSALIGN_MSPROBE_RECORD"  # the record of the run, less the rank (crossalign/dump_settings.py)
RECORD_FILE = "crossalign_dump.json"


def write_rank_record(config_path: str, template_path: str | None, rank: int) -> None:
    """The record of the run (the step's template with this rank) into this rank's folder of the dump step, once
    msprobe has written its dump.json there; as ``crossalign/dump_settings.py`` ``write_rank_record`` does."""
    import json

    if not template_path:
        return
    with open(template_path) as handle:
        record = json.load(handle)
    with open(config_path) as handle:
        dump_path = json.load(handle)["dump_path"]
    folder = os.path.join(dump_path, f"step{record['step']}", f"rank{rank}")
    if os.path.isfile(os.path.join(folder, "dump.json")):
        with open(os.path.join(folder, RECORD_FILE), "w") as handle:
            json.dump({**record, "rank": rank}, handle, indent=1)


def dump_each_iteration(training_module, config_path: str, template_path: str | None = None) -> None:
    """Make pretrain()'s training loop run each iteration under msprobe's ``PrecisionDebugger`` (mindstudio-probe).

    msprobe's way for a training loop: ``debugger.start(model)`` before the iteration, ``debugger.stop()`` and
    ``debugger.step()`` after it, the debugger made once from the ``config.json`` the step wrote
    (``crossalign/dump_settings.py``: task, level, the step and the ranks to dump). Megatron's ``train()`` runs
    each iteration as one call of the module-level ``train_step(forward_step_func, data_iterator, model, ...)``
    (core_v0.16.1 megatron/training/training.py:1603, called at 2795), ``model`` being the list of model
    chunks: wrapped here, so msprobe hooks the chunks Megatron trains (module names ``Module.<chunk>.module...``)
    and counts the iterations itself. The debugger is made at the first iteration, after pretrain() initialised
    torch.distributed, so that each rank writes ``step{N}/rank{R}/``; after the iteration msprobe dumped, each rank
    writes the record of the run beside msprobe's files (``template_path``: :func:`write_rank_record`).
    """
    import torch
    from msprobe.pytorch import PrecisionDebugger

    original = training_module.train_step
    made = []

    def train_step(forward_step_func, data_iterator, model, *args, **kwargs):
        if not made:
            made.append(PrecisionDebugger(config_path=config_path))
        debugger = made[0]
        debugger.start(model=model)
        try:
            result = original(forward_step_func, data_iterator, model, *args, **kwargs)
        finally:
            debugger.stop()
        debugger.step()
        write_rank_record(config_path, template_path,
                          torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)
        return result

    train_step.__wrapped__ = original
    training_module.train_step = train_step


def find_checkout() -> str | None:
    """The Megatron-LM checkout: MEGATRON_LM_PATH, else the current directory, else where gpt_builders imports from."""
    for candidate in (os.environ.get("MEGATRON_LM_PATH"), os.getcwd()):
        if candidate and os.path.exists(os.path.join(candidate, "pretrain_gpt.py")):
            return os.path.abspath(candidate)
    found = importlib.util.find_spec("gpt_builders")
    if found is not None and found.origin:
        folder = os.path.dirname(os.path.abspath(found.origin))
        if os.path.exists(os.path.join(folder, "pretrain_gpt.py")):
            return folder
    return None


def main() -> None:
    checkout = find_checkout()
    if checkout is None:
        sys.exit("pretrain_qwen35.py: no Megatron-LM checkout found (no pretrain_gpt.py in MEGATRON_LM_PATH or the "
                 "current directory, and gpt_builders is not on PYTHONPATH)")
    entry = os.path.join(checkout, "pretrain_gpt.py")
    sys.path.insert(0, checkout)
    import gpt_builders

    # pretrain_gpt.py does `from gpt_builders import gpt_builder`: it picks up the wrapped builder.
    gpt_builders.gpt_builder = wrap_builder(gpt_builders)
    if os.environ.get(DIGEST_ENV):
        from megatron.training import training

        digest_after_load(training, os.environ[DIGEST_ENV])
    if os.environ.get(DUMP_ENV):
        from megatron.training import training

        dump_each_iteration(training, os.environ[DUMP_ENV], os.environ.get(RECORD_ENV))
    sys.argv = [entry] + sys.argv[1:]
    runpy.run_path(entry, run_name="__main__")


if __name__ == "__main__":
    main()
