// Pieces several pages share: badges, culprit text, incident and action tables.
import { el, dash, link, row, table, td } from "../dom.js";
import { fmtAge, fmtDuration } from "../format.js";
import { get } from "../api.js";

/** Recent actions on one target (node or job); the list route has no target filter. */
export async function actionsFor(target) {
  const all = await get("/actions?limit=500");
  return { data: all.data.filter((a) => a.target === target), count: 0 };
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

export function actionTable(list, emptyText = "no actions") {
  const rows = list.map((a) => {
    const status = td(null, badge(a.status));
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
      { "data-action-id": String(a.id) },
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
