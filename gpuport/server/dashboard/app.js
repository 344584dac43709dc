// gpuport's dashboard: follows /ui/events (the server's state every two seconds) and a job's log
// (/ui/jobs/ID/log). Every value is written as text (textContent), never as markup.
"use strict";

const $ = (id) => document.getElementById(id);
let csrf = "";
let events = null;
let logStream = null;
let logJob = "";
let lastModels = {}; // name/version -> [at, requests, latency_ns, batches, rows], for rates

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function size(bytes) {
  if (!bytes) return "0";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (bytes >= 1024 && i < units.length - 1) { bytes /= 1024; i++; }
  return `${bytes.toFixed(bytes < 10 && i ? 1 : 0)} ${units[i]}`;
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "";
  seconds = Math.max(0, seconds);
  if (seconds < 60) return `${seconds.toFixed(seconds < 10 ? 1 : 0)}s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)}m${Math.floor(seconds % 60)}s`;
  return `${Math.floor(seconds / 3600)}h${Math.floor((seconds % 3600) / 60)}m`;
}

async function call(method, path, body) {
  const headers = { "x-csrf-token": csrf };
  if (body !== undefined) headers["content-type"] = "application/json";
  const response = await fetch(path, {
    method, headers, credentials: "same-origin", body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await response.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (e) { data = null; }
  if (!response.ok) {
    const message = data && data.error ? (data.error.message || data.error) : `${response.status} ${text}`;
    throw new Error(message);
  }
  return data;
}

function table(node, heads, rows) {
  node.replaceChildren();
  const head = el("tr");
  for (const h of heads) head.append(el("th", h));
  node.append(head);
  if (!rows.length) {
    const tr = el("tr");
    const td = el("td", "none", "muted");
    td.colSpan = heads.length;
    tr.append(td);
    node.append(tr);
  }
  for (const row of rows) node.append(row);
}

function row(cells, onclick) {
  const tr = el("tr");
  for (const cell of cells) {
    if (cell instanceof Node) { const td = el("td"); td.append(cell); tr.append(td); }
    else if (cell && cell.wide) tr.append(el("td", cell.wide, "wide"));
    else tr.append(el("td", cell));
  }
  if (onclick) { tr.className = "clickable"; tr.addEventListener("click", onclick); }
  return tr;
}

function stateCell(state) { return el("span", state, `state ${state}`); }

function button(label, action, danger) {
  const b = el("button", label, danger ? "danger" : "");
  b.addEventListener("click", async (event) => {
    event.stopPropagation();
    b.disabled = true;
    try { await action(); } catch (e) { $("status").textContent = e.message; }
    b.disabled = false;
  });
  return b;
}

function chart(history, total) {
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("class", "chart");
  svg.setAttribute("viewBox", "0 0 300 70");
  svg.setAttribute("preserveAspectRatio", "none");
  const frame = document.createElementNS(ns, "rect");
  frame.setAttribute("class", "frame");
  frame.setAttribute("x", "0"); frame.setAttribute("y", "0");
  frame.setAttribute("width", "300"); frame.setAttribute("height", "70");
  svg.append(frame);
  const now = Date.now() / 1000;
  const x = (at) => 300 - Math.min(3600, now - at) / 3600 * 300; // the last hour, now at the right
  const line = (cls, value) => {
    const points = history.filter((r) => value(r) !== null).map((r) => `${x(r[0]).toFixed(1)},${(68 - value(r) * 66).toFixed(1)}`);
    if (points.length < 1) return;
    const path = document.createElementNS(ns, "polyline");
    path.setAttribute("class", cls);
    path.setAttribute("points", points.length === 1 ? `${points[0]} 300,${points[0].split(",")[1]}` : points.join(" "));
    svg.append(path);
  };
  line("util", (r) => (r[1] === null ? null : r[1] / 100));
  line("mem", (r) => (total ? r[2] / total : 0));
  return svg;
}

function renderGpus(gpus) {
  const box = $("gpus");
  box.replaceChildren();
  if (!gpus.length) box.append(el("p", "This server has no GPUs (its jobs run on the CPU).", "muted"));
  for (const gpu of gpus) {
    const card = el("div", undefined, "card");
    card.dataset.gpu = gpu.key;
    card.append(el("h3", `GPU ${gpu.key} · ${gpu.name}`));
    const util = gpu.utilization === null ? "utilization unknown" : `${gpu.utilization}% busy`;
    card.append(el("div", `${util} · ${size(gpu.memory_used)} of ${size(gpu.memory_total)}`, "muted"));
    const bar = el("div", undefined, "bar");
    const fill = el("div");
    fill.style.width = `${gpu.memory_total ? (100 * gpu.memory_used) / gpu.memory_total : 0}%`;
    bar.append(fill);
    card.append(bar);
    card.append(chart(gpu.history, gpu.memory_total));
    const legend = el("div", undefined, "legend");
    legend.append(el("span", "— utilization", "u"), el("span", "— memory (last hour)", "m"));
    card.append(legend);
    const holders = gpu.holders.length
      ? gpu.holders.map((h) => `${h.user} · ${h.job}${h.memory ? ` (${size(h.memory)} slice)` : ""}`).join(", ")
      : "free";
    card.append(el("div", `held by: ${holders}`, "holders"));
    box.append(card);
  }
}

function renderQueue(queue) {
  table($("queue"), ["#", "job", "user", "asks for", "waiting", "why"], queue.map((j) => row([
    j.position, j.id, j.owner, j.gpu_memory ? `${size(j.gpu_memory)} of a GPU` : `${j.gpus} GPU`,
    duration(Date.now() / 1000 - j.created_at), { wide: j.message },
  ])));
}

function renderJobs(jobs, state) {
  $("jobs-title").textContent = state.admin ? "Jobs (every user's)" : "Your jobs";
  table($("jobs"), ["job", "user", "state", "command", "duration", "exit"], jobs.map((j) => {
    const end = j.ended_at || Date.now() / 1000;
    return row([
      j.id, j.owner, stateCell(j.state), { wide: (j.command || []).join(" ") },
      j.started_at ? duration(end - j.started_at) : "", j.exit_code === null ? "" : j.exit_code,
    ], () => openLog(j.id));
  }));
  const shown = jobs.find((j) => j.id === logJob);
  if (shown) updateLogState(shown);
}

function renderSessions(sessions) {
  table($("sessions"), ["session", "name", "user", "state", "values", "idle", ""], sessions.map((s) => row([
    s.id, s.name, s.owner, stateCell(s.state), s.refs, duration(Date.now() / 1000 - s.last_call_at),
    button("Close", () => call("POST", `/ui/sessions/${encodeURIComponent(s.id)}/close`), true),
  ])));
}

function renderModels(models, at) {
  const next = {};
  table($("models"), ["model", "version", "owner", "state", "requests", "per second", "mean latency", "rows per batch", ""],
    models.map((m) => {
      const key = `${m.name}/${m.version}`;
      const before = lastModels[key];
      next[key] = [at, m.requests, m.latency_ns, m.batches, m.rows];
      let rate = "", latency = "";
      if (before && at > before[0]) {
        rate = ((m.requests - before[1]) / (at - before[0])).toFixed(1);
        const done = m.requests - before[1];
        latency = done > 0 ? `${((m.latency_ns - before[2]) / done / 1e6).toFixed(1)} ms` : "";
      }
      const perBatch = m.batches ? (m.rows / m.batches).toFixed(1) : "";
      return row([
        m.name, m.version, m.owner, stateCell(m.state), m.requests, rate, latency, perBatch,
        m.mine ? button("Undeploy", () => call("POST", `/ui/models/${encodeURIComponent(m.name)}/${m.version}/undeploy`), true) : "",
      ]);
    }));
  lastModels = next;
}

function render(state) {
  $("who").textContent = `${state.user}${state.admin ? " (admin)" : ""}`;
  $("status").textContent = `updated ${new Date(state.at * 1000).toLocaleTimeString()}`;
  renderGpus(state.gpus);
  renderQueue(state.queue);
  renderJobs(state.jobs, state);
  renderSessions(state.sessions);
  renderModels(state.models, state.at);
}

function updateLogState(job) {
  const s = $("log-state");
  s.textContent = job.state;
  s.className = `state ${job.state}`;
  $("log-cancel").hidden = !(job.state === "queued" || job.state === "running");
}

function closeLog() {
  if (logStream) logStream.close();
  logStream = null;
  logJob = "";
  $("log-panel").hidden = true;
}

function openLog(id) {
  closeLog();
  logJob = id;
  $("log-panel").hidden = false;
  $("log-job").textContent = id;
  $("log").textContent = "";
  logStream = new EventSource(`/ui/jobs/${encodeURIComponent(id)}/log`);
  logStream.onmessage = (event) => {
    const chunk = JSON.parse(event.data);
    const pre = $("log");
    const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    pre.append(document.createTextNode(chunk.text));
    if (atBottom) pre.scrollTop = pre.scrollHeight;
  };
  logStream.addEventListener("ended", (event) => {
    const data = JSON.parse(event.data);
    if (data.error) $("log").append(document.createTextNode(`\n[${data.error}]\n`));
    else updateLogState(data);
    logStream.close();
  });
}

function follow() {
  if (events) events.close();
  events = new EventSource("/ui/events");
  events.onmessage = (event) => render(JSON.parse(event.data));
  events.addEventListener("ended", (event) => {
    events.close();
    showLogin(JSON.parse(event.data).error);
  });
  events.onerror = () => { $("status").textContent = "reconnecting…"; };
}

function showLogin(message) {
  if (events) events.close();
  closeLog();
  $("board").hidden = true;
  $("logout").hidden = true;
  $("who").textContent = "";
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  $("token").focus();
}

function showBoard(me) {
  csrf = me.csrf;
  $("login").hidden = true;
  $("board").hidden = false;
  $("logout").hidden = false;
  $("who").textContent = me.user;
  follow();
}

async function start() {
  $("login").addEventListener("submit", async (event) => {
    event.preventDefault();
    const token = $("token").value.trim();
    $("token").value = "";
    try { showBoard(await call("POST", "/ui/login", { token })); } catch (e) { showLogin(e.message); }
  });
  $("logout").addEventListener("click", async () => {
    try { await call("POST", "/ui/logout"); } catch (e) { /* logged out anyway */ }
    showLogin("");
  });
  $("log-close").addEventListener("click", closeLog);
  $("log-cancel").addEventListener("click", async () => {
    try { updateLogState(await call("POST", `/ui/jobs/${encodeURIComponent(logJob)}/cancel`)); }
    catch (e) { $("status").textContent = e.message; }
  });
  window.addEventListener("hashchange", logInByLink); // a link opened in a tab showing the page already
  if (await logInByLink()) return;
  try { showBoard(await call("GET", "/ui/me")); } catch (e) { showLogin(""); }
}

// A one-time link (gpuport dashboard): its code is in the fragment, which the browser never sends;
// it leaves the address bar and the history before it is posted, and works once.
async function logInByLink() {
  const code = new URLSearchParams(location.hash.slice(1)).get("code");
  if (code === null) return false;
  history.replaceState(null, "", location.pathname + location.search);
  try { showBoard(await call("POST", "/ui/login", { code })); } catch (e) { showLogin(e.message); }
  return true;
}

start();
