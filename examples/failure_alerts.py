"""A Prefect automation that sends a notice whenever a rollflow training fails, however it
was started (CLI, deployment, schedule):

    export PREFECT_API_URL=http://127.0.0.1:4200/api
    python -m examples.failure_alerts --slack https://hooks.slack.com/services/...
    python -m examples.failure_alerts --webhook https://example.com/rollflow-alerts

Trigger: the event `rollflow.training.failed`, which the train flow's on_failure hook
(flows/bookkeeping/failure_notice.py) emits with its summary: which run, step and task failed, the cause
in one line, and how to resume (the same text is logged to the flow run and kept as its
artifact `<run>-failure`). Action: a notification through a block saved as
`rollflow-failure-alerts` (Slack, or a webhook that receives JSON `{"subject", "body"}`)
with that summary and a link to the flow run. Running it again replaces the automation
(same name) instead of adding one. A driver killed outright runs no hook: its flow run
ends Crashed, which Prefect's own event `prefect.flow-run.Crashed` reports.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from uuid import UUID

from prefect.automations import Automation, EventTrigger, Posture, SendNotification
from prefect.blocks.notifications import CustomWebhookNotificationBlock, SlackWebhook

NAME = "rollflow-training-failed"
BLOCK = "rollflow-failure-alerts"
SUBJECT = "rollflow: training {{ event.resource.name }} failed"
BODY = "{{ event.payload.summary }}\nFlow run: {{ flow_run|ui_url }}"


async def save_block(
    slack: str | None, webhook: str | None, allow_private_urls: bool = False
) -> UUID:
    """The notification block the automation sends through."""
    block: SlackWebhook | CustomWebhookNotificationBlock
    if slack:
        block = SlackWebhook(url=slack, allow_private_urls=allow_private_urls)
    elif webhook:
        block = CustomWebhookNotificationBlock(
            name=BLOCK, url=webhook, allow_private_urls=allow_private_urls,
            json_data={"subject": "{{subject}}", "body": "{{body}}"},
        )
    else:
        raise ValueError("give --slack URL or --webhook URL")
    return await block.asave(BLOCK, overwrite=True)


def failed_training_automation(block_id: UUID) -> Automation:
    return Automation(
        name=NAME,
        description="A rollflow training (flow `train`) failed: notify.",
        trigger=EventTrigger(
            expect={"rollflow.training.failed"},
            match={"prefect.resource.id": "rollflow.run.*"},
            posture=Posture.Reactive, threshold=1,
        ),
        actions=[SendNotification(block_document_id=block_id, subject=SUBJECT, body=BODY)],
    )


async def acreate(slack: str | None = None, webhook: str | None = None,
                  allow_private_urls: bool = False) -> UUID:
    """Save the block and (re)create the automation; returns the automation's id."""
    block_id = await save_block(slack, webhook, allow_private_urls)
    with contextlib.suppress(ValueError):  # ValueError: none yet
        await (await Automation.aread(name=NAME)).adelete()
    created = await failed_training_automation(block_id).acreate()
    assert created.id is not None
    return created.id


def create(slack: str | None = None, webhook: str | None = None,
           allow_private_urls: bool = False) -> UUID:
    return asyncio.run(acreate(slack, webhook, allow_private_urls))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--slack", help="Slack incoming-webhook URL")
    where.add_argument("--webhook", help="URL that receives a JSON POST {subject, body}")
    parser.add_argument("--allow-private-urls", action="store_true",
                        help="allow a webhook on this machine or the local network")
    args = parser.parse_args()
    print(f"automation {NAME}: {create(args.slack, args.webhook, args.allow_private_urls)}")


if __name__ == "__main__":
    main()
