// The chat page: talks to this server's OpenAI API (/v1/models, streamed
// /v1/chat/completions) and reads /stats for the server panel. Nothing else is fetched.
"use strict";

const KEY_STORAGE = "llmctl-api-key"; // sessionStorage: gone when the tab closes
const STATS_EVERY_MS = 1000;
const PLOT_POINTS = 60;

const $ = (id) => document.getElementById(id);
const state = {
  history: [],          // [{role, content}] of the current chat
  controller: null,     // AbortController of the answer being streamed
  lastStats: null,      // the previous /stats reading, to turn totals into rates
  series: { tps: [], running: [], waiting: [], kv: [], ttft: [] },
  lastTtftMs: null,
};

// ---- API access -----------------------------------------------------------

class Unauthorized extends Error {}

function authHeaders() {
  const key = sessionStorage.getItem(KEY_STORAGE);
  return key ? { Authorization: "Bearer " + key } : {};
}

async function api(path, options = {}) {
  const response = await fetch(path, {
    ...options,
    headers: { ...authHeaders(), ...(options.headers || {}) },
  });
  if (response.status === 401) throw new Unauthorized();
  return response;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (_) {
    return "HTTP " + response.status;
  }
}

// Ask for a key (once at a time); resolves to whether one was given.
let keyPrompt = null;
function askForKey() {
  if (!keyPrompt) {
    keyPrompt = new Promise((resolve) => {
      const dialog = $("key-dialog");
      $("key-input").value = "";
      dialog.addEventListener("close", function done() {
        dialog.removeEventListener("close", done);
        const key = $("key-input").value.trim();
        if (key) sessionStorage.setItem(KEY_STORAGE, key);
        keyPrompt = null;
        if (key) refreshStats(); // the panel needs the key too: do not wait for the next tick
        resolve(Boolean(key));
      });
      dialog.showModal();
    });
  }
  return keyPrompt;
}

// Run fn; on 401 ask for a key and try again.
async function withKey(fn) {
  for (;;) {
    try {
      return await fn();
    } catch (error) {
      if (!(error instanceof Unauthorized)) throw error;
      if (!(await askForKey())) throw new Error("this server needs an API key (reload the page to give one)");
    }
  }
}

// ---- models -----------------------------------------------------------------

async function loadModels() {
  const response = await withKey(() => api("/v1/models"));
  if (!response.ok) throw new Error(await errorText(response));
  const select = $("model");
  select.replaceChildren();
  for (const model of (await response.json()).data) {
    const option = document.createElement("option");
    option.value = option.textContent = model.id;
    select.append(option);
  }
}

// ---- chat -------------------------------------------------------------------

function addMessage(role, text) {
  $("empty-hint").hidden = true;
  const box = document.createElement("div");
  box.className = "msg " + role;
  const body = document.createElement("div");
  body.className = "body";
  if (role === "user") body.textContent = text;
  box.append(body);
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function addMeta(box, text, answer) {
  const meta = document.createElement("div");
  meta.className = "meta";
  const copy = document.createElement("button");
  copy.type = "button";
  copy.className = "copy";
  copy.textContent = "Copy";
  copy.addEventListener("click", async () => {
    await copyText(answer);
    copy.textContent = "Copied";
    setTimeout(() => { copy.textContent = "Copy"; }, 1500);
  });
  const info = document.createElement("span");
  info.textContent = text;
  meta.append(copy, info);
  box.append(meta);
}

async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  const area = document.createElement("textarea"); // plain http on another host
  area.value = text;
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}

function numberField(id) {
  const value = $(id).value.trim();
  return value === "" ? null : Number(value);
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history);
  const body = {
    model: $("model").value || undefined,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberField("temperature"),
    top_p: numberField("top_p"),
    max_tokens: numberField("max_tokens"),
    seed: numberField("seed"),
  };
  for (const key of Object.keys(body)) if (body[key] === null) delete body[key];
  return body;
}

// Server-Sent Events from a fetch body: yields each event's data string.
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (data) yield data;
    }
  }
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("prompt").disabled = busy;
}

async function send(text) {
  state.history.push({ role: "user", content: text });
  addMessage("user", text);
  const box = addMessage("assistant", "");
  const body = box.querySelector(".body");
  state.controller = new AbortController();
  setBusy(true);
  let answer = "";
  let usage = null;
  let finish = null;
  let pending = false;
  const started = performance.now();
  let firstAt = null;
  const draw = () => {
    pending = false;
    body.innerHTML = renderMarkdown(answer);
    box.scrollIntoView({ block: "end" });
  };
  try {
    const response = await withKey(() => api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody()),
      signal: state.controller.signal,
    }));
    if (!response.ok) throw new Error(await errorText(response));
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        if (choice.delta && choice.delta.content) {
          if (firstAt === null) firstAt = performance.now();
          answer += choice.delta.content;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      if (!pending) { pending = true; requestAnimationFrame(draw); }
    }
  } catch (error) {
    if (error.name === "AbortError") {
      finish = "stopped";
    } else {
      box.classList.add("error");
      answer += (answer ? "\n\n" : "") + "Error: " + error.message;
      finish = "error";
    }
  } finally {
    state.controller = null;
    setBusy(false);
  }
  draw();
  if (finish === "error") state.history.pop(); // the failed question is not part of the chat
  else state.history.push({ role: "assistant", content: answer }); // a stopped one is, so far
  const seconds = (performance.now() - started) / 1000;
  const parts = [];
  if (usage) parts.push(usage.completion_tokens + " tokens");
  if (usage && seconds > 0) parts.push((usage.completion_tokens / seconds).toFixed(1) + " tok/s");
  if (firstAt !== null) parts.push("first token " + Math.round(firstAt - started) + " ms");
  if (finish) parts.push(finish);
  addMeta(box, parts.join(" · "), answer);
  box.dataset.finish = finish || "";
  $("prompt").focus();
}

function newChat() {
  if (state.controller) state.controller.abort();
  state.history = [];
  $("messages").querySelectorAll(".msg").forEach((m) => m.remove());
  $("empty-hint").hidden = false;
  $("prompt").focus();
}

// ---- server panel -------------------------------------------------------------

function fact(name, value) {
  const dt = document.createElement("dt");
  dt.textContent = name;
  const dd = document.createElement("dd");
  dd.textContent = value;
  return [dt, dd];
}

function showFacts(stats) {
  const s = stats.settings || {};
  const e = stats.engine;
  const cacheTokens = e.kv_blocks_total * e.block_size;
  const rows = [
    ["Backend", stats.backend],
    ["Model", stats.model + (stats.max_model_len ? " (" + stats.max_model_len + " tokens)" : "")],
    ["Block size", e.block_size + " tokens"],
    ["KV cache", e.kv_blocks_total + " blocks = " + cacheTokens + " tokens"],
  ];
  if (s.cache_max_entry_count) rows.push(["KV budget", s.cache_max_entry_count]);
  if (s.quantization) rows.push(["Quantization", s.quantization]);
  if (s.kv_cache_dtype) rows.push(["KV dtype", s.kv_cache_dtype]);
  if (s.device) rows.push(["Device", s.device]);
  $("facts").replaceChildren(...rows.flatMap(([n, v]) => fact(n, String(v))));
}

function push(series, value) {
  series.push(value);
  if (series.length > PLOT_POINTS) series.shift();
}

function plot(id, lists, labels) {
  const figure = $(id);
  const lines = figure.querySelectorAll("polyline");
  const top = Math.max(1e-9, ...lists.flat().filter((v) => v !== null));
  lists.forEach((values, index) => {
    const offset = PLOT_POINTS - values.length; // the newest reading at the right edge
    const points = values.map((v, i) => {
      const x = ((offset + i) / (PLOT_POINTS - 1)) * 120;
      const y = 34 - ((v || 0) / top) * 32;
      return x.toFixed(1) + "," + y.toFixed(1);
    });
    lines[index].setAttribute("points", points.join(" "));
  });
  figure.querySelector(".now").textContent = labels[0];
  if (labels[1] !== undefined) figure.querySelector(".now2").textContent = labels[1];
  figure.dataset.last = lists.map((v) => v[v.length - 1]).join(",");
}

async function refreshStats() {
  let stats;
  try {
    const response = await api("/stats");
    if (!response.ok) throw new Error(await errorText(response));
    stats = await response.json();
  } catch (error) {
    $("server-status").textContent = error instanceof Unauthorized
      ? "The server panel needs the API key."
      : "Server not reachable: " + error.message;
    return;
  }
  $("server-status").textContent = "";
  const previous = state.lastStats;
  state.lastStats = stats;
  if (!previous) { showFacts(stats); return; }
  showFacts(stats);
  const dt = Math.max(1e-3, stats.time - previous.time);
  const tps = (stats.totals.generation_tokens - previous.totals.generation_tokens) / dt;
  const firsts = stats.totals.time_to_first_token_count - previous.totals.time_to_first_token_count;
  if (firsts > 0) {
    const sum = stats.totals.time_to_first_token_seconds_sum - previous.totals.time_to_first_token_seconds_sum;
    state.lastTtftMs = (sum / firsts) * 1000;
  }
  const e = stats.engine;
  const series = state.series;
  push(series.tps, tps);
  push(series.running, e.running);
  push(series.waiting, e.waiting);
  push(series.kv, e.kv_blocks_used);
  push(series.ttft, state.lastTtftMs); // the latest figure, held until a new one
  plot("plot-tps", [series.tps], [tps.toFixed(1)]);
  plot("plot-requests", [series.running, series.waiting], [String(e.running), String(e.waiting)]);
  plot("plot-kv", [series.kv], [e.kv_blocks_used + " / " + e.kv_blocks_total]);
  plot("plot-ttft", [series.ttft],
    [state.lastTtftMs === null ? "–" : Math.round(state.lastTtftMs) + " ms"]);
}

// ---- wiring ---------------------------------------------------------------------

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => {
  if (state.controller) state.controller.abort(); // closes the connection: the server aborts
});
$("new-chat").addEventListener("click", newChat);

loadModels().catch((error) => {
  $("server-status").textContent = "Cannot list models: " + error.message;
});
refreshStats();
setInterval(refreshStats, STATS_EVERY_MS);
