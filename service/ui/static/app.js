// The dashboard's live parts: list refresh, job charts and events (SSE), compare, upload, editor.
// Charts are plotly.js (served from the plotly wheel); pages work without this script, minus live data.
"use strict";

const TERMINAL = ["succeeded", "failed", "cancelled"];
const EVENT_TYPES = ["status", "stage", "log", "warning", "error", "reconcile", "info"];
const PLOT_CONFIG = { responsive: true, displaylogo: false };

function pageData() {
  const node = document.getElementById("page-data");
  return node ? JSON.parse(node.textContent) : {};
}

function csrfToken() {
  return document.getElementById("main").dataset.csrf;
}

async function getJSON(url) {
  const res = await fetch(url, { headers: { Accept: "application/json" }, credentials: "same-origin" });
  if (!res.ok) throw new Error(`${url}: HTTP ${res.status}`);
  return res.json();
}

// Re-read a part of the page. A part holding the keyboard focus is left alone, so a refresh never pulls
// the focus from under a keyboard user (it is re-read on the next tick after they move on).
async function swapHTML(node, url, selector) {
  const target = selector ? node.querySelector(selector) : node;
  if (target.contains(document.activeElement) && document.activeElement !== document.body) return false;
  const res = await fetch(url, { headers: { Accept: "text/html" }, credentials: "same-origin" });
  if (!res.ok) return false;
  const html = await res.text();
  if (target.contains(document.activeElement) && document.activeElement !== document.body) return false;
  target.innerHTML = html;
  return true;
}

// Replace `selector`'s content with the same element of a freshly fetched page.
async function refreshFromPage(url, selector) {
  const res = await fetch(url, { headers: { Accept: "text/html" }, credentials: "same-origin" });
  if (!res.ok) return;
  const doc = new DOMParser().parseFromString(await res.text(), "text/html");
  const fresh = doc.querySelector(selector);
  if (fresh) document.querySelector(selector).innerHTML = fresh.innerHTML;
}

function layout(title, yTitle, extra) {
  return Object.assign(
    {
      title: { text: title, font: { size: 14 }, x: 0.01, xanchor: "left" },
      xaxis: { title: { text: "step" }, rangemode: "tozero" },
      yaxis: { title: { text: yTitle } },
      margin: { l: 60, r: 16, t: 36, b: 44 },
      height: 280,
      legend: { orientation: "h", x: 1, xanchor: "right", y: 1.02, yanchor: "bottom" },
    },
    extra || {}
  );
}

// Every metric row of a job, paging with the dashboard's row cursor.
async function fetchMetrics(jobId, after) {
  const rows = [];
  let cursor = after;
  for (;;) {
    const q = cursor == null ? "" : `?after=${cursor}`;
    const page = await getJSON(`/ui/data/jobs/${encodeURIComponent(jobId)}/metrics${q}`);
    rows.push(...page.data);
    if (page.cursor != null) cursor = page.cursor;
    if (!page.has_more) return { rows, cursor };
  }
}

function series(rows, key) {
  const x = [], y = [];
  for (const r of rows) {
    const v = r.values[key];
    if (typeof v === "number") { x.push(r.step); y.push(v); }
  }
  return { x, y };
}

// Acceptance-length series: ours (eval/acceptance_length@K) and vLLM's (eval/vllm_acceptance_length@K).
function evalKeys(rows) {
  const keys = new Set();
  for (const r of rows) {
    for (const k of Object.keys(r.values)) {
      if (k.startsWith("eval/acceptance_length@") || k.startsWith("eval/vllm_acceptance_length@")) keys.add(k);
    }
  }
  return [...keys].sort();
}

function evalLabel(key) {
  const k = key.split("@")[1];
  return key.startsWith("eval/vllm_") ? `vLLM K=${k}` : `ours K=${k}`;
}

// -- jobs list -----------------------------------------------------------------------------------

function initJobList() {
  const table = document.getElementById("jobs");
  if (!table) return;
  const select = document.getElementById("status");
  select.addEventListener("change", () => document.getElementById("status-filter").submit());
  setInterval(() => swapHTML(table, table.dataset.refresh, "tbody").catch(() => {}), 3000);
}

// -- a job's page --------------------------------------------------------------------------------

function drawJobCharts(rows, depths) {
  const line = (s, name) => ({ x: s.x, y: s.y, name, type: "scatter", mode: "lines+markers", marker: { size: 4 } });
  Plotly.react("chart-loss", [line(series(rows, "loss"), "loss")], layout("Loss (KL to the verifier)", "loss"), PLOT_CONFIG);
  const acc = [];
  for (let d = 0; d < depths; d++) acc.push(line(series(rows, `acc_${d}`), `depth ${d}`));
  Plotly.react("chart-acc", acc, layout("Accuracy per depth", "top-1 agreement", { yaxis: { range: [0, 1], title: { text: "top-1 agreement" } } }), PLOT_CONFIG);
  Plotly.react("chart-tps", [line(series(rows, "tokens_per_s"), "tokens/s")], layout("Throughput", "tokens/s"), PLOT_CONFIG);
  Plotly.react("chart-lr", [line(series(rows, "lr"), "lr")], layout("Learning rate", "lr"), PLOT_CONFIG);
  const al = evalKeys(rows).map((k) => line(series(rows, k), evalLabel(k)));
  Plotly.react("chart-al", al, layout("Acceptance length per evaluation", "tokens per verifier pass"), PLOT_CONFIG);
  const n = series(rows, "loss").x.length;
  document.getElementById("points-note").textContent = `${n} training steps logged.`;
}

function initJobPage() {
  const panels = [...document.querySelectorAll(".panel[data-refresh]")];
  if (!panels.length || !document.getElementById("chart-loss")) return;
  const data = pageData();
  let rows = [];
  let cursor = null;
  let terminal = data.terminal;
  let busy = false;

  async function refreshMetrics() {
    if (busy) return;
    busy = true;
    try {
      const got = await fetchMetrics(data.job_id, cursor);
      cursor = got.cursor;
      if (got.rows.length || !rows.length) {
        rows = rows.concat(got.rows);
        drawJobCharts(rows, data.depths);
      }
    } finally {
      busy = false;
    }
  }
  const refreshPanel = () => Promise.all(panels.map((p) => swapHTML(p, p.dataset.refresh).catch(() => {})));

  refreshMetrics();
  const timer = setInterval(() => {
    if (terminal) return;
    refreshMetrics().catch(() => {});
    refreshPanel();
  }, 3000);

  const list = document.getElementById("events");
  const source = new EventSource(`/ui/data/jobs/${encodeURIComponent(data.job_id)}/events`);
  const onEvent = (msg) => {
    const ev = JSON.parse(msg.data);
    const li = document.createElement("li");
    li.className = `level-${ev.level}`;
    const when = new Date(ev.created_at).toLocaleTimeString();
    li.textContent = `${when} · ${ev.level} · ${ev.type} · ${ev.message}`;
    list.appendChild(li);
    // Keep the page light on long jobs: the newest events only (the API keeps them all).
    while (list.childElementCount > 500) list.firstElementChild.remove();
    if (ev.type === "status" || ev.type === "stage") refreshPanel();
    if (ev.type === "status" && ev.data && TERMINAL.includes(ev.data.status)) {
      terminal = true;
      // The last metric rows land before the final status: one more read gets them all.
      setTimeout(() => refreshMetrics().catch(() => {}), 0);
    }
  };
  for (const t of EVENT_TYPES) source.addEventListener(t, onEvent);
  source.onmessage = onEvent;
  source.addEventListener("end", () => {
    source.close();
    document.getElementById("events-state").textContent = "(job finished)";
    terminal = true;
    refreshPanel().then(() => refreshMetrics().catch(() => {}));
    clearInterval(timer);
  });
}

// -- copy buttons (the panel is re-rendered, so listen on the document) --------------------------------

function initCopy() {
  document.addEventListener("click", async (e) => {
    const button = e.target.closest("button.copy");
    if (!button) return;
    const code = document.getElementById(button.dataset.copy);
    const note = button.parentElement.querySelector(".copied");
    try {
      await navigator.clipboard.writeText(code.textContent);
      note.textContent = "Copied.";
    } catch {
      // No clipboard permission: select the text so Ctrl+C copies it.
      const range = document.createRange();
      range.selectNodeContents(code);
      const sel = window.getSelection();
      sel.removeAllRanges();
      sel.addRange(range);
      note.textContent = "Selected: press Ctrl+C to copy.";
    }
  });
}

// -- compare -------------------------------------------------------------------------------------

function initCompare() {
  const chart = document.getElementById("chart-compare");
  if (!chart) return;
  const data = pageData();
  const select = document.getElementById("metric");
  const all = {};
  const draw = () => {
    const metric = select.value;
    const traces = [];
    for (const job of data.jobs) {
      const rows = all[job.id] || [];
      const keys = metric === "eval" ? evalKeys(rows) : [metric];
      for (const k of keys) {
        const s = series(rows, k);
        const suffix = metric === "eval" ? ` (${evalLabel(k)})` : "";
        traces.push({ x: s.x, y: s.y, name: `${job.name}${suffix}`, type: "scatter", mode: "lines+markers", marker: { size: 4 } });
      }
    }
    const label = select.options[select.selectedIndex].text;
    Plotly.react(chart, traces, layout(label, label, { height: 420 }), PLOT_CONFIG);
  };
  Promise.all(data.jobs.map((j) => fetchMetrics(j.id, null).then((got) => { all[j.id] = got.rows; }))).then(draw);
  select.addEventListener("change", draw);
}

// -- datasets ------------------------------------------------------------------------------------

function initUpload() {
  const form = document.getElementById("upload");
  if (!form) return;
  const bar = document.getElementById("upload-progress");
  const percent = document.getElementById("upload-percent");
  const result = document.getElementById("upload-result");
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    const file = document.getElementById("file").files[0];
    if (!file) return;
    const body = new FormData();
    body.append("file", file);
    const xhr = new XMLHttpRequest();
    xhr.open("POST", form.action);
    xhr.setRequestHeader("X-CSRF-Token", csrfToken());
    xhr.setRequestHeader("Accept", "application/json");
    const show = (p) => { bar.value = p; bar.textContent = `${p}%`; percent.textContent = `${p}%`; };
    xhr.upload.addEventListener("progress", (ev) => {
      if (ev.lengthComputable) show(Math.round((100 * ev.loaded) / ev.total));
    });
    xhr.addEventListener("load", async () => {
      let answer = {};
      try { answer = JSON.parse(xhr.responseText); } catch { /* not JSON */ }
      if (xhr.status === 201) {
        show(100);
        result.className = "ok";
        result.textContent = `Uploaded ${answer.filename}: ${answer.num_records} records (${answer.format}), id ${answer.id}.`;
        await refreshFromPage("/ui/datasets", "#datasets tbody");
      } else {
        result.className = "error";
        const err = answer.error || {};
        result.textContent = `Upload refused: ${err.message || xhr.statusText}`;
      }
    });
    xhr.addEventListener("error", () => { result.className = "error"; result.textContent = "Upload failed: the server is unreachable."; });
    show(0);
    result.textContent = "";
    xhr.send(body);
  });
}

// -- job editor ----------------------------------------------------------------------------------

function initEditor() {
  const area = document.getElementById("spec_yaml");
  if (!area) return;
  const gutter = document.querySelector(".code-edit .gutter");
  const bad = new Map([...gutter.querySelectorAll("span.bad")].map((s) => [s.textContent, s.title]));
  const sync = () => {
    const lines = area.value.split("\n").length;
    area.rows = Math.max(lines + 1, 16);
    if (gutter.childElementCount !== lines) {
      gutter.textContent = "";
      for (let n = 1; n <= lines; n++) {
        const span = document.createElement("span");
        span.textContent = String(n);
        if (bad.has(span.textContent)) { span.className = "bad"; span.title = bad.get(span.textContent); }
        gutter.appendChild(span);
        gutter.appendChild(document.createTextNode("\n"));
      }
    }
  };
  area.addEventListener("input", sync);
  sync();
  document.querySelectorAll("a.goto").forEach((a) =>
    a.addEventListener("click", (e) => {
      e.preventDefault();
      const line = Number(a.dataset.line);
      const lines = area.value.split("\n");
      const start = lines.slice(0, line - 1).join("\n").length + (line > 1 ? 1 : 0);
      area.focus();
      area.setSelectionRange(start, start + (lines[line - 1] || "").length);
    })
  );
}

// The job and compare pages load plotly with `defer` before this script, so Plotly is defined here.
document.addEventListener("DOMContentLoaded", () => {
  initJobList();
  initCopy();
  initJobPage();
  initCompare();
  initUpload();
  initEditor();
});
