// Live updates: server-sent events from GET /api/v1/stream, read with fetch() so the token
// goes in the Authorization header (EventSource cannot send one). Reconnects by itself
// with backoff; says "behind" when events stop arriving or arrive late, "disconnected"
// while the controller cannot be reached. The server sends a full snapshot on every
// (re)connect, and to a client whose queue overflowed (with the count of updates it
// missed): either way the client says so, shows the snapshot and asks the page to fetch
// again ("resync"), so nothing missed stays missing.
import { API, ApiError, authHeaders } from "./api.js";
import { nowS, setServerTime } from "./format.js";

const BEHIND_AFTER_MS = 8000; // the server sends at least a heartbeat every 3 s
const RECONNECT_AFTER_MS = 15000;
const LATE_S = 5;
const SHOW_MISSED_MS = 5000; // how long "behind: N updates missed" stays up after a resync

export class Live {
  constructor() {
    this.handlers = new Map();
    this.state = "connecting";
    this.lastEventAt = 0;
    this.lastServerLagS = 0;
    this.abort = null;
    this.retryMs = 500;
    this.stopped = true;
    this.watchdog = null;
    this.behindUntil = 0;
    this.missedTotal = 0;
  }

  on(type, fn) {
    if (!this.handlers.has(type)) this.handlers.set(type, new Set());
    this.handlers.get(type).add(fn);
    return () => this.handlers.get(type).delete(fn);
  }

  emit(type, data) {
    for (const fn of this.handlers.get(type) || []) {
      try {
        fn(data);
      } catch (err) {
        console.error("live handler failed", type, err);
      }
    }
  }

  setState(state, detail) {
    if (state === this.state && !detail) return;
    this.state = state;
    this.emit("state", { state, detail: detail || "" });
  }

  start() {
    if (!this.stopped) return;
    this.stopped = false;
    this.connect();
    this.watchdog = setInterval(() => this.check(), 1000);
  }

  stop() {
    this.stopped = true;
    if (this.abort) this.abort.abort();
    clearInterval(this.watchdog);
  }

  restart() {
    this.stop();
    this.start();
  }

  check() {
    if (this.state === "disconnected" || this.state === "connecting") return;
    const quiet = performance.now() - this.lastEventAt;
    if (quiet > RECONNECT_AFTER_MS) {
      if (this.abort) this.abort.abort(); // the read loop reconnects
      return;
    }
    if (quiet > BEHIND_AFTER_MS) {
      this.setState("behind", `no update for ${Math.round(quiet / 1000)} s`);
    } else if (this.lastServerLagS > LATE_S) {
      this.setState("behind", `updates arrive ${Math.round(this.lastServerLagS)} s late`);
    } else if (this.state === "behind" && performance.now() >= this.behindUntil) {
      this.setState("live");
    }
  }

  async connect() {
    while (!this.stopped) {
      const abort = new AbortController();
      this.abort = abort;
      try {
        const resp = await fetch(`${API}/stream`, {
          headers: { Accept: "text/event-stream", ...authHeaders() },
          cache: "no-store",
          credentials: "omit",
          signal: abort.signal,
        });
        if (resp.status === 401 || resp.status === 403) {
          this.stopped = true;
          this.setState("disconnected", "token refused");
          this.emit("error", new ApiError("auth", resp.status, ""));
          return;
        }
        if (!resp.ok || !resp.body) throw new Error(`HTTP ${resp.status}`);
        this.retryMs = 500;
        await this.read(resp.body.getReader());
      } catch {
        // fall through to the reconnect below
      }
      if (this.stopped) return;
      this.setState("disconnected", `reconnecting in ${Math.round(this.retryMs / 1000)} s`);
      this.emit("down", null);
      await new Promise((r) => setTimeout(r, this.retryMs));
      this.retryMs = Math.min(this.retryMs * 2, 4000);
    }
  }

  async read(reader) {
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        this.dispatch(block);
      }
    }
  }

  dispatch(block) {
    let type = "message";
    const data = [];
    for (const line of block.split("\n")) {
      if (line.startsWith("event:")) type = line.slice(6).trim();
      else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
    }
    if (data.length === 0) return;
    let parsed;
    try {
      parsed = JSON.parse(data.join("\n"));
    } catch {
      return;
    }
    const wasQuietMs = this.lastEventAt ? performance.now() - this.lastEventAt : 0;
    this.lastEventAt = performance.now();
    if (typeof parsed.t === "number") {
      if (type === "hello") setServerTime(parsed.t);
      this.lastServerLagS = Math.max(0, nowS() - parsed.t);
    }
    const missed = type === "nodes" && parsed.full && typeof parsed.missed === "number" ? parsed.missed : 0;
    if (missed > 0) {
      // The server dropped updates this client was too slow to take, and sent a snapshot.
      this.missedTotal += missed;
      this.behindUntil = performance.now() + SHOW_MISSED_MS;
      this.setState("behind", `${missed} update${missed === 1 ? "" : "s"} missed; caught up from a snapshot`);
    } else if (this.state === "behind" && wasQuietMs > BEHIND_AFTER_MS) {
      // Back after a stall: the page may have missed "changed" hints in the meantime.
      this.behindUntil = 0;
      this.emit("resync", { reason: "stall" });
    }
    if (this.state !== "live" && this.lastServerLagS <= LATE_S && performance.now() >= this.behindUntil) {
      this.setState("live");
    }
    this.emit(type, parsed);
    if (missed > 0) this.emit("resync", { reason: "missed", missed });
  }
}

export const live = new Live();
