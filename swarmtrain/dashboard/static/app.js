// The dashboard page: polls the coordinator's JSON API and renders the peers, alerts, rounds and charts.
// No network access beyond the coordinator; the only library is the vendored uPlot.
"use strict";

const STATUS_EVERY_MS = 2000;
const ROUNDS_EVERY_MS = 5000;
const TIMELINE_ROWS = 200;
const rows = new Map();  // "round/part" -> the API's row, every one fetched so far
let rounds = [];  // the rows, oldest first
let nextRound = 0;
const charts = {};

const $ = (id) => document.getElementById(id);
const text = (v) => (v === null || v === undefined ? "–" : String(v));
const short = (s, n = 10) => (s ? s.slice(0, n) : "–");
const num = (v, d = 3) => (v === null || v === undefined ? "–" : Number(v).toFixed(d));
const partName = (p) => (p === -2 ? "model" : p === -1 ? "ends" : `stage ${p}`);

function human(n) {
  if (n === null || n === undefined) return "–";
  const units = ["", "k", "M", "G", "T", "P"];
  let i = 0;
  while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  const digits = Number.isInteger(n) ? 0 : Math.abs(n) < 10 ? 2 : Math.abs(n) < 100 ? 1 : 0;
  return `${n.toFixed(digits)}${units[i]}`;
}

function cell(tr, value, cls) {
  const td = document.createElement("td");
  td.textContent = value;
  if (cls) td.className = cls;
  tr.appendChild(td);
  return td;
}

function renderStatus(s) {
  $("run").textContent = s.run_id;
  $("round").textContent = s.round;
  $("live").textContent = `${s.live_peers}${s.invalid_peers ? ` (${s.invalid_peers} invalid)` : ""}`;
  $("agreement").textContent = `${(100 * s.hash_agreement).toFixed(0)}%`;
  $("agreement").className = s.hash_agreement < 1 ? "bad" : "ok";
  $("tps").textContent = human(s.peers.filter((p) => p.state !== "invalid")
    .reduce((a, p) => a + ((p.stats && p.stats.tokens_per_s) || 0), 0));
  $("updated").textContent = new Date(s.polled_at * 1000).toLocaleTimeString();
  const alerts = $("alerts");
  alerts.replaceChildren();
  for (const a of s.alerts) {
    const div = document.createElement("div");
    div.className = "alert";
    div.dataset.kind = a.kind;
    div.textContent = a.kind === "hash_disagreement"
      ? `θ hashes disagree in ${partName(a.part)} round ${a.round}: ` +
        Object.entries(a.hashes).map(([h, ps]) => `${short(h)} (${ps.length})`).join(", ")
      : a.kind === "stuck_round" ? `no new round for ${a.since_s} s`
      : a.kind === "silent_peer" ? `peer ${short(a.peer, 16)} silent for ${a.last_seen_s} s (no departure)`
      : a.kind === "invalid_record" ? `peer ${short(a.peer, 16)} reports absurd values: ${a.problems.join("; ")}`
      : JSON.stringify(a);
    alerts.appendChild(div);
  }
  if (!s.alerts.length) {
    const div = document.createElement("div");
    div.className = "none";
    div.textContent = "none";
    alerts.appendChild(div);
  }
  const body = $("peers").tBodies[0];
  body.replaceChildren();
  for (const p of s.peers) {
    const tr = document.createElement("tr");
    tr.dataset.peer = p.peer_id;
    cell(tr, short(p.peer_id, 16)).title = p.peer_id;
    cell(tr, p.role === "stage_server" ? `server, stage ${p.stage}` : p.role);
    cell(tr, p.endpoint || "–");
    cell(tr, p.client_mode ? "yes" : "");
    cell(tr, p.round);
    const hash = cell(tr, short(p.state_hash, 12));
    hash.className = "hash " + (p.hash_agrees === true ? "agree" : p.hash_agrees === false ? "disagree" : "behind");
    hash.title = p.state_hash;
    const st = p.stats || {};
    cell(tr, num(st.loss));
    cell(tr, num(st.val_loss));
    cell(tr, st.val_loss === null || st.val_loss === undefined ? "–" : num(Math.exp(Math.min(st.val_loss, 700)), 2));
    cell(tr, num(st.val_bpb));
    cell(tr, human(st.tokens_per_s));
    cell(tr, p.bandwidth_bytes_per_s ? `${human(p.bandwidth_bytes_per_s)}B/s` : "–");
    const util = cell(tr, "");
    if (p.compute_utilization !== null) {
      const bar = document.createElement("span");
      bar.className = "bar";
      bar.style.width = `${Math.round(60 * p.compute_utilization)}px`;
      util.append(bar, ` ${(100 * p.compute_utilization).toFixed(0)}%`);
    }
    cell(tr, `${num(p.heartbeat_age_s, 1)} s ago`);
    const state = cell(tr, p.state, p.state === "ok" ? "ok" : "bad");
    if (p.problems.length) state.title = p.problems.join("; ");
    body.appendChild(tr);
  }
  markRendered("status");
  document.body.dataset.peers = String(s.peers.length);
}

function chart(id, title, series, data) {
  const el = $(id);
  const opts = {
    title, width: Math.max(420, el.clientWidth - 12), height: 220,
    scales: { x: { time: false } },
    axes: [{ values: (u, vals) => vals.map((v) => (series[0] === "round" && !Number.isInteger(v) ? "" : human(v))) },
           { size: 60, values: (u, vals) => vals.map(human) }],
    series: [{ label: series[0] }, ...series.slice(1).map((label, i) => ({
      label, stroke: ["#4a7fd1", "#d1664a", "#3aa76d"][i % 3], width: 1.5, spanGaps: true,
    }))],
  };
  if (charts[id]) charts[id].setData(data);
  else charts[id] = new uPlot(opts, data, el);
}

function renderRounds() {
  // Charts: one point per round, summed over parts; loss against cumulative tokens.
  const byRound = new Map();
  for (const r of rounds) {
    const a = byRound.get(r.round) || { round: r.round, tokens: 0, bytes: 0, loss: [], val: [], comm: [], spread: [] };
    a.tokens += r.tokens; a.bytes += r.bytes;
    if (r.loss !== null) a.loss.push(r.loss);
    if (r.val_loss !== null) a.val.push(r.val_loss);
    if (r.comm_s !== null) a.comm.push(r.comm_s);
    if (r.spread !== null && r.spread !== undefined) a.spread.push(r.spread);
    byRound.set(r.round, a);
  }
  const mean = (xs) => (xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : null);
  // A round with neither tokens nor bytes is only where peers were first seen: no point of its own.
  const xs = [...byRound.values()].filter((a) => a.tokens || a.bytes).sort((a, b) => a.round - b.round);
  let cum = 0;
  const tokens = xs.map((a) => (cum += a.tokens));
  chart("chart-loss", "loss and val loss against tokens", ["tokens", "loss", "val loss"],
    [tokens, xs.map((a) => mean(a.loss)), xs.map((a) => mean(a.val))]);
  chart("chart-bytes", "bytes per round", ["round", "bytes"], [xs.map((a) => a.round), xs.map((a) => a.bytes)]);
  chart("chart-allreduce", "all-reduce seconds per round (mean of its members)", ["round", "seconds"],
    [xs.map((a) => a.round), xs.map((a) => mean(a.comm))]);
  if (xs.some((a) => a.spread.length)) {  // gossip rounds: how far apart the replicas are
    $("chart-spread").hidden = false;
    chart("chart-spread", "gossip spread per round (‖φ_partner − φ‖ / ‖φ‖, mean of its peers)", ["round", "spread"],
      [xs.map((a) => a.round), xs.map((a) => mean(a.spread))]);
  }
  document.body.dataset.charts = String(Object.keys(charts).length);
  const body = $("rounds").tBodies[0];
  body.replaceChildren();
  for (const r of rounds.slice(-TIMELINE_ROWS).reverse()) {
    const tr = document.createElement("tr");
    cell(tr, r.round);
    cell(tr, partName(r.part));
    cell(tr, r.members);
    const h = cell(tr, r.hashes.length === 1 ? short(r.hashes[0], 12) : `${r.hashes.length} hashes`);
    h.className = "hash " + (r.hashes.length === 1 ? "agree" : "disagree");
    h.title = r.hashes.join("\n");
    cell(tr, num(r.loss));
    cell(tr, num(r.val_loss));
    cell(tr, human(r.bytes));
    cell(tr, num(r.comm_s, 2));
    cell(tr, r.aborts.length ? r.aborts.map((a) => `${short(a.peer, 8)}: ${a.reason}`).join("; ") : "",
      r.aborts.length ? "bad" : "");
    body.appendChild(tr);
  }
  document.body.dataset.rounds = String(rounds.length);
  markRendered("rounds");
}

// Milliseconds from navigation to the first render of both the status and the rounds (a benchmark reads it).
const firstRenders = new Set();
function markRendered(what) {
  firstRenders.add(what);
  if (firstRenders.size === 2 && !document.body.dataset.renderMs) {
    document.body.dataset.renderMs = String(Math.round(performance.now()));
  }
}

async function getJSON(path) {
  const resp = await fetch(path, { cache: "no-store" });
  if (!resp.ok) throw new Error(`${path}: HTTP ${resp.status}`);
  return resp.json();
}

async function pollStatus() {
  try { renderStatus(await getJSON("/api/status")); } catch (e) { console.error(e); }
  setTimeout(pollStatus, STATUS_EVERY_MS);
}

async function pollRounds() {
  try {
    for (;;) {  // pages of 10,000 rows until caught up
      const page = await getJSON(`/api/rounds?since=${nextRound}&limit=10000`);
      for (const r of page) rows.set(`${r.round}/${r.part}`, r);
      if (page.length < 10000) {
        // The newest round may still gain members: ask for it (and the one before) again next time.
        if (page.length) nextRound = Math.max(0, page[page.length - 1].round - 1);
        break;
      }
      nextRound = page[page.length - 1].round;
    }
    rounds = [...rows.values()].sort((a, b) => a.round - b.round || a.part - b.part);
    renderRounds();
  } catch (e) { console.error(e); }
  setTimeout(pollRounds, ROUNDS_EVERY_MS);
}

pollStatus();
pollRounds();
