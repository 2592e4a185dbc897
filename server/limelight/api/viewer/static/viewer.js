// Limelight viewer: one vanilla ES module, no dependencies, no build step.
// Every piece of user or model text goes into the page through textContent or
// setAttribute (never parsed as markup), so a text containing HTML renders as text.

const API = "api";
const TOKEN_KEY = "limelight.token";
const POLL_MS = 500;
const POS = [179, 88, 6]; // orange (positive)
const NEG = [33, 102, 172]; // blue (negative)
const MID = [247, 247, 247];

const state = {
  model: null,
  explanation: null, // the last inline explanation (JSON from /api/explain)
  view: "explain",
  level: "tokens",
  scoreSource: "method",
  targetIndex: null,
  runs: [], // compare-methods runs: {job, card}
  timers: {},
  pending: null, // a call to retry after the token is entered
};

// --- small DOM helpers ----------------------------------------------------------------------

function $(id) {
  return document.getElementById(id);
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const SVG_NS = "http://www.w3.org/2000/svg";

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined) continue;
    if (key === "text") node.textContent = value;
    else node.setAttribute(key, String(value));
  }
  for (const child of children.flat()) if (child) node.append(child);
  return node;
}

function fmt(x, digits = 3) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  const s = Number(x).toFixed(digits);
  return x > 0 ? `+${s}` : s;
}

function when(unix) {
  return unix ? new Date(unix * 1000).toLocaleString() : "–";
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  return seconds < 60 ? `${seconds.toFixed(1)} s` : `${(seconds / 60).toFixed(1)} min`;
}

function showError(message) {
  const box = $("error");
  if (!message) {
    box.hidden = true;
    box.textContent = "";
    return;
  }
  box.textContent = message;
  box.hidden = false;
}

// --- the JSON API -----------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function api(path, options = {}) {
  const headers = { Accept: "application/json" };
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  const init = { method: options.method || "GET", headers, cache: "no-store" };
  if (options.body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(options.body);
  }
  const response = await fetch(`${API}/${path}`, init);
  let body = null;
  try {
    body = await response.json();
  } catch {
    body = null;
  }
  if (response.status === 401) {
    $("auth").hidden = false;
    $("auth-token").focus();
  }
  if (!response.ok) {
    const message = body && body.error ? body.error : `HTTP ${response.status}`;
    throw new ApiError(response.status, message);
  }
  return body;
}

async function guarded(action) {
  try {
    showError("");
    return await action();
  } catch (error) {
    if (error instanceof ApiError && error.status === 401) state.pending = action;
    showError(error.message || String(error));
    return null;
  }
}

// --- colours: a diverging blue - white - orange map, plus a sign marker ---------------------

function mix(a, b, t) {
  return a.map((v, i) => Math.round(v + (b[i] - v) * t));
}

/** WCAG relative luminance and contrast ratio of sRGB colours. */
function luminance(rgb) {
  const [r, g, b] = rgb.map((v) => {
    const c = v / 255;
    return c <= 0.04045 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4;
  });
  return 0.2126 * r + 0.7152 * g + 0.0722 * b;
}

function contrast(a, b) {
  const [hi, lo] = [luminance(a), luminance(b)].sort((x, y) => y - x);
  return (hi + 0.05) / (lo + 0.05);
}

const DARK = [27, 27, 27];
const WHITE = [255, 255, 255];

/** A cell's colours: background, the text colour with the better contrast on it, the sign,
 * and whether the text must be bold (large text) to keep WCAG AA: mid-luminance cells
 * offer 4.1:1 at best with either text colour. */
function colour(score, scale) {
  const t = scale > 0 ? Math.min(1, Math.abs(score) / scale) : 0;
  const rgb = mix(MID, score >= 0 ? POS : NEG, t);
  const fg = contrast(rgb, WHITE) > contrast(rgb, DARK) ? WHITE : DARK;
  return {
    background: `rgb(${rgb[0]}, ${rgb[1]}, ${rgb[2]})`,
    foreground: fg === WHITE ? "#ffffff" : "#1b1b1b",
    sign: score > 0 ? "pos" : score < 0 ? "neg" : "zero",
    bold: contrast(rgb, fg) < 4.5,
  };
}

// --- heat-map units: word pieces or words -----------------------------------------------------

function sourceOf(explanation, segment) {
  return segment === 1 && explanation.text_pair ? explanation.text_pair : explanation.text;
}

const codePointCache = new Map();

/** text[start:end] as Python slices it: the server's offsets count code points, where a
 * JavaScript string counts UTF-16 units (an emoji is one of the first and two of the second). */
function sliceChars(text, start, end) {
  let points = codePointCache.get(text);
  if (points === undefined) {
    if (codePointCache.size > 16) codePointCache.clear();
    points = Array.from(text);
    codePointCache.set(text, points);
  }
  return points.slice(start, end).join("");
}

/** Display units: {text, score, segment, start, end, indices, gap} (gap: whitespace before). */
function units(explanation, scores, level) {
  const out = [];
  if (level === "words") {
    for (const word of explanation.words) {
      const score = word.tokens.reduce((sum, i) => sum + (scores[i] || 0), 0);
      out.push({ text: word.text, score, segment: word.segment, start: word.start,
        end: word.end, indices: word.tokens, kind: "word" });
    }
  } else {
    explanation.tokens.forEach((token, i) => {
      if (token.special || token.end <= token.start) return;
      const source = sourceOf(explanation, token.segment);
      out.push({ text: sliceChars(source, token.start, token.end) || token.text, piece: token.text,
        score: scores[i] || 0, segment: token.segment, start: token.start, end: token.end,
        indices: [i], kind: "piece" });
    });
  }
  let previous = null;
  for (const unit of out) {
    if (previous && previous.segment === unit.segment) {
      unit.gap = sliceChars(sourceOf(explanation, unit.segment), previous.end, unit.start);
    } else {
      unit.gap = "";
    }
    unit.newSegment = previous !== null && previous.segment !== unit.segment;
    previous = unit;
  }
  return out;
}

/** The score that colours as white: 0, unless every score has one sign and they are close in
 * size (NormXLogit often is); then the median, so the colours still tell the tokens that
 * matter more than a typical one from those that matter less. */
function centreOf(list) {
  const values = list.map((u) => u.score).filter(Number.isFinite).sort((a, b) => a - b);
  if (values.length < 3 || (values[0] < 0 && values[values.length - 1] > 0)) return 0;
  const top = Math.max(Math.abs(values[0]), Math.abs(values[values.length - 1]));
  if (top === 0 || values[values.length - 1] - values[0] > 0.5 * top) return 0;
  const mid = Math.floor(values.length / 2);
  return values.length % 2 ? values[mid] : (values[mid - 1] + values[mid]) / 2;
}

/** {centre, scale}: colours run from centre - scale (blue) to centre + scale (orange). */
function scaleOf(list) {
  const centre = centreOf(list);
  const scale = list.reduce((m, u) => Math.max(m, Math.abs(u.score - centre)), 0);
  return { centre, scale };
}

function ranks(values) {
  const order = values.map((v, i) => [v, i]).sort((a, b) => a[0] - b[0]);
  const out = new Array(values.length);
  let i = 0;
  while (i < order.length) {
    let j = i;
    while (j + 1 < order.length && order[j + 1][0] === order[i][0]) j += 1;
    const rank = (i + j) / 2 + 1;
    for (let k = i; k <= j; k += 1) out[order[k][1]] = rank;
    i = j + 1;
  }
  return out;
}

/** Spearman's rank correlation (average ranks for ties); null when undefined. */
function spearman(a, b) {
  if (a.length !== b.length || a.length < 2) return null;
  const ra = ranks(a);
  const rb = ranks(b);
  const mean = (a.length + 1) / 2;
  let num = 0;
  let da = 0;
  let db = 0;
  for (let i = 0; i < a.length; i += 1) {
    num += (ra[i] - mean) * (rb[i] - mean);
    da += (ra[i] - mean) ** 2;
    db += (rb[i] - mean) ** 2;
  }
  return da > 0 && db > 0 ? num / Math.sqrt(da * db) : null;
}

// --- rendering a heat-map -------------------------------------------------------------------

function renderHeatmap(container, list, info, label) {
  container.replaceChildren();
  const { centre, scale } = scaleOf(list);
  container.dataset.centre = String(centre);
  const order = list.map((u, i) => [u.score, i]).sort((a, b) => b[0] - a[0]);
  const rankOf = new Map(order.map(([, i], r) => [i, r + 1]));
  const spans = [];
  list.forEach((unit, i) => {
    if (unit.newSegment) container.append(el("span", { class: "seg-break", "aria-hidden": "true" }));
    else if (unit.gap) container.append(document.createTextNode(unit.gap.replace(/\s+/g, " ")));
    const c = colour(unit.score - centre, scale);
    const sign = centre === 0
      ? (c.sign === "pos" ? "positive" : c.sign === "neg" ? "negative" : "zero")
      : (c.sign === "pos" ? "above the median" : c.sign === "neg" ? "below the median" : "median");
    const span = el("span", {
      class: `tok ${c.sign}${unit.kind === "piece" ? " piece" : ""}${c.bold ? " bold" : ""}`,
      role: "listitem",
      tabindex: spans.length === 0 ? "0" : "-1",
      "data-score": String(unit.score),
      "data-index": String(i),
      "aria-label": `${unit.text}: ${fmt(unit.score)} (${sign}), rank ${rankOf.get(i)} of ${list.length}`,
      title: `${fmt(unit.score)}`,
    }, unit.text);
    span.style.backgroundColor = c.background;
    span.style.color = c.foreground;
    const describe = () => {
      if (!info) return;
      const piece = unit.kind === "piece" && unit.piece !== unit.text ? ` [${unit.piece}]` : "";
      info.textContent = `“${unit.text}”${piece} · score ${fmt(unit.score, 4)} · rank ` +
        `${rankOf.get(i)} of ${list.length} · characters ${unit.start}–${unit.end}` +
        (unit.segment === 1 ? " of the pair" : "");
    };
    span.addEventListener("mouseenter", describe);
    span.addEventListener("focus", describe);
    span.addEventListener("keydown", (event) => {
      const step = { ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1 }[event.key];
      const jump = { Home: 0, End: spans.length - 1 }[event.key];
      let next = null;
      if (step !== undefined) next = spans[Math.max(0, Math.min(spans.length - 1, i + step))];
      else if (jump !== undefined) next = spans[jump];
      if (next) {
        event.preventDefault();
        span.tabIndex = -1;
        next.tabIndex = 0;
        next.focus();
      }
    });
    spans.push(span);
    container.append(span);
  });
  if (label) container.setAttribute("aria-label", label);
  return { centre, scale, spans };
}

function flatLegend(centre) {
  return `every token scores ${fmt(centre)}: none stands out`;
}

function renderLegend(container, centre, scale) {
  container.replaceChildren();
  const ramp = el("span", { class: "ramp", "aria-hidden": "true" });
  for (const t of [-1, -0.66, -0.33, 0, 0.33, 0.66, 1]) {
    const c = colour(t, 1);
    const cell = el("span", { class: c.sign });
    cell.style.backgroundColor = c.background;
    ramp.append(cell);
  }
  if (scale === 0) {  // a ramp from -0 to +0 would say nothing (SLALOM's importance of one word)
    container.append(el("span", { class: "meta", text: flatLegend(centre) }));
    return;
  }
  const median = centre !== 0;
  container.append(
    el("span", { text: `${fmt(centre - scale)}${median ? "" : " against"}` }),
    ramp,
    el("span", { text: `${fmt(centre + scale)}${median ? "" : " for the class"}` }),
    el("span", { class: "meta", text: median
      ? `(every score has one sign: white is the median ${fmt(centre)}; orange, solid ` +
        "underline: more than a typical token; blue, dotted: less)"
      : "(blue, dotted underline: against; orange, solid underline: for)" }),
  );
}

// --- Explain ----------------------------------------------------------------------------------

function currentScores() {
  const e = state.explanation;
  if (!e) return [];
  if (state.scoreSource !== "method" && e.extra_scores[state.scoreSource]) {
    return e.extra_scores[state.scoreSource];
  }
  if (e.class_scores && state.targetIndex !== null && e.class_scores[state.targetIndex]) {
    return e.class_scores[state.targetIndex];
  }
  return e.tokens.map((t) => t.score);
}

function renderPrediction(e) {
  const box = $("prediction");
  box.replaceChildren();
  if (state.model && state.model.problem_type === "regression") {
    box.append(el("span", { class: "predicted", text: e.labels[0] || "value" }), el("span"),
      el("span", { class: "predicted", text: fmt(e.probabilities[0], 4) }));
    return;
  }
  const predicted = new Set(e.predicted_labels && e.predicted_labels.length
    ? e.predicted_labels : e.multi_label ? [] : [e.label]);
  e.labels.forEach((label, i) => {
    const p = e.probabilities[i] ?? 0;
    const bar = el("span");
    bar.style.width = `${Math.max(0, Math.min(1, p)) * 100}%`;
    const cls = predicted.has(label) ? "predicted" : "";
    const threshold = e.multi_label && e.thresholds[i] !== undefined
      ? ` (threshold ${(e.thresholds[i] * 100).toFixed(0)} %)` : "";
    box.append(
      el("span", { class: cls, text: predicted.has(label) ? `${label} (predicted)` : label }),
      el("span", { class: "bar", role: "img",
        "aria-label": `${label}: ${(p * 100).toFixed(1)} %${threshold}` }, bar),
      el("span", { class: cls, text: `${(p * 100).toFixed(1)} %` }),
    );
  });
  if (e.multi_label) {
    box.append(el("span", { class: "meta", text: "multi-label: sigmoid per label, predicted " +
      `at or above its threshold (${predicted.size ? [...predicted].join(", ") : "none"})` }));
  }
}

function renderExplanation() {
  const e = state.explanation;
  if (!e) return;
  $("explain-result").hidden = false;
  renderPrediction(e);
  const target = $("target");
  target.replaceChildren(...e.labels.map((l, i) => el("option", { value: String(i), text: l })));
  target.value = String(state.targetIndex ?? e.target_index);
  const scores = $("scores");
  const sources = [["method", `${e.method} (served)`],
    ...Object.keys(e.extra_scores).map((k) => [k, k])];
  scores.replaceChildren(...sources.map(([v, t]) => el("option", { value: v, text: t })));
  if (!sources.some(([v]) => v === state.scoreSource)) state.scoreSource = "method";
  scores.value = state.scoreSource;
  for (const radio of document.querySelectorAll("input[name=level]")) {
    radio.checked = radio.value === state.level;
  }
  const list = units(e, currentScores(), state.level);
  const label = `Heat-map of ${state.level === "words" ? "words" : "word pieces"} for class ` +
    `${e.labels[state.targetIndex ?? e.target_index]}`;
  const { centre, scale } = renderHeatmap($("heatmap"), list, $("token-info"), label);
  renderLegend($("legend"), centre, scale);
  const t = e.timings_ms;
  $("explain-meta").textContent = `method ${e.method} · ${e.tokens.length} tokens` +
    `${truncationNote(e)}${e.windows ? ` in ${e.windows} windows` : ""} · ` +
    `${t.total.toFixed(1)} ms in the sidecar ` +
    `(forward ${t.forward.toFixed(1)} ms) · model ${e.model_name} ${e.model_version}`;
  $("compare-text").textContent = `Text: “${e.text}”` + (e.text_pair ? ` / “${e.text_pair}”` : "");
}

/** " (truncated: the first 1,657 of 2,600 characters explained)", " (truncated)" when the
 * tokens reach the text's end (its pair was cut), or "" for an answer that was not cut. */
function truncationNote(e) {
  if (!e.truncated) return "";
  const n = (x) => x.toLocaleString("en-US");
  return e.explained_chars > 0 && e.explained_chars < e.text_chars
    ? ` (truncated: the first ${n(e.explained_chars)} of ${n(e.text_chars)} characters explained)`
    : " (truncated)";
}

async function explain(options = {}) {
  const text = $("text").value;
  if (!text.trim()) {
    showError("Type a text to explain.");
    return;
  }
  const body = { text };
  const pair = $("pair").value;
  if (pair.trim()) body.text_pair = pair;
  const method = $("method").value;
  if (method) body.method = method;
  if (options.target !== undefined && options.target !== null) body.target_index = options.target;
  $("explain-button").disabled = true;
  const result = await guarded(() => api("explain", { method: "POST", body }));
  $("explain-button").disabled = false;
  if (!result) return;
  state.explanation = result;
  state.targetIndex = result.target_index;
  state.runs = [];
  $("compare-runs").replaceChildren();
  renderExplanation();
  if (!options.keepHash) updateHash();
}

function updateHash() {
  const e = state.explanation;
  const params = new URLSearchParams();
  if (state.view === "explain" && e) {
    params.set("text", e.text);
    if (e.text_pair) params.set("pair", e.text_pair);
    if ($("method").value) params.set("method", $("method").value);
    params.set("target", e.labels[state.targetIndex ?? e.target_index]);
    params.set("level", state.level);
    if (state.scoreSource !== "method") params.set("scores", state.scoreSource);
  } else if (state.view === "compare" && e) {
    params.set("text", e.text);
    if (e.text_pair) params.set("pair", e.text_pair);
    params.set("target", e.labels[state.targetIndex ?? e.target_index]);
    const ids = state.runs.map((r) => r.job.id);
    if (ids.length) params.set("jobs", ids.join(","));
  } else if (state.view === "jobs" && state.openJob) {
    params.set("job", state.openJob);
  }
  const query = params.toString();
  const hash = `#/${state.view}${query ? `?${query}` : ""}`;
  if (location.hash !== hash) history.replaceState(null, "", hash);
}

// --- exports --------------------------------------------------------------------------------

function download(blob, name) {
  const url = URL.createObjectURL(blob);
  const a = el("a", { href: url, download: name });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

function exportTitle() {
  const e = state.explanation;
  const target = e.labels[state.targetIndex ?? e.target_index];
  const source = state.scoreSource === "method" ? e.method : state.scoreSource;
  return `${source} scores for class ${target} (predicted ${e.label}, ` +
    `${(e.probabilities[e.label_index] * 100).toFixed(1)} %)`;
}

/** What an export shows: the Explain view's heat-map unless told otherwise. */
function currentView() {
  return { explanation: state.explanation, scores: currentScores(), level: state.level,
    title: exportTitle() };
}

function heatmapSvg(view = currentView()) {
  const e = view.explanation;
  const list = units(e, view.scores, view.level);
  const { centre, scale } = scaleOf(list);
  const measure = document.createElement("canvas").getContext("2d");
  const font = "16px DejaVu Sans, Arial, sans-serif";
  measure.font = font;
  const width = 880;
  const lineHeight = 30;
  let x = 10;
  let y = 56;
  const items = [];
  for (const unit of list) {
    const w = measure.measureText(unit.text).width + 6;
    if (unit.newSegment || x + w > width - 10) {
      x = 10;
      y += lineHeight + (unit.newSegment ? 10 : 0);
    } else if (unit.gap) {
      x += 6;
    }
    const c = colour(unit.score - centre, scale);
    const group = svg("g", {},
      svg("title", { text: `${unit.text}: ${fmt(unit.score, 4)}` }),
      svg("rect", { x, y: y - 19, width: w, height: 25, rx: 3, fill: c.background }),
      svg("text", { x: x + 3, y, fill: c.foreground, "font-family": font.split(" ").slice(1).join(" "),
        "font-size": 16, "font-weight": c.bold ? 700 : null, text: unit.text }));
    if (c.sign !== "zero") {
      group.append(svg("line", { x1: x, x2: x + w, y1: y + 8, y2: y + 8, "stroke-width": 3,
        stroke: c.sign === "pos" ? "#b35806" : "#2166ac",
        "stroke-dasharray": c.sign === "neg" ? "2 3" : null }));
    }
    items.push(group);
    x += w + 1;
  }
  const height = y + 48;
  const legend = scale === 0 ? flatLegend(centre) : centre === 0
    ? `orange, solid underline: for the class; blue, dotted: against (scale ±${scale.toFixed(4)})`
    : `every score has one sign: white is the median ${fmt(centre, 4)}; orange, solid: more; ` +
      `blue, dotted: less (±${scale.toFixed(4)})`;
  const root = svg("svg", { xmlns: SVG_NS, width, height, viewBox: `0 0 ${width} ${height}` },
    svg("rect", { width, height, fill: "#ffffff" }),
    svg("text", { x: 10, y: 24, "font-family": "DejaVu Sans, Arial, sans-serif", "font-size": 15,
      fill: "#1b1b1b", text: view.title }),
    ...items,
    svg("text", { x: 10, y: height - 12, "font-family": "DejaVu Sans, Arial, sans-serif",
      "font-size": 12, fill: "#555555", text: legend }));
  return new XMLSerializer().serializeToString(root);
}

const EXPORT_CSS = "body{font-family:system-ui,sans-serif;margin:2rem;color:#1b1b1b}" +
  ".h{font-size:1.15rem;line-height:2.3}.t{padding:.1rem .12rem;border-radius:3px;" +
  "border-bottom:3px solid transparent}.pos{border-bottom-color:#b35806}" +
  ".neg{border-bottom:3px dotted #2166ac}.b{font-weight:700}.m{color:#555;font-size:.9rem}";

function heatmapHtml(view = currentView()) {
  // Built as elements (text through textContent) and serialised, which escapes every text.
  const e = view.explanation;
  const title = el("title", { text: `Limelight: ${view.title}` });
  const h1 = el("h1", { text: view.title });
  const box = el("div", { class: "h" });
  const list = units(e, view.scores, view.level);
  const { centre, scale } = scaleOf(list);
  for (const unit of list) {
    if (unit.newSegment) box.append(el("br"));
    else if (unit.gap) box.append(" ");
    const c = colour(unit.score - centre, scale);
    const span = el("span", { class: `t ${c.sign}${c.bold ? " b" : ""}`, title: fmt(unit.score, 4) },
      unit.text);
    span.style.backgroundColor = c.background;
    span.style.color = c.foreground;
    box.append(span);
  }
  const note = el("p", { class: "m", text: (centre === 0
    ? "Orange, solid underline: for the class; blue, dotted: against. "
    : `Every score has one sign: white is the median ${fmt(centre, 4)}; orange, solid ` +
      "underline: more than a typical token; blue, dotted: less. ") +
    `Scale ±${scale.toFixed(4)}. Model ${e.model_name} ${e.model_version}.` });
  return `<!doctype html>\n<html lang="en"><head><meta charset="utf-8">${title.outerHTML}` +
    `<style>${EXPORT_CSS}</style></head><body>${h1.outerHTML}${box.outerHTML}${note.outerHTML}` +
    "</body></html>\n";
}

async function exportPng(view = currentView()) {
  const text = heatmapSvg(view);
  const url = URL.createObjectURL(new Blob([text], { type: "image/svg+xml" }));
  try {
    const image = new Image();
    await new Promise((resolve, reject) => {
      image.onload = resolve;
      image.onerror = () => reject(new Error("the SVG could not be drawn"));
      image.src = url;
    });
    const canvas = document.createElement("canvas");
    canvas.width = image.width * 2;
    canvas.height = image.height * 2;
    const context = canvas.getContext("2d");
    context.scale(2, 2);
    context.drawImage(image, 0, 0);
    const blob = await new Promise((resolve) => canvas.toBlob(resolve, "image/png"));
    download(blob, "limelight-heatmap.png");
  } catch (error) {
    showError(`PNG export failed: ${error.message}`);
  } finally {
    URL.revokeObjectURL(url);
  }
}

/** Download buttons for a heat-map other than the Explain view's (a job's). */
function exportButtons(view, name) {
  const base = `limelight-${name}`;
  return el("div", { class: "row exports" },
    el("button", { type: "button", class: "secondary", text: "Download SVG",
      onclick: () => download(new Blob([heatmapSvg(view())], { type: "image/svg+xml" }), `${base}.svg`) }),
    el("button", { type: "button", class: "secondary", text: "Download HTML",
      onclick: () => download(new Blob([heatmapHtml(view())], { type: "text/html" }), `${base}.html`) }),
    el("button", { type: "button", class: "secondary", text: "Download PNG",
      onclick: () => exportPng(view()) }));
}

// --- Compare methods ----------------------------------------------------------------------------

function jobMethods() {
  return state.model ? state.model.methods.filter((m) => m.cost === "job") : [];
}

function renderParams() {
  const box = $("job-params");
  box.replaceChildren(el("legend", { text: "Parameters" }));
  const method = jobMethods().find((m) => m.name === $("job-method").value);
  $("job-method-info").textContent = method
    ? method.description + (method.unavailable_reason ? ` — unavailable: ${method.unavailable_reason}` : "")
    : "";
  $("compare-submit").disabled = !method || Boolean(method.unavailable_reason) ||
    !state.model.jobs;
  if (!method) return;
  for (const [name, value] of Object.entries(method.defaults)) {
    const id = `param-${name}`;
    let input;
    if (typeof value === "boolean") {
      input = el("input", { id, type: "checkbox", "data-param": name, "data-kind": "bool" });
      input.checked = value;
    } else if (typeof value === "number") {
      input = el("input", { id, type: "number", step: "any", value: String(value),
        "data-param": name, "data-kind": Number.isInteger(value) ? "int" : "float" });
    } else if (typeof value === "string" || value === null) {
      input = el("input", { id, type: "text", value: value ?? "", "data-param": name,
        "data-kind": value === null ? "nullable" : "string", placeholder: value === null ? "default" : "" });
    } else {
      input = el("input", { id, type: "text", value: JSON.stringify(value), "data-param": name,
        "data-kind": "json" });
    }
    box.append(el("div", { class: "param" }, el("label", { for: id, text: name }), input));
  }
}

function readParams() {
  const params = {};
  for (const input of document.querySelectorAll("#job-params [data-param]")) {
    const name = input.dataset.param;
    const kind = input.dataset.kind;
    if (kind === "bool") params[name] = input.checked;
    else if (kind === "int" || kind === "float") {
      const value = Number(input.value);
      if (input.value.trim() === "" || !Number.isFinite(value)) {
        throw new Error(`parameter ${name} must be a finite number`);
      }
      if (kind === "int" && !Number.isInteger(value)) {
        throw new Error(`parameter ${name} must be an integer`);
      }
      params[name] = value;
    } else if (kind === "nullable") {
      if (input.value.trim() !== "") params[name] = input.value;
    } else if (kind === "json") {
      try {
        params[name] = JSON.parse(input.value);
      } catch {
        throw new Error(`parameter ${name} must be JSON`);
      }
    } else params[name] = input.value;
  }
  return params;
}

/** Scores of a job result aligned on the inline explanation's tokens (by character span). */
function aligned(result, inline) {
  const byKey = new Map();
  result.tokens.forEach((t, i) => byKey.set(`${t.segment}:${t.start}:${t.end}:${t.special}`, t.score ?? 0));
  return inline.tokens.map((t) => byKey.get(`${t.segment}:${t.start}:${t.end}:${t.special}`) ?? 0);
}

function inlineScoresFor(targetIndex) {
  const e = state.explanation;
  if (e.class_scores && e.class_scores[targetIndex]) return e.class_scores[targetIndex];
  return e.tokens.map((t) => t.score);
}

function agreement(scoresA, scoresB, level) {
  const e = state.explanation;
  const a = units(e, scoresA, level).map((u) => u.score);
  const b = units(e, scoresB, level).map((u) => u.score);
  return spearman(a, b);
}

function runCard(title) {
  const heat = el("div", { class: "heatmap", role: "list", "aria-label": `Heat-map: ${title}` });
  const info = el("p", { class: "token-info", "aria-live": "polite" });
  const status = el("p", { class: "meta" });
  const progress = el("progress", { max: "1", value: "0", "aria-label": `Progress of ${title}` });
  const agree = el("p", { class: "agreement" });
  const cancel = el("button", { type: "button", class: "secondary", text: "Cancel" });
  const card = el("article", { class: "panel run" }, el("h3", { text: title }), status, progress,
    agree, heat, info, cancel);
  return { card, heat, info, status, progress, agree, cancel };
}

function renderInlineCard() {
  const e = state.explanation;
  const parts = runCard(`${e.method} (inline)`);
  parts.progress.remove();
  parts.cancel.remove();
  parts.card.classList.add("inline-run");
  const target = state.targetIndex ?? e.target_index;
  parts.status.textContent = `class ${e.labels[target]}`;
  renderHeatmap(parts.heat, units(e, inlineScoresFor(target), state.level), parts.info);
  return parts.card;
}

function renderRuns() {
  const box = $("compare-runs");
  box.replaceChildren();
  if (!state.explanation) return;
  box.append(renderInlineCard());
  for (const run of state.runs) box.append(run.parts.card);
}

function updateRun(run) {
  const job = run.job;
  const { parts } = run;
  parts.card.dataset.state = job.state;
  parts.card.dataset.jobId = job.id;
  parts.status.textContent = `${job.state}${job.message ? ` — ${job.message}` : ""}` +
    `${job.duration_s !== null ? ` · ${duration(job.duration_s)}` : ""} · job ${job.id}`;
  parts.progress.value = job.state === "succeeded" ? 1 : job.progress;
  parts.cancel.hidden = job.terminal;
  if (job.error) parts.agree.textContent = `Error: ${job.error}`;
  if (job.result) {
    const e = state.explanation;
    const scores = aligned(job.result, e);
    const rho = agreement(inlineScoresFor(job.result.target_index), scores, state.level);
    parts.agree.textContent = `Spearman ρ vs inline (${state.level === "words" ? "words" : "word pieces"}): ` +
      `${rho === null ? "undefined" : rho.toFixed(3)} · class ${job.result.target_label}`;
    parts.agree.dataset.spearman = rho === null ? "" : String(rho);
    renderHeatmap(parts.heat, units(e, scores, state.level), parts.info);
    parts.progress.remove();
  }
}

async function watchRun(run) {
  while (!run.job.terminal && state.runs.includes(run)) {
    await new Promise((resolve) => setTimeout(resolve, POLL_MS));
    const job = await guarded(() => api(`jobs/${encodeURIComponent(run.job.id)}`));
    if (!job) return;
    run.job = job;
    updateRun(run);
  }
}

function addRun(job) {
  const params = Object.entries(job.params || {}).map(([k, v]) => `${k}=${JSON.stringify(v)}`);
  const parts = runCard(`${job.method}${params.length ? ` (${params.join(", ")})` : ""}`);
  const run = { job, parts };
  parts.cancel.addEventListener("click", () =>
    guarded(async () => {
      run.job = await api(`jobs/${encodeURIComponent(job.id)}/cancel`, { method: "POST", body: {} });
      updateRun(run);
    }));
  state.runs.push(run);
  $("compare-runs").append(parts.card);
  updateRun(run);
  watchRun(run);
}

async function submitCompare() {
  const e = state.explanation;
  if (!e) {
    showError("Explain a text first (Explain section): its text and class are compared here.");
    return;
  }
  let params;
  try {
    params = readParams();
  } catch (error) {
    showError(error.message);
    return;
  }
  const timeout = Number($("job-timeout").value || 0);
  if (!Number.isFinite(timeout) || timeout < 0) {
    showError("The timeout must be a number of seconds, 0 or more.");
    return;
  }
  const body = { method: $("job-method").value, text: e.text, params,
    target_index: state.targetIndex ?? e.target_index, timeout_s: timeout };
  if (e.text_pair) body.text_pair = e.text_pair;
  const job = await guarded(() => api("jobs", { method: "POST", body }));
  if (!job) return;
  if (!$("compare-runs").querySelector(".inline-run")) renderRuns();
  addRun(job);
  updateHash();
}

// --- Jobs ---------------------------------------------------------------------------------------

async function loadJobs() {
  const data = await guarded(() => api("jobs?limit=50"));
  if (!data) return;
  const body = $("jobs-table").querySelector("tbody");
  body.replaceChildren();
  if (!data.jobs.length) {
    body.append(el("tr", {}, el("td", { colspan: "8", text: "No jobs yet: submit one from Compare methods." })));
  }
  for (const job of data.jobs) {
    const open = el("button", { type: "button", class: "secondary", text: "Open",
      "aria-label": `Open job ${job.id}`, onclick: () => openJob(job.id) });
    const cancel = job.terminal ? null : el("button", { type: "button", class: "secondary",
      text: "Cancel", "aria-label": `Cancel job ${job.id}`,
      onclick: () => guarded(async () => {
        await api(`jobs/${encodeURIComponent(job.id)}/cancel`, { method: "POST", body: {} });
        await loadJobs();
      }) });
    body.append(el("tr", { "data-job-id": job.id },
      el("td", {}, el("code", { text: job.id.slice(0, 12) })),
      el("td", { text: job.method }),
      el("td", { class: `state-${job.state}`, text: job.state }),
      el("td", { text: `${Math.round(job.progress * 100)} %` }),
      el("td", { text: when(job.created_at) }),
      el("td", { text: duration(job.duration_s) }),
      el("td", { class: "text", text: job.text }),
      el("td", {}, open, " ", cancel)));
  }
  const active = data.jobs.some((j) => !j.terminal);
  clearTimeout(state.timers.jobs);
  if (active && state.view === "jobs") state.timers.jobs = setTimeout(loadJobs, 2000);
}

async function openJob(id) {
  const job = await guarded(() => api(`jobs/${encodeURIComponent(id)}`));
  if (!job) return;
  state.openJob = id;
  updateHash();
  const box = $("job-detail");
  box.hidden = false;
  const facts = el("dl", { class: "facts" });
  const add = (k, v) => facts.append(el("dt", { text: k }), el("dd", { text: v }));
  add("Job", job.id);
  add("Method", job.method);
  add("State", job.state + (job.message ? ` — ${job.message}` : ""));
  add("Parameters", JSON.stringify(job.params));
  if (job.model_version) {
    // A job runs only on the model it was submitted to (a rollout or a restart fails it).
    const served = state.model && state.model.version !== job.model_version
      ? " — not the model served now: submit the job again" : "";
    add("Model", `${job.model_name} ${job.model_version}${served}`);
  }
  add("Text", job.text);
  if (job.text_pair) add("Pair", job.text_pair);
  add("Created", when(job.created_at));
  add("Duration", duration(job.duration_s));
  if (job.error) add("Error", job.error);
  box.replaceChildren(el("h3", { text: `Job ${job.id}` }), facts);
  if (job.result) {
    const r = job.result;
    const heat = el("div", { class: "heatmap", role: "list", "aria-label": `Heat-map of job ${job.id}` });
    const info = el("p", { class: "token-info", "aria-live": "polite" });
    box.append(el("p", { class: "meta", text: `class ${r.target_label} · predicted ${r.label}` }), heat, info);
    renderHeatmap(heat, units(r, r.tokens.map((t) => t.score), state.level), info);
    const view = () => ({ explanation: r, scores: r.tokens.map((t) => t.score), level: state.level,
      title: `${job.method} scores for class ${r.target_label} (predicted ${r.label}, job ${job.id})` });
    box.append(exportButtons(view, `job-${job.id.slice(0, 12)}`),
      el("button", { type: "button", text: "Compare with the inline explanation",
        onclick: () => compareJob(job) }));
  } else if (!job.terminal) {
    clearTimeout(state.timers.job);
    state.timers.job = setTimeout(() => state.view === "jobs" && state.openJob === id && openJob(id), 1000);
  }
  box.focus();
}

async function compareJob(job) {
  $("text").value = job.text;
  $("pair").value = job.text_pair || "";
  await explain({ target: job.result ? job.result.target_index : null, keepHash: true });
  go("compare");
  renderRuns();
  addRun(job);
  updateHash();
}

// --- Drift --------------------------------------------------------------------------------------

const DASHES = [null, "6 3", "2 3", "8 3 2 3", "1 2"];
const LINE_COLOURS = ["#0b5cad", "#b35806", "#1b6e20", "#6a3d9a", "#4d4d4d"];

function driftChart(report) {
  const width = 720;
  const height = 260;
  const pad = { l: 52, r: 130, t: 12, b: 34 };
  const history = report.history.filter((h) => h.state === "ready");
  const labels = report.labels.map((d) => d.label);
  const maxY = Math.max(report.alert_threshold * 1.5,
    ...history.flatMap((h) => labels.map((l) => h.labels[l] || 0)), 0.001);
  const t0 = history.length ? history[0].t : 0;
  const t1 = history.length > 1 ? history[history.length - 1].t : t0 + 1;
  const X = (t) => pad.l + ((t - t0) / (t1 - t0 || 1)) * (width - pad.l - pad.r);
  const Y = (v) => height - pad.b - (v / maxY) * (height - pad.t - pad.b);
  const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, role: "img",
    "aria-label": `Drift per label over ${history.length} samples; alert threshold ${report.alert_threshold}` });
  root.append(svg("line", { x1: pad.l, x2: pad.l, y1: pad.t, y2: height - pad.b, stroke: "#555" }));
  root.append(svg("line", { x1: pad.l, x2: width - pad.r, y1: height - pad.b, y2: height - pad.b, stroke: "#555" }));
  for (const v of [0, maxY / 2, maxY]) {
    root.append(svg("text", { x: pad.l - 6, y: Y(v) + 4, "text-anchor": "end", text: v.toFixed(3) }));
  }
  root.append(svg("text", { x: pad.l, y: height - 8, text: history.length ? new Date(t0 * 1000).toLocaleTimeString() : "no samples yet" }));
  if (history.length > 1) {
    root.append(svg("text", { x: width - pad.r, y: height - 8, "text-anchor": "end",
      text: new Date(t1 * 1000).toLocaleTimeString() }));
  }
  const thresholdY = Y(report.alert_threshold);
  root.append(svg("line", { x1: pad.l, x2: width - pad.r, y1: thresholdY, y2: thresholdY,
    stroke: "#b00020", "stroke-width": 2, "stroke-dasharray": "10 4", class: "threshold" }));
  root.append(svg("text", { x: width - pad.r - 4, y: thresholdY - 6, "text-anchor": "end",
    fill: "#b00020", text: `alert threshold ${report.alert_threshold}` }));
  labels.forEach((label, k) => {
    // A label with no explanation in the window has no divergence: a gap, not a zero.
    const points = history.filter((h) => !h.counts || h.counts[label] > 0)
      .map((h) => [X(h.t), Y(h.labels[label] || 0)]);
    const stroke = LINE_COLOURS[k % LINE_COLOURS.length];
    if (points.length > 1) {
      root.append(svg("polyline", { points: points.map((p) => p.join(",")).join(" "), fill: "none",
        stroke, "stroke-width": 2, "stroke-dasharray": DASHES[k % DASHES.length], class: "series" }));
    }
    for (const [x, y] of points.slice(-1)) {
      root.append(svg("circle", { cx: x, cy: y, r: 3.5, fill: stroke }));
    }
    // The legend: one row per label with its line style (colour and dash pattern).
    const ly = pad.t + 8 + k * 18;
    root.append(svg("line", { x1: width - pad.r + 6, x2: width - pad.r + 30, y1: ly, y2: ly, stroke,
      "stroke-width": 2, "stroke-dasharray": DASHES[k % DASHES.length] }));
    root.append(svg("text", { x: width - pad.r + 34, y: ly + 4, fill: stroke, text: label }));
  });
  return root;
}

function shiftChart(drift) {
  const shifts = [...drift.risers.map((s) => ({ ...s, up: true })), ...drift.fallers.map((s) => ({ ...s, up: false }))];
  const row = 20;
  const width = 420;
  const height = Math.max(1, shifts.length) * row + 10;
  const mid = 210;
  const maxDelta = Math.max(...shifts.map((s) => Math.abs(s.current_share - s.reference_share)), 1e-9);
  const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", class: "shifts",
    "aria-label": `Tokens whose share of attribution rose or fell for label ${drift.label}` });
  if (!shifts.length) {
    root.append(svg("text", { x: 10, y: 16, text: "no token moved" }));
    return root;
  }
  root.append(svg("line", { x1: mid, x2: mid, y1: 0, y2: height, stroke: "#555" }));
  shifts.forEach((s, i) => {
    const delta = s.current_share - s.reference_share;
    const w = (Math.abs(delta) / maxDelta) * (mid - 90);
    const y = 5 + i * row;
    root.append(svg("g", {},
      svg("title", { text: `${s.token}: ${(s.reference_share * 100).toFixed(2)} % → ${(s.current_share * 100).toFixed(2)} %` }),
      svg("rect", { x: delta >= 0 ? mid : mid - w, y, width: Math.max(w, 1), height: row - 6,
        fill: delta >= 0 ? "#b35806" : "#2166ac", "fill-opacity": 0.35 + 0.65 * Math.min(1, Math.abs(delta) / maxDelta) }),
      svg("text", { x: delta >= 0 ? mid - 6 : mid + 6, y: y + row - 9,
        "text-anchor": delta >= 0 ? "end" : "start", text: `${delta >= 0 ? "▲" : "▼"} ${s.token}` }),
      svg("text", { x: delta >= 0 ? mid + w + 4 : mid - w - 4, y: y + row - 9,
        "text-anchor": delta >= 0 ? "start" : "end", text: `${delta >= 0 ? "+" : "−"}${(Math.abs(delta) * 100).toFixed(2)} pts` })));
  });
  return root;
}

function mixChart(report) {
  const total = report.labels.reduce((s, d) => s + d.window_count, 0);
  const width = 520;
  const row = 24;
  const root = svg("svg", { viewBox: `0 0 ${width} ${report.labels.length * row + 6}`, role: "img",
    class: "small",
    "aria-label": `Predicted-label mix of the current window (${total} explanations)` });
  report.labels.forEach((d, i) => {
    const share = total ? d.window_count / total : 0;
    const y = 3 + i * row;
    root.append(svg("text", { x: 0, y: y + 15, text: d.label }),
      svg("rect", { x: 120, y, width: Math.max(1, share * 300), height: row - 6, fill: "#4d4d4d" }),
      svg("text", { x: 126 + share * 300, y: y + 15, text: `${(share * 100).toFixed(1)} % (${d.window_count})` }));
  });
  return root;
}

async function loadDrift() {
  const report = await guarded(() => api("drift?top_k=8"));
  if (!report) return;
  const alerting = report.labels.filter((d) => d.alert).map((d) => d.label);
  // An empty window (reference still building, or a label no recent answer was predicted as)
  // has nothing to compare: "–", not a divergence of 0 that reads as healthy.
  const compared = report.window_count > 0;
  // While the reference builds, how far along it is: drift is compared only once it is ready.
  const building = report.reference_state === "building" && report.reference_target > 0;
  $("drift-summary").textContent = `reference ${report.reference_state} (${report.reference_count}` +
    `${building ? ` of ${report.reference_target}` : ""} explanations) · window ${report.window_count} · threshold ${report.alert_threshold} · ` +
    (report.sample_rate < 1 ? `observing ${+(report.sample_rate * 100).toPrecision(3)} % of requests · ` : "") +
    `label-mix divergence ${compared ? report.label_mix_divergence.toFixed(4) : "–"} · entropy ` +
    `${report.reference_entropy.toFixed(2)} → ${compared ? report.current_entropy.toFixed(2) : "–"} bits · ` +
    `${alerting.length ? `ALERT: ${alerting.join(", ")}` : "no alert"}`;
  $("drift-chart").replaceChildren(driftChart(report));
  $("drift-labels").replaceChildren(...report.labels.map((d) => el("article",
    { class: `panel card${d.alert ? " alert" : ""}`, "data-label": d.label },
    el("h3", { text: d.label }),
    el("p", {}, d.window_count > 0
      ? `divergence ${d.divergence.toFixed(4)} over ${d.window_count} explanations `
      : "no answer in the window yet: nothing to compare ",
      d.alert ? el("span", { class: "alert-text", text: "— above the threshold" }) : ""),
    shiftChart(d))));
  $("drift-mix").replaceChildren(mixChart(report));
  clearTimeout(state.timers.drift);
  if (state.view === "drift") state.timers.drift = setTimeout(loadDrift, 10000);
}

// --- Model ------------------------------------------------------------------------------------

function renderModel() {
  const m = state.model;
  if (!m) return;
  $("model-badge").textContent = `${m.name} · ${m.architecture} · ${m.runtime} · version ${m.version}`;
  const facts = $("model-facts");
  facts.replaceChildren();
  const add = (k, v) => facts.append(el("dt", { text: k }), el("dd", { text: String(v) }));
  add("Name", m.name);
  add("Version", m.version);
  add("Architecture", `${m.architecture} (${m.num_layers} layers, ${m.num_heads} heads, hidden ${m.hidden_size})`);
  add("Labels", m.labels.join(", "));
  add("Runtime", m.runtime);
  add("Default inline method", m.default_method);
  add("Limits", `${m.max_tokens} tokens, ${m.max_text_chars} characters; jobs up to ${m.job_timeout_max_s} s (default ${m.job_timeout_s} s)`);
  add("Text pairs", m.supports_text_pair ? "supported" : "not supported");
  add("Jobs", m.jobs ? "enabled" : "disabled");
  add("Drift monitor", m.drift ? `enabled (alert above ${m.drift_alert_threshold})` : "disabled");
  add("Authentication", m.auth ? "bearer tokens" : "off");
  add("Server version", m.server_version);
  const body = $("methods-table").querySelector("tbody");
  body.replaceChildren(...m.methods.map((method) => el("tr", { "data-method": method.name },
    el("th", { scope: "row", text: method.name }),
    el("td", { text: method.cost === "inline" ? "inline (every request)" : "job" }),
    el("td", { class: method.unavailable_reason ? "state-failed" : "state-succeeded",
      text: method.unavailable_reason ? `unavailable: ${method.unavailable_reason}` : "available" }),
    el("td", { text: method.description }),
    el("td", {}, el("pre", { class: "json", text: JSON.stringify(method.defaults, null, 1) })))));
  const inline = m.methods.filter((x) => x.cost === "inline");
  $("method").replaceChildren(el("option", { value: "", text: `default (${m.default_method})` }),
    ...inline.map((x) => el("option", { value: x.name, disabled: Boolean(x.unavailable_reason),
      text: x.unavailable_reason ? `${x.name} (unavailable)` : x.name })));
  const jobs = jobMethods();
  $("job-method").replaceChildren(...jobs.map((x) => el("option", { value: x.name,
    text: x.unavailable_reason ? `${x.name} (unavailable)` : x.name })));
  const firstAvailable = jobs.find((x) => !x.unavailable_reason);
  if (firstAvailable) $("job-method").value = firstAvailable.name;
  renderParams();
  $("pair").disabled = !m.supports_text_pair;
  if (!m.jobs) {
    $("compare-submit").disabled = true;
    $("job-method-info").textContent = "Jobs are disabled on this sidecar (LIMELIGHT_JOBS=off).";
  }
}

async function loadModel() {
  const model = await guarded(() => api("model"));
  if (model) {
    state.model = model;
    renderModel();
  }
  return model;
}

// --- navigation and permalinks --------------------------------------------------------------------

const VIEWS = ["explain", "compare", "jobs", "drift", "model"];

function go(view) {
  state.view = VIEWS.includes(view) ? view : "explain";
  for (const name of VIEWS) $(`view-${name}`).hidden = name !== state.view;
  for (const link of document.querySelectorAll("nav a")) {
    if (link.dataset.view === state.view) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  document.title = `Limelight viewer: ${state.view}`;
  clearTimeout(state.timers.jobs);
  clearTimeout(state.timers.drift);
  if (state.view === "jobs") loadJobs();
  if (state.view === "drift") loadDrift();
  if (state.view === "compare") {
    if (!$("compare-runs").children.length) renderRuns();
    $("compare-text").textContent = state.explanation ? $("compare-text").textContent
      : "Explain a text first: its text and class are compared here.";
  }
}

function parseHash() {
  const raw = location.hash.replace(/^#\/?/, "");
  const [view, query] = raw.split("?", 2);
  return { view: view || "explain", params: new URLSearchParams(query || "") };
}

async function applyHash() {
  const { view, params } = parseHash();
  const text = params.get("text");
  if (text) {
    $("text").value = text;
    $("pair").value = params.get("pair") || "";
    if (params.has("method")) $("method").value = params.get("method");
    if (params.has("level")) state.level = params.get("level") === "words" ? "words" : "tokens";
    if (params.has("scores")) state.scoreSource = params.get("scores");
    const labels = state.model ? state.model.labels : [];
    const target = labels.indexOf(params.get("target"));
    await explain({ target: target >= 0 ? target : null, keepHash: true });
  }
  go(view);
  if (view === "compare" && params.get("jobs") && state.explanation) {
    renderRuns();
    for (const id of params.get("jobs").split(",").filter(Boolean)) {
      const job = await guarded(() => api(`jobs/${encodeURIComponent(id)}`));
      if (job) addRun(job);
    }
  }
  if (view === "jobs" && params.get("job")) await openJob(params.get("job"));
}

function wire() {
  $("explain-form").addEventListener("submit", (event) => {
    event.preventDefault();
    explain();
  });
  $("target").addEventListener("change", () => {
    state.targetIndex = Number($("target").value);
    const e = state.explanation;
    if (state.scoreSource !== "method" || !e.class_scores) {
      explain({ target: state.targetIndex });
      return;
    }
    renderExplanation();
    updateHash();
  });
  $("scores").addEventListener("change", () => {
    state.scoreSource = $("scores").value;
    if (state.scoreSource !== "method" && state.targetIndex !== state.explanation.target_index) {
      explain({ target: state.targetIndex });
      return;
    }
    renderExplanation();
    updateHash();
  });
  for (const radio of document.querySelectorAll("input[name=level]")) {
    radio.addEventListener("change", () => {
      state.level = radio.value;
      renderExplanation();
      if (state.runs.length) {
        for (const run of state.runs) updateRun(run);
        const card = $("compare-runs").querySelector(".inline-run");
        if (card) card.replaceWith(renderInlineCard());
      }
      updateHash();
    });
  }
  $("export-svg").addEventListener("click", () =>
    download(new Blob([heatmapSvg()], { type: "image/svg+xml" }), "limelight-heatmap.svg"));
  $("export-html").addEventListener("click", () =>
    download(new Blob([heatmapHtml()], { type: "text/html" }), "limelight-heatmap.html"));
  $("export-png").addEventListener("click", () => exportPng());
  $("permalink").addEventListener("click", async () => {
    updateHash();
    const out = $("permalink-out");
    out.value = location.href;
    out.hidden = false;
    out.select();
    try {
      await navigator.clipboard.writeText(location.href);
      $("token-info").textContent = "Permalink copied to the clipboard.";
    } catch {
      $("token-info").textContent = "Permalink selected: copy it from the box.";
    }
  });
  $("job-method").addEventListener("change", renderParams);
  $("compare-form").addEventListener("submit", (event) => {
    event.preventDefault();
    submitCompare();
  });
  $("jobs-refresh").addEventListener("click", loadJobs);
  $("drift-refresh").addEventListener("click", loadDrift);
  $("auth").addEventListener("submit", async (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("auth-token").value.trim());
    $("auth-token").value = "";
    $("auth").hidden = true;
    const retry = state.pending;
    state.pending = null;
    if (!state.model) await loadModel();
    if (retry) await guarded(retry);
    else if (state.model) await applyHash();
  });
  for (const link of document.querySelectorAll("nav a")) {
    link.addEventListener("click", (event) => {
      event.preventDefault();
      go(link.dataset.view);
      updateHash();
      $("main").focus();
    });
  }
  window.addEventListener("hashchange", () => {
    const { view } = parseHash();
    if (view !== state.view) go(view);
  });
}

// The exports (the buttons download the same) and the page's arithmetic, for scripts and
// tests that drive the page.
window.limelightViewer = Object.freeze({ heatmapSvg, heatmapHtml, spearman, scaleOf, colour,
  contrast, renderLegend, units });

async function main() {
  wire();
  const model = await loadModel();
  if (model) await applyHash();
  else go(parseHash().view);
  document.body.dataset.ready = "true";
}

main();
