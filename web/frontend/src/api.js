// The controller's /api/v1 from the browser. The token lives in sessionStorage only (this
// tab), is sent only in the Authorization header of same-origin calls, never in a URL.
import { noteServerClock } from "./format.js";

export const API = "/api/v1";
const TIMEOUT_MS = 8000;
const TOKEN_KEY = "trainguard.token";

export class ApiError extends Error {
  /** kind: "auth" (401/403), "unreachable", "standby" (503), "http" (anything else). */
  constructor(kind, status, detail) {
    super(detail);
    this.kind = kind;
    this.status = status;
    this.detail = detail;
  }
}

function readToken() {
  try {
    return sessionStorage.getItem(TOKEN_KEY) || "";
  } catch {
    return "";
  }
}

let token = readToken();

export const getToken = () => token;

export function setToken(value) {
  try {
    if (value) sessionStorage.setItem(TOKEN_KEY, value);
    else sessionStorage.removeItem(TOKEN_KEY);
  } catch {
    // Storage disabled: the token lasts until the page reloads.
  }
  token = value;
}

export function authHeaders() {
  return token ? { Authorization: `Bearer ${token}` } : {};
}

async function call(method, path, body, { notFoundIsNull = false } = {}) {
  const headers = { Accept: "application/json", ...authHeaders() };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(), TIMEOUT_MS);
  let resp;
  try {
    resp = await fetch(API + path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      signal: abort.signal,
      cache: "no-store",
      credentials: "omit",
    });
  } catch {
    const why = abort.signal.aborted ? `no answer within ${TIMEOUT_MS / 1000} s` : "no connection";
    throw new ApiError("unreachable", 0, why);
  } finally {
    clearTimeout(timer);
  }
  noteServerClock(resp);
  if (resp.ok) return resp.status === 204 ? null : resp.json();
  if (resp.status === 404 && notFoundIsNull) return null;
  let detail = "";
  try {
    const parsed = await resp.json();
    if (parsed && typeof parsed.detail === "string") detail = parsed.detail;
    else if (parsed && Array.isArray(parsed.detail)) detail = parsed.detail.map((d) => d.msg).join("; ");
  } catch {
    // Not JSON: the status says enough.
  }
  if (resp.status === 401 || resp.status === 403) throw new ApiError("auth", resp.status, detail);
  if (resp.status === 503) throw new ApiError("standby", 503, detail);
  throw new ApiError("http", resp.status, `${method} ${API}${path}: HTTP ${resp.status} ${detail}`);
}

export const get = (path, opts) => call("GET", path, undefined, opts);
export const post = (path, body) => call("POST", path, body === undefined ? {} : body);
export const enc = encodeURIComponent;
