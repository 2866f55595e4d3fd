// A job's rank x step matrix (GET /jobs/{name}/steps), kept up to date by asking only for
// the steps after the newest one held: a 2,048-rank job's matrix is ~2.2 MB of JSON, and
// the job page refreshes it on every live change of the job. docs/dashboard.md
// "Incremental steps" says when the page asks for the whole window again.
import { get, enc } from "./api.js";

/** Steps the job page shows (the heatmap's columns). */
export const STEPS_SHOWN = 120;
/** A whole-window fetch at least this often: a cell that arrived late (a rank whose agent
 *  lagged more than the server's 3 s settle time) is filled in within a minute. */
const FULL_EVERY_MS = 60_000;
/** A refresh this long after the previous one (an idle page) fetches the whole window. */
const IDLE_MS = 30_000;

/**
 * The job's steps as the page shows them. `fetch()` resolves to the matrix (same shape as
 * the endpoint's answer) or null (404: none held for the job); one request at a time.
 */
export function jobSteps(name, { last = STEPS_SHOWN } = {}) {
  let held = null;
  let fullAt = 0;
  let fetchedAt = 0;
  let wasHidden = false;
  const onVisibility = () => {
    if (document.visibilityState === "hidden") wasHidden = true;
  };
  document.addEventListener("visibilitychange", onVisibility);
  const path = (after) => `/jobs/${enc(name)}/steps?last=${last}${after === null ? "" : `&after=${after}`}`;

  async function ask(after) {
    const answer = await get(path(after), { notFoundIsNull: true });
    const now = Date.now();
    fetchedAt = now;
    if (answer === null || after === null || !answer.incremental) {
      // Whole window (asked for, or the server could not send a delta and sent it instead).
      fullAt = now;
      wasHidden = false;
      return answer;
    }
    if (answer.epoch !== held.epoch) return ask(null); // restarted lower, or resized
    return mergeSteps(held, answer, last);
  }

  async function once() {
    const now = Date.now();
    // An answer from a controller without deltas has no next_after: ask for the whole.
    const stale = !held || typeof held.next_after !== "number" || wasHidden || now - fullAt > FULL_EVERY_MS || now - fetchedAt > IDLE_MS;
    held = await ask(stale ? null : held.next_after);
    return held;
  }

  let chain = Promise.resolve();
  return {
    fetch() {
      const next = chain.then(once, once);
      chain = next.catch(() => {});
      return next;
    },
    dispose() {
      document.removeEventListener("visibilitychange", onVisibility);
    },
  };
}

/**
 * `held` (a whole window or an earlier merge) with `delta` (the steps after `delta.after`)
 * merged in: held steps up to `after` and from the server's window start (`first_step`),
 * then the delta's, the newest `last` of them; ranks with no cell left drop out, as the
 * server leaves them out of a whole answer. Everything else is the delta's (fresher).
 */
export function mergeSteps(held, delta, last) {
  const first = delta.first_step === null ? -Infinity : delta.first_step;
  const kept = [];
  held.steps.forEach((s, i) => {
    if (s <= delta.after && s >= first) kept.push(i);
  });
  const drop = Math.max(0, kept.length + delta.steps.length - last);
  const column = (old, fresh) => [...kept.map((i) => (old ? old[i] : null)), ...fresh].slice(drop);
  const before = new Map(held.ranks.map((r) => [r.rank, r]));
  const now = new Map(delta.ranks.map((r) => [r.rank, r]));
  const numbers = [...new Set([...before.keys(), ...now.keys()])].sort((a, b) => a - b);
  const ranks = [];
  for (const rank of numbers) {
    const old = before.get(rank);
    const fresh = now.get(rank);
    const times = column(old && old.step_time_s, fresh ? fresh.step_time_s : delta.steps.map(() => null));
    if (times.every((v) => v === null)) continue;
    ranks.push({ ...(fresh || old), step_time_s: times });
  }
  return {
    ...delta,
    steps: column(held.steps, delta.steps),
    end_unix_s: column(held.end_unix_s, delta.end_unix_s),
    median_s: column(held.median_s, delta.median_s),
    max_s: column(held.max_s, delta.max_s),
    ranks,
  };
}
