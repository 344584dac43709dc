// gpuport's dashboard: follows /ui/events (the server's state every two seconds) and a job's log
// (/ui/jobs/ID/log). Every value is written as text (textContent), never as markup.
"use strict";

const $ = (id) => document.getElementById(id);
let csrf = "";
let events = null;
let logStream = null;
let logJob = "";
let outputsOf = ""; // the job whose outputs the log panel lists
let lastModels = {}; // name/version -> [at, requests, latency_ns, batches, rows], for rates
const jobsView = { state: "", name: "", user: "", page: 1 }; // the jobs table's filters and page

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

function when(at) {
  const date = new Date(at * 1000);
  return date.toDateString() === new Date().toDateString() ? date.toLocaleTimeString() : date.toLocaleString();
}

function resources(j) {
  const held = [];
  if (j.gpu_memory) held.push(`${size(j.gpu_memory)} GPU slice`);
  else if (j.gpus) held.push(`${j.gpus} GPU`);
  if (j.cpus) held.push(`${j.cpus} CPU`);
  if (j.memory) held.push(`${size(j.memory)} RAM`);
  if (j.nodes > 1) held.push(`× ${j.nodes} nodes`);
  return held.length ? held.join(" · ") : "—";
}

function renderJobs(page, state) {
  $("jobs-title").textContent = state.admin ? "Jobs (every user's)" : "Your jobs";
  $("filter-user").hidden = !state.admin;
  table($("jobs"), ["job", "name", "user", "state", "resources", "submitted", "duration", "exit"], page.jobs.map((j) => {
    const end = j.ended_at || Date.now() / 1000;
    const tr = row([
      j.id, j.name, j.owner, stateCell(j.state), resources(j), when(j.created_at),
      j.started_at ? duration(end - j.started_at) : "", j.exit_code === null ? "" : j.exit_code,
    ], () => openLog(j.id));
    tr.title = (j.command || []).join(" ");
    return tr;
  }));
  const first = (page.page - 1) * page.per_page;
  $("jobs-count").textContent = page.error
    || (page.total ? `${first + 1}–${first + page.jobs.length} of ${page.total}` : "");
  $("jobs-count").className = page.error ? "error" : "muted";
  $("jobs-prev").disabled = page.page <= 1;
  $("jobs-next").disabled = page.page >= page.pages;
  jobsView.page = page.page; // past the last page (jobs ended meanwhile) the server showed the last
  const shown = page.jobs.find((j) => j.id === logJob);
  if (shown) updateLogState(shown);
}

// Workers spread over a cluster's nodes: each one's node is said (as `gpuport sessions` and `models` do).
function spread(nodes) {
  return new Set(nodes.filter((n) => n)).size > 1;
}

function renderSessions(sessions) {
  const nodes = spread(sessions.map((s) => s.node));
  const heads = ["session", "name", "user", "state", ...(nodes ? ["node"] : []), "values", "idle", ""];
  table($("sessions"), heads, sessions.map((s) => row([
    s.id, s.name, s.owner, stateCell(s.state), ...(nodes ? [s.node || "-"] : []), s.refs,
    duration(Date.now() / 1000 - s.last_call_at),
    button("Close", () => call("POST", `/ui/sessions/${encodeURIComponent(s.id)}/close`), true),
  ])));
}

function renderModels(models, at) {
  const next = {};
  const nodes = spread(models.flatMap((m) => m.nodes));
  const heads = ["model", "version", "owner", "state", ...(nodes ? ["nodes"] : []), "requests", "per second",
    "mean latency", "rows per batch", ""];
  table($("models"), heads,
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
        m.name, m.version, m.owner, stateCell(m.state), ...(nodes ? [m.nodes.map((n) => n || "-").join(", ")] : []),
        m.requests, rate, latency, perBatch,
        m.mine ? button("Undeploy", () => call("POST", `/ui/models/${encodeURIComponent(m.name)}/${m.version}/undeploy`), true) : "",
      ]);
    }));
  lastModels = next;
}

function renderUsage(usage, admin) {
  $("usage-title").textContent = admin ? "Usage, last 7 days (every user's)" : "Your usage, last 7 days";
  const share = (x) => (x === null ? "" : `${(x * 100).toPrecision(2)}%`);
  const hours = (h) => (h >= 10 || h === 0 ? h.toFixed(1) : h.toPrecision(2));
  table($("usage"), ["user", "GPU-hours", "CPU-hours", "runs", "shares", "effective share", "decayed use"],
    usage.map((u) => row([
      u.user, hours(u.gpu_hours), hours(u.cpu_hours), u.runs, u.shares === null ? "" : u.shares,
      share(u.effective_share), share(u.decayed_use),
    ])));
}

// The environments built for jobs' requirements: a row each; its packages show on hover, and listed
// under it once the row is clicked.
const openEnvs = new Set(); // the hashes whose packages are listed
function renderEnvironments(envs) {
  const rows = [];
  for (const e of envs) {
    const names = e.packages.map((p) => p.split("==")[0]);
    const summary = names.slice(0, 4).join(", ") + (names.length > 4 ? ", …" : "");
    const tr = row([
      e.hash.slice(0, 12), `Python ${e.python_version}`, `${e.packages.length} packages`, { wide: summary },
      size(e.size), `${duration(Date.now() / 1000 - e.last_used)} ago`, e.running, e.jobs,
    ], () => {
      if (openEnvs.has(e.hash)) openEnvs.delete(e.hash); else openEnvs.add(e.hash);
      renderEnvironments(envs);
    });
    tr.title = `${e.hash}\n${e.packages.join("\n")}`;
    tr.dataset.env = e.hash;
    rows.push(tr);
    if (openEnvs.has(e.hash)) {
      const more = el("tr", undefined, "packages");
      const td = el("td", e.packages.join("  "), "wide");
      td.colSpan = 8;
      more.append(td);
      rows.push(more);
    }
  }
  table($("environments"), ["environment", "python", "packages", "", "size", "last used", "jobs now", "jobs in all"], rows);
}

function render(state) {
  $("who").textContent = `${state.user}${state.admin ? " (admin)" : ""}`;
  $("status").textContent = `updated ${new Date(state.at * 1000).toLocaleTimeString()}`;
  renderGpus(state.gpus);
  renderQueue(state.queue);
  renderJobs(state.jobs, state);
  renderSessions(state.sessions);
  renderModels(state.models, state.at);
  renderUsage(state.usage, state.admin);
  renderEnvironments(state.environments);
}

function updateLogState(job) {
  const s = $("log-state");
  s.textContent = job.state;
  s.className = `state ${job.state}`;
  $("log-command").textContent = (job.command || []).join(" ");
  $("log-cancel").hidden = !(job.state === "queued" || job.state === "running");
  if (job.state !== "queued" && job.state !== "running" && outputsOf !== job.id) {
    outputsOf = job.id;
    showOutputs(job);
  }
}

function outputLink(job, path) {
  const parts = path.split("/").map(encodeURIComponent).join("/");
  const a = el("a", path);
  a.href = `/ui/jobs/${encodeURIComponent(job.id)}/outputs/${parts}`;
  a.download = path.split("/").pop();
  return a;
}

async function showOutputs(job) {
  const box = $("outputs");
  box.replaceChildren();
  let files;
  try { files = await call("GET", `/ui/jobs/${encodeURIComponent(job.id)}/outputs`); }
  catch (e) { files = e; }
  if (outputsOf !== job.id) return; // another job's panel opened meanwhile
  if (files instanceof Error) { box.append(el("p", files.message, "muted")); return; }
  const all = el("a", "Download all outputs (.tar.gz)", "download");
  all.href = `/ui/jobs/${encodeURIComponent(job.id)}/outputs.tar.gz`;
  all.download = `${job.id}-outputs.tar.gz`;
  box.append(el("h3", `Outputs (${files.length} files)`), all);
  const list = el("ul");
  for (const f of files) {
    const item = el("li");
    if (f.link) item.append(el("span", `${f.path} → ${f.link}`));
    else item.append(outputLink(job, f.path), el("span", ` ${size(f.size)}`, "muted"));
    list.append(item);
  }
  box.append(list);
}

// A job's log as a terminal shows it: "\r" goes back to the line's start (a progress bar rewritten
// in place shows its last state), "\b" one column back; SGR sequences (ESC [ ... m) set bold, colours
// and the like as classes of style.css (the CSP forbids inline styles); ESC [ K erases the line from
// the cursor; every other escape sequence and control character is dropped. Text only: each piece
// becomes a text node or a span's textContent.
const SGR_FLAGS = { 1: "bold", 2: "dim", 3: "italic", 4: "underline" };
const SGR_OFF = { 22: ["bold", "dim"], 23: ["italic"], 24: ["underline"] };

class Terminal {
  constructor(node) {
    this.node = node;
    this.cells = []; // the line being written: [character, classes] each
    this.column = 0;
    this.style = { flags: new Set(), fg: null, bg: null };
    this.classes = "";
    this.pending = ""; // an escape sequence cut at a chunk's end
    this.current = el("span");
    node.replaceChildren(this.current);
  }

  write(text) {
    text = this.pending + text;
    this.pending = "";
    const done = document.createDocumentFragment();
    let i = 0;
    if (!this.cells.length && !this.column) { // whole plain lines, most of a log, go in as they are
      const end = text.lastIndexOf("\n") + 1;
      if (end && !/[\x00-\x08\x0b-\x1f]/.test(text.slice(0, end))) {
        const plain = text.slice(0, end);
        done.append(this.classes ? el("span", plain, this.classes) : document.createTextNode(plain));
        i = end;
      }
    }
    while (i < text.length) {
      const c = text[i];
      if (c === "\x1b") {
        const used = this.escape(text, i);
        if (used === 0) { // cut short at the chunk's end: the rest comes with the next chunk
          this.pending = text.slice(i);
          break;
        }
        i += used;
        continue;
      }
      if (c === "\n") { this.commit(done); }
      else if (c === "\r") { this.column = 0; }
      else if (c === "\b") { this.column = Math.max(0, this.column - 1); }
      else if (c >= " " || c === "\t") { this.put(c); }
      i += 1;
    }
    this.node.insertBefore(done, this.current);
    this.current.replaceChildren(...this.pieces());
  }

  put(c) {
    while (this.cells.length < this.column) this.cells.push([" ", ""]);
    this.cells[this.column] = [c, this.classes];
    this.column += 1;
  }

  // The length of the escape sequence at text[i], once applied; 0 when the text ends inside it.
  // A malformed one loses its ESC alone.
  escape(text, i) {
    const rest = text.slice(i, i + 64);
    const cut = i + 64 >= text.length; // what is here may yet be completed by the next chunk
    if (rest.length === 1) return 0;
    if (rest[1] === "[") {
      const m = /^\x1b\[([0-?]*)([ -\/]*)([@-~])/.exec(rest);
      if (!m) return cut && /^\x1b\[[0-?]*[ -\/]*$/.test(rest) ? 0 : 1;
      if (m[3] === "m" && !m[2]) this.sgr(m[1]);
      else if (m[3] === "K" && !m[2]) this.erase(m[1]);
      return m[0].length;
    }
    if (rest[1] === "]") { // an operating system command (a window title...): up to BEL or ESC \
      const end = /\x07|\x1b\\/.exec(text.slice(i + 2, i + 4096));
      if (end) return 2 + end.index + end[0].length;
      return i + 4096 >= text.length ? 0 : 1;
    }
    const m = /^\x1b[ -\/]*[0-~]/.exec(rest);
    if (m) return m[0].length;
    return cut && /^\x1b[ -\/]*$/.test(rest) ? 0 : 1;
  }

  sgr(params) {
    const codes = params === "" ? [0] : params.split(";").map((p) => (p === "" ? 0 : Number(p)));
    const style = this.style;
    for (let k = 0; k < codes.length; k++) {
      const n = codes[k];
      if (n === 0) { style.flags.clear(); style.fg = null; style.bg = null; }
      else if (SGR_FLAGS[n]) style.flags.add(SGR_FLAGS[n]);
      else if (SGR_OFF[n]) for (const f of SGR_OFF[n]) style.flags.delete(f);
      else if (n >= 30 && n <= 37) style.fg = n - 30;
      else if (n >= 90 && n <= 97) style.fg = n - 90 + 8;
      else if (n === 39) style.fg = null;
      else if (n >= 40 && n <= 47) style.bg = n - 40;
      else if (n >= 100 && n <= 107) style.bg = n - 100 + 8;
      else if (n === 49) style.bg = null;
      else if (n === 38 || n === 48) { // 256 colours (the first 16 kept) or RGB (dropped)
        if (codes[k + 1] === 5) {
          const colour = codes[k + 2];
          if (colour < 16) style[n === 38 ? "fg" : "bg"] = colour;
          k += 2;
        } else if (codes[k + 1] === 2) k += 4;
      }
    }
    const classes = [...style.flags].map((f) => `ansi-${f}`);
    if (style.fg !== null) classes.push(`ansi-fg-${style.fg}`);
    if (style.bg !== null) classes.push(`ansi-bg-${style.bg}`);
    this.classes = classes.join(" ");
  }

  erase(param) {
    if (param === "" || param === "0") this.cells.length = Math.min(this.cells.length, this.column);
    else if (param === "1") for (let k = 0; k <= this.column && k < this.cells.length; k++) this.cells[k] = [" ", ""];
    else if (param === "2") this.cells = [];
  }

  // The line being written, as text nodes and spans: one per run of characters of the same classes.
  pieces() {
    const out = [];
    let start = 0;
    for (let k = 1; k <= this.cells.length; k++) {
      if (k === this.cells.length || this.cells[k][1] !== this.cells[start][1]) {
        const text = this.cells.slice(start, k).map((cell) => cell[0]).join("");
        const cls = this.cells[start][1];
        out.push(cls ? el("span", text, cls) : document.createTextNode(text));
        start = k;
      }
    }
    return out;
  }

  commit(into) {
    into.append(...this.pieces(), document.createTextNode("\n"));
    this.cells = [];
    this.column = 0;
  }
}

let terminal = null;

function closeLog() {
  if (logStream) logStream.close();
  logStream = null;
  logJob = "";
  $("log-panel").hidden = true;
}

function openLog(id) {
  closeLog();
  logJob = id;
  outputsOf = "";
  $("outputs").replaceChildren();
  $("log-command").textContent = "";
  $("log-panel").hidden = false;
  $("log-job").textContent = id;
  terminal = new Terminal($("log"));
  logStream = new EventSource(`/ui/jobs/${encodeURIComponent(id)}/log`);
  logStream.onmessage = (event) => {
    const chunk = JSON.parse(event.data);
    const pre = $("log");
    const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    terminal.write(chunk.text);
    if (atBottom) pre.scrollTop = pre.scrollHeight;
  };
  logStream.addEventListener("ended", (event) => {
    const data = JSON.parse(event.data);
    if (data.error) terminal.write(`\n[${data.error}]\n`);
    else updateLogState(data);
    logStream.close();
  });
}

function follow() {
  if (events) events.close();
  const query = new URLSearchParams();
  for (const [key, value] of Object.entries(jobsView)) if (value !== "" && !(key === "page" && value === 1)) query.set(key, value);
  events = new EventSource(`/ui/events${query.size ? `?${query}` : ""}`);
  events.onmessage = (event) => render(JSON.parse(event.data));
  events.addEventListener("ended", (event) => {
    events.close();
    showLogin(JSON.parse(event.data).error);
  });
  events.onerror = () => {
    $("status").textContent = "reconnecting…";
    // A stream refused (its login revoked or expired while it was away) is not retried by the
    // browser: ask who this login is, and show why it ended.
    if (events.readyState === EventSource.CLOSED) {
      setTimeout(() => call("GET", "/ui/me").then(follow, (e) => showLogin(e.message)), 1000);
    }
  };
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

function filtersChanged() {
  jobsView.state = $("filter-state").value;
  jobsView.name = $("filter-name").value.trim();
  jobsView.user = $("filter-user").value.trim();
  jobsView.page = 1;
  follow();
}

async function start() {
  let typing = null;
  $("filter-state").addEventListener("change", filtersChanged);
  for (const id of ["filter-name", "filter-user"]) {
    $(id).addEventListener("input", () => { clearTimeout(typing); typing = setTimeout(filtersChanged, 300); });
  }
  $("job-filters").addEventListener("submit", (event) => { event.preventDefault(); filtersChanged(); });
  $("jobs-prev").addEventListener("click", () => { jobsView.page -= 1; follow(); });
  $("jobs-next").addEventListener("click", () => { jobsView.page += 1; follow(); });
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
