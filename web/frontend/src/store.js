// The fleet as the stream describes it: a full snapshot on every (re)connect, then only the
// nodes that changed. Kept across page changes so the fleet page opens at once.
import { live } from "./live.js";

export const fleet = { nodes: new Map(), version: 0, listeners: new Set(), complete: false };

/** Worst first. "simulated" is not a state: it is marked on the cell as well. */
export const STATES = ["lost", "unhealthy", "unreachable", "cordoned", "degraded", "unknown", "healthy"];
export const STATE_GLYPH = {
  lost: "■",
  unhealthy: "✕",
  unreachable: "?",
  cordoned: "⊘",
  degraded: "◐",
  unknown: "…",
  healthy: "",
};

/** One state per node, the worst that applies. */
export function nodeState(n) {
  if (n.h === "lost") return "lost";
  if (n.h === "unhealthy") return "unhealthy";
  if (n.silent) return "unreachable";
  if (n.iso !== null && n.iso !== undefined) return "cordoned";
  if (n.b > 0 || n.i > 0) return "degraded";
  if (n.h === "unknown") return "unknown";
  return "healthy";
}

live.on("nodes", (msg) => {
  if (msg.full) {
    fleet.nodes.clear();
    fleet.complete = true;
  }
  const changed = [];
  for (const n of msg.data) {
    fleet.nodes.set(n.n, n);
    changed.push(n.n);
  }
  for (const name of msg.removed || []) fleet.nodes.delete(name);
  fleet.version += 1;
  for (const fn of fleet.listeners) fn({ full: Boolean(msg.full), changed, removed: msg.removed || [] });
});

export function onFleet(fn) {
  fleet.listeners.add(fn);
  return () => fleet.listeners.delete(fn);
}
