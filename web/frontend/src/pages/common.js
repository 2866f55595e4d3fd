// Pieces several pages share: reloading on live changes, badges, culprit text, incident
// and action tables (with "Approve" on a dry run for operators).
import { actionButton } from "../actions.js";
import { el, dash, link, row, table, td } from "../dom.js";
import { fmtAge, fmtDuration } from "../format.js";
import { get } from "../api.js";
import { live } from "../live.js";

/** Dry-run kinds the API carries out on approval (POST /actions/{id}/approve). */
const APPROVABLE = new Set(["restart_job", "isolate_node"]);

/** A page's refresh: load again, then clear the error state, or show the error. */
export function reloader(ctx, load) {
  return async () => {
    try {
      await load();
      ctx.ok();
    } catch (err) {
      ctx.onError(err);
    }
  };
}

/**
 * Reload when the live stream says one of `topics` changed (coalesced: at most one reload
 * per `delayMs`), or when `nodeName` is among the nodes it sent. Returns {refresh, dispose}.
 */
export function refreshOn(ctx, load, { topics = [], nodeName = null, delayMs = 1000 } = {}) {
  let pending = null;
  const refresh = reloader(ctx, load);
  const later = () => {
    if (pending) return;
    pending = setTimeout(() => {
      pending = null;
      refresh();
    }, delayMs);
  };
  const offs = [
    live.on("changed", (msg) => {
      if (msg.topics.some((t) => topics.includes(t))) later();
    }),
  ];
  if (nodeName !== null) {
    offs.push(
      live.on("nodes", (msg) => {
        if (msg.data.some((n) => n.n === nodeName)) later();
      }),
    );
  }
  return {
    refresh,
    dispose() {
      for (const off of offs) off();
      clearTimeout(pending);
    },
  };
}

/**
 * What a page hands the router: its node, its refresh (`r` from refreshOn) and a dispose
 * that stops the reloads and the page's charts (`charts()`: the ones drawn now).
 */
export function mounted(node, r, charts = () => []) {
  return {
    node,
    refresh: r.refresh,
    dispose() {
      r.dispose();
      for (const c of charts()) c.dispose();
    },
  };
}

/**
 * What the action list says about approvals: `approved`, the ids of dry runs approved
 * already (their `approve_action` rows name `action:{id}`), and `plans`, remediation id ->
 * the `approval` row holding that remediation's plan (its steps are approved with it).
 */
export function approvals(actions) {
  const approved = new Set();
  const plans = new Map();
  for (const a of actions) {
    if (a.kind === "approve_action" && a.status === "succeeded" && a.target.startsWith("action:")) {
      approved.add(Number(a.target.slice(7)));
    }
    if (a.kind === "approval" && a.params && a.params.remediation) plans.set(a.params.remediation, a.id);
  }
  return { approved, plans };
}

/** Recent actions on one target (node or job), and what approvals say about them. */
export async function actionsFor(target) {
  const all = await get("/actions?limit=500");
  return { data: all.data.filter((a) => a.target === target), ...approvals(all.data) };
}

/** What approving a dry run does, for its confirmation. */
function approvalEffect(a) {
  const would = a.outcome ? ` The policy recorded: "${a.outcome}".` : "";
  if (a.kind === "approval") {
    const steps = (a.params && a.params.planned_steps) || [];
    return `Run the plan job ${a.target}'s own policy held back (#${a.id}) now, for real: ${steps.join(", ") || "no steps"}. It runs once; the approval is logged with your name.`;
  }
  if (a.kind === "restart_job") {
    return `Carry out dry run #${a.id} now: restart job ${a.target} through the actuator, from its newest committed checkpoint, without isolated nodes. Progress since that checkpoint is lost.${would}`;
  }
  return `Carry out dry run #${a.id} now: isolate ${a.target} (cordon it so no new work lands there).${would}`;
}

export function badge(value) {
  const text = value === null || value === undefined || value === "" ? "-" : String(value);
  return el("span", `badge b-${text.replace(/[^a-z_]/g, "")}`, text);
}

export function culprit(inc) {
  const parts = [];
  if (inc.node) parts.push(inc.node);
  if (inc.gpu_index !== null && inc.gpu_index !== undefined) parts.push(`GPU ${inc.gpu_index}`);
  if (inc.ranks && inc.ranks.length) {
    const shown = inc.ranks.slice(0, 8).join(",");
    parts.push(`rank${inc.ranks.length > 1 ? "s" : ""} ${shown}${inc.ranks.length > 8 ? "…" : ""}`);
  }
  if (inc.job) parts.push(`job ${inc.job}`);
  return parts.join(" · ");
}

export function incidentTable(list, emptyText = "no incidents") {
  const rows = list.map((inc) =>
    row(
      [
        td("num", link(`#/incident/${inc.id}`, String(inc.id))),
        inc.kind,
        td(null, badge(inc.severity)),
        td(null, badge(inc.state)),
        culprit(inc),
        td("summary", dash(inc.summary), inc.count > 1 ? el("span", "muted", ` ×${inc.count}`) : null),
        td("num", fmtAge(inc.opened_unix_s)),
      ],
      { "data-incident": String(inc.id) },
    ),
  );
  return table(["ID", "Kind", "Severity", "State", "Culprit", "Summary", "Age"], rows, emptyText, "incidents");
}

/**
 * The actions table. For an operator, a dry run the API can carry out gets an "Approve"
 * button: a job policy's held-back plan (`approval`), or a `restart_job`/`isolate_node`
 * step the controller's dry-run policy recorded (`approved`, `plans`: from approvals();
 * `done`: called after one).
 */
export function actionTable(list, emptyText = "no actions", { approved = new Set(), plans = new Map(), done = null } = {}) {
  const rows = list.map((a) => {
    const status = td(null, badge(a.status));
    const plan = a.params && a.params.remediation && a.kind !== "approval" ? plans.get(a.params.remediation) : undefined;
    const approvable = a.kind === "approval" ? Boolean(a.params && a.params.awaiting_approval) : APPROVABLE.has(a.kind);
    if (a.status === "dry_run" && approvable) {
      if (approved.has(a.id)) {
        status.append(" ", el("span", "muted approved", "approved"));
      } else if (plan !== undefined) {
        status.append(" ", el("span", "muted", `part of plan #${plan}`));
      } else {
        const button = actionButton({
          id: "approve",
          label: "Approve",
          title: "Approve dry run",
          effect: approvalEffect(a),
          path: `/actions/${a.id}/approve`,
          done: () => done && done(),
        });
        if (button) status.append(" ", button);
      }
    }
    return row(
      [
        td("num", String(a.id)),
        a.kind,
        td("name", dash(a.target)),
        a.trigger,
        status,
        td("summary", dash(a.outcome)),
        td("num", a.duration_s === null ? "running" : fmtDuration(a.duration_s)),
        td("num", fmtAge(a.created_unix_s)),
      ],
      { "data-action-id": String(a.id), "data-status": a.status },
    );
  });
  return table(["ID", "Kind", "Target", "Trigger", "Status", "Outcome", "Took", "Age"], rows, emptyText, "actions");
}

/** Key/value evidence as text (nested values as compact JSON text, never markup). */
export function evidenceList(evidence) {
  const dl = el("dl", "evidence");
  for (const [k, v] of Object.entries(evidence || {})) {
    dl.append(el("dt", null, k), el("dd", null, typeof v === "object" ? JSON.stringify(v) : String(v)));
  }
  return dl;
}
