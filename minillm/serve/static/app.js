// minillm serve's page: a chat that streams from /v1/chat/completions, and the engine's live state from
// /engine/events (server-sent events). No build step, nothing fetched from outside this server.
"use strict";
const $ = (id) => document.getElementById(id);
const history = [];
let model = "default";

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = localStorage.getItem("minillm-key");
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

async function loadModel() {
  const r = await fetch("/v1/models", { headers: headers() });
  if (r.status === 401) { $("keybox").hidden = false; return; }
  if (r.ok) { model = (await r.json()).data[0].id; $("model").textContent = model; }
}

async function send(text) {
  history.push({ role: "user", content: text });
  bubble("user", text);
  const out = bubble("assistant", "");
  const body = { model, messages: history, stream: true, stream_options: { include_usage: true },
                 max_tokens: Number($("max_tokens").value) || 256 };
  if ($("temperature").value !== "") body.temperature = Number($("temperature").value);
  const t0 = performance.now();
  let first = null, usage = null, reply = "", finish = null;
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body) });
    if (!r.ok) {
      const err = await r.json().catch(() => ({ error: { message: r.statusText } }));
      if (r.status === 401) $("keybox").hidden = false;
      throw new Error(err.error.message);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut); buf = buf.slice(cut + 2);
        if (!event.startsWith("data: ") || event === "data: [DONE]") continue;
        const chunk = JSON.parse(event.slice(6));
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        for (const c of chunk.choices || []) {
          if (c.delta && c.delta.content) {
            if (first === null) first = performance.now();
            reply += c.delta.content;
            out.textContent = reply;
          }
          if (c.finish_reason) finish = c.finish_reason;
        }
      }
    }
    history.push({ role: "assistant", content: reply });
    const meta = document.createElement("span");
    meta.className = "meta";
    const ttft = first === null ? "–" : Math.round(first - t0) + " ms";
    meta.textContent = `first token after ${ttft}` + (usage ? `, ${usage.completion_tokens} tokens` : "") +
      `, ${((performance.now() - t0) / 1000).toFixed(1)} s` + (finish === "length" ? " (cut at max tokens)" : "");
    out.appendChild(meta);
  } catch (e) {
    history.pop();
    out.className = "msg error";
    out.textContent = "error: " + e.message;
  }
}

$("ask").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("input").value.trim();
  if (!text) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("ask").requestSubmit(); }
});
$("reset").addEventListener("click", () => { history.length = 0; $("messages").textContent = ""; });
$("apikey").addEventListener("change", () => { localStorage.setItem("minillm-key", $("apikey").value); loadModel(); });

const COLORS = { u: "#e07b39", c: "#4f8fd6", ".": "#e9edf1" };
function drawPool(pool) {
  const canvas = $("pool"), ctx = canvas.getContext("2d");
  const n = pool.length, w = canvas.width, h = canvas.height;
  const cols = Math.ceil(Math.sqrt(n * w / h)), rows = Math.ceil(n / cols);
  const cw = w / cols, ch = h / rows;
  ctx.clearRect(0, 0, w, h);
  for (let i = 0; i < n; i++) {
    ctx.fillStyle = COLORS[pool[i]];
    ctx.fillRect((i % cols) * cw, Math.floor(i / cols) * ch, Math.max(cw - 1, 1), Math.max(ch - 1, 1));
  }
}

function show(s) {
  $("running").textContent = s.running.length;
  $("waiting").textContent = s.waiting;
  $("tps").textContent = s.tokens_per_step;
  $("steptime").textContent = s.step_ms ? s.step_ms.toFixed(1) : "–";
  $("toks").textContent = s.output_tok_s.toFixed(0);
  $("hit").textContent = s.prefix_hit_rate === null ? "–" : Math.round(100 * s.prefix_hit_rate) + "%";
  $("spec").textContent = s.spec_acceptance === null ? "–" : Math.round(100 * s.spec_acceptance) + "%";
  $("step").textContent = s.step;
  $("poolinfo").textContent = `${s.num_blocks} blocks of ${s.block_size} tokens: ${s.used} in use, ` +
    `${s.cached} cached, ${s.free} free` + (s.pool.length < s.num_blocks ? " (cells group blocks)" : "");
  drawPool(s.pool);
  const list = $("requests");
  list.textContent = "";
  for (const r of s.running) {
    const li = document.createElement("li");
    li.textContent = `${r.id}: ${r.prompt} prompt + ${r.output} generated`;
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.width = Math.min(200, r.output) + "px";
    li.appendChild(bar);
    list.appendChild(li);
  }
}

function watch() {
  const events = new EventSource("/engine/events");
  events.onopen = () => { $("conn").textContent = "live"; $("conn").className = "pill ok"; };
  events.onmessage = (ev) => show(JSON.parse(ev.data));
  events.onerror = () => { $("conn").textContent = "reconnecting…"; $("conn").className = "pill bad"; };
}

loadModel();
watch();
