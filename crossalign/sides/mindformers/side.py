"""The MindFormers side as the shared code sees it (``crossalign.sides.protocol.Side``)."""

from __future__ import annotations

from pathlib import Path

from crossalign.config import AlignmentConfig, TrainingConfig
from crossalign.data.settings import SampleOrderSettings
from crossalign.sides.launch import Runner
from crossalign.sides.mindformers.backend import MindFormersBackend
from crossalign.sides.mindformers.log_checks import parse_step_line
from crossalign.sides.mindformers.yaml import mindformers_yaml, sample_order
from crossalign.sides.mindformers.yaml_reader import load_mindformers_yaml_file, read_mindformers_yaml, sample_order_from_yaml
from crossalign.sides.protocol import ProgressLine, TrainBackend
from crossalign.sides.readings import PREFLIGHT_DATA_PREFIX, Reading
from crossalign.site import SiteConfig


class MindFormersSide:
    name = "mindformers"
    framework = "MindFormers"
    pool = "npu"
    log_formats = ("mindformers-pynative", "mindformers-graph")

    def sample_order(self, training: TrainingConfig, num_samples: int | None = None) -> SampleOrderSettings:
        return sample_order(training, num_samples)

    def launch_sample_order(self, path: Path) -> SampleOrderSettings:
        return sample_order_from_yaml(load_mindformers_yaml_file(path))

    def generated_readings(self, config: AlignmentConfig) -> dict[str, Reading]:
        document = mindformers_yaml(config, mode="align", data_prefix=PREFLIGHT_DATA_PREFIX,
                                    load_dir=Path("MINDFORMERS_CHECKPOINT"))
        return read_mindformers_yaml(document, config.parallel.mindformers.world_size)

    def progress(self, line: str) -> ProgressLine | None:
        return parse_step_line(line)

    def embedded_backend(self) -> TrainBackend:
        # MindSpore is imported only where the embedded side trains (start-up time of the CLI)
        from crossalign.sides.mindformers.embedded.trainer import LocalMindFormersBackend

        return LocalMindFormersBackend()

    def real_backend(self, site: SiteConfig, runner: Runner | None = None) -> TrainBackend:
        return MindFormersBackend(site) if runner is None else MindFormersBackend(site, runner)


MINDFORMERS = MindFormersSide()
