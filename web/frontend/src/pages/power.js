// Power: each domain's draw against its budget and thresholds (now, and over time from the
// controller's in-memory power history), the caps in force.
import { get } from "../api.js";
import { timeChart } from "../charts.js";
import { el, fill, dash, row, section, table, td, notReported } from "../dom.js";
import { fmtAge, fmtW } from "../format.js";
import { live } from "../live.js";
import { badge } from "./common.js";

function meter(d) {
  const box = el("div", "meter");
  const frac = d.power_w === null ? 0 : d.power_w / d.budget_w;
  const fill = el("span", `fill lvl-${d.level}`);
  fill.style.width = `${Math.min(100, frac * 100)}%`;
  box.append(fill);
  for (const [k, f] of [["T1", d.policy.t1_frac], ["T2", d.policy.t2_frac], ["brake", d.policy.brake_frac]]) {
    const tick = el("span", "tick", k);
    tick.style.left = `${Math.min(100, f * 100)}%`;
    box.append(tick);
  }
  return box;
}

export async function powerPage(ctx) {
  const root = el("div", "page power");
  let charts = [];
  async function load() {
    const [view, hist] = await Promise.all([get("/power/domains"), get("/power/history?window_s=3600")]);
    if (!ctx.isCurrent()) return;
    for (const c of charts) c.dispose();
    charts = [];
    if (!view.enabled || !view.data.length) {
      fill(root, el("h2", null, "Power"), notReported("power domains (no domain tree configured; PUT /api/v1/power/domains or power_domains_file)"));
      return;
    }
    // Oversubscription: children's budgets added up against the parent's, and how many
    // children (servers, for a rack or row) the budget could not feed at their peak.
    const children = new Map();
    for (const d of view.data) {
      if (d.parent === null) continue;
      if (!children.has(d.parent)) children.set(d.parent, []);
      children.get(d.parent).push(d);
    }
    function oversub(d) {
      const kids = children.get(d.name) || [];
      if (!kids.length) return "-";
      const sum = kids.reduce((a, k) => a + k.budget_w, 0);
      const ratio = sum / d.budget_w;
      if (ratio <= 1) return `${ratio.toFixed(2)}×`;
      let fed = 0;
      let count = 0;
      for (const k of [...kids].sort((a, b) => a.budget_w - b.budget_w)) {
        if (fed + k.budget_w > d.budget_w) break;
        fed += k.budget_w;
        count += 1;
      }
      return `${ratio.toFixed(2)}× (+${kids.length - count} ${kids[0].kind}${kids.length - count === 1 ? "" : "s"} beyond peak)`;
    }
    const rows = view.data.map((d) =>
      row(
        [
          td("name", `${"  ".repeat(d.depth)}${d.name}`),
          d.kind,
          td("num", fmtW(d.power_w)),
          td("num", fmtW(d.budget_w)),
          td("num oversub", oversub(d)),
          td("meter-cell", meter(d)),
          td(null, badge(d.level)),
          d.stale ? td("warn", "stale reading") : "ok",
          dash(d.capped_gpus.join(", ")),
        ],
        { "data-domain": d.name },
      ),
    );
    const chartsBox = el("div", "charts");
    for (const d of view.data.filter((x) => x.depth <= 1).slice(0, 6)) {
      const s = hist.domains[d.name];
      if (!s) continue;
      const budget = s.t.map(() => d.budget_w);
      const chart = timeChart({
        title: `${d.name} draw vs budget`,
        unit: "W",
        x: s.t,
        series: [
          { label: "draw", values: s.power_w, width: 2 },
          { label: "budget", values: budget, color: "#D55E00", dash: [6, 3] },
          { label: "T1", values: s.t.map(() => d.budget_w * d.policy.t1_frac), color: "#E69F00", dash: [2, 2] },
        ],
      });
      charts.push(chart);
      chartsBox.append(chart.node);
    }
    if (!chartsBox.children.length) chartsBox.append(notReported("power history (kept in memory since the controller started)"));
    const capped = view.data.flatMap((d) => d.capped_gpus.map((g) => [d.name, g]));
    fill(root, 
      el("h2", null, "Power"),
      el("p", "muted", `source ${view.source} · last tick ${fmtAge(view.last_tick_unix_s)} ago · cap latency p50 ${dash(view.actuation_latency.p50_s)} s`),
      table(["Domain", "Kind", "Draw", "Budget", "Children / budget", "Draw vs budget (T1, T2, brake)", "Level", "Reading", "Capped GPUs"], rows, "no domains", "domains"),
      section("Over time", chartsBox),
      section(
        "Caps in force",
        capped.length
          ? el("ul", "caps", capped.map(([d, g]) => el("li", null, `${g} (in ${d})`)))
          : el("p", "muted", "no GPU is capped"),
        el("p", "muted", "Each cap's priority class: not reported by the controller."),
      ),
    );
  }
  await load();
  const timer = setInterval(async () => {
    try {
      await load();
      ctx.ok();
    } catch (err) {
      ctx.onError(err);
    }
  }, 10000);
  const off = live.on("changed", (msg) => {
    if (msg.topics.includes("power")) load().catch(ctx.onError);
  });
  return {
    node: root,
    refresh: () => load().catch(ctx.onError),
    dispose() {
      clearInterval(timer);
      off();
      for (const c of charts) c.dispose();
    },
  };
}
