// Formatting, with the controller's clock (from the Date header) so a skewed browser clock
// does not distort ages.
let skewS = 0;

export function noteServerClock(resp) {
  const date = Date.parse(resp.headers.get("Date") || "");
  if (Number.isNaN(date)) return;
  const skew = (date + 500 - Date.now()) / 1000;
  if (Math.abs(skew - skewS) > 1.5) skewS = skew;
}

export function setServerTime(unixS) {
  const skew = unixS - Date.now() / 1000;
  if (Math.abs(skew - skewS) > 1.5) skewS = skew;
}

export const nowS = () => Date.now() / 1000 + skewS;

/** kubectl-style: 4.2s, 45s, 7m, 5h, 3d. */
export function fmtDuration(s) {
  if (typeof s !== "number" || !Number.isFinite(s)) return "-";
  s = Math.max(0, s);
  if (s < 10) return `${s.toFixed(1)}s`;
  if (s < 120) return `${Math.floor(s)}s`;
  if (s < 2 * 3600) return `${Math.floor(s / 60)}m`;
  if (s < 48 * 3600) return `${Math.floor(s / 3600)}h`;
  return `${Math.floor(s / 86400)}d`;
}

export function fmtAge(unixS) {
  if (typeof unixS !== "number") return "-";
  return fmtDuration(nowS() - unixS);
}

export const fmtPct = (x) =>
  typeof x === "number" && Number.isFinite(x) ? `${(x * 100).toFixed(1)}%` : "-";

export function fmtBytes(n) {
  if (typeof n !== "number" || !Number.isFinite(n)) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

export const fmtW = (w) => (typeof w === "number" ? `${Math.round(w)} W` : "-");

export function fmtTime(unixS) {
  if (typeof unixS !== "number") return "-";
  return new Date(unixS * 1000).toLocaleTimeString();
}
