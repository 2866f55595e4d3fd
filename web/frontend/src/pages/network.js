// Network: the fabric (switches, links) with the links suspected slow or down, and each
// traffic plan's link load against ECMP hashing.
import { ApiError, get, enc } from "../api.js";
import { el, dash, row, section, table, td, notReported } from "../dom.js";
import { fmtBytes } from "../format.js";

export async function networkPage(ctx) {
  const root = el("div", "page network");
  let topo;
  try {
    topo = await get("/topology");
  } catch (err) {
    if (err instanceof ApiError && err.status === 409) {
      root.append(el("h2", null, "Network"), notReported("fabric topology (no topology loaded: set topology_file or node labels)"));
      return { node: root };
    }
    throw err;
  }
  const plans = await get("/plans");
  const slow = new Set(topo.slow_links.map((s) => s.link));
  const down = new Set(topo.down_links);
  const linkRows = [
    ...topo.down_links.map((l) => row([td("name", l), td("bad", "✕ down"), "-"], { "data-link": l })),
    ...topo.slow_links.map((s) => row([td("name", s.link), td("warn", "◐ slow"), `${Math.round(s.capacity_factor * 100)}% capacity`], { "data-link": s.link })),
  ];
  const facts = el("dl", "facts");
  for (const [k, v] of Object.entries(topo)) {
    if (["switches", "down_links", "slow_links"].includes(k) || typeof v === "object") continue;
    facts.append(el("dt", null, k), el("dd", null, String(v)));
  }
  const planParts = [];
  for (const p of plans.data) {
    const links = await get(`/plans/${enc(p.plan_id)}/links`, { notFoundIsNull: true }).catch(() => null);
    if (!ctx.isCurrent()) return { node: root };
    let body;
    if (!links) {
      body = notReported("per-link load for this plan");
    } else {
      const max = Math.max(1, ...links.data.map((l) => Math.max(l.plan_bytes, l.ecmp_bytes)));
      const rows = links.data.slice(0, 40).map((l) => {
        const bars = el("div", "loadbars");
        for (const [cls, v] of [["plan", l.plan_bytes], ["ecmp", l.ecmp_bytes]]) {
          const b = el("span", `lb ${cls}`);
          b.style.width = `${(v / max) * 100}%`;
          bars.append(b);
        }
        const mark = down.has(l.link) ? "✕ down" : slow.has(l.link) ? "◐ slow" : "";
        return row([td("name", l.link), td("num", fmtBytes(l.plan_bytes)), td("num", fmtBytes(l.ecmp_bytes)), td("bars", bars), mark || "-"], { "data-link": l.link });
      });
      body = table(["Link", "Plan", "ECMP (one draw)", "Plan ▮ / ECMP ▯", "State"], rows, "no loaded link", "links");
    }
    planParts.push(section(`Plan ${p.plan_id} for ${p.job} (v${p.version}): busiest ${dash(p.busiest_link)}`, body));
  }
  root.append(
    el("h2", null, "Network"),
    facts,
    section(`Switches (${topo.switches.length})`, el("p", "switches", topo.switches.join(" · "))),
    section("Links suspected slow or down", table(["Link", "State", "Detail"], linkRows, "every link is up at full capacity", "bad-links")),
    ...(planParts.length ? planParts : [section("Traffic plans", el("p", "muted", "no traffic plan yet"))]),
  );
  return { node: root };
}
