// trainguard dashboard: a read-only view of the controller's /api/v1, polled every 2 s.
//
// Rules this file keeps:
// * Every string from the API reaches the page as text (textContent / append), never as
//   markup: a node name, reason or summary cannot inject HTML. No HTML-parsing sink is used.
// * The token lives in sessionStorage only (this tab), is sent only in the Authorization
//   header of same-origin calls, and is never logged or put in a URL.
// * One failure shows one line in the banner; the last good data stays on screen, dimmed.
"use strict";

(() => {
  const API = "/api/v1";
  const POLL_MS = 2000;
  const TIMEOUT_MS = 5000;
  const GOODPUT_REFRESH_MS = 10000;
  const GOODPUT_JOBS_MAX = 20;
  const TOKEN_KEY = "trainguard.token";

  const HEALTH_ORDER = { unhealthy: 0, lost: 1, unknown: 2, healthy: 3 };

  let timer = null;
  let skewS = 0; // controller clock minus browser clock, from the Date header
  const goodputCache = new Map(); // job name -> {at: ms, value: snapshot | null}

  const $ = (id) => document.getElementById(id);

  // ------------------------------------------------------------------ DOM helpers

  /** An element with text (or element) children; strings always become text nodes. */
  function el(tag, className, ...children) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  function badge(value) {
    const text = value === null || value === undefined || value === "" ? "-" : String(value);
    return el("span", `badge b-${text.replace(/[^a-z_]/g, "")}`, text);
  }

  function fillTable(id, rows, columns, emptyText) {
    const body = $(id).tBodies[0];
    if (rows.length === 0) {
      const cell = el("td", "empty", emptyText);
      cell.colSpan = columns;
      body.replaceChildren(el("tr", null, cell));
      return;
    }
    body.replaceChildren(...rows);
  }

  function row(cells) {
    const tr = el("tr");
    for (const cell of cells) {
      tr.append(cell instanceof HTMLTableCellElement ? cell : el("td", null, dash(cell)));
    }
    return tr;
  }

  function dash(value) {
    if (value === null || value === undefined || value === "") return "-";
    return value;
  }

  function countLabel(shown, total) {
    return shown < total ? `(${shown} of ${total})` : `(${total})`;
  }

  // ------------------------------------------------------------------ formatting

  const nowS = () => Date.now() / 1000 + skewS;

  function fmtAge(unixS) {
    if (typeof unixS !== "number") return "-";
    const s = Math.max(0, nowS() - unixS);
    return s < 120 ? `${Math.floor(s)}s` : fmtDuration(s);
  }

  /** kubectl-style: 45s, 7m, 5h, 3d (one decimal under 10 s). */
  function fmtDuration(s) {
    if (typeof s !== "number" || !Number.isFinite(s)) return "-";
    s = Math.max(0, s);
    if (s < 10) return `${s.toFixed(1)}s`;
    if (s < 120) return `${Math.floor(s)}s`;
    if (s < 2 * 3600) return `${Math.floor(s / 60)}m`;
    if (s < 48 * 3600) return `${Math.floor(s / 3600)}h`;
    return `${Math.floor(s / 86400)}d`;
  }

  function fmtPercent(x) {
    return typeof x === "number" && Number.isFinite(x) ? `${(x * 100).toFixed(1)}%` : "-";
  }

  function noteServerClock(resp) {
    const date = Date.parse(resp.headers.get("Date") || "");
    if (Number.isNaN(date)) return;
    // The header has 1 s resolution: take the middle of that second; ignore jitter.
    const skew = (date + 500 - Date.now()) / 1000;
    if (Math.abs(skew - skewS) > 1.5) skewS = skew;
  }

  // ------------------------------------------------------------------ API

  class ApiError extends Error {
    /** kind: "auth" (401/403), "unreachable", "standby" (503), "http" (anything else). */
    constructor(kind, status, detail) {
      super(detail);
      this.kind = kind;
      this.status = status;
      this.detail = detail;
    }
  }

  function storedToken() {
    try {
      return sessionStorage.getItem(TOKEN_KEY) || "";
    } catch {
      return "";
    }
  }

  function storeToken(value) {
    try {
      if (value) sessionStorage.setItem(TOKEN_KEY, value);
      else sessionStorage.removeItem(TOKEN_KEY);
    } catch {
      // Storage disabled: the token lasts until the page reloads.
    }
    memoryToken = value;
  }

  let memoryToken = storedToken();

  async function get(path, { notFoundIsNull = false } = {}) {
    const headers = { Accept: "application/json" };
    const sent = memoryToken;
    if (sent) headers.Authorization = `Bearer ${sent}`;
    const abort = new AbortController();
    const timeout = setTimeout(() => abort.abort(), TIMEOUT_MS);
    let resp;
    try {
      resp = await fetch(API + path, {
        headers,
        signal: abort.signal,
        cache: "no-store",
        credentials: "omit",
      });
    } catch {
      const why = abort.signal.aborted ? `no answer within ${TIMEOUT_MS / 1000} s` : "no connection";
      throw new ApiError("unreachable", 0, why);
    } finally {
      clearTimeout(timeout);
    }
    noteServerClock(resp);
    if (resp.ok) return resp.json();
    if (resp.status === 404 && notFoundIsNull) return null;
    let detail = "";
    try {
      const body = await resp.json();
      if (body && typeof body.detail === "string") detail = body.detail;
    } catch {
      // Not JSON: the status code says enough.
    }
    if (resp.status === 401 || resp.status === 403) {
      const err = new ApiError("auth", resp.status, detail);
      err.sentToken = sent; // to tell a refusal of an older token from one of the current
      throw err;
    }
    if (resp.status === 503) throw new ApiError("standby", 503, detail);
    throw new ApiError("http", resp.status, `GET ${API}${path}: HTTP ${resp.status} ${detail}`);
  }

  async function loadGoodput(jobs) {
    const now = Date.now();
    const names = jobs.slice(0, GOODPUT_JOBS_MAX).map((j) => j.name);
    await Promise.all(
      names.map(async (name) => {
        const cached = goodputCache.get(name);
        if (cached && now - cached.at < GOODPUT_REFRESH_MS) return;
        try {
          const value = await get(`/jobs/${encodeURIComponent(name)}/goodput`, {
            notFoundIsNull: true,
          });
          goodputCache.set(name, { at: now, value });
        } catch (err) {
          if (err instanceof ApiError && err.kind === "auth") throw err;
          // Goodput is extra: a failure here leaves the column at its last value.
        }
      }),
    );
    for (const name of goodputCache.keys()) {
      if (!names.includes(name)) goodputCache.delete(name);
    }
  }

  // ------------------------------------------------------------------ rendering

  function renderStatus(s) {
    const role = s.leader ? "leader" : "standby";
    $("meta").textContent =
      `controller ${s.version} · ${s.database} · ${role} · up ${fmtDuration(s.uptime_s)}`;

    const byHealth = Object.entries(s.nodes_by_health || {})
      .filter(([, n]) => n > 0)
      .sort(([a], [b]) => (HEALTH_ORDER[a] ?? 9) - (HEALTH_ORDER[b] ?? 9));
    $("card-nodes").textContent = String(s.nodes_total);
    $("card-nodes-detail").replaceChildren(
      ...byHealth.flatMap(([health, n], i) => [
        i ? " · " : "",
        el("span", `h-${health.replace(/[^a-z]/g, "")}`, `${n} ${health}`),
      ]),
    );
    const bad = byHealth.some(([h]) => h === "unhealthy" || h === "lost");
    $("card-nodes").parentElement.classList.toggle("alert", bad);

    $("card-gpus").textContent = String(s.gpus_total);
    $("card-gpus-detail").textContent = `${s.gpus_unhealthy} unhealthy`;
    $("card-gpus").parentElement.classList.toggle("alert", s.gpus_unhealthy > 0);

    $("card-incidents").textContent = String(s.incidents_open);
    $("card-incidents-detail").textContent =
      Object.entries(s.incidents_open_by_kind || {})
        .map(([kind, n]) => `${n} ${kind}`)
        .join(" · ") || "none";
    $("card-incidents").parentElement.classList.toggle("alert", s.incidents_open > 0);

    $("card-jobs").textContent = String(s.jobs_total);
    $("card-jobs-detail").textContent = `${s.reports_total} reports received`;
  }

  function renderNodes(list) {
    const nodes = [...list.data].sort(
      (a, b) =>
        (HEALTH_ORDER[a.health] ?? 9) - (HEALTH_ORDER[b.health] ?? 9) ||
        a.name.localeCompare(b.name),
    );
    const rows = nodes.map((n) => {
      const name = el("td", "name", n.name);
      if (n.hostname) name.title = n.hostname;
      const reason = el("td", "reason", dash(n.health_reason));
      if (n.isolated_reason !== null && n.isolated_reason !== undefined) {
        reason.append(el("div", "isolated", `isolated: ${n.isolated_reason}`));
      }
      const gpus = el("td", "num", String(n.gpu_count));
      if (n.gpus_unhealthy > 0) gpus.append(el("span", "h-unhealthy", ` (${n.gpus_unhealthy} bad)`));
      return row([
        name,
        el("td", null, badge(n.health)),
        reason,
        gpus,
        el("td", "num", fmtAge(n.last_report_unix_s)),
      ]);
    });
    rows.forEach((tr, i) => tr.setAttribute("data-node", nodes[i].name));
    fillTable("nodes", rows, 5, "no node has reported yet");
    $("count-nodes").textContent = countLabel(list.data.length, list.count);
  }

  function culprit(inc) {
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

  function renderIncidents(list) {
    const rows = list.data.map((inc) => {
      const summary = el("td", "summary", dash(inc.summary));
      if (inc.count > 1) summary.append(el("span", "muted", ` ×${inc.count}`));
      const age = el("td", "num", fmtAge(inc.opened_unix_s));
      age.title = `last seen ${fmtAge(inc.updated_unix_s)} ago`;
      const tr = row([
        el("td", "num", String(inc.id)),
        inc.kind,
        el("td", null, badge(inc.severity)),
        culprit(inc),
        summary,
        age,
      ]);
      tr.setAttribute("data-incident", String(inc.id));
      return tr;
    });
    fillTable("incidents", rows, 6, "no open incidents");
    $("count-incidents").textContent = countLabel(list.data.length, list.count);
  }

  function renderJobs(list) {
    const rows = list.data.map((job) => {
      const cached = goodputCache.get(job.name);
      const gp = cached ? cached.value : null;
      const tr = row([
        el("td", "name", job.name),
        el("td", null, badge(job.state)),
        el("td", "num", `${job.ranks_reporting}/${job.world_size}`),
        el("td", "num", dash(job.last_step)),
        el("td", "num", gp ? fmtPercent(gp.ettr) : "-"),
        el("td", "num", gp ? fmtDuration(gp.lost_s) : "-"),
        el("td", "num", fmtAge(job.last_seen_unix_s)),
      ]);
      tr.setAttribute("data-job", job.name);
      return tr;
    });
    fillTable("jobs", rows, 7, "no job has reported yet");
    $("count-jobs").textContent = countLabel(list.data.length, list.count);
  }

  function renderActions(list) {
    const rows = list.data.map((a) => {
      const status = el("td", null, badge(a.status));
      if (a.outcome) status.title = a.outcome;
      return row([
        a.kind,
        el("td", "name", dash(a.target)),
        a.trigger,
        status,
        el("td", "num", a.duration_s === null ? "running" : fmtDuration(a.duration_s)),
        el("td", "num", fmtAge(a.created_unix_s)),
      ]);
    });
    fillTable("actions", rows, 6, "no actions yet");
    $("count-actions").textContent = countLabel(list.data.length, list.count);
  }

  // ------------------------------------------------------------------ banner and login

  function showBanner(text, kind) {
    const banner = $("banner");
    banner.textContent = text;
    banner.className = `banner ${kind}`;
    banner.hidden = false;
  }

  function clearBanner() {
    $("banner").hidden = true;
    $("banner").textContent = "";
  }

  function showLogin() {
    $("login").hidden = false;
    $("token").focus();
  }

  function syncSignout() {
    $("signout").hidden = !memoryToken;
  }

  function handleError(err) {
    $("content").classList.add("stale");
    if (!(err instanceof ApiError)) {
      console.error("dashboard error", err); // a bug of ours, never API data
      showBanner(`Dashboard error: ${err && err.message ? err.message : err}`, "error");
      return;
    }
    if (err.kind === "auth") {
      const had = Boolean(memoryToken);
      storeToken("");
      syncSignout();
      const detail = err.detail ? `: ${err.detail}` : "";
      showBanner(
        had
          ? `Token refused (HTTP ${err.status})${detail}. Enter a token with the viewer role.`
          : `This controller needs a token (HTTP ${err.status}). Enter a viewer token.`,
        "auth",
      );
      showLogin();
      return;
    }
    if (err.kind === "unreachable") {
      showBanner(
        `Controller unreachable at ${location.origin} (${err.detail}); retrying every ${
          POLL_MS / 1000
        } s.`,
        "error",
      );
      return;
    }
    if (err.kind === "standby") {
      showBanner(
        `This controller replica is a standby${err.detail ? ` (${err.detail})` : ""}; ` +
          "open the leader's dashboard.",
        "error",
      );
      return;
    }
    showBanner(err.detail, "error");
  }

  // ------------------------------------------------------------------ polling

  function schedule(delayMs) {
    if (timer !== null) clearTimeout(timer);
    timer = setTimeout(poll, delayMs);
  }

  async function poll() {
    timer = null;
    try {
      const [status, nodes, incidents, jobs, actions] = await Promise.all([
        get("/status"),
        get("/nodes?limit=500"),
        get("/incidents?state=open&limit=200"),
        get("/jobs?limit=200"),
        get("/actions?limit=20"),
      ]);
      await loadGoodput(jobs.data);
      renderStatus(status);
      renderNodes(nodes);
      renderIncidents(incidents);
      renderJobs(jobs);
      renderActions(actions);
      clearBanner();
      $("login").hidden = true;
      $("content").classList.remove("stale");
      $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    } catch (err) {
      if (err instanceof ApiError && err.kind === "auth" && err.sentToken !== memoryToken) {
        return; // the token changed meanwhile; the poll it started is under way
      }
      handleError(err);
      // A refused token is not retried: the next poll starts when a new one is entered.
      if (err instanceof ApiError && err.kind === "auth") return;
    }
    schedule(POLL_MS);
  }

  function onLogin(event) {
    event.preventDefault();
    const input = $("token");
    const value = input.value.trim();
    input.value = "";
    if (!/^[\x21-\x7e]+$/.test(value)) {
      showBanner("A token is printable ASCII without spaces; paste it again.", "auth");
      return;
    }
    storeToken(value);
    syncSignout();
    $("login").hidden = true;
    showBanner("Connecting…", "info");
    schedule(0);
  }

  function onSignout() {
    storeToken("");
    syncSignout();
    goodputCache.clear();
    schedule(0);
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("login").addEventListener("submit", onLogin);
    $("signout").addEventListener("click", onSignout);
    syncSignout();
    schedule(0);
  });
})();
