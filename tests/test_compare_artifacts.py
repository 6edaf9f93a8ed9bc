"""Prefect artifacts of a comparison: created inside a real flow run, nothing outside one."""

from __future__ import annotations

from pathlib import Path

import pytest

from crossalign.report.artifacts import LINK_KEY, METRICS_KEY, REPORT_KEY, publish_artifacts
from crossalign.report.compare import CompareOptions, compare_logs

FIXTURES = Path(__file__).parent / "fixtures" / "logs"


@pytest.fixture(scope="session")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def _artifacts() -> dict[str, object]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    keys = ArtifactFilterKey(any_=[REPORT_KEY, METRICS_KEY, LINK_KEY])
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=keys))
    return {a.key: a for a in found}


@pytest.mark.slow  # the temporary Prefect server takes 10-45 s to start on 2 busy cores
def test_publish_inside_a_flow_and_not_outside(prefect_server, tmp_path):
    from prefect import flow
    from prefect.context import get_run_context

    summary = compare_logs(FIXTURES / "mindformers_pynative.log", FIXTURES / "megatron_0.16_noise.log",
                           tmp_path / "out", CompareOptions(plot=False))
    publish_artifacts(summary, tmp_path / "out")  # outside a run: a no-op, and no error
    assert _artifacts() == {}

    @flow
    def compare_step() -> str:
        publish_artifacts(summary, tmp_path / "out")
        return str(get_run_context().flow_run.id)

    flow_run_id = compare_step()
    artifacts = _artifacts()
    assert set(artifacts) == {REPORT_KEY, METRICS_KEY, LINK_KEY}
    assert all(str(a.flow_run_id) == flow_run_id for a in artifacts.values())
    assert artifacts[REPORT_KEY].type == "markdown" and summary.verdict.upper() in artifacts[REPORT_KEY].data
    assert artifacts[METRICS_KEY].type == "table"
    assert "lm_loss" in str(artifacts[METRICS_KEY].data)
    assert (tmp_path / "out" / "report.html").resolve().as_uri() in artifacts[LINK_KEY].data
