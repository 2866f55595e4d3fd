// trainguard dashboard: one page per URL (hash routing, so the back button works and every
// view is linkable), data from /api/v1, live updates from /api/v1/stream.
//
// Rules this code keeps:
// * API strings reach the page as text only (textContent / append); no HTML parsing sink.
// * The token stays in this tab's sessionStorage and the Authorization header.
// * A failure shows one line in the banner; the last good view stays on screen, dimmed.
// * Action buttons appear for the operator role only, and every action asks for a
//   confirmation that names its effect; the API refuses a viewer anyway.
import { ApiError, get, getToken, setToken } from "./api.js";
import { el } from "./dom.js";
import { live } from "./live.js";
import { session } from "./session.js";
import { fleetPage } from "./pages/fleet.js";
import { nodePage } from "./pages/node.js";
import { jobsPage, jobPage } from "./pages/job.js";
import { incidentsPage, incidentPage } from "./pages/incidents.js";
import { powerPage } from "./pages/power.js";
import { networkPage } from "./pages/network.js";

const $ = (id) => document.getElementById(id);

const ROUTES = [
  [/^\/fleet$/, "fleet", () => fleetPage],
  [/^\/node\/(.+)$/, "fleet", () => nodePage],
  [/^\/jobs$/, "jobs", () => jobsPage],
  [/^\/job\/(.+)$/, "jobs", () => jobPage],
  [/^\/incidents$/, "incidents", () => incidentsPage],
  [/^\/incident\/(\d+)$/, "incidents", () => incidentPage],
  [/^\/power$/, "power", () => powerPage],
  [/^\/network$/, "network", () => networkPage],
];

let current = null; // {page, dispose}
let renderSeq = 0;

function parseHash() {
  const raw = location.hash.replace(/^#/, "") || "/fleet";
  const [path, query = ""] = raw.split("?");
  return { path, params: new URLSearchParams(query) };
}

export function showBanner(text, kind) {
  const banner = $("banner");
  banner.textContent = text;
  banner.className = `banner ${kind}`;
  banner.hidden = false;
}

export function clearBanner() {
  $("banner").hidden = true;
  $("banner").textContent = "";
}

function handleError(err) {
  $("view").classList.add("stale");
  if (!(err instanceof ApiError)) {
    console.error("dashboard error", err);
    showBanner(`Dashboard error: ${err && err.message ? err.message : err}`, "error");
    return;
  }
  if (err.kind === "auth") {
    const had = Boolean(getToken());
    setToken("");
    $("signout").hidden = true;
    live.stop();
    const detail = err.detail ? `: ${err.detail}` : "";
    showBanner(
      had
        ? `Token refused (HTTP ${err.status})${detail}. Enter a token with the viewer role.`
        : `This controller needs a token (HTTP ${err.status}). Enter a viewer token.`,
      "auth",
    );
    $("login").hidden = false;
    $("token").focus();
    return;
  }
  if (err.kind === "unreachable") {
    showBanner(`Controller unreachable at ${location.origin} (${err.detail}); retrying.`, "error");
    return;
  }
  if (err.kind === "standby") {
    showBanner(`This controller replica is a standby${err.detail ? ` (${err.detail})` : ""}; open the leader's dashboard.`, "error");
    return;
  }
  showBanner(err.detail, "error");
}

/** The route's captured names, decoded. A malformed %-escape (#/node/%E0) is a page that
 *  does not exist, shown as any not-found is, not a URIError that would leave the old page
 *  up with no word: it is thrown inside route()'s error handling for that reason. */
function decodeArgs(match, path) {
  try {
    return match.slice(1).map(decodeURIComponent);
  } catch {
    throw new ApiError("http", 404, `No such page: #${path} has a malformed %-escape.`);
  }
}

/** Render the page for the current hash; a newer navigation wins over a slower one. */
async function route() {
  const { path, params } = parseHash();
  const found = ROUTES.find(([re]) => re.test(path));
  if (!found) {
    location.replace("#/fleet");
    return;
  }
  const [re, nav, pageOf] = found;
  const match = path.match(re);
  for (const a of document.querySelectorAll("nav a")) {
    if (a.dataset.nav === nav) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  const seq = ++renderSeq;
  if (current && current.dispose) current.dispose();
  current = null;
  const view = $("view");
  const ctx = {
    args: [],
    params,
    operator: session.role === "operator",
    isCurrent: () => seq === renderSeq,
    onError: handleError,
    ok: () => {
      if (seq !== renderSeq) return;
      view.classList.remove("stale");
      const kind = $("banner").classList;
      if (!kind.contains("action") && !kind.contains("warn")) clearBanner();
    },
  };
  try {
    ctx.args = decodeArgs(match, path);
    const page = pageOf();
    const mounted = await page(ctx);
    if (seq !== renderSeq) {
      if (mounted && mounted.dispose) mounted.dispose();
      return;
    }
    view.replaceChildren(mounted.node);
    view.dataset.page = nav;
    current = mounted;
    ctx.ok();
    $("login").hidden = true;
  } catch (err) {
    if (seq !== renderSeq) return;
    if (err instanceof ApiError && err.kind === "http" && err.status === 404) {
      // A deep link to something that does not exist (or no longer does): say so in place
      // of the page, never leave the previous page (another node's, another job's) up.
      const text = notFoundText(path, ctx.args, err.detail);
      view.replaceChildren(notFoundPanel(text, nav, err.detail));
      view.dataset.page = nav;
      $("login").hidden = true;
      handleError(new ApiError("http", 404, text));
      return;
    }
    handleError(err);
  }
}

const LISTS = { fleet: ["#/fleet", "the fleet"], jobs: ["#/jobs", "all jobs"], incidents: ["#/incidents", "all incidents"] };

/** "No such node: nope." for #/node/nope; a malformed address keeps its own sentence. */
function notFoundText(path, args, detail) {
  if (/^No such page/.test(detail)) return detail;
  const what = { node: "node", job: "job", incident: "incident" }[path.split("/")[1]] || "page";
  return `No such ${what}: ${what === "incident" ? "#" : ""}${args[0] || path}. The controller knows no ${what} by that name (HTTP 404).`;
}

function notFoundPanel(text, nav, detail) {
  const [href, name] = LISTS[nav] || LISTS.fleet;
  const back = document.createElement("a");
  back.href = href;
  back.textContent = `Back to ${name}`;
  return el(
    "div",
    "page not-found",
    el("h2", null, "Not found"),
    el("p", "summary", text),
    detail && detail !== text ? el("p", "muted summary", detail) : null,
    el("p", null, back),
  );
}

async function signIn() {
  try {
    const me = await get("/whoami");
    session.role = me.role;
    session.name = me.name;
    $("whoami").textContent = me.role ? `${me.name} (${me.role})` : "anonymous (read-only)";
    $("signout").hidden = !getToken();
    $("login").hidden = true;
    live.restart();
    await route();
  } catch (err) {
    handleError(err);
  }
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
  setToken(value);
  showBanner("Connecting…", "info");
  signIn();
}

function onSignout() {
  setToken("");
  session.role = null;
  live.stop();
  $("whoami").textContent = "";
  $("signout").hidden = true;
  $("view").replaceChildren();
  signIn();
}

const THEME_KEY = "trainguard.theme";

function applyTheme(theme) {
  if (theme) document.documentElement.dataset.theme = theme;
  else delete document.documentElement.dataset.theme;
}

function toggleTheme() {
  const dark =
    document.documentElement.dataset.theme === "dark" ||
    (!document.documentElement.dataset.theme && matchMedia("(prefers-color-scheme: dark)").matches);
  const next = dark ? "light" : "dark";
  applyTheme(next);
  try {
    sessionStorage.setItem(THEME_KEY, next);
  } catch {
    // not kept
  }
  window.dispatchEvent(new Event("themechange"));
}

function showLive({ state, detail }) {
  const node = $("live");
  node.dataset.state = state;
  const text = { live: "● live", behind: "◐ behind", disconnected: "✕ disconnected", connecting: "… connecting" }[state];
  node.textContent = detail ? `${text} (${detail})` : text;
  const banner = $("banner");
  if (state === "disconnected") {
    $("view").classList.add("stale");
    if (detail !== "token refused") showBanner(`Controller unreachable at ${location.origin}; live updates paused, reconnecting.`, "error");
  } else if (state === "behind") {
    if (!banner.classList.contains("error") || banner.hidden) {
      showBanner(`Live updates are behind (${detail}); the view may be out of date until they catch up.`, "warn");
    }
  } else if (state === "live") {
    if (banner.classList.contains("error") || banner.classList.contains("warn")) clearBanner();
    $("view").classList.remove("stale");
  }
}

document.addEventListener("DOMContentLoaded", () => {
  try {
    applyTheme(sessionStorage.getItem(THEME_KEY) || "");
  } catch {
    // default theme
  }
  $("login").addEventListener("submit", onLogin);
  $("signout").addEventListener("click", onSignout);
  $("theme").addEventListener("click", toggleTheme);
  live.on("state", showLive);
  live.on("error", handleError);
  // A page that missed data while the stream was down asks again once it is back.
  live.on("hello", () => {
    if (current && current.refresh) current.refresh();
  });
  // Likewise after updates were dropped or the stream stalled: "changed" hints may be lost.
  live.on("resync", () => {
    if (current && current.refresh) current.refresh();
  });
  window.addEventListener("hashchange", () => {
    route();
    $("view").focus({ preventScroll: true });
  });
  signIn();
});

export { el };
