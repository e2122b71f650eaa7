// The console: sign-in, hash routing, and live updates. Each page reads only what it shows (one
// page of a list at a time) and reads it again when the event stream says something it shows
// changed; a failed read is tried again (retryLater), and a page showing unfinished workflows reads
// again every few seconds (pollLater): nothing else is polled.

import {api, readEvents, session} from "./console-api.js";
import {ago, h, plain, problemText} from "./console-ui.js";
import {pageFor} from "./console-pages.js";

const main = document.getElementById("main");
const live = document.getElementById("live");
let current = null;   // the page shown
let who = null;       // GET /whoami of the key signed in
let stream = null;    // AbortController of the event stream

function parseRoute() {
  const raw = location.hash.replace(/^#/, "") || "/";
  const [path, search = ""] = raw.split("?");
  const parts = path.split("/").filter(Boolean).map((p) => {
    try { return decodeURIComponent(p); } catch { return p; }
  });
  return {parts, params: new URLSearchParams(search)};
}

export function go(parts, params = {}) {
  const path = "/" + parts.map((p) => encodeURIComponent(p)).join("/");
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== null && v !== "") q.set(k, v);
  const text = q.toString();
  const hash = `#${path}${text ? `?${text}` : ""}`;
  // The same address again (Search or Filter with the filters unchanged): no hashchange comes, but
  // the operator asks where things stand now (a finished workflow is not audited, so nothing said so).
  if (hash === location.hash) { if (current) refreshPage(current); return; }
  location.hash = hash;
}

function signInForm(message) {
  document.getElementById("nav").hidden = true;
  document.getElementById("nav-instances").hidden = false;
  document.getElementById("nav-audit").hidden = false;
  document.getElementById("session").hidden = true;
  const error = h("p", {id: "signin-error", class: message ? "alert" : null, role: "alert"}, message || "");
  const org = h("input", {id: "org", name: "org", required: true, autocomplete: "organization", value: session.org || "", "aria-describedby": "signin-help"});
  const key = h("input", {id: "key", name: "key", type: "password", required: true, autocomplete: "off"});
  const form = h("form", {class: "signin", "aria-labelledby": "signin-title"},
    h("label", {for: "org"}, "Organization", org),
    h("label", {for: "key"}, "API key", key),
    h("p", {id: "signin-help", class: "note"},
      "The key is kept in this tab only (sessionStorage) and sent to this Relay as a bearer token."),
    h("button", {type: "submit"}, "Sign in"),
    error);
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    try {
      const me = await api("/whoami", {org: org.value.trim(), key: key.value.trim()});
      const refused = unfitKey(me);
      if (refused) { error.className = "alert"; error.textContent = refused; return; }
      session.save(me.org, key.value.trim());
      who = me;
      startSession();
    } catch (err) {
      error.className = "alert";
      error.textContent = err.status === 401 ? "This key is not valid here." : problemText(err);
    }
  });
  main.replaceChildren(h("h1", {id: "signin-title", tabindex: "-1"}, "Sign in to Relay"), form);
  document.title = "Sign in · Relay console";
  (session.org ? key : org).focus();
}

// A key that may read nothing the console shows (an executor's conductor key, pasted by mistake:
// only websocket.connect) is refused at sign-in with a word on why, not taken in to 403s.
function unfitKey(me) {
  const perms = me.permissions || [];
  if (perms.includes("application.read") || perms.includes("organization.read")) return null;
  const executors = perms.includes("websocket.connect") ? "This is an executor's key (it may only connect executors). " : "";
  return `${executors}The console needs an API key with application.read; this key has ${perms.length ? perms.join(", ") : "no permission"}.`;
}

function startSession() {
  document.getElementById("nav").hidden = false;
  document.getElementById("session").hidden = false;
  showWho();
  startStream();
  if (!location.hash || location.hash === "#") location.hash = "#/";
  else show();
}

function showWho() {
  const writes = who.permissions.includes("application.write") ? "" : " · read-only";
  document.getElementById("who").textContent = plain(`${who.tokenName} in ${who.org}${writes}`);
  // Only the pages the key may read: Instances and the audit log need organization.read (a key
  // limited to apps lacks it).
  const orgRead = who.permissions.includes("organization.read");
  document.getElementById("nav-instances").hidden = !orgRead;
  document.getElementById("nav-audit").hidden = !orgRead;
}

// A key renamed while signed in keeps working (its streams stay open, no event tells a key without
// organization.read): the header reads the key again with each page shown and each time the stream
// opens. A failure changes nothing here (the page's own reads say what is wrong).
async function rereadWho() {
  const key = session.key;
  let me;
  try { me = await api("/whoami"); } catch { return; }
  if (!who || session.key !== key || unfitKey(me)) return;
  who = me;
  showWho();
}

// Signing out forgets the page too; a key that stopped working (deleted or changed while signed in)
// keeps it, so that signing in again with a new key comes back to where the operator was.
function signOut(reason) {
  session.clear();
  who = null;
  if (stream) stream.abort();
  stream = null;
  current = null;
  setLive(null);
  if (!reason) history.replaceState(null, "", location.pathname);
  signInForm(reason);
}

const LIVE_TEXT = {
  on: "Live",
  off: "Reconnecting…",
  silent: "No word from Relay: reconnecting…",
  busy: "Live updates refused: this key has too many consoles open (429); trying again",
  denied: "Live updates are not available for this key",
};

function setLive(state) {
  live.className = `live ${state === "on" ? "on" : state ? "off" : ""}`;
  live.textContent = LIVE_TEXT[state] || "";
}

// -- pages --------------------------------------------------------------------------------------

async function show() {
  if (!who) return;
  rereadWho();
  const route = parseRoute();
  const ctx = {who, canWrite: who.permissions.includes("application.write"), go, route, reread: () => refreshPage(current)};
  const page = pageFor(route, ctx);
  current = page;
  for (const a of document.querySelectorAll("[data-nav]")) {
    if (a.dataset.nav === page.section) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  document.title = plain(`${page.title} · Relay console`);
  main.replaceChildren();
  page.mount(main);
  const heading = main.querySelector("h1");
  if (heading) { heading.tabIndex = -1; heading.focus({preventScroll: true}); }
  await refreshPage(page);
}

let timer = null;

// One refresh of a page at a time; a change that comes meanwhile reads it once more afterwards.
async function refreshPage(page) {
  if (page !== current) return;
  if (page.running) { page.again = true; return; }
  page.running = true;
  let failed = null;
  try {
    await page.refresh();
    page.retryMs = 0;
  } catch (err) {
    failed = err;
    if (page.fail) page.fail(err); else console.error(err);
  } finally {
    page.running = false;
    page.loadedOnce = true;
  }
  if (page.again && page === current) { page.again = false; await refreshPage(page); return; }
  if (failed) retryLater(page, failed);
  else pollLater(page);
}

// What no event tells: a workflow's progress is the executor's, not Relay's, so a page that shows
// unfinished workflows (page.pollMs() > 0) reads again after that long, until what it shows has
// finished or the operator leaves it; not while the tab is hidden (it reads when shown again), not
// under an open dialog.
function pollLater(page) {
  clearTimeout(page.pollTimer);
  const ms = page.pollMs ? page.pollMs() : 0;
  if (!ms) return;
  page.pollTimer = setTimeout(() => {
    if (page !== current) return;
    if (document.hidden) { page.pollDue = true; return; }
    if (document.querySelector("dialog[open]")) { pollLater(page); return; }
    refreshPage(page);
  }, ms);
}

document.addEventListener("visibilitychange", () => {
  if (!document.hidden && current && current.pollDue) { current.pollDue = false; refreshPage(current); }
});

// A read that failed for a reason that passes (Relay or the app's executor busy or unreachable: no
// status, 429, 5xx) is tried again by itself, 2 s after the first failure and twice as long after
// each next one, up to 30 s: the page comes right without a reload, and no event need come for it.
// A refusal that will repeat (401, 403, 404, 422) is not. Nothing is read while a page reads fine.
function retryLater(page, err) {
  const status = err && err.status;
  if (status && status !== 429 && status < 500) return;
  page.retryMs = Math.min((page.retryMs || 1000) * 2, 30000);
  setTimeout(() => { if (page === current) refreshPage(page); }, page.retryMs);
}

function scheduleRefresh() {
  if (timer) return;
  timer = setTimeout(() => {
    timer = null;
    if (document.querySelector("dialog[open]")) { scheduleRefresh(); return; }  // not under an open dialog
    refreshPage(current);
  }, 250);
}

// -- live updates -------------------------------------------------------------------------------

// A stream that says nothing for three of Relay's heartbeats (it gives their interval in ``ready``)
// and a little more is taken for lost (a frozen instance, a path that drops packets without a
// reset, where the socket stays open): the console says so and opens another.
const SILENCE_SLACK_MS = 2000;

async function startStream() {
  if (stream) stream.abort();
  const controller = new AbortController();
  stream = controller;
  let backoff = 1000;
  while (stream === controller) {
    let opened = false;
    let silent = false;
    let state = "off";
    const attempt = new AbortController();
    const stop = () => attempt.abort();
    controller.signal.addEventListener("abort", stop);
    let heard = Date.now();
    let silenceMs = null;
    const watchdog = setInterval(() => {
      if (silenceMs && Date.now() - heard > silenceMs) { silent = true; attempt.abort(); }
    }, 500);
    try {
      await readEvents((name, data) => {
        heard = Date.now();
        if (name === "heartbeat") return;
        if (name === "ready") {
          opened = true;
          backoff = 1000;
          silenceMs = data && data.heartbeatSecs ? data.heartbeatSecs * 3000 + SILENCE_SLACK_MS : null;
          setLive("on");
          rereadWho();
          if (current && current.loadedOnce) scheduleRefresh();  // what changed while the stream was down
        } else if (name === "end") {
          setLive("off");
        } else if (current && current.relevant && current.relevant(name, data)) {
          scheduleRefresh();
        }
      }, attempt.signal);
    } catch (err) {
      if (controller.signal.aborted) return;
      if (err.status === 401) { signOut("Your key is no longer valid; sign in again."); return; }
      // A key without application.read is refused the stream, and will be refused it every time:
      // asking again would only cost a request every 10 s for as long as the tab is open.
      if (err.status === 403) { setLive("denied"); return; }
      if (err.status === 429) state = "busy";  // the key's streams are all taken (other tabs): say so
    } finally {
      clearInterval(watchdog);
      controller.signal.removeEventListener("abort", stop);
    }
    if (stream !== controller) return;
    setLive(silent ? "silent" : state);
    await new Promise((resolve) => setTimeout(resolve, opened && !silent ? 500 : backoff));
    backoff = Math.min(backoff * 2, 10000);
  }
}

// -- start --------------------------------------------------------------------------------------

document.getElementById("signout").addEventListener("click", () => signOut());
// "N s ago" counts on between reads: a page is read again only when something it shows changes.
setInterval(() => {
  for (const el of document.querySelectorAll("[data-ago]")) el.textContent = ago(el.dataset.ago);
}, 1000);
document.getElementById("skip").addEventListener("click", (ev) => {
  ev.preventDefault();  // the hash is the router's: move focus instead
  main.focus();
});
window.addEventListener("hashchange", show);

// A reload (or a new tab's first read) while Relay cannot answer (restarting, its database away:
// no status, 429, 5xx) keeps the key and asks again, 2 s after the first failure and twice as long
// after each next one, up to 30 s; only an answer that the key is not valid forgets it.
async function resumeSession(waitMs = 0) {
  if (!session.key) { signInForm(); return; }
  try {
    who = await api("/whoami");
  } catch (err) {
    const status = err && err.status;
    if (!status || status === 429 || status >= 500) { waitForRelay(err, Math.min(Math.max(waitMs * 2, 2000), 30000)); return; }
    session.clear();
    signInForm(status === 401 ? "Your key is no longer valid; sign in again." : problemText(err));
    return;
  }
  const refused = unfitKey(who);
  if (refused) { who = null; signOut(refused); return; }
  startSession();
}

function waitForRelay(err, waitMs) {
  document.getElementById("nav").hidden = true;
  document.getElementById("session").hidden = true;
  const retry = h("button", {type: "button", id: "retry-now"}, "Try now");
  const other = h("button", {type: "button", id: "signin-other"}, "Sign in with another key");
  const timer = setTimeout(() => resumeSession(waitMs), waitMs);
  retry.addEventListener("click", () => { clearTimeout(timer); resumeSession(waitMs); });
  other.addEventListener("click", () => { clearTimeout(timer); signOut(); });
  main.replaceChildren(
    h("h1", {id: "waiting-title", tabindex: "-1"}, "Relay is not answering"),
    h("p", {id: "waiting-error", class: "alert", role: "alert"}, problemText(err)),
    h("p", {class: "note"}, `Your key is kept in this tab. Trying again in ${Math.round(waitMs / 1000)} s.`),
    h("p", {}, retry, " ", other));
  document.title = "Waiting for Relay · Relay console";
}

resumeSession();
