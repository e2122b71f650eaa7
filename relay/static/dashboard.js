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

async function refresh() {
  try {
    const apps = await get("/apps");
    let html = "";
    for (const app of apps) {
      const executors = await get(`/apps/${encodeURIComponent(app.name)}/executors`);
      html += `<h2>${esc(app.name)}</h2><p>grace period ${esc(app.executorTimeoutSecs)} s,
        recover to latest version: ${esc(app.recoverToLatestVersion)}</p>
        <table><tr><th>executor</th><th>state</th><th>version</th><th>host</th><th>connected</th>
        <th>disconnected</th><th>relay instance</th><th>blocked</th></tr>`;
      for (const e of executors) {
        html += `<tr><td>${esc(e.executorId)}</td><td class="${esc(e.state)}">${esc(e.state)}</td>
          <td>${esc(e.applicationVersion)}</td><td>${esc(e.hostname)}</td><td>${esc(e.connectedAt)}</td>
          <td>${esc(e.disconnectedAt)}</td><td>${esc(e.relayInstance)}</td>
          <td class="blocked">${esc(e.blockedReason)}</td></tr>`;
      }
      html += "</table>";
    }
    $("apps").innerHTML = html || "<p>No apps yet.</p>";
    $("error").textContent = "";
  } catch (err) {
    $("error").textContent = err.message;
  }
}

$("login").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem("relay.org", $("org").value);
  sessionStorage.setItem("relay.key", $("key").value);
  refresh();
});
if ($("org").value && $("key").value) refresh();
setInterval(() => { if ($("org").value && $("key").value) refresh(); }, 5000);
