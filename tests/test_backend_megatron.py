"""Megatron backend: arguments from the model config, log verdicts, and a launch through the run script."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from crossalign.data.files import DatasetFiles
from crossalign.sides.protocol import TrainRequest
from crossalign.sides.launch import BackendRunError, BackendSetupError
from crossalign.sides.megatron.backend import LAUNCHER, MegatronBackend, entry_point
from crossalign.sides.megatron.args import megatron_args
from crossalign.sides.megatron.log_checks import parse_iteration_line, verify_megatron_log
from crossalign.sides.mindformers.yaml import mindformers_yaml
from crossalign.preflight.config import preflight_config
from crossalign.sides.megatron.checkpoint import write_megatron_checkpoint
from crossalign.config import load_config
from crossalign.sides.megatron.args_reader import parse_megatron_args
from crossalign.site import FrameworkSite, SiteConfig

FIXTURES = Path(__file__).parent / "fixtures"
PACKAGE_INFO = Path(importlib.util.find_spec("megatron").submodule_search_locations[0]) / "core" / "package_info.py"
SPEC_LINE = (" [2026-03-20 10:11:12.345678] iteration        3/    1000 | consumed samples: 24 | elapsed time per "
             "iteration (ms): 3456.7 | learning rate: 1.000000E-05 | global batch size:     8 | lm loss: 1.187654E+01 | "
             "load_balancing_loss: 1.003456E+00 | mtp_1 loss: 1.201234E+01 | loss scale: 1.0 | grad norm: 5.432 | "
             "number of skipped iterations:   0 | number of nan iterations:   0 |")


def args_of(name: str, **kw) -> dict[str, list[str]]:
    kw.setdefault("load_dir", "/ckpt")
    return parse_megatron_args(megatron_args(load_config(name), data_prefix="/data/corpus_text_document",
                                             tokenizer=None, **kw))


def test_dense_arguments_follow_the_spec():
    a = args_of("qwen35_dense")
    expect = {"--num-layers": ["8"], "--hidden-size": ["1024"], "--num-attention-heads": ["16"],
              "--num-query-groups": ["4"], "--kv-channels": ["256"], "--ffn-hidden-size": ["3072"],
              "--norm-epsilon": ["1e-05"], "--rotary-base": ["1000000"], "--rotary-percent": ["0.25"],
              "--experimental-attention-variant": ["gated_delta_net"], "--linear-attention-freq": ["4"],
              "--linear-num-value-heads": ["16"], "--mtp-num-layers": ["1"], "--mtp-loss-scaling-factor": ["1.0"],
              "--seed": ["1234"], "--dataloader-type": ["single"], "--split": ["1,0,0"], "--lr": ["0.0003"],
              "--lr-decay-style": ["constant"], "--lr-warmup-iters": ["10"], "--attention-dropout": ["0.0"],
              "--hidden-dropout": ["0.0"], "--log-interval": ["1"], "--transformer-impl": ["transformer_engine"],
              "--load": ["/ckpt"], "--vocab-size": ["248319"], "--data-path": ["/data/corpus_text_document"]}
    for flag, value in expect.items():
        assert a[flag] == value, flag
    for switch in ("--group-query-attention", "--swiglu", "--untie-embeddings-and-output-weights", "--qk-layernorm",
                   "--attention-output-gate", "--disable-bias-linear", "--finetune", "--no-load-optim",
                   "--no-load-rng", "--bf16", "--deterministic-mode", "--no-gradient-accumulation-fusion"):
        assert a[switch] == [], switch
    assert "--apply-layernorm-1p" not in a
    assert not [flag for flag in a if flag.startswith("--moe") or flag == "--num-experts"]


def with_core(name: str, version: str):
    config = load_config(name)
    return config.model_copy(update={"training": config.training.model_copy(
        update={"megatron_core_version": version})})


@pytest.mark.parametrize("version, vocab_arg", [("0.16.1", 248319), ("0.17.1", 248319), ("0.18.0", 248320),
                                                ("0.19.0", 248320)])
def test_vocab_size_argument_follows_the_null_tokenizer_of_the_core_version(version: str, vocab_arg: int):
    # 0.16/0.17: NullTokenizer reports --vocab-size + 1; from 0.18 exactly --vocab-size (null_tokenizer.py)
    config = with_core("qwen35_dense", version)
    args = megatron_args(config, data_prefix="/d", tokenizer=None, load_dir="/ckpt")
    assert parse_megatron_args(args)["--vocab-size"] == [str(vocab_arg)]
    rows = {row.name: row for row in preflight_config(config).rows}["vocab rows"]
    assert rows.ok and rows.megatron == "248320", rows

    # arguments written for another core version give the wrong number of rows, and preflight says so
    other = "0.18.0" if version < "0.18" else "0.16.1"
    foreign = megatron_args(with_core("qwen35_dense", other), data_prefix="/d", tokenizer=None, load_dir="/ckpt")
    report = preflight_config(config, megatron_args=foreign,
                              mindformers_yaml=mindformers_yaml(config, mode="align", data_prefix="/d", load_dir="/c"))
    assert report.mismatches == ["vocab rows"]


def test_installed_null_tokenizer_gives_the_checkpoint_rows():
    """The megatron-core 0.16.1 wheel's own NullTokenizer, fed the generated --vocab-size."""
    path = PACKAGE_INFO.parent / "tokenizers" / "text" / "libraries" / "null_tokenizer.py"
    spec = importlib.util.spec_from_file_location("null_tokenizer", path)  # the file alone: megatron.core is slow
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    NullTokenizer = module.NullTokenizer
    args = parse_megatron_args(megatron_args(load_config("qwen35_dense"), data_prefix="/d", tokenizer=None,
                                             load_dir="/ckpt"))
    assert NullTokenizer(int(args["--vocab-size"][0])).vocab_size == load_config("qwen35_dense").model.padded_vocab_size


def test_moe_arguments_follow_the_spec():
    a = args_of("qwen35_moe")
    expect = {"--num-experts": ["8"], "--moe-layer-freq": ["1"], "--moe-router-topk": ["2"],
              "--moe-ffn-hidden-size": ["512"], "--moe-shared-expert-intermediate-size": ["512"],
              "--moe-token-dispatcher-type": ["alltoall"], "--moe-router-score-function": ["softmax"],
              "--moe-router-topk-scaling-factor": ["1.0"], "--moe-router-dtype": ["fp32"],
              "--moe-router-load-balancing-type": ["aux_loss"], "--moe-aux-loss-coeff": ["0.001"]}
    for flag, value in expect.items():
        assert a[flag] == value, flag
    assert a["--moe-shared-expert-gate"] == [] and a["--moe-grouped-gemm"] == []
    assert "--moe-router-pre-softmax" not in a  # norm_topk_prob True: Megatron's top-k softmax


def test_save_and_batch_checks(tmp_path: Path):
    a = args_of("qwen35_moe_tiny", save_dir="/out", train_iters=7)
    assert a["--save"] == ["/out"] and a["--save-interval"] == ["7"] and a["--train-iters"] == ["7"]
    with pytest.raises(BackendSetupError, match="not a multiple of micro_batch_size 4 x 3 GPUs"):
        args_of("qwen35_moe_tiny", nproc=3)
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(json.dumps({"model": {"vocab": {f"t{i}": i for i in range(3000)}}, "added_tokens": []}))
    with pytest.raises(BackendSetupError, match="3000 tokens do not fit model.padded_vocab_size 2048"):
        megatron_args(load_config("qwen35_moe_tiny"), data_prefix="/d", tokenizer=tmp_path, load_dir=None)


def test_iteration_line_parsing():
    step, total, metrics = parse_iteration_line(SPEC_LINE)
    assert (step, total) == (3, 1000)
    assert metrics == {"step_time_ms": 3456.7, "lr": 1e-5, "lm_loss": 11.87654, "aux_loss": 1.003456,
                       "mtp_1_loss": 12.01234, "grad_norm": 5.432}
    assert parse_iteration_line(" validation loss at iteration 100 | lm loss value: 1.1E+01 |") is None


def write_log(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def iteration_lines(n: int) -> list[str]:
    return [SPEC_LINE.replace("iteration        3/    1000", f"iteration {k:8d}/{n:8d}") for k in range(1, n + 1)]


def test_log_verdicts(tmp_path: Path):
    loaded = "  successfully loaded checkpoint from /ckpt [ t 1/1, p 1/1 ] at iteration 0"
    good = write_log(tmp_path / "good.log", [loaded, *iteration_lines(3)])
    verify_megatron_log(good, iterations=3, loaded=True, exit_status=0)

    # what core_v0.16.1 prints after a failed strict load, whatever failed (the wrappers drop the result:
    # checkpointing.py:1759-1767); the line comes from a rehearsal of pretrain() on CPU (tests/test_rehearsal.py)
    non_strict = write_log(tmp_path / "non_strict.log", ["load_return: None", loaded, *iteration_lines(3)])
    assert verify_megatron_log(non_strict, iterations=3, loaded=True, exit_status=0) == \
        f"{non_strict}:1: load_return: None"
    assert verify_megatron_log(good, iterations=3, loaded=True, exit_status=0) is None

    pickle = write_log(tmp_path / "pickle.log", ["building GPT model ...", "could not load the checkpoint", "boom"])
    with pytest.raises(BackendRunError, match=r"exits 0 anyway.*pickle.log:2"):
        verify_megatron_log(pickle, iterations=3, loaded=True, exit_status=0)

    short = write_log(tmp_path / "short.log", [loaded, *iteration_lines(3)[:2]])
    with pytest.raises(BackendRunError, match=r"iterations 3..3 of 3 were never logged \(last logged: 2\)"):
        verify_megatron_log(short, iterations=3, loaded=True, exit_status=0)

    with pytest.raises(BackendRunError, match="no 'successfully loaded checkpoint'"):
        verify_megatron_log(write_log(tmp_path / "noload.log", iteration_lines(3)), iterations=3, loaded=True,
                            exit_status=0)
    with pytest.raises(BackendRunError, match="exited with status 1"):
        verify_megatron_log(good, iterations=3, loaded=True, exit_status=1)


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    root = tmp_path / "Megatron-LM"
    shutil.copytree(FIXTURES / "megatron_tree", root)
    (root / "megatron" / "core").mkdir(parents=True, exist_ok=True)
    shutil.copy(PACKAGE_INFO, root / "megatron" / "core" / "package_info.py")
    return root


def test_entry_point_by_version(checkout: Path):
    # the launcher on every version: it writes the load digest (from 0.19 its builder builds upstream's specs)
    assert entry_point(checkout, (0, 16, 1)) == LAUNCHER
    assert entry_point(checkout, (0, 18, 2)) == LAUNCHER
    assert entry_point(checkout, (0, 19, 0)) == LAUNCHER
    with pytest.raises(BackendSetupError, match="has no GatedDeltaNet"):
        entry_point(checkout, (0, 15, 3))


def request_for(tmp_path: Path, steps: list) -> TrainRequest:
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(json.dumps({"model": {"vocab": {f"t{i}": i for i in range(2000)}},
                                     "added_tokens": [{"id": 2000, "content": "<eod>"}]}))
    config = load_config("qwen35_moe_tiny")
    config = config.model_copy(update={"training": config.training.model_copy(update={"train_iters": 4})})
    if not (tmp_path / "converted").exists():
        write_megatron_checkpoint(tmp_path / "converted", 0, {"embedding.word_embeddings.weight": torch.ones(3, 2),
                                                              "decoder.final_layernorm.weight": torch.arange(2.0)})
    return TrainRequest(config=config, side="megatron", mode="align",
                        data=DatasetFiles(prefix=tmp_path / "data" / "corpus_text_document", tokenizer=tokenizer),
                        output_dir=tmp_path / "04-megatron-train", init_checkpoint=tmp_path / "converted",
                        on_step=lambda step, total, metrics: steps.append((step, total, metrics["lm_loss"])))


def site_for(checkout: Path, **env: str) -> SiteConfig:
    return SiteConfig(megatron=FrameworkSite(path=checkout, python=sys.executable, nproc_per_node=1, env=env))


@pytest.mark.timeout(120)
def test_train_through_run_script_and_launcher(tmp_path: Path, checkout: Path):
    steps: list = []
    request = request_for(tmp_path, steps)
    result = MegatronBackend(site=site_for(checkout)).train(request)
    assert result.iterations == 4 and result.log_path == request.log_path and result.checkpoint_dir is None
    assert result.loaded_tensors_verified and result.loaded_tensors_verified > 0  # the compare step reads it
    assert [s[0] for s in steps] == [1, 2, 3, 4] and steps[0][1] == 4 and steps[0][2] == pytest.approx(7.59)
    log = request.log_path.read_text()
    assert "builder wrapped by launcher: True" in log  # 0.16.1: the MTP+GDN launcher ran pretrain_gpt.py
    script = (request.output_dir / "run_megatron.sh").read_text()
    launcher = request.output_dir / LAUNCHER.name  # copied next to the run script (shared with remote hosts)
    assert launcher.read_text() == LAUNCHER.read_text()
    for needle in ("export NCCL_ALGO=Ring", "export CUBLAS_WORKSPACE_CONFIG=:4096:8", "torch.distributed.run",
                   "--nproc_per_node 1", str(launcher), "--load", str(request.init_checkpoint), "--seed 1234",
                   "[ -e pretrain_gpt.py ] ||"):
        assert needle in script, needle
    args = (request.output_dir / "megatron_args.txt").read_text().split()
    assert args[:2] == ["--transformer-impl", "transformer_engine"]
    # Megatron's dataset index cache goes to the step, never next to the shared dataset
    assert args[args.index("--data-cache-path") + 1] == str(request.output_dir.absolute() / "data_cache")
    # the dataset helpers are built by the framework's own python3, first on PATH, before training
    assert f'export PATH={Path(sys.executable).parent}:"$PATH"' in script
    assert "megatron.core.datasets.helpers_cpp" in script
    assert json.loads((request.output_dir / "load_digest" / "mp_rank_00.json").read_text())["rank"] == "mp_rank_00"


@pytest.mark.timeout(120)
def test_a_partial_load_fails_the_step_naming_the_tensor(tmp_path: Path, checkout: Path):
    """Megatron prints only 'load_return: None' and 'successfully loaded': the load digest names what is missing."""
    backend = MegatronBackend(site=site_for(checkout, FAKE_MEGATRON="partial"))
    with pytest.raises(BackendRunError, match=r"1 in the checkpoint but never loaded \(extra or renamed\): "
                                              r"decoder.final_layernorm.weight.*train.log:\d+: load_return: None"):
        backend.train(request_for(tmp_path, []))


@pytest.mark.timeout(120)
def test_failed_unpickle_with_exit_zero_is_an_error(tmp_path: Path, checkout: Path):
    backend = MegatronBackend(site=site_for(checkout, FAKE_MEGATRON="bad-pickle"))
    with pytest.raises(BackendRunError, match=r"could not unpickle.*train.log:\d+: could not load"):
        backend.train(request_for(tmp_path, []))


@pytest.mark.timeout(60)
def test_missing_checkout_on_the_running_host_stops_the_script(tmp_path: Path, checkout: Path):
    # a remote checkout is not read from here; the run script checks it where it runs
    (tmp_path / "elsewhere").mkdir()
    site = SiteConfig(megatron=FrameworkSite(path=tmp_path / "elsewhere", python=sys.executable, ssh_host="gpu01"),
                      ssh_hosts={"gpu01": {"hostname": "10.0.0.12"}})
    with pytest.raises(BackendRunError, match=r"(?s)exited with status 2.*elsewhere/pretrain_gpt.py not found on \w"):
        MegatronBackend(site=site).train(request_for(tmp_path, []))


def test_setup_errors(tmp_path: Path, checkout: Path):
    with pytest.raises(BackendSetupError, match="megatron.path"):
        MegatronBackend(site=SiteConfig()).train(request_for(tmp_path, []))
    info = checkout / "megatron" / "core" / "package_info.py"
    info.write_text(info.read_text().replace("MINOR = 16", "MINOR = 17"))
    with pytest.raises(BackendSetupError, match="megatron-core 0.17.1 but training.megatron_core_version is 0.16.1"):
        MegatronBackend(site=site_for(checkout)).train(request_for(tmp_path, []))


def require_python(checkout: Path, requirement: str) -> str:
    pyproject = checkout / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('">=3.10"', f'"{requirement}"'))
    return f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"


def test_interpreter_must_satisfy_the_checkout_requires_python(tmp_path: Path, checkout: Path):
    # Megatron-LM core 0.17.0 on: requires-python ">=3.12" (pyproject.toml); 0.18 on imports typing.override
    version = require_python(checkout, f">{sys.version_info.major}.{sys.version_info.minor + 1}")
    with pytest.raises(BackendSetupError, match=rf"megatron.python {sys.executable} is Python {version}, but the "
                                                rf"Megatron-LM checkout {checkout} requires Python >3.{sys.version_info.minor + 1}"):
        MegatronBackend(site=site_for(checkout)).train(request_for(tmp_path, []))


@pytest.mark.timeout(120)
def test_gpu_probe_names_the_python_mismatch(checkout: Path):
    from crossalign.agents.probe import probe_pool

    require_python(checkout, ">=3.99")
    site = SiteConfig(backends={"gpu": "megatron"}, megatron=FrameworkSite(path=checkout, python=sys.executable))
    check = {c.name: c for c in probe_pool("gpu", site)}["Megatron-LM Python"]
    assert not check.ok and "requires Python >=3.99 (requires-python in its pyproject.toml)" in check.detail


@pytest.mark.timeout(60)
def test_remote_run_script_checks_the_python_where_it_runs(tmp_path: Path, checkout: Path):
    # a remote host's checkout and interpreter cannot be read from here: the run script checks them there
    require_python(checkout, ">=3.99")
    site = SiteConfig(megatron=FrameworkSite(path=checkout, python=sys.executable, ssh_host="gpu01"),
                      ssh_hosts={"gpu01": {"hostname": "10.0.0.12"}})
    with pytest.raises(BackendRunError, match=r"(?s)exited with status 2.*is Python 3\.\d+\.\d+, but this "
                                              r"Megatron-LM checkout requires Python >=3.99"):
        MegatronBackend(site=site).train(request_for(tmp_path, []))


def test_relative_checkout_and_step_paths_are_made_absolute(tmp_path: Path, checkout: Path, monkeypatch):
    """The run script cds into the checkout: every path it names must hold from there."""
    monkeypatch.chdir(tmp_path)
    request = request_for(Path("."), [])
    site = SiteConfig(megatron=FrameworkSite(path=Path(checkout.name), python=sys.executable))
    script = MegatronBackend(site=site).write_launch(request)
    args = parse_megatron_args((tmp_path / request.output_dir / "megatron_args.txt").read_text().split())
    assert args["--data-path"] == [str(tmp_path / "data" / "corpus_text_document")]
    assert args["--load"] == [str(tmp_path / "converted")]
    text = script.read_text()
    assert f"export PYTHONPATH={checkout}\n" in text and f"cd {checkout}\n" in text
    assert f"{tmp_path / request.output_dir / LAUNCHER.name}" in text


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("g++") is None, reason="needs make and g++")
@pytest.mark.timeout(300)
def test_dataset_helpers_that_do_not_build_are_named_before_a_run(tmp_path: Path, checkout: Path):
    """Megatron builds its dataset helpers with make at start-up and exits 1 if it cannot (initialize.py:186-195):
    the GPU probe and the run script try first, with the framework's interpreter."""
    from crossalign.sides.megatron.backend import dataset_helpers_problem

    assert dataset_helpers_problem(checkout, sys.executable) is None  # nothing of Megatron's to build here
    datasets = checkout / "megatron" / "core" / "datasets"
    datasets.mkdir(parents=True)
    (datasets / "helpers.cpp").write_text("this is not C++\n")
    # the rule of core_v0.16.1's megatron/core/datasets/Makefile
    (datasets / "Makefile").write_text("LIBNAME = helpers_cpp\n$(LIBNAME)$(LIBEXT): helpers.cpp\n"
                                       "\t$(CXX) -shared -fPIC $(CPPFLAGS) $< -o $@\n")
    problem = dataset_helpers_problem(checkout, sys.executable)
    assert problem is not None and "dataset helpers do not build for" in problem and "helpers.cpp" in problem


@pytest.mark.timeout(120)
def test_a_dump_writes_msprobes_config_and_the_launcher_is_told_where_it_is(tmp_path: Path, checkout: Path):
    """With a dump asked (diagnose.dump, rerun --dump) the step writes msprobe's config.json and exports its path for
    the launcher (patches/megatron/pretrain_qwen35.py dump_each_iteration); without one, neither."""
    from crossalign.dump_settings import CONFIG_FILE, RECORD_TEMPLATE, DumpRecord, DumpSettings

    request = request_for(tmp_path, [])
    request.dump = DumpSettings(step=2, task="tensor", ranks=(0,))
    request.run_id = "r-7"
    script = MegatronBackend(site=site_for(checkout)).write_launch(request).read_text()
    config_path = request.output_dir.absolute() / CONFIG_FILE
    assert f"export CROSSALIGN_MSPROBE_CONFIG={config_path}" in script
    # the record of the run each dumping rank writes beside msprobe's files (the launcher's write_rank_record)
    template = request.output_dir.absolute() / RECORD_TEMPLATE
    assert f"export CROSSALIGN_MSPROBE_RECORD={template}" in script
    assert DumpRecord.model_validate_json(template.read_text()) == DumpRecord.of(request.config, "megatron", "r-7", 2)
    assert "cannot import msprobe.pytorch" in script  # checked with the framework's Python before training
    config = json.loads(config_path.read_text())
    assert (config["task"], config["step"], config["rank"]) == ("tensor", [2], [0])
    assert config["dump_path"] == str(request.output_dir.absolute() / "msprobe_dump")
    (tmp_path / "plain").mkdir()
    plain = request_for(tmp_path / "plain", [])
    assert "CROSSALIGN_MSPROBE_CONFIG" not in MegatronBackend(site=site_for(checkout)).write_launch(plain).read_text()
    assert not (plain.output_dir / CONFIG_FILE).exists()
    with pytest.raises(ValueError, match=r"diagnose.dump.step: 4 is not reached by a training of 4 iterations"):
        request.dump = DumpSettings(step=4)
        MegatronBackend(site=site_for(checkout)).write_launch(request)


def test_the_checkpoint_format_of_the_converted_checkpoint_is_the_one_megatron_is_told():
    config = load_config("qwen35_moe_tiny")
    assert parse_megatron_args(megatron_args(config, data_prefix="/d", tokenizer=None,
                                             load_dir="/ckpt"))["--ckpt-format"] == ["torch"]
    dist = config.model_copy(update={"training": config.training.model_copy(
        update={"megatron_ckpt_format": "torch_dist"})})
    assert parse_megatron_args(megatron_args(dist, data_prefix="/d", tokenizer=None,
                                             load_dir="/ckpt"))["--ckpt-format"] == ["torch_dist"]
