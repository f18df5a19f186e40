// The dashboard page: polls /api/view and redraws. Every string a peer provides is put
// in the DOM as text (textContent / createTextNode), never parsed as markup.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
let refreshMs = 2000;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function fixed(value, digits) {
  return value === null || value === undefined ? "-" : Number(value).toFixed(digits);
}

function count(value) {
  return Number(value).toLocaleString("en-US");
}

function ago(seconds) {
  return seconds === null || seconds === undefined ? "now" : `${Math.round(seconds)} s ago`;
}

function chart(times, values, cls, label) {
  const width = 320, height = 90, pad = 4;
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("class", "chart");
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  const points = [];
  for (let i = 0; i < values.length; i++) {
    if (values[i] !== null && Number.isFinite(values[i])) points.push([times[i], values[i]]);
  }
  svg.append(text(6, 12, "start", points.length
    ? `${label}: ${points[points.length - 1][1].toPrecision(4)}`
    : `${label}: no data yet`));
  if (points.length >= 2) {
    const t0 = points[0][0], t1 = points[points.length - 1][0];
    const bottom = Math.min(...points.map((p) => p[1])), top = Math.max(...points.map((p) => p[1]));
    const lo = top === bottom ? bottom - 1 : bottom, hi = top === bottom ? top + 1 : top;
    const xs = (t) => pad + ((t - t0) / Math.max(t1 - t0, 1e-9)) * (width - 2 * pad);
    // the line between the title row (top 20 px) and the min label's row (bottom 16 px)
    const ys = (v) => height - 16 - ((v - lo) / (hi - lo)) * (height - 16 - 20);
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("class", cls);
    line.setAttribute("points", points.map((p) => `${xs(p[0]).toFixed(1)},${ys(p[1]).toFixed(1)}`).join(" "));
    svg.append(line);
    // the range drawn, so a flat-looking line is not read as a flat run
    svg.append(text(width - 6, 12, "end", `max ${top.toPrecision(3)}`));
    svg.append(text(width - 6, height - 4, "end", `min ${bottom.toPrecision(3)}`));
  }
  return svg;
}

function text(x, y, anchor, content) {
  const node = document.createElementNS(SVG, "text");
  node.setAttribute("x", x);
  node.setAttribute("y", y);
  node.setAttribute("text-anchor", anchor);
  node.textContent = content;
  return node;
}

function renderRuns(view, history) {
  const box = document.getElementById("runs");
  box.replaceChildren();
  if (!view.runs.length) box.append(el("p", { class: "muted" }, "no run publishes its status"));
  for (const run of view.runs) {
    const series = (history.series || {})[run.run_id] || { time: [], loss: [], samples_per_second: [] };
    const facts = el("dl", {},
      el("dt", {}, "peers"), el("dd", {}, run.num_peers),
      el("dt", {}, "epoch"), el("dd", {}, run.epoch),
      el("dt", {}, "samples"), el("dd", { class: "run-samples" }, count(run.samples)),
      el("dt", {}, "samples/s"), el("dd", {}, fixed(run.samples_per_second, 1)),
      el("dt", {}, "loss"), el("dd", {}, fixed(run.loss, 4)),
      el("dt", {}, "rounds"), el("dd", {}, run.num_rounds),
      el("dt", {}, "failed rounds"), el("dd", {}, run.num_rounds_failed),
    );
    const card = el("div", { class: "run" }, el("h3", { class: "run-id" }, `run ${run.run_id}`), facts);
    card.dataset.runId = run.run_id;
    card.append(chart(series.time, series.loss, "loss", "loss"));
    card.append(chart(series.time, series.samples_per_second, "rate", "samples/s"));
    box.append(card);
  }
}

function renderPeers(view) {
  const body = document.querySelector("#peers tbody");
  body.replaceChildren();
  for (const peer of view.peers) {
    const roles = peer.runs.map((r) => `run ${r}`);
    if (peer.num_served) roles.push(`serves ${peer.num_served}`);
    const row = el("tr", {},
      el("td", { class: "id" }, peer.peer_id),
      el("td", {}, el("span", { class: `reach reach-${peer.reachability}` }, peer.reachability === "private" ? "behind NAT" : peer.reachability)),
      el("td", {}, ago(peer.seconds_ago)),
      el("td", {}, peer.agent || "-"),
      el("td", {}, roles.join(", ") || "-"),
      el("td", { class: "addr" }, peer.addrs.join(" ")),
    );
    row.dataset.peerId = peer.peer_id;
    body.append(row);
  }
}

function renderServed(view) {
  const box = document.getElementById("pipelines");
  box.replaceChildren();
  if (!view.pipelines.length) box.append(el("p", { class: "muted" }, "no stage server publishes its status"));
  for (const pipe of view.pipelines) {
    const stages = el("div", {});
    pipe.servers.forEach((servers, stage) => {
      const cell = el("span", { class: servers ? "stage" : "stage missing" },
        `stage ${stage}: ${servers}`, el("br", {}), `queued ${pipe.queued[stage]}`);
      stages.append(cell);
    });
    box.append(el("p", {}, `${pipe.uid_prefix}: ${Math.round(pipe.coverage * 100)}% of ${pipe.num_stages} stages served`), stages);
  }
  const body = document.querySelector("#experts tbody");
  body.replaceChildren();
  for (const expert of view.experts) {
    body.append(el("tr", {}, el("td", { class: "id" }, expert.uid), el("td", {}, expert.num_servers),
      el("td", {}, expert.queued), el("td", {}, expert.num_batches)));
  }
}

function renderEvents(history) {
  const list = document.getElementById("events");
  list.replaceChildren();
  // the server keeps a bounded number of events (swarm/dashboard/history.py)
  for (const event of history.events || []) {
    let when = new Date(event.time * 1000).toLocaleTimeString();
    if (event.since && event.since < event.time) {
      when = `${new Date(event.since * 1000).toLocaleTimeString()} to ${when}`;
    }
    list.append(el("li", { class: `ev-${event.kind}` }, `${when}  ${event.text}`));
  }
}

function render(data) {
  const view = data.view;
  if (!view) return;
  const nat = view.peers.filter((p) => p.reachability === "private" || p.reachability === "relayed").length;
  document.getElementById("summary").textContent =
    `${view.peers.length} peers (${nat} behind NAT), ${view.runs.length} runs, ` +
    `${view.pipelines.length} pipelines, ${view.experts.length} experts`;
  document.getElementById("updated").textContent =
    `read at ${new Date(view.time * 1000).toLocaleTimeString()} through ${data.through || "the swarm"}`;
  renderRuns(view, data.history || {});
  renderPeers(view);
  renderServed(view);
  renderEvents(data.history || {});
}

async function poll() {
  try {
    const response = await fetch("/api/view", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const data = await response.json();
    if (data.refresh_seconds) refreshMs = Math.max(500, data.refresh_seconds * 1000);
    render(data);
  } catch (error) {
    document.getElementById("updated").textContent = `cannot read the dashboard process: ${error}`;
  }
  setTimeout(poll, refreshMs);
}

poll();
