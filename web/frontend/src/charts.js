// Charts: uPlot for time series (one series per GPU/rank/domain), a canvas heatmap for
// rank x step. Colours come from the Okabe-Ito palette (colour-blind safe) and every series
// also differs by dash pattern; the heatmap uses a sequential scale with a text summary.
import uPlot from "uplot";
import { el, attrs } from "./dom.js";

export const PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#999999"];
const DASHES = [[], [6, 3], [2, 2], [8, 3, 2, 3], [], [6, 3], [2, 2], [8, 3, 2, 3]];

function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || "#888";
}

/**
 * A time-series chart. series: [{label, values}], x: unix seconds (shared).
 * marks: [{t, label, kind}] drawn as vertical lines (incidents, checkpoints, restarts).
 */
export function timeChart({ title, unit, x, series, marks = [], height = 180, yRange }) {
  const box = el("figure", "chart");
  const caption = el("figcaption", null, unit ? `${title} (${unit})` : title);
  box.append(caption);
  if (!x.length) {
    box.append(el("p", "not-reported", "no samples in this window"));
    return { node: box, dispose() {} };
  }
  const axisColor = cssVar("--muted");
  const grid = cssVar("--line");
  const opts = {
    width: 560,
    height,
    legend: { live: true },
    cursor: { drag: { x: true, y: false } },
    // One sample (or none apart) would stretch the axis over years: keep a minute at least.
    scales: {
      x: { time: true, range: (u, min, max) => (max - min < 60 ? [min - 1, min + 60] : [min, max]) },
      y: yRange ? { range: yRange } : {},
    },
    axes: [
      { stroke: axisColor, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid } },
      { stroke: axisColor, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid }, size: 56 },
    ],
    series: [
      {},
      ...series.map((s, i) => ({
        label: s.label,
        stroke: s.color || PALETTE[i % PALETTE.length],
        dash: s.dash || DASHES[i % DASHES.length],
        width: s.width || 1.5,
        // Few samples (a node that just started): draw them as points, or nothing shows.
        points: { show: s.values.filter((v) => v !== null && v !== undefined).length < 30 },
        spanGaps: false,
      })),
    ],
    hooks: {
      draw: [
        (u) => {
          const ctx = u.ctx;
          for (const m of marks) {
            const px = u.valToPos(m.t, "x", true);
            if (px < u.bbox.left || px > u.bbox.left + u.bbox.width) continue;
            ctx.save();
            ctx.strokeStyle = MARK_COLORS[m.kind] || axisColor;
            ctx.setLineDash(m.kind === "checkpoint" ? [3, 3] : m.kind === "restart" ? [8, 4] : []);
            ctx.lineWidth = 1.5 * devicePixelRatio;
            ctx.beginPath();
            ctx.moveTo(px, u.bbox.top);
            ctx.lineTo(px, u.bbox.top + u.bbox.height);
            ctx.stroke();
            ctx.restore();
          }
        },
      ],
    },
  };
  const plot = new uPlot(opts, [x, ...series.map((s) => s.values)], box);
  attrs(plot.root, { role: "img", "aria-label": `${title}: ${series.length} series, ${x.length} points` });
  if (marks.length) {
    box.append(
      el(
        "ul",
        "marks",
        marks.slice(-12).map((m) => el("li", `mark-${m.kind}`, `${MARK_GLYPHS[m.kind] || "|"} ${m.label}`)),
      ),
    );
  }
  const fit = () => {
    const w = Math.max(280, Math.min(box.clientWidth || 560, 900));
    plot.setSize({ width: w, height });
  };
  const observer = new ResizeObserver(fit);
  observer.observe(box);
  return {
    node: box,
    plot,
    dispose() {
      observer.disconnect();
      plot.destroy();
    },
  };
}

export const MARK_COLORS = { incident: "#D55E00", checkpoint: "#0072B2", restart: "#CC79A7", cap: "#E69F00" };
export const MARK_GLYPHS = { incident: "✕", checkpoint: "◆", restart: "↻", cap: "▼" };

// Sequential scale (cividis-like: readable with every common colour-vision deficiency).
const SCALE = ["#00204c", "#213d6b", "#555b6c", "#7b7a77", "#a59c74", "#d3c064", "#ffe945"];

function scaleColor(f) {
  const x = Math.max(0, Math.min(1, f)) * (SCALE.length - 1);
  return SCALE[Math.round(x)];
}

/**
 * Rank x step heatmap of step time. ranks: [rank], steps: [step], cell(rank, step) -> s|null.
 * marked: Map(rank -> "straggler"|"hang"|...). Colour = step time / median of the step.
 */
/** At most this many rows: a wider job's ranks are drawn in bands of consecutive ranks,
 *  each cell the band's slowest (a 2,048-rank heatmap at 2 px a rank was 4,096 px tall,
 *  and a straggler still shows: a band is as slow as its slowest rank). */
export const HEATMAP_ROWS = 210;

export function heatmap({ ranks, steps, value, marked, labelOf }) {
  const box = el("figure", "heatmap");
  const perRow = Math.max(1, Math.ceil(ranks.length / HEATMAP_ROWS));
  box.append(
    el(
      "figcaption",
      null,
      "Step time per rank (colour: time / median of that step; darker is faster)",
      perRow > 1 ? `; ${perRow} consecutive ranks a row, coloured by the slowest of them` : "",
    ),
  );
  if (!ranks.length || !steps.length) {
    box.append(el("p", "not-reported", "no step summaries received yet"));
    return box;
  }
  const bands = [];
  for (let i = 0; i < ranks.length; i += perRow) bands.push(ranks.slice(i, i + perRow));
  const cellW = Math.max(2, Math.min(14, Math.floor(800 / steps.length)));
  const cellH = Math.max(2, Math.min(14, Math.floor(420 / bands.length)));
  const canvas = el("canvas");
  canvas.width = steps.length * cellW;
  canvas.height = bands.length * cellH;
  const ctx = canvas.getContext("2d");
  const medians = steps.map((s) => {
    const vals = ranks.map((r) => value(r, s)).filter((v) => typeof v === "number").sort((a, b) => a - b);
    return vals.length ? vals[Math.floor(vals.length / 2)] : null;
  });
  const slowest = new Map();
  bands.forEach((band, bi) => {
    steps.forEach((s, si) => {
      const m = medians[si];
      let worst = null;
      for (const r of band) {
        const v = value(r, s);
        if (typeof v !== "number" || !m) continue;
        const ratio = v / m;
        slowest.set(r, Math.max(slowest.get(r) || 0, ratio));
        worst = worst === null ? ratio : Math.max(worst, ratio);
      }
      if (worst === null) return;
      // 1.0 (median) -> low end, 2.0 and above -> top end.
      ctx.fillStyle = scaleColor(worst - 1);
      ctx.fillRect(si * cellW, bi * cellH, cellW, cellH);
    });
  });
  const labels = el("ol", "hm-ranks");
  bands.forEach((band) => {
    const hit = band.find((r) => marked.has(r));
    const mark = hit === undefined ? null : `${marked.get(hit)}${band.length > 1 ? ` (rank ${hit})` : ""}`;
    const name = band.length > 1 ? `r${band[0]}–r${band[band.length - 1]}` : labelOf(band[0]);
    const li = el("li", mark ? "marked" : null, `${name}${mark ? ` ◀ ${mark}` : ""}`);
    li.style.height = `${cellH}px`;
    li.style.lineHeight = `${cellH}px`;
    if (cellH < 10 && !mark) li.classList.add("tiny");
    labels.append(li);
  });
  attrs(canvas, {
    role: "img",
    "aria-label":
      `Heatmap of ${ranks.length} ranks by ${steps.length} steps, steps ${steps[0]} to ${steps[steps.length - 1]}` +
      (perRow > 1 ? `, ${perRow} ranks a row` : ""),
  });
  const legend = el(
    "div",
    "hm-legend",
    "median ",
    ...SCALE.map((c) => {
      const sw = el("span", "swatch");
      sw.style.background = c;
      return sw;
    }),
    " ≥ 2× median",
  );
  const worst = [...slowest.entries()].sort((a, b) => b[1] - a[1]).slice(0, 3);
  const summary = el(
    "p",
    "hm-summary",
    `Steps ${steps[0]}–${steps[steps.length - 1]}. Slowest ranks (worst step / median): `,
    worst.map(([r, x]) => `rank ${r} ${x.toFixed(2)}×`).join(", "),
  );
  box.append(el("div", "hm-body", labels, canvas), legend, summary);
  return box;
}
