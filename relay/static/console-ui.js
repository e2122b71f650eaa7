// Small DOM helpers for the console: elements built with textContent (never innerHTML, so
// nothing an executor or a caller sends can become markup), tables, pagers, dialogs, times.

// The bidirectional formatting characters (the marks U+061C, U+200E, U+200F, the embeddings and
// overrides U+202A-U+202E, the isolates U+2066-U+2069): one in a workflow id or an error drew the
// text after it, up to the end of its block, in another order than it has (an audit entry's
// "x\u202e, second" read "x dnoces ,"). Every text put on the page shows them escaped, as the
// command line does (\u202e): legible, and reordering nothing.
const BIDI_CONTROLS = /[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/g;

export function plain(text) {
  return String(text).replace(BIDI_CONTROLS, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, "0")}`);
}

// A command shown for copying into a shell: each word as bash or zsh reads it back, character for
// character. A word of letters, digits and _@%+=:,./- is left as it is; another is single-quoted;
// one with a control or a bidirectional character goes in ANSI-C quotes with that character escaped
// ($'cut\u202e'): legible, as plain shows it, and the shell makes it the character again (the
// escape plain shows, copied as it is, named another executor). Options come after the arguments,
// or before "--" and them when an argument starts with "-" (not to be read as an option).
const SHELL_SAFE = /^[A-Za-z0-9_@%+=:,./-]+$/;
const SHELL_ESCAPED = /[\u0000-\u001f\u007f-\u009f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/g;

function shellWord(text) {
  const s = String(text);
  if (SHELL_SAFE.test(s)) return s;
  if (!s.match(SHELL_ESCAPED)) return `'${s.replaceAll("'", "'\\''")}'`;
  const escaped = s.replace(/[\\']/g, (c) => `\\${c}`)
    .replace(SHELL_ESCAPED, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, "0")}`);
  return `$'${escaped}'`;
}

export function shellCommand(command, args, options = []) {
  const dashed = args.some((a) => String(a).startsWith("-"));
  const words = args.map(shellWord);
  return [command, ...(dashed ? [...options, "--", ...words] : [...words, ...options])].join(" ");
}

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") el.className = value;
    else if (name.startsWith("on") && typeof value === "function") el.addEventListener(name.slice(2), value);
    else if (name === "dataset") Object.assign(el.dataset, value);
    else el.setAttribute(name, value === true ? "" : String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(plain(child)));
  }
}

// The values a badge is coloured by (console.css): DBOS's workflow statuses, executor states, recovery
// statuses and Relay's own. A value is a class only if it is one of them: an executor chooses the status
// text it reports, and "SUCCESS alert", say, would have taken the page's own classes. Anything else
// gets the neutral "other", its text shown as it is.
const BADGE_CLASSES = new Set([
  "PENDING", "ENQUEUED", "DELAYED", "SUCCESS", "ERROR", "CANCELLED", "MAX_RECOVERY_ATTEMPTS_EXCEEDED",
  "HEALTHY", "DISCONNECTED", "DEAD", "RECOVERING", "AVAILABLE", "UNAVAILABLE",
  "dispatching", "waiting_for_peer", "awaiting_operator", "succeeded", "failed", "blocked", "live", "released", "expired",
  "executor_back",
]);

export function badge(value, label) {
  return h("span", {class: `badge ${BADGE_CLASSES.has(value) ? value : "other"}`}, label ?? value ?? "");
}

export function when(iso) {
  if (!iso) return "";
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return String(iso);
  // The attribute in HTML's form (at most three fraction digits; Relay's times have six), the title as served.
  return h("time", {datetime: d.toISOString(), title: iso}, d.toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z"));
}

export function ago(iso) {
  if (!iso) return "";
  const secs = Math.max(0, (Date.now() - new Date(iso).getTime()) / 1000);
  if (secs < 90) return `${Math.round(secs)} s ago`;
  if (secs < 5400) return `${Math.round(secs / 60)} min ago`;
  if (secs < 172800) return `${Math.round(secs / 3600)} h ago`;
  return `${Math.round(secs / 86400)} days ago`;
}

export function duration(fromIso, toIso) {
  if (!fromIso || !toIso) return "";
  const ms = new Date(toIso).getTime() - new Date(fromIso).getTime();
  if (!Number.isFinite(ms)) return "";
  return ms < 1000 ? `${ms} ms` : `${(ms / 1000).toFixed(ms < 10000 ? 2 : 1)} s`;
}

// A table: columns are [header, cell(row) => node, {num: true}?]; an empty list says so. It scrolls
// sideways in its own box (a phone's width), which the keyboard can reach and scroll: the page
// itself, its header and filters, stays as wide as the window.
export function table(caption, columns, rows, {rowAttrs, empty = "Nothing to show."} = {}) {
  if (!rows.length) return h("p", {class: "note"}, empty);
  return h("div", {class: "scroll", tabindex: "0", role: "region", "aria-label": caption}, h("table", {},
    h("caption", {}, caption),
    h("thead", {}, h("tr", {}, columns.map(([head, , opts]) => h("th", {scope: "col", class: opts?.num ? "num" : null}, head)))),
    h("tbody", {}, rows.map((row) => h("tr", rowAttrs ? rowAttrs(row) : {},
      columns.map(([, cell, opts], i) => i === 0
        ? h("th", {scope: "row", class: opts?.num ? "num" : null}, cell(row))
        : h("td", {class: opts?.num ? "num" : null}, cell(row))))))));
}

// Previous/next for a page of `limit` at `offset`; `total` when known, else "more" when the page was full.
export function pager(label, {offset, limit, shown, total, go}) {
  const first = shown ? offset + 1 : 0;
  const last = offset + shown;
  const more = total !== undefined && total !== null ? last < total : shown === limit;
  const range = total !== undefined && total !== null ? `${first}–${last} of ${total}` : `${first}–${last}`;
  return h("nav", {class: "pager", "aria-label": label},
    h("button", {type: "button", class: "secondary", disabled: offset === 0, onclick: () => go(Math.max(0, offset - limit))}, "Previous page"),
    h("span", {}, shown ? `Showing ${range}` : "No rows"),
    h("button", {type: "button", class: "secondary", disabled: !more, onclick: () => go(offset + limit)}, "Next page"));
}

// A modal confirmation: resolves with the form's values, or null if dismissed. Focus goes to the
// first field, or the confirm button, or for a destructive action (danger) to the button that
// keeps things as they are, so that a second Enter does not do it (WAI-ARIA's alert dialog: focus
// the least destructive action); and back to what had it when the dialog closes.
export function confirmDialog({title, body, confirm, danger = false, fields = []}) {
  return new Promise((resolve) => {
    const opener = document.activeElement;
    const titleId = `dlg-${Math.random().toString(36).slice(2)}`;
    const form = h("form", {method: "dialog"},
      h("h2", {id: titleId}, title),
      h("p", {}, body),
      fields.map((f) => h("label", {}, f.label, h("input", {name: f.name, type: f.type || "text", value: f.value ?? "", min: f.min, required: f.required, checked: f.checked}))),
      h("div", {class: "actions"},
        h("button", {type: "submit", value: "confirm", class: danger ? "danger" : null}, confirm),
        h("button", {type: "submit", value: "cancel", class: "secondary", formnovalidate: true}, "Keep it as it is")));
    const dialog = h("dialog", {"aria-labelledby": titleId}, form);
    document.body.append(dialog);
    dialog.addEventListener("close", () => {
      const values = Object.fromEntries(new FormData(form).entries());
      const ok = dialog.returnValue === "confirm";
      dialog.remove();
      if (opener && opener.isConnected) opener.focus();
      resolve(ok ? values : null);
    });
    dialog.showModal();
    const keep = form.querySelector('button[value="cancel"]');
    (form.querySelector("input") || (danger ? keep : form.querySelector("button"))).focus();
  });
}

export function announce(text) {
  const region = document.getElementById("announce");
  region.textContent = "";
  setTimeout(() => { region.textContent = plain(text); }, 30);
}

export function problemText(err) {
  return plain(err && err.message ? err.message : String(err));
}
