"use strict";
const $ = (id) => document.getElementById(id);
const esc = (s) => String(s ?? "").replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
$("org").value = sessionStorage.getItem("relay.org") || "";
$("key").value = sessionStorage.getItem("relay.key") || "";

async function get(path) {
  const resp = await fetch(`/v2/orgs/${encodeURIComponent($("org").value)}${path}`,
                           {headers: {Authorization: `Bearer ${$("key").value}`}});
  const body = await resp.json();
  // Errors are problem details ({"detail": ...}) or, from older routes, {"error": {"message": ...}}.
  if (!resp.ok) throw new Error(body.detail || (body.error && body.error.message) || resp.statusText);
  return body;
}

// One request for the apps (their executors counted by state), and one page of executors for
// the app the operator picked: never every app's executors at every refresh.
let selected = null;
const PAGE = 100;

async function refresh() {
  try {
    const apps = await get(`/apps?limit=${PAGE}`);
    let html = `<table><tr><th>app</th><th>grace period (s)</th><th>HEALTHY</th><th>DISCONNECTED</th>
      <th>DEAD</th><th>RECOVERING</th></tr>`;
    for (const app of apps) {
      const n = app.executors || {};
      html += `<tr><td><a href="#" data-app="${esc(app.name)}">${esc(app.name)}</a></td>
        <td>${esc(app.executorTimeoutSecs)}</td><td>${esc(n.HEALTHY)}</td><td>${esc(n.DISCONNECTED)}</td>
        <td class="${n.DEAD ? "DEAD" : ""}">${esc(n.DEAD)}</td><td>${esc(n.RECOVERING)}</td></tr>`;
    }
    html += "</table>";
    if (selected !== null) html += await executorsOf(selected);
    $("apps").innerHTML = apps.length ? html : "<p>No apps yet.</p>";
    $("error").textContent = "";
  } catch (err) {
    $("error").textContent = err.message;
  }
}

async function executorsOf(app) {
  const executors = await get(`/apps/${encodeURIComponent(app)}/executors?limit=${PAGE}`);
  let html = `<h2>${esc(app)}</h2><table><tr><th>executor</th><th>state</th><th>version</th><th>host</th>
    <th>connected</th><th>disconnected</th><th>relay instance</th><th>blocked</th></tr>`;
  for (const e of executors) {
    html += `<tr><td>${esc(e.executorId)}</td><td class="${esc(e.state)}">${esc(e.state)}</td>
      <td>${esc(e.applicationVersion)}</td><td>${esc(e.hostname)}</td><td>${esc(e.connectedAt)}</td>
      <td>${esc(e.disconnectedAt)}</td><td>${esc(e.relayInstance)}</td>
      <td class="blocked">${esc(e.blockedReason)}</td></tr>`;
  }
  return html + (executors.length === PAGE ? `<p>First ${PAGE} shown.</p>` : "") + "</table>";
}

$("apps").addEventListener("click", (ev) => {
  const app = ev.target.dataset && ev.target.dataset.app;
  if (app) { ev.preventDefault(); selected = app; refresh(); }
});
$("login").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem("relay.org", $("org").value);
  sessionStorage.setItem("relay.key", $("key").value);
  refresh();
});
if ($("org").value && $("key").value) refresh();
setInterval(() => { if ($("org").value && $("key").value) refresh(); }, 5000);
