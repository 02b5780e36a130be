// busctl web's page: jobs, a job, studies, a study, services. Read-only; every string from the cluster
// (job names, events, logs: tenants wrote them) goes into the page as text (textContent), never as markup.
// The data is what `busctl ... --json` prints, from /api/ (services/web/server.py).
"use strict";

const POLL_MS = 3000;
const TERMINAL = new Set(["succeeded", "failed", "stopped"]);
const EXACT_HOW =
  "for exact scores the provider's operator sets eval_epsilon = 0, only where every asker may see the test split";

// -- elements ---------------------------------------------------------------------------------------
function el(tag, attrs, ...kids) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null) continue;
    if (k === "class") node.className = v;
    else if (k === "href") node.setAttribute("href", v);
    else node.setAttribute(k, v);
  }
  for (const kid of kids.flat(Infinity)) {
    if (kid === undefined || kid === null) continue;
    node.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return node;
}

function svg(tag, attrs, ...kids) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  for (const kid of kids.flat()) {
    if (kid === undefined || kid === null) continue;
    node.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return node;
}

function table(id, headers, rows) {
  return el(
    "table",
    { id },
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows.map((cells) => el("tr", {}, cells.map((c) => el("td", {}, c))))),
  );
}

function section(title, ...kids) {
  return el("section", {}, el("h3", {}, title), ...kids);
}

function link(href, text) {
  return el("a", { href }, text);
}

function badge(state) {
  return el("span", { class: `state state-${String(state).replace(/[^a-z_-]/gi, "")}` }, state);
}

// -- numbers ----------------------------------------------------------------------------------------
const isNum = (v) => typeof v === "number" && Number.isFinite(v);
const fmt = (v, d = 4) => (isNum(v) ? v.toFixed(d) : "-");
function ago(ts) {
  if (!ts) return "-";
  const s = Math.max(0, Date.now() / 1000 - ts);
  return s < 120 ? `${s.toFixed(0)}s ago` : s < 7200 ? `${(s / 60).toFixed(0)}m ago` : `${(s / 3600).toFixed(0)}h ago`;
}
const clock = (ts) => new Date(ts * 1000).toLocaleTimeString();
// A time as a list shows it: the clock today, the date and clock before.
function when(ts) {
  const d = new Date(ts * 1000);
  return d.toDateString() === new Date().toDateString() ? d.toLocaleTimeString() : d.toLocaleString();
}
// How long a job has taken: from submission to its last change once it ended, to now while it runs.
function took(j) {
  if (!j.created) return "-";
  const end = TERMINAL.has(j.state) ? j.updated : Date.now() / 1000;
  const s = Math.max(0, end - j.created);
  return s < 120 ? `${s.toFixed(0)}s` : s < 7200 ? `${(s / 60).toFixed(0)}m` : `${(s / 3600).toFixed(1)}h`;
}
const firstLine = (text) => String(text).split("\n")[0].slice(0, 160);

// The epoch a report is in, from 0, as busctl counts it (services/views.py epoch_index): a job that
// ended at an epoch's end shows that epoch.
function epochIndex(p, state) {
  const epoch = p.epoch, epochs = p.epochs;
  if (!Number.isInteger(epoch) || epoch < 0) return null;
  const known = Number.isInteger(epochs) && epochs > 0;
  const per = p.steps_per_epoch, step = p.step, succeeded = state === "succeeded";
  const atEnd = Number.isInteger(per) && per > 0 && Number.isInteger(step) && epoch >= 1 && step === epoch * per;
  if (TERMINAL.has(state) && epoch >= 1) {
    const reportedAll = per == null && Array.isArray(p.history) && p.history.length >= epoch;
    if (atEnd || reportedAll || (succeeded && per == null)) return known ? Math.min(epoch, epochs) - 1 : epoch - 1;
  }
  if (known) return Math.min(epoch, epochs - 1);
  return atEnd || (succeeded && per == null) ? Math.max(0, epoch - 1) : epoch;
}
function epochOf(p, state) {
  const i = epochIndex(p, state);
  const shown = i === null ? "?" : String(i + 1);
  return Number.isInteger(p.epochs) && p.epochs > 0 ? `${shown}/${p.epochs}` : shown;
}
function fraction(p) {
  const total = (p.epochs || 0) * (p.steps_per_epoch || 0);
  return total ? Math.min(1, (p.step || 0) / total) : null;
}
function bar(f) {
  return el("span", { class: "bar" }, el("span", { class: "fill", style: null, "data-f": f }));
}

// A checkpoint's place as busctl says it (libbus/order/epochs.py Cursor.shown): epochs from 1.
function cursorShown(c) {
  const epoch = Number.isInteger(c.epoch) ? c.epoch : 0;
  const position = c.cursor && Number.isInteger(c.cursor.position) ? c.cursor.position : 1;
  return position === 0 && epoch > 0 ? `after epoch ${epoch}` : `in epoch ${epoch + 1}`;
}

function runs(spec) {
  if (spec.entrypoint) return spec.entrypoint;
  if (spec.task === "evaluate") {
    const source = spec.model_from === "upload" ? "uploaded file" : spec.model_from || "?";
    return `evaluate ${source}` + (spec.evaluator ? ` (${spec.evaluator})` : "");
  }
  return spec.model || "-";
}

function score(scores, metric) {
  const s = (scores || {})[metric];
  if (!s) return null;
  if (s.margin === null) return `${fmt(s.value)} (noise not reported)`;
  return s.margin > 0 ? `${fmt(s.value)} ± ${fmt(s.margin)} at 95%` : `${fmt(s.value)} (exact)`;
}

function resultCell(r) {
  if (!r) return "-";
  const parts = [];
  if (isNum(r.val_accuracy)) parts.push(`val acc ${fmt(r.val_accuracy)}`);
  if (isNum(r.test_accuracy)) parts.push(`test acc ${fmt(r.test_accuracy)}` + (r.test_epsilon > 0 ? " (noised)" : ""));
  if (!parts.length) {
    // a function that reports its own metrics: its last epoch record's, but the train loss
    const history = Array.isArray(r.history) ? r.history : [];
    const lastRecord = history[history.length - 1] || {};
    for (const [k, v] of Object.entries(lastRecord)) {
      if (k !== "epoch" && k !== "train_loss" && isNum(v) && parts.length < 2) parts.push(`${k} ${fmt(v)}`);
    }
  }
  return parts.join(", ") || "-";
}

// -- fetching ---------------------------------------------------------------------------------------
// Thrown by api() when the page moved on while a request was out: its answer is drawn nowhere.
const STALE = new Error("stale");

async function api(path, page = true) {
  const asked = generation; // (page false: not drawn by a page, never stale)
  const reply = await fetch(`/api/${path}`, { credentials: "same-origin", cache: "no-store" });
  if (page && asked !== generation) throw STALE;
  if (reply.status === 401) {
    location.assign("/"); // the sign-in page, saying why
    throw new Error("signed out");
  }
  const body = await reply.json();
  if (page && asked !== generation) throw STALE;
  if (!reply.ok) throw new Error(body.error || `HTTP ${reply.status}`);
  return body;
}

let generation = 0; // a newer route stops the older one's polling
function poll(fn) {
  const mine = ++generation;
  const tick = async () => {
    if (mine !== generation) return;
    let again = true;
    try {
      if (!document.hidden) again = (await fn()) !== false;
      setStatus("");
    } catch (err) {
      if (err === STALE) return;
      setStatus(String(err.message || err));
    }
    if (again && mine === generation) setTimeout(tick, POLL_MS);
  };
  tick();
}

function setStatus(text) {
  document.getElementById("status").textContent = text;
}

function show(...nodes) {
  const view = document.getElementById("view");
  view.replaceChildren(...nodes);
  for (const fill of view.querySelectorAll(".fill[data-f]")) {
    fill.style.width = `${(100 * Number(fill.dataset.f)).toFixed(1)}%`; // CSSOM: allowed by the CSP
  }
}

// -- charts (SVG, no library) -----------------------------------------------------------------------
const W = 640, H = 220, PAD = { l: 52, r: 12, t: 26, b: 28 };
const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d"];

function scale(lo, hi, a, b) {
  if (!(hi > lo)) { lo -= 1; hi += 1; }
  return (v) => a + ((v - lo) / (hi - lo)) * (b - a);
}

// series: [{name, points: [[x, y], ...], dots?: bool, cls?}]
function lineChart(id, series, xLabel) {
  const all = series.flatMap((s) => s.points).filter(([x, y]) => isNum(x) && isNum(y));
  const chart = svg("svg", { id, class: "chart", viewBox: `0 0 ${W} ${H}`, role: "img", "data-points": all.length });
  if (!all.length) {
    chart.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, "no points yet"));
    return chart;
  }
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  const x = scale(Math.min(...xs), Math.max(...xs), PAD.l, W - PAD.r);
  const y = scale(Math.min(...ys), Math.max(...ys), H - PAD.b, PAD.t);
  axes(chart, Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys), xLabel);
  series.forEach((s, i) => {
    const pts = s.points.filter(([a, b]) => isNum(a) && isNum(b));
    const color = s.color || COLORS[i % COLORS.length];
    if (s.line !== false && pts.length > 1) {
      chart.append(svg("polyline", { points: pts.map(([a, b]) => `${x(a)},${y(b)}`).join(" "), stroke: color, fill: "none", class: "line" }));
    }
    for (const [a, b, title, cls] of pts) {
      chart.append(svg("circle", { cx: x(a), cy: y(b), r: s.dots === false ? 1.5 : 3, fill: color, class: `pt ${cls || ""}` },
        svg("title", {}, title || `${s.name}: ${fmt(b)} at ${a}`)));
    }
  });
  chart.append(legend_(series.map((s, i) => [s.name, s.color || COLORS[i % COLORS.length]])));
  return chart;
}

// A legend along the top: [name, color] pairs, each as wide as its name.
function legend_(items) {
  const g = svg("g", { class: "legend" });
  let x = PAD.l + 8;
  for (const [name, color] of items) {
    g.append(svg("rect", { x, y: 6, width: 10, height: 10, fill: color }));
    g.append(svg("text", { x: x + 14, y: 15 }, name));
    x += 30 + 6.2 * String(name).length;
  }
  return g;
}

function axes(chart, x0, x1, y0, y1, xLabel) {
  chart.append(svg("line", { x1: PAD.l, y1: H - PAD.b, x2: W - PAD.r, y2: H - PAD.b, class: "axis" }));
  chart.append(svg("line", { x1: PAD.l, y1: PAD.t, x2: PAD.l, y2: H - PAD.b, class: "axis" }));
  const num = (v) => (Math.abs(v) >= 1000 || Number.isInteger(v) ? String(Math.round(v)) : v.toPrecision(3));
  chart.append(svg("text", { x: PAD.l - 4, y: PAD.t + 8, "text-anchor": "end" }, num(y1)));
  chart.append(svg("text", { x: PAD.l - 4, y: H - PAD.b, "text-anchor": "end" }, num(y0)));
  chart.append(svg("text", { x: PAD.l, y: H - 8 }, num(x0)));
  chart.append(svg("text", { x: W - PAD.r, y: H - 8, "text-anchor": "end" }, num(x1)));
  chart.append(svg("text", { x: (W + PAD.l) / 2, y: H - 8, "text-anchor": "middle", class: "label" }, xLabel));
}

// The stall split over time: per progress report, the share of time waiting for data, split by cause.
function stallChart(id, reports) {
  const rows = reports.filter((p) => isNum(p.data_wait_pct) && isNum(p.step));
  const chart = svg("svg", { id, class: "chart", viewBox: `0 0 ${W} ${H}`, role: "img", "data-points": rows.length });
  if (!rows.length) {
    chart.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, "no data-wait figures yet"));
    return chart;
  }
  const causes = [...new Set(rows.flatMap((p) => Object.keys((p.data_wait_split || {}).parts || {})))].sort();
  const top = Math.max(1, ...rows.map((p) => p.data_wait_pct));
  const y = scale(0, top, H - PAD.b, PAD.t);
  const bw = Math.max(2, (W - PAD.l - PAD.r) / rows.length - 1);
  axes(chart, rows[0].step, rows[rows.length - 1].step, 0, top, "step (bars: % of time waiting for data, by cause)");
  rows.forEach((p, i) => {
    const parts = (p.data_wait_split || {}).parts || {};
    const total = Object.values(parts).filter(isNum).reduce((a, b) => a + b, 0);
    const x = PAD.l + i * (bw + 1);
    let base = 0;
    const pieces = total > 0 ? causes.map((c) => [c, (p.data_wait_pct * (parts[c] || 0)) / total]) : [["unsplit", p.data_wait_pct]];
    for (const [cause, pct] of pieces) {
      if (!(pct > 0)) continue;
      const color = cause === "unsplit" ? "#9ca3af" : COLORS[causes.indexOf(cause) % COLORS.length];
      chart.append(svg("rect", { x, y: y(base + pct), width: bw, height: y(base) - y(base + pct), fill: color, class: "stall" },
        svg("title", {}, `step ${p.step}: ${cause} ${pct.toFixed(1)}% of the time`)));
      base += pct;
    }
  });
  chart.append(legend_(causes.map((c, i) => [c, COLORS[i % COLORS.length]])));
  return chart;
}

// One small chart per metric an epoch record holds (a loss and an accuracy differ in scale).
function epochCharts(series) {
  const charts = series.map((one, i) => lineChart(`epoch-chart-${i}`, [{ ...one, color: COLORS[i % COLORS.length] }], "epoch"));
  const total = series.reduce((n, one) => n + one.points.filter(([x, y]) => isNum(x) && isNum(y)).length, 0);
  return el("div", { id: "epoch-chart", class: "charts", "data-points": total }, charts.length ? charts : el("p", {}, "no epoch records yet"));
}

// Parallel coordinates: one axis per param and the objective; one line per trial.
function parallelChart(id, trials, objective) {
  const names = [...new Set(trials.flatMap((t) => Object.keys(t.params || {})))].sort();
  const axesNames = [...names, objective];
  const chart = svg("svg", { id, class: "chart", viewBox: `0 0 ${W} ${H}`, role: "img", "data-lines": 0 });
  if (!trials.length || !names.length) {
    chart.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, "no trials yet"));
    return chart;
  }
  const valueOf = (t, name) => (name === objective && !names.includes(objective) ? trialValue(t).value : (t.params || {})[name]);
  const scales = axesNames.map((name) => {
    const vals = trials.map((t) => valueOf(t, name));
    if (vals.every((v) => v === undefined || v === null || isNum(v))) {
      const nums = vals.filter(isNum);
      return { kind: "num", lo: Math.min(...nums), hi: Math.max(...nums), f: scale(Math.min(...nums), Math.max(...nums), H - PAD.b, PAD.t + 14) };
    }
    const cats = [...new Set(vals.map(String))].sort();
    return { kind: "cat", cats, f: (v) => scale(0, Math.max(1, cats.length - 1), H - PAD.b, PAD.t + 14)(cats.indexOf(String(v))) };
  });
  const xAt = scale(0, Math.max(1, axesNames.length - 1), PAD.l, W - PAD.r - 40);
  axesNames.forEach((name, i) => {
    chart.append(svg("line", { x1: xAt(i), y1: PAD.t + 14, x2: xAt(i), y2: H - PAD.b, class: "axis" }));
    chart.append(svg("text", { x: xAt(i), y: PAD.t + 8, "text-anchor": "middle", class: "label" }, name));
    const s = scales[i];
    const lo = s.kind === "num" ? (isNum(s.lo) ? s.lo.toPrecision(3) : "") : s.cats[0];
    const hi = s.kind === "num" ? (isNum(s.hi) ? s.hi.toPrecision(3) : "") : s.cats[s.cats.length - 1];
    chart.append(svg("text", { x: xAt(i) + 3, y: H - PAD.b + 12 }, lo));
    chart.append(svg("text", { x: xAt(i) + 3, y: PAD.t + 24 }, hi));
  });
  let lines = 0;
  for (const t of trials) {
    const pts = axesNames.map((name, i) => [xAt(i), valueOf(t, name)]).map(([x, v], i) => (v === undefined || v === null ? null : [x, scales[i].f(v)]));
    const drawn = pts.filter((p) => p && isNum(p[1]));
    if (drawn.length < 2) continue;
    lines += 1;
    chart.append(svg("polyline", { points: drawn.map(([a, b]) => `${a},${b}`).join(" "), fill: "none", class: `trial trial-${String(t.state).replace(/[^a-z_-]/gi, "")}` },
      svg("title", {}, `trial ${t.number} (${t.state})`)));
  }
  chart.setAttribute("data-lines", lines);
  return chart;
}

// A trial's value: its objective's final value, else its last reported one and the epoch (as busctl's trial_value).
function trialValue(t) {
  if (isNum(t.value)) return { value: t.value, epoch: null };
  const reports = Object.entries(t.reports || {}).filter(([e, v]) => /^\d+$/.test(e) && isNum(v)).map(([e, v]) => [Number(e), v]);
  if (!reports.length) return { value: null, epoch: null };
  reports.sort((a, b) => a[0] - b[0]);
  const [epoch, value] = reports[reports.length - 1];
  return { value, epoch };
}

// -- pages ------------------------------------------------------------------------------------------
async function jobsPage() {
  const filter = el("input", { id: "filter", type: "search", placeholder: "filter: id, name, dataset, runs, trainer" });
  const state = el("select", { id: "state-filter" }, ["", "queued", "running", "paused", "succeeded", "failed", "stopped"].map((s) => el("option", { value: s }, s || "any state")));
  const params = new URLSearchParams(location.hash.split("?")[1] || "");
  filter.value = params.get("q") || "";
  state.value = params.get("state") || "";
  const holder = el("div", { id: "jobs-holder" });
  const redo = () => {
    const q = new URLSearchParams();
    if (filter.value) q.set("q", filter.value);
    if (state.value) q.set("state", state.value);
    history.replaceState(null, "", `#/jobs${q.toString() ? "?" + q : ""}`);
  };
  let last = null, limit = 200;
  const draw = () => {
    if (!last) return;
    const needle = filter.value.trim().toLowerCase();
    const rows = last.jobs.filter((j) =>
      !needle || [j.id, j.spec.name, j.spec.dataset, runs(j.spec), j.trainer].some((v) => String(v || "").toLowerCase().includes(needle)));
    const body = rows.map((j) => {
      const p = j.progress || {};
      const f = fraction(p);
      return [
        link(`#/job/${encodeURIComponent(j.id)}`, j.id),
        j.spec.name || "",
        badge(j.state),
        j.spec.dataset,
        runs(j.spec),
        j.trainer || "-",
        j.progress ? el("span", {}, `epoch ${epochOf(p, j.state)}`, f === null ? "" : bar(j.state === "succeeded" ? 1 : f)) : "-",
        fmt(p.loss),
        j.state === "failed" && j.error ? el("span", { class: "error", title: j.error }, firstLine(j.error)) : resultCell(j.result),
        j.created ? `${when(j.created)}` : "-",
        took(j),
        ago(j.updated),
      ];
    });
    const counts = {};
    for (const j of rows) counts[j.state] = (counts[j.state] || 0) + 1;
    holder.replaceChildren(
      el("p", { id: "counts" }, Object.entries(counts).map(([k, n]) => [badge(k), ` ${n}  `])),
      table("jobs", ["job", "name", "state", "dataset", "runs", "trainer", "progress", "loss", "result", "submitted", "took", "updated"], body),
      el("p", { class: "note" }, `${rows.length} of the ${last.jobs.length} newest shown` + (last.note ? `; ${last.note}` : ""),
        last.jobs.length >= limit && limit < 1000 ? el("button", { id: "more", type: "button" }, "older jobs") : ""),
    );
    for (const fill of holder.querySelectorAll(".fill[data-f]")) fill.style.width = `${(100 * Number(fill.dataset.f)).toFixed(1)}%`;
    const more = document.getElementById("more");
    if (more) more.addEventListener("click", () => { limit = Math.min(1000, limit + 200); poll(load); });
  };
  filter.addEventListener("input", () => { redo(); draw(); });
  state.addEventListener("change", () => { redo(); last = null; poll(load); });
  show(el("h2", {}, "Jobs"), el("div", { class: "controls" }, filter, state), holder);
  const load = async () => {
    last = await api(`jobs?limit=${limit}${state.value ? "&state=" + encodeURIComponent(state.value) : ""}`);
    draw();
  };
  poll(load);
}

async function jobPage(id, chosen) {
  let after = 0, attempt = Number.isInteger(chosen) ? chosen : -1, attempts = [];
  const logLines = [];
  poll(async () => {
    const [{ job, note, test_scores: scores }, metrics] = await Promise.all([api(`jobs/${encodeURIComponent(id)}`), api(`jobs/${encodeURIComponent(id)}/metrics`)]);
    const logs = await api(`jobs/${encodeURIComponent(id)}/logs?after=${after}&attempt=${attempt}`).catch((err) => { if (err === STALE) throw err; return null; });
    if (logs) {
      if (logs.attempt !== attempt && attempt !== -1) logLines.length = 0;
      attempt = logs.attempt;
      attempts = Array.isArray(logs.attempts) ? logs.attempts : [];
      after = logs.next;
      logLines.push(...logs.lines);
      logLines.splice(0, Math.max(0, logLines.length - 500));
    }
    const p = job.progress || {};
    const spec = job.spec || {};
    const f = fraction(p);
    const summary = [
      ["state", badge(job.state)],
      ["runs", runs(spec)],
      ["dataset", spec.dataset],
      ["trainer", job.trainer || "-"],
      ["attempts", String(job.attempts)],
      ["progress", job.progress ? el("span", {}, `epoch ${epochOf(p, job.state)} step ${p.step ?? "-"}`, f === null ? "" : bar(job.state === "succeeded" ? 1 : f)) : "-"],
      ["loss", fmt(p.loss)],
      ["samples/s", isNum(p.samples_per_s) ? p.samples_per_s.toFixed(0) : "-"],
      ["data wait", isNum(p.data_wait_pct) ? `${p.data_wait_pct.toFixed(1)}%` : "-"],
      ["updated", ago(job.updated)],
    ];
    const reports = metrics.reports || [];
    const lossPts = reports.filter((r) => isNum(r.loss)).map((r) => [r.step, r.loss, `step ${r.step}: loss ${fmt(r.loss)}`]);
    const history = metrics.history || [];
    const keys = [...new Set(history.flatMap((h) => Object.keys(h).filter((k) => k !== "epoch" && isNum(h[k]))))];
    const epochSeries = keys.map((k) => ({ name: k, points: history.map((h, i) => [isNum(h.epoch) ? h.epoch : i + 1, h[k], `epoch ${h.epoch}: ${k} ${fmt(h[k])}`]) }));
    const r = job.result || {};
    const resultRows = [];
    if (isNum(r.val_accuracy)) resultRows.push(["val accuracy", fmt(r.val_accuracy)]);
    if (isNum(r.val_loss)) resultRows.push(["val loss", fmt(r.val_loss)]);
    for (const metric of Object.keys(scores || {})) resultRows.push([`test ${metric}`, score(scores, metric)]);
    if (Object.keys(scores || {}).length && r.test_epsilon > 0) resultRows.push(["test noise", `released with privacy noise (eval_epsilon ${r.test_epsilon}); ${EXACT_HOW}`]);
    if (r.model) {
      resultRows.push(["model sha256", r.model.sha256]);
      if (r.model.weights_digest) resultRows.push(["weights digest", `${r.model.weights_digest} (equal for equal tensors)`]);
    }
    if (r.model_sha256) resultRows.push(["scored weights sha256", r.model_sha256]);
    const ckpts = job.checkpoints || [];
    const trial = /^(s[0-9a-f]{4,32})\/(\d+)$/.exec(spec.name || ""); // a study names its trials STUDY/N
    show(
      el("h2", {}, el("a", { href: "#/jobs" }, "Jobs"), " / ", el("span", { id: "job-id" }, job.id), spec.name ? el("span", { class: "name" }, ` ${spec.name}`) : ""),
      trial ? el("p", {}, `trial ${trial[2]} of study `, link(`#/study/${encodeURIComponent(trial[1])}`, trial[1])) : "",
      el("dl", { class: "summary" }, summary.map(([k, v]) => [el("dt", {}, k), el("dd", {}, v)])),
      job.error ? el("p", { class: "error", id: "job-error" }, job.error) : "",
      section("Loss", lineChart("loss-chart", [{ name: "train loss", points: lossPts, dots: lossPts.length < 60 }], "step")),
      section("Epochs", epochCharts(epochSeries)),
      section("Where the data wait went", stallChart("stall-chart", reports)),
      resultRows.length ? section("Result", table("result", ["", ""], resultRows)) : "",
      section(`Checkpoints (${ckpts.length})`, ckpts.length ? table("checkpoints", ["step", "where", "trainer", "path", "sha256"],
        ckpts.slice(-20).reverse().map((c) => [String(c.step), cursorShown(c), c.trainer || "-", c.path, c.sha256 || "-"])) : el("p", {}, "none yet")),
      section("Events", table("events", ["time", "state", "reason"], (job.events || []).map((e) => [clock(e.at), e.state, e.reason]))),
      section(`Log (attempt ${attempt < 0 ? "-" : attempt}, last ${logLines.length} lines)`,
        attempts.length > 1 ? el("p", { class: "attempts" }, "attempts: ", attempts.map((a) =>
          [a === attempt ? el("strong", {}, String(a)) : link(`#/job/${encodeURIComponent(id)}?attempt=${a}`, String(a)), " "])) : "",
        el("pre", { id: "logs" }, logLines.join("\n") || "(no output)")),
      el("details", {}, el("summary", {}, "spec"), el("pre", { id: "spec" }, JSON.stringify(spec, null, 2))),
      note ? el("p", { class: "note" }, note) : "",
    );
    return !TERMINAL.has(job.state) || (logs !== null && logs.lines.length > 0);
  });
}

async function studiesPage() {
  show(el("h2", {}, "Studies"), el("div", { id: "studies-holder" }));
  poll(async () => {
    const { studies } = await api("studies");
    document.getElementById("studies-holder").replaceChildren(
      table("studies", ["study", "state", "dataset", "objective", "trials", "epochs", "best"], studies.map((s) => [
        link(`#/study/${encodeURIComponent(s.id)}`, s.id),
        badge(s.state),
        s.dataset || "-",
        s.objective,
        Object.entries(s.counts || {}).map(([k, n]) => `${n} ${k}`).join(", ") || "-",
        `${s.epochs_trained}/${s.epochs_budget ?? "-"}`,
        s.best ? `${fmt(s.best.value)} (trial ${s.best.number})` : "-",
      ])),
    );
  });
}

async function studyPage(id) {
  poll(async () => {
    const { study } = await api(`studies/${encodeURIComponent(id)}`);
    const trials = study.trials || [];
    const better = study.direction === "maximize" ? Math.max : Math.min;
    let best = null;
    const valuePts = [], bestPts = [], partialPts = [];
    for (const t of trials) {
      const { value, epoch } = trialValue(t);
      if (!isNum(value)) continue;
      const title = `trial ${t.number} (${t.state}): ${study.objective} ${fmt(value)}` + (epoch === null ? "" : ` at epoch ${epoch}`);
      (epoch === null ? valuePts : partialPts).push([t.number, value, title, `trial-${t.state}`]);
      if (epoch === null) {
        best = best === null ? value : better(best, value);
        bestPts.push([t.number, best, `best so far: ${fmt(best)}`]);
      }
    }
    const rows = trials.map((t) => {
      const { value, epoch } = trialValue(t);
      return [
        String(t.number),
        t.job ? link(`#/job/${encodeURIComponent(t.job)}`, t.job) : "-",
        badge(t.state),
        isNum(value) ? (epoch === null ? fmt(value) : `${fmt(value)} (epoch ${epoch})`) : "-",
        String(t.epochs),
        Object.entries(t.params || {}).map(([k, v]) => `${k}=${typeof v === "number" ? v.toPrecision(4) : v}`).join(" "),
      ];
    });
    show(
      el("h2", {}, el("a", { href: "#/studies" }, "Studies"), " / ", el("span", { id: "study-id" }, study.id)),
      el("dl", { class: "summary" },
        [["state", badge(study.state)], ["objective", `${study.objective} (${study.direction})`],
         ["epochs", `${study.epochs_trained} of ${study.epochs_budget ?? "-"}`],
         ["best", study.best ? `trial ${study.best.number} (${study.best.job}): ${fmt(study.best.value)}` : "none complete yet"],
         ["reason", study.reason || "-"]].map(([k, v]) => [el("dt", {}, k), el("dd", {}, v)])),
      section("Optimisation history", lineChart("history-chart", [
        { name: `${study.objective} (final)`, points: valuePts, line: false },
        { name: "last reported (pruned, stopped, running)", points: partialPts, line: false, color: "#9ca3af" },
        { name: "best so far", points: bestPts, dots: false },
      ], "trial")),
      section("Parameters", parallelChart("parallel-chart", trials, study.objective)),
      section("Trials", table("trials", ["#", "job", "state", study.objective, "epochs", "params"], rows)),
    );
    return study.state === "running" || trials.some((t) => ["running", "pruning"].includes(t.state));
  });
}

async function servicesPage() {
  poll(async () => {
    const { frame, datasets } = await api("services");
    const providers = frame.providers.map((p) => [
      p.name, p.endpoint || "-", (p.datasets || []).join(", ") || "-",
      isNum(p.samples_per_s) ? p.samples_per_s.toFixed(0) : "…", String(p.samples), String(p.batches),
      `${(p.bytes / 1e6).toFixed(1)} MB`, String(p.sessions ?? "-"), `${p.evaluations_running || 0} (${p.evaluations || 0} done)`,
      Object.entries(p.refused || {}).map(([k, n]) => `${k} ${n}`).join(", ") || "0",
    ]);
    const trainers = frame.trainers.map((t) => [
      t.name, badge(t.state), t.job ? link(`#/job/${encodeURIComponent(t.job)}`, t.job) : "-",
      t.epoch === null || t.epoch === undefined ? "-" : `${t.epoch}${t.epochs ? "/" + t.epochs : ""}`,
      fmt(t.loss), isNum(t.samples_per_s) ? t.samples_per_s.toFixed(0) : "-",
      isNum(t.data_wait_pct) ? `${t.data_wait_pct.toFixed(1)}%` + (t.data_wait_slowest ? ` (${t.data_wait_slowest})` : "") : "-",
      t.transport || "-",
    ]);
    const ds = datasets.map((d) => {
      const info = d.info || {};
      const splits = Object.entries(info.splits || {}).map(([k, s]) => `${k} ${s.num_samples ?? "?"}`).join(", ");
      const caches = Object.entries(d.decode_cache || {}).map(([prov, c]) => {
        const lookups = (c.hits || 0) + (c.misses || 0);
        return `${prov}: ` + (lookups ? `hit rate ${(100 * (c.hit_rate || 0)).toFixed(1)}%` : "no reads yet");
      });
      return [d.dataset, (d.providers || []).map((p) => p.name).join(", "), info.kind || "-", splits || "-",
        Array.isArray(info.sample_shape) ? info.sample_shape.join("×") : "-", info.dtype || "-", caches.join("; ") || "-",
        isNum(d.evaluations_left_today) ? String(d.evaluations_left_today) : "unlimited"];
    });
    const counts = Object.entries(frame.job_counts || {}).map(([k, n]) => `${n} ${k}`).join(", ");
    show(
      el("h2", {}, "Services"),
      el("p", {}, `router ${frame.router.endpoint || "-"}; jobs: ${counts || "none"}`),
      section("Providers", table("providers", ["name", "endpoint", "datasets", "samples/s", "samples", "batches", "sent", "sessions", "evaluating", "refused"], providers)),
      section("Trainers", table("trainers", ["name", "state", "job", "epoch", "loss", "samples/s", "data wait", "transport"], trainers)),
      section("Datasets", table("datasets", ["dataset", "providers", "kind", "splits", "sample shape", "dtype", "decode cache", "test evaluations left today"], ds)),
    );
  });
}

// -- routing ----------------------------------------------------------------------------------------
function route() {
  const [path, query] = (location.hash || "#/jobs").slice(1).split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("here", a.id === `nav-${parts[0] === "job" ? "jobs" : parts[0] === "study" ? "studies" : parts[0]}`);
  if (parts[0] === "job" && parts[1]) {
    const chosen = new URLSearchParams(query || "").get("attempt");
    return jobPage(parts[1], chosen !== null && /^\d+$/.test(chosen) ? Number(chosen) : null);
  }
  if (parts[0] === "studies") return studiesPage();
  if (parts[0] === "study" && parts[1]) return studyPage(parts[1]);
  if (parts[0] === "services") return servicesPage();
  return jobsPage();
}

async function who() {
  try {
    const me = await api("me", false);
    const scopes = [me.datasets ? `datasets ${me.datasets.join(", ")}` : "", me.jobs ? `jobs ${me.jobs.join(", ")}` : ""].filter(Boolean).join("; ");
    document.getElementById("who").textContent = `${me.sub || "?"} (${me.role || "?"}${scopes ? "; " + scopes : ""})`;
  } catch (err) {
    setStatus(String(err.message || err));
  }
}

window.addEventListener("hashchange", route);
document.addEventListener("visibilitychange", () => { if (!document.hidden) route(); });
who();
route();
