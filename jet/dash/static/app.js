// The Jet dashboard's pages: Swarm, Training, Episodes (and one episode), Studies.
// Each page polls the JSON API under api/ while it is shown; nothing reloads, nothing comes from outside.
"use strict";

const $main = document.getElementById("main");
const $status = document.getElementById("status");
const $run = document.getElementById("run");
const POLL_MS = {swarm: 2000, training: 2000, episodes: 3000, episode: 0, studies: 5000, study: 5000};
const state = {run: null, page: null, timer: null, gen: 0, selected: new Set(), open: new Set(), curves: {},
               trainingModel: null, episodeFilters: {}, lpMode: false, older: null};

// -- helpers ------------------------------------------------------------------------------

function h(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(e.dataset, v);
    else e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    e.appendChild(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

async function api(path, options) {
  const sep = path.includes("?") ? "&" : "?";
  const url = state.run && !path.includes("run=") ? `${path}${sep}run=${encodeURIComponent(state.run)}` : path;
  const res = await fetch(url, options);
  const body = await res.json();
  if (!res.ok) throw new Error(body.error || res.statusText);
  return body;
}

function status(text, error) {
  $status.textContent = text;
  $status.className = "status" + (error ? " err" : "");
}

const fmt = v => (v === null || v === undefined) ? "–" : (typeof v === "number" ? JetChart.fmt(v) : String(v));
const ago = s => s < 60 ? `${s.toFixed(1)}s` : s < 3600 ? `${(s / 60).toFixed(1)}m` : `${(s / 3600).toFixed(1)}h`;
const when = t => new Date(t * 1000).toLocaleTimeString();
const table = (heads, rows) => h("table", {}, h("tr", {}, heads.map(x => h("th", {}, x))), rows);
const card = (k, v, bad) => h("div", {class: "card" + (bad ? " bad" : "")}, h("div", {class: "v"}, fmt(v)),
                              h("div", {class: "k"}, k));

// -- router and polling ---------------------------------------------------------------------

function route() {
  const [path, query] = location.hash.replace(/^#\/?/, "").split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  const params = new URLSearchParams(query || "");
  return {page: parts[0] || "swarm", parts, params};
}

async function show() {
  clearTimeout(state.timer);
  const r = route();
  const gen = ++state.gen;
  let page = r.page, render = PAGES[page];
  if (page === "episode") render = renderEpisode;
  if (page === "studies" && r.parts[1]) { page = "study"; render = renderStudy; }
  if (!render) { page = "swarm"; render = PAGES.swarm; }
  for (const a of document.querySelectorAll("nav a"))
    a.classList.toggle("active", a.dataset.page === (page === "episode" ? "episodes" : page === "study" ? "studies" : page));
  if (state.page !== page) { $main.replaceChildren(h("p", {class: "muted"}, "loading…")); state.page = page; }
  const tick = async () => {
    if (gen !== state.gen) return;
    try {
      await render(r, gen);
      if (gen === state.gen) status(`updated ${new Date().toLocaleTimeString()}`);
    } catch (e) {
      if (gen === state.gen) status(e.message, true);
    }
    if (gen === state.gen && POLL_MS[page]) state.timer = setTimeout(tick, POLL_MS[page]);
  };
  await tick();
}

function put(gen, ...nodes) {  // replace the page's content unless the user moved on meanwhile
  if (gen === state.gen) $main.replaceChildren(...nodes.flat().filter(n => n !== null && n !== undefined && n !== false));
}

async function loadRuns() {
  const data = await api("api/runs");
  const wanted = new URLSearchParams(location.search).get("run");
  state.run = state.run || wanted || data.default || data.runs[0] || null;
  $run.replaceChildren(...data.runs.map(r => h("option", {value: r, selected: r === state.run}, r)));
}

$run.addEventListener("change", () => { state.run = $run.value; state.curves = {}; state.selected.clear(); show(); });
window.addEventListener("hashchange", show);

// -- swarm --------------------------------------------------------------------------------

async function renderSwarm(r, gen) {
  const s = await api("api/swarm");
  const alive = s.workers.filter(w => w.alive).length;
  const noCalls = (s.stats.no_llm_calls || 0) + 0;
  const cards = h("div", {class: "cards"}, card("workers alive", `${alive} / ${s.workers.length}`),
    card("dead letters", s.dead, s.dead > 0), card("lost (reclaimed as deleted)", s.stats.lost || 0, s.stats.lost > 0),
    card("duplicates skipped", s.stats.duplicates || 0), card("no-LLM-call episodes", noCalls, noCalls > 0),
    ...Object.entries(s.weights).map(([m, w]) => card(`weights:${m} version`, w.version)));
  const banner = (noCalls || s.recent.no_llm_calls) ? h("div", {class: "banner", id: "no-llm-banner"},
    h("b", {}, "Episodes with no LLM call: "),
    `${noCalls} counted by the env workers, ${s.recent.no_llm_calls} of the latest ${s.recent.looked} trajectories. ` +
    "They train nothing. Likely cause: the workflow talks to another endpoint (an OpenAI client not built from the " +
    "episode's session: use llm.openai_client() or llm.openai_credentials()), or returns before calling the model.")
    : null;
  const streams = [];
  for (const st of s.streams) {
    const groups = st.groups.length ? st.groups : [null];
    groups.forEach((g, i) => streams.push(h("tr", {},
      h("td", {}, i ? "" : st.name), h("td", {class: "num"}, i ? "" : st.length), h("td", {}, g ? g.name : "–"),
      h("td", {class: "num"}, g ? g.pending : "–"), h("td", {class: "num"}, g ? fmt(g.lag) : "–"),
      h("td", {}, g ? g.consumers.map(c => h("div", {}, `${c.name} `,
        h("span", {class: "muted"}, `pending ${c.pending}, idle ${ago(c.idle_ms / 1000)}`))) : "–"))));
  }
  const workers = s.workers.map(w => h("tr", {},
    h("td", {}, w.name), h("td", {}, w.role || "–"), h("td", {}, w.host || "–"),
    h("td", {}, h("span", {class: "pill " + (w.alive ? "ok" : "bad")}, w.alive ? "alive" : "gone")),
    h("td", {class: "num"}, ago(w.idle_s || 0)), h("td", {}, w.code_version || "–"), h("td", {}, w.model || "–"),
    h("td", {}, w.weight_version === undefined ? "–" : `v${w.weight_version}`,
      w.weight_source ? h("span", {class: "muted"}, ` (${w.weight_source})`) : null),
    h("td", {class: "num"}, w.pending || 0), h("td", {class: "muted"}, w.source)));
  const notice = state.notice ? h("div", {class: "banner", id: "notice"}, state.notice) : null;
  put(gen, cards, banner, h("h2", {}, "Streams"),
      table(["stream", "length", "group", "pending", "lag", "consumers"], streams),
      h("h2", {}, "Workers"),
      table(["name", "role", "host", "state", "idle", "code version", "model", "weight version", "pending", "from"],
            workers),
      h("h2", {}, `Dead letters (${s.dead})`), notice, deadLetters(s));
}

function deadLetters(s) {
  if (!s.dead_letters.length) return h("p", {class: "muted"}, "none");
  const act = async (op, ids) => {
    if (!ids.length) return;
    const res = await api("api/dlq", {method: "POST", headers: {"Content-Type": "application/json"},
                                      body: JSON.stringify({op, ids, run: state.run})});
    ids.forEach(i => state.selected.delete(i));
    state.notice = `${op === "requeue" ? "requeued" : "dropped"} ${res.changed} dead letter(s) at ${new Date().toLocaleTimeString()}`;
    show();
  };
  const rows = s.dead_letters.map(d => h("tr", {"data-id": d.id},
    h("td", {}, h("input", {type: "checkbox", checked: state.selected.has(d.id),
      onchange: e => e.target.checked ? state.selected.add(d.id) : state.selected.delete(d.id)})),
    h("td", {}, d.id), h("td", {}, d.stream), h("td", {}, d.kind || "–"), h("td", {class: "num"}, fmt(d.deliveries)),
    h("td", {}, d.time ? when(d.time) : "–"),
    h("td", {}, h("div", {class: "reason"}, d.reason || ""), d.last_error ? h("details",
      {open: state.open.has(d.id), ontoggle: e => e.target.open ? state.open.add(d.id) : state.open.delete(d.id)},
      h("summary", {}, "last error"), h("pre", {}, d.last_error)) : null),
    h("td", {}, h("button", {class: "requeue", onclick: () => act("requeue", [d.id])}, "requeue"), " ",
      h("button", {class: "drop danger", onclick: () => act("drop", [d.id])}, "drop"))));
  const bulk = h("div", {class: "filters"},
    h("button", {onclick: () => act("requeue", [...state.selected])}, "requeue selected"),
    h("button", {class: "danger", onclick: () => act("drop", [...state.selected])}, "drop selected"));
  return h("div", {}, bulk,
    table(["", "id", "from stream", "kind", "deliveries", "time", "reason", ""], rows));
}

// -- training -----------------------------------------------------------------------------

const CHARTS = [
  ["Reward", n => n === "rollout/reward_mean" || /^rollout\/.+\/reward_mean$/.test(n)],
  ["Held-out evaluation (per evaluated version)", n => /^eval\/.+\/reward_mean$/.test(n)],
  ["Loss", n => n === "train/loss" || n === "train/pg_loss"],
  ["KL", n => n === "train/kl"],
  ["Clip fraction", n => n === "train/clip_frac"],
  ["Entropy (sampled estimate, nats/token)", n => n === "train/entropy"],
  ["Staleness (versions)", n => n === "policy/staleness" || n === "policy/staleness_max"],
  ["Trajectories: trained / stale / dropped (total)",
   n => ["counts/trained", "counts/stale", "counts/small_group", "counts/failed", "counts/poison"].includes(n)],
  ["Throughput: tokens/s", n => n === "perf/tokens_per_s"],
  ["Throughput: steps/min", n => n === "perf/steps_per_min"],
  ["Groups trained per task", n => /^train\/.+\/groups$/.test(n)],
  ["Queue lag (trajectories)", n => n === "queue/lag" || n === "queue/held"],
];

async function renderTraining(r, gen) {
  const index = await api("api/training");
  if (!index.models.length) {
    put(gen, h("p", {class: "muted"}, `no trainer metrics yet under runs/${state.run}/trainer/`));
    return;
  }
  const model = index.models.includes(state.trainingModel) ? state.trainingModel : index.models[0];
  state.trainingModel = model;
  const key = `${state.run}/${model}`;
  const c = state.curves[key] || (state.curves[key] = {epoch: 0, lines: 0, series: {}});
  const data = await api(`api/training?model=${encodeURIComponent(model)}&epoch=${c.epoch}&lines=${c.lines}`);
  if (data.reset) c.series = {};
  for (const [name, pts] of Object.entries(data.series)) (c.series[name] = c.series[name] || []).push(...pts);
  c.epoch = data.epoch;
  c.lines = data.lines;
  const last = index.latest[model] || {};
  const tabs = h("div", {class: "filters"}, index.models.map(m => h("button", {
    class: m === model ? "active" : null, onclick: () => { state.trainingModel = m; show(); }}, m)),
    h("span", {class: "muted"}, `step ${fmt(last.step)} · reward ${fmt(last["rollout/reward_mean"])} · ` +
      `version ${fmt(last["policy/version"])} · ${fmt(last["perf/steps_per_min"])} steps/min`));
  const charts = CHARTS.map(([title, match]) => JetChart.line({title,
    series: Object.keys(c.series).filter(match).sort().map(n => ({name: n, points: c.series[n]}))}));
  put(gen, tabs, h("div", {class: "grid", id: "charts"}, charts));
}

// -- episodes -----------------------------------------------------------------------------

function episodeQuery() {
  const f = state.episodeFilters, q = new URLSearchParams();
  for (const k of ["model", "task", "min_reward", "max_reward", "failed", "stream"]) if (f[k]) q.set(k, f[k]);
  if (f.no_llm_calls) q.set("no_llm_calls", "1");
  if (state.older) q.set("before", state.older);
  return q.toString();
}

function filterBar(models) {
  const f = state.episodeFilters;
  const input = (k, attrs) => h("input", {...attrs, value: f[k] || "", onchange: e => { f[k] = e.target.value; state.older = null; show(); }});
  const select = (k, options) => h("select", {onchange: e => { f[k] = e.target.value; state.older = null; show(); }},
    options.map(([v, label]) => h("option", {value: v, selected: (f[k] || "") === v}, label)));
  return h("div", {class: "filters", id: "episode-filters"},
    h("label", {}, "model ", select("model", models.map(m => [m, m]))),
    h("label", {}, "stream ", select("stream", [["", "traj"], ["shadow", "shadow"]])),
    h("label", {}, "task ", input("task", {type: "text", placeholder: "any", name: "task", size: 10})),
    h("label", {}, "reward ≥ ", input("min_reward", {type: "number", step: "any", name: "min_reward"})),
    h("label", {}, "≤ ", input("max_reward", {type: "number", step: "any", name: "max_reward"})),
    h("label", {}, "status ", select("failed", [["", "any"], ["false", "finished"], ["true", "failed"]])),
    h("label", {}, h("input", {type: "checkbox", checked: !!f.no_llm_calls,
      onchange: e => { f.no_llm_calls = e.target.checked; state.older = null; show(); }}), " no LLM call only"),
    state.older ? h("button", {onclick: () => { state.older = null; show(); }}, "newest") : null);
}

async function renderEpisodes(r, gen) {
  const data = await api(`api/episodes?${episodeQuery()}`);
  if (!state.episodeFilters.model && data.model) state.episodeFilters.model = data.model;
  const stream = state.episodeFilters.stream || "";
  const rows = data.rows.map(e => h("tr", {class: "click", "data-id": e.id, onclick: () => {
      location.hash = `#/episode/${encodeURIComponent(data.model)}/${encodeURIComponent(e.id)}` +
        (stream ? `?stream=${stream}` : ""); }},
    h("td", {}, when(e.time)), h("td", {}, e.task), h("td", {class: "num"}, e.failed ? "–" : fmt(e.reward)),
    h("td", {}, e.failed ? h("span", {class: "pill bad", title: e.error || ""}, "failed")
      : e.no_llm_calls ? h("span", {class: "pill warn"}, "no LLM call") : h("span", {class: "pill ok"}, "ok")),
    h("td", {class: "num"}, `${e.trained} / ${e.tokens}`), h("td", {}, e.versions.length ? e.versions.join(", ") : "–"),
    h("td", {}, e.code_version || "–"), h("td", {class: "muted"}, e.worker || "–"),
    h("td", {class: "muted"}, e.error || "")));
  const more = data.next ? h("button", {onclick: () => { state.older = data.next; show(); }}, "older") : null;
  const results = [data.unreadable.length ? h("div", {class: "banner error"},
        `${data.unreadable.length} unreadable entries: ${data.unreadable[0]}`) : null,
      table(["time", "task", "reward", "status", "trained / tokens", "weight versions", "code", "worker", "error"], rows),
      h("p", {class: "muted"}, `${data.rows.length} shown of ${data.scanned} looked at `, more)];
  // The filter bar is built once per visit, so polling never takes the focus from a field being typed in.
  const box = document.getElementById("episode-results");
  if (box && state.filtersGen === gen) box.replaceChildren(...results.flat().filter(Boolean));
  else if (gen === state.gen) {
    state.filtersGen = gen;
    put(gen, filterBar(data.models), h("div", {id: "episode-results"}, results));
  }
}

const LP_FLOOR = -8;  // logprobs at or below this are shown fully red; 0 (certain) is green

function lpColor(lp) {  // on the log scale, so the usual range (-8..0) spreads over the hues
  const x = 1 - Math.min(1, Math.max(0, lp / LP_FLOOR));
  return `hsl(${Math.round(120 * x)}, 75%, 80%)`;
}

function tokensView(s) {
  const box = h("div", {class: "tokens" + (state.lpMode ? " lp" : "")});
  s.text.forEach((t, i) => {
    if (s.parents && i > 0 && s.parents[i] !== i - 1) box.appendChild(h("span", {class: "branch"}, `\n↳ branch from token ${s.parents[i]}: `));
    const span = h("span", {class: `tok m${s.mask[i]}`,
      title: `id ${s.tokens[i]} · mask ${s.mask[i]}` + (s.mask[i] ? ` · logprob ${s.logprobs[i]} · v${s.versions[i]}` : "")}, t);
    if (state.lpMode && s.mask[i]) span.style.background = lpColor(s.logprobs[i]);
    box.appendChild(span);
  });
  return box;
}

async function renderEpisode(r, gen) {
  const [, model, id] = r.parts;
  const stream = r.params.get("stream") || "";
  // An entry never changes, and the trainer's trim may remove it once trained: the episode last read is
  // kept, so switching the colouring re-renders it without reading it again.
  const key = `${model}|${id}|${stream}`;
  const e = state.episode && state.episode.key === key ? state.episode.e
    : await api(`api/episode?model=${encodeURIComponent(model)}&id=${encodeURIComponent(id)}` +
                (stream ? `&stream=${stream}` : ""));
  if (e.unreadable) { put(gen, h("div", {class: "banner error"}, e.unreadable)); return; }
  state.episode = {key, e};
  const meta = h("dl", {class: "meta"}, ...[
    ["task", e.task], ["reward", e.failed ? "– (failed)" : fmt(e.reward) + (e.rewards ? ` ${JSON.stringify(e.rewards)}` : "")],
    ["status", e.failed ? `failed: ${e.error}` : e.no_llm_calls ? "finished, but no LLM call was recorded" : "finished"],
    ["episode", e.episode_id], ["group", `${e.group_id} · member ${e.index} of ${e.group_size} · attempt ${e.attempt}`],
    ["code version", e.code_version || "–"], ["weight versions", e.versions.join(", ") || "–"],
    ["worker", `${e.worker || "–"} on ${e.host || "–"}`], ["LLM calls", fmt(e.calls)],
    ["tokens", `${e.trained} trained of ${e.tokens}`],
    ["opponent versions", e.meta.opponent_versions ? JSON.stringify(e.meta.opponent_versions) : null],
  ].filter(([, v]) => v !== null).flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
  const toggle = h("div", {class: "filters"}, "colour by ",
    h("button", {class: state.lpMode ? null : "active", onclick: () => { state.lpMode = false; show(); }}, "loss mask"),
    h("button", {class: state.lpMode ? "active" : null, onclick: () => { state.lpMode = true; show(); }}, "behaviour logprob"),
    h("span", {class: "muted"}, state.lpMode ? `trained tokens by behaviour logprob: red ≤ ${LP_FLOOR}, green = 0; grey = not trained`
      : "blue = trained (loss mask 1, generated by the model); grey = context (mask 0)"),
    e.decoded ? null : h("span", {class: "pill warn"}, "no tokenizer found: token ids shown"));
  const samples = e.samples_view.map((s, i) => h("div", {class: "sample"},
    h("h3", {}, `sample ${i + 1} of ${e.samples_view.length}: ${s.tokens.length} tokens, agents ${s.agents.join(", ") || "–"}`),
    tokensView(s)));
  put(gen, h("p", {}, h("a", {href: "#/episodes"}, "← episodes")), h("h2", {}, `Episode ${e.id} (${model})`), meta,
      e.traceback ? h("div", {}, h("h3", {}, "traceback"), h("pre", {class: "traceback"}, e.traceback)) : null,
      e.meta.info && Object.keys(e.meta.info).length ? h("details", {}, h("summary", {}, "workflow info"),
        h("pre", {class: "light"}, JSON.stringify(e.meta.info, null, 2))) : null,
      samples.length ? toggle : h("p", {class: "muted"}, "no samples (nothing to train on)"), samples);
}

// -- studies ------------------------------------------------------------------------------

async function renderStudies(r, gen) {
  const data = await api("api/studies");
  if (!data.studies.length) { put(gen, h("p", {class: "muted"}, "no studies found in the studies folder")); return; }
  put(gen, table(["study", "files", "updated"], data.studies.map(s => h("tr", {class: "click",
    onclick: () => { location.hash = `#/studies/${encodeURIComponent(s.name)}`; }},
    h("td", {}, s.name), h("td", {}, s.files.join(", ") || "–"), h("td", {}, new Date(s.updated * 1000).toLocaleString())))));
}

async function renderStudy(r, gen) {
  const name = r.parts[1];
  const s = await api(`api/studies/${encodeURIComponent(name)}`);
  const parts = [h("p", {}, h("a", {href: "#/studies"}, "← studies")), h("h2", {}, `Study ${s.name}`)];
  const res = s.results;
  if (res && res.arm_column) {
    for (const [metric, arms] of Object.entries(res.arms)) {
      parts.push(JetChart.intervals({title: `${metric}: mean and 95% interval per ${res.arm_column}`,
        items: Object.entries(arms).map(([label, v]) => ({label, ...v}))}));
    }
    const curves = Object.entries(res.curves || {}).map(([metric, arms]) => JetChart.line({
      title: `${metric} per step (band: 95% interval over runs)`,
      series: Object.entries(arms).map(([a, pts], i) => ({name: a, color: i, points: pts.map(p => [p.step, p.mean])})),
      bands: Object.entries(arms).map(([a, pts], i) => ({name: a, color: i, points: pts.map(p => [p.step, p.lo, p.hi])}))}));
    if (curves.length) parts.push(h("div", {class: "grid"}, curves));
  }
  for (const p of s.plots) parts.push(h("h3", {}, p), h("img", {class: "plot", alt: p,
    src: `api/studies/${encodeURIComponent(name)}/files/${p.split("/").map(encodeURIComponent).join("/")}`}));
  if (s.decisions) {
    const keys = [...new Set(s.decisions.flatMap(d => Object.keys(d)))].slice(0, 8);
    parts.push(h("h3", {}, `decisions (${s.decisions.length})`), table(keys, s.decisions.slice(-200).reverse().map(d =>
      h("tr", {}, keys.map(k => h("td", {}, typeof d[k] === "object" ? JSON.stringify(d[k]) : fmt(d[k])))))));
  }
  if (s.report) parts.push(h("h3", {}, "report.md"), h("pre", {class: "light report"}, s.report));
  if (res) parts.push(h("h3", {}, `results.csv (${res.rows.length} rows)`), table(res.columns,
    res.rows.slice(0, 300).map(row => h("tr", {}, res.columns.map(c => h("td", {}, row[c]))))));
  if (!res && !s.decisions && !s.report) parts.push(h("p", {class: "muted"}, `nothing readable yet; files: ${s.files.join(", ")}`));
  put(gen, ...parts);
}

const PAGES = {swarm: renderSwarm, training: renderTraining, episodes: renderEpisodes, studies: renderStudies};

loadRuns().then(show).catch(e => { status(e.message, true); show(); });
