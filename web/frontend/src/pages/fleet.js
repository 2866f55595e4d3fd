// Fleet: every node one cell, coloured and marked (glyph) by its worst state; filters by
// state, label and job; arrow keys move between cells, Enter opens the node.
import { get } from "../api.js";
import { el, attrs } from "../dom.js";
import { live } from "../live.js";
import { fleet, nodeState, onFleet, STATES, STATE_GLYPH } from "../store.js";

function describe(n, state) {
  const bits = [`${n.n}: ${state}`];
  if (n.sim) bits.push("simulated");
  if (n.r) bits.push(n.r);
  if (n.iso) bits.push(`isolated: ${n.iso}`);
  if (n.b) bits.push(`${n.b} of ${n.g} GPUs bad`);
  if (n.i) bits.push(`${n.i} open incidents`);
  const labels = Object.entries(n.l || {});
  if (labels.length) bits.push(`labels: ${labels.map(([k, v]) => `${k}=${v}`).join(", ")}`);
  return bits.join(" · ");
}

export async function fleetPage(ctx) {
  const jobs = await get("/jobs?limit=500");
  const filter = {
    states: new Set((ctx.params.get("state") || "").split(",").filter(Boolean)),
    label: ctx.params.get("label") || "",
    job: ctx.params.get("job") || "",
  };
  const jobNodes = new Map(jobs.data.map((j) => [j.name, new Set(j.nodes)]));

  const legend = el("div", "legend");
  attrs(legend, { role: "group", "aria-label": "Filter by state" });
  const counts = new Map();
  const stateButtons = new Map();
  for (const s of STATES) {
    const b = el("button", `chip st-${s}`, el("span", "glyph", STATE_GLYPH[s] || "●"), ` ${s} `, el("span", "n", "0"));
    attrs(b, { type: "button", "aria-pressed": filter.states.has(s) ? "true" : "false", "data-state": s });
    b.addEventListener("click", () => {
      if (filter.states.has(s)) filter.states.delete(s);
      else filter.states.add(s);
      b.setAttribute("aria-pressed", filter.states.has(s) ? "true" : "false");
      syncUrl();
      applyFilter();
    });
    stateButtons.set(s, b);
    legend.append(b);
  }
  const simNote = el("span", "chip sim-key", el("span", "cell-demo sim"), " dashed: simulated");
  legend.append(simNote);

  const labelInput = el("input");
  attrs(labelInput, { id: "fleet-label", type: "search", placeholder: "key=value or text", value: filter.label });
  labelInput.value = filter.label;
  const jobSelect = el("select");
  attrs(jobSelect, { id: "fleet-job" });
  jobSelect.append(el("option", null, "all jobs"));
  jobSelect.options[0].value = "";
  for (const j of jobs.data) {
    const o = el("option", null, j.name);
    o.value = j.name;
    jobSelect.append(o);
  }
  jobSelect.value = filter.job;
  const shown = el("span", "muted");
  const controls = el(
    "div",
    "filters",
    el("label", null, "Label ", labelInput),
    el("label", null, "Job ", jobSelect),
    shown,
  );
  labelInput.addEventListener("input", () => {
    filter.label = labelInput.value.trim();
    syncUrl();
    applyFilter();
  });
  jobSelect.addEventListener("change", () => {
    filter.job = jobSelect.value;
    syncUrl();
    applyFilter();
  });

  const grid = el("div", "fleet-grid");
  attrs(grid, { id: "fleet", role: "list", "aria-label": "Nodes; arrow keys move, Enter opens" });
  const cells = new Map();

  function matches(n, state) {
    if (filter.states.size && !filter.states.has(state)) return false;
    if (filter.job) {
      const nodes = jobNodes.get(filter.job);
      if (!nodes || !nodes.has(n.n)) return false;
    }
    if (filter.label) {
      const want = filter.label;
      const labels = n.l || {};
      const eq = want.indexOf("=");
      if (eq > 0) {
        if (labels[want.slice(0, eq)] !== want.slice(eq + 1)) return false;
      } else if (!n.n.includes(want) && !Object.entries(labels).some(([k, v]) => k.includes(want) || v.includes(want))) {
        return false;
      }
    }
    return true;
  }

  function paint(cell, n) {
    const state = nodeState(n);
    cell.className = `cell st-${state}${n.sim ? " sim" : ""}`;
    cell.textContent = STATE_GLYPH[state];
    cell.dataset.state = state;
    cell.title = describe(n, state);
    cell.setAttribute("aria-label", describe(n, state));
    cell.hidden = !matches(n, state);
  }

  function makeCell(n) {
    const cell = el("a", "cell");
    cell.href = `#/node/${encodeURIComponent(n.n)}`;
    cell.dataset.node = n.n;
    attrs(cell, { role: "listitem", tabindex: "-1" });
    return cell;
  }

  function renderAll() {
    const names = [...fleet.nodes.keys()].sort((a, b) => a.localeCompare(b, undefined, { numeric: true }));
    cells.clear();
    const frag = [];
    for (const name of names) {
      const n = fleet.nodes.get(name);
      const cell = makeCell(n);
      paint(cell, n);
      cells.set(name, cell);
      frag.push(cell);
    }
    grid.replaceChildren(...frag);
    if (!names.length) grid.append(el("p", "empty", fleet.complete ? "no node has reported yet" : "waiting for the live stream…"));
    roving();
    recount();
  }

  function recount() {
    for (const s of STATES) counts.set(s, 0);
    let visible = 0;
    for (const [name, cell] of cells) {
      const n = fleet.nodes.get(name);
      const s = nodeState(n);
      counts.set(s, counts.get(s) + 1);
      if (!cell.hidden) visible += 1;
    }
    for (const [s, b] of stateButtons) b.querySelector(".n").textContent = String(counts.get(s));
    shown.textContent = `${visible} of ${cells.size} nodes shown`;
  }

  function applyFilter() {
    // Only visibility changes here: touching 2,048 cells' text and labels costs a frame.
    for (const [name, cell] of cells) {
      const n = fleet.nodes.get(name);
      const hide = !matches(n, cell.dataset.state);
      if (cell.hidden !== hide) cell.hidden = hide;
    }
    roving();
    recount();
  }

  function syncUrl() {
    const p = new URLSearchParams();
    if (filter.states.size) p.set("state", [...filter.states].join(","));
    if (filter.label) p.set("label", filter.label);
    if (filter.job) p.set("job", filter.job);
    const q = p.toString();
    history.replaceState(null, "", `#/fleet${q ? `?${q}` : ""}`);
  }

  // Roving tabindex: the grid is one tab stop; arrows move inside it.
  let focusName = null;
  function visibleCells() {
    return [...grid.querySelectorAll(".cell:not([hidden])")];
  }
  function roving() {
    const list = visibleCells();
    if (!list.length) return;
    let target = focusName && cells.get(focusName);
    if (!target || target.hidden) target = list[0];
    for (const c of list) c.tabIndex = c === target ? 0 : -1;
  }
  grid.addEventListener("keydown", (event) => {
    const list = visibleCells();
    const i = list.indexOf(document.activeElement);
    if (i < 0) return;
    const perRow = Math.max(1, Math.round(grid.clientWidth / (list[0].offsetWidth + 2)));
    const step = { ArrowRight: 1, ArrowLeft: -1, ArrowDown: perRow, ArrowUp: -perRow, Home: -i, End: list.length - 1 - i }[event.key];
    if (step === undefined) return;
    event.preventDefault();
    const next = list[Math.max(0, Math.min(list.length - 1, i + step))];
    list[i].tabIndex = -1;
    next.tabIndex = 0;
    focusName = next.dataset.node;
    next.focus();
  });

  const off = onFleet(({ full, changed, removed }) => {
    if (full || removed.length || changed.some((name) => !cells.has(name))) {
      renderAll();
      return;
    }
    for (const name of changed) paint(cells.get(name), fleet.nodes.get(name));
    recount();
  });
  // Jobs come and go: refresh the job filter's node sets when the server says jobs changed.
  const offJobs = live.on("changed", async (msg) => {
    if (!msg.topics.includes("jobs")) return;
    try {
      const fresh = await get("/jobs?limit=500");
      jobNodes.clear();
      for (const j of fresh.data) jobNodes.set(j.name, new Set(j.nodes));
      if (filter.job) applyFilter();
    } catch {
      // the next change tries again
    }
  });
  // "unreachable" depends on time: the server re-sends a node when its silence flag flips.

  renderAll();
  const node = el(
    "div",
    "page fleet",
    el("h2", null, "Fleet"),
    el("div", "fleet-controls", legend, controls),
    grid,
  );
  return {
    node,
    dispose() {
      off();
      offJobs();
    },
  };
}
