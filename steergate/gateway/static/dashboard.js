// steergate quota dashboard. Plain browser JavaScript: no build step, no CDN.
//
// Security: the key lives only in this tab's sessionStorage and travels only as an
// Authorization header to this origin (CSP connect-src 'self'). Everything from the
// API is rendered with textContent / DOM nodes, never innerHTML, so a hostile
// conversation id or vector name cannot run script in a page that holds a key.
"use strict";

(() => {
  const STORAGE_KEY = "steergate.dashboard.key";
  const REFRESH_MS = 2000;
  const SVG_NS = "http://www.w3.org/2000/svg";
  const QUOTAS = [
    ["requests_per_minute", "Requests / min", false],
    ["tokens_per_minute", "Tokens / min", false],
    ["concurrency", "In flight", false],
    ["latch_count", "Latches", false],
    ["latch_bytes", "Latch memory", true],
    ["vector_count", "Named vectors", false],
    ["vector_bytes", "Vector memory", true],
  ];
  const CLASSES = ["2xx", "4xx", "429", "5xx"];
  const PERIODS = { day: "UTC day", month: "UTC month" };
  const AUDIT_LIMIT = 50;

  const $ = (id) => document.getElementById(id);
  const state = {
    key: null, role: null, timer: null, gen: 0, sort: { col: "tenant", dir: 1 }, admin: null,
    keysTenant: null, keysTenants: null,
  };

  // ------------------------------------------------------------------ formatting

  function fmtBytes(n) {
    if (n === null || n === undefined) return "–";
    let v = Number(n);
    for (const unit of ["B", "KiB", "MiB", "GiB"]) {
      if (Math.abs(v) < 1024 || unit === "GiB") {
        if (unit === "B") return `${Math.round(v)} B`;
        return `${v.toFixed(1).replace(/\.0$/, "")} ${unit}`;
      }
      v /= 1024;
    }
    return String(n);
  }
  const fmtNum = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"));
  const fmt = (n, isBytes) => (isBytes ? fmtBytes(n) : fmtNum(n));
  const ratio = (q) => (q && q.limit > 0 ? q.used / q.limit : 0);
  const pct = (q) => (q && q.limit > 0 ? `${Math.round((100 * q.used) / q.limit)}%` : "–");

  function toMillis(t) {
    if (typeof t === "string") return Date.parse(t);
    const n = Number(t);
    return n > 1e12 ? n : n * 1000; // engine/gateway timestamps are seconds or ms
  }

  /** 42s, 5m, 3h, 2d: the largest whole unit of a duration in seconds. */
  function dur(s) {
    if (s < 60) return `${s}s`;
    if (s < 3600) return `${Math.floor(s / 60)}m`;
    if (s < 86400) return `${Math.floor(s / 3600)}h`;
    return `${Math.floor(s / 86400)}d`;
  }

  function ago(t) {
    const s = Math.max(0, Math.round((Date.now() - toMillis(t)) / 1000));
    return Number.isFinite(s) ? `${dur(s)} ago` : "–";
  }

  function until(t) {
    const s = Math.max(0, Math.round((toMillis(t) - Date.now()) / 1000));
    return Number.isFinite(s) ? `in ${dur(s)}` : "–";
  }

  /** "2025-06-01 12:00:00": a time in UTC, to the second. */
  function utc(t) {
    const ms = toMillis(t);
    return Number.isFinite(ms) ? new Date(ms).toISOString().replace("T", " ").slice(0, 19) : "–";
  }

  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else node.setAttribute(k, v);
    }
    for (const c of children) node.append(c);
    return node;
  }

  function meter(q, label, small = false) {
    const r = ratio(q);
    const bar = el("div", {
      class: `meter${small ? " small" : ""}${r >= 1 ? " full" : r >= 0.8 ? " hi" : ""}`,
      role: "meter",
      "aria-label": label,
      "aria-valuemin": "0",
      "aria-valuemax": String(q ? q.limit : 0),
      "aria-valuenow": String(q ? Math.min(q.used, q.limit) : 0),
      "aria-valuetext": `${pct(q)} used`,
    });
    const fill = el("span");
    fill.style.width = `${Math.min(100, r * 100)}%`;
    bar.append(fill);
    return bar;
  }

  // ------------------------------------------------------------------ API

  class HttpError extends Error {
    constructor(status, body) {
      const e = body && body.error ? body.error : null;
      super(e ? e.message : `HTTP ${status}`);
      this.status = status;
      this.code = e ? e.code : null;
    }
  }

  async function api(path, key = state.key) {
    const r = await fetch(path, {
      headers: { Authorization: `Bearer ${key}`, Accept: "application/json" },
      cache: "no-store",
      credentials: "omit",
      referrerPolicy: "no-referrer",
    });
    let body = null;
    try { body = await r.json(); } catch (_) { body = null; }
    if (!r.ok) throw new HttpError(r.status, body);
    return body;
  }

  const listOf = (doc, field) => (Array.isArray(doc) ? doc : (doc && (doc[field] || doc.data)) || []);

  /** Which view a key opens: a tenant key answers /v1/usage, the admin key /admin/usage.
   *  A tenant key without the `usage` scope is "no-usage-scope": valid, but its view
   *  is built on /v1/usage, so the page says which scope it lacks. */
  async function detectRole(key) {
    let scopeless = false;
    try {
      await api("/v1/usage", key);
      return "tenant";
    } catch (err) {
      if (!(err instanceof HttpError) || err.status >= 500) throw err;
      scopeless = err.code === "insufficient_scope";
    }
    if (scopeless) return "no-usage-scope";
    try {
      await api("/admin/usage", key);
      return "admin";
    } catch (err) {
      if (!(err instanceof HttpError) || err.status >= 500) throw err;
      return null;
    }
  }

  /** A tenant section's list, or null when the key lacks that section's scope (the
   *  section then says so, and the rest of the view still refreshes). */
  async function scopedList(path, field) {
    try {
      return listOf(await api(path), field);
    } catch (err) {
      if (err instanceof HttpError && err.code === "insufficient_scope") return null;
      throw err;
    }
  }

  // ------------------------------------------------------------------ sign-in

  async function signIn(key) {
    $("signin-error").textContent = "";
    $("signin-button").disabled = true;
    try {
      const role = await detectRole(key);
      if (role === "no-usage-scope") {
        $("signin-error").textContent =
          "That key is valid but lacks the usage scope, which the dashboard needs " +
          "(it reads /v1/usage). Use a key with the usage scope.";
        sessionStorage.removeItem(STORAGE_KEY);
        return;
      }
      if (!role) {
        $("signin-error").textContent =
          "That key was not accepted: it is unknown, revoked or mistyped.";
        sessionStorage.removeItem(STORAGE_KEY);
        return;
      }
      sessionStorage.setItem(STORAGE_KEY, key);
      state.key = key;
      state.role = role;
      $("key").value = "";
      await refresh(); // render first, so the view appears with its numbers
      show();
    } catch (err) {
      $("signin-error").textContent = `Could not reach the gateway (${err.message}).`;
    } finally {
      $("signin-button").disabled = false;
    }
  }

  function signOut(message = "") {
    clearTimeout(state.timer);
    sessionStorage.removeItem(STORAGE_KEY);
    Object.assign(state, { key: null, role: null, admin: null, keysTenant: null, keysTenants: null });
    for (const id of ["keys", "audit"]) $(id).tBodies[0].replaceChildren();
    $("keys-tenant").replaceChildren();
    show();
    $("signin-error").textContent = message;
    $("status").textContent = "";
    $("updated").textContent = "";
    $("key").focus();
  }

  function show() {
    const signed = Boolean(state.key);
    $("signin").hidden = signed;
    $("who").hidden = !signed;
    $("tenant-view").hidden = state.role !== "tenant";
    $("admin-view").hidden = state.role !== "admin";
  }

  // ------------------------------------------------------------------ refresh loop

  async function refresh() {
    clearTimeout(state.timer);
    if (!state.key) return;
    const gen = ++state.gen; // a refresh started meanwhile schedules the next one, not this
    try {
      if (state.role === "tenant") await refreshTenant();
      else await refreshAdmin();
      $("status").textContent = "";
      $("status").classList.remove("bad");
      $("updated").textContent = `Updated ${new Date().toLocaleTimeString()}`;
    } catch (err) {
      if (err instanceof HttpError && (err.status === 401 || err.status === 403)) {
        signOut("Signed out: the key is no longer accepted.");
        return;
      }
      $("status").textContent = `Refresh failed (${err.message}); retrying…`;
      $("status").classList.add("bad");
    }
    if ($("live").checked && gen === state.gen) state.timer = setTimeout(refresh, REFRESH_MS);
  }

  // ------------------------------------------------------------------ tenant view

  async function refreshTenant() {
    const [usage, latches, vectors] = await Promise.all([
      api("/v1/usage"),
      scopedList("/v1/steering/latches", "latches"),
      scopedList("/v1/steering/vectors", "vectors"),
    ]);
    const id = usage.tenant_id;
    $("who-label").textContent = `Tenant ${id}`;
    $("tenant-title").textContent = usage.name ? `${usage.name} (${id})` : `Tenant ${id}`;
    const history = usage.history || [];
    const last = history[history.length - 1] || {};
    renderQuotaCards($("tenant-quotas"), usage.quotas || {}, {
      requests_per_minute: `${fmtNum(last.requests || 0)} this calendar minute`,
      tokens_per_minute: `${fmtNum(last.tokens || 0)} this calendar minute`,
    });
    renderBudget(usage.budget);
    const q = usage.quotas || {};
    renderChart($("chart-requests"), history, "requests", q.requests_per_minute, "requests");
    renderChart($("chart-tokens"), history, "tokens", q.tokens_per_minute, "tokens");
    renderCounts($("responses"), CLASSES.map((c) => [c, (usage.responses || {})[c] || 0]));
    renderCounts($("rejections"), Object.entries(usage.rejections || {}));
    renderLatches(latches);
    renderVectors(vectors);
  }

  /** One card per quota. ``used`` for the two rates is the limiter's window (it
   *  drains continuously), so the calendar-minute count is shown beside it. */
  function renderQuotaCards(container, quotas, notes = {}) {
    const cards = QUOTAS.filter(([key]) => quotas[key]).map(([key, label, isBytes]) => {
      const q = quotas[key];
      const full = q.limit > 0 && q.used >= q.limit;
      return el(
        "div",
        { class: `card${full ? " full" : ""}`, role: "listitem", "data-quota": key },
        el("div", { class: "label", text: label }),
        el("div", { class: "value", text: `${fmt(q.used, isBytes)} / ${fmt(q.limit, isBytes)} (${pct(q)})${full ? " — at limit" : ""}` }),
        meter(q, `${label}: ${fmt(q.used, isBytes)} of ${fmt(q.limit, isBytes)}`),
        ...(notes[key] ? [el("div", { class: "hint", text: notes[key] })] : []),
      );
    });
    container.replaceChildren(...cards);
  }

  /** The token budget (``budget`` of /v1/usage) as one card like the quota cards;
   *  hidden when the tenant has none. ``used`` may pass ``tokens`` (the last request
   *  admitted can overshoot): the bar stops at full, the numbers say how far. */
  function renderBudget(budget) {
    const box = $("budget");
    box.hidden = !budget;
    if (!budget) {
      box.replaceChildren();
      return;
    }
    const q = { used: budget.used, limit: budget.tokens };
    const full = q.limit > 0 && q.used >= q.limit;
    const label = `Token budget per ${PERIODS[budget.period] || budget.period}`;
    box.replaceChildren(el(
      "div",
      { class: `card${full ? " full" : ""}`, role: "listitem", "data-quota": "token_budget" },
      el("div", { class: "label", text: label }),
      el("div", { class: "value", text: `${fmtNum(q.used)} / ${fmtNum(q.limit)} tokens (${pct(q)})${full ? " — at limit" : ""}` }),
      meter(q, `${label}: ${fmtNum(q.used)} of ${fmtNum(q.limit)} tokens`),
      el("div", { class: "hint", "data-field": "resets",
        text: `${fmtNum(budget.remaining)} left · resets ${utc(budget.resets_at)} UTC (${until(budget.resets_at)})` }),
    ));
  }

  function svg(tag, attrs = {}) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    return node;
  }

  /** The smallest of 2, 4, 6, 10 × 10^k at or above v: its half is a whole number too. */
  function niceTop(v) {
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    return [2, 4, 6, 10].map((m) => m * p).find((t) => t >= v);
  }

  /** A 60-minute area chart; the limit line is drawn when it is on a useful scale. */
  function renderChart(container, history, field, quota, unit) {
    const W = 600, H = 160, L = 44, R = 8, T = 10, B = 22;
    const values = history.map((h) => Number(h[field] || 0));
    const peak = Math.max(0, ...values);
    const limit = quota ? quota.limit : 0;
    const showLimit = limit > 0 && limit <= Math.max(peak, 1) * 3;
    const top = niceTop(Math.max(1, showLimit ? Math.max(peak, limit) : peak));
    const n = Math.max(values.length, 2);
    const x = (i) => L + ((W - L - R) * i) / (n - 1);
    const y = (v) => T + (H - T - B) * (1 - v / top);
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img",
      "aria-label": `${unit} per minute over the last ${values.length} minutes: peak ${fmtNum(peak)}, now ${fmtNum(values[values.length - 1] || 0)}, limit ${fmtNum(limit)}` });
    root.append(svg("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }));
    root.append(svg("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }));
    for (const v of [0, top / 2, top]) {
      const t = svg("text", { x: L - 4, y: y(v) + 4, "text-anchor": "end" });
      t.textContent = fmtNum(v);
      root.append(t);
    }
    [["-60m", 0], ["-30m", (n - 1) / 2], ["now", n - 1]].forEach(([label, i]) => {
      const t = svg("text", { x: x(i), y: H - 6, "text-anchor": i === 0 ? "start" : i === n - 1 ? "end" : "middle" });
      t.textContent = label;
      root.append(t);
    });
    if (values.length) {
      const pts = values.map((v, i) => `${x(i).toFixed(1)},${y(v).toFixed(1)}`);
      root.append(svg("polygon", { class: "area", points: `${x(0)},${y(0)} ${pts.join(" ")} ${x(values.length - 1)},${y(0)}` }));
      root.append(svg("polyline", { class: "line", points: pts.join(" ") }));
    }
    if (showLimit) {
      root.append(svg("line", { class: "limit", x1: L, x2: W - R, y1: y(limit), y2: y(limit) }));
      const t = svg("text", { x: W - R, y: y(limit) - 3, "text-anchor": "end" });
      t.textContent = `limit ${fmtNum(limit)}`;
      root.append(t);
    } else if (limit > 0) {
      const t = svg("text", { x: W - R, y: T + 10, "text-anchor": "end" });
      t.textContent = `limit ${fmtNum(limit)} (off scale)`;
      root.append(t);
    }
    container.replaceChildren(root);
  }

  function renderCounts(dl, entries) {
    const nodes = [];
    for (const [k, v] of entries) nodes.push(el("dt", { text: k }), el("dd", { text: fmtNum(v), "data-count": k }));
    if (!nodes.length) nodes.push(el("dt", { class: "empty", text: "none" }), el("dd"));
    dl.replaceChildren(...nodes);
  }

  function emptyRow(cols, text) {
    return el("tr", {}, el("td", { class: "empty", colspan: String(cols), text }));
  }

  function renderLatches(items) {
    if (items === null) {
      $("latches").tBodies[0].replaceChildren(emptyRow(4, "This key lacks the latches scope."));
      return;
    }
    items.sort((a, b) => toMillis(b.last_used) - toMillis(a.last_used));
    const rows = items.map((l) =>
      el("tr", {},
        el("td", { class: "id", text: l.conversation_id }),
        el("td", { text: l.kind === "ref" ? "by reference" : "by value" }),
        el("td", { class: "num", text: fmtBytes(l.bytes) }),
        el("td", { text: ago(l.last_used), title: new Date(toMillis(l.last_used)).toISOString() })));
    $("latches").tBodies[0].replaceChildren(...(rows.length ? rows : [emptyRow(4, "No latched conversations.")]));
  }

  function renderVectors(items) {
    if (items === null) {
      $("vectors").tBodies[0].replaceChildren(emptyRow(6, "This key lacks the vectors scope."));
      return;
    }
    items.sort((a, b) => String(a.name).localeCompare(String(b.name)));
    const rows = items.map((v) =>
      el("tr", {},
        el("td", { class: "id", text: v.name }),
        el("td", { text: v.hook || "–" }),
        el("td", { text: Array.isArray(v.layers) ? v.layers.join(", ") : String(v.layers ?? "–") }),
        el("td", { class: "num", text: fmtBytes(v.bytes) }),
        el("td", { class: "id", text: v.digest ? String(v.digest).slice(0, 12) : "–", title: v.digest || "" }),
        el("td", {}, provenanceCell(v))));
    $("vectors").tBodies[0].replaceChildren(...(rows.length ? rows : [emptyRow(6, "No named vectors.")]));
  }

  // A vector made by from-examples: how it was made, and its per-layer report (norm,
  // separation in pooled standard deviations, leave-one-out accuracy) to pick layers.
  function provenanceCell(v) {
    const p = v.provenance;
    if (!p || typeof p !== "object") return el("span", { class: "muted", text: "uploaded" });
    const counts = p.counts || {};
    const made = `${p.method} · ${counts.positive ?? "?"}+ / ${counts.negative ?? "?"}− · ` +
      `${p.position}${p.normalize ? " · unit" : ""}`;
    const title = `model ${p.model ?? "?"}, made ${p.created ? new Date(toMillis(p.created)).toISOString() : "?"}`;
    const layers = (v.report && v.report.layers) || {};
    const fmt = (x, d) => (typeof x === "number" ? x.toFixed(d) : "–");
    const rows = Object.keys(layers).sort((a, b) => Number(a) - Number(b)).map((l) =>
      el("tr", {},
        el("td", { class: "num", text: l }),
        el("td", { class: "num", text: fmt(layers[l].norm, 3) }),
        el("td", { class: "num", text: fmt(layers[l].separation, 2) }),
        el("td", { class: "num", text: fmt(layers[l].accuracy, 2) })));
    const head = el("tr", {}, ...["layer", "norm", "separation", "accuracy"].map((h) =>
      el("th", { scope: "col", class: "num", text: h })));
    return el("details", { class: "report" },
      el("summary", { text: made, title }),
      el("table", { class: "report" }, el("thead", {}, head), el("tbody", {}, ...rows)));
  }

  // ------------------------------------------------------------------ admin view

  const ADMIN_COLS = [
    ["tenant", "Tenant"],
    ...QUOTAS.map(([key, label]) => [key, label]),
    ["budget", "Token budget"],
    ["r429", "429s"],
    ["r5xx", "5xx"],
  ];

  function adminValue(row, col) {
    if (col === "tenant") return row.tenant_id;
    if (col === "r429") return (row.responses || {})["429"] || 0;
    if (col === "r5xx") return (row.responses || {})["5xx"] || 0;
    if (col === "budget") return row.budget ? ratio({ used: row.budget.used, limit: row.budget.tokens }) : -1;
    return ratio((row.quotas || {})[col]);
  }

  async function refreshAdmin() {
    const [usage, engines, audit] = await Promise.all([
      api("/admin/usage"),
      api("/admin/engines"),
      api(`/admin/audit?limit=${AUDIT_LIMIT}`),
    ]);
    state.admin = usage;
    $("who-label").textContent = "Administrator";
    renderTenantTable();
    renderCapacity(usage.capacity || {});
    renderEngines(listOf(engines, "engines"));
    renderAudit(listOf(audit, "entries"));
    await refreshKeys(listOf(usage, "tenants").map((t) => String(t.tenant_id)));
  }

  // One tenant's keys at a time (chosen in the select): one request per refresh,
  // however many tenants there are.
  async function refreshKeys(ids) {
    ids.sort((a, b) => a.localeCompare(b));
    const select = $("keys-tenant");
    if (state.keysTenants !== ids.join(" ")) {
      state.keysTenants = ids.join(" ");
      select.replaceChildren(...ids.map((id) => el("option", { value: id, text: id })));
    }
    if (!ids.includes(state.keysTenant)) state.keysTenant = ids.length ? ids[0] : null;
    select.disabled = !ids.length;
    const tenant = state.keysTenant;
    if (tenant === null) {
      $("keys").tBodies[0].replaceChildren(emptyRow(7, "No tenants yet."));
      return;
    }
    select.value = tenant;
    let keys = [];
    try {
      keys = listOf(await api(`/admin/tenants/${encodeURIComponent(tenant)}/keys`), "keys");
    } catch (err) {
      if (!(err instanceof HttpError && err.status === 404)) throw err; // deleted meanwhile
    }
    if (tenant === state.keysTenant) renderKeys(tenant, keys);
  }

  function keyLimits(limits) {
    const l = limits || {};
    const parts = [];
    if (l.rpm !== null && l.rpm !== undefined) parts.push(`${fmtNum(l.rpm)} req/min`);
    if (l.max_concurrency !== null && l.max_concurrency !== undefined) {
      parts.push(`${fmtNum(l.max_concurrency)} in flight`);
    }
    return parts.length ? parts.join(" · ") : "the tenant's";
  }

  /** A time cell: relative text, the UTC time in the tooltip. */
  function timeCell(field, t, text) {
    const td = el("td", { "data-field": field, text });
    if (t !== null && t !== undefined) td.title = `${utc(t)} UTC`;
    return td;
  }

  function renderKeys(tenant, keys) {
    const now = Date.now();
    const rows = keys.map((k) => {
      const has = (v) => v !== null && v !== undefined;
      const expired = has(k.expires_at) && toMillis(k.expires_at) <= now;
      const tr = el("tr", { "data-key": k.key_id });
      if (expired) tr.classList.add("expired");
      const name = el("td", { "data-field": "name" },
        el("div", { class: k.name ? "" : "empty", text: k.name || "unnamed" }),
        el("div", { class: "hint id", text: k.key_id }));
      const expires = timeCell("expires", k.expires_at, has(k.expires_at) ? "" : "never");
      if (expired) expires.append(el("span", { class: "badge", text: "expired" }), ` ${ago(k.expires_at)}`);
      else if (has(k.expires_at)) expires.append(until(k.expires_at));
      if (has(k.previous_expires_at) && toMillis(k.previous_expires_at) > now) {
        expires.append(el("div", { class: "hint", text: `rotated: the old secret works ${until(k.previous_expires_at)}` }));
      }
      tr.append(
        name,
        el("td", { class: "id", "data-field": "prefix", text: `${k.prefix}…` }),
        el("td", { "data-field": "scopes", text: (k.scopes || []).join(", ") }),
        el("td", { "data-field": "limits", text: keyLimits(k.limits) }),
        timeCell("created", k.created_at, ago(k.created_at)),
        expires,
        timeCell("last_used", k.last_used_at, has(k.last_used_at) ? ago(k.last_used_at) : "never"),
      );
      return tr;
    });
    $("keys").tBodies[0].replaceChildren(...(rows.length ? rows : [emptyRow(7, `${tenant} has no keys.`)]));
  }

  /** What an audit entry changed, as [path, text] pairs: nested objects as dotted
   *  paths; an update's [old, new] pairs as "old → new". */
  function auditFields(action, fields) {
    const show = (path, v) => {
      if (v === null || v === undefined) return "none";
      if (Array.isArray(v)) return v.length ? v.map((x) => show(path, x)).join(", ") : "[]";
      if (typeof v === "object") return JSON.stringify(v);
      if (typeof v === "number" && path.endsWith("_at")) return `${utc(v)} UTC`;
      if (typeof v === "number" && path.endsWith("_bytes")) return fmtBytes(v);
      if (v === "") return '""';
      return String(v);
    };
    const out = [];
    const walk = (obj, prefix) => {
      for (const [k, v] of Object.entries(obj)) {
        const path = prefix + k;
        if (action.endsWith(".update") && Array.isArray(v) && v.length === 2) {
          out.push([path, `${show(path, v[0])} → ${show(path, v[1])}`]);
        } else if (v && typeof v === "object" && !Array.isArray(v)) walk(v, `${path}.`);
        else out.push([path, show(path, v)]);
      }
    };
    if (fields && typeof fields === "object") walk(fields, "");
    return out;
  }

  function renderAudit(entries) {
    const rows = entries.map((e) => {
      const action = String(e.action || "");
      const pairs = auditFields(action, e.fields);
      const fields = el("td", { class: "fields", "data-field": "fields" });
      for (const [path, text] of pairs) {
        fields.append(el("span", { class: "field" }, el("span", { class: "k", text: `${path}:` }), ` ${text}`));
      }
      if (!pairs.length) fields.append(el("span", { class: "empty", text: "–" }));
      return el("tr", { "data-audit": String(e.id) },
        el("td", { "data-field": "time", text: utc(e.time), title: ago(e.time) }),
        el("td", { "data-field": "actor" },
          el("div", { class: "id", text: e.actor }), el("div", { class: "hint", text: e.role || "" })),
        el("td", { class: "id", "data-field": "action", text: action }),
        el("td", { class: "id", "data-field": "target", text: e.target || "–" }),
        fields);
    });
    $("audit").tBodies[0].replaceChildren(...(rows.length ? rows : [emptyRow(5, "No admin writes yet.")]));
  }

  function renderTenantTable() {
    const table = $("tenants");
    const head = table.tHead.rows[0];
    if (!head.cells.length) {
      for (const [col, label] of ADMIN_COLS) {
        const btn = el("button", { type: "button", class: "sort" }, label,
          el("span", { class: "arrow", "aria-hidden": "true" })); // aria-sort says it to AT
        btn.addEventListener("click", () => {
          state.sort = { col, dir: state.sort.col === col ? -state.sort.dir : col === "tenant" ? 1 : -1 };
          renderTenantTable();
        });
        head.append(el("th", { scope: "col", "data-col": col }, btn));
      }
    }
    for (const th of head.cells) {
      const sorted = th.dataset.col === state.sort.col;
      if (sorted) th.setAttribute("aria-sort", state.sort.dir > 0 ? "ascending" : "descending");
      else th.removeAttribute("aria-sort");
      th.querySelector(".arrow").textContent = sorted ? (state.sort.dir > 0 ? " ▲" : " ▼") : " ↕";
    }
    const rows = [...listOf(state.admin, "tenants")];
    const { col, dir } = state.sort;
    rows.sort((a, b) => {
      const va = adminValue(a, col), vb = adminValue(b, col);
      const c = typeof va === "string" ? va.localeCompare(vb) : va - vb;
      return c * dir || String(a.tenant_id).localeCompare(String(b.tenant_id));
    });
    const body = rows.map((row) => {
      const tr = el("tr", { "data-tenant": row.tenant_id });
      tr.append(el("th", { scope: "row", class: "id", text: row.tenant_id }));
      for (const [key, label, isBytes] of QUOTAS) {
        const q = (row.quotas || {})[key];
        const td = el("td", { "data-quota": key });
        if (q) {
          td.append(el("div", { class: "pct", text: pct(q) }),
            meter(q, `${row.tenant_id} ${label}`, true),
            el("div", { class: "hint", text: `${fmt(q.used, isBytes)} / ${fmt(q.limit, isBytes)}` }));
          if (q.limit > 0 && q.used >= q.limit) td.classList.add("full");
        } else td.textContent = "–";
        tr.append(td);
      }
      const b = row.budget;
      const budget = el("td", { "data-quota": "token_budget" });
      if (b) {
        const q = { used: b.used, limit: b.tokens };
        budget.append(el("div", { class: "pct", text: pct(q) }),
          meter(q, `${row.tenant_id} token budget`, true),
          el("div", { class: "hint", text: `${fmtNum(b.used)} / ${fmtNum(b.tokens)} per ${b.period}` }));
        if (q.used >= q.limit) budget.classList.add("full");
      } else budget.textContent = "–";
      tr.append(budget);
      tr.append(el("td", { class: "num", text: fmtNum(adminValue(row, "r429")) }));
      tr.append(el("td", { class: "num", text: fmtNum(adminValue(row, "r5xx")) }));
      return tr;
    });
    table.tBodies[0].replaceChildren(...(body.length ? body : [emptyRow(ADMIN_COLS.length, "No tenants yet.")]));
  }

  function renderCapacity(capacity) {
    const cards = Object.entries(capacity).map(([key, c]) => {
      const isBytes = key.endsWith("bytes");
      const label = key === "latch_bytes" ? "Latch memory" : "Latch count";
      const q = { used: c.allocated, limit: c.engine_cap };
      const title = el("div", { class: "label", text: label });
      title.append(" ", el("span", { class: `badge${c.overcommitted ? "" : " ok"}`, text: c.overcommitted ? "OVERCOMMITTED" : "fits" }));
      return el("div", { class: "card", role: "listitem", "data-capacity": key }, title,
        el("div", { class: "value", text: `Σ quotas ${fmt(c.allocated, isBytes)} of engine cap ${fmt(c.engine_cap, isBytes)} (${pct(q)})` }),
        meter(q, `${label}: sum of tenant quotas against the engine cap`));
    });
    $("capacity").replaceChildren(...(cards.length ? cards : [el("p", { class: "empty", text: "No engine caps known yet." })]));
  }

  function renderEngines(engines) {
    const cards = engines.map((e) => {
      const s = e.status || {};
      const title = el("div", { class: "label id", text: e.url });
      title.append(" ", el("span", { class: `badge${e.up ? " ok" : ""}`, text: e.up ? "up" : "down" }));
      const card = el("div", { class: "card", role: "listitem", "data-engine": e.url }, title);
      if (!e.up) {
        card.append(el("div", { class: "value", text: e.error || "not reachable" }));
        return card;
      }
      const count = { used: s.latched_conversations, limit: s.max_latched_conversations };
      const bytes = { used: s.latched_bytes, limit: s.max_latched_bytes };
      card.append(
        el("div", { class: "value", text: `Latches ${fmtNum(count.used)} / ${fmtNum(count.limit)} (${pct(count)})` }),
        meter(count, `${e.url} latches against cap`),
        el("div", { class: "value", text: `Latch memory ${fmtBytes(bytes.used)} / ${fmtBytes(bytes.limit)} (${pct(bytes)})` }),
        meter(bytes, `${e.url} latch memory against cap`),
        el("div", { class: "hint", text: `evictions ${fmtNum(s.evictions)} · refusals ${fmtNum(s.refusals)} · bridged turns ${fmtNum(s.bridges)}` }),
      );
      return card;
    });
    $("engines").replaceChildren(...(cards.length ? cards : [el("p", { class: "empty", text: "No engines configured." })]));
  }

  // ------------------------------------------------------------------ wiring

  document.addEventListener("DOMContentLoaded", () => {
    $("signin-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const key = $("key").value.trim();
      if (!key) {
        $("signin-error").textContent = "Enter an API key.";
        return;
      }
      signIn(key);
    });
    $("sign-out").addEventListener("click", () => signOut());
    $("keys-tenant").addEventListener("change", () => {
      state.keysTenant = $("keys-tenant").value;
      $("keys").tBodies[0].replaceChildren(emptyRow(7, "Loading…"));
      refresh();
    });
    $("live").addEventListener("change", () => { if ($("live").checked) refresh(); else clearTimeout(state.timer); });
    document.addEventListener("visibilitychange", () => { if (!document.hidden && state.key) refresh(); });
    const saved = sessionStorage.getItem(STORAGE_KEY);
    if (saved) signIn(saved);
    else $("key").focus();
  });
})();
