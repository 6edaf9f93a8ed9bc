"""A conversion's progress: by the bytes of its input, in the CLI's bar and in the step's Prefect progress artifact."""

from __future__ import annotations

import logging

import pytest

from crossalign.checkpoint.convert import convert_checkpoint
from crossalign.config import load_config
from crossalign.models.layout import random_mindformers_state
from crossalign.sides.mindformers.checkpoint import default_common, write_mindformers_checkpoint
from crossalign.tasks.convert import ConversionProgress

MOE = load_config("qwen35_moe_tiny").model


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("ms")
    write_mindformers_checkpoint(root, 4, random_mindformers_state(MOE, seed=3), None, default_common(4, 4))
    return root


def test_both_directions_report_the_bytes_of_their_input_up_to_all_of_it(tmp_path, source):
    for direction, inp, out, layout in (("ms2mg", source, tmp_path / "mg", dict(tp=2, ep=2)),
                                        ("mg2ms", tmp_path / "mg", tmp_path / "ms", {})):
        calls = []
        report = convert_checkpoint(MOE, direction, inp, out, progress=lambda *call: calls.append(call), **layout)
        done = [call[0] for call in calls]
        assert done == sorted(done) and len(set(done)) > 10, direction
        assert {call[1] for call in calls} == {report.bytes_in} and done[-1] == report.bytes_in, direction


def test_the_step_reports_at_most_once_a_second_with_the_time_left():
    reports = []
    progress = ConversionProgress(lambda done, total, metrics: reports.append((done, total, metrics)))
    for done in range(0, 1001, 10):
        progress(done, 1000, "key")
    assert reports[-1][0] == 1000 and reports[-1][2]["seconds_left"] == 0  # the last always comes
    assert len(reports) <= 3  # the loop takes well under a second: the first, maybe one more, the last
    every = []
    progress = ConversionProgress(lambda done, total, metrics: every.append(metrics), interval_s=0)
    progress(250, 1000, "key")
    assert every[0]["GB_read"] == 250e-9 and every[0]["seconds_left"] >= 0


@pytest.mark.slow  # the session's Prefect server takes 10-45 s to start on 2 busy cores
def test_a_conversion_in_a_flow_keeps_a_progress_artifact_with_the_time_left(prefect_client_settings, tmp_path,
                                                                            source):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    from crossalign.flows.reporting import StepReporter

    @flow
    def convert_step() -> None:
        reporter = StepReporter("convert", "run-1", logging.getLogger("test"))
        convert_checkpoint(MOE, "ms2mg", source, tmp_path / "mg", ep=2,
                           progress=ConversionProgress(reporter.on_step, interval_s=0))

    state = convert_step(return_state=True)
    ours = ArtifactFilter(key=ArtifactFilterKey(any_=["convert-progress"]),  # the server is shared by the file's tests
                          flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]))
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ours)
    assert len(found) == 1 and found[0].type == "progress" and float(found[0].data) == 100.0
    assert found[0].description.startswith("run run-1: convert, ") and found[0].description.endswith(" left")
