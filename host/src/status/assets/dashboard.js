/*
 * rlhost live dashboard (served at /assets/dashboard.js).
 *
 * Plain ES2020, no modules, no framework. Depends only on uPlot (global
 * `uPlot`, loaded from /assets/uPlot.iife.min.js before this file).
 *
 * Data flow:
 *   GET /status            header (run id, phase, progress, ...), polled slowly
 *   GET /history           all StepMetrics so far; reloaded on every (re)connect
 *   GET /events  (SSE)     `step` (one StepMetrics) and `status` (phase change)
 *   GET /rollouts/latest   rollout viewer; re-fetched after each `step` event
 *
 * With `?live=0` in the page URL the event stream is not opened and the page
 * polls /history, /status and /rollouts/latest every 2 s instead.
 *
 * Steps are kept in a Map keyed by `step`, so history reloads and live events
 * can overlap freely without duplicating or losing a step.
 *
 * Server data is only ever inserted with textContent / DOM nodes, never
 * innerHTML (rollout text is raw model output).
 */
(() => {
  "use strict";

  // ---------------------------------------------------------------- helpers

  const $ = (id) => document.getElementById(id);

  // Count uncaught errors on <html data-js-errors="N"> so a headless test that
  // can only dump the DOM can still assert the page ran cleanly.
  const root = document.documentElement;
  root.dataset.jsErrors = "0";
  const countError = () => { root.dataset.jsErrors = String(Number(root.dataset.jsErrors) + 1); };
  window.addEventListener("error", countError);
  window.addEventListener("unhandledrejection", countError);

  /** Create an element with a class and optional text (textContent only). */
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }

  const isNum = (v) => typeof v === "number" && Number.isFinite(v);
  const numOrNull = (v) => (isNum(v) ? v : null);

  /** Seconds → "2m 40s" / "1h 05m" / "3d 4h". */
  function fmtDur(s) {
    if (!isNum(s) || s < 0) return "—";
    s = Math.round(s);
    if (s < 60) return `${s}s`;
    const m = Math.floor(s / 60), sec = s % 60;
    if (m < 60) return `${m}m ${String(sec).padStart(2, "0")}s`;
    const h = Math.floor(m / 60), min = m % 60;
    if (h < 24) return `${h}h ${String(min).padStart(2, "0")}m`;
    return `${Math.floor(h / 24)}d ${h % 24}h`;
  }

  /** Compact number for legends and axes. */
  function fmtNum(v) {
    if (!isNum(v)) return "—";
    const a = Math.abs(v);
    if (a === 0) return "0";
    if (a >= 1e6) return (v / 1e6).toFixed(2) + "M";
    if (a >= 1e4) return (v / 1e3).toFixed(1) + "k";
    if (a >= 100) return v.toFixed(0);
    if (a >= 1) return v.toFixed(3).replace(/\.?0+$/, "");
    if (a >= 1e-3) return v.toFixed(4).replace(/\.?0+$/, "");
    return v.toExponential(2);
  }

  const fmtInt = (v) => (isNum(v) ? Math.round(v).toLocaleString("en-US") : "—");

  async function getJSON(url) {
    const r = await fetch(url, { cache: "no-store" });
    if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
    return r.json();
  }

  const PALETTE = [
    "#2563eb", "#d97706", "#16a34a", "#dc2626", "#7c3aed",
    "#0891b2", "#db2777", "#65a30d", "#92400e", "#475569",
  ];
  const color = (i) => PALETTE[i % PALETTE.length];

  // ------------------------------------------------------------------ state

  const state = {
    steps: new Map(),      // step number → StepMetrics
    status: null,          // last /status object
    statusAt: 0,           // performance.now() when `status` was received
    rolloutN: 8,
  };

  try {
    const saved = parseInt(localStorage.getItem("rlhost.rolloutN"), 10);
    if ([4, 8, 16].includes(saved)) state.rolloutN = saved;
  } catch (_) { /* storage unavailable: ignore */ }

  /** Steps sorted by step number. */
  const sortedSteps = () =>
    Array.from(state.steps.values()).sort((a, b) => a.step - b.step);

  function addStep(m) {
    if (!m || !isNum(m.step)) return;
    state.steps.set(m.step, m);
  }

  // ----------------------------------------------------------------- header

  const TERMINAL = new Set(["done", "failed"]);
  const PHASES = new Set(["loading", "warm-start", "rollout", "update", "eval", "done", "failed"]);

  function setStatus(s) {
    if (!s || typeof s !== "object") return;
    // A different run id (server restarted on a new run): drop old steps.
    if (state.status && s.run_id && state.status.run_id && s.run_id !== state.status.run_id) {
      state.steps.clear();
      loadHistory();
    }
    const newStart = !!s.eval_start && !(state.status && state.status.eval_start);
    state.status = s;
    state.statusAt = performance.now();
    if (s.metrics) addStep(s.metrics);
    // The starting evaluation is a point of the accuracy chart before any step.
    if (newStart) scheduleRender();
    renderHeader();
    renderFaultsTable();
  }

  function renderHeader() {
    const s = state.status;
    if (!s) return;
    const steps = sortedSteps();
    const last = steps[steps.length - 1];
    $("run-id").textContent = s.run_id || "—";
    document.title = `${s.phase || "?"} · ${s.run_id || "rlhost"}`;

    const phase = PHASES.has(s.phase) ? s.phase : "unknown";
    const badge = $("phase");
    badge.className = `badge phase-${phase}`;
    badge.dataset.phase = s.phase || "";
    badge.textContent = s.phase || "unknown";

    const err = $("error");
    if (s.phase === "failed" || s.error) {
      err.hidden = false;
      err.textContent = s.error ? `error: ${s.error}` : "run failed";
    } else {
      err.hidden = true;
      err.textContent = "";
    }

    // Step counter: the newest of /status and the latest step event.
    const step = Math.max(isNum(s.step) ? s.step : 0, last ? last.step : 0);
    const total = isNum(s.total_steps) ? s.total_steps : null;
    const frac = total ? Math.min(1, step / total) : (s.phase === "done" ? 1 : 0);
    const bar = $("progress-bar");
    bar.style.width = `${(frac * 100).toFixed(1)}%`;
    bar.classList.toggle("done", s.phase === "done");
    bar.classList.toggle("failed", s.phase === "failed");
    $("progress-text").textContent =
      `step ${step} / ${total ?? "—"}` + (total ? `  (${Math.round(frac * 100)}%)` : "");

    const newer = last && last.step > (s.step || 0) ? last : null;
    $("epoch").textContent = String(newer ? newer.epoch : (s.epoch ?? "—"));
    $("adapter").textContent = String(newer ? newer.adapter_version : (s.adapter_version ?? "—"));
    $("tps").textContent = isNum(s.tokens_per_s) ? fmtInt(s.tokens_per_s) : "—";
    $("tool-wait").textContent = toolWait(steps);
    $("checkpoint").textContent = s.last_checkpoint || "—";
    $("model").textContent = s.model || "—";
    $("config").textContent = s.config || "—";
    renderClock();
  }

  /** The tools' share of sampling time (`tool_wait_share`) over `steps` (in step order):
   * the latest step's, and the mean, e.g. "1.2% (mean 1.3%)". */
  function toolWait(steps) {
    const shares = steps.map((m) => m.tool_wait_share).filter(isNum);
    if (shares.length === 0) return "—";
    const pct = (v) => `${(100 * v).toFixed(1)}%`;
    const mean = shares.reduce((a, b) => a + b, 0) / shares.length;
    return `${pct(shares[shares.length - 1])} (mean ${pct(mean)})`;
  }

  /** Elapsed / ETA tick locally between /status updates. */
  function renderClock() {
    const s = state.status;
    if (!s) return;
    const running = !TERMINAL.has(s.phase);
    const dt = running ? (performance.now() - state.statusAt) / 1000 : 0;
    $("elapsed").textContent = isNum(s.elapsed_s) ? fmtDur(s.elapsed_s + dt) : "—";
    $("eta").textContent = !running ? (s.phase === "done" ? "done" : "—")
      : isNum(s.eta_s) ? fmtDur(Math.max(0, s.eta_s - dt)) : "—";
  }

  function renderFaultsTable() {
    const tbody = $("faults").tBodies[0];
    const totals = (state.status && state.status.faults_total) || {};
    const rows = Object.entries(totals)
      .filter(([, n]) => isNum(n) && n > 0)
      .sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]));
    tbody.replaceChildren();
    if (rows.length === 0) {
      const tr = el("tr", "empty");
      const td = el("td", null, "no plugin faults");
      td.colSpan = 3;
      tr.append(td);
      tbody.append(tr);
      return;
    }
    for (const [key, n] of rows) {
      const cut = key.indexOf("/");
      const plugin = cut >= 0 ? key.slice(0, cut) : key;
      const kind = cut >= 0 ? key.slice(cut + 1) : "";
      const tr = el("tr");
      tr.dataset.key = key;
      tr.append(el("td", null, plugin), el("td", null, kind), el("td", "num", fmtInt(n)));
      tbody.append(tr);
    }
  }

  // ----------------------------------------------------------------- charts

  /*
   * Each chart definition returns its series for the current step list:
   *   { label, get: (m) => number|null, color?, width?, dash?, points? }
   * and optionally `bands` (uPlot band specs, indices into the series list
   * counting the x series as 0). Dynamic series (reward components, fault
   * kinds) appear as soon as they show up in the data; when the series set
   * changes the uPlot instance is rebuilt, otherwise only setData() runs.
   */

  /** Keys of an object-valued field, in order of first appearance. */
  function dynamicKeys(steps, field) {
    const keys = [];
    const seen = new Set();
    for (const m of steps) {
      const o = m[field];
      if (!o || typeof o !== "object") continue;
      for (const k of Object.keys(o)) if (!seen.has(k)) { seen.add(k); keys.push(k); }
    }
    return keys;
  }

  const field = (name) => (m) => numOrNull(m[name]);

  const CHART_DEFS = {
    reward: {
      series(steps) {
        const base = [
          { label: "reward_mean", get: field("reward_mean"), color: "#111827", width: 2 },
          { label: "+std", get: (m) => (isNum(m.reward_mean) && isNum(m.reward_std) ? m.reward_mean + m.reward_std : null),
            color: "rgba(17,24,39,0.35)", width: 1, dash: [4, 3] },
          { label: "−std", get: (m) => (isNum(m.reward_mean) && isNum(m.reward_std) ? m.reward_mean - m.reward_std : null),
            color: "rgba(17,24,39,0.35)", width: 1, dash: [4, 3] },
        ];
        const comps = dynamicKeys(steps, "rewards").map((k, i) => ({
          label: k, get: (m) => numOrNull(m.rewards && m.rewards[k]), color: color(i),
        }));
        return base.concat(comps);
      },
      bands: [{ series: [2, 3], fill: "rgba(17,24,39,0.07)" }],
    },
    accuracy: {
      // Training-batch accuracy every step; held-out greedy accuracy every
      // train.eval_every steps (joined across the steps in between), starting at step 0
      // with the evaluation of the model before the first update.
      rows(steps) {
        const start = state.status && state.status.eval_start;
        if (!start || !isNum(start.accuracy) || steps.some((m) => m.step === 0)) return steps;
        return [{ step: 0, eval_accuracy: start.accuracy }, ...steps];
      },
      series: () => [
        { label: "accuracy", get: field("accuracy"), color: color(2), points: true },
        { label: "eval_accuracy", get: field("eval_accuracy"), color: color(5), points: true, width: 2, spanGaps: true },
      ],
    },
    kl: {
      // rollout_kl: the sampler's log-probs against the trainer's (vLLM or another kernel).
      series: () => [
        { label: "kl", get: field("kl"), color: color(4) },
        { label: "rollout_kl", get: field("rollout_kl"), color: color(1), spanGaps: true },
      ],
    },
    response_length: {
      series: () => [{ label: "response_tokens", get: field("response_tokens"), color: color(0) }],
    },
    tool_calls: {
      series: () => [
        { label: "tool_calls", get: field("tool_calls"), color: color(1) },
        { label: "turns", get: field("turns"), color: color(5) },
        // Native function calling: the share of calls the model wrote malformed.
        { label: "malformed_call_rate", get: field("malformed_call_rate"), color: color(3), spanGaps: true },
        // Plugins' model.generate calls (a judge, a simulated user) the batch answered.
        { label: "model_calls", get: field("generate_answered"), color: color(6) },
      ],
    },
    throughput: {
      series: () => [{ label: "sampled_tokens_per_s", get: field("sampled_tokens_per_s"), color: color(2) }],
    },
    loss: {
      series: () => [
        { label: "loss", get: field("loss"), color: color(3) },
        { label: "policy_loss", get: field("policy_loss"), color: color(0) },
      ],
    },
    step_time: {
      series: () => [
        { label: "rollout_s", get: field("rollout_s"), color: color(0) },
        { label: "update_s", get: field("update_s"), color: color(1) },
        { label: "tool_wait_s", get: field("tool_wait_s"), color: color(4) },
        { label: "generate_s", get: field("generate_s"), color: color(6) },
        { label: "step_s", get: field("step_s"), color: "#111827" },
      ],
    },
    tree: {
      // Tree rollouts ([rollout.tree]): leaves a prompt, branch points on a path, the
      // sessions forked for branches and the seconds the forks took, and the deferred
      // forks replayed at a branch's first call and their seconds; empty otherwise.
      series: () => {
        const inTree = (name) => (m) => numOrNull(m.tree ? m.tree[name] : null);
        return [
          { label: "leaves", get: inTree("leaves"), color: color(0), spanGaps: true },
          { label: "depth", get: inTree("depth"), color: color(5), spanGaps: true },
          { label: "forks", get: inTree("forks"), color: color(2), spanGaps: true },
          { label: "fork_s", get: inTree("fork_s"), color: color(4), spanGaps: true },
          { label: "replays", get: inTree("replays"), color: color(1), spanGaps: true },
          { label: "replay_s", get: inTree("replay_s"), color: color(3), spanGaps: true },
        ];
      },
    },
    faults: {
      // Cumulative count per "plugin/kind"; one series per key as it appears.
      series(steps) {
        return dynamicKeys(steps, "faults").map((k, i) => ({
          label: k, color: color(i + 3), cumulative: true,
          get: (m) => (m.faults && isNum(m.faults[k]) ? m.faults[k] : 0),
        }));
      },
    },
  };

  const CHART_HEIGHT = 200;
  const charts = new Map(); // name → { div, def, plot, sig }

  /** Build uPlot options for a chart's series list. */
  function plotOptions(div, def, series) {
    return {
      width: Math.max(200, div.clientWidth),
      height: CHART_HEIGHT,
      scales: {
        x: { time: false },
        // uPlot's default range for a flat series at 0 is 0..100, which reads as
        // "something happened"; pad flat series by ±1 (or ±10%) around the value.
        y: {
          range: (u, min, max) => {
            if (min == null || max == null) return [0, 1];
            if (min === max) {
              const pad = min === 0 ? 1 : Math.abs(min) * 0.1;
              return [min - pad, max + pad];
            }
            return uPlot.rangeNum(min, max, 0.1, true);
          },
        },
      },
      legend: { live: true },
      cursor: { drag: { x: false, y: false } },
      series: [
        { label: "step", value: (u, v) => (v == null ? "—" : String(v)) },
        ...series.map((s) => ({
          label: s.label,
          stroke: s.color,
          width: s.width ?? 1.5,
          dash: s.dash,
          spanGaps: !!s.spanGaps,
          points: s.points ? { show: true, size: 5 } : undefined,
          value: (u, v) => fmtNum(v),
        })),
      ],
      bands: def.bands && series.length >= 3 ? def.bands : undefined,
      axes: [
        {
          space: 50,
          incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000],
          values: (u, vals) => vals.map((v) => String(v)),
          grid: { stroke: "#eef0f3" },
          ticks: { stroke: "#dde1e6" },
        },
        {
          size: 56,
          values: (u, vals) => vals.map(fmtNum),
          grid: { stroke: "#eef0f3" },
          ticks: { stroke: "#dde1e6" },
        },
      ],
    };
  }

  /** Column-major data for uPlot: [xs, ys1, ys2, ...]. */
  function plotData(steps, series) {
    const xs = steps.map((m) => m.step);
    const cols = series.map((s) => {
      let acc = 0;
      return steps.map((m) => {
        const v = s.get(m);
        if (s.cumulative) { acc += isNum(v) ? v : 0; return acc; }
        return v;
      });
    });
    return [xs, ...cols];
  }

  /** Create or update every chart from the current step map. */
  function renderCharts() {
    const steps = sortedSteps();
    for (const div of document.querySelectorAll(".chart[data-chart]")) {
      const name = div.dataset.chart;
      const def = CHART_DEFS[name];
      if (!def) continue;
      let c = charts.get(name);
      if (!c) { c = { div, def, plot: null, sig: null }; charts.set(name, c); }

      const rows = def.rows ? def.rows(steps) : steps;
      const series = def.series(rows);
      const data = plotData(rows, series);
      const sig = series.map((s) => s.label).join("\u0000");
      if (!c.plot || c.sig !== sig) {
        if (c.plot) c.plot.destroy();
        c.plot = new uPlot(plotOptions(div, def, series), data, div);
        c.sig = sig;
      } else {
        c.plot.setData(data);
      }
      // Show the newest values in the legend unless the user is hovering.
      const n = rows.length;
      if (n > 0 && !(c.plot.cursor.left >= 0)) c.plot.setLegend({ idx: n - 1 });
      // Steps plotted, and points in all (a chart may start with a step-0 point).
      div.dataset.points = String(steps.length);
      div.dataset.rows = String(n);
      // Placeholder text (drawn by CSS) while there is nothing to plot.
      const empty = n === 0 ? "waiting for the first step…"
        : series.length === 0 ? (name === "faults" ? "no plugin faults" : "no data") : "";
      if (empty) div.dataset.empty = empty; else delete div.dataset.empty;
    }
  }

  // Resize charts with their containers (only width is driven by layout).
  const resizeObs = new ResizeObserver((entries) => {
    for (const entry of entries) {
      const c = charts.get(entry.target.dataset.chart);
      if (!c || !c.plot) continue;
      const w = Math.max(200, Math.floor(entry.contentRect.width));
      if (Math.abs(w - c.plot.width) >= 1) c.plot.setSize({ width: w, height: CHART_HEIGHT });
    }
  });

  // Coalesce bursts of updates (e.g. a history reload) into one render.
  let renderTimer = null;
  function scheduleRender() {
    if (renderTimer !== null) return;
    renderTimer = setTimeout(() => {
      renderTimer = null;
      try {
        renderCharts();
        renderHeader();
      } catch (e) {
        console.error("dashboard render failed:", e);
        countError();
      }
    }, 30);
  }

  // --------------------------------------------------------------- rollouts

  let rolloutBusy = false, rolloutAgain = false;

  /** Fetch /rollouts/latest; at most one request in flight, one queued. */
  async function loadRollouts() {
    if (rolloutBusy) { rolloutAgain = true; return; }
    rolloutBusy = true;
    try {
      const r = await getJSON(`/rollouts/latest?n=${state.rolloutN}`);
      renderRollouts(r);
    } catch (e) {
      console.warn("rollouts:", e.message || e);
    } finally {
      rolloutBusy = false;
      if (rolloutAgain) { rolloutAgain = false; loadRollouts(); }
    }
  }

  function renderRollouts(r) {
    const box = $("rollouts");
    const trajs = (r && Array.isArray(r.trajectories)) ? r.trajectories : [];
    $("rollouts-step").textContent = r && isNum(r.step) ? `(step ${r.step})` : "";
    box.replaceChildren();
    box.dataset.count = String(trajs.length);
    if (trajs.length === 0) {
      box.append(el("p", "muted", "no rollouts yet"));
      return;
    }
    for (const t of trajs) box.append(rolloutCard(t));
  }

  function rolloutCard(t) {
    const faults = Array.isArray(t.faults) ? t.faults : [];
    const card = el("article", "card" + (faults.length ? " has-faults" : ""));
    if (t.sample_id != null) card.dataset.sampleId = String(t.sample_id);

    // Head: reward, stop reason, turns, tool calls, ids.
    const head = el("div", "card-head");
    const reward = el("span", "reward", isNum(t.reward) ? t.reward.toFixed(3) : "—");
    if (isNum(t.reward)) reward.classList.add(t.reward > 0 ? "pos" : t.reward < 0 ? "neg" : "zero");
    reward.title = "reward";
    head.append(
      reward,
      el("span", "tag", `stop: ${t.stop ?? "?"}`),
    );
    if (t.truncated) head.append(el("span", "tag warn", "truncated"));
    head.append(
      el("span", null, `turns ${t.turns ?? "—"}`),
      el("span", null, `tool calls ${t.tool_calls ?? "—"}`),
    );
    // Function calls the function did not answer: malformed, refused, faulted.
    for (const [kind, n] of Object.entries(t.call_kinds || {})) {
      if (kind !== "ok") head.append(el("span", "tag warn", `${kind} ${n}`));
    }
    head.append(
      el("span", null, `sample ${t.sample_id ?? "?"}#${t.index ?? "?"} · step ${t.step ?? "?"} · v${t.version ?? "?"}`),
    );
    card.append(head);

    // Reward components.
    const comps = t.rewards && typeof t.rewards === "object" ? Object.entries(t.rewards) : [];
    if (comps.length) {
      const row = el("div", "components");
      for (const [k, v] of comps) row.append(el("span", "component", `${k} ${fmtNum(v)}`));
      card.append(row);
    }

    // Prompt (muted) then the transcript spans in order.
    if (t.prompt) card.append(el("div", "prompt", t.prompt));
    const tr = el("div", "transcript");
    for (const sp of Array.isArray(t.spans) ? t.spans : []) {
      const kind = ["model", "tool", "env"].includes(sp.kind) ? sp.kind : "env";
      const s = el("span", `span span-${kind}`, sp.text ?? "");
      s.title = kind;
      tr.append(s);
    }
    card.append(tr);

    // Faults in red.
    if (faults.length) {
      const ul = el("ul", "card-faults");
      for (const f of faults) {
        const where = [f.plugin, f.call].filter(Boolean).join(".");
        ul.append(el("li", null, `${where}: ${f.kind ?? "fault"}${f.message ? " — " + f.message : ""}`));
      }
      card.append(ul);
    }
    // What the rewards said about their scores, e.g. the first failed test.
    const notes = t.notes && typeof t.notes === "object" ? Object.entries(t.notes) : [];
    if (notes.length) {
      const ul = el("ul", "card-notes");
      for (const [plugin, note] of notes) ul.append(el("li", null, `${plugin}: ${note}`));
      card.append(ul);
    }
    return card;
  }

  // ------------------------------------------------------------ live stream

  async function loadStatus() {
    try { setStatus(await getJSON("/status")); }
    catch (e) { console.warn("status:", e.message || e); }
  }

  /**
   * Reload /history and merge: the server's list is authoritative, plus any
   * live steps newer than it (events that raced the request).
   */
  async function loadHistory() {
    try {
      const h = await getJSON("/history");
      const fresh = new Map();
      let maxStep = 0;
      for (const m of (h && Array.isArray(h.steps)) ? h.steps : []) {
        if (m && isNum(m.step)) { fresh.set(m.step, m); maxStep = Math.max(maxStep, m.step); }
      }
      for (const [k, m] of state.steps) if (k > maxStep) fresh.set(k, m);
      state.steps = fresh;
      scheduleRender();
    } catch (e) {
      console.warn("history:", e.message || e);
    }
  }

  function setConn(s) {
    const c = $("conn");
    c.className = `conn conn-${s}`;
    c.dataset.state = s;
    c.textContent = s;
  }

  let es = null;
  let retryTimer = null;

  function connect() {
    if (retryTimer) { clearTimeout(retryTimer); retryTimer = null; }
    if (es) es.close();
    setConn(state.steps.size || state.status ? "reconnecting" : "connecting");
    es = new EventSource("/events");

    // Every open (first or after a drop) reloads history/status/rollouts, so
    // nothing that happened while disconnected is missed.
    es.addEventListener("open", () => {
      setConn("live");
      loadHistory();
      loadStatus();
      loadRollouts();
    });

    es.addEventListener("error", () => {
      if (es.readyState === EventSource.CLOSED) {
        // The browser gave up (e.g. non-SSE response); retry ourselves.
        setConn("reconnecting");
        retryTimer = setTimeout(connect, 3000);
      } else {
        setConn("reconnecting"); // EventSource retries on its own
      }
    });

    es.addEventListener("step", (ev) => {
      let m;
      try { m = JSON.parse(ev.data); } catch (_) { return; }
      // Steps that reached this page over the stream (not from /history): what a
      // test reads to know the charts grew live.
      root.dataset.liveSteps = String(Number(root.dataset.liveSteps || 0) + 1);
      addStep(m);
      scheduleRender();
      loadRollouts();
    });

    // The server dropped events this page read too slowly: re-read what was missed.
    es.addEventListener("resync", () => {
      loadHistory();
      loadStatus();
      loadRollouts();
    });

    es.addEventListener("status", (ev) => {
      let s;
      try { s = JSON.parse(ev.data); } catch (_) { return; }
      setStatus(s);
      scheduleRender();
    });
  }

  // ------------------------------------------------------------------- init

  function init() {
    if (typeof uPlot === "undefined") {
      console.error("uPlot failed to load (/assets/uPlot.iife.min.js)");
      countError();
      return;
    }
    // Empty charts right away so every container has its canvas.
    renderCharts();
    for (const div of document.querySelectorAll(".chart[data-chart]")) resizeObs.observe(div);

    const sel = $("rollout-n");
    sel.value = String(state.rolloutN);
    sel.addEventListener("change", () => {
      state.rolloutN = parseInt(sel.value, 10) || 8;
      try { localStorage.setItem("rlhost.rolloutN", String(state.rolloutN)); } catch (_) { /* ignore */ }
      loadRollouts();
    });

    // Initial snapshot, independent of the event stream.
    loadStatus();
    loadHistory();
    loadRollouts();

    // `?live=0`: no EventSource, poll instead. For proxies that buffer SSE and
    // for headless snapshots (an open stream keeps Chromium's
    // --virtual-time-budget from ever finishing).
    const live = new URLSearchParams(location.search).get("live");
    if (live === "0" || live === "false") {
      setConn("polling");
      setInterval(() => { loadHistory(); loadStatus(); loadRollouts(); }, 2000);
    } else {
      connect();
    }

    setInterval(renderClock, 1000);        // local elapsed/ETA tick
    setInterval(() => {                    // refresh tokens/s, faults, ETA
      if (!state.status || !TERMINAL.has(state.status.phase)) loadStatus();
    }, 5000);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
