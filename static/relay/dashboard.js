// ModelRelay dashboard: draws one relay snapshot, then follows the server-sent event
// stream (one snapshot per second) and redraws in place. Everything that came from a
// worker or a client (names, models) is inserted as text, never as HTML.
(function () {
  "use strict";

  const script = document.currentScript;
  const eventsUrl = script.dataset.eventsUrl;
  const canAct = script.dataset.canAct === "true";
  const csrfToken = document.querySelector('meta[name="csrf-token"]').content;
  const SVG = "http://www.w3.org/2000/svg";
  const CLASS_LABELS = { ok: "OK", client_error: "4xx", error: "5xx / failed", cancelled: "Cancelled" };
  const pending = new Map(); // worker id -> action in progress

  // ---------------------------------------------------------------- helpers

  function el(tag, attrs, children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "text") node.textContent = value;
      else if (key === "class") node.className = value;
      else node.setAttribute(key, value === true ? "" : value);
    }
    for (const child of children || []) node.append(child);
    return node;
  }

  function setText(id, text) {
    const node = document.getElementById(id);
    if (node && node.textContent !== text) node.textContent = text;
  }

  function fmtInt(n) {
    return Number(n || 0).toLocaleString("en-US");
  }

  function fmtCompact(n) {
    n = Number(n || 0);
    if (n >= 1e9) return (n / 1e9).toFixed(1) + "B";
    if (n >= 1e6) return (n / 1e6).toFixed(1) + "M";
    if (n >= 1e4) return (n / 1e3).toFixed(1) + "k";
    return fmtInt(n);
  }

  function fmtDuration(secs) {
    secs = Math.max(0, Math.floor(secs));
    const d = Math.floor(secs / 86400), h = Math.floor((secs % 86400) / 3600);
    const m = Math.floor((secs % 3600) / 60), s = secs % 60;
    if (d) return d + "d " + h + "h";
    if (h) return h + "h " + m + "m";
    if (m) return m + "m " + s + "s";
    return s + "s";
  }

  function fmtMs(ms) {
    if (ms === null || ms === undefined) return "–";
    if (ms >= 10000) return (ms / 1000).toFixed(1) + " s";
    if (ms >= 1000) return (ms / 1000).toFixed(2) + " s";
    return Math.round(ms) + " ms";
  }

  function fmtClock(epochSecs) {
    return new Date(epochSecs * 1000).toLocaleTimeString([], { hour12: false });
  }

  function statusClass(record) {
    if (record.outcome === "cancelled") return "cancelled";
    if (record.status < 400) return "ok";
    if (record.status < 500) return "client_error";
    return "error";
  }

  // ---------------------------------------------------------------- summary

  function renderSummary(snap) {
    const s = snap.stats;
    const workers = snap.workers;
    const capacity = workers.reduce((sum, w) => sum + w.max_concurrent, 0);
    const load = workers.reduce((sum, w) => sum + w.load, 0);
    setText("stat-workers", fmtInt(s.workers_connected));
    setText("stat-capacity", workers.length ? load + " of " + capacity + " slots busy" : "none connected");
    setText("stat-inflight", fmtInt(s.in_flight));
    setText("stat-queued", fmtInt(s.queue_depth));
    const byClass = s.queue_by_class || {};
    const parts = ["priority", "default", "flex"]
      .filter((c) => byClass[c])
      .map((c) => fmtInt(byClass[c]) + " " + c);
    if (s.preemptions) parts.push(fmtInt(s.preemptions) + " preempted");
    setText("stat-queued-classes", parts.length ? parts.join(" · ") : "waiting for a worker");
    setText("stat-rate", Number(snap.rate_per_sec || 0).toFixed(snap.rate_per_sec >= 10 ? 0 : 2));
    setText("stat-total", fmtCompact(s.requests.total));
    setText("stat-uptime", "up " + fmtDuration(s.uptime_secs));
    setText("stat-tokens", fmtCompact(s.tokens.prompt + s.tokens.completion));
    setText("stat-tokens-split", fmtCompact(s.tokens.prompt) + " in · " + fmtCompact(s.tokens.completion) + " out");
    document.getElementById("stat-queued").closest(".stat").classList.toggle("warn", s.queue_depth > 0);
    renderRouting(s.routing);
  }

  // Cache-aware routing (SPEC §14): what backends said they reused, and how routing went.
  function renderRouting(r) {
    if (!r) return;
    const rows = Object.values(r.workers || {});
    const reported = rows.reduce((sum, w) => sum + w.reported_cached_tokens, 0);
    setText("stat-cached", fmtCompact(reported));
    const d = r.decisions || {};
    const checked = r.predicted_hits_confirmed + r.predicted_hits_refuted;
    const parts = [r.policy.replace("_", "-")];
    if (r.policy !== "least_load") {
      parts.push(fmtInt(d.hit || 0) + " hit · " + fmtInt(d.miss || 0) + " new · " + fmtInt(d.guard || 0) + " spilled");
      if (checked) parts.push(Math.round((100 * r.predicted_hits_confirmed) / checked) + "% confirmed");
    }
    setText("stat-cached-split", parts.join(" · "));
  }

  // ---------------------------------------------------------------- workers

  // Speed-aware routing (SPEC §21): each model's learned rates, and its recent time to
  // first byte as predicted and as measured; "fleet's" while it has no history.
  function speedLines(w) {
    const rows = (w.speeds || []).filter((s) => s.learned);
    if (!rows.length) return [el("span", { class: "muted small", title: "No history here yet: the fleet's median", text: "fleet's" })];
    return rows.slice(0, 3).map((s) => el("div", {
      title: s.model + " · confidence " + Math.round(100 * s.confidence) + "% · " + fmtInt(s.samples) + " requests",
    }, [
      el("div", { class: "small", text: fmtCompact(s.prefill_tokens_per_sec) + " tok/s in · " + fmtCompact(Math.round(s.decode_tokens_per_sec)) + " out" }),
      el("div", { class: "muted small", text: "TTFT " + fmtMs(s.predicted_ttft_ms) + " predicted · " + fmtMs(s.measured_ttft_ms) + " measured" }),
    ]));
  }

  function workerCells(w, snapAt) {
    const pct = w.max_concurrent ? Math.min(100, Math.round((100 * w.load) / w.max_concurrent)) : 0;
    const since = snapAt - w.connected_secs;
    // Models on demand (SPEC §19): each model's state on this worker, with its loads.
    const states = new Map((w.model_states || []).map((s) => [s.model, s]));
    const chip = (m) => {
      const s = states.get(m);
      if (!s) return el("span", { class: "chip", text: m });
      const title = s.state + " · " + fmtInt(s.loads) + " loads, " + fmtInt(s.unloads) + " unloads"
        + (s.last_load_secs == null ? "" : " · last load " + s.last_load_secs.toFixed(2) + " s")
        + (s.waited_for_load ? " · " + fmtInt(s.waited_for_load) + " requests waited for a load" : "");
      return el("span", { class: "chip chip-" + (s.state || "unknown"), "data-model-state": s.state,
        title, text: s.state === "loaded" ? m : m + " · " + (s.state || "?") });
    };
    const models = el("div", { class: "chips" },
      w.models.length ? w.models.map(chip)
        : [el("span", { class: "muted", text: "no models" })]);
    const state = w.draining
      ? el("span", { class: "badge badge-warn", "data-state": "draining", text: "Draining" })
      : w.backend_error
        ? el("span", { class: "badge badge-warn", "data-state": "backend-down",
            title: w.backend_error, text: "Backend unreachable" })
        : el("span", { class: "badge badge-ok", "data-state": "ready", text: "Ready" });
    const cells = [
      el("td", { "data-label": "" }, [el("div", {}, [el("div", { class: "strong", text: w.name }), el("div", { class: "muted mono small", text: w.id })])]),
      el("td", { "data-label": "Provider", text: w.provider }),
      el("td", { "data-label": "Models" }, [models]),
      el("td", { class: "load-cell", "data-label": "Load" }, [
        el("div", { class: "load-text", text: w.load + " / " + w.max_concurrent }),
        el("div", { class: "meter", title: pct + "% busy" }, [el("span", { style: "width:" + pct + "%" })]),
      ]),
      el("td", { class: "speed-cell", "data-label": "Speed" }, speedLines(w)),
      el("td", { "data-label": "State" }, [state]),
      el("td", { class: "connected", "data-label": "Connected", title: new Date(since * 1000).toLocaleString() }, [
        el("div", {}, [
          el("div", { class: "connected-ago", text: fmtDuration(w.connected_secs) + " ago" }),
          el("div", { class: "muted small", text: "since " + fmtClock(since) }),
        ]),
      ]),
      el("td", { class: "num", "data-label": "Served", text: fmtInt(w.requests_served) }),
    ];
    if (canAct) {
      const busy = pending.get(w.id);
      cells.push(el("td", { class: "actions", "data-label": "" }, [
        el("button", { type: "button", class: "button small", "data-action": "refresh", "data-worker": w.id,
          disabled: busy === "refresh", text: busy === "refresh" ? "Refreshing…" : "Refresh models" }),
        el("button", { type: "button", class: "button small danger", "data-action": "drain", "data-worker": w.id,
          disabled: w.draining || busy === "drain", text: w.draining ? "Draining" : "Drain" }),
      ]));
    }
    return cells;
  }

  function renderWorkers(snap) {
    const tbody = document.querySelector("#workers tbody");
    const existing = new Map([...tbody.rows].map((row) => [row.dataset.workerId, row]));
    const seen = new Set();
    snap.workers.forEach((w, index) => {
      seen.add(w.id);
      let row = existing.get(w.id);
      if (!row) row = el("tr", { "data-worker-id": w.id });
      // Rebuild a row only when what it shows changed (the connected-for time is updated
      // in place), so buttons are not swapped under the pointer every second.
      const modelStates = (w.model_states || []).map((m) => [m.model, m.state, m.loads, m.unloads]);
      const signature = JSON.stringify([w.name, w.provider, w.models, modelStates,
        w.load, w.max_concurrent, w.draining, w.backend_error, w.requests_served,
        pending.get(w.id) || ""]);
      if (row.dataset.signature !== signature) {
        row.replaceChildren(...workerCells(w, snap.at));
        row.dataset.signature = signature;
      } else {
        row.querySelector(".connected-ago").textContent = fmtDuration(w.connected_secs) + " ago";
        // (Speeds move with every request and fade between them: updated in place.)
        row.querySelector(".speed-cell").replaceChildren(...speedLines(w));
      }
      row.classList.toggle("is-draining", w.draining);
      if (tbody.rows[index] !== row) tbody.insertBefore(row, tbody.rows[index] || null);
    });
    for (const [id, row] of existing) if (!seen.has(id)) { row.remove(); pending.delete(id); }
    const empty = snap.workers.length === 0;
    document.getElementById("empty-state").hidden = !empty;
    document.getElementById("workers-section").hidden = empty;
    setText("workers-count", empty ? "" : snap.workers.length + (snap.workers.length === 1 ? " worker" : " workers"));
  }

  async function act(button) {
    const id = button.dataset.worker, action = button.dataset.action;
    if (action === "drain" && !window.confirm("Drain worker " + id + "? It finishes its requests, then disconnects and exits.")) return;
    pending.set(id, action);
    button.disabled = true;
    try {
      const response = await fetch("/dashboard/workers/" + encodeURIComponent(id) + "/" + action, {
        method: "POST", credentials: "same-origin",
        headers: { "X-CSRFToken": csrfToken, "Accept": "application/json" },
      });
      if (!response.ok) {
        const body = await response.json().catch(() => ({}));
        flash(body.detail || "Request failed (" + response.status + ")", "error");
      } else {
        flash(action === "drain" ? "Draining " + id : "Asked " + id + " to refresh its models", "ok");
      }
    } catch (err) {
      flash("Could not reach the server", "error");
    } finally {
      window.setTimeout(() => { pending.delete(id); }, action === "refresh" ? 1500 : 0);
    }
  }

  document.getElementById("workers").addEventListener("click", (event) => {
    const button = event.target.closest("button[data-action]");
    if (button && !button.disabled) act(button);
  });

  let flashTimer = null;
  function flash(message, kind) {
    let box = document.getElementById("flash");
    if (!box) {
      box = el("div", { id: "flash", role: "status", "aria-live": "polite" });
      document.body.append(box);
    }
    box.className = "flash flash-" + kind;
    box.textContent = message;
    box.hidden = false;
    window.clearTimeout(flashTimer);
    flashTimer = window.setTimeout(() => { box.hidden = true; }, 4000);
  }

  // ---------------------------------------------------------------- providers & outcomes

  function renderProviders(snap) {
    const tbody = document.querySelector("#providers tbody");
    const rows = Object.entries(snap.stats.providers).map(([name, p]) => el("tr", { "data-provider": name }, [
      el("td", {}, [el("span", { class: "strong", text: name }),
        p.enabled ? "" : el("span", { class: "badge badge-muted", style: "margin-left:8px", text: "Disabled" })]),
      el("td", { class: "num", text: fmtInt(p.workers) }),
      el("td", { class: "num", text: p.capacity ? p.load + " / " + p.capacity : "–" }),
      el("td", { class: "num" + (p.queue_depth ? " warn-text" : ""), "data-queue": p.queue_depth, text: fmtInt(p.queue_depth) }),
    ]));
    if (!rows.length) rows.push(el("tr", {}, [el("td", { colspan: "4", class: "muted", text: "No provider yet." })]));
    tbody.replaceChildren(...rows);

    const outcomes = Object.entries(snap.stats.requests.by_outcome);
    const list = document.getElementById("outcomes");
    list.replaceChildren(...(outcomes.length
      ? outcomes.map(([name, count]) => el("li", {}, [
          el("span", { class: "outcome-name", text: name.replace(/_/g, " ") }),
          el("span", { class: "outcome-count", text: fmtInt(count) }),
        ]))
      : [el("li", { class: "muted", text: "No requests yet." })]));
  }

  // ---------------------------------------------------------------- chart

  function niceMax(n) {
    if (n <= 4) return 4;
    const magnitude = Math.pow(10, Math.floor(Math.log10(n)));
    for (const step of [1, 2, 2.5, 5, 10]) if (step * magnitude >= n) return step * magnitude;
    return 10 * magnitude;
  }

  function svg(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
    return node;
  }

  function renderChart(snap) {
    const t = snap.timeline;
    const n = t.counts[t.classes[0]].length;
    const totals = Array.from({ length: n }, (_, i) => t.classes.reduce((sum, c) => sum + t.counts[c][i], 0));
    const top = niceMax(Math.max(...totals));
    const box = document.getElementById("rate-chart");
    const W = Math.max(240, box.clientWidth || 600), H = 200, left = 34, right = 6, topPad = 8, bottom = 22;
    const plotW = W - left - right, plotH = H - topPad - bottom;
    const slot = plotW / n, barW = Math.max(2, slot * 0.72);
    const root = svg("svg", { width: W, height: H, viewBox: "0 0 " + W + " " + H, class: "chart-svg" });
    for (let k = 0; k <= 4; k++) {
      const y = topPad + plotH - (plotH * k) / 4;
      root.append(svg("line", { x1: left, x2: W - right, y1: y, y2: y, class: "grid" }));
      const label = svg("text", { x: left - 6, y: y + 4, class: "axis", "text-anchor": "end" });
      label.textContent = String(Math.round((top * k) / 4 * 10) / 10);
      root.append(label);
    }
    for (let i = 0; i < n; i++) {
      const x = left + i * slot + (slot - barW) / 2;
      let y = topPad + plotH;
      const group = svg("g", {});
      const start = t.end - (n - i) * t.bucket_secs;
      const parts = [];
      for (const c of t.classes) {
        const v = t.counts[c][i];
        if (!v) continue;
        const h = (plotH * v) / top;
        y -= h;
        group.append(svg("rect", { x: x, y: y, width: barW, height: Math.max(h, 0.5), class: "bar bar-" + c }));
        parts.push(v + " " + CLASS_LABELS[c]);
      }
      const title = svg("title", {});
      title.textContent = fmtClock(start) + " – " + (parts.length ? parts.join(", ") : "no requests");
      group.append(title);
      group.append(svg("rect", { x: left + i * slot, y: topPad, width: slot, height: plotH, class: "hit" }));
      root.append(group);
    }
    const minutes = (n * t.bucket_secs) / 60;
    for (let m = 0; m <= minutes; m++) {
      const x = left + plotW - (plotW * m) / minutes;
      const label = svg("text", { x: x, y: H - 6, class: "axis", "text-anchor": m === 0 ? "end" : m === minutes ? "start" : "middle" });
      label.textContent = m === 0 ? "now" : "−" + m + "m";
      root.append(label);
    }
    box.replaceChildren(root);

    const legend = document.getElementById("rate-legend");
    legend.replaceChildren(...t.classes.map((c) => el("li", {}, [
      el("span", { class: "swatch bar-" + c, "aria-hidden": "true" }),
      el("span", { text: CLASS_LABELS[c] + " " }),
      el("span", { class: "muted", text: fmtInt(t.counts[c].reduce((a, b) => a + b, 0)) }),
    ])));
  }

  // ---------------------------------------------------------------- who is using the pool

  function budgetCell(spent, budget, extraClass) {
    const cell = el("td", { class: "num" + (extraClass ? " " + extraClass : "") });
    if (budget === null || budget === undefined) {
      cell.textContent = fmtCompact(spent);
      return cell;
    }
    const pct = budget ? Math.min(100, Math.round((100 * spent) / budget)) : 0;
    cell.title = fmtInt(spent) + " of " + fmtInt(budget) + " tokens";
    cell.append(
      el("div", { class: "load-text" + (spent >= budget ? " warn-text" : ""), text: fmtCompact(spent) + " / " + fmtCompact(budget) }),
      el("div", { class: "meter" }, [el("span", { style: "width:" + pct + "%" })]),
    );
    return cell;
  }

  function renderKeys(snap) {
    const rows = snap.keys;
    const section = document.getElementById("keys-section");
    const table = document.getElementById("keys");
    document.getElementById("keys-off").hidden = rows !== null && rows !== undefined;
    if (rows === null || rows === undefined) {
      table.hidden = true;
      document.getElementById("keys-empty").hidden = true;
      section.dataset.keys = "off";
      return;
    }
    table.hidden = rows.length === 0;
    document.getElementById("keys-empty").hidden = rows.length > 0;
    section.dataset.keys = String(rows.length);
    const tbody = table.querySelector("tbody");
    tbody.replaceChildren(...rows.map((k) => {
      const refused = Object.entries(k.rejected_by || {}).map(([o, n]) => n + " " + o.replace(/_/g, " ")).join(", ");
      const name = k.id === null
        ? el("span", { class: "muted", text: k.name + " · " + k.keys + " keys" })
        : el("span", { class: "strong", text: k.name });
      const limits = [];
      if (k.max_concurrent) limits.push(k.max_concurrent + " at once");
      if (k.requests_per_minute) limits.push(k.requests_per_minute + "/min");
      return el("tr", { "data-key": k.id === null ? "(other)" : String(k.id) }, [
        el("td", {}, [name, limits.length ? el("div", { class: "muted small", text: limits.join(" · ") }) : ""]),
        el("td", { class: "num", "data-running": k.in_flight, text: fmtInt(k.in_flight) }),
        el("td", { class: "num" + (k.queued ? " warn-text" : ""), "data-queued": k.queued, text: fmtInt(k.queued) }),
        budgetCell(k.tokens_today, k.tokens_per_day),
        budgetCell(k.tokens_month, k.tokens_per_month, "hide-sm"),
        el("td", { class: "num" + (k.rejected ? " warn-text" : ""), title: refused || "none", text: fmtInt(k.rejected) }),
        el("td", { class: "num hide-sm", text: k.weight === undefined ? "–" : String(k.weight) }),
      ]);
    }));
  }

  // ---------------------------------------------------------------- batches

  function renderBatches(snap) {
    const rows = snap.batches || [];
    const table = document.getElementById("batches");
    table.hidden = rows.length === 0;
    document.getElementById("batches-empty").hidden = rows.length > 0;
    table.querySelector("tbody").replaceChildren(...rows.map((b) => {
      const done = b.succeeded + b.errored + b.canceled + b.expired;
      const failed = b.errored + b.canceled + b.expired;
      const pct = b.total ? Math.min(100, Math.round((100 * done) / b.total)) : 0;
      // As the batch's own API says it (Message Batches: in_progress, canceling, ended).
      const status = (b.api_status || b.status).replace(/_/g, " ");
      const active = ["validating", "in_progress", "finalizing", "cancelling"].includes(b.status);
      return el("tr", { "data-batch-id": b.id, "data-status": b.status, "data-api-status": b.api_status }, [
        el("td", {}, [el("div", { class: "strong mono small", text: b.id }),
          el("div", { class: "muted small", text: b.api === "anthropic" ? "Anthropic" : "OpenAI" })]),
        el("td", { class: "small hide-sm", text: b.key || "–" }),
        el("td", { class: "mono small hide-sm", text: b.endpoint }),
        el("td", {}, [el("span", { class: "badge " + (active ? "badge-ok" : "badge-muted"), text: status })]),
        el("td", { class: "load-cell", title: pct + "% ended" }, [
          el("div", { class: "load-text", "data-done": done, text: fmtInt(done) + " / " + fmtInt(b.total) }),
          el("div", { class: "meter" }, [el("span", { style: "width:" + pct + "%" })]),
        ]),
        el("td", { class: "num hide-sm" + (failed ? " warn-text" : ""), text: fmtInt(failed) }),
        el("td", { class: "small hide-sm", title: new Date(b.expires_at * 1000).toLocaleString(),
          text: active ? "in " + fmtDuration(b.expires_at - snap.at) : "–" }),
      ]);
    }));
  }

  // ---------------------------------------------------------------- recent requests

  // Its priority class, and how often a higher class took its slot: batch lines run
  // as flex and are the first preempted.
  function classCell(r) {
    const parts = [el("span", { class: "badge class-" + r.class, text: r.class })];
    if (r.preemptions) {
      parts.push(el("span", { class: "muted small", title: "lost its slot to a higher class " + r.preemptions + " time(s)",
        text: " preempted ×" + r.preemptions }));
    }
    return el("td", { class: "hide-sm nowrap", "data-class": r.class, "data-preemptions": r.preemptions }, parts);
  }

  function renderRecent(snap) {
    const tbody = document.querySelector("#recent tbody");
    tbody.replaceChildren(...snap.recent.map((r) => el("tr", { "data-request-id": r.request_id, "data-ended-at": r.ended_at }, [
      el("td", { class: "mono small", title: "arrived " + fmtClock(r.at), text: fmtClock(r.ended_at) }),
      el("td", { class: "strong", text: r.model || "–" }),
      el("td", { class: "small hide-sm", text: r.key || "–" }),
      r.request_id ? classCell(r) : el("td", { class: "hide-sm muted", text: "–" }), // refused: never queued
      el("td", { class: "mono small hide-sm", text: r.endpoint }),
      el("td", { class: "hide-sm", text: r.worker || "–" }),
      el("td", {}, [el("span", { class: "badge status-" + statusClass(r), title: r.outcome.replace(/_/g, " ") }, [
        String(r.status), el("span", { class: "hide-sm", text: " " + r.outcome.replace(/_/g, " ") }),
      ])]),
      el("td", { class: "num", text: fmtMs(r.duration_ms) }),
      el("td", { class: "num muted hide-sm", text: fmtMs(r.ttfb_ms) }),
      el("td", { class: "num muted hide-sm", text: r.cached_tokens == null ? "–" : fmtInt(r.cached_tokens) }),
    ])));
    document.getElementById("recent-empty").hidden = snap.recent.length > 0;
  }

  // ---------------------------------------------------------------- wiring

  let last = null;
  function render(snap) {
    last = snap;
    renderSummary(snap);
    renderWorkers(snap);
    renderProviders(snap);
    renderChart(snap);
    renderKeys(snap);
    renderBatches(snap);
    renderRecent(snap);
    document.body.dataset.snapshotAt = String(snap.at);
  }

  function setLive(state, text) {
    const box = document.getElementById("live-status");
    box.dataset.state = state;
    box.querySelector(".live-text").textContent = text;
  }

  render(JSON.parse(document.getElementById("initial-snapshot").textContent));
  let resizeTimer = null;
  window.addEventListener("resize", () => {
    window.clearTimeout(resizeTimer);
    resizeTimer = window.setTimeout(() => { if (last) renderChart(last); }, 100);
  });

  if (!window.EventSource) {
    setLive("off", "Live updates unavailable in this browser");
    return;
  }
  const source = new EventSource(eventsUrl);
  source.onopen = () => setLive("live", "Live");
  source.onmessage = (event) => {
    setLive("live", "Live");
    render(JSON.parse(event.data));
  };
  source.onerror = () => {
    if (source.readyState === EventSource.CLOSED) setLive("off", "Disconnected — reload the page (or log in again)");
    else setLive("connecting", "Reconnecting…");
  };
  window.addEventListener("pagehide", () => source.close());
})();
