"""The Megatron-LM side as the shared code sees it (``crossalign.sides.protocol.Side``)."""

from __future__ import annotations

from pathlib import Path

from crossalign.config import AlignmentConfig, TrainingConfig
from crossalign.data.settings import SampleOrderSettings
from crossalign.sides.launch import Runner
from crossalign.sides.megatron.args import megatron_args, sample_order
from crossalign.sides.megatron.args_reader import load_megatron_args_file, read_megatron_args, sample_order_from_args
from crossalign.sides.megatron.backend import MegatronBackend
from crossalign.sides.megatron.log_checks import parse_iteration_line
from crossalign.sides.protocol import ProgressLine, TrainBackend
from crossalign.sides.readings import PREFLIGHT_DATA_PREFIX, Reading
from crossalign.site import SiteConfig


class MegatronSide:
    name = "megatron"
    framework = "Megatron-LM"
    pool = "gpu"
    log_formats = ("megatron",)

    def sample_order(self, training: TrainingConfig, num_samples: int | None = None) -> SampleOrderSettings:
        return sample_order(training, num_samples)

    def launch_sample_order(self, path: Path) -> SampleOrderSettings:
        return sample_order_from_args(load_megatron_args_file(path))

    def generated_readings(self, config: AlignmentConfig) -> dict[str, Reading]:
        args = megatron_args(config, data_prefix=PREFLIGHT_DATA_PREFIX, tokenizer=None,
                             load_dir=Path("MEGATRON_CHECKPOINT"))
        return read_megatron_args(args, config.training.megatron_core_version, config.parallel.megatron.world_size)

    def progress(self, line: str) -> ProgressLine | None:
        return parse_iteration_line(line)

    def embedded_backend(self) -> TrainBackend:
        # megatron-core and torch are imported only where the embedded side trains (start-up time of the CLI)
        from crossalign.sides.megatron.embedded.trainer import LocalMegatronBackend

        return LocalMegatronBackend()

    def real_backend(self, site: SiteConfig, runner: Runner | None = None) -> TrainBackend:
        return MegatronBackend(site) if runner is None else MegatronBackend(site, runner)


MEGATRON = MegatronSide()
