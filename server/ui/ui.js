// Plait playground: n choices of one chat request, written side by side from one stream.
// Talks to the public API only: GET /v1/models, POST /v1/chat/completions (streamed, read
// with fetch + ReadableStream since it is a POST), GET /metrics (open, Prometheus text).
// No inline code, no eval, no other origin: it runs under the strict CSP /ui is sent with.
"use strict";

const KEY_STORAGE = "plait.api_key";
const METRICS_INTERVAL_MS = 1500;
const $ = (selector, root = document) => root.querySelector(selector);

const ui = {
  form: $("form[data-role=form]"),
  prompt: $("textarea[name=prompt]"),
  apiKey: $("input[name=api_key]"),
  model: $("select[name=model]"),
  stop: $("button[name=stop]"),
  submit: $("button[type=submit]"),
  newChat: $("button[name=new_chat]"),
  sort: $("select[name=sort]"),
  error: $("[data-role=error]"),
  shared: $("[data-role=shared]"),
  choices: $("[data-role=choices]"),
  history: $("[data-role=history]"),
  seedHint: $("[data-role=seed-hint]"),
  copyCurl: $("button[name=copy_curl]"),
  copyPython: $("button[name=copy_python]"),
  copyOutput: $("[data-role=copy-output]"),
  copyStatus: $("[data-role=copy-status]"),
  ops: $("[data-role=ops]"),
};

const state = {
  turns: [],          // [{user, assistant, branches: [text]}]: the conversation so far
  pending: null,      // {user, choices}: the last response, until a choice is continued
  controller: null,   // AbortController of the stream in flight
  lastBody: null,     // the JSON body of the request just sent
};

// ---------------------------------------------------------------- small helpers
function el(tag, attrs = {}, text = null) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  if (text !== null) node.textContent = text;
  return node;
}

function showError(message) {
  ui.error.textContent = message;
  ui.error.hidden = !message;
}

function authHeaders() {
  const key = ui.apiKey.value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function errorMessage(response) {
  let detail = "";
  try {
    detail = (await response.json()).error.message;
  } catch {
    detail = response.statusText;
  }
  if (response.status === 401) {
    const given = ui.apiKey.value.trim() !== "";
    return (given ? "The API key was refused (401): check the API key field. "
                  : "This server needs an API key (401): type it in the API key field. ")
      + detail;
  }
  return `${response.status}: ${detail}`;
}

// ---------------------------------------------------------------- models
async function loadModels() {
  let response;
  try {
    response = await fetch("/v1/models", { headers: authHeaders() });
  } catch (err) {
    showError(`Cannot reach the server: ${err.message}`);
    return;
  }
  if (response.status === 503) {
    showError("The model is still loading; retrying…");
    setTimeout(loadModels, 2000);
    return;
  }
  if (!response.ok) {
    showError(await errorMessage(response));
    return;
  }
  const cards = (await response.json()).data;
  const current = ui.model.value;
  ui.model.replaceChildren(...cards.map((card) => el("option", { value: card.id }, card.id)));
  if (cards.some((card) => card.id === current)) ui.model.value = current;
  showError("");
}

// ---------------------------------------------------------------- the request
function numberField(name) {
  const text = ui.form.elements[name].value.trim();
  return text === "" ? null : Number(text);
}

function stopStrings() {
  return ui.form.elements.stop.value.split(/[\n,]/).map((s) => s.trim()).filter(Boolean);
}

// The request body from the form and the conversation; throws Error with a user message.
function buildBody(userText) {
  const form = ui.form.elements;
  const n = numberField("n") ?? 1;
  if (!Number.isInteger(n) || n < 1 || n > 16) throw new Error("n must be a whole number 1-16.");
  const messages = [];
  if (form.system.value.trim()) messages.push({ role: "system", content: form.system.value });
  for (const turn of state.turns) {
    messages.push({ role: "user", content: turn.user });
    messages.push({ role: "assistant", content: turn.assistant });
  }
  messages.push({ role: "user", content: userText });
  const body = { model: ui.model.value || undefined, messages, n };
  for (const name of ["temperature", "top_p", "max_tokens", "seed"]) {
    const value = numberField(name);
    if (value !== null) {
      if (Number.isNaN(value)) throw new Error(`${name} must be a number.`);
      body[name] = value;
    }
  }
  const stops = stopStrings();
  if (stops.length) body.stop = stops;
  const schemaText = form.json_schema.value.trim();
  if (schemaText) {
    let schema;
    try {
      schema = JSON.parse(schemaText);
    } catch (err) {
      throw new Error(`The JSON schema is not valid JSON: ${err.message}`);
    }
    if (schema === null || typeof schema !== "object" || Array.isArray(schema)) {
      throw new Error("The JSON schema must be a JSON object.");
    }
    body.response_format = { type: "json_schema", json_schema: { name: "schema", schema } };
  }
  if (form.logprobs.checked) body.logprobs = true;
  body.stream = true;
  // continuous_usage_stats (a vLLM extra Plait serves) gives each choice's token count.
  body.stream_options = { include_usage: true, continuous_usage_stats: true };
  return body;
}

// ---------------------------------------------------------------- the columns
function makeColumn(index, seed) {
  const column = el("article", { class: "choice", "data-column": String(index),
                                 "aria-label": `Choice ${index}` });
  const head = el("header");
  head.append(el("h2", {}, `Choice ${index}`));
  if (seed !== null) head.append(el("span", { class: "seed" }, `seed ${seed} + ${index} = ${seed + index}`));
  head.append(el("span", { class: "rank", "data-role": "rank" }));
  const text = el("div", { class: "text", "data-choice": String(index), tabindex: "0" });
  const stats = el("footer", { class: "stats", "data-role": "stats" });
  const cont = el("button", { type: "button", "data-continue": String(index), disabled: "" },
                  "Continue with this choice");
  column.append(head, text, stats, cont);
  return { index, column, text, stats, cont, content: "", tokens: 0, logprob: null,
           finish: null, firstAt: null, lastAt: null };
}

function renderStats(choice, startedAt, withLogprobs) {
  const parts = [choice.finish ? `finish: ${choice.finish}` : "writing…",
                 `${choice.tokens} tokens`];
  if (withLogprobs) {
    parts.push(`cum. logprob ${choice.logprob === null ? "–" : choice.logprob.toFixed(3)}`);
  }
  if (choice.lastAt !== null && choice.tokens > 0) {
    const seconds = (choice.lastAt - startedAt) / 1000;
    if (seconds > 0) parts.push(`${(choice.tokens / seconds).toFixed(1)} tok/s`);
  }
  choice.stats.textContent = parts.join(" · ");
}

function applyOrder(choices) {
  const byLogprob = ui.sort.value === "logprob";
  const ranked = [...choices].sort((a, b) => (b.logprob ?? -Infinity) - (a.logprob ?? -Infinity));
  ranked.forEach((choice, rank) => {
    choice.column.querySelector("[data-role=rank]").textContent =
      choice.logprob === null ? "" : `#${rank + 1} by logprob`;
  });
  const order = byLogprob ? ranked : [...choices].sort((a, b) => a.index - b.index);
  for (const choice of order) ui.choices.append(choice.column);
}

// ---------------------------------------------------------------- the stream
// Yields each `data:` payload of a server-sent event stream, parsed; stops at [DONE].
async function* sseEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
      if (!data) continue;  // a `: ping` comment
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

function renderShared(run, usage) {
  const parts = [];
  const promptTokens = usage?.prompt_tokens ?? run.promptTokens;
  if (promptTokens !== null) {
    parts.push(`Prompt: ${promptTokens} tokens, computed once for ${run.choices.length} `
               + `choice${run.choices.length === 1 ? "" : "s"}`);
  }
  if (usage) {
    parts.push(`cached_tokens: ${usage.prompt_tokens_details?.cached_tokens ?? 0}`);
    parts.push(`completion: ${usage.completion_tokens} tokens`);
  }
  if (run.firstAt !== null) parts.push(`time to first token: ${Math.round(run.firstAt - run.startedAt)} ms`);
  const end = run.endAt ?? performance.now();
  const tokens = run.choices.reduce((sum, c) => sum + c.tokens, 0);
  const seconds = (end - run.startedAt) / 1000;
  if (tokens > 0 && seconds > 0) {
    parts.push(`${(tokens / seconds).toFixed(1)} tok/s in total, `
               + `${(tokens / seconds / run.choices.length).toFixed(1)} per choice`);
  }
  ui.shared.textContent = parts.join(" · ");
}

function onChunk(run, chunk) {
  if (chunk.error) throw new Error(`The server failed mid-stream: ${chunk.error.message}`);
  const now = performance.now();
  for (const delta of chunk.choices ?? []) {
    const choice = run.choices[delta.index];
    if (!choice) continue;
    const content = delta.delta?.content;
    if (content) {
      run.firstAt ??= now;
      choice.content += content;
      choice.text.textContent = choice.content;
      choice.lastAt = now;
    }
    for (const entry of delta.logprobs?.content ?? []) {
      choice.logprob = (choice.logprob ?? 0) + entry.logprob;
    }
    if (chunk.usage) choice.tokens = chunk.usage.completion_tokens;
    if (chunk.usage) run.promptTokens = chunk.usage.prompt_tokens;
    if (delta.finish_reason) {
      choice.finish = delta.finish_reason;
      choice.lastAt ??= now;
      choice.text.setAttribute("data-finish-reason", delta.finish_reason);
    }
    renderStats(choice, run.startedAt, run.logprobs);
  }
  if (chunk.usage && (chunk.choices ?? []).length === 0) run.usage = chunk.usage;
}

async function send(event) {
  event.preventDefault();
  if (state.controller) return;
  const userText = ui.prompt.value;
  if (!userText.trim()) {
    showError("Type a message first.");
    ui.prompt.focus();
    return;
  }
  let body;
  try {
    body = buildBody(userText);
  } catch (err) {
    showError(err.message);
    return;
  }
  showError("");
  ui.copyStatus.textContent = "";
  state.lastBody = body;
  ui.copyCurl.disabled = ui.copyPython.disabled = false;
  const shownKind = ui.copyOutput.getAttribute("data-kind");
  if (shownKind) showCopy(shownKind);  // keep the shown snippet that of this request
  const seed = body.seed ?? null;
  const run = { choices: [], startedAt: performance.now(), firstAt: null, endAt: null,
                usage: null, promptTokens: null, logprobs: Boolean(body.logprobs) };
  for (let i = 0; i < body.n; i++) run.choices.push(makeColumn(i, seed));
  ui.choices.replaceChildren(...run.choices.map((c) => c.column));
  ui.choices.setAttribute("data-n", String(body.n));
  run.choices.forEach((c) => renderStats(c, run.startedAt, run.logprobs));
  ui.shared.textContent = "Waiting for the first token…";
  state.pending = { user: userText, choices: run.choices };
  state.controller = new AbortController();
  setBusy(true);
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", signal: state.controller.signal,
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify(body),
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const chunk of sseEvents(response)) {
      onChunk(run, chunk);
      renderShared(run, run.usage);
    }
  } catch (err) {
    if (err.name === "AbortError") {
      ui.copyStatus.textContent = "Stopped: the server aborts every choice and frees its blocks.";
    } else {
      showError(err.message);
      state.controller.abort();  // close the connection: the server stops the choices
    }
  } finally {
    run.endAt = performance.now();
    renderShared(run, run.usage);
    applyOrder(run.choices);
    for (const choice of run.choices) {
      if (!choice.finish && state.controller?.signal.aborted) {
        choice.finish = "abort";
        choice.text.setAttribute("data-finish-reason", "abort");
      }
      renderStats(choice, run.startedAt, run.logprobs);
      choice.cont.disabled = false;
    }
    state.controller = null;
    setBusy(false);
  }
}

function setBusy(busy) {
  ui.submit.disabled = busy;
  ui.stop.disabled = !busy;
  ui.form.setAttribute("aria-busy", String(busy));
}

// ---------------------------------------------------------------- conversation
function continueWith(index) {
  const pending = state.pending;
  if (!pending || state.controller) return;
  const chosen = pending.choices[index];
  state.turns.push({ user: pending.user, assistant: chosen.content, chosen: index,
                     branches: pending.choices.filter((c) => c !== chosen)
                       .map((c) => ({ index: c.index, text: c.content })) });
  state.pending = null;
  renderHistory();
  ui.choices.replaceChildren();
  ui.shared.textContent = "";
  ui.prompt.value = "";
  ui.prompt.focus();
}

function renderHistory() {
  const items = [];
  state.turns.forEach((turn, t) => {
    const item = el("article", { class: "turn", "data-turn": String(t) });
    item.append(el("h2", {}, "You"), el("p", { class: "msg user" }, turn.user));
    item.append(el("h2", {}, `Assistant (choice ${turn.chosen})`),
                el("p", { class: "msg assistant" }, turn.assistant));
    if (turn.branches.length) {
      const details = el("details", { class: "branches" });
      details.append(el("summary", {}, `${turn.branches.length} other branch`
                                        + `${turn.branches.length === 1 ? "" : "es"}`));
      for (const branch of turn.branches) {
        const b = el("div", { class: "branch" });
        b.append(el("h3", {}, `choice ${branch.index}`), el("p", { class: "msg" }, branch.text));
        details.append(b);
      }
      item.append(details);
    }
    items.push(item);
  });
  ui.history.replaceChildren(...items);
  ui.history.hidden = items.length === 0;
}

function newChat() {
  if (state.controller) state.controller.abort();
  state.turns = [];
  state.pending = null;
  renderHistory();
  ui.choices.replaceChildren();
  ui.shared.textContent = "";
  ui.prompt.focus();
}

// ---------------------------------------------------------------- copy as ...
function shellQuote(text) {
  return `'${text.replaceAll("'", "'\\''")}'`;
}

function curlCommand(body) {
  const lines = [`curl -sN ${shellQuote(`${location.origin}/v1/chat/completions`)}`,
                 "-H 'Content-Type: application/json'"];
  if (ui.apiKey.value.trim()) lines.push('-H "Authorization: Bearer $PLAIT_API_KEY"');
  lines.push(`-d ${shellQuote(JSON.stringify(body, null, 2))}`);
  return lines.join(" \\\n  ");
}

// A JSON value as a Python literal (JSON string escapes are valid Python escapes).
function pyLiteral(value, indent = "") {
  if (value === null || value === undefined) return "None";
  if (value === true) return "True";
  if (value === false) return "False";
  if (typeof value !== "object") return JSON.stringify(value);
  const inner = `${indent}    `;
  if (Array.isArray(value)) {
    if (!value.length) return "[]";
    return `[\n${value.map((v) => inner + pyLiteral(v, inner)).join(",\n")},\n${indent}]`;
  }
  const entries = Object.entries(value);
  if (!entries.length) return "{}";
  return `{\n${entries.map(([k, v]) => `${inner}${JSON.stringify(k)}: ${pyLiteral(v, inner)}`)
    .join(",\n")},\n${indent}}`;
}

function pythonSnippet(body) {
  const key = ui.apiKey.value.trim() ? 'os.environ["PLAIT_API_KEY"]' : '"unused"';
  const args = Object.entries(body).filter(([, v]) => v !== undefined)
    .map(([k, v]) => `    ${k}=${pyLiteral(v, "    ")},`);
  return ["import os", "", "from openai import OpenAI", "",
          `client = OpenAI(base_url=${JSON.stringify(`${location.origin}/v1`)}, api_key=${key})`,
          "stream = client.chat.completions.create(", ...args, ")",
          "for chunk in stream:",
          "    for choice in chunk.choices:",
          "        print(choice.index, repr(choice.delta.content), choice.finish_reason)",
          "    if chunk.usage:",
          "        print(chunk.usage)"].join("\n");
}

function showCopy(kind) {
  const text = kind === "curl" ? curlCommand(state.lastBody) : pythonSnippet(state.lastBody);
  ui.copyOutput.textContent = text;
  ui.copyOutput.hidden = false;
  ui.copyOutput.setAttribute("data-kind", kind);
  return text;
}

async function copy(kind) {
  if (!state.lastBody) return;
  const text = showCopy(kind);
  try {
    if (!navigator.clipboard) throw new Error("no clipboard");
    await navigator.clipboard.writeText(text);
    ui.copyStatus.textContent = "Copied to the clipboard.";
  } catch {
    ui.copyStatus.textContent = "Shown below (the clipboard is not available here).";
  }
}

// ---------------------------------------------------------------- ops strip (/metrics)
// Prometheus text exposition -> {"name{labels}": value}.
function parseMetrics(text) {
  const values = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = /^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?)\s+(\S+)/.exec(line);
    if (match) values[match[1]] = Number(match[2]);
  }
  return values;
}

async function pollMetrics() {
  if (document.visibilityState !== "visible") return;
  try {
    const response = await fetch("/metrics", { cache: "no-store" });
    if (!response.ok) throw new Error(String(response.status));
    const m = parseMetrics(await response.text());
    const show = (name, value) => { $(`[data-metric=${name}]`, ui.ops).textContent = value; };
    const kv = m.plait_kv_cache_usage_perc;
    show("running", m.plait_num_requests_running ?? "–");
    show("waiting", m.plait_num_requests_waiting ?? "–");
    show("kv", kv === undefined ? "–" : `${(kv * 100).toFixed(1)} %`);
    $("[data-metric=kv-meter]", ui.ops).value = kv ?? 0;
    ui.ops.removeAttribute("data-stale");
  } catch {
    ui.ops.setAttribute("data-stale", "true");
  }
}

// ---------------------------------------------------------------- wiring
function updateSeedHint() {
  const seed = numberField("seed");
  const n = numberField("n") ?? 1;
  if (seed === null || Number.isNaN(seed)) {
    ui.seedHint.textContent = "No seed: each choice samples from the engine's own generator.";
    return;
  }
  const shown = Math.min(Math.max(n, 1), 3);
  const examples = Array.from({ length: shown }, (_, i) => `choice ${i} uses seed ${seed + i}`);
  ui.seedHint.textContent = `Choice i uses seed + i: ${examples.join(", ")}${n > 3 ? ", …" : ""}`
    + " (each equals the same request with n=1 and that seed).";
}

function init() {
  ui.apiKey.value = sessionStorage.getItem(KEY_STORAGE) ?? "";
  ui.apiKey.addEventListener("change", () => {
    const key = ui.apiKey.value.trim();
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    else sessionStorage.removeItem(KEY_STORAGE);
    loadModels();
  });
  ui.form.addEventListener("submit", send);
  ui.prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      ui.form.requestSubmit();
    }
  });
  ui.stop.addEventListener("click", () => state.controller?.abort());
  ui.newChat.addEventListener("click", newChat);
  ui.sort.addEventListener("change", () => state.pending && applyOrder(state.pending.choices));
  ui.choices.addEventListener("click", (event) => {
    const button = event.target.closest("button[data-continue]");
    if (button) continueWith(Number(button.getAttribute("data-continue")));
  });
  ui.copyCurl.addEventListener("click", () => copy("curl"));
  ui.copyPython.addEventListener("click", () => copy("python"));
  for (const name of ["seed", "n"]) ui.form.elements[name].addEventListener("input", updateSeedHint);
  updateSeedHint();
  loadModels();
  pollMetrics();
  setInterval(pollMetrics, METRICS_INTERVAL_MS);
  document.addEventListener("visibilitychange", pollMetrics);
}

init();
