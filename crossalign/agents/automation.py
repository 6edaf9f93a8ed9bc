"""Install the automations a self-hosted Prefect server needs for crossalign.

The definitions are YAML files beside this module (``automations/``), in the shape of Prefect's
own automation model, with ``${NAME}`` placeholders for what only the server knows (the nightly
deployment's id, the webhook block's id). Installing is idempotent: an automation of the same
name is replaced.
"""

from __future__ import annotations

from pathlib import Path
from string import Template
from typing import Any

import yaml

DEFINITIONS = Path(__file__).resolve().parent / "automations"
ZOMBIE = "crash-zombie-flow-runs.yaml"
NIGHTLY = "nightly-failed.yaml"
WEBHOOK_BLOCK = "crossalign-nightly-webhook"
NIGHTLY_DEPLOYMENT = "nightly/nightly"
# three heartbeats of crossalign's flows (PREFECT_FLOWS_HEARTBEAT_FREQUENCY=30 in prefect.yaml and the CLI,
# the least Prefect accepts): a tiny run learns within two minutes that a machine died
DEFAULT_ZOMBIE_AFTER_S = 90


class AutomationError(ValueError):
    """An automation that cannot be installed as asked (missing deployment, bad definition file)."""


def load_definition(name: str, values: dict[str, Any]) -> dict[str, Any]:
    """A definition file with its ``${NAME}`` placeholders filled in; every placeholder must be given."""
    path = DEFINITIONS / name
    try:
        text = Template(path.read_text()).substitute({k: str(v) for k, v in values.items()})
    except KeyError as exc:
        raise AutomationError(f"{path}: placeholder ${{{exc.args[0]}}} has no value") from None
    data = yaml.safe_load(text)
    if not isinstance(data, dict) or "name" not in data:
        raise AutomationError(f"{path}: expected a mapping with a name, a trigger and actions")
    return data


def _replace(client, definition: dict[str, Any]) -> str:
    """Create the automation, first deleting any of the same name; returns its id."""
    # Prefect loads in seconds: imported only where its API is called
    from prefect.automations import AutomationCore

    automation = AutomationCore.model_validate(definition)
    for existing in client.read_automations_by_name(automation.name):
        client.delete_automation(existing.id)
    return str(client.create_automation(automation))


def save_webhook(url: str) -> str:
    """Save the webhook notification block the nightly automation calls; returns its id."""
    # Prefect loads in seconds: imported only where its API is called
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    block = CustomWebhookNotificationBlock(name=WEBHOOK_BLOCK, url=url, method="POST",
                                           json_data={"text": "{{subject}}\n{{body}}"})
    return str(block.save(WEBHOOK_BLOCK, overwrite=True))


def install_automations(webhook_url: str | None = None,
                        zombie_after_s: int = DEFAULT_ZOMBIE_AFTER_S) -> dict[str, str]:
    """Install the zombie-run automation and, given a webhook URL, the nightly failure alert.

    Returns {automation name: id}. The nightly alert needs the nightly deployment (``crossalign deploy``).
    """
    # Prefect loads in seconds: imported only where its API is called
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    installed = {}
    with get_client(sync_client=True) as client:
        zombie = load_definition(ZOMBIE, {"ZOMBIE_AFTER_S": zombie_after_s})
        installed[zombie["name"]] = _replace(client, zombie)
        if webhook_url:
            try:
                deployment = client.read_deployment_by_name(NIGHTLY_DEPLOYMENT)
            except ObjectNotFound:
                raise AutomationError(f"no deployment {NIGHTLY_DEPLOYMENT} on the server: run `crossalign deploy` "
                                      "first, then install the automations") from None
            nightly = load_definition(NIGHTLY, {"NIGHTLY_DEPLOYMENT_ID": deployment.id,
                                                "WEBHOOK_BLOCK_ID": save_webhook(webhook_url)})
            installed[nightly["name"]] = _replace(client, nightly)
    return installed
