"""Runs MindFormers' own code on what crossalign generates; started by tests/helpers/mindformers_upstream.py.

Runs in a subprocess whose PYTHONPATH starts with an unpacked MindFormers wheel and the
``hyper_parallel`` stand-in. Reads a job (JSON) naming the tasks, writes their results (JSON).
What is not MindFormers' own code here, and why:

- public MindFormers has no Qwen3.5 model (a site's fork has it): the model is MindFormers' pynative
  ``GPTModel`` built the way its ``PyNativeQwen3ForCausalLM`` builds it, from the generated YAML's
  ``model`` section converted by ``Qwen3ConfigConverter`` extended with the MoE rows of upstream's own
  alias table (``COMMON_CONFIG_MAPPING``), since Qwen3 is dense. The GatedDeltaNet and attention-gate
  keys (``FORK_ONLY``) are left out of the build: no public TransformerConfig knows them, so every
  layer is full attention;
- ``LossCallback.on_step_end``, graph mode's ``MFLossMonitor.print_output_info`` and
  ``Trainer._should_skip_optimizer_step`` are called with the values a training step would hand them
  (a full training step needs NPU kernels).
"""

from __future__ import annotations

import json
import logging
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import yaml

FORK_ONLY = ("experimental_attention_variant", "attention_output_gate", "linear_attention_freq",
             "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
             "linear_num_value_heads")


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _log_to(path: Path) -> logging.Handler:
    """Also write MindFormers' log records to ``path``, formatted as its stdout handler formats them."""
    from mindformers.tools.logger import get_logger
    logger = get_logger()
    handler = logging.FileHandler(path)
    stdout = [h for h in logger.handlers if isinstance(h, logging.StreamHandler)
              and not isinstance(h, logging.FileHandler)]
    handler.setFormatter(stdout[0].formatter if stdout else logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    return handler


def _unlog(handler: logging.Handler) -> None:
    from mindformers.tools.logger import get_logger
    get_logger().removeHandler(handler)
    handler.close()


def load_yaml(path: str) -> str:
    """MindFormers' pynative TrainConfig loader on the file: "ok" or the error it raises."""
    from mindformers.pynative.config.config import TrainConfig
    try:
        TrainConfig.load_from_yaml(path)
        return "ok"
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return _error(exc)


def converter():
    from mindformers.models.qwen3.config_converter_qwen3 import Qwen3ConfigConverter
    from mindformers.parallel_core.transformer_config_utils import COMMON_CONFIG_MAPPING

    moe = {sources: target for sources, target in COMMON_CONFIG_MAPPING.items()
           if isinstance(target, str) and (target.startswith("moe_") or target in ("num_moe_experts",
                                                                                    "shared_expert_num"))}
    return type("MoEQwen3ConfigConverter", (Qwen3ConfigConverter,), {"CONFIG_MAPPING": moe})


def convert(model: dict, log: Path):
    handler = _log_to(log)
    try:
        return converter().convert(dict(model))
    finally:
        _unlog(handler)


def public(model: dict) -> dict:
    """The model section without the keys only a fork's TransformerConfig has (see the module docstring)."""
    return {key: value for key, value in model.items() if key not in FORK_ONLY}


def patched_trainer(path: str):
    """The patched trainer.py at ``path``, imported as a module of MindFormers' pynative trainer package (where its
    relative imports resolve)."""
    import importlib.util

    import mindformers.pynative.trainer  # noqa: F401 - the package the patched file's relative imports resolve in

    spec = importlib.util.spec_from_file_location("mindformers.pynative.trainer.crossalign_patched", path)
    patched = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(patched)
    return patched


def build(model: dict, log: Path):
    """MindFormers' pynative GPTModel for the model section, as PyNativeQwen3ForCausalLM builds it."""
    from mindformers.pynative.base_models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, \
        get_gpt_layer_local_spec
    from mindformers.pynative.base_models.gpt.gpt_model import GPTModel

    config = convert(public(model), log)
    spec = (get_gpt_decoder_block_spec(config) if config.num_moe_experts else
            get_gpt_layer_local_spec(normalization=config.normalization, qk_layernorm=True))
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=config.vocab_size,
                    max_sequence_length=config.max_position_embeddings,
                    position_embedding_type=config.position_embedding_type, rotary_base=config.rotary_base,
                    share_embeddings_and_output_weights=config.tie_word_embeddings)


def parameters(net) -> dict:
    return {name: [list(p.shape), str(p.dtype)] for name, p in net.parameters_and_names()}


def model_task(name: str, path: str, workdir: Path) -> dict:
    model = yaml.safe_load(Path(path).read_text())["model"]
    out: dict = {"load": load_yaml(path)}
    convert(model, workdir / f"convert_{name}.log")
    out["convert_log"] = str(workdir / f"convert_{name}.log")
    net = build(model, workdir / f"build_{name}.log")
    out["parameters"] = parameters(net)
    out["rotary_percent"] = net.rotary_percent
    out["rotary_dims"] = 2 * int(net.rotary_pos_emb._inv_freq_np.shape[0])
    return out


def variant_task(name: str, path: str, changes: dict, workdir: Path) -> dict:
    """Build the model with some model keys changed (None: removed): its parameter names, or the error."""
    model = yaml.safe_load(Path(path).read_text())["model"]
    for key, value in changes.items():
        if value is None:
            model.pop(key, None)
        else:
            model[key] = value
    try:
        return {"parameters": parameters(build(model, workdir / f"variant_{name}.log"))}
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return {"error": _error(exc), "where": traceback.format_exc(limit=-2)}


def loss_lines(steps: list[dict], model: dict, lr: dict, log: Path) -> None:
    """LossCallback.on_step_end, MindFormers' own per-step code and format, on each step's values.

    The model answers LossCallback's questions (its converted TransformerConfig; the aux and MTP losses
    its trackers hold) with the given values; the lr comes from MindFormers' own ConstantWarmUpLR.
    """
    import mindspore as ms
    from mindformers.core.lr.lr_schedule import ConstantWarmUpLR
    from mindformers.pynative.callback.loss_callback import LossCallback

    config = convert(public(model), log.with_suffix(".convert.log"))
    scheduler = ConstantWarmUpLR(**lr)
    callback = LossCallback()
    handler = _log_to(log)
    try:
        for values in steps:
            answers = SimpleNamespace(
                get_gpt_transformer_config=lambda: config,
                get_load_balancing_loss=lambda *args, aux=values.get("aux"), **kwargs: (
                    None if aux is None else ms.Tensor(float(aux), ms.float32)),
                get_mtp_loss=lambda *args, mtp=values.get("mtp", ()), **kwargs: (
                    [ms.Tensor(float(x), ms.float32) for x in mtp] or None),
                reset_model_temporary_tensors=lambda: None)
            state = SimpleNamespace(global_step=values["step"], max_steps=values["max_steps"], num_accumulation_steps=1,
                                    loss_scale=1.0, consumed_samples=values["step"] * 4, global_batch_size=4,
                                    total_flops=0)
            callback.on_step_begin(None, state)
            time.sleep(0.002)  # per_step_time is whole milliseconds; the throughput divides by it
            callback.on_step_end(None, state, loss=ms.Tensor(float(values["loss"]), ms.float32), model=answers,
                                 grad_norm=ms.Tensor(float(values["grad_norm"]), ms.float32), lr_scheduler=scheduler)
    finally:
        _unlog(handler)


def skip_warnings(steps: list[int], log: Path) -> None:
    """The trainer's own NaN-skip decision and warning (2.1.0 training.use_skip_step_on_nan) at ``steps``."""
    from mindformers.pynative.trainer.trainer import Trainer

    trainer = SimpleNamespace(use_skip_step_on_nan=True, _consecutive_skipped_steps=0, max_consecutive_skipped_steps=0,
                              state=SimpleNamespace(skipped_steps=0, global_step=0))
    handler = _log_to(log)
    try:
        for step in steps:
            trainer.state.global_step = step - 1
            assert Trainer._should_skip_optimizer_step(trainer, float("nan")) is True
    finally:
        _unlog(handler)


def save_task(path: str, save_dir: Path, log: Path) -> None:
    """CheckpointCallback saving the built model and its pynative AdamW, as after training step 2 of 3."""
    from mindformers.pynative.callback.checkpoint_callback import CheckpointCallback
    from mindformers.pynative.optimizer.adamw import AdamW

    net = build(yaml.safe_load(Path(path).read_text())["model"], log)
    optimizer = AdamW(net.trainable_params(), learning_rate=1e-3)
    callback = CheckpointCallback(save_path=str(save_dir), save_max=1, save_interleaved_steps=1, prefix="qwen35")
    state = SimpleNamespace(global_step=2, max_steps=3, epoch=1, loss_scale=1.0, global_batch_size=4,
                            consumed_samples=8)
    callback.on_train_begin(None, state)
    callback.on_step_end(None, state, model=net, optimizer=optimizer)


def load_task(path: str, checkpoint: str, dump: Path, log: Path) -> None:
    """MindFormers' load_checkpoint of a checkpoint into a freshly built model (weights only, as the align
    run loads), then the model's parameters as MindSpore saves them."""
    import mindspore as ms
    from mindformers.checkpoint.checkpoint import load_checkpoint

    net = build(yaml.safe_load(Path(path).read_text())["model"], log)
    handler = _log_to(log)
    try:
        load_checkpoint(checkpoint, net)
    finally:
        _unlog(handler)
    ms.save_checkpoint(net, str(dump), format="safetensors")


def holder(params: dict):
    """A single-card pynative network holding ``params`` ({name: [shape, dtype]}) under their full names.

    It stands in for a fork's Qwen3.5 model: public MindFormers builds no GatedDeltaNet layer and no
    gated linear_qkv (see the module docstring), and load_checkpoint asks the network only for its
    parameters (2.1.0 ``checkpoint/checkpoint.py:555``: ``parameters_dict`` for the name filter,
    ``get_sharded_tensor_from_cell`` for the shapes, ``load_parameters`` to put them in).
    """
    import mindspore as ms
    import numpy as np
    from mindspore import nn

    class Holder(nn.Cell):
        def __init__(self):
            super().__init__()
            self.weights = ms.ParameterTuple(
                [ms.Parameter(ms.Tensor(np.zeros(shape, np.float32), getattr(ms, dtype)), name=name)
                 for name, (shape, dtype) in params.items()])

    net = Holder()
    assert set(net.parameters_dict()) == set(params), sorted(set(params) ^ set(net.parameters_dict()))[:5]
    return net


def holder_load_task(params: dict, checkpoints: dict, dumps: dict, log: Path) -> None:
    """MindFormers' load_checkpoint of each checkpoint into a fresh single-card ``holder`` network."""
    import mindspore as ms
    from mindformers.checkpoint.checkpoint import load_checkpoint

    for label, checkpoint in checkpoints.items():
        net = holder(params)
        handler = _log_to(log)
        try:
            load_checkpoint(checkpoint, net)
        finally:
            _unlog(handler)
        ms.save_checkpoint([{"name": p.name, "data": p} for p in net.get_parameters()], dumps[label],
                           format="safetensors")


def _mesh(mesh: list) -> tuple[list, list]:
    """(axis names, sizes) of a device mesh given as [name, size] (1-D) or [[names...], [sizes...]]."""
    return ([mesh[0]], [mesh[1]]) if isinstance(mesh[0], str) else (list(mesh[0]), list(mesh[1]))


def _tensor_map(cut, ndim: int, names: list) -> list:
    """A layout's tensor_map: per tensor axis the mesh axis it is cut along, counted from the right, or -1.

    ``cut`` is the tensor axis cut along a 1-D mesh (None: Replicate), or per tensor axis a mesh
    axis name or None.
    """
    if cut is None or isinstance(cut, int):
        cut = [names[0] if axis == cut else None for axis in range(ndim)]
    return [-1 if name is None else len(names) - 1 - names.index(name) for name in cut]


def _rank_layouts(params: dict, mesh: list, dims: dict) -> dict:
    """Rank-local layouts ({name: [ms.Layout, dtype, global shape]}) on a device mesh, converted by
    MindFormers' own code from the raw dict hyper_parallel's ``get_current_layout`` reports.

    hyper_parallel is not installed: the raw dict (device_matrix, alias_name, rank_list, tensor_map,
    type, full_shape; the keys 2.1.0 ``checkpoint/layout_adapter.py:321 _convert_rank_layout_dict``
    reads) is written here from the placement each parameter gets (``dims``, see ``_tensor_map``).
    """
    import math

    import mindspore as ms
    from mindformers.checkpoint.layout_adapter import LayoutAdapter

    names, sizes = _mesh(mesh)
    raw = {name: {"device_matrix": sizes, "alias_name": names, "rank_list": list(range(math.prod(sizes))),
                  "tensor_map": _tensor_map(dims[name], len(shape), names),
                  "type": getattr(ms, dtype), "full_shape": list(shape)}
           for name, (shape, dtype) in params.items()}
    if hasattr(LayoutAdapter, "_convert_rank_layout_dict"):  # 2.1.0
        return LayoutAdapter._convert_rank_layout_dict(raw)
    # 2.0.0 has the same conversion inline only (checkpoint/layout_adapter.py:143-153, in
    # _get_layout_from_pynative, which asks hyper_parallel for the whole job's layouts first)
    out = {}
    for name, info in raw.items():
        layout = ms.Layout(device_matrix=tuple(info["device_matrix"]), alias_name=tuple(info["alias_name"]),
                           rank_list=list(info["rank_list"]))
        layout._tensor_map = tuple(info["tensor_map"])
        out[name] = [layout, info["type"], info["full_shape"]]
    return out


def _world(mesh: list) -> int:
    import math
    return math.prod(_mesh(mesh)[1])


def _resharded(checkpoint: str, infos: dict, rank: int) -> tuple[dict, dict]:
    """Rank ``rank``'s destination ShardedTensors and what ReshardLoader loads for them from ``checkpoint``.

    The rank is the one the loader asks for, ``get_real_rank()``, which falls back to RANK_ID without
    a communication group.
    """
    import os

    from mindformers.checkpoint.metadata import get_metadata_of_checkpoint
    from mindformers.checkpoint.reshard import ReshardLoader
    from mindformers.checkpoint.sharded_tensor import get_sharded_tensor_from_strategy_metadata

    src_metas, file_mappings = get_metadata_of_checkpoint(checkpoint)
    os.environ["RANK_ID"] = str(rank)
    try:
        dst = get_sharded_tensor_from_strategy_metadata(param_infos=infos, cur_npu_rank=rank)
        state = ReshardLoader(checkpoint_dir=checkpoint, dst_sharded_tensor_metas=dst,
                              src_sharded_tensor_metas=src_metas, param_file_mappings=file_mappings,
                              reshard_worker_num=1, template=None).load()
    finally:
        os.environ.pop("RANK_ID", None)
    return dst, state


def reshard_task(checkpoint: str, params: dict, layouts: dict, out: Path, log: Path) -> dict:
    """What MindFormers' ReshardLoader gives each rank of each layout from ``checkpoint``.

    As load_checkpoint does for a multi-rank job (2.1.0 ``checkpoint/checkpoint.py:555``):
    get_metadata_of_checkpoint for the source, the destination ShardedTensors of the rank from
    ``get_sharded_tensor_from_strategy_metadata`` (what ``get_cur_sharded_tensor`` calls on the
    network's layouts), then ``ReshardLoader(...).load()``. Writes ``<layout>-<rank>.safetensors``;
    returns each rank's destination metas.
    """
    import mindspore as ms

    metas: dict = {}
    handler = _log_to(log)
    try:
        for label, spec in layouts.items():
            infos = _rank_layouts(params, spec["mesh"], spec["dims"])
            for rank in range(_world(spec["mesh"])):
                dst, state = _resharded(checkpoint, infos, rank)
                ms.save_checkpoint([{"name": name, "data": value} for name, value in state.items()],
                                   str(out / f"{label}-{rank}.safetensors"), format="safetensors")
                metas[f"{label}-{rank}"] = {name: {"local_shape": list(t.local_shape),
                                                   "global_offset": list(t.global_offset),
                                                   "axis_fragmentations": list(t.axis_fragmentations)}
                                            for name, t in dst.items()}
    finally:
        _unlog(handler)
    return metas

def metadata_task(params: dict, mesh: list, dims: dict, prefix: str, path: str) -> None:
    """metadata.json as MindFormers' own save path writes it for ``params`` saved by every rank of ``mesh``.

    As save_checkpoint does (2.1.0 ``checkpoint/checkpoint.py:528 save_metadata_json``): every rank's
    ShardedTensors (``get_sharded_tensor_from_strategy_metadata``, as ``get_all_sharded_tensor``
    builds them), the file of each slice (``get_total_params_file_mapping_info``) and ``save_metadata``.
    Without a communication group, the group size that get_total_params_file_mapping_info asks
    MindSpore for (``get_group_size``) is given as the mesh size.
    """
    import mindformers.checkpoint.metadata as metadata
    from mindformers.checkpoint.sharded_tensor import get_sharded_tensor_from_strategy_metadata

    infos = _rank_layouts(params, mesh, dims)
    metas = {rank: get_sharded_tensor_from_strategy_metadata(param_infos=infos, cur_npu_rank=rank)
             for rank in range(_world(mesh))}
    metadata.get_group_size = lambda: _world(mesh)
    mappings = metadata.get_total_params_file_mapping_info(metas, prefix, set(params))
    metadata.save_metadata(metas, mappings, path)


def sharded_save_task(checkpoint: str, params: dict, mesh: list, dims: dict, prefix: str, out: Path,
                      log: Path) -> None:
    """A checkpoint saved by every rank of ``mesh`` as MindFormers' pynative save writes it, weights only.

    Each rank's file holds that rank's local tensors (what save_checkpoint writes after
    ``LayoutAdapter.preprocess_params`` takes each DTensor's local part, 2.1.0
    ``checkpoint/layout_adapter.py:425``), here cut from ``checkpoint`` by ReshardLoader and written
    by MindSpore's ``save_checkpoint`` under MindFormers' file name (``get_checkpoint_name``);
    then metadata.json by ``metadata_task``.
    """
    import mindspore as ms
    from mindformers.checkpoint.utils import FileType, get_checkpoint_name

    infos = _rank_layouts(params, mesh, dims)
    handler = _log_to(log)
    try:
        for rank in range(_world(mesh)):
            _, state = _resharded(checkpoint, infos, rank)
            name = get_checkpoint_name(None, prefix, rank, _world(mesh), FileType.MODEL)
            ms.save_checkpoint([{"name": key, "data": value} for key, value in state.items()],
                               str(out / f"{name}.safetensors"), format="safetensors")
    finally:
        _unlog(handler)
    metadata_task(params, mesh, dims, prefix, str(out / "metadata.json"))


def fork_task(module: str, classes: list[str], path: str, log: Path) -> None:
    """A fork's Qwen3.5 classes (``module``, patched with mindformers-qwen35-loss-logging) built from the
    converted model section, asked for their config as LossCallback asks on every step."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fork_qwen35", module)
    fork = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fork)
    config = convert(public(yaml.safe_load(Path(path).read_text())["model"]), log.with_suffix(".convert.log"))
    handler = _log_to(log)
    try:
        for name in classes:
            model = getattr(fork, name)(config)
            assert model.get_gpt_transformer_config() is config and model.get_gpt_transformer_config() is config
    finally:
        _unlog(handler)


def modules_task(dense: str, moe: str, weights: str, inputs: str, out: str, log: Path) -> None:
    """MindFormers' pynative gated MLP and gated shared expert in fp32 on the given weights and input.

    (Its MoE layer does not run on CPU: the router's top-k is an Ascend kernel, TopkExt.)
    """
    import mindspore as ms
    import numpy as np
    from mindformers.pynative.layers.linear import Linear
    from mindformers.pynative.transformers.mlp import MLP, MLPSubmodules
    from mindformers.pynative.transformers.moe.shared_experts import SharedExpertMLP

    def fp32(path: str) -> dict:
        return public({**yaml.safe_load(Path(path).read_text())["model"], "compute_dtype": "float32"})

    arrays = np.load(weights)
    x = ms.Tensor(np.load(inputs))
    outputs = {}
    for name, module in (("mlp", MLP(convert(fp32(dense), log), MLPSubmodules(linear_fc1=Linear, linear_fc2=Linear))),
                         ("shared_experts", SharedExpertMLP(convert(fp32(moe), log),
                                                            MLPSubmodules(linear_fc1=Linear, linear_fc2=Linear)))):
        own = {key: ms.Parameter(ms.Tensor(arrays[f"{name}.{key}"]), name=key)
               for key, _ in module.parameters_and_names()}
        unloaded, _ = ms.load_param_into_net(module, own, strict_load=True)
        assert not unloaded, unloaded
        outputs[name] = module(x).asnumpy()
    np.savez(out, **outputs)


def graph_lines(steps: list[dict], log: Path) -> None:
    """Graph mode's MFLossMonitor.print_output_info (its own format and logger) for each step's values,
    sink mode, with a fixed float lr (its lr schedule is evaluated only on Ascend)."""
    import numpy as np
    from mindformers.core.callback.callback import MFLossMonitor

    monitor = MFLossMonitor(learning_rate=steps[0]["lr"], origin_epochs=1, dataset_size=len(steps),
                            print_separate_loss=True, is_moe_model=True, is_mtp_model=True)
    monitor.print_separate_loss = True  # what it keeps for an mcore (use_legacy: False) model; here no model is set
    handler = _log_to(log)
    try:
        for v in steps:
            monitor.print_output_info(SimpleNamespace(dataset_sink_mode=True), 1, 1, 0.65, v["step"], len(steps),
                                      v["loss"], 1530, False, 1.0, 100.0, 100.0 * v["step"] / len(steps),
                                      np.array([v["grad_norm"]], np.float32), np.array([v["lm_loss"]], np.float32),
                                      np.array([v["aux"]], np.float32), np.array([v["mtp"]], np.float32),
                                      np.array([0.0], np.float32))
    finally:
        _unlog(handler)


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    workdir = Path(job["result"]).parent
    result: dict = {}
    result["models"] = {name: model_task(name, path, workdir) for name, path in job.get("models", {}).items()}
    result["loads"] = {name: load_yaml(path) for name, path in job.get("loads", {}).items()}
    result["variants"] = {name: variant_task(name, spec["yaml"], spec["changes"], workdir)
                          for name, spec in job.get("variants", {}).items()}
    if "loss_lines" in job:
        spec = job["loss_lines"]
        loss_lines(spec["steps"], yaml.safe_load(Path(spec["yaml"]).read_text())["model"], spec["lr"],
                   workdir / "loss_lines.log")
    if "skip_steps" in job:
        skip_warnings(job["skip_steps"], workdir / "skip.log")
    for name, spec in job.get("forks", {}).items():
        fork_task(spec["module"], spec["classes"], spec["yaml"], workdir / f"fork_{name}.log")
    if "modules" in job:
        spec = job["modules"]
        modules_task(spec["dense"], spec["moe"], spec["weights"], spec["input"], spec["out"], workdir / "modules.log")
    if "graph_lines" in job:
        graph_lines(job["graph_lines"], workdir / "graph_lines.log")
    if "save" in job:
        save_task(job["save"]["yaml"], Path(job["save"]["dir"]), workdir / "save.log")
    if "load" in job:
        load_task(job["load"]["yaml"], job["load"]["checkpoint"], Path(job["load"]["dump"]), workdir / "load.log")
    for spec in job.get("holder_loads", []):
        holder_load_task(spec["params"], spec["checkpoints"], spec["dumps"], workdir / spec["log"])
    result["reshards"] = {source: reshard_task(spec["checkpoint"], spec["params"], spec["layouts"],
                                               Path(spec["out"]), workdir / f"reshard_{source}.log")
                          for source, spec in job.get("reshards", {}).items()}
    for spec in job.get("saves", []):
        sharded_save_task(spec["checkpoint"], spec["params"], spec["mesh"], spec["dims"], spec["prefix"],
                          Path(spec["out"]), workdir / spec["log"])
    for spec in job.get("metadata", []):
        metadata_task(spec["params"], spec["mesh"], spec["dims"], spec["prefix"], spec["path"])
    Path(job["result"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
