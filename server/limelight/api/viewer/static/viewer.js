// Limelight viewer: one vanilla ES module, no dependencies, no build step.
// Every piece of user or model text goes into the page through textContent or
// setAttribute (never parsed as markup), so a text containing HTML renders as text.

const API = "api";
const TOKEN_KEY = "limelight.token";
const POLL_MS = 500;
const RETRY_MAX_MS = 10000; // the longest wait between two tries at an unreachable sidecar
const JOBS_PAGE = 50;
const POS = [179, 88, 6]; // orange (positive)
const NEG = [33, 102, 172]; // blue (negative)
const MID = [247, 247, 247];

const state = {
  model: null,
  explanation: null, // the last inline explanation (JSON from /api/explain)
  explainedMethod: "", // the inline method it was asked for ("": the server's default)
  explainSeq: 0, // the latest explain request: an older answer arriving late is dropped
  applySeq: 0, // the latest address applied
  view: "explain",
  level: "tokens",
  scoreSource: "method",
  targetIndex: null,
  runs: [], // compare-methods runs: {job, parts}
  timers: {},
  openJob: null,
  openSeq: 0, // the latest job opened (or closed): an older answer arriving late is dropped
  jobWatch: null, // the open job's poller (a token: replaced to stop it)
  jobs: { rows: [], next: "", pages: 0 }, // the Jobs table: the rows, the next page's token
  retry: {}, // per view (jobs, drift): the wait before the next try after a failed refresh
  starting: null, // the model's load (and the address applied after it) while it runs
  shown: null, // the address of what the page shows (canonical): events for it are no change
  pending: new Map(), // user-level actions to run again, whole, once a token is entered
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

/** No answer at all: the sidecar is down, restarting, or the network dropped the request. */
class NetworkError extends Error {
  constructor() {
    super("the sidecar is unreachable");
    this.status = 0;
  }
}

/** Whether trying the same request again later may succeed: no answer, or a 5xx from the
 * sidecar or a proxy in front of it (503 while the model loads, 502 while it restarts). */
function retryable(error) {
  return error instanceof NetworkError || (error instanceof ApiError && error.status >= 500);
}

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

/** "retrying in 2 s" for a wait in milliseconds. */
function retryNote(ms) {
  return `retrying in ${+(ms / 1000).toFixed(1)} s`;
}

/** A view's note on its automatic refresh ("" clears it): a failed refresh that is tried
 * again says so there, not in the error banner, and the next refresh that succeeds clears it. */
function refreshNote(view, message) {
  const note = $(`${view}-note`);
  note.textContent = message;
  note.hidden = !message;
}

/** After a refresh of `view` (jobs, drift) that failed with a retryable error: the wait
 * before the next try, doubling from a second up to RETRY_MAX_MS, and the note saying so. */
function retryLater(view, error) {
  const delay = Math.min((state.retry[view] || POLL_MS) * 2, RETRY_MAX_MS);
  state.retry[view] = delay;
  const why = error instanceof NetworkError ? "the sidecar is unreachable" : error.message;
  refreshNote(view, `Not refreshed (${why}): ${retryNote(delay)}.`);
  return delay;
}

/** A refresh of `view` that succeeded (or failed for good): the backoff and the note are
 * over. */
function retryOver(view) {
  delete state.retry[view];
  refreshNote(view, "");
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
  let response;
  try {
    response = await fetch(`${API}/${path}`, init);
  } catch {
    throw new NetworkError();
  }
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

/** Runs a user-level action (load the model and apply the address, explain, run a job, list
 * or open jobs...) and shows its error. On a 401 the whole action is kept under `key` and run
 * again once a token is entered: re-running only its request would drop the answer. */
async function perform(key, action) {
  try {
    showError("");
    return await action();
  } catch (error) {
    if (error instanceof ApiError && error.status === 401) state.pending.set(key, action);
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

/** The bidirectional embeddings, overrides and isolates (U+202A–U+202E, U+2066–U+2069). */
const BIDI_CONTROLS = /[\u202A-\u202E\u2066-\u2069]/g;

/** A text as a heat-map shows it: each bidirectional control as U+FFFD, as the CLI and the
 * SDK show them. One left in would reorder every token after it (an override lasts to the
 * end of the paragraph), so the map would no longer read in the text's order. */
function displayText(text) {
  return text.replace(BIDI_CONTROLS, "\uFFFD");
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
      out.push({ text: displayText(word.text), score, segment: word.segment, start: word.start,
        end: word.end, indices: word.tokens, kind: "word",
        missing: word.tokens.filter((i) => !Number.isFinite(scores[i])).length });
    }
  } else {
    explanation.tokens.forEach((token, i) => {
      if (token.special || token.end <= token.start) return;
      const last = out[out.length - 1];
      if (last && last.segment === token.segment && token.start < last.end) {
        // Pieces of one character (an uncased BERT cuts a Hangul syllable into its letters,
        // each with the syllable's span): one unit, their scores summed, not the syllable thrice.
        last.score += scores[i] || 0;
        last.piece += ` ${displayText(token.text)}`;
        last.indices.push(i);
        if (!Number.isFinite(scores[i])) last.missing += 1;
        return;
      }
      const source = sourceOf(explanation, token.segment);
      out.push({ text: displayText(sliceChars(source, token.start, token.end) || token.text),
        piece: displayText(token.text),
        score: scores[i] || 0, segment: token.segment, start: token.start, end: token.end,
        indices: [i], kind: "piece", missing: Number.isFinite(scores[i]) ? 0 : 1 });
    });
  }
  let previous = null;
  for (const unit of out) {
    if (previous && previous.segment === unit.segment) {
      unit.gap = displayText(sliceChars(sourceOf(explanation, unit.segment), previous.end,
        unit.start));
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
      "aria-label": unit.missing === unit.indices.length
        ? `${unit.text}: no finite score`
        : `${unit.text}: ${fmt(unit.score)} (${sign}), rank ${rankOf.get(i)} of ${list.length}`,
      title: unit.missing === unit.indices.length ? "no finite score (nan or inf)" : fmt(unit.score),
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

/** A line for a map where some tokens score nan or inf (the JSON carries null): drawn white,
 * which would otherwise read as a score of 0. */
function missingNote(list) {
  const missing = list.reduce((n, u) => n + (u.missing || 0), 0);
  const all = list.reduce((n, u) => n + u.indices.length, 0);
  if (!missing) return null;
  return missing === all
    ? "no token has a finite score (nan or inf): this map shows nothing"
    : `${missing} of ${all} tokens have no finite score (nan or inf) and are drawn white`;
}

function renderLegend(container, centre, scale, list = []) {
  container.replaceChildren();
  const note = missingNote(list);
  if (note) {
    container.append(el("span", { class: "meta warn", text: note }));
    if (list.every((u) => u.missing === u.indices.length)) return;
  }
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
  renderLegend($("legend"), centre, scale, list);
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

/** The request for an explanation: of the text box's text unless `options` name the text
 * (a class or score switch explains the text shown, not a draft typed since). */
function explainRequest(options = {}) {
  const text = options.text ?? $("text").value;
  const pair = options.pair ?? $("pair").value;
  const method = options.method ?? $("method").value;
  const body = { text };
  if (pair && pair.trim()) body.text_pair = pair;
  if (method) body.method = method;
  if (options.target !== undefined && options.target !== null) body.target_index = options.target;
  return { body, method: method || "" };
}

/** Explain and show the answer; `history`: "push" (a new entry, Back returns to the previous
 * text), "replace", or "none" (the address is left as it is). Null for an answer overtaken by
 * a later request; errors are thrown (and the explanation shown before is cleared: it is not
 * the one asked for). */
async function explainNow(request, history) {
  const seq = ++state.explainSeq;
  $("explain-button").disabled = true;
  let result;
  try {
    result = await api("explain", { method: "POST", body: request.body });
  } catch (error) {
    // Overtaken by a later request: its failure is no error of what the page shows now.
    if (seq !== state.explainSeq) return null;
    dropExplanation();
    throw error;
  } finally {
    if (seq === state.explainSeq) $("explain-button").disabled = false;
  }
  if (seq !== state.explainSeq) return null;
  state.explanation = result;
  state.explainedMethod = request.method;
  state.targetIndex = result.target_index;
  state.runs = [];
  $("compare-runs").replaceChildren();
  renderExplanation();
  if (history !== "none") updateHash(history);
  return result;
}

/** Explain from the page (the form, a class or score switch). A new text is a new history
 * entry; the first explanation of the page, or another class of the same text, is not. */
function explain(options = {}) {
  const request = explainRequest(options);
  if (!request.body.text.trim()) {
    showError("Type a text to explain.");
    return Promise.resolve(null);
  }
  const history = options.history ?? (state.explanation ? "push" : "replace");
  return perform("explain", () => explainNow(request, history));
}

/** Forget the explanation shown: after a failed explain its heat-map would sit under a text
 * it does not belong to. */
function dropExplanation() {
  state.explanation = null;
  state.runs = [];
  $("compare-runs").replaceChildren();
  $("heatmap").replaceChildren();
  $("legend").replaceChildren();
  $("prediction").replaceChildren();
  $("explain-meta").textContent = "";
  $("explain-result").hidden = true;
  $("compare-text").textContent = "Explain a text first: its text and class are compared here.";
}

function hashOf() {
  const e = state.explanation;
  const params = new URLSearchParams();
  if (state.view === "explain" && e) {
    params.set("text", e.text);
    if (e.text_pair) params.set("pair", e.text_pair);
    if (state.explainedMethod) params.set("method", state.explainedMethod);
    params.set("target", e.labels[state.targetIndex ?? e.target_index]);
    params.set("level", state.level);
    if (state.scoreSource !== "method") params.set("scores", state.scoreSource);
  } else if (state.view === "compare" && e) {
    params.set("text", e.text);
    if (e.text_pair) params.set("pair", e.text_pair);
    if (state.explainedMethod) params.set("method", state.explainedMethod);
    params.set("target", e.labels[state.targetIndex ?? e.target_index]);
    params.set("level", state.level);
    const ids = state.runs.map((r) => r.job.id);
    if (ids.length) params.set("jobs", ids.join(","));
  } else if (state.view === "jobs" && state.openJob) {
    params.set("job", state.openJob);
  }
  const query = params.toString();
  return `#/${state.view}${query ? `?${query}` : ""}`;
}

/** Write what the page shows into the address: "push" for a new history entry (a section, a
 * job opened, a new text explained: Back returns to what was shown before), "replace" for a
 * change of the same view (level, class, scores, a run added). */
function updateHash(mode = "replace") {
  const hash = hashOf();
  state.shown = canonical(hash);
  if (canonical(location.hash) === state.shown) return;
  if (mode === "push") history.pushState(null, "", hash);
  else history.replaceState(null, "", hash);
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

/** What an explanation predicted, for titles: every label a multi-label model predicted
 * ("predicted toxic 98.2 %, insult 95.3 %"), the value of a regression, else the class. */
function predictedText(e) {
  const pct = (i) => `${((e.probabilities[i] ?? 0) * 100).toFixed(1)} %`;
  if (state.model && state.model.problem_type === "regression") {
    return `predicted ${fmt(e.probabilities[0], 4)}`;
  }
  if (e.multi_label) {
    const names = e.predicted_labels || [];
    return names.length
      ? `predicted ${names.map((l) => `${l} ${pct(e.labels.indexOf(l))}`).join(", ")}`
      : "predicted none";
  }
  return `predicted ${e.label}, ${pct(e.label_index)}`;
}

function exportTitle() {
  const e = state.explanation;
  const target = e.labels[state.targetIndex ?? e.target_index];
  const source = state.scoreSource === "method" ? e.method : state.scoreSource;
  return `${source} scores for class ${target} (${predictedText(e)})`;
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

/** Why Run cannot be pressed now, or "" when it can. */
function runBlocked() {
  if (!state.model) return "Waiting for the model to load.";
  if (!state.model.jobs) return "Jobs are disabled on this sidecar (LIMELIGHT_JOBS=off).";
  const jobs = jobMethods();
  if (!jobs.length) return "This model has no job methods.";
  const method = jobs.find((m) => m.name === $("job-method").value);
  if (!method) return "Pick a job method.";
  if (method.unavailable_reason) return `${method.name} is unavailable on this model.`;
  return "";
}

function renderParams() {
  const box = $("job-params");
  box.replaceChildren(el("legend", { text: "Parameters" }));
  const method = jobMethods().find((m) => m.name === $("job-method").value);
  $("job-method-info").textContent = method
    ? method.description + (method.unavailable_reason ? ` — unavailable: ${method.unavailable_reason}` : "")
    : runBlocked();
  $("compare-submit").disabled = Boolean(runBlocked());
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
  const legend = el("div", { class: "legend" });
  const status = el("p", { class: "meta" });
  const progress = el("progress", { max: "1", value: "0", "aria-label": `Progress of ${title}` });
  const agree = el("p", { class: "agreement" });
  const cancel = el("button", { type: "button", class: "secondary", text: "Cancel" });
  const card = el("article", { class: "panel run" }, el("h3", { text: title }), status, progress,
    agree, heat, info, legend, cancel);
  return { card, heat, info, legend, status, progress, agree, cancel };
}

/** A heat-map with its colour legend (each card has its own scale). */
function renderMap(heat, info, legend, list, label) {
  const { centre, scale } = renderHeatmap(heat, list, info, label);
  renderLegend(legend, centre, scale, list);
}

function renderInlineCard() {
  const e = state.explanation;
  const parts = runCard(`${e.method} (inline)`);
  parts.progress.remove();
  parts.cancel.remove();
  parts.card.classList.add("inline-run");
  const target = state.targetIndex ?? e.target_index;
  parts.status.textContent = `class ${e.labels[target]}`;
  renderMap(parts.heat, parts.info, parts.legend, units(e, inlineScoresFor(target), state.level));
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
    `${job.duration_s !== null ? ` · ${duration(job.duration_s)}` : ""} · job ${job.id}` +
    (run.note ? ` · ${run.note}` : "");
  if (run.note) parts.status.dataset.note = run.note;
  else delete parts.status.dataset.note;
  parts.progress.value = job.state === "succeeded" ? 1 : job.progress;
  parts.cancel.hidden = job.terminal || Boolean(run.gone);
  if (job.error) parts.agree.textContent = `Error: ${job.error}`;
  if (job.result) {
    const e = state.explanation;
    const scores = aligned(job.result, e);
    const rho = agreement(inlineScoresFor(job.result.target_index), scores, state.level);
    parts.agree.textContent = `Spearman ρ vs inline (${state.level === "words" ? "words" : "word pieces"}): ` +
      `${rho === null ? "undefined" : rho.toFixed(3)} · class ${job.result.target_label}`;
    parts.agree.dataset.spearman = rho === null ? "" : String(rho);
    renderMap(parts.heat, parts.info, parts.legend, units(e, scores, state.level));
    parts.progress.remove();
  }
}

/** Poll a run until its job ends. No answer or a 5xx (a sidecar restarting, a network blip)
 * is waited out with backoff, the card saying so; only a 404 (the job is gone) or a 401
 * (polling goes on once a token is entered) stops it early. */
async function watchRun(run) {
  let delay = POLL_MS;
  while (!run.job.terminal && state.runs.includes(run)) {
    await sleep(delay);
    if (!state.runs.includes(run)) return;
    try {
      run.job = await api(`jobs/${encodeURIComponent(run.job.id)}`);
      run.note = "";
      delay = POLL_MS;
    } catch (error) {
      if (error instanceof ApiError && error.status === 404) {
        run.gone = true;
        run.note = "the job is no longer on the sidecar (expired, or lost in a restart)";
        updateRun(run);
        return;
      }
      if (error instanceof ApiError && error.status === 401) {
        run.note = "waiting for a bearer token";
        updateRun(run);
        state.pending.set(`watch:${run.job.id}`, () => {
          watchRun(run); // not awaited: the other actions kept for the token go on
        });
        return;
      }
      if (!retryable(error)) {
        run.note = `polling stopped: ${error.message}`;
        updateRun(run);
        return;
      }
      delay = Math.min(delay * 2, RETRY_MAX_MS);
      const why = error instanceof NetworkError ? "" : ` (${error.message})`;
      run.note = `sidecar unreachable, retrying${why}: next try in ${+(delay / 1000).toFixed(1)} s`;
    }
    updateRun(run);
  }
}

function addRun(job) {
  const params = Object.entries(job.params || {}).map(([k, v]) => `${k}=${JSON.stringify(v)}`);
  const parts = runCard(`${job.method}${params.length ? ` (${params.join(", ")})` : ""}`);
  const run = { job, parts, note: "" };
  parts.cancel.addEventListener("click", () =>
    perform(`cancel:${job.id}`, async () => {
      run.job = await api(`jobs/${encodeURIComponent(job.id)}/cancel`, { method: "POST", body: {} });
      updateRun(run);
    }));
  state.runs.push(run);
  $("compare-runs").append(parts.card);
  updateRun(run);
  watchRun(run);
}

/** A fresh idempotency key: one per press of Run, so that sending the same submission again
 * (a lost answer, a token entered after a 401) never queues a second job. */
function idempotencyKey() {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return `viewer-${Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("")}`;
}

/** POST a job, sent again (same body, same idempotency key) while the sidecar does not
 * answer or answers 5xx: at most 4 tries. */
async function postJob(body) {
  let delay = POLL_MS;
  for (let attempt = 1; ; attempt += 1) {
    try {
      return await api("jobs", { method: "POST", body });
    } catch (error) {
      if (!retryable(error) || attempt >= 4) throw error;
      showError(`Submitting the job: ${error.message}; ${retryNote(delay)}.`);
      await sleep(delay);
      delay *= 2;
    }
  }
}

function submitCompare() {
  const e = state.explanation;
  if (!e) {
    showError("Explain a text first (Explain section): its text and class are compared here.");
    return null;
  }
  const blocked = runBlocked();
  if (blocked) {
    showError(blocked);
    return null;
  }
  let params;
  try {
    params = readParams();
  } catch (error) {
    showError(error.message);
    return null;
  }
  const timeout = Number($("job-timeout").value || 0);
  if (!Number.isFinite(timeout) || timeout < 0) {
    showError("The timeout must be a number of seconds, 0 or more.");
    return null;
  }
  const body = { method: $("job-method").value, text: e.text, params,
    target_index: state.targetIndex ?? e.target_index, timeout_s: timeout,
    idempotency_key: idempotencyKey() };
  if (e.text_pair) body.text_pair = e.text_pair;
  return perform("compare", async () => {
    // Off while the job is being queued: a second press would queue a second job.
    $("compare-submit").disabled = true;
    try {
      const job = await postJob(body);
      showError("");
      if (state.explanation !== e) return job; // another text was explained meanwhile
      if (!$("compare-runs").querySelector(".inline-run")) renderRuns();
      addRun(job);
      updateHash();
      return job;
    } finally {
      $("compare-submit").disabled = Boolean(runBlocked());
    }
  });
}

// --- Jobs ---------------------------------------------------------------------------------------

/** The Jobs table: the first page, or with `more` the next one added below. An automatic
 * refresh reads as many pages again as are shown (the pages are cursors: none repeats). */
async function listJobs({ more = false, pages = 1 } = {}) {
  const rows = more ? [...state.jobs.rows] : [];
  let token = more ? state.jobs.next : "";
  let read = more ? state.jobs.pages : 0;
  const want = more ? read + 1 : Math.max(1, pages);
  try {
    do {
      const page = token ? `&page_token=${encodeURIComponent(token)}` : "";
      const data = await api(`jobs?limit=${JOBS_PAGE}${page}`);
      rows.push(...data.jobs);
      token = data.next_page_token || "";
      read += 1;
    } while (read < want && token);
  } catch (error) {
    // A sidecar restarting or a network blip: while the table has unfinished jobs (or shows
    // nothing yet), the refresh goes on with backoff, saying so above the table (a view left
    // meanwhile is listed again when it is opened).
    if (more) throw error;
    const watched = !state.jobs.pages || state.jobs.rows.some((j) => !j.terminal);
    if (!retryable(error) || !watched) {
      retryOver("jobs");
      throw error;
    }
    if (state.view === "jobs") scheduleJobs(retryLater("jobs", error));
    return;
  }
  state.jobs = { rows, next: token, pages: read };
  retryOver("jobs");
  renderJobs();
  const active = rows.some((j) => !j.terminal);
  clearTimeout(state.timers.jobs);
  if (active) scheduleJobs(2000);
}

/** The Jobs table's next automatic refresh, `delay` ms from now, while the view is open. */
function scheduleJobs(delay) {
  clearTimeout(state.timers.jobs);
  if (state.view !== "jobs") return;
  state.timers.jobs = setTimeout(() =>
    perform("jobs", () => listJobs({ pages: state.jobs.pages })), delay);
}

function loadJobs() {
  return perform("jobs", () => listJobs());
}

function moreJobs() {
  return perform("jobs-more", () => listJobs({ more: true }));
}

function renderJobs() {
  const { rows, next } = state.jobs;
  const body = $("jobs-table").querySelector("tbody");
  body.replaceChildren();
  if (!rows.length) {
    body.append(el("tr", {}, el("td", { colspan: "8", text: "No jobs yet: submit one from Compare methods." })));
  }
  for (const job of rows) {
    const open = el("button", { type: "button", class: "secondary", text: "Open",
      "aria-label": `Open job ${job.id}`, onclick: () => openJob(job.id) });
    const cancel = job.terminal ? null : el("button", { type: "button", class: "secondary",
      text: "Cancel", "aria-label": `Cancel job ${job.id}`,
      onclick: () => perform(`cancel:${job.id}`, async () => {
        await api(`jobs/${encodeURIComponent(job.id)}/cancel`, { method: "POST", body: {} });
        await listJobs({ pages: state.jobs.pages });
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
  $("jobs-more").hidden = !next;
  $("jobs-count").textContent = `${rows.length} job${rows.length === 1 ? "" : "s"} shown` +
    (next ? "; older ones follow" : "");
}

/** Open a job from the Jobs table (a new history entry: Back closes it again). */
function openJob(id) {
  return perform("job", () => showJob(id, "push"));
}

async function showJob(id, history) {
  const seq = ++state.openSeq;
  let job;
  try {
    job = await api(`jobs/${encodeURIComponent(id)}`);
  } catch (error) {
    if (seq !== state.openSeq) return null; // overtaken: not an error of what is shown
    throw error;
  }
  // Another job opened since (or this one closed): the last one asked for is shown, and its
  // history entry is the last.
  if (seq !== state.openSeq) return null;
  state.openJob = id;
  if (history !== "none") updateHash(history);
  renderJob(job);
  $("job-detail").focus();
  const watch = {};
  state.jobWatch = watch;
  if (!job.terminal) watchOpenJob(id, watch);
  return job;
}

function closeJob() {
  state.openSeq += 1; // a job still being fetched is not shown
  state.openJob = null;
  state.jobWatch = null;
  $("job-detail").hidden = true;
  $("job-detail").replaceChildren();
}

/** Refresh an open job until it ends, waiting out an unreachable sidecar with backoff. */
async function watchOpenJob(id, watch) {
  const watching = () => state.jobWatch === watch && state.openJob === id && state.view === "jobs";
  let delay = 1000;
  while (watching()) {
    await sleep(delay);
    if (!watching()) return;
    try {
      const job = await api(`jobs/${encodeURIComponent(id)}`);
      if (!watching()) return;
      renderJob(job);
      if (job.terminal) return;
      delay = 1000;
    } catch (error) {
      const note = $("job-detail").querySelector(".job-note");
      if (!retryable(error)) {
        if (note) note.textContent = `Not refreshed: ${error.message}`;
        return;
      }
      delay = Math.min(delay * 2, RETRY_MAX_MS);
      if (note) note.textContent = `sidecar unreachable, retrying: next try in ${+(delay / 1000).toFixed(1)} s`;
    }
  }
}

function renderJob(job) {
  const box = $("job-detail");
  box.hidden = false;
  box.dataset.jobId = job.id;
  box.dataset.state = job.state;
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
  box.replaceChildren(el("h3", { text: `Job ${job.id}` }), facts,
    el("p", { class: "meta job-note", "aria-live": "polite" }));
  if (job.result) {
    const r = job.result;
    const heat = el("div", { class: "heatmap", role: "list", "aria-label": `Heat-map of job ${job.id}` });
    const info = el("p", { class: "token-info", "aria-live": "polite" });
    const legend = el("div", { class: "legend" });
    box.append(el("p", { class: "meta", text: `class ${r.target_label} · ${predictedText(r)}` }),
      heat, info, legend);
    renderMap(heat, info, legend, units(r, r.tokens.map((t) => t.score), state.level));
    const view = () => ({ explanation: r, scores: r.tokens.map((t) => t.score), level: state.level,
      title: `${job.method} scores for class ${r.target_label} (${predictedText(r)}, job ${job.id})` });
    box.append(exportButtons(view, `job-${job.id.slice(0, 12)}`),
      el("button", { type: "button", text: "Compare with the inline explanation",
        onclick: () => perform("compare-job", () => compareJob(job)) }));
  }
}

async function compareJob(job) {
  $("text").value = job.text;
  $("pair").value = job.text_pair || "";
  $("method").value = "";
  const request = explainRequest({ text: job.text, pair: job.text_pair || "", method: "",
    target: job.result ? job.result.target_index : null });
  if (!(await explainNow(request, "none"))) return;
  go("compare");
  renderRuns();
  addRun(job);
  updateHash("push");
}

// --- Drift --------------------------------------------------------------------------------------

/** Label text for a chart: measured in the charts' font (12 px, see viewer.css), and cut with
 * "…" when wider than `max` user units. {text, width, cut}. */
function fitLabel(label, max) {
  if (!fitLabel.context) {
    fitLabel.context = document.createElement("canvas").getContext("2d");
  }
  const context = fitLabel.context;
  context.font = `12px ${getComputedStyle(document.body).fontFamily}`;
  const width = (s) => context.measureText(s).width;
  if (width(label) <= max) return { text: label, width: width(label), cut: false };
  const chars = Array.from(label);
  let lo = 0;
  let hi = chars.length;
  while (lo < hi) {
    const mid = Math.ceil((lo + hi) / 2);
    if (width(`${chars.slice(0, mid).join("")}…`) <= max) lo = mid;
    else hi = mid - 1;
  }
  const text = `${chars.slice(0, lo).join("").trimEnd()}…`;
  return { text, width: width(text), cut: true };
}

/** A chart label: cut to fit, the whole label as its tooltip (<title>). */
function chartLabel(fit, label, attrs) {
  return svg("g", { class: "chart-label" }, svg("title", { text: label }),
    svg("text", { ...attrs, text: fit.text, "data-cut": fit.cut ? "true" : null }));
}

const DASHES = [null, "6 3", "2 3", "8 3 2 3", "1 2"];
const LINE_COLOURS = ["#0b5cad", "#b35806", "#1b6e20", "#6a3d9a", "#4d4d4d"];

function driftChart(report) {
  const width = 720;
  const height = 260;
  const history = report.history.filter((h) => h.state === "ready");
  const labels = report.labels.map((d) => d.label);
  // The legend's column is as wide as its longest label, up to 200 units (longer ones are cut).
  const fits = labels.map((l) => fitLabel(l, 200));
  const pad = { l: 52, r: 34 + Math.max(40, ...fits.map((f) => f.width)) + 8, t: 12, b: 34 };
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
    // So has one with too few explanations to be compared yet (null).
    const points = history.filter((h) => (!h.counts || h.counts[label] > 0) && h.labels[label] != null)
      .map((h) => [X(h.t), Y(h.labels[label])]);
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
    root.append(chartLabel(fits[k], label, { x: width - pad.r + 34, y: ly + 4, fill: stroke }));
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
  const row = 24;
  const bar = 300;
  // Labels in a column as wide as the longest (up to 180 units, longer ones cut), bars after it.
  const fits = report.labels.map((d) => fitLabel(d.label, 180));
  const x0 = Math.ceil(Math.max(40, ...fits.map((f) => f.width))) + 10;
  const width = x0 + bar + 110;
  const root = svg("svg", { viewBox: `0 0 ${width} ${report.labels.length * row + 6}`, role: "img",
    class: "small",
    "aria-label": `Predicted-label mix of the current window (${total} explanations)` });
  report.labels.forEach((d, i) => {
    const share = total ? d.window_count / total : 0;
    const y = 3 + i * row;
    root.append(svg("g", { class: "mix-row", "data-label": d.label },
      chartLabel(fits[i], d.label, { x: 0, y: y + 15 }),
      svg("rect", { x: x0, y, width: Math.max(1, share * bar), height: row - 6, fill: "#4d4d4d" }),
      svg("text", { x: x0 + 6 + share * bar, y: y + 15,
        text: `${(share * 100).toFixed(1)} % (${d.window_count})` })));
  });
  return root;
}

function loadDrift() {
  return perform("drift", showDrift);
}

/** Why a label has no divergence: nothing in the window, nothing of it in the reference, or
 * too few explanations on either side to tell drift from sampling noise. */
function notCompared(report, d) {
  if (d.window_count === 0) return "no answer in the window yet: nothing to compare ";
  const least = report.min_count || 0;
  if (least && d.reference_count > 0) {
    if (report.reference_state === "ready" && d.reference_count < least) {
      // A ready reference no longer grows: waiting does not help.
      return `never compared against this reference: ${d.reference_count} explanations in it; ` +
        `a label needs ${least} in each (rebuild the reference with more texts of it) `;
    }
    if (d.window_count >= least) {
      return `not compared: fewer than ${least} of its explanations carry positive attribution `;
    }
    return `not compared yet: ${d.window_count} explanations in the window, ` +
      `${d.reference_count} in the reference; a label needs ${least} in each `;
  }
  return "no explanation in the reference was predicted as this label: nothing to compare with ";
}

// A mean entropy, or "–" where there is none (null: no explanation of positive mass yet).
const bits = (x) => (x != null ? x.toFixed(2) : "–");

async function showDrift() {
  let report;
  try {
    report = await api("drift?top_k=8");
  } catch (error) {
    // A sidecar restarting or a network blip: the refresh goes on with backoff, saying so
    // (a view left meanwhile loads again when it is opened).
    if (!retryable(error)) {
      retryOver("drift");
      throw error;
    }
    if (state.view === "drift") scheduleDrift(retryLater("drift", error));
    return;
  }
  retryOver("drift");
  const alerting = report.labels.filter((d) => d.alert).map((d) => d.label);
  // An empty window (reference still building, or a label no recent answer was predicted as)
  // has nothing to compare: "–", not a divergence of 0 that reads as healthy.
  const compared = report.window_count > 0;
  // While the reference builds, how far along it is: drift is compared only once it is ready.
  const building = report.reference_state === "building" && report.reference_target > 0;
  $("drift-summary").textContent = `reference ${report.reference_state} (${report.reference_count}` +
    `${building ? ` of ${report.reference_target}` : ""} explanations) · window ${report.window_count} · threshold ${report.alert_threshold} · ` +
    (report.sample_rate < 1 ? `observing ${+(report.sample_rate * 100).toPrecision(3)} % of requests · ` : "") +
    `label-mix divergence ${compared && report.label_mix_divergence != null ? report.label_mix_divergence.toFixed(4) : "–"} · entropy ` +
    `${bits(report.reference_entropy)} → ${compared ? bits(report.current_entropy) : "–"} bits · ` +
    `${alerting.length ? `ALERT: ${alerting.join(", ")}` : "no alert"}`;
  $("drift-chart").replaceChildren(driftChart(report));
  $("drift-labels").replaceChildren(...report.labels.map((d) => el("article",
    { class: `panel card${d.alert ? " alert" : ""}`, "data-label": d.label },
    el("h3", { text: d.label }),
    el("p", {}, d.window_count > 0 && d.divergence != null
      ? `divergence ${d.divergence.toFixed(4)} over ${d.window_count} explanations `
      : notCompared(report, d),
      d.alert ? el("span", { class: "alert-text", text: "— above the threshold" }) : ""),
    shiftChart(d))));
  $("drift-mix").replaceChildren(mixChart(report));
  scheduleDrift(10000);
}

/** The Drift view's next automatic refresh, `delay` ms from now, while the view is open. */
function scheduleDrift(delay) {
  clearTimeout(state.timers.drift);
  if (state.view === "drift") state.timers.drift = setTimeout(loadDrift, delay);
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

/** GET the model, tried again with backoff (half a second, doubling up to 10 s) while the
 * sidecar answers 503 (the model is still loading) or does not answer (starting, restarting):
 * a page opened early shows the model once it is there, without a reload. */
async function loadModel() {
  let delay = 500;
  for (;;) {
    try {
      const model = await api("model");
      state.model = model;
      renderModel();
      showError("");
      return model;
    } catch (error) {
      if (!retryable(error)) throw error;
      const why = error instanceof NetworkError ? "The sidecar is unreachable"
        : `The sidecar is not ready: ${error.message}`;
      showError(`${why}; ${retryNote(delay)}.`);
      await sleep(delay);
      delay = Math.min(delay * 2, RETRY_MAX_MS);
    }
  }
}

/** Load the model, then show what the address asks for (a deep link, a permalink); one
 * start at a time. */
function start() {
  if (!state.starting) {
    state.starting = perform("model", async () => {
      await loadModel();
      await applyHash();
    }).finally(() => {
      state.starting = null;
    });
  }
  return state.starting;
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
  for (const name of ["jobs", "drift"]) retryOver(name); // a view opened again starts afresh
  // Until the model is loaded these would only be refused: they load with it.
  if (state.view === "jobs" && state.model) loadJobs();
  if (state.view === "drift" && state.model) loadDrift();
  if (state.view === "compare") {
    if (!$("compare-runs").children.length) renderRuns();
    if (!state.explanation) {
      $("compare-text").textContent = "Explain a text first: its text and class are compared here.";
    }
  }
}

function parseHash(hash = location.hash) {
  const raw = hash.replace(/^#\/?/, "");
  const cut = raw.indexOf("?");
  const view = cut < 0 ? raw : raw.slice(0, cut);
  const query = cut < 0 ? "" : raw.slice(cut + 1);
  return { view: VIEWS.includes(view) ? view : "explain", params: new URLSearchParams(query) };
}

/** An address in one spelling (parameters sorted, empty ones left out), to tell whether two
 * addresses ask for the same view. */
function canonical(hash) {
  const { view, params } = parseHash(hash);
  const entries = [...params].filter(([, v]) => v !== "").sort((a, b) =>
    (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : a[1] < b[1] ? -1 : a[1] > b[1] ? 1 : 0));
  return `${view}?${new URLSearchParams(entries)}`;
}

/** Show what the address asks for: its text explained (again only when the page does not
 * show that explanation already), its class, scores and level, its view, and on Compare its
 * jobs, on Jobs its opened job. Errors are thrown (a 401 keeps the whole step for later). */
async function applyHash() {
  const seq = ++state.applySeq;
  state.shown = canonical(location.hash);
  const { view, params } = parseHash();
  const text = params.get("text");
  if (text) {
    const pair = params.get("pair") || "";
    // A method this page does not offer (a link from another model): the default.
    const asked = params.get("method") || "";
    const method = [...$("method").options].some((o) => o.value === asked) ? asked : "";
    $("text").value = text;
    $("pair").value = pair;
    $("method").value = method;
    if (params.has("level")) state.level = params.get("level") === "words" ? "words" : "tokens";
    state.scoreSource = params.get("scores") || "method";
    const labels = state.model ? state.model.labels : [];
    const found = labels.indexOf(params.get("target"));
    const target = found >= 0 ? found : null;
    const e = state.explanation;
    const same = e && e.text === text && (e.text_pair || "") === pair &&
      state.explainedMethod === method;
    // Another class of the explanation shown needs no request when the page holds its scores.
    const local = same && (target === null || target === e.target_index ||
      (state.scoreSource === "method" && e.class_scores && e.class_scores[target]));
    if (local) {
      if (target !== null) state.targetIndex = target;
      renderExplanation();
    } else {
      const request = explainRequest({ text, pair, method, target });
      if (!(await explainNow(request, "none")) || seq !== state.applySeq) return;
    }
  }
  go(view);
  if (view === "compare" && params.get("jobs") && state.explanation) {
    const ids = params.get("jobs").split(",").filter(Boolean);
    const shown = state.runs.map((r) => r.job.id);
    if (ids.join(",") !== shown.join(",")) {
      state.runs = [];
      renderRuns();
      for (const id of ids) {
        let job;
        try {
          job = await api(`jobs/${encodeURIComponent(id)}`);
        } catch (error) {
          if (error instanceof ApiError && error.status === 404) {
            showError(`Job ${id} is no longer on the sidecar (its result expired).`);
            continue;
          }
          throw error;
        }
        if (seq !== state.applySeq) return;
        addRun(job);
      }
    } else if (!$("compare-runs").querySelector(".inline-run")) {
      renderRuns();
    }
  }
  if (view === "jobs") {
    const id = params.get("job");
    if (id) await showJob(id, "none");
    else closeJob();
  }
}

/** Back, Forward, or an address typed or pasted into this page: show it, unless it is what
 * the page shows already (what the page wrote itself, or the second of popstate and
 * hashchange for one step). */
function onAddressChange() {
  if (location.hash && !location.hash.startsWith("#/")) return; // an anchor ("#main")
  if (canonical(location.hash) === state.shown) return;
  if (!state.model) {
    // Loading (or waiting for a token): the address is applied once the model is there.
    go(parseHash().view);
    return;
  }
  perform("address", applyHash);
}

function wire() {
  $("explain-form").addEventListener("submit", (event) => {
    event.preventDefault();
    explain();
  });
  // A class or score switch explains the text shown (not a draft typed in the box since),
  // with the method it was explained with; it replaces the history entry.
  const again = (target) => {
    const e = state.explanation;
    return explain({ text: e.text, pair: e.text_pair || "", method: state.explainedMethod,
      target, history: "replace" });
  };
  $("target").addEventListener("change", () => {
    state.targetIndex = Number($("target").value);
    const e = state.explanation;
    if (!e) return;
    if (state.scoreSource !== "method" || !e.class_scores) {
      again(state.targetIndex);
      return;
    }
    renderExplanation();
    updateHash();
  });
  $("scores").addEventListener("change", () => {
    state.scoreSource = $("scores").value;
    const e = state.explanation;
    if (!e) return;
    if (state.scoreSource !== "method" && state.targetIndex !== e.target_index) {
      again(state.targetIndex);
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
      if (state.explanation) updateHash();
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
  $("jobs-more").addEventListener("click", moreJobs);
  $("drift-refresh").addEventListener("click", loadDrift);
  $("auth").addEventListener("submit", async (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("auth-token").value.trim());
    $("auth-token").value = "";
    $("auth").hidden = true;
    // Run again, whole, what the token was asked for: the model and the address first (a deep
    // link opened without a token), then what the user did (explain, run a job, list jobs...).
    const actions = [...state.pending.entries()];
    state.pending.clear();
    let loaded = false;
    if (!state.model) {
      await start();
      loaded = true;
    }
    for (const [key, action] of actions) {
      if (loaded && (key === "model" || key === "address")) continue;
      await perform(key, action);
    }
  });
  for (const link of document.querySelectorAll("nav a")) {
    link.addEventListener("click", (event) => {
      event.preventDefault();
      go(link.dataset.view);
      updateHash("push");
      $("main").focus();
    });
  }
  window.addEventListener("popstate", onAddressChange);
  window.addEventListener("hashchange", onAddressChange);
}

// The exports (the buttons download the same) and the page's arithmetic, for scripts and
// tests that drive the page.
window.limelightViewer = Object.freeze({ heatmapSvg, heatmapHtml, spearman, scaleOf, colour,
  contrast, renderLegend, units });

async function main() {
  wire();
  go(parseHash().view); // the section at once; its data come with the model
  await start();
  document.body.dataset.ready = "true";
}

main();
