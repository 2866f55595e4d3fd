// DOM helpers. Every string from the API becomes a text node: no HTML parsing sink is used
// anywhere in the dashboard (tests/web checks the bundle for them).

/** An element with class and children; strings become text nodes, null/undefined skipped. */
export function el(tag, className, ...children) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

/** Set attributes (values as strings, never markup). */
export function attrs(node, values) {
  for (const [k, v] of Object.entries(values)) {
    if (v === null || v === undefined || v === false) node.removeAttribute(k);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  return node;
}

export function link(href, ...children) {
  const a = el("a", null, ...children);
  a.href = href;
  return a;
}

export const dash = (v) => (v === null || v === undefined || v === "" ? "-" : v);

export function table(columns, rows, emptyText, className) {
  const head = el("tr", null, ...columns.map((c) => attrs(el("th", null, c), { scope: "col" })));
  const body = el("tbody");
  if (rows.length === 0) {
    const td = el("td", "empty", emptyText);
    td.colSpan = columns.length;
    body.append(el("tr", null, td));
  } else {
    body.append(...rows);
  }
  return el("table", className, el("thead", null, head), body);
}

export function row(cells, data) {
  const tr = el("tr");
  for (const cell of cells) {
    tr.append(cell instanceof HTMLTableCellElement ? cell : el("td", null, dash(cell)));
  }
  if (data) attrs(tr, data);
  return tr;
}

export function td(className, ...children) {
  return el("td", className, ...children);
}

export function section(title, ...children) {
  const h = el("h2", null, title);
  return el("section", null, h, ...children);
}

/** A "not reported" note: said plainly where the controller has no such data. */
export function notReported(what) {
  return el("p", "not-reported", `${what}: not reported by the controller.`);
}

/** Replace a node's children, skipping null/undefined/false (an absent action bar). */
export function fill(node, ...children) {
  node.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
  return node;
}
