// The REST API as the console uses it: the key from sessionStorage in the Authorization header,
// problem details turned into errors, and the live event stream read with fetch (EventSource
// cannot send the header).

const KEY = "relay.key";
const ORG = "relay.org";

export const session = {
  get org() { return sessionStorage.getItem(ORG) || ""; },
  get key() { return sessionStorage.getItem(KEY) || ""; },
  save(org, key) { sessionStorage.setItem(ORG, org); sessionStorage.setItem(KEY, key); },
  clear() { sessionStorage.removeItem(ORG); sessionStorage.removeItem(KEY); },
};

export class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

export const enc = encodeURIComponent;

function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) if (v !== undefined && v !== null && v !== "") q.set(k, v);
  const text = q.toString();
  return text ? `?${text}` : "";
}

export async function api(path, options = {}) {
  return (await call(path, options)).data;
}

// A listing with the number of rows its filters match on every page (total=true: X-Total-Count).
export async function apiCounted(path, {params, ...options} = {}) {
  const {data, resp} = await call(path, {...options, params: {...params, total: true}});
  return {rows: data, total: Number(resp.headers.get("X-Total-Count"))};
}

async function call(path, {method = "GET", params, body, org = session.org, key = session.key} = {}) {
  const headers = {Authorization: `Bearer ${key}`};
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const resp = await fetch(`v2/orgs/${enc(org)}${path}${query(params)}`, {
    method, headers, body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await resp.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = null; }
  if (!resp.ok) {
    const detail = (data && (data.detail || (data.error && data.error.message))) || resp.statusText || `HTTP ${resp.status}`;
    throw new ApiError(resp.status, `${detail} (${resp.status})`);
  }
  return {data, resp};
}

// Reads GET /v2/orgs/{org}/events until it ends; calls onEvent(name, data) for each event.
// Resolves when the stream ends (or the signal aborts it), rejects on an HTTP error.
export async function readEvents(onEvent, signal) {
  const resp = await fetch(`v2/orgs/${enc(session.org)}/events`, {
    headers: {Authorization: `Bearer ${session.key}`, Accept: "text/event-stream"}, signal,
  });
  if (!resp.ok || !resp.body) throw new ApiError(resp.status, `event stream: HTTP ${resp.status}`);
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).trim());
      }
      if (!data.length) { onEvent("heartbeat", null); continue; }  // a heartbeat (a comment line)
      let parsed = null;
      try { parsed = JSON.parse(data.join("\n")); } catch { continue; }
      onEvent(name, parsed);
    }
  }
}
