"""The nightly regression flow: align dense and MoE, compare with the previous night, keep a history.

It aligns the configs it is given, else the site's ``nightly.configs`` (the tiny configs without one: the
full-size ones are a distributed site's to name). Each model runs as an alignment subflow with the run id
``nightly-<date>-<model>`` (so a re-triggered night resumes instead of starting over). The history lives in
``<store>/nightly/history.json`` with a trend plot ``trend.png`` beside it, shown in the UI as an
image where the site names a report server. The flow run is named ``nightly-<date>``; it ends Failed
when any model fails or regresses, which is what the nightly failure automation alerts on (its
message, which the alert carries, names the problems and links the trend plot), and Completed
with a one-line message otherwise.
"""

from __future__ import annotations

from datetime import date, datetime, timezone

from prefect import flow, get_run_logger
from prefect.artifacts import create_image_artifact, create_markdown_artifact, create_table_artifact
from prefect.states import Completed, State

from crossalign.config import ConfigError
from crossalign.flows.alignment import alignment, name_flow_run
from crossalign.flows.outcome import failed, outcome_of
from crossalign.report.serve import store_url
from crossalign.request import Mode, RunRequest, as_typed, form_error, handing_over
from crossalign.site import load_site
from crossalign.store import StoreError
from crossalign.tasks.regression import (
    DEFAULT_FLOOR,
    DEFAULT_TOLERANCE,
    find_regressions,
    history_entry,
    history_rows,
    load_history,
    plot_trend,
    previous_entry,
    record,
)


@flow(name="nightly")
def nightly(configs: list[str] | None = None, overrides: list[str] | None = None,
            store: str | None = None, mode: Mode = "distributed", night: str | None = None,
            tolerance: float = DEFAULT_TOLERANCE, floor: float = DEFAULT_FLOOR, retries: int = 2,
            retry_delay_s: float = 30.0) -> State:
    """Align each config and fail on a regression against the previous night.

    Args:
        configs: Shipped configs (qwen35_dense, qwen35_dense_tiny, qwen35_moe, qwen35_moe_tiny) or
            config YAML paths to align, one per item. Empty: the site config's nightly.configs
            (qwen35_dense_tiny and qwen35_moe_tiny without one).
        overrides: Config changes for every config, one KEY=VALUE per item (training.train_iters=10).
        store: The run store every agent mounts. Empty: the site config's store.
        mode: distributed: each step a flow run on its pool's workers; embedded: local processes.
        night: The night (YYYY-MM-DD) that names the runs and the history entries. Empty: today in UTC.
        tolerance: A relative error more than this many times the night before's is a regression.
        floor: Relative errors at or below this (a fraction, 1e-4 = 0.01%) never count as a regression.
        retries: Attempts per step after an infrastructure failure.
        retry_delay_s: Seconds before the first retry of a step, tripled for each further one.
    """
    logger = get_run_logger()
    configs = as_typed(configs) or list(load_site().nightly.configs)
    today = date.fromisoformat(night) if night else datetime.now(timezone.utc).date()
    name_flow_run(f"nightly-{today:%Y%m%d}")
    try:  # a bad config or override fails the night before any run starts
        runs = [RunRequest(config=config, overrides=overrides, store=store, mode=mode, retries=retries,
                           retry_delay_s=retry_delay_s).resolve() for config in configs]
    except (ConfigError, StoreError) as exc:
        return failed(form_error(exc), cause=exc)
    runs = [resolved.named(f"nightly-{today:%Y%m%d}-{resolved.config.model.name}") for resolved in runs]
    history_path = runs[0].store.root / "nightly" / "history.json"
    history = load_history(history_path)

    entries, problems = [], []
    for resolved in runs:
        model = resolved.config.model.name
        with handing_over(resolved):
            state = alignment(**resolved.request.form(), return_state=True)
        summary = (outcome_of(state)[0] or {}).get("summary")  # the verdict's, from the run's own outcome
        error = None if state.is_completed() or summary is not None else state.message or state.name
        entry = history_entry(model, resolved.run_id, today, summary, error)
        found = find_regressions(previous_entry(history, model, today.isoformat()), entry,
                                 tolerance=tolerance, floor=floor)
        if entry["verdict"] not in (None, "pass"):
            found.insert(0, f"{model}: verdict {entry['verdict']}")
        logger.info(f"{model}: verdict {entry['verdict']}; " + ("; ".join(found) if found else "no regression"))
        entries.append(entry)
        problems += found

    history = record(history_path, entries)
    trend = plot_trend(history, history_path.with_name("trend.png"))
    trend_url = store_url(load_site().report_url, runs[0].store.root, trend)
    create_table_artifact(history_rows(history), key="nightly-history",
                          description=f"nightly alignment history ({history_path})")
    create_markdown_artifact(
        "# nightly " + today.isoformat() + "\n\n"
        + ("\n".join(f"- {p}" for p in problems) if problems else "no regression") + "\n\n"
        + (f"![trend]({trend_url})\n" if trend_url else f"trend plot: `{trend}`\n"),
        key="nightly-report", description="regressions against the previous night")
    if trend_url:
        create_image_artifact(image_url=trend_url, key="nightly-trend", description="relative errors, night by night")
    outcome = {"night": today.isoformat(), "entries": entries, "history": str(history_path), "trend": str(trend)}
    if problems:
        return failed(f"nightly {today}: " + "; ".join(problems) + f" (trend: {trend_url or trend})", outcome)
    verdicts = ", ".join(f"{entry['model']} {entry['verdict']}" for entry in entries)
    return Completed(message=f"nightly {today}: {verdicts}; no regression (trend: {trend_url or trend})",
                     data=outcome)
