// Jobs: the list, and one job's rank x step heatmap (stragglers/hung ranks marked), its
// step time over time with incidents, checkpoints and restarts on the same axis, goodput,
// checkpoints and actions; "checkpoint now", "restart job" and approving dry runs for
// operators.
import { get, post, enc } from "../api.js";
import { actionBar, actionButton } from "../actions.js";
import { heatmap, timeChart } from "../charts.js";
import { attrs, el, fill, dash, link, row, section, table, td, notReported } from "../dom.js";
import { fmtAge, fmtBytes, fmtDuration, fmtPct, fmtTime } from "../format.js";
import { jobSteps } from "../steps.js";
import { actionTable, actionsFor, badge, incidentTable, mounted, refreshOn } from "./common.js";

export async function jobsPage(ctx) {
  const root = el("div", "page jobs");
  // "Show ended jobs": every job the database holds (?history=true), those that left the
  // controller's memory (job_retention_s) marked ended. Part of the address, so it stays
  // on reload and a link to it shows the same list.
  const history = ctx.params.get("history") === "1";
  async function load() {
    const jobs = await get(`/jobs?limit=500${history ? "&history=true" : ""}`);
    const goodput = await Promise.all(
      jobs.data
        .slice(0, 50)
        .map((j) => (j.source === "history" ? null : get(`/jobs/${enc(j.name)}/goodput`, { notFoundIsNull: true }).catch(() => null))),
    );
    if (!ctx.isCurrent()) return;
    const rows = jobs.data.map((j, i) => {
      const gp = goodput[i];
      return row(
        [
          td("name", link(`#/job/${enc(j.name)}`, j.name)),
          td(null, badge(j.state)),
          td("num", `${j.ranks_reporting}/${j.world_size}`),
          td("num", dash(j.last_step)),
          td("num", gp ? fmtPct(gp.ettr) : "-"),
          td("num", gp ? fmtDuration(gp.lost_s) : "-"),
          td("num", String(j.open_incidents)),
          td("num", fmtAge(j.last_seen_unix_s)),
        ],
        { "data-job": j.name, "data-source": j.source },
      );
    });
    const toggle = attrs(el("input"), { type: "checkbox", id: "jobs-history" });
    toggle.checked = history;
    toggle.addEventListener("change", () => {
      location.hash = toggle.checked ? "#/jobs?history=1" : "#/jobs";
    });
    fill(root, 
      el("h2", null, "Jobs"),
      el("p", "filters", el("label", null, toggle, " show ended jobs (those the controller no longer holds, from its database)")),
      table(["Name", "State", "Ranks", "Last step", "Goodput", "Lost", "Incidents", "Last seen"], rows, history ? "no job stored yet" : "no job has reported yet", "jobs"),
    );
  }
  await load();
  const r = refreshOn(ctx, load, { topics: ["jobs", "incidents"] });
  return mounted(root, r);
}

export async function jobPage(ctx) {
  const [name] = ctx.args;
  const root = el("div", "page job");
  let charts = [];
  const shown = { checkpoints: [] }; // the newest load's, for texts read at click time
  let allRanks = false; // a wide job's Ranks table: everything, once asked (kept across loads)
  const stepSource = jobSteps(name); // asks only for steps after those it holds

  async function load() {
    const [job, stepsOrNull, goodput, incidents, checkpointsOrNull, actions] = await Promise.all([
      get(`/jobs/${enc(name)}`),
      // null (404): no step kept in memory for it (a controller that restarted since, or a
      // stalled job that has sent none since): the rest of the page still shows.
      stepSource.fetch(),
      get(`/jobs/${enc(name)}/goodput`, { notFoundIsNull: true }),
      get(`/incidents?job=${enc(name)}&limit=100`),
      // Stored rows: answered for a job that left the controller's memory (job_retention_s)
      // too; 404 only for a job never stored (the page's own /jobs/{name} says so first).
      get(`/jobs/${enc(name)}/checkpoints?limit=200`, { notFoundIsNull: true }),
      actionsFor(name),
    ]);
    if (!ctx.isCurrent()) return;
    for (const c of charts) c.dispose();
    charts = [];
    const checkpoints = checkpointsOrNull || { data: [] };
    shown.checkpoints = checkpoints.data;
    const steps = stepsOrNull || NO_STEPS;

    // Ranks an open straggler/hang/fault incident names are marked on the heatmap.
    const marked = new Map();
    for (const inc of incidents.data) {
      if (inc.state !== "open") continue;
      for (const r of inc.ranks) if (!marked.has(r)) marked.set(r, inc.kind);
    }
    const rankInfo = new Map(steps.ranks.map((r) => [r.rank, r]));
    const ranks = steps.ranks.map((r) => r.rank);
    const index = new Map(steps.steps.map((s, i) => [s, i]));
    const hm = heatmap({
      ranks,
      steps: steps.steps,
      value: (rank, step) => {
        const r = rankInfo.get(rank);
        const v = r.step_time_s[index.get(step)];
        return v === null ? null : v;
      },
      marked,
      labelOf: (rank) => {
        const r = rankInfo.get(rank);
        return `r${rank}${r.role ? ` ${r.role}` : ""}`;
      },
    });

    const marks = [
      ...incidents.data.map((i) => ({ t: i.opened_unix_s, label: `incident #${i.id} ${i.kind} at ${fmtTime(i.opened_unix_s)}`, kind: "incident" })),
      ...uniqueCheckpoints(checkpoints.data).map((c) => ({ t: c.time_unix_s, label: `checkpoint step ${c.step} at ${fmtTime(c.time_unix_s)}`, kind: "checkpoint" })),
      ...actions.data
        .filter((a) => /restart|shrink|rollback/.test(a.kind))
        .map((a) => ({ t: a.created_unix_s, label: `${a.kind} (${a.status}) at ${fmtTime(a.created_unix_s)}`, kind: "restart" })),
      ...actions.data
        .filter((a) => /power|cap/.test(a.kind))
        .map((a) => ({ t: a.created_unix_s, label: `${a.kind} at ${fmtTime(a.created_unix_s)}`, kind: "cap" })),
    ].sort((a, b) => a.t - b.t);
    const stepChart = timeChart({
      title: "Step time: median and slowest rank",
      unit: "s",
      x: steps.end_unix_s,
      series: [
        { label: "median", values: steps.median_s },
        { label: "slowest", values: steps.max_s },
      ],
      marks,
    });
    charts.push(stepChart);
    const goodputChart = timeChart({
      title: "Goodput (ETTR: productive / wall time)",
      unit: "fraction",
      x: steps.goodput.t,
      series: [{ label: "ETTR", values: steps.goodput.ettr, width: 2 }],
      marks,
      yRange: [0, 1],
      height: 140,
    });
    charts.push(goodputChart);

    const ended = job.source === "history";
    const bar = ended ? el("p", "muted", "Ended: the controller no longer holds this job (job_retention_s); shown as the database last stored it. Nothing to act on.") : actionBar(
      actionButton({
        id: "checkpoint",
        label: "Checkpoint now",
        title: "Checkpoint now",
        effect: `Ask every rank of ${name} (on ${job.nodes.length} node${job.nodes.length === 1 ? "" : "s"}) to save a checkpoint at its next step; training pauses for the checkpoint's blocking part.`,
        run: async () => {
          const out = [];
          for (const node of job.nodes) out.push(await post(`/nodes/${enc(node)}/commands`, { kind: "job_checkpoint", job: name }));
          return out;
        },
        done: () => refresh(),
      }),
      actionButton({
        id: "restart",
        label: "Restart job",
        title: "Restart job",
        effect: () =>
          `Restart ${name} now: stop all ${job.world_size} ranks and start them again through the actuator, from ${resumeFrom(shown.checkpoints)}, without isolated nodes. Progress since that checkpoint is lost; the restart counts against the job's restart limit.`,
        path: `/jobs/${enc(name)}/restart`,
        reason: { default: "" },
        body: (reason) => ({ reason }),
        done: () => refresh(),
      }),
    );

    const goodputPart = goodput
      ? el(
          "dl",
          "facts",
          el("dt", null, "Goodput (ETTR)"), el("dd", "goodput", fmtPct(goodput.ettr)),
          el("dt", null, "Productive"), el("dd", null, fmtDuration(goodput.productive_s)),
          el("dt", null, "Lost"), el("dd", null, fmtDuration(goodput.lost_s)),
          el("dt", null, "Wall"), el("dd", null, fmtDuration(goodput.wall_s)),
        )
      : notReported(ended ? "goodput (kept in the controller's memory only, it went with the job)" : "goodput (no step recorded by the remediation engine yet)");

    const ckRows = checkpoints.data.map((c) =>
      row([
        td("num", String(c.step)),
        td("num", String(c.rank)),
        c.kind,
        td("num", c.size_bytes === null ? "-" : fmtBytes(c.size_bytes)),
        td("num", c.blocking_s === null ? "-" : fmtDuration(c.blocking_s)),
        td("num", c.duration_s === null ? "-" : fmtDuration(c.duration_s)),
        td("summary", c.error || c.path || "-"),
        td("num", fmtAge(c.time_unix_s)),
      ]),
    );
    const listed = ranksListed(job.ranks, marked, allRanks);
    const rankRows = listed.ranks.map((r) =>
      row([
        td("num", String(r.rank)),
        td("name", link(`#/node/${enc(r.node)}`, r.node)),
        td("num", dash(r.gpu_index)),
        dash(rankInfo.get(r.rank) && rankInfo.get(r.rank).role),
        td("num", layoutText(rankInfo.get(r.rank))),
        td(null, badge(r.state)),
        td("num", dash(r.last_step)),
        marked.has(r.rank) ? td("marked", `◀ ${marked.get(r.rank)}`) : "-",
      ], { "data-rank": String(r.rank) }),
    );
    fill(root, 
      el("h2", null, link("#/jobs", "Jobs"), " / ", el("span", "name", job.name), " ", badge(job.state)),
      bar,
      el("p", "muted summary", `${job.ranks_reporting}/${job.world_size} ranks reporting · last step ${dash(job.last_step)} · ${nodesText(job.nodes)}`),
      section("Rank × step", stepsOrNull ? null : notReported(ended ? "step times (kept in the controller's memory only, they went with the job)" : "step times since the controller started (none kept in its memory for this job yet; they start with the job's next step)"), hm),
      section("Over time", el("div", "charts", stepChart.node, goodputChart.node), el("p", "muted", "Loss: not reported (step summaries carry no loss).")),
      section("Goodput", goodputPart),
      section(
        "Ranks",
        listed.hidden ? ranksShowAll(listed, () => { allRanks = true; load(); }) : null,
        table(["Rank", "Node", "GPU", "Role", "pp · dp · tp (peers)", "State", "Last step", "Marked"], rankRows, "no ranks", "ranks"),
      ),
      section("Checkpoints (tier = kind)", table(["Step", "Rank", "Kind", "Size", "Blocking", "Durable after", "Path / error", "Age"], ckRows, checkpointsOrNull ? "no checkpoint reported" : "not reported", "checkpoints")),
      section("Incidents", incidentTable(incidents.data, "no incidents for this job")),
      section("Actions", actionTable(actions.data, "no actions on this job", { approved: actions.approved, plans: actions.plans, done: () => refresh() })),
    );
  }

  await load();
  const r = refreshOn(ctx, load, { topics: ["jobs", "incidents", "actions", "checkpoints"] });
  const refresh = r.refresh;
  const stop = { ...r, dispose: () => (r.dispose(), stepSource.dispose()) };
  return mounted(root, stop, () => charts);
}

/** What /jobs/{name}/steps holds for a job it has no step for (it answered 404). */
const NO_STEPS = { steps: [], ranks: [], end_unix_s: [], median_s: [], max_s: [], goodput: { t: [], ettr: [] } };

/** The job's nodes in one line: all of a small job's, the first few of a wide one's (a
 *  2,048-node list would push the heatmap several screens down). */
function nodesText(nodes) {
  const SHOWN = 8;
  if (nodes.length <= SHOWN) return `nodes ${nodes.join(", ") || "-"}`;
  return `${nodes.length} nodes: ${nodes.slice(0, SHOWN).join(", ")} and ${nodes.length - SHOWN} more (see Ranks)`;
}

/** Rows a wide job's Ranks table starts with: a 2,048-rank table is ~110,000 px of page
 *  under the heatmap, and the ranks someone opens this page for are the few an incident
 *  marks or that stopped running. Those come first (all of them, up to the cap), then the
 *  lowest ranks fill up to it; shown in rank order. */
const RANKS_SHOWN = 64;

function ranksListed(ranks, marked, all) {
  if (all || ranks.length <= RANKS_SHOWN) return { ranks, hidden: 0, attention: 0 };
  const attention = ranks.filter((r) => marked.has(r.rank) || r.state !== "running");
  const keep = new Set(attention.slice(0, RANKS_SHOWN).map((r) => r.rank));
  for (const r of ranks) {
    if (keep.size >= RANKS_SHOWN) break;
    keep.add(r.rank);
  }
  const kept = ranks.filter((r) => keep.has(r.rank));
  return { ranks: kept, hidden: ranks.length - kept.length, attention: attention.length };
}

function ranksShowAll(listed, showAll) {
  const total = listed.ranks.length + listed.hidden;
  const why = listed.attention
    ? `the ${listed.attention} an open incident marks or that are not running first, then the lowest`
    : "the lowest (none is marked by an open incident or stopped running)";
  const button = attrs(el("button", "show-all", `Show all ${total.toLocaleString("en-US")} ranks`), { type: "button" });
  button.addEventListener("click", showAll);
  return el("p", "muted ranks-shown", `${listed.ranks.length} of ${total.toLocaleString("en-US")} ranks listed: ${why}. `, button);
}

/** "pp 1 · dp 0 · tp 3 (8 peers)" from what the rank's step summaries declared. */
function layoutText(info) {
  if (!info) return "-";
  const parts = [["pp", info.pp_stage], ["dp", info.dp_rank], ["tp", info.tp_rank]]
    .filter(([, v]) => v !== null && v !== undefined)
    .map(([k, v]) => `${k} ${v}`);
  if (info.peer_group_size) parts.push(`(${info.peer_group_size} peers)`);
  return parts.length ? parts.join(" · ") : "-";
}

/** Where a restart resumes: the newest committed checkpoint the ranks reported. */
function resumeFrom(list) {
  const committed = list.filter((c) => c.kind === "committed" && !c.error).map((c) => c.step);
  return committed.length
    ? `its newest committed checkpoint (step ${Math.max(...committed)} when this page last loaded)`
    : "its newest committed checkpoint (none reported to this page yet: from the start if there is none)";
}

function uniqueCheckpoints(list) {
  const seen = new Map();
  for (const c of list) if (!seen.has(c.step) || seen.get(c.step).time_unix_s > c.time_unix_s) seen.set(c.step, c);
  return [...seen.values()];
}
