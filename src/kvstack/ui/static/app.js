// kvstack cache view. Plain DOM, canvas and SVG; no library, no build step.
// Every piece of text that comes from the server is set with textContent (never as markup),
// so a prompt that contains markup shows as text.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "kvstack-ui-key";
  const STATE_NAMES = { f: "free", u: "in use", c: "cached, evictable", p: "pinned" };
  const STATE_COLOURS = { f: "#e5e7eb", u: "#3b82f6", c: "#22c55e", p: "#f59e0b" };
  const SOURCE_NAMES = {
    prefix_cache: "prefix cache", tier: "restored from a tier", computed: "computed",
    draft: "verified draft", model: "sampled", blended: "reused chunk, not recomputed (approximate)",
  };
  const KNOWN_SOURCES = new Set(Object.keys(SOURCE_NAMES));
  const TIER_NAMES = { d: ["disk"], r: ["Redis"], b: ["disk", "Redis"], "-": [] };

  const state = {
    key: sessionStorage.getItem(KEY_STORE) || "",
    hello: null, pool: null, tree: [], nodes: new Map(), history: [], now: 0,
    highlight: null, layout: null, seq: 0, abort: null,
  };

  // -- helpers -------------------------------------------------------------------------------

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (name === "class") node.className = value;
      else if (name === "text") node.textContent = value;
      else node.setAttribute(name, String(value));
    }
    node.append(...children);  // strings become text nodes
    return node;
  }

  function svg(tag, attrs) {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, String(value));
    return node;
  }

  const sleep = (ms) => new Promise((done) => setTimeout(done, ms));

  function headers(extra) {
    const out = Object.assign({}, extra || {});
    if (state.key) out.Authorization = "Bearer " + state.key;
    return out;
  }

  function ago(t) {
    const s = Math.max(0, Math.round((state.now || Date.now() / 1000) - t));
    if (s < 90) return s + " s ago";
    if (s < 5400) return Math.round(s / 60) + " min ago";
    return Math.round(s / 3600) + " h ago";
  }

  function fmt(value, digits) {
    if (value === null || value === undefined) return "–";
    return Number(value).toFixed(digits === undefined ? 0 : digits);
  }

  function clip(text, max) {
    return text.length <= max ? text : "…" + text.slice(text.length - max);
  }

  // Server-sent events over fetch (EventSource cannot send the Authorization header).
  async function readEvents(response, onEvent) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const raw = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        let name = "message";
        let data = "";
        for (const line of raw.split("\n")) {
          if (line.startsWith("event: ")) name = line.slice(7);
          else if (line.startsWith("data: ")) data += line.slice(6);
        }
        if (data) onEvent(name, JSON.parse(data));
      }
    }
  }

  // -- session -------------------------------------------------------------------------------

  function showLogin(message) {
    $("main").hidden = true;
    $("login").hidden = false;
    $("login-error").textContent = message || "";
    $("key").focus();
  }

  async function start() {
    const response = await fetch("/ui/api/session", { headers: headers(), cache: "no-store" });
    if (response.status === 401) {
      state.key = "";
      sessionStorage.removeItem(KEY_STORE);
      showLogin("The server did not accept that key.");
      return;
    }
    const session = await response.json();
    $("model").textContent = session.model;
    if (!session.viewer) {
      showLogin("");
      return;
    }
    $("login").hidden = true;
    $("main").hidden = false;
    $("viewer").textContent = session.viewer.role + ": " + session.viewer.label;
    // Nothing of a previous key's view stays on the page.
    Object.assign(state, { pool: null, tree: [], nodes: new Map(), history: [], highlight: null });
    renderTree();
    const canvas = $("pool");
    canvas.getContext("2d").clearRect(0, 0, canvas.width, canvas.height);
    connect();
  }

  function setStatus(live) {
    const status = $("status");
    status.textContent = live ? "live" : "reconnecting";
    status.className = "pill " + (live ? "status-on" : "status-off");
  }

  async function connect() {
    // A new key (or a new login) supersedes the stream of the previous one.
    if (state.abort) state.abort.abort();
    const abort = new AbortController();
    state.abort = abort;
    while (!abort.signal.aborted) {
      try {
        const response = await fetch("/ui/api/events", {
          headers: headers(), cache: "no-store", signal: abort.signal,
        });
        if (response.status === 401) {
          showLogin("The server no longer accepts this key.");
          return;
        }
        if (response.ok) {
          setStatus(true);
          await readEvents(response, onLiveEvent);
        }
      } catch (err) {
        // The server went away or restarted, or the stream was superseded: see below.
      }
      if (abort.signal.aborted) return;
      setStatus(false);
      await sleep(2000);
    }
  }

  function onLiveEvent(name, data) {
    if (name === "hello") {
      state.hello = data;
      state.history = data.history || [];
      renderCharts();
      return;
    }
    if (name !== "tick") return;
    state.seq = data.seq;
    state.now = data.point.t;
    state.history.push(data.point);
    const keep = Math.round(600 / ((state.hello && state.hello.interval_s) || 1));
    if (state.history.length > keep) state.history.splice(0, state.history.length - keep);
    renderTotals(data.totals);
    if (data.tree) {
      state.tree = data.tree;
      state.nodes = new Map(data.tree.map((n) => [n.id, n]));
      renderTree();
    }
    if (data.pool) {
      state.pool = data.pool;
      renderCounts();
    }
    if (data.pool || data.tree) drawPool();
    renderCharts();
    $("pool").dataset.seq = String(data.seq);
  }

  function renderTotals(t) {
    $("totals").textContent =
      `${t.requests_running} running · ${t.requests_waiting} waiting · prefix hit rate ` +
      `${fmt(t.prefix_cache_hit_rate * 100, 1)}% · ${t.prompt_tokens} prompt / ` +
      `${t.generation_tokens} output tokens · ${t.preemptions} preemptions`;
  }

  // -- block pool ----------------------------------------------------------------------------

  function renderCounts() {
    const counts = { f: 0, u: 0, c: 0, p: 0 };
    for (const letter of state.pool.states) counts[letter] += 1;
    $("count-free").textContent = String(counts.f);
    $("count-in_use").textContent = String(counts.u);
    $("count-cached").textContent = String(counts.c);
    $("count-pinned").textContent = String(counts.p);
    $("count-total").textContent = String(state.pool.states.length);
  }

  function drawPool() {
    const pool = state.pool;
    if (!pool) return;
    const canvas = $("pool");
    const n = pool.states.length;
    const width = canvas.parentElement.clientWidth || 800;
    const cell = n <= 2000 ? 12 : n <= 8000 ? 8 : 5;
    const cols = Math.max(1, Math.floor(width / cell));
    const rows = Math.max(1, Math.ceil(n / cols));
    const ratio = window.devicePixelRatio || 1;
    canvas.width = cols * cell * ratio;
    canvas.height = rows * cell * ratio;
    canvas.style.width = cols * cell + "px";
    canvas.style.height = rows * cell + "px";
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    const size = cell - 1;
    for (let i = 0; i < n; i++) {
      const x = (i % cols) * cell;
      const y = Math.floor(i / cols) * cell;
      ctx.fillStyle = STATE_COLOURS[pool.states[i]];
      ctx.fillRect(x, y, size, size);
      if (pool.owner[i] === "o") {  // another tenant's block: hatched, nothing else shown
        ctx.strokeStyle = "rgba(255,255,255,0.8)";
        ctx.beginPath();
        ctx.moveTo(x, y + size);
        ctx.lineTo(x + size, y);
        ctx.stroke();
      }
      const tier = pool.tiers[i];
      if (tier === "d" || tier === "b") {
        ctx.fillStyle = "#7c3aed";
        ctx.fillRect(x, y + size - 3, 3, 3);
      }
      if (tier === "r" || tier === "b") {
        ctx.fillStyle = "#dc2626";
        ctx.fillRect(x + size - 3, y + size - 3, 3, 3);
      }
      if (state.highlight && state.highlight.has(i)) {
        ctx.strokeStyle = "#111827";
        ctx.lineWidth = 2;
        ctx.strokeRect(x + 1, y + 1, size - 2, size - 2);
        ctx.lineWidth = 1;
      }
    }
    state.layout = { cell, cols, n };
  }

  function prefixText(nodeId) {
    const parts = [];
    let node = state.nodes.get(nodeId);
    node = node && node.parent !== null ? state.nodes.get(node.parent) : null;
    while (node) {
      parts.unshift(node.text);
      node = node.parent !== null ? state.nodes.get(node.parent) : null;
    }
    return parts.join("");
  }

  function blockTip(i) {
    const pool = state.pool;
    const tip = [el("b", { text: `block ${i}` }), ` · ${STATE_NAMES[pool.states[i]]}`];
    const tiers = TIER_NAMES[pool.tiers[i]] || [];
    if (pool.owner[i] === "o") {
      tip.push("\nanother tenant's block");
      if (pool.tenant && pool.tenant[i] >= 0) tip.push(` (${pool.tenants[pool.tenant[i]]})`);
    }
    if (pool.owner[i] === "m") {
      if (pool.hash[i]) tip.push(`\nhash ${pool.hash[i]}…`);
      if (pool.origin[i] !== "-") tip.push(pool.origin[i] === "r" ? " · restored from a tier" : " · computed");
      if (pool.tenant && pool.tenant[i] >= 0) tip.push(` · tenant ${pool.tenants[pool.tenant[i]]}`);
      const holders = pool.holders[String(i)];
      if (holders) tip.push(`\nheld by ${holders.join(", ")}`);
      const node = state.nodes.get(pool.node[i]);
      if (node) {
        tip.push(`\nhits ${node.hits} · last used ${ago(node.last_used)}`);
        tip.push("\nprefix: ", el("span", { class: "tip-prefix", text: clip(prefixText(node.id), 300) }),
          el("span", { class: "tip-own", text: clip(node.text, 300) }));
      } else if (pool.states[i] === "u") {
        tip.push("\nbeing filled: not a full block yet");
      }
    }
    if (tiers.length) tip.push(`\non ${tiers.join(" and ")}`);
    return tip;
  }

  function onPoolHover(ev) {
    const tooltip = $("tooltip");
    const layout = state.layout;
    if (!layout || !state.pool) return;
    const col = Math.floor(ev.offsetX / layout.cell);
    const row = Math.floor(ev.offsetY / layout.cell);
    const i = row * layout.cols + col;
    if (col >= layout.cols || i < 0 || i >= layout.n) {
      tooltip.hidden = true;
      return;
    }
    tooltip.replaceChildren(...blockTip(i));
    tooltip.dataset.block = String(i);
    tooltip.hidden = false;
    tooltip.style.left = Math.min(ev.offsetX + 14, $("pool-wrap").clientWidth - 300) + "px";
    tooltip.style.top = ev.offsetY + 14 + "px";
  }

  // -- prefix tree ---------------------------------------------------------------------------

  function renderTree() {
    const root = $("tree");
    const scroll = root.scrollTop;
    if (!state.tree.length) {
      root.replaceChildren(el("p", { class: "empty", text: "No cached prefix of yours yet." }));
      return;
    }
    const children = new Map();
    for (const node of state.tree) {
      const parent = node.parent === null ? -1 : node.parent;
      if (!children.has(parent)) children.set(parent, []);
      children.get(parent).push(node);
    }
    for (const list of children.values()) list.sort((a, b) => b.last_used - a.last_used);
    const build = (parent) => {
      const list = el("ul");
      for (const node of children.get(parent) || []) {
        const item = el("li", { class: "node", "data-node": node.id });
        const swatch = el("span", { class: "node-state st-" + node.state, title: STATE_NAMES[node.state] });
        const text = el("span", { class: "node-text", text: node.text });
        const badges = [`${node.tokens} tok`, `hits ${node.hits}`, `used ${ago(node.last_used)}`];
        if (node.tiers.length) badges.push("on " + node.tiers.join("+"));
        if (node.origin === "restored") badges.push("restored");
        if (node.orphan) badges.push("head evicted");
        if (node.tenant) badges.push(node.tenant);
        const row = el("div", { class: "node-row" }, swatch, text,
          el("span", { class: "badge", text: badges.join(" · ") }));
        row.addEventListener("mouseenter", () => { state.highlight = new Set(node.blocks); drawPool(); });
        row.addEventListener("mouseleave", () => { state.highlight = null; drawPool(); });
        item.append(row);
        if (children.has(node.id)) item.append(build(node.id));
        list.append(item);
      }
      return list;
    };
    root.replaceChildren(build(-1));
    root.scrollTop = scroll;
  }

  // -- charts --------------------------------------------------------------------------------

  const at = (i) => (p) => (p && p[i] !== undefined ? p[i] : null);
  const CHARTS = [
    { id: "hit_rate", title: "Prefix hit rate (%)", series: [
      ["last 10 s", (p) => (p.hit_rate === null ? null : p.hit_rate * 100), "#16a34a"],
      ["since start", (p) => p.hit_rate_total * 100, "#9ca3af"]] },
    { id: "ttft", title: "TTFT (ms, requests of the last minute)", series: [
      ["p50", (p) => at(0)(p.ttft), "#2563eb"], ["p90", (p) => at(1)(p.ttft), "#f59e0b"],
      ["p99", (p) => at(2)(p.ttft), "#dc2626"]] },
    { id: "tpot", title: "TPOT (ms, requests of the last minute)", series: [
      ["p50", (p) => at(0)(p.tpot), "#2563eb"], ["p90", (p) => at(1)(p.tpot), "#f59e0b"],
      ["p99", (p) => at(2)(p.tpot), "#dc2626"]] },
    { id: "tok_s", title: "Output tokens/s", series: [["tok/s", (p) => p.tok_s, "#7c3aed"]] },
    { id: "blocks", title: "Blocks", series: [
      ["in use", (p) => p.blocks_used, STATE_COLOURS.u], ["cached", (p) => p.blocks_cached, STATE_COLOURS.c],
      ["pinned", (p) => p.blocks_pinned, STATE_COLOURS.p]] },
    { id: "preemptions", title: "Preemptions (per tick)", series: [
      ["preemptions", (p) => p.preemptions, "#dc2626"]] },
    { id: "tiers", title: "Tier hits / misses (blocks per tick)", series: null },
    { id: "semantic", title: "Semantic cache (per tick)", series: [
      ["lookups", (p) => at(0)(p.semantic), "#9ca3af"], ["hits", (p) => at(1)(p.semantic), "#16a34a"]] },
  ];

  function tierSeries() {
    const names = new Set();
    for (const p of state.history) for (const name of Object.keys(p.tiers || {})) names.add(name);
    const colours = ["#7c3aed", "#c4b5fd", "#dc2626", "#fca5a5"];
    const out = [];
    let k = 0;
    for (const name of names) {
      out.push([`${name} hits`, (p) => at(0)((p.tiers || {})[name]), colours[k++ % 4]]);
      out.push([`${name} misses`, (p) => at(1)((p.tiers || {})[name]), colours[k++ % 4]]);
    }
    return out;
  }

  function chartFrame(spec) {
    let box = document.querySelector(`.chart[data-chart="${spec.id}"]`);
    if (!box) {
      box = el("div", { class: "chart", "data-chart": spec.id }, el("h4", { text: spec.title }),
        el("div", { class: "now" }), svg("svg", { viewBox: "0 0 300 90", preserveAspectRatio: "none" }));
      $("charts").append(box);
    }
    return box;
  }

  function renderChart(spec) {
    const box = chartFrame(spec);
    const series = spec.series || tierSeries();
    const points = state.history;
    const plot = box.querySelector("svg");
    plot.replaceChildren();
    const now = box.querySelector(".now");
    if (!series.length || !points.length || series.every(([, f]) => points.every((p) => f(p) === null))) {
      now.textContent = spec.id === "semantic" ? "no lookups (is --semantic-cache on?)"
        : spec.id === "tiers" ? "no tier (start with --kv-disk-dir or --kv-redis-url)" : "no data yet";
      return;
    }
    let top = 1;
    for (const [, f] of series) for (const p of points) { const v = f(p); if (v !== null && v > top) top = v; }
    top *= 1.1;
    const t1 = points[points.length - 1].t;
    const span = Math.max(60, t1 - points[0].t);
    const x = (t) => 300 - ((t1 - t) / span) * 296;
    const y = (v) => 86 - (v / top) * 80;
    plot.append(svg("line", { x1: 0, y1: 86, x2: 300, y2: 86, class: "axis" }));
    const label = svg("text", { x: 2, y: 9, class: "lbl" });
    label.textContent = fmt(top, top < 10 ? 1 : 0);
    plot.append(label);
    const current = [];
    for (const [name, f, colour] of series) {
      let run = [];
      const flush = () => {
        if (run.length) plot.append(svg("polyline", { points: run.join(" "), stroke: colour }));
        run = [];
      };
      for (const p of points) {
        const v = f(p);
        if (v === null) flush();
        else run.push(`${x(p.t).toFixed(1)},${y(v).toFixed(1)}`);
      }
      flush();
      const last = f(points[points.length - 1]);
      current.push(`${name} ${fmt(last, last !== null && last < 10 ? 1 : 0)}`);
    }
    now.textContent = current.join(" · ");
  }

  function renderCharts() {
    for (const spec of CHARTS) renderChart(spec);
  }

  // -- playground ----------------------------------------------------------------------------

  const pg = { turns: [], last: null, runs: 0, running: false };

  function pgBody() {
    const common = {
      max_tokens: Number($("pg-max-tokens").value) || 48,
      temperature: Number($("pg-temperature").value) || 0,
    };
    if ($("pg-lookup").checked) common.prompt_lookup = 8;
    if ($("pg-mode").value === "completion") {
      return Object.assign({ mode: "completion", prompt: $("pg-prompt").value }, common);
    }
    const messages = [];
    if ($("pg-system").value.trim()) messages.push({ role: "system", content: $("pg-system").value });
    messages.push(...pg.turns, { role: "user", content: $("pg-user").value });
    return Object.assign({ mode: "chat", messages }, common);
  }

  function sourceClass(source) {
    return "tok src-" + (KNOWN_SOURCES.has(source) ? source : "other");
  }

  function paint(spans, runs, delayMs) {
    // Colour the prompt's tokens in order, a few at a time, so the reuse is seen happening.
    const sources = [];
    for (const [source, count] of runs) for (let k = 0; k < count; k++) sources.push(source);
    const step = Math.max(1, Math.ceil(spans.length / 40));
    return new Promise((done) => {
      let i = 0;
      const tick = () => {
        for (let k = 0; k < step && i < spans.length; k++, i++) {
          spans[i].className = sourceClass(sources[i] || "computed");
          spans[i].title = SOURCE_NAMES[sources[i]] || sources[i] || "";
        }
        if (i < spans.length) setTimeout(tick, delayMs);
        else done();
      };
      tick();
    });
  }

  async function pgSend() {
    if (pg.running) return;
    pg.running = true;
    const body = pgBody();
    const promptBox = $("pg-prompt-tokens");
    const output = $("pg-output");
    promptBox.replaceChildren();
    output.replaceChildren();
    promptBox.dataset.state = "running";
    $("pg-error").textContent = "";
    $("pg-stats").textContent = "sending…";
    $("pg-send").disabled = true;
    $("pg-reply").disabled = true;
    const run = { spans: [], answer: "", painted: Promise.resolve(), done: null };
    try {
      const response = await fetch("/ui/api/playground", {
        method: "POST", headers: headers({ "content-type": "application/json" }), body: JSON.stringify(body),
      });
      if (!response.ok) {
        const err = await response.json().catch(() => null);
        throw new Error((err && err.error && err.error.message) || `HTTP ${response.status}`);
      }
      await readEvents(response, (name, data) => onPlaygroundEvent(run, name, data));
      await run.painted;
      if (run.done) finishRun(run, body);
    } catch (err) {
      $("pg-error").textContent = String(err.message || err);
      $("pg-stats").textContent = "";
    } finally {
      pg.running = false;
      $("pg-send").disabled = false;
      promptBox.dataset.state = run.done ? "done" : "failed";
    }
  }

  function onPlaygroundEvent(run, name, data) {
    const promptBox = $("pg-prompt-tokens");
    if (name === "prompt") {
      run.spans = data.pieces.map((piece, i) => el("span", { class: "tok pending", "data-i": i, text: piece }));
      promptBox.replaceChildren(...run.spans);
      promptBox.dataset.total = String(run.spans.length);
      $("pg-stats").textContent = `${run.spans.length} prompt tokens · waiting for the first token…`;
    } else if (name === "admitted") {
      promptBox.dataset.cached = String(data.num_cached_tokens);
      run.painted = paint(run.spans, data.provenance, 25);
      $("pg-stats").textContent = `TTFT ${fmt(data.ttft_ms)} ms · generating…`;
    } else if (name === "tokens") {
      const sources = [];
      for (const [source, count] of data.sources) for (let k = 0; k < count; k++) sources.push(source);
      data.pieces.forEach((piece, i) => {
        run.answer += piece;
        $("pg-output").append(el("span", { class: sourceClass(sources[i] || "model"), text: piece }));
      });
    } else if (name === "done") {
      run.done = data;
    } else if (name === "error") {
      $("pg-error").textContent = data.message;
    }
  }

  function finishRun(run, body) {
    const d = run.done;
    const prompt = d.provenance.prompt;
    const count = (source) => prompt.filter(([s]) => s === source).reduce((a, [, n]) => a + n, 0);
    const total = run.spans.length;
    const cached = count("prefix_cache") + count("tier");
    $("pg-stats").textContent =
      `TTFT ${fmt(d.ttft_ms)} ms · TPOT ${fmt(d.tpot_ms, 1)} ms · prompt ${total} tokens: ` +
      `${count("prefix_cache")} from the prefix cache, ${count("tier")} from a tier, ` +
      `${count("computed")} computed · ${d.num_output_tokens} out (${d.finish_reason})` +
      (d.num_draft_tokens ? ` · drafts ${d.num_accepted_tokens}/${d.num_draft_tokens} accepted` : "");
    pg.runs += 1;
    const item = el("li", { "data-cached": cached, "data-total": total,
      text: `${cached}/${total} prompt tokens reused · TTFT ${fmt(d.ttft_ms)} ms · TPOT ${fmt(d.tpot_ms, 1)} ms` });
    $("pg-history").prepend(item);
    if (body.mode === "chat") {
      pg.last = { user: body.messages[body.messages.length - 1], answer: run.answer };
      $("pg-reply").disabled = false;
    }
  }

  function pgContinue() {
    if (!pg.last) return;
    pg.turns.push(pg.last.user, { role: "assistant", content: pg.last.answer });
    pg.last = null;
    $("pg-user").value = "";
    $("pg-user").focus();
    $("pg-reply").disabled = true;
  }

  // -- wiring --------------------------------------------------------------------------------

  document.addEventListener("DOMContentLoaded", () => {
    $("login-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      state.key = $("key").value.trim();
      sessionStorage.setItem(KEY_STORE, state.key);
      start();
    });
    $("switch-key").addEventListener("click", () => showLogin(""));
    $("pool").addEventListener("mousemove", onPoolHover);
    $("pool").addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
    $("pg-send").addEventListener("click", pgSend);
    $("pg-reply").addEventListener("click", pgContinue);
    $("pg-mode").addEventListener("change", () => {
      const completion = $("pg-mode").value === "completion";
      $("pg-chat-fields").hidden = completion;
      $("pg-completion-fields").hidden = !completion;
    });
    window.addEventListener("resize", drawPool);
    start();
  });
})();
