"""``webhook``: hand the remediation to the site's own flow (ticketing, repair) over HTTP.

POSTs event ``remediation`` with the incident, the job, the culprit node and the
remediation's steps to ``remediation_webhook_url`` through
:class:`~controller.services.webhook.Webhook`: signed with HMAC-SHA256 over
``<timestamp>.<body>``, each attempt bounded by a timeout, connection errors, timeouts, 429
and 5xx retried with exponential backoff under one ``X-Trainguard-Delivery`` id. The
receiver's answer (its JSON, e.g. a ticket number) goes into the action's outcome. A failed
delivery is recorded as ``failed`` and the steps after it still run: a site's ticketing
being down must not keep a node in service.
"""

from __future__ import annotations

import json

from controller.logic.remediation.rules import Rule, Step
from controller.services.remediation.records import Remediation
from controller.services.remediation.steps.base import StepContext, StepResult
from controller.state import IncidentState
from trainguard.urls import shown_url

EVENT = "remediation"


class WebhookStep:
    step = Step.WEBHOOK
    action_kind = "webhook"

    async def run(
        self, ctx: StepContext, rem: Remediation, incident: IncidentState | None, rule: Rule | None
    ) -> StepResult:
        record = ctx.recorder.record
        hook = ctx.webhook
        target = rem.job or rem.node or ""
        if hook is None:
            outcome = "no remediation_webhook_url configured: nothing sent"
            await record(incident, rem, self.action_kind, target, {}, "skipped", outcome)
            return True, outcome
        # The row is every viewer's to read: the URL without the credentials it may carry.
        url = shown_url(hook.url)
        params = {"url": url, "event": EVENT}
        if rem.dry_run:
            outcome = f"would POST {EVENT} to {url}"
            await record(incident, rem, self.action_kind, target, params, "dry_run", outcome)
            return True, outcome
        payload = {
            "incident": None
            if incident is None
            else {
                "id": incident.id,
                "kind": incident.kind,
                "severity": incident.severity,
                "summary": incident.summary,
                "node": incident.node,
                "job": incident.job,
                "opened_unix_s": incident.opened_unix_s,
                "evidence": incident.evidence.as_json(),
            },
            "remediation": {
                "id": rem.id,
                "job": rem.job,
                "node": rem.node,
                "steps": rem.steps,
                "approved_by": rem.approved_by,
            },
            "actuator": ctx.actuator.name if ctx.actuator is not None else None,
        }
        action = await record(incident, rem, self.action_kind, target, params, "pending", "")
        result = await hook.send(EVENT, payload)
        tried = f"{result.attempts} attempt(s), delivery {result.delivery}"
        if result.ok:
            answer = json.dumps(result.response, sort_keys=True)[:500] if result.response else ""
            outcome = f"{url} answered HTTP {result.status} ({tried})" + (
                f": {answer}" if answer else ""
            )
        else:
            outcome = f"{url} failed after {tried}: {result.error}"
        await ctx.recorder.finish(action, "succeeded" if result.ok else "failed", outcome)
        return result.ok, outcome


__all__ = ["EVENT", "WebhookStep"]
