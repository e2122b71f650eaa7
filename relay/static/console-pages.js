// The console's pages. Each reads one page of what it lists (limit and offset, never everything),
// says which live events concern it, and reads again only its own data when one comes.

import {api, apiCounted, enc} from "./console-api.js";
import {ago, announce, badge, confirmDialog, duration, h, pager, plain, problemText, shellCommand, table, when} from "./console-ui.js";

const STATES = ["HEALTHY", "DISCONNECTED", "DEAD", "RECOVERING"];
const WORKFLOW_STATUSES = ["PENDING", "ENQUEUED", "DELAYED", "SUCCESS", "ERROR", "CANCELLED", "MAX_RECOVERY_ATTEMPTS_EXCEEDED"];
// Not finished: DBOS 3.2 holds a workflow enqueued with a delay as DELAYED until its time comes.
// Such a workflow can be cancelled; resuming it would enqueue it at once, skipping its delay. An
// ENQUEUED one can be resumed too (as in Conductor's console): it starts now, past its queue's limits.
const ACTIVE = ["PENDING", "ENQUEUED", "DELAYED"];
// Finished for good: DBOS does not resume these (Relay answers 409); a fork runs one again.
const FINISHED = ["SUCCESS", "ERROR"];
const PAGE = 50;
// How often a page showing unfinished workflows reads them again: their progress is the executor's,
// and no event of Relay's says when a workflow finishes.
const WORKFLOW_POLL_MS = 3000;
const LIST_POLL_MS = 10000;
const AUDIT_PAGE = 100;

const link = (parts, text, params) => {
  const q = params ? new URLSearchParams(Object.entries(params).filter(([, v]) => v)).toString() : "";
  return h("a", {href: `#/${parts.map((p) => encodeURIComponent(p)).join("/")}${q ? `?${q}` : ""}`}, text);
};
const id = (text) => h("span", {class: "id"}, text ?? "");
// A workflow id: DBOS bounds none and Relay takes up to 16 KiB, which is two screens of text. Where
// ids are listed or linked, each shows its first lines (console.css's .wf); its link, its text for
// a screen reader and a copy are the whole id.
const wfId = (workflowId, content) => h("span", {class: "id wf"}, content ?? workflowId);
// A name an app gives (a queue's, a schedule's, a workflow's or a step's): DBOS bounds none either,
// and Relay takes up to 16 KiB. Listed or linked, it shows its first lines as a workflow id does
// (console.css's .long); its link, its text for a screen reader and a copy are the whole name.
const longName = (name, content) => h("span", {class: "long"}, content ?? name);
// A workflow id inside a sentence (a dialog, the outcome of an action, the window's title): its
// beginning and its end, so that the sentence stays on the screen. The page's heading says it whole.
const SHORT_ID = 80;
const shortId = (workflowId) => (workflowId.length <= SHORT_ID ? workflowId : `${workflowId.slice(0, 56)}…${workflowId.slice(-20)}`);
// An executor id, linked to the app's Executors page showing it, which says where its recoveries
// are when its record is gone (a recovered executor's is deleted).
const executorLink = (app, executorId) => (executorId ? id(link(["apps", app, "executors"], executorId, {executor: executorId})) : id(executorId));
// How far back the Executors page looks for executors recovered (and so removed from the registry).
const RECENT_RECOVERY_MS = 3600 * 1000;
const RECENT_RECOVERIES = 20;  // the newest runs it reads for the ids it names (it counts them all)
const offsetOf = (params) => Math.max(0, parseInt(params.get("offset") || "0", 10) || 0);

// A page: a heading and controls mounted once, and a data region read again on refresh. A page of
// an app whose last read failed (503: no executor of it connected) reads again when an executor
// of the app changes, whatever else it waits for.
function basePage({section, title, heading, intro, controls, load, relevant, app, pollMs}) {
  const region = h("div", {class: "data", "aria-busy": "true"});
  const status = h("p", {class: "note", role: "status"});
  let failed = false;
  return {
    section, title, pollMs,
    relevant(name, data) {
      if (failed && app !== undefined && name === "executor" && data.app === app) return true;
      return relevant(name, data);
    },
    mount(main) {
      main.append(...[heading || h("h1", {}, title), intro, controls, status, region].filter(Boolean));
    },
    async refresh() {
      region.setAttribute("aria-busy", "true");
      let content;
      try {
        content = await load();
      } finally {
        region.setAttribute("aria-busy", "false");
      }
      // What has focus as the region is replaced (not as the read began: a dialog open then had it,
      // and its opener got it back while the read was under way). An element put back as it was (the
      // page's outcome) loses focus as it is taken out: it gets it again.
      const had = document.activeElement && region.contains(document.activeElement) ? document.activeElement : null;
      const focusKey = had ? had.dataset.focusKey || had.getAttribute("href") : null;
      region.replaceChildren(...[content].flat(Infinity).filter(Boolean));
      failed = false;
      status.className = "note";
      status.setAttribute("role", "status");
      status.textContent = "";
      if (had) {
        const again = focusKey
          ? [...region.querySelectorAll("[data-focus-key], a[href]")]
            .find((el) => (el.dataset.focusKey || el.getAttribute("href")) === focusKey)
          : region.contains(had) ? had : null;
        // What had focus is gone (a Cancel button once the workflow is cancelled): the page's
        // outcome, or its heading, rather than the top of the document.
        const fallback = region.querySelector("[data-focus-fallback]") || document.querySelector("main h1");
        if (again) again.focus({preventScroll: true});
        else if (fallback) fallback.focus({preventScroll: true});
      }
    },
    fail(err) {
      failed = true;
      status.className = "alert";
      status.setAttribute("role", "alert");
      status.textContent = problemText(err);
    },
  };
}

// -- apps -------------------------------------------------------------------------------------------

function appsPage(ctx) {
  const offset = offsetOf(ctx.route.params);
  return basePage({
    section: "apps", title: "Apps",
    intro: h("p", {class: "note"}, "Executors of each app by state and version; apps with a blocked recovery come first in red."),
    relevant: (name) => name === "executor" || name === "audit",
    async load() {
      // Relay orders them (blockedFirst): apps in trouble lead the first page, however many there are.
      const apps = await api("/apps", {params: {limit: PAGE, offset, blockedFirst: true}});
      const blocked = (a) => Object.values(a.blocked || {}).reduce((x, y) => x + y, 0);
      return [
        table("Apps", [
          ["App", (a) => link(["apps", a.name], a.name)],
          ["Status", (a) => badge(a.status, a.status === "AVAILABLE" ? "Available" : "Unavailable")],
          ...STATES.map((s) => [s[0] + s.slice(1).toLowerCase(), (a) => {
            const n = a.executors[s] || 0;
            return n ? link(["apps", a.name, "executors"], String(n), {state: s}) : "0";
          }, {num: true}]),
          ["Versions", (a) => {
            const versions = Object.entries(a.executorsByVersion || {});
            if (!versions.length) return h("span", {class: "note"}, "none connected");
            return h("ul", {class: "versions"}, versions.map(([v, byState]) => h("li", {},
              h("span", {class: "id"}, v), ": ",
              Object.entries(byState).map(([s, n]) => `${n} ${s.toLowerCase()}`).join(", "))));
          }],
          ["Blocked recoveries", (a) => {
            const n = blocked(a);
            if (!n) return "none";
            return h("span", {}, badge("blocked", `${n} blocked`), " ",
              Object.entries(a.blocked).map(([r, k]) => `${r.replaceAll("_", " ")} (${k})`).join(", "), " ",
              link(["apps", a.name, "recoveries"], "see recoveries"));
          }],
          // As set (a fraction included); the release before had no gracePeriodSecs and served the
          // value set in executorTimeoutSecs, which a rolling upgrade may answer this page with.
          ["Grace period", (a) => `${a.gracePeriodSecs ?? a.executorTimeoutSecs} s`, {num: true}],
        ], apps, {rowAttrs: (a) => (blocked(a) ? {class: "blocked-row"} : {}), empty: "No apps yet: connect an executor."}),
        pager("Apps pages", {offset, limit: PAGE, shown: apps.length, go: (o) => ctx.go([], {offset: o})}),
      ];
    },
  });
}

function appHeader(ctx, app, tab, title) {
  const tabs = [["executors", "Executors"], ["recoveries", "Recoveries"], ["workflows", "Workflows"], ["queues", "Queues"], ["schedules", "Schedules"], ["alerts", "Alerts"]];
  return h("div", {},
    h("p", {class: "crumbs"}, link([], "Apps"), " › ", h("span", {class: "id"}, app)),
    h("h1", {}, title),
    h("nav", {class: "tabs", "aria-label": `App ${app}`}, h("ul", {}, tabs.map(([key, label]) =>
      h("li", {}, h("a", {href: `#/apps/${encodeURIComponent(app)}/${key}`, "aria-current": key === tab ? "page" : null}, label))))));
}

// -- executors --------------------------------------------------------------------------------------

function since(e) {
  if (e.state === "HEALTHY") return e.connectedAt;
  if (e.state === "DISCONNECTED") return e.disconnectedAt;
  return e.deadAt || e.disconnectedAt;
}

function executorsPage(ctx, app) {
  const params = ctx.route.params;
  const only = params.get("executor") || "";
  if (only) return executorPage(ctx, app, only);
  const state = STATES.includes(params.get("state")) ? params.get("state") : "";
  const offset = offsetOf(params);
  const select = h("select", {id: "state-filter", name: "state"},
    h("option", {value: ""}, "Any state"), STATES.map((s) => h("option", {value: s, selected: s === state}, s)));
  const controls = h("form", {class: "filters", "aria-label": "Filter executors"},
    h("label", {for: "state-filter"}, "State", select), h("button", {type: "submit"}, "Filter"));
  controls.addEventListener("submit", (ev) => { ev.preventDefault(); ctx.go(["apps", app, "executors"], {state: select.value}); });
  const {outcome, recover} = manualRecovery(app);
  return basePage({
    section: "apps", title: `Executors of ${app}`, app,
    heading: appHeader(ctx, app, "executors", `Executors of ${app}`), controls,
    relevant: (name, data) => data.app === app,
    async load() {
      const [info, executors, recoveries] = await Promise.all([
        api(`/apps/${enc(app)}`),
        api(`/apps/${enc(app)}/executors`, {params: {state, limit: PAGE, offset}}),
        apiCounted(`/apps/${enc(app)}/recoveries`, {params: {limit: RECENT_RECOVERIES, sortDesc: true,
          status: "succeeded", updatedSince: new Date(Date.now() - RECENT_RECOVERY_MS).toISOString(),
          executorDeleted: true}}),
      ]);
      const total = state ? info.executors[state] : Object.values(info.executors).reduce((x, y) => x + y, 0);
      return [
        outcome,
        recentlyRecovered(app, recoveries),
        executorsTable(ctx, app, executors, state, recover),
        pager("Executor pages", {offset, limit: PAGE, shown: executors.length, total,
          go: (o) => ctx.go(["apps", app, "executors"], {state, offset: o})}),
      ];
    },
  });
}

// The executors recovered lately: a recovered executor's record is deleted, so it is in no list of
// executors; an engineer paged about it is told it was recovered, and where its run is. Counted by the
// API (the runs that succeeded in the last hour and deleted their executor's record, however many: a
// run that succeeded while its executor had connected again kept the record, recordKept, and the
// executor is still in this list, so it is not counted), the newest few executors named. The
// count is of runs, not executors: one that came back and was recovered again counts twice, so the
// line says recoveries, and "more" counts the runs of the executors it does not name.
function recentlyRecovered(app, {rows, total}) {
  if (!total) return null;
  const shown = [...new Set(rows.filter((r) => r.deletedAt).map((r) => r.executorId))].slice(0, 5);
  const more = total - rows.filter((r) => r.deletedAt && shown.includes(r.executorId)).length;
  return h("p", {class: "note", id: "recently-recovered"},
    `${total} recover${total === 1 ? "y" : "ies"} succeeded in the last hour, ${total === 1 ? "its executor" : "their executors"} removed from this list (the runs are under Recoveries)${shown.length ? ": " : ""}`,
    shown.map((e, i) => [i ? ", " : "", id(link(["apps", app, "recoveries"], e, {executor: e}))]),
    shown.length && more > 0 ? ` and ${more} more` : "", ".");
}

function executorsTable(ctx, app, executors, state, recover) {
  return table(`Executors of ${app}${state ? ` in state ${state}` : ""}`, [
    ["Executor", (e) => h("span", {class: "id", "data-executor": e.executorId}, e.executorId)],
    // A DISCONNECTED executor's grace period ends at graceEndsAt: when it is declared DEAD unless it reconnects.
    ["State", (e) => h("span", {}, badge(e.state), e.blockedReason ? [" ", badge("blocked", `blocked: ${e.blockedReason.replaceAll("_", " ")}`)] : "",
      e.graceEndsAt ? [" ", h("span", {class: "note grace-ends"}, "dead at ", when(e.graceEndsAt), " unless it reconnects")] : "")],
    ["Version", (e) => id(e.applicationVersion)],
    // The SDK's language and version: an app whose executors mix languages loses work (README).
    ["SDK", (e) => [e.language, e.dbosVersion].filter(Boolean).join(" ")],
    ["Host", (e) => e.hostname || ""],
    ["Relay instance", (e) => id(e.relayInstance)],
    ["Since", (e) => h("span", {}, when(since(e)), " ", h("span", {class: "when", "data-ago": since(e)}, ago(since(e))))],
    ["Recoveries", (e) => e.state === "HEALTHY" ? "" : h("span", {},
      link(["apps", app, "recoveries"], "Recoveries", {executor: e.executorId}),
      ctx.canWrite ? [" ", h("button", {type: "button", class: "secondary", "data-focus-key": `recover-${e.executorId}`, onclick: () => recover(e)},
        "Recover now…", h("span", {class: "visually-hidden"}, ` (${e.executorId})`))] : "")],
  ], executors, {
    rowAttrs: (e) => ({"data-state": e.state, class: e.blockedReason ? "blocked-row" : null}),
    empty: state ? `No executor of ${app} is ${state}.` : `No executor of ${app} is in the registry (recovered ones are deleted; see Recoveries).`,
  });
}

// One executor (the Executors page with ?executor=): its row, or, when the registry no longer holds
// it (recovered, hence deleted, or never connected through Relay), where its recoveries are.
function executorPage(ctx, app, executorId) {
  const {outcome, recover} = manualRecovery(app);
  const all = h("p", {class: "note"}, link(["apps", app, "executors"], `All executors of ${app}`));
  return basePage({
    section: "apps", title: `Executor ${executorId}`, app,
    heading: appHeader(ctx, app, "executors", `Executor ${executorId}`), controls: all,
    relevant: (name, data) => data.app === app,
    async load() {
      let e;
      try {
        e = await api(`/apps/${enc(app)}/executors/${enc(executorId)}`);
      } catch (err) {
        if (err.status !== 404) throw err;
        return h("p", {class: "note", id: "executor-gone"}, `Executor ${executorId} is not in the registry of ${app}: `,
          "a recovered executor's record is deleted. See ", link(["apps", app, "recoveries"], "its recoveries", {executor: executorId}), ".");
      }
      return [outcome, executorsTable(ctx, app, [e], "", recover)];
    },
  });
}

// An operator's recovery of an executor (POST .../executors/{id}/recover): a confirmation, then its
// outcome in ``outcome``, one element for the page's life (the refreshes its own audit entries bring
// put it back), with a link to the run.
function manualRecovery(app) {
  const outcome = h("p", {id: "action-status", role: "status", class: "note", tabindex: "-1", "data-focus-fallback": ""});
  const tell = (...text) => { outcome.className = "note"; outcome.replaceChildren(...text); };
  async function recover(e) {
    const values = await confirmDialog({title: "Recover this executor's workflows now?", confirm: "Recover now",
      body: e.state === "DISCONNECTED"
        ? `Executor ${e.executorId} is declared dead now, without waiting for the rest of its grace period, and a healthy peer is asked to recover its workflows. If it is only slow to come back, its workflows may run twice.`
        : `A healthy peer of ${app} is asked now to recover the workflows of executor ${e.executorId}${e.blockedReason ? ", which is blocked" : ""}.`,
      fields: [{name: "toLatestVersion", label: "Onto the latest version, if no peer runs its version", type: "checkbox", value: "yes", checked: e.toLatest}]});
    if (!values) return;
    tell("");
    try {
      const out = await api(`/apps/${enc(app)}/executors/${enc(e.executorId)}/recover`,
        {method: "POST", body: {toLatestVersion: values.toLatestVersion === "yes"}});
      const what = out.newRun === false ? "A recovery was running already and was woken to try again now" : "Recovery started";
      announce(`${what}: ${e.executorId}`);
      tell(`${what}: `, link(["apps", app, "recoveries"], out.recoveryId, {executor: e.executorId}), ".");
    } catch (err) {
      outcome.className = "alert";
      outcome.textContent = problemText(err);
    }
  }
  return {outcome, recover};
}

// -- recoveries -------------------------------------------------------------------------------------

function step(cls, title, at, ...more) {
  return h("li", {class: cls}, h("span", {class: "step-title"}, title), at ? [" ", h("span", {class: "when"}, when(at))] : "", ...more);
}

function recoveryCard(ctx, app, r, recover) {
  const items = [step("bad", "DEAD", r.deadAt, h("span", {class: "note"}, ` executor declared dead (${r.trigger.replaceAll("_", " ")})`))];
  const waits = {"recovery.waiting_for_peer": "Waiting for a healthy peer", "recovery.awaiting_operator": "Waiting for an operator (version upgrade not allowed)"};
  // A wait for a peer of the executor's own language (an app mixing SDKs) is said as such: "no healthy
  // peer" read as if the app had none, beside the healthy executors of another language it lists.
  // Which language, named as the SDKs are (the API gives the handshake's "python", "typescript"; a
  // language Relay has no name for as given): unnamed, on-call had to open the executor to learn
  // which peers to start. An answer without it (its record gone, or an instance of the release
  // before) says "of its language", as before.
  const sdkNames = {python: "Python", typescript: "TypeScript"};
  const itsPeer = r.language ? `${Object.hasOwn(sdkNames, r.language) ? sdkNames[r.language] : r.language} peer` : "peer of its language";
  const ofItsLanguage = (t) => t && t.detail && t.detail.reason === "no_peer_of_its_language";
  const waitTitle = (t) => ofItsLanguage(t) ? `Waiting for a healthy ${itsPeer}` : waits[t.action];
  const firstDispatch = r.attempts.length ? r.attempts[0].dispatchedAt : null;
  for (const t of r.timeline || []) {
    if (waits[t.action] && (!firstDispatch || t.at <= firstDispatch)) items.push(step("warn", waitTitle(t), t.at));
  }
  for (const a of r.attempts) {
    items.push(step("info", `Attempt ${a.attempt}: dispatched`, a.dispatchedAt || (a.outcome === "dispatched" ? a.at : null)));
    items.push(step("info", "Peer", null, " ", executorLink(app, a.peerExecutorId), ` (${a.mode.replaceAll("_", " ")})`));
    if (a.outcome === "succeeded") {
      items.push(step("ok", "Verified", a.endedAt || a.at, a.verifiedBy ? [" by ", executorLink(app, a.verifiedBy)] : "",
        h("span", {class: "note"}, ` ${duration(a.dispatchedAt, a.endedAt)} after dispatch`)));
      if (a.deletedAt) items.push(step("ok", "Deleted", a.deletedAt, h("span", {class: "note"}, ` ${duration(r.deadAt, a.deletedAt)} after DEAD`)));
    } else if (a.outcome === "failed") {
      items.push(step("bad", "Failed", a.endedAt || a.at, a.error ? `: ${a.error}` : ""));
    } else {
      items.push(step("warn", "Waiting for the peer's answer", null));
    }
  }
  // A run ended by its executor's return is "failed" in the API (the contract's statuses), but nothing
  // failed: the executor runs its own workflows again. Said as such, not as a failure.
  const back = r.status === "failed" && (r.timeline || []).find((t) => t.action === "recovery.failed" && t.detail && t.detail.executorBack);
  if (back) items.push(step("ok", "Ended: the executor reconnected", back.at));
  const blocked = r.status === "waiting_for_peer" || r.status === "awaiting_operator";
  if (blocked && r.attempts.length) {
    const lastWait = (r.timeline || []).filter((t) => waits[t.action]).pop();
    const peerless = ofItsLanguage(lastWait) ? `Blocked: no healthy ${itsPeer}` : "Blocked: no healthy peer";
    items.push(step("bad", r.status === "waiting_for_peer" ? peerless : "Blocked: awaiting an operator", r.updatedAt));
  }
  // A way out, named on the card: the button (with a key that may write), and the command.
  const toLatest = r.status === "awaiting_operator";
  const command = shellCommand("relay recover", [app, r.executorId], toLatest ? ["--to-latest"] : []);
  const wayOut = blocked ? h("p", {class: "actions"},
    ctx.canWrite ? [h("button", {type: "button", class: "secondary", "data-focus-key": `recover-${r.recoveryId}`,
      onclick: () => recover({executorId: r.executorId, state: "DEAD", blockedReason: r.status, toLatest})},
      "Recover now…", h("span", {class: "visually-hidden"}, ` (${r.executorId})`)), " "] : "",
    h("span", {class: "note"}, "or: ", h("code", {}, command))) : null;
  return h("section", {class: "recovery", "aria-labelledby": `rec-${r.recoveryId}`, "data-recovery": r.recoveryId},
    h("h2", {id: `rec-${r.recoveryId}`}, "Executor ", executorLink(app, r.executorId), ` · run ${r.run} `, back ? badge("executor_back", "ended: executor back") : badge(r.status, r.status.replaceAll("_", " "))),
    h("p", {class: "note"}, `Version ${r.applicationVersion} · started `, when(r.createdAt), r.error ? ` · ${r.error}` : ""),
    h("ol", {class: "timeline", "aria-label": `Timeline of recovery run ${r.run} of ${r.executorId}`}, items),
    wayOut);
}

function recoveriesPage(ctx, app) {
  const params = ctx.route.params;
  const executor = params.get("executor") || "";
  const offset = offsetOf(params);
  const input = h("input", {id: "rec-executor", name: "executor", value: executor, size: 40});
  const controls = h("form", {class: "filters", "aria-label": "Filter recoveries"},
    h("label", {for: "rec-executor"}, "Executor id", input), h("button", {type: "submit"}, "Filter"));
  controls.addEventListener("submit", (ev) => { ev.preventDefault(); ctx.go(["apps", app, "recoveries"], {executor: input.value.trim()}); });
  const limit = 20;
  const {outcome, recover} = manualRecovery(app);
  return basePage({
    section: "apps", title: `Recoveries of ${app}`, app,
    heading: appHeader(ctx, app, "recoveries", `Recoveries of ${app}`), controls,
    relevant: (name, data) => data.app === app && (name === "audit" || data.state !== "HEALTHY"),
    async load() {
      const rows = await api(`/apps/${enc(app)}/recoveries`, {params: {executorId: executor, limit, offset, sortDesc: true}});
      return [
        outcome,
        rows.length ? rows.map((r) => recoveryCard(ctx, app, r, recover)) : h("p", {class: "note"}, "No recovery yet."),
        pager("Recovery pages", {offset, limit, shown: rows.length, go: (o) => ctx.go(["apps", app, "recoveries"], {executor, offset: o})}),
      ];
    },
  });
}

// -- workflows --------------------------------------------------------------------------------------

const FILTERS = [
  ["status", "Status"], ["name", "Workflow name"], ["queue", "Queue"], ["from", "Created from (UTC)"],
  ["to", "Created until (UTC)"], ["version", "App version"], ["executor", "Executor id"],
];

// The console shows every time in UTC, so a time typed into a filter (a datetime-local field, which
// has no zone) is UTC too: the time of a row as shown finds that row in any browser's time zone, and
// an address with it means the same instant to everyone who opens it.
export function utc(value) {
  if (!value) return undefined;
  const d = new Date(/[zZ]|[+-]\d\d:\d\d$/.test(value) ? value : `${value}Z`);
  return Number.isNaN(d.getTime()) ? undefined : d.toISOString();
}

function workflowSearch(params, offset) {
  const list = (v) => (v ? [v] : undefined);
  return {
    status: list(params.get("status")), workflowName: list(params.get("name")), queueName: list(params.get("queue")),
    appVersion: list(params.get("version")), executorId: list(params.get("executor")),
    startTime: utc(params.get("from")), endTime: utc(params.get("to")),
    limit: PAGE, offset, sortDesc: true, loadInput: false, loadOutput: false,
  };
}

// A workflow id "." or ".." cannot be asked for by a browser: it resolves such a path segment in
// any encoding (%2E%2E too), so its link would read another route. The command line reads it.
const unlinkable = (workflowId) => workflowId === "." || workflowId === "..";

function workflowsTable(app, rows, caption) {
  return table(caption, [
    ["Workflow", (w) => unlinkable(w.workflowId)
      ? h("span", {class: "id", title: `A browser cannot open this id; use: ${shellCommand("relay workflows get", [app, w.workflowId])}`}, w.workflowId)
      : wfId(w.workflowId, link(["apps", app, "workflows", w.workflowId], w.workflowId))],
    ["Name", (w) => longName(w.workflowName || "")],
    ["Status", (w) => badge(w.status)],
    ["Queue", (w) => longName(w.queueName || "")],
    ["Version", (w) => id(w.appVersion)],
    ["Executor", (w) => executorLink(app, w.executorId)],
    ["Created", (w) => when(w.createdAt)],
    ["Updated", (w) => when(w.updatedAt)],
  ], rows, {empty: "No workflow matches."});
}

function workflowsPage(ctx, app) {
  const params = ctx.route.params;
  const offset = offsetOf(params);
  let unfinished = false;  // a workflow listed has not finished: its status is read again (pollMs)
  // Pages after the first are read as of the first one (created at or before its newest workflow):
  // workflows started since would otherwise push rows already seen onto the next page.
  const asOf = offset ? utc(params.get("asOf")) : undefined;
  const fields = {};
  const controls = h("form", {class: "filters", "aria-label": "Filter workflows"},
    FILTERS.map(([key, label]) => {
      const fid = `wf-${key}`;
      let input;
      if (key === "status") {
        input = h("select", {id: fid, name: key}, h("option", {value: ""}, "Any status"),
          WORKFLOW_STATUSES.map((s) => h("option", {value: s, selected: params.get(key) === s}, s)));
      } else {
        input = h("input", {id: fid, name: key, type: key === "from" || key === "to" ? "datetime-local" : "text", value: params.get(key) || "", size: key === "executor" ? 36 : 16});
      }
      fields[key] = input;
      return h("label", {for: fid}, label, input);
    }),
    h("button", {type: "submit"}, "Search"));
  controls.addEventListener("submit", (ev) => {
    ev.preventDefault();
    ctx.go(["apps", app, "workflows"], Object.fromEntries(Object.entries(fields).map(([k, el]) => [k, el.value.trim()])));
  });
  return basePage({
    section: "apps", title: `Workflows of ${app}`, app,
    heading: appHeader(ctx, app, "workflows", `Workflows of ${app}`),
    intro: h("p", {class: "note"}, `Newest first, ${PAGE} at a time, asked of a healthy executor of the app.`),
    controls,
    relevant: (name, data) => name === "audit" && data.app === app && data.action.startsWith("workflow."),
    pollMs: () => unfinished ? LIST_POLL_MS : 0,
    async load() {
      const body = workflowSearch(params, offset);
      if (asOf && (!body.endTime || asOf < body.endTime)) body.endTime = asOf;
      const rows = await api(`/apps/${enc(app)}/workflows/search`, {method: "POST", body});
      unfinished = rows.some((w) => ACTIVE.includes(w.status));
      const keep = Object.fromEntries(FILTERS.map(([k]) => [k, params.get(k) || ""]));
      const anchor = asOf || (rows[0] && utc(rows[0].createdAt));
      return [
        workflowsTable(app, rows, `Workflows of ${app}`),
        pager("Workflow pages", {offset, limit: PAGE, shown: rows.length,
          go: (o) => ctx.go(["apps", app, "workflows"], {...keep, offset: o, asOf: o ? anchor : undefined})}),
      ];
    },
  });
}

function workflowPage(ctx, app, workflowId) {
  const base = `/apps/${enc(app)}/workflows/${enc(workflowId)}`;
  let showData = false;
  const stepsLimit = 100;
  const stepsOffset = offsetOf(ctx.route.params);
  const childrenOffset = Math.max(0, parseInt(ctx.route.params.get("children") || "0", 10) || 0);
  const here = (params) => ctx.go(["apps", app, "workflows", workflowId], {offset: stepsOffset || undefined, children: childrenOffset || undefined, ...params});
  let unfinished = false;  // the workflow, a step or a child shown has not finished (pollMs)
  // The last action's outcome. One element for the page's life, put back in each refresh of the
  // data region: every action is audited, and the refresh the audit event brings must not wipe
  // it. It goes when the operator acts again or leaves the page (a new page has its own).
  const outcome = h("p", {id: "action-status", role: "status", class: "note", tabindex: "-1", "data-focus-fallback": ""});
  const tell = (text, failed = false) => { outcome.className = failed ? "alert" : "note"; outcome.textContent = plain(text); };

  async function act(kind, body) {
    const verb = {cancel: "Cancelled", resume: "Resumed", fork: "Forked"}[kind];
    tell("");
    let out;
    try {
      out = await api(`${base}/${kind}`, {method: "POST", body});
    } catch (err) {
      tell(problemText(err), true);
      return;
    }
    if (kind === "fork" && out && out.workflowId) {
      announce(`${verb} ${shortId(workflowId)} as ${shortId(out.workflowId)}`);
      ctx.go(["apps", app, "workflows", out.workflowId]);
      return;
    }
    // DBOS cancels nothing of a workflow that finished meanwhile, and says it did: look.
    let text = `${verb} ${shortId(workflowId)}.`;
    let late = false;
    if (kind === "cancel") {
      try {
        const now = await api(base, {params: {loadInput: false, loadOutput: false}});
        if (now.status !== "CANCELLED") {
          late = true;
          text = `Not cancelled: ${shortId(workflowId)} is ${now.status}, it finished before the cancel reached it.`;
        }
      } catch { /* the page's own read says what it can */ }
    }
    announce(text);
    tell(text, late);
    // The read after the action is the page's own (a failure there is tried again by itself; it
    // does not turn the action's outcome into an error).
    await ctx.reread();
  }

  async function confirmCancel() {
    const ok = await confirmDialog({title: "Cancel this workflow?", danger: true, confirm: "Cancel workflow",
      body: `Workflow ${shortId(workflowId)} stops at its next step and is marked CANCELLED. It can be resumed later.`});
    if (ok) await act("cancel", {});
  }
  async function confirmResume(status) {
    // Conductor resumes an ENQUEUED workflow too: it starts now, past its queue's limits; the dialog
    // says so, as that is what an operator getting one workflow past a held queue wants.
    const waiting = status === "ENQUEUED";
    const ok = await confirmDialog({title: waiting ? "Start this workflow now?" : "Resume this workflow?", confirm: waiting ? "Start now" : "Resume workflow",
      body: waiting
        ? `Workflow ${shortId(workflowId)} is ENQUEUED. Resuming starts it now, outside its queue's concurrency and rate limits.`
        : `Workflow ${shortId(workflowId)} is queued again and continues from its last completed step.`});
    if (ok) await act("resume", {});
  }
  async function confirmFork(stepId) {
    const values = await confirmDialog({title: "Fork this workflow?", confirm: "Fork workflow",
      body: `A new workflow starts from a copy of ${shortId(workflowId)}: the steps before the one you choose are not run again.`,
      fields: [{name: "startStep", label: "Start from step", type: "number", min: 0, value: stepId, required: true},
               {name: "newWorkflowId", label: "New workflow id (optional)"}]});
    if (values) {
      const body = {startStep: parseInt(values.startStep, 10) || 0};
      if (values.newWorkflowId && values.newWorkflowId.trim()) body.newWorkflowId = values.newWorkflowId.trim();
      await act("fork", body);
    }
  }

  const page = basePage({
    section: "apps", title: `Workflow ${shortId(workflowId)}`, app,
    heading: h("div", {},
      h("p", {class: "crumbs"}, link([], "Apps"), " › ", link(["apps", app, "workflows"], app), " › workflows"),
      h("h1", {}, "Workflow ", wfId(workflowId)),
      // The heading shows a long id's first lines; the whole of it is a click away, to read or copy.
      workflowId.length > SHORT_ID ? h("details", {class: "whole-id"},
        h("summary", {}, `The whole id (${workflowId.length} characters)`), h("code", {}, workflowId)) : null),
    relevant: (name, data) => name === "audit" && data.app === app && data.action.startsWith("workflow."),
    pollMs: () => unfinished ? WORKFLOW_POLL_MS : 0,
    async load() {
      const [w, steps, children] = await Promise.all([
        api(base, {params: {loadInput: showData, loadOutput: showData}}),
        api(`${base}/steps`, {params: {limit: stepsLimit, offset: stepsOffset, loadOutput: showData}}),
        api(`/apps/${enc(app)}/workflows/search`, {method: "POST", body: {parentWorkflowId: [workflowId], limit: PAGE, offset: childrenOffset, loadInput: false, loadOutput: false}}),
      ]);
      // DBOS gives a workflow's error only with its output, and the error is why the operator came:
      // a failed workflow's is read without waiting for "Show inputs and outputs" (a workflow that
      // raised has no output, so this reads nothing large).
      if (w.status === "ERROR" && !showData) {
        const full = await api(base, {params: {loadInput: false, loadOutput: true}});
        w.error = full.error;
      }
      const active = ACTIVE.includes(w.status);
      unfinished = active || children.some((c) => ACTIVE.includes(c.status));
      const actions = ctx.canWrite ? h("div", {class: "actions", role: "group", "aria-label": "Workflow actions"},
        active ? h("button", {type: "button", class: "danger", "data-focus-key": "cancel", onclick: confirmCancel}, "Cancel…") : null,
        w.status !== "PENDING" && w.status !== "DELAYED" && !FINISHED.includes(w.status) ? h("button", {type: "button", "data-focus-key": "resume", onclick: () => confirmResume(w.status)}, "Resume…") : null,
        h("button", {type: "button", class: "secondary", "data-focus-key": "fork", onclick: () => confirmFork(1)}, "Fork…"))
        // A read-only key is told why there is nothing to press, rather than left to look for it.
        : h("p", {class: "note", id: "read-only-note"}, "This key may read but not act (it lacks application.write): cancel, resume and fork need a key that may write.");
      const facts = [
        ["Status", badge(w.status)], ["Name", w.workflowName && longName(w.workflowName)], ["Queue", w.queueName && longName(w.queueName)], ["App version", id(w.appVersion)],
        ["Executor", executorLink(app, w.executorId)], ["Created", when(w.createdAt)], ["Updated", when(w.updatedAt)],
        ["Completed", when(w.completedAt)],
        ["Parent", w.parentWorkflowId ? wfId(w.parentWorkflowId, link(["apps", app, "workflows", w.parentWorkflowId], w.parentWorkflowId)) : null],
        ["Forked from", w.forkedFrom ? wfId(w.forkedFrom, link(["apps", app, "workflows", w.forkedFrom], w.forkedFrom)) : null],
        ["Error", w.error ? h("code", {}, w.error) : null],
      ].filter(([, v]) => v);
      const toggle = h("button", {type: "button", class: "secondary", "aria-pressed": String(showData), "data-focus-key": "toggle-data",
        onclick: async () => { showData = !showData; await page.refresh(); }}, showData ? "Hide inputs and outputs" : "Show inputs and outputs");
      return [
        actions, outcome,
        h("dl", {class: "facts"}, facts.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])),
        toggle,
        showData ? h("div", {}, h("h2", {}, "Input"), h("pre", {}, w.input ?? "(none)"), h("h2", {}, "Output"), h("pre", {}, w.output ?? "(none)")) : null,
        h("h2", {id: "steps-title"}, `Steps (${steps.length}${steps.length === stepsLimit ? "+" : ""})`),
        steps.length ? h("ol", {class: "timeline", "aria-labelledby": "steps-title"}, steps.map((s) => h("li", {class: s.error ? "bad" : s.completedAt && !sleeping(w, s) ? "ok" : "warn", "data-step": s.stepId},
          // Clamped only when long: an inline box sits a little off the line of the badge after it.
          h("span", {class: (s.stepName || "").length > SHORT_ID ? "step-title long" : "step-title"}, `Step ${s.stepId}: ${s.stepName}`), " ",
          sleeping(w, s) ? badge("PENDING", "sleeping") : badge(s.error ? "ERROR" : s.completedAt ? "SUCCESS" : "PENDING", s.error ? "error" : s.completedAt ? "done" : "running"), " ",
          h("span", {class: "when"}, when(s.startedAt), sleeping(w, s) ? [" · until ", when(s.completedAt)] : s.completedAt ? ` · ${duration(s.startedAt, s.completedAt)}` : ""),
          s.childWorkflowId ? [" · child ", wfId(s.childWorkflowId, link(["apps", app, "workflows", s.childWorkflowId], s.childWorkflowId))] : "",
          ctx.canWrite ? [" ", h("button", {type: "button", class: "secondary", "data-focus-key": `fork-${s.stepId}`, onclick: () => confirmFork(s.stepId)},
            "Fork from here…", h("span", {class: "visually-hidden"}, ` (step ${s.stepId}: ${s.stepName})`))] : "",
          showData && s.output ? h("pre", {}, s.output) : null,
          s.error ? h("pre", {}, s.error) : null))) : h("p", {class: "note"}, "No step recorded yet."),
        steps.length === stepsLimit || stepsOffset ? pager("Step pages", {offset: stepsOffset, limit: stepsLimit, shown: steps.length,
          go: (o) => here({offset: o || undefined})}) : null,
        h("h2", {}, "Children"),
        workflowsTable(app, children, `Child workflows of ${shortId(workflowId)}`),
        children.length === PAGE || childrenOffset ? pager("Child pages", {offset: childrenOffset, limit: PAGE, shown: children.length,
          go: (o) => here({children: o || undefined})}) : null,
      ];
    },
  });
  return page;
}

// -- queues and schedules ---------------------------------------------------------------------------

// What each queue holds now (Conductor's queues tab shows the enqueued and running workflows):
// one aggregate of the app's ENQUEUED and PENDING workflows by queue and status.
async function queueFigures(app) {
  const rows = await api(`/apps/${enc(app)}/workflows/aggregates`, {method: "POST", body: {
    groupByQueueName: true, groupByStatus: true, selectCount: true, selectMinCreatedAt: true, status: ["ENQUEUED", "PENDING"]}});
  const byQueue = {};
  for (const r of rows) {
    const q = byQueue[r.group.queue_name] ||= {ENQUEUED: 0, PENDING: 0, oldest: null};
    q[r.group.status] = (q[r.group.status] || 0) + (r.count || 0);
    if (r.group.status === "ENQUEUED" && r.minCreatedAt && (!q.oldest || r.minCreatedAt < q.oldest)) q.oldest = r.minCreatedAt;
  }
  return byQueue;
}

function queuesPage(ctx, app) {
  // No event says when a workflow is enqueued or dequeued (that is the executors' own work): the
  // figures are read again every 10 s while the page is shown, unless the app's SDK cannot give them
  // (501): a failure that may pass (no executor connected, a timeout, Relay busy) is read again too.
  let readAgain = false;
  return basePage({
    section: "apps", title: `Queues of ${app}`, app, heading: appHeader(ctx, app, "queues", `Queues of ${app}`),
    intro: h("p", {class: "note"}, "As the app's executors declare them, with the workflows each holds now (read again every 10 s)."),
    relevant: (name, data) => name === "audit" && data.app === app && data.action.startsWith("workflow."),
    pollMs: () => readAgain ? LIST_POLL_MS : 0,
    async load() {
      // The figures are asked of an executor too, and an older SDK may not answer them (501): the
      // queues are shown all the same, and the page says why their figures are not.
      const [queues, figures] = await Promise.all([api(`/apps/${enc(app)}/queues`), queueFigures(app).catch((err) => err)]);
      const failed = figures instanceof Error;
      const of = (q) => (failed ? null : figures[q.name]) || {ENQUEUED: 0, PENDING: 0, oldest: null};
      readAgain = !failed || figures.status !== 501;
      const count = (q, status) => failed ? "?" : of(q)[status]
        ? link(["apps", app, "workflows"], String(of(q)[status]), {queue: q.name, status}) : "0";
      return [
        failed ? h("p", {class: "alert", role: "alert"}, `What the queues hold could not be read: ${problemText(figures)}`) : null,
        table(`Queues of ${app}`, [
          ["Queue", (q) => longName(q.name, link(["apps", app, "workflows"], q.name, {queue: q.name}))],
          ["Enqueued", (q) => count(q, "ENQUEUED"), {num: true}],
          ["Running", (q) => count(q, "PENDING"), {num: true}],
          ["Oldest enqueued", (q) => of(q).oldest ? h("span", {}, when(of(q).oldest), " ", h("span", {class: "when", "data-ago": of(q).oldest}, ago(of(q).oldest))) : ""],
          ["Concurrency", (q) => q.concurrency ?? "unlimited", {num: true}],
          ["Per worker", (q) => q.workerConcurrency ?? "unlimited", {num: true}],
          ["Rate limit", (q) => (q.rateLimitMax ? `${q.rateLimitMax} per ${q.rateLimitPeriodSecs} s` : "none")],
          ["Priority", (q) => (q.priorityEnabled ? "yes" : "no")],
          ["Partitioned", (q) => (q.partitionQueue ? "yes" : "no")],
        ], queues, {empty: "This app declares no queue."}),
      ];
    },
  });
}

function schedulesPage(ctx, app) {
  return basePage({
    section: "apps", title: `Schedules of ${app}`, app, heading: appHeader(ctx, app, "schedules", `Schedules of ${app}`),
    relevant: (name, data) => name === "audit" && data.app === app && data.action.startsWith("schedule."),
    async load() {
      const schedules = await api(`/apps/${enc(app)}/schedules`);
      return table(`Schedules of ${app}`, [
        ["Schedule", (s) => longName(s.scheduleName)],
        ["Workflow", (s) => longName(s.workflowName, link(["apps", app, "workflows"], s.workflowName, {name: s.workflowName}))],
        ["Cron", (s) => h("code", {class: "cron"}, s.cronExpression)],
        ["Status", (s) => badge(s.status)],
        ["Last fired", (s) => when(s.lastFiredAt)],
      ], schedules, {empty: "This app has no schedule."});
    },
  });
}

// -- alerts -----------------------------------------------------------------------------------------

const ALERTS_SHOWN = 50;
const ruleParams = (r) => Object.entries(r.ruleMetadata || {}).filter(([, v]) => v !== null && v !== undefined && v !== "")
  .map(([k, v]) => `${k} ${v}`).join(", ") || "none";
const destinationOf = (r) => r.webhook ? h("span", {}, h("code", {}, r.webhook), r.format === "slack" ? " (Slack)" : "")
  : r.receiverApp ? `the alert handler of ${r.receiverApp}` : "this app's own alert handler";

// The subject an alert was about, linked where the console has a page for it.
function alertSubject(app, d) {
  if (d.executorId) return link(["apps", app, "recoveries"], d.executorId, {executor: d.executorId});
  if (d.workflowName) return d.workflowName === "*" ? "any workflow" : longName(d.workflowName, link(["apps", app, "workflows"], d.workflowName, {name: d.workflowName}));
  if (d.queueName) return d.queueName === "*" ? "any queue" : longName(d.queueName, link(["apps", app, "workflows"], d.queueName, {queue: d.queueName}));
  if (d.instance) return id(d.instance);
  return d.appName || "";
}

// A durable sleep (DBOS.sleep) is recorded when it begins, with its wake time as its completion (so
// that its duration is the sleep's): in a workflow still PENDING, one whose completion is ahead is asleep.
function sleeping(w, s) {
  return w.status === "PENDING" && !s.error && Boolean(s.completedAt) && Date.parse(s.completedAt) > Date.now();
}

// The app's alerting rules (relay.yaml's and the API's) and the alerts delivered or given up on
// (the audit log's alert.sent and alert.failed of the app), newest first: what paged whom, and when.
function alertsPage(ctx, app) {
  return basePage({
    section: "apps", title: `Alerts of ${app}`, app, heading: appHeader(ctx, app, "alerts", `Alerts of ${app}`),
    relevant: (name, data) => name === "audit" && data.app === app && (data.action.startsWith("alert.") || data.action.startsWith("alerting_rule.")),
    async load() {
      // The alerts sent are audit entries, which only a key with organization.read may read: a key
      // without it is told so, and still sees the rules.
      const auditRead = ctx.who.permissions.includes("organization.read");
      const none = Promise.resolve([]);
      const [rules, sent, failed] = await Promise.all([
        api(`/apps/${enc(app)}/alerting-rules`),
        auditRead ? api("/audit", {params: {app, action: "alert.sent", limit: ALERTS_SHOWN, sortDesc: true}}) : none,
        auditRead ? api("/audit", {params: {app, action: "alert.failed", limit: ALERTS_SHOWN, sortDesc: true}}) : none,
      ]);
      const alerts = [...sent, ...failed].sort((a, b) => b.id - a.id).slice(0, ALERTS_SHOWN);
      return [
        h("h2", {}, "Rules"),
        table(`Alerting rules of ${app}`, [
          ["Kind", (r) => r.kind],
          ["Parameters", (r) => longName(ruleParams(r))],
          ["Sent to", (r) => destinationOf(r)],
          ["At most every", (r) => `${r.minIntervalSecs} s`, {num: true}],
          ["Last fired", (r) => r.lastFiredAt ? h("span", {}, when(r.lastFiredAt), " ", h("span", {class: "when", "data-ago": r.lastFiredAt}, ago(r.lastFiredAt))) : "never"],
          ["Set in", (r) => r.source === "config" ? "relay.yaml" : `the API${r.createdBy ? ` (${r.createdBy})` : ""}`],
        ], rules, {empty: "No alerting rule: this app alerts nobody (relay.yaml's alerts:, or the alerting-rules API)."}),
        h("h2", {}, "Alerts"),
        !auditRead ? h("p", {class: "note", id: "alerts-unreadable"}, "The alerts sent are in the audit log, which this key may not read ",
          "(it needs organization.read): each rule's last fired time is above.") : table(`Alerts of ${app}, newest first`, [
          ["Time", (e) => when(e.at)],
          ["Kind", (e) => e.detail.kind || ""],
          // A resolution (its detail names the alert it resolves) is sent as the alert was, to the
          // same place: said so, or the end of an incident reads as the same alert sent twice.
          ["Outcome", (e) => e.detail.resolves
            ? (e.action === "alert.sent" ? badge("SUCCESS", "resolution sent") : badge("ERROR", "resolution failed"))
            : (e.action === "alert.sent" ? badge("SUCCESS", "sent") : badge("ERROR", "failed"))],
          ["About", (e) => alertSubject(app, e.detail)],
          ["Attempts", (e) => e.detail.attempts ?? "", {num: true}],
          ["Sent to", (e) => e.detail.destination ? h("code", {}, e.detail.destination) : ""],
          ["Error", (e) => e.detail.error || ""],
        ], alerts, {empty: "No alert has been sent for this app."}),
        alerts.length === ALERTS_SHOWN ? h("p", {class: "note"}, `The newest ${ALERTS_SHOWN}; the rest are in the `,
          link(["audit"], "audit log", {app, action: "alert.sent"}), ".") : null,
      ];
    },
  });
}

// -- audit and instances ----------------------------------------------------------------------------

// Every action Relay audits (README: the audit log's row under REST API, Operating workflows, Alerts).
const ACTIONS = [
  "executor.dead", "recovery.dispatched", "recovery.failed", "recovery.failover", "recovery.waiting_for_peer",
  "recovery.awaiting_operator", "recovery.workflow_moved", "recovery.succeeded", "recovery.restarted",
  "recovery.manual_requested", "executor.deleted", "reconcile.found", "reconcile.recovered",
  "workflow.cancel", "workflow.resume", "workflow.fork", "workflow.delete", "workflow.import",
  "workflow.bulk_cancel", "workflow.bulk_resume", "workflow.bulk_delete", "workflow.bulk_fork_from_failure",
  "schedule.pause", "schedule.resume", "schedule.trigger", "schedule.backfill",
  "application.create", "application.delete", "application.set_latest_version", "settings.updated",
  "retention.sent", "retention.skipped", "retention.checked",
  "alert.sent", "alert.failed", "alert.resolved", "alerting_rule.create", "alerting_rule.delete",
  "token.created", "token.renamed", "token.deleted", "relay.instance_adopted",
];

// An entry's detail as "name: value" pairs rather than one line of JSON: a refusal's error as text,
// and the workflows and recovery it names linked to their pages.
function auditDetail(e) {
  const workflow = (w) => e.app && !unlinkable(w) ? wfId(w, link(["apps", e.app, "workflows", w], w)) : wfId(w);
  const value = (k, v) => {
    if ((k === "workflowIds" || k === "newWorkflowIds") && Array.isArray(v)) return v.flatMap((w, i) => [i ? ", " : "", workflow(w)]);
    if ((k === "workflowId" || k === "newWorkflowId") && typeof v === "string") return workflow(v);
    if (k === "recoveryId" && e.app && e.executorId) return id(link(["apps", e.app, "recoveries"], v, {executor: e.executorId}));
    if (k === "error") return h("span", {class: "error-text"}, String(v));
    if (k === "scheduleName" || k === "queueName") return wfId(String(v));  // as long as an id may be
    return v !== null && typeof v === "object" ? h("code", {}, JSON.stringify(v)) : id(String(v));
  };
  const entries = Object.entries(e.detail || {});
  if (!entries.length) return "";
  return h("ul", {class: "detail"}, entries.map(([k, v]) => h("li", {"data-key": k}, h("span", {class: "note"}, `${k}: `), value(k, v))));
}

function auditPage(ctx) {
  const params = ctx.route.params;
  const offset = offsetOf(params);
  const scoped = ctx.who.appNames !== null;
  // The filters applied are the address's, not what is typed in the form and not yet submitted.
  const app = params.get("app") || (scoped ? ctx.who.appNames[0] || "" : "");
  const applied = {app, executorId: params.get("executorId") || "", action: params.get("action") || "", since: params.get("since") || ""};
  // Pages after the first are read as of the first one (its newest entry): entries audited since
  // would otherwise push rows already seen onto the next page. Filter or the first page reads anew.
  const untilId = offset ? parseInt(params.get("untilId") || "", 10) || undefined : undefined;
  const fields = {
    app: h("input", {id: "au-app", name: "app", value: app, required: scoped}),
    executorId: h("input", {id: "au-executor", name: "executorId", value: applied.executorId, size: 36}),
    action: h("select", {id: "au-action", name: "action"}, h("option", {value: ""}, "Any action"),
      ACTIONS.map((a) => h("option", {value: a, selected: applied.action === a}, a))),
    since: h("input", {id: "au-since", name: "since", type: "datetime-local", value: applied.since}),
  };
  const labels = {app: "App", executorId: "Executor id", action: "Action", since: "Since (UTC)"};
  const controls = h("form", {class: "filters", "aria-label": "Filter the audit log"},
    Object.entries(fields).map(([k, el]) => h("label", {for: el.id}, labels[k], el)), h("button", {type: "submit"}, "Filter"));
  controls.addEventListener("submit", (ev) => {
    ev.preventDefault();
    ctx.go(["audit"], Object.fromEntries(Object.entries(fields).map(([k, el]) => [k, el.value.trim()])));
  });
  return basePage({
    section: "audit", title: "Audit log", controls,
    intro: h("p", {class: "note"}, `Newest first, ${AUDIT_PAGE} entries at a time.`),
    relevant: (name, data) => name === "audit" && offset === 0 && (!app || data.app === app),
    async load() {
      const q = {app, executorId: applied.executorId, action: applied.action,
        since: utc(applied.since), untilId,
        limit: AUDIT_PAGE, offset, sortDesc: true};
      if (scoped && !q.app) return h("p", {class: "note"}, "This key is limited to apps: name one of them.");
      const rows = await api("/audit", {params: q});
      return [
        table("Audit entries", [
          ["Time", (e) => when(e.at)], ["App", (e) => (e.app ? link(["apps", e.app], e.app) : "")],
          ["Action", (e) => h("code", {}, e.action)],
          ["Executor", (e) => (e.executorId && e.app ? link(["apps", e.app, "recoveries"], e.executorId, {executor: e.executorId}) : id(e.executorId))],
          ["Peer", (e) => (e.peerExecutorId && e.app ? executorLink(e.app, e.peerExecutorId) : id(e.peerExecutorId))], ["Actor", (e) => e.actor],
          ["Detail", (e) => auditDetail(e)],
        ], rows, {empty: "No entry matches."}),
        pager("Audit pages", {offset, limit: AUDIT_PAGE, shown: rows.length,
          go: (o) => ctx.go(["audit"], {...applied, offset: o, untilId: o ? untilId || (rows[0] && rows[0].id) : undefined})}),
      ];
    },
  });
}

// A lease given up by a clean stop (a rolling restart, a scale-in) is not one that ran out (a crash).
function leaseState(i) {
  return i.live ? "live" : i.releasedAt ? "released" : "expired";
}

function instancesPage() {
  return basePage({
    section: "instances", title: "Relay instances",
    intro: h("p", {class: "note"}, "Every instance on this database, its lease, and how many of this org's executors it holds."),
    relevant: (name, data) => name === "audit" ? data.action === "relay.instance_adopted" : true,
    async load() {
      const rows = await api("/instances");
      return table("Relay instances", [
        ["Instance", (i) => id(i.instanceId)],
        ["Lease", (i) => badge(leaseState(i))],
        ["Epoch", (i) => i.leaseEpoch, {num: true}],
        ["Expires", (i) => when(i.leaseExpiresAt)],
        ["Renewed", (i) => when(i.renewedAt)],
        ["Started", (i) => when(i.startedAt)],
        ["Adopted by", (i) => (i.adoptedBy ? h("span", {}, id(i.adoptedBy), " ", when(i.adoptedAt)) : "")],
        ["Executors", (i) => i.executors, {num: true}],
      ], rows, {empty: "No instance has started on this database."});
    },
  });
}

function notFound(parts) {
  return basePage({section: "", title: "Not found", relevant: () => false,
    async load() { return h("p", {}, `No page at /${parts.join("/")}. `, link([], "Back to the apps")); }});
}

export function pageFor(route, ctx) {
  const [first, app, tab, workflowId] = route.parts;
  if (!first) return appsPage(ctx);
  if (first === "audit") return auditPage(ctx);
  if (first === "instances") return instancesPage(ctx);
  if (first === "apps" && !app) return appsPage(ctx);
  if (first === "apps") {
    if (!tab || tab === "executors") return executorsPage(ctx, app);
    if (tab === "recoveries") return recoveriesPage(ctx, app);
    if (tab === "workflows" && workflowId !== undefined) return workflowPage(ctx, app, workflowId);
    if (tab === "workflows") return workflowsPage(ctx, app);
    if (tab === "queues") return queuesPage(ctx, app);
    if (tab === "schedules") return schedulesPage(ctx, app);
    if (tab === "alerts") return alertsPage(ctx, app);
  }
  return notFound(route.parts);
}
