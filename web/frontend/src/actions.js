// Operator actions: a button (shown to the operator role only) that opens a confirmation
// naming the effect, then calls the existing API route. The API checks the role itself.
import { post, ApiError } from "./api.js";
import { el, attrs } from "./dom.js";
import { session } from "./session.js";

const $ = (id) => document.getElementById(id);

/** Ask; resolves to the reason typed (or "" when none is asked), or null when cancelled. */
function confirmEffect({ title, effect, reason }) {
  const dialog = $("confirm");
  $("confirm-title").textContent = title;
  $("confirm-effect").textContent = typeof effect === "function" ? effect() : effect;
  const input = $("confirm-reason");
  const label = $("confirm-reason-label");
  input.hidden = label.hidden = !reason;
  input.value = reason ? reason.default || "" : "";
  input.required = Boolean(reason);
  $("confirm-ok").textContent = title;
  return new Promise((resolve) => {
    const done = () => {
      dialog.removeEventListener("close", done);
      resolve(dialog.returnValue === "ok" ? input.value.trim() : null);
    };
    dialog.returnValue = "";
    dialog.addEventListener("close", done);
    dialog.showModal();
    (reason ? input : $("confirm-cancel")).focus();
  });
}

function say(text, kind) {
  const banner = $("banner");
  banner.textContent = text;
  banner.className = `banner action ${kind}`;
  banner.hidden = false;
  setTimeout(() => {
    if (banner.textContent === text) {
      banner.hidden = true;
      banner.className = "banner";
    }
  }, 8000);
}

/**
 * An action button, or null for a viewer. spec: {label, title, effect, path, body(reason),
 * reason: {default} | undefined, done(result)}; effect may be a function, called when the
 * button is clicked (text about data that moves, read as it is then).
 */
export function actionButton(spec) {
  if (session.role !== "operator") return null;
  const button = el("button", "act", spec.label);
  attrs(button, { type: "button", "data-action": spec.id || spec.label });
  button.addEventListener("click", async () => {
    const reason = await confirmEffect(spec);
    if (reason === null) return;
    if (spec.reason && !reason) return;
    button.disabled = true;
    try {
      const result = spec.run ? await spec.run(reason) : await post(spec.path, spec.body ? spec.body(reason) : {});
      say(`${spec.title}: done.`, "info");
      if (spec.done) spec.done(result);
    } catch (err) {
      const detail = err instanceof ApiError ? err.detail || `HTTP ${err.status}` : String(err);
      say(`${spec.title} failed: ${detail}`, "error");
    } finally {
      button.disabled = false;
    }
  });
  return button;
}

export function actionBar(...buttons) {
  const kept = buttons.filter(Boolean);
  return kept.length ? el("div", "actions-bar", ...kept) : null;
}
