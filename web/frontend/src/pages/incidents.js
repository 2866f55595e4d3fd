// Incidents: a timeline and a table; one incident with its evidence drawn (the culprit's
// step times against its peers') and the actions taken; resolve for operators.
import { get, enc } from "../api.js";
import { actionBar, actionButton } from "../actions.js";
import { timeChart } from "../charts.js";
import { el, fill, attrs, dash, link, section, notReported } from "../dom.js";
import { fmtTime, nowS } from "../format.js";
import { actionTable, approvals, badge, culprit, evidenceList, incidentTable, mounted, refreshOn, reloader } from "./common.js";

function timeline(list) {
  const box = el("figure", "timeline");
  box.append(el("figcaption", null, "Timeline (bar: first to last seen; open ones run to now)"));
  if (!list.length) return box;
  const end = nowS();
  const start = Math.min(...list.map((i) => i.opened_unix_s));
  const span = Math.max(60, end - start);
  const lanes = el("ol", "lanes");
  for (const inc of list.slice(0, 40)) {
    const stop = inc.resolved_unix_s || (inc.state === "open" ? end : inc.updated_unix_s);
    const bar = link(`#/incident/${inc.id}`, `#${inc.id} ${inc.kind}`);
    bar.className = `bar sev-${inc.severity} ${inc.state}`;
    bar.style.marginLeft = `${((inc.opened_unix_s - start) / span) * 100}%`;
    bar.style.width = `${Math.max(0.8, ((stop - inc.opened_unix_s) / span) * 100)}%`;
    attrs(bar, { "aria-label": `incident ${inc.id} ${inc.kind} ${inc.severity}, ${inc.state}, opened ${fmtTime(inc.opened_unix_s)}` });
    lanes.append(el("li", null, bar));
  }
  box.append(lanes, el("div", "axis", el("span", null, fmtTime(start)), el("span", null, fmtTime(end))));
  return box;
}

/** The Flight Recorder's divergences: per collective, which ranks entered (✓) and which
 * never did (✕), with the verdict and whether it agrees with trainguard's culprits. */
function flightRecorder(fr) {
  const box = el("figure", "flight-recorder");
  box.append(el("figcaption", null, "Flight Recorder divergence"));
  box.append(el("p", null, String(fr.verdict || "")));
  if (fr.agrees_with_trainguard === false) box.append(el("p", "marked", "Disagrees with trainguard's culprits."));
  for (const d of Array.isArray(fr.divergences) ? fr.divergences : []) {
    const entered = new Set(d.entered || []);
    const ranks = [...new Set([...(d.entered || []), ...(d.missing || [])])].sort((a, b) => a - b);
    const cells = el("ol", "fr-ranks");
    attrs(cells, { "aria-label": `${d.op} seq ${d.seq}: entered ${[...entered].join(",")}; never entered ${(d.missing || []).join(",")}` });
    for (const r of ranks.slice(0, 512)) {
      const ok = entered.has(r);
      const cell = el("li", ok ? "fr-in" : "fr-out", ok ? "✓" : "✕");
      cell.title = `rank ${r}: ${ok ? "entered" : "never entered"}`;
      cells.append(cell);
    }
    box.append(el("p", "fr-op", `${d.op} seq ${d.seq} on group ${d.group}${d.completed === false ? " (not completed)" : ""}`), cells);
  }
  const rest = { ...fr };
  delete rest.divergences;
  delete rest.verdict;
  box.append(evidenceList(rest));
  return box;
}

export async function incidentsPage(ctx) {
  const state = ctx.params.get("state") || "";
  const root = el("div", "page incidents");
  async function load() {
    const list = await get(`/incidents?limit=200${state ? `&state=${enc(state)}` : ""}`);
    if (!ctx.isCurrent()) return;
    const tabs = el(
      "nav",
      "tabs",
      ...[["", "all"], ["open", "open"], ["resolved", "resolved"]].map(([v, label]) => {
        const a = link(v ? `#/incidents?state=${v}` : "#/incidents", label);
        if (v === state) a.setAttribute("aria-current", "page");
        return a;
      }),
    );
    attrs(tabs, { "aria-label": "Incident state" });
    fill(root, 
      el("h2", null, `Incidents (${list.count})`),
      tabs,
      timeline(list.data),
      incidentTable(list.data, state === "open" ? "no open incidents" : "no incidents"),
    );
  }
  await load();
  const r = refreshOn(ctx, load, { topics: ["incidents"], delayMs: 800 });
  return mounted(root, r);
}

export async function incidentPage(ctx) {
  const id = Number(ctx.args[0]);
  const root = el("div", "page incident");
  let charts = [];
  async function load() {
    const inc = await get(`/incidents/${id}`);
    const actions = await get("/actions?limit=500");
    let steps = null;
    if (inc.job) steps = await get(`/jobs/${enc(inc.job)}/steps?last=200`, { notFoundIsNull: true }).catch(() => null);
    if (!ctx.isCurrent()) return;
    for (const c of charts) c.dispose();
    charts = [];
    const acks = actions.data.filter((a) => a.kind === "ack_incident" && a.target === `incident:${inc.id}`);
    const related = actions.data.filter(
      (a) =>
        a.trigger === `incident:${inc.id}` ||
        a.target === `incident:${inc.id}` ||
        (a.params && a.params.incident === inc.id) ||
        ((a.target === inc.node || a.target === inc.job) && a.created_unix_s >= inc.opened_unix_s - 5),
    );
    const picture = el("div", "evidence-picture");
    if (steps && steps.ranks.length && inc.ranks.length) {
      const culprits = new Set(inc.ranks);
      const peers = steps.ranks.filter((r) => !culprits.has(r.rank));
      const peerMedian = steps.steps.map((_, i) => {
        const v = peers.map((r) => r.step_time_s[i]).filter((x) => typeof x === "number").sort((a, b) => a - b);
        return v.length ? v[Math.floor(v.length / 2)] : null;
      });
      const series = [{ label: "peers (median)", values: peerMedian, width: 2 }];
      for (const r of steps.ranks.filter((x) => culprits.has(x.rank)).slice(0, 6)) {
        series.push({ label: `rank ${r.rank} (culprit)`, values: r.step_time_s });
      }
      const chart = timeChart({
        title: "Culprit's step time against its peers'",
        unit: "s",
        x: steps.end_unix_s,
        series,
        marks: [{ t: inc.opened_unix_s, label: `opened ${fmtTime(inc.opened_unix_s)}`, kind: "incident" }],
      });
      charts.push(chart);
      picture.append(chart.node);
    } else {
      picture.append(notReported(inc.job ? "step times around this incident (not kept any more, or no ranks named)" : "step-time evidence (not a job incident)"));
    }
    const fr = inc.evidence && inc.evidence.flight_recorder;
    if (fr && typeof fr === "object") picture.append(flightRecorder(fr));
    const bar = actionBar(
      inc.state === "open" && !acks.length
        ? actionButton({
            id: "ack",
            label: "Acknowledge",
            title: "Acknowledge incident",
            effect: `Record that you are on incident #${inc.id} (${inc.kind}): it stays open, and the acknowledgement is logged with your name.`,
            path: `/incidents/${inc.id}/ack`,
            done: () => refresh(),
          })
        : null,
      inc.state === "open"
        ? actionButton({
            id: "resolve",
            label: "Resolve",
            title: "Resolve incident",
            effect: `Mark incident #${inc.id} (${inc.kind}) resolved: it leaves the open list; a new occurrence opens a new incident.`,
            path: `/incidents/${inc.id}/resolve`,
            done: () => refresh(),
          })
        : null,
    );
    fill(root, 
      el("h2", null, link("#/incidents", "Incidents"), " / ", `#${inc.id} ${inc.kind} `, badge(inc.severity), " ", badge(inc.state)),
      bar,
      el("p", "summary", inc.summary),
      // Set only on a stored row whose evidence does not fit its kind's model (the API
      // serves it untyped, as stored, rather than hide the incident).
      inc.evidence_error ? el("p", "marked evidence-error", `Evidence does not fit the ${inc.kind} model (${inc.evidence_error}); shown as stored.`) : null,
      el(
        "dl",
        "facts",
        el("dt", null, "Culprit"), el("dd", null, dash(culprit(inc))),
        el("dt", null, "Opened"), el("dd", null, fmtTime(inc.opened_unix_s)),
        el("dt", null, "Last seen"), el("dd", null, `${fmtTime(inc.updated_unix_s)} (×${inc.count})`),
        el("dt", null, "Resolved"), el("dd", null, inc.resolved_unix_s ? fmtTime(inc.resolved_unix_s) : "-"),
        el("dt", null, "Acknowledged"),
        el("dd", "acked", acks.length ? acks.map((a) => `${a.outcome} at ${fmtTime(a.created_unix_s)}`).join("; ") : "no"),
        inc.node ? el("dt", null, "Node") : null,
        inc.node ? el("dd", null, link(`#/node/${enc(inc.node)}`, inc.node)) : null,
        inc.job ? el("dt", null, "Job") : null,
        inc.job ? el("dd", null, link(`#/job/${enc(inc.job)}`, inc.job)) : null,
      ),
      section("Evidence", picture, evidenceList(inc.evidence)),
      section(
        "Actions taken",
        actionTable(related, "no action recorded for this incident", { ...approvals(actions.data), done: () => refresh() }),
      ),
    );
  }
  const refresh = reloader(ctx, load);
  await load();
  const r = refreshOn(ctx, load, { topics: ["incidents", "actions"], delayMs: 800 });
  return mounted(root, r, () => charts);
}
