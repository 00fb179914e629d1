// stagerun's web page: a chat over the OpenAI API, and the pipeline live from /ui/state.
// Everything the model or the server says is written with textContent: never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "stagerun.api_key";
const POLL_MS = 2000;

const page = {
  mode: "chat",
  messages: [], // the conversation, as the API takes it
  controller: null, // the AbortController of the request in flight
  key: sessionStorage.getItem(KEY_STORE) || "",
  waitingForKey: null, // resolves when the key dialog closes
  stagesSignature: "", // what the stage cards show, but their busy shares
};

function headers(json) {
  const out = {};
  if (json) out["content-type"] = "application/json";
  if (page.key) out.authorization = "Bearer " + page.key;
  return out;
}

// fetch() with the key; a 401 asks for a key once and tries again.
async function api(path, options = {}) {
  for (let attempt = 0; ; attempt++) {
    const response = await fetch(path, { ...options, headers: headers(options.body) });
    if (response.status !== 401 || attempt > 0) return response;
    if (!(await askForKey())) return response;
  }
}

function askForKey() {
  if (!page.waitingForKey) {
    page.waitingForKey = new Promise((resolve) => {
      const dialog = $("key-dialog");
      const done = (ok) => {
        page.waitingForKey = null;
        dialog.close();
        resolve(ok);
      };
      $("key-form").onsubmit = (event) => {
        event.preventDefault();
        page.key = $("key-input").value.trim();
        sessionStorage.setItem(KEY_STORE, page.key);
        done(true);
      };
      $("key-cancel").onclick = () => done(false);
      dialog.showModal();
    });
  }
  return page.waitingForKey;
}

// -- the conversation ---------------------------------------------------------------------

function bubble(role, text) {
  const item = document.createElement("div");
  item.className = "message " + role;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  const facts = document.createElement("div");
  facts.className = "facts muted";
  item.append(who, body, facts);
  $("log").append(item);
  $("log").scrollTop = $("log").scrollHeight;
  return { item, body, facts };
}

function number(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value);
}

function requestBody(prompt) {
  const body = {
    model: $("model").dataset.id || undefined,
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: number("max-tokens"),
    temperature: number("temperature"),
    top_p: number("top-p"),
    seed: number("seed"),
  };
  const speculative = $("speculative").value;
  if (speculative) body.speculative = speculative === "true";
  if (page.mode === "chat") {
    const system = $("system").value.trim();
    body.messages = [...(system ? [{ role: "system", content: system }] : []), ...page.messages];
  } else {
    body.prompt = prompt;
  }
  return body;
}

// The `data:` payloads of an SSE byte stream, as they arrive.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

function showFacts(view, started, firstAt, count, timings) {
  const facts = [];
  if (firstAt) facts.push(`first token ${Math.round(firstAt - started)} ms`);
  const seconds = (performance.now() - (firstAt || started)) / 1000;
  const rate = timings && timings.predicted_per_second;
  if (rate) facts.push(`${rate.toFixed(1)} tokens/s`);
  else if (count > 1 && seconds > 0) facts.push(`${((count - 1) / seconds).toFixed(1)} tokens/s`);
  if (timings) {
    facts.push(`${timings.prompt_n} prompt tokens, ${timings.prefix_cached_tokens || 0} cached`);
    if (timings.draft_n !== undefined) {
      facts.push(`${timings.draft_n_accepted} of ${timings.draft_n} drafts accepted`);
    }
    if (timings.recoveries) facts.push(`${timings.recoveries} recoveries`);
  }
  view.facts.textContent = facts.join(" · ");
}

async function send(event) {
  event.preventDefault();
  if (page.controller) return;
  const prompt = $("prompt").value;
  if (!prompt.trim()) return;
  $("error").textContent = "";
  if (page.mode === "chat") page.messages.push({ role: "user", content: prompt });
  bubble(page.mode === "chat" ? "user" : "prompt", prompt);
  $("prompt").value = "";
  const view = bubble(page.mode === "chat" ? "assistant" : "completion", "");
  view.item.classList.add("streaming");
  page.controller = new AbortController();
  setBusy(true);
  const started = performance.now();
  let firstAt = 0;
  let count = 0;
  let text = "";
  try {
    const path = page.mode === "chat" ? "/v1/chat/completions" : "/v1/completions";
    const response = await api(path, {
      method: "POST",
      body: JSON.stringify(requestBody(prompt)),
      signal: page.controller.signal,
    });
    if (!response.ok) {
      const failure = await response.json().catch(() => ({}));
      throw new Error((failure.error && failure.error.message) || response.statusText);
    }
    for await (const data of events(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices && chunk.choices[0];
      const piece = choice ? (choice.delta ? choice.delta.content : choice.text) : null;
      if (piece) {
        if (!firstAt) firstAt = performance.now();
        count += 1;
        text += piece;
        view.body.textContent = text;
        $("log").scrollTop = $("log").scrollHeight;
      }
      showFacts(view, started, firstAt, count, chunk.timings);
    }
  } catch (error) {
    if (error.name === "AbortError") view.facts.textContent += " · stopped";
    else $("error").textContent = String(error.message || error);
  } finally {
    view.item.classList.remove("streaming");
    if (page.mode === "chat") page.messages.push({ role: "assistant", content: text });
    page.controller = null;
    setBusy(false);
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  document.body.classList.toggle("busy", busy);
}

function stop() {
  if (page.controller) page.controller.abort();
}

function setMode(mode) {
  page.mode = mode;
  for (const tab of document.querySelectorAll(".tab")) {
    tab.classList.toggle("active", tab.dataset.mode === mode);
  }
  $("prompt").placeholder = mode === "chat" ? "Write a message" : "Text to continue";
}

function clear() {
  stop();
  page.messages = [];
  $("log").replaceChildren();
}

// -- the pipeline -------------------------------------------------------------------------

function cell(tag, text, className) {
  const node = document.createElement(tag);
  node.textContent = text;
  if (className) node.className = className;
  return node;
}

function mib(bytes) {
  return bytes === undefined || bytes === null ? "–" : (bytes / 1048576).toFixed(1) + " MiB";
}

function stageCard(stage) {
  const card = document.createElement("div");
  card.className = "stage " + stage.state;
  card.dataset.index = stage.index;
  const [lo, hi] = stage.layers;
  card.append(cell("h3", `stage ${stage.index}`), cell("span", stage.state, "pill " + stage.state));
  const facts = [
    ["layers", `${lo}..${hi}`],
    ["backend", stage.backend],
    ["address", stage.address],
  ];
  if (stage.process) facts.push(["restarts", String(stage.process.restarts)]);
  if (stage.latency_ms !== undefined) facts.push(["probe", `${stage.latency_ms.toFixed(1)} ms`]);
  const batch = stage.recent_batch ?? (stage.batch && stage.batch.mean_items_per_tick);
  facts.push(["forwards per tick", batch === undefined || batch === null ? "–" : String(batch)]);
  if (stage.prefix_cache) {
    const cache = stage.prefix_cache;
    facts.push(["prefix cache", `${mib(cache.bytes)}, ${cache.hits ?? 0} hits`]);
  }
  const list = document.createElement("dl");
  for (const [name, value] of facts) list.append(cell("dt", name), cell("dd", value));
  const bar = document.createElement("div");
  bar.className = "bar";
  bar.append(document.createElement("div"));
  card.append(list, cell("div", "", "muted busy"), bar);
  showBusy(card, stage.busy);
  return card;
}

function showBusy(card, busy) {
  const label = busy === undefined ? "busy: not measured" : `busy ${(busy * 100).toFixed(0)}%`;
  card.querySelector(".busy").textContent = label;
  card.querySelector(".bar > div").style.width = `${Math.round(Math.min(1, busy ?? 0) * 100)}%`;
}

function showState(state) {
  $("status").textContent = state.status;
  $("status").className = "pill " + state.status;
  // Rebuild the cards only when something but the busy shares changed; else move the bars.
  const signature = JSON.stringify(state.stages.map((s) => ({ ...s, busy: undefined })));
  const cards = $("stages").children;
  if (signature !== page.stagesSignature || cards.length !== state.stages.length) {
    page.stagesSignature = signature;
    $("stages").replaceChildren(...state.stages.map(stageCard));
  } else {
    state.stages.forEach((stage, i) => showBusy(cards[i], stage.busy));
  }
  const requests = state.requests;
  const rows = [
    ["requests running", `${requests.running} of ${requests.max_batch}`],
    ["requests queued", `${requests.queued} of ${requests.max_queue}`],
    ["refused (queue full)", String(requests.rejected)],
    ["KV reserved", `${mib(requests.kv_reserved_bytes)} of ${mib(requests.kv_budget_bytes)}`],
    ["clients gone (cancelled)", String(state.client_disconnects)],
  ];
  if (state.lanes) rows.push(["lanes busy", `${state.lanes.busy} of ${state.lanes.capacity}`]);
  const body = $("summary").tBodies[0];
  body.replaceChildren(...rows.map(([name, value]) => {
    const row = document.createElement("tr");
    row.append(cell("th", name), cell("td", value));
    return row;
  }));
  $("updated").textContent = new Date(state.time * 1000).toLocaleTimeString();
  drawTimeline(state.timeline);
}

// -- the timeline of the request in flight ------------------------------------------------

const COLOURS = {
  compute: "#3a6ea5", stale: "#c0392b", verified: "#2e7d32", cancelled: "#c0392b",
  open: "#9aa3ad", recovery: "#f0a202", grid: "#d9dde3", text: "#6b7480",
};

// One row per stage (its computes), above them one for stage 0's verify windows (sent to
// settled); times are milliseconds before the snapshot, the right edge "now" (or the end).
function drawTimeline(line) {
  $("timeline").hidden = !line;
  if (!line) return;
  const canvas = $("timeline-canvas");
  const scale = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  canvas.width = Math.round(width * scale);
  canvas.height = Math.round(height * scale);
  const g = canvas.getContext("2d");
  g.setTransform(scale, 0, 0, scale, 0, 0);
  g.clearRect(0, 0, width, height);
  const left = 52, right = width - 6;
  const from = line.since_ms, to = line.end_ms ?? 0;
  const span = Math.max(1, to - from);
  const x = (ms) => left + ((Math.min(Math.max(ms, from), to) - from) / span) * (right - left);
  const rows = line.stages.length + 1;
  const rowHeight = (height - 18) / rows;
  g.font = "11px system-ui, sans-serif";
  g.textBaseline = "middle";
  g.fillStyle = COLOURS.text;
  g.fillText("windows", 2, rowHeight / 2);
  line.windows.forEach(([id, opened, settled, outcome], i) => {
    const lane = 3 + (i % 4) * ((rowHeight - 6) / 4);
    g.fillStyle = COLOURS[outcome] || COLOURS.open;
    g.fillRect(x(opened), lane, Math.max(1.5, x(settled ?? to) - x(opened)), (rowHeight - 6) / 4 - 1);
  });
  line.stages.forEach((spans, stage) => {
    const top = (stage + 1) * rowHeight;
    g.fillStyle = COLOURS.grid;
    g.fillRect(left, top + rowHeight - 1, right - left, 1);
    g.fillStyle = COLOURS.text;
    g.fillText(`stage ${stage}`, 2, top + rowHeight / 2);
    for (const [start, end, kind] of spans) {
      g.fillStyle = COLOURS[kind] || COLOURS.compute;
      g.fillRect(x(start), top + 3, Math.max(1, x(end) - x(start)), rowHeight - 7);
    }
  });
  g.fillStyle = COLOURS.recovery;
  for (const at of line.recoveries) g.fillRect(x(at) - 1, 0, 2, height - 18);
  g.fillStyle = COLOURS.text;
  g.textBaseline = "bottom";
  g.fillText(`${(from / 1000).toFixed(1)} s`, left, height - 2);
  const edge = line.running ? "now" : "ended";
  g.fillText(edge, right - g.measureText(edge).width, height - 2);
  const stale = line.windows.filter((w) => w[3] === "stale" || w[3] === "cancelled").length;
  const computes = line.stages.map((spans) => spans.length).join(", ");
  $("timeline-caption").textContent =
    `request ${line.request} ${line.running ? "running" : "ended"} · computes per stage: ` +
    `${computes} · windows ${line.windows.length} (${stale} stale) · ` +
    `recoveries ${line.recoveries.length}`;
}

async function poll() {
  try {
    const response = await api("/ui/state");
    if (response.ok) showState(await response.json());
    else $("status").textContent = `state: ${response.status}`;
  } catch (error) {
    $("status").textContent = "server unreachable";
    $("status").className = "pill unhealthy";
  }
  setTimeout(poll, document.hidden ? POLL_MS * 5 : POLL_MS);
}

async function loadModel() {
  const response = await api("/v1/models");
  if (!response.ok) return;
  const models = await response.json();
  const first = models.data && models.data[0];
  if (first) {
    $("model").textContent = first.id;
    $("model").dataset.id = first.id;
  }
}

function start() {
  $("composer").addEventListener("submit", send);
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", clear);
  $("key-button").addEventListener("click", () => askForKey());
  for (const tab of document.querySelectorAll(".tab")) {
    tab.addEventListener("click", () => setMode(tab.dataset.mode));
  }
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  loadModel().then(poll);
}

document.addEventListener("DOMContentLoaded", start);
