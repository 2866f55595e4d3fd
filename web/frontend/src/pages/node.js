// One node: its GPUs now, their last hour as charts (downsampled history from the
// controller's database, or from Prometheus when the controller is configured with one),
// its incidents and actions; isolate/return and approving dry runs for operators.
import { get, enc } from "../api.js";
import { actionBar, actionButton } from "../actions.js";
import { timeChart } from "../charts.js";
import { el, fill, dash, link, row, section, table, td, notReported } from "../dom.js";
import { fmtAge, fmtW } from "../format.js";
import { nodeState, STATE_GLYPH } from "../store.js";
import { actionTable, actionsFor, badge, incidentTable, mounted, refreshOn, reloader } from "./common.js";

const WINDOW_S = 3600;

const METRICS = [
  ["power_w", "Power", "W"],
  ["temperature_c", "Temperature", "°C"],
  ["sm_clock_mhz", "SM clock", "MHz"],
  ["utilization_pct", "Utilization", "%"],
  ["ecc_corrected", "ECC corrected (total)", "errors"],
  ["ecc_uncorrected", "ECC uncorrected (total)", "errors"],
  ["throttle_reasons", "Throttle reasons active", "count"],
];

export async function nodePage(ctx) {
  const [name] = ctx.args;
  const root = el("div", "page node");
  let charts = [];

  async function load() {
    const [node, hist, incidents, actions] = await Promise.all([
      get(`/nodes/${enc(name)}?history_s=0`),
      get(`/nodes/${enc(name)}/history?window_s=${WINDOW_S}`),
      get(`/incidents?node=${enc(name)}&limit=50`),
      actionsFor(name),
    ]);
    if (!ctx.isCurrent()) return;
    for (const c of charts) c.dispose();
    charts = [];

    const state = nodeState({
      h: node.health,
      iso: node.isolated_reason,
      b: node.gpus_unhealthy,
      i: node.open_incidents,
      silent: false,
    });
    const head = el(
      "div",
      "node-head",
      el("h2", null, link("#/fleet", "Fleet"), " / ", el("span", "name", node.name)),
      el("span", `chip st-${state}`, el("span", "glyph", STATE_GLYPH[state] || "●"), ` ${state}`),
      node.backend === "sim" ? el("span", "chip sim-key", "simulated GPUs") : null,
    );
    const facts = el(
      "dl",
      "facts",
      el("dt", null, "Hostname"), el("dd", null, dash(node.hostname)),
      el("dt", null, "Health"), el("dd", null, `${node.health}${node.health_reason ? `: ${node.health_reason}` : ""}`),
      el("dt", null, "Isolated"), el("dd", "isolated", node.isolated_reason === null ? "no" : `yes: ${node.isolated_reason}`),
      el("dt", null, "Labels"), el("dd", "labels", labelList(node.labels)),
      el("dt", null, "Power"), el("dd", null, fmtW(node.power_w)),
      el("dt", null, "Last report"), el("dd", null, `${fmtAge(node.last_report_unix_s)} ago`),
      el("dt", null, "Agent"), el("dd", null, `${node.agent_version} (${node.backend})`),
    );
    const isolated = node.isolated_reason !== null;
    const bar = actionBar(
      isolated
        ? actionButton({
            id: "release",
            label: "Return to service",
            title: "Return node",
            effect: `Return ${node.name} to service: the scheduler may place work on it again (uncordon).`,
            path: `/nodes/${enc(node.name)}/release`,
            reason: { default: "repaired" },
            body: (reason) => ({ reason }),
            done: () => refresh(),
          })
        : actionButton({
            id: "isolate",
            label: "Isolate node",
            title: "Isolate node",
            effect: `Isolate ${node.name}: cordon it so no new work lands there; running jobs are not stopped by this.`,
            path: `/nodes/${enc(node.name)}/isolate`,
            reason: { default: "" },
            body: (reason) => ({ reason }),
            done: () => refresh(),
          }),
    );

    const gpuRows = node.gpus.map((g) => {
      const s = g.latest || {};
      return row(
        [
          td("num", String(g.index)),
          td("name", g.name),
          td(null, badge(g.health)),
          dash(g.health_reason),
          td("num", fmtW(s.power_w)),
          td("num", typeof s.temperature_c === "number" ? `${s.temperature_c} °C` : "-"),
          td("num", typeof s.sm_clock_mhz === "number" ? `${s.sm_clock_mhz} MHz` : "-"),
          td("num", typeof s.utilization_gpu_pct === "number" ? `${s.utilization_gpu_pct}%` : "-"),
        ],
        { "data-gpu": String(g.index) },
      );
    });

    const xids = [];
    for (const inc of incidents.data) {
      const ev = inc.evidence || {};
      // XidEvidence.codes (application_xid, gpu_xid); a gpu_fault's fatal XID is in its events.
      const xidEvent = Array.isArray(ev.events) && ev.events.some((e) => e && e.xid != null);
      if (ev.codes !== undefined || xidEvent || /xid/i.test(inc.summary)) xids.push(inc);
    }
    const gpus = hist.gpus || [];
    const chartBox = el("div", "charts");
    if (!gpus.length) chartBox.append(notReported("GPU history for the last hour"));
    const marks = incidents.data.map((i) => ({ t: i.opened_unix_s, label: `#${i.id} ${i.kind}: ${i.summary}`, kind: "incident" }));
    for (const [key, title, unit] of METRICS) {
      // One x axis for all GPUs: the bucket times of the first GPU (all share the buckets).
      const x = hist.t || [];
      const series = gpus.map((g) => ({ label: `GPU ${g.index}`, values: g[key] }));
      const chart = timeChart({ title, unit, x, series, marks, height: 150 });
      charts.push(chart);
      chartBox.append(chart.node);
    }
    fill(root, 
      head,
      bar,
      facts,
      section(`GPUs (${node.gpu_count})`, table(["GPU", "Model", "Health", "Reason", "Power", "Temp", "SM clock", "Util"], gpuRows, "no GPUs reported", "gpus")),
      section(
        `Last hour (${hist.bucket_s} s buckets, from ${hist.source === "prometheus" ? "Prometheus" : "the controller's history store"})`,
        hist.fallback ? el("p", "fallback", `⚠ ${hist.fallback}`) : null,
        chartBox,
      ),
      section(
        "XID events",
        xids.length
          ? el("ul", "xids", xids.map((i) => el("li", null, link(`#/incident/${i.id}`, `#${i.id}`), ` ${fmtAge(i.opened_unix_s)} ago: ${i.summary}`)))
          : el("p", "muted", "no XID event in this node's incidents"),
      ),
      section("NICs", notReported("per-node NIC state")),
      section("Incidents", incidentTable(incidents.data, "no incidents on this node")),
      section("Actions", actionTable(actions.data, "no actions on this node", { approved: actions.approved, plans: actions.plans, done: () => refresh() })),
    );
  }

  const refresh = reloader(ctx, load);
  await load();
  const r = refreshOn(ctx, load, { topics: ["actions", "incidents"], nodeName: name });
  return mounted(root, r, () => charts);
}

/** Each label its own bidi-isolated span: a value with an unterminated right-to-left
 *  override (U+202E) reverses only itself, never the labels beside it. */
function labelList(labels) {
  const entries = Object.entries(labels || {});
  if (!entries.length) return "-";
  return entries.flatMap(([k, v], i) => [i ? ", " : null, el("span", "label", `${k}=${v}`)]);
}
