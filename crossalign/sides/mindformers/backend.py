"""The real NPU side: MindFormers in pynative mode (``run_mindformer.py --mode 1``).

The run script (``run_mindformers.sh``, kept in the step folder) launches ``run_mindformer.py`` (msrun for
several cards) with the YAML of ``yaml.py``; afterwards the log is judged (``log_checks.py``), never the exit
status alone, and what the network loaded is held against the checkpoint (``load_digest.py``).
"""

from __future__ import annotations

import time
from pathlib import Path


from crossalign.sides.protocol import TrainRequest, TrainResult
from crossalign.sides.launch import (
    BackendRunError,
    BackendSetupError,
    FrameworkBackend,
    RunScript,
    progress_callback,
    write_run_script,
)
from crossalign.sides.mindformers.yaml import dump_yaml, mindformers_yaml
from crossalign.sides.mindformers.log_checks import parse_step_line, verify_built_model, verify_mindformers_log, verify_transformer_config
from crossalign.sides.mindformers.load_digest import LOAD_DIGEST_DIR, LOAD_DIGEST_ENV, verify_load_digest
from crossalign.tensorio.errors import CheckpointError
from crossalign.dump_settings import CONFIG_FILE, RECORD_ENV, RECORD_TEMPLATE, msprobe_import_check


RUN_SCRIPT = "run_mindformers.sh"
DETERMINISTIC_ENV = {"HCCL_DETERMINISTIC": "true", "ASCEND_LAUNCH_BLOCKING": "1"}
MSRUN_PORT = 8118
MSPROBE_ENV = "CROSSALIGN_MSPROBE_CONFIG"  # read by patches/mindformers/msprobe_dump.yaml

# ---- what MindFormers built from the YAML ------------------------------------------------------


# ---- the log ---------------------------------------------------------------------------------



def find_checkpoint(save_dir: Path) -> Path:
    """The saved checkpoint root (holding latest_checkpointed_iteration.txt)."""
    tracker = save_dir / "latest_checkpointed_iteration.txt"
    if not tracker.exists():
        found = sorted(save_dir.rglob("latest_checkpointed_iteration.txt"))
        if not found:
            raise BackendRunError(f"{save_dir}: MindFormers saved no checkpoint (no latest_checkpointed_iteration.txt)")
        return found[0].parent
    return save_dir


# ---- what the network loaded -------------------------------------------------------------------



# ---- launching -------------------------------------------------------------------------------


class MindFormersBackend(FrameworkBackend):
    """DAG steps 1 and 5 on an NPU machine: ``run_mindformer.py --mode 1`` (msrun for several cards)."""

    name = "mindformers"

    def checkout(self) -> Path:
        """The MindFormers checkout (checked here unless it lives on a remote host; the run script checks too)."""
        path = self.site.mindformers.path
        if path is None:
            raise BackendSetupError("site config: mindformers.path (the MindFormers checkout) is not set")
        path = Path(path).expanduser()
        if self.site.mindformers.ssh_host is not None:
            if not path.is_absolute():
                raise BackendSetupError(f"mindformers.path {path}: must be an absolute path on the remote host "
                                        f"{self.site.mindformers.ssh_host}")
            return path
        path = path.absolute()  # the run script cds into the step folder: a relative path would no longer hold
        if not (path / "run_mindformer.py").exists():
            raise BackendSetupError(f"mindformers.path {path}: no run_mindformer.py there (not a MindFormers checkout)")
        return path

    def run_script(self, request: TrainRequest, config_path: Path) -> RunScript:
        checkout = self.checkout()
        site = self.site.mindformers
        layout = request.config.parallel.mindformers
        if site.nproc_per_node < layout.cards_per_node:
            raise BackendSetupError(f"parallel.mindformers.cards_per_node is {layout.cards_per_node}, but the site's "
                                    f"mindformers.nproc_per_node is {site.nproc_per_node}")
        nproc, local = layout.world_size, layout.cards_per_node
        log_root = request.output_dir.absolute() / "mf_log"
        env = {**DETERMINISTIC_ENV, "PYTHONPATH": str(checkout), "LOG_MF_PATH": str(log_root), **site.env}
        if request.mode == "align":  # the run that loads: the patched trainer records what it loaded
            env[LOAD_DIGEST_ENV] = str(request.output_dir.absolute() / LOAD_DIGEST_DIR)
        if request.dump is not None:  # the mindformers-msprobe-dump patch runs each step under msprobe
            env[MSPROBE_ENV] = str(request.output_dir.absolute() / CONFIG_FILE)
            env[RECORD_ENV] = str(request.output_dir.absolute() / RECORD_TEMPLATE)  # each rank's record of the run
        entry = [str(checkout / "run_mindformer.py"), "--mode", "1", "--config", str(config_path.absolute())]
        if nproc == 1:
            command = [site.python, *entry]
        else:
            command = [site.python, "-m", "mindspore.parallel.cluster.run", f"--worker_num={nproc}",
                       f"--local_worker_num={local}", f"--master_port={MSRUN_PORT}",
                       f"--log_dir={request.output_dir.absolute() / 'msrun_log'}", "--join=True",
                       f"--tail_worker_log={nproc - 1}", *entry]
        # the mindformers-msprobe-dump patch imports msprobe's MindSpore side in the framework's own Python
        checks = [(site.python, "-c", msprobe_import_check("msprobe.mindspore"))] if request.dump is not None else []
        return RunScript(command=command, cwd=request.output_dir.absolute(), env=env, required_files=(entry[0],),
                         checks=checks,
                         staged_in=request.output_dir, published_as=request.published_dir,
                         title=f"MindFormers pynative: {request.config.model.name}, {request.mode} run, "
                               f"{request.iterations} steps on {nproc} card(s)")

    def train(self, request: TrainRequest) -> TrainResult:
        if request.side != "mindformers":
            raise BackendSetupError(f"the mindformers backend trains side 'mindformers', not {request.side!r}")
        loaded = request.mode == "align"
        if loaded and request.init_checkpoint is None:
            raise BackendSetupError("the align run needs request.init_checkpoint (the bf16 MindFormers checkpoint)")
        save = request.save or request.mode == "base"
        data = mindformers_yaml(
            request.config, mode=request.mode, data_prefix=request.data.prefix.absolute(),
            tokenizer=request.data.tokenizer,
            load_dir=request.init_checkpoint.absolute() if loaded else None,  # type: ignore[union-attr]
            save_dir=request.checkpoint_dir.absolute() if save else None,
            model_overrides=request.extra.get("mindformers_model"))  # type: ignore[arg-type]
        request.output_dir.mkdir(parents=True, exist_ok=True)
        config_path = dump_yaml(data, request.output_dir / f"{request.mode}_train.yaml")
        if request.dump is not None:
            request.write_dump_config()
        script = write_run_script(request.output_dir / RUN_SCRIPT, self.run_script(request, config_path))

        steps = request.iterations
        on_line = progress_callback(request.on_step, steps, parse_step_line)
        start = time.monotonic()
        status = self._runner(script, request.log_path, on_line)
        verify_mindformers_log(request.log_path, steps=steps, loaded=loaded, exit_status=status,
                               mtp=request.config.model.mtp_num_layers > 0, moe=request.config.model.is_moe)
        verify_transformer_config(request.log_path, request.config)
        verify_built_model(request.log_path, request.config)
        verified = None
        if loaded:
            try:
                verified = verify_load_digest(request.output_dir / LOAD_DIGEST_DIR, request.init_checkpoint,
                                              request.config)  # type: ignore[arg-type]
            except CheckpointError as exc:  # LoadDigestError, or the checkpoint itself unreadable
                raise BackendRunError(str(exc)) from None
        checkpoint = find_checkpoint(request.checkpoint_dir) if save else None
        return TrainResult(log_path=request.log_path, checkpoint_dir=checkpoint, iterations=steps,
                           seconds=time.monotonic() - start, loaded_tensors_verified=verified)

