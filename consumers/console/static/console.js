// Scheduled Events console: the page's whole behaviour. Plain JavaScript, no build step.
//
// The server sends batches of changed rows (server-sent events, every 250 ms at most); each
// batch updates only the rows it names: a row is created, re-rendered in place, moved to its
// sorted place, or removed. The NotBefore countdown and agent silence are computed here, from
// the server's clock (each batch says what time it is there).
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const stats = { batches: 0, resets: 0, rowsCreated: 0, rowsUpdated: 0, rowsRemoved: 0, rowsRendered: 0, applyMs: 0, longestApplyMs: 0 };
  window.consoleStats = stats;

  const state = {
    me: null,
    events: new Map(),      // id -> row (from the server)
    agents: new Map(),      // key (VM name, case-folded) -> row
    eventsOfVm: new Map(),  // key -> Set(event id): which event rows show this agent
    agentStatus: new Map(), // key -> "online" | "silent" | "offline"
    offset: 0,              // server clock - local clock, ms
    liveness: 150,
    filter: "",
    showOnline: false,
    current: null,          // the event shown in the event view
  };

  // --------------------------------------------------------------------- small helpers

  const serverNow = () => Date.now() + state.offset;
  const key = (name) => (name || "").toLowerCase();

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "class") node.className = value;
      else if (name === "text") node.textContent = value;
      else node.setAttribute(name, value === true ? "" : value);
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function utc(iso) {
    if (!iso) return "–";
    return iso.replace("T", " ").replace(/\.\d+/, "").replace(/\+00:00$|Z$/, " UTC");
  }

  function span(ms) {
    const total = Math.floor(Math.abs(ms) / 1000);
    const d = Math.floor(total / 86400), h = Math.floor((total % 86400) / 3600);
    const m = Math.floor((total % 3600) / 60), s = total % 60;
    const two = (n) => String(n).padStart(2, "0");
    if (d > 0) return `${d} d ${h} h`;
    if (h > 0) return `${h}:${two(m)}:${two(s)}`;
    return `${m}:${two(s)}`;
  }

  function ago(iso) {
    if (!iso) return "none yet";
    return `${span(serverNow() - Date.parse(iso))} ago`;
  }

  function toast(text, error) {
    const box = $("toast");
    box.textContent = text;
    box.className = error ? "toast error" : "toast";
    box.setAttribute("role", error ? "alert" : "status");
    box.hidden = false;
    clearTimeout(toast.timer);
    toast.timer = setTimeout(() => { box.hidden = true; }, error ? 12000 : 6000);
  }

  async function api(path, options) {
    const response = await fetch(path, Object.assign({ credentials: "same-origin" }, options));
    if (response.status === 401) {
      location.assign("/login");
      throw new Error("signed out");
    }
    let body = {};
    try { body = await response.json(); } catch (_) { /* not JSON */ }
    if (!response.ok) {
      const error = new Error(body.error || `${response.status} ${response.statusText}`);
      error.status = response.status;
      throw error;
    }
    return body;
  }

  function post(path, data) {
    return api(path, {
      method: "POST",
      headers: { "Content-Type": "application/json", "X-CSRF-Token": state.me.csrf },
      body: JSON.stringify(data || {}),
    });
  }

  // --------------------------------------------------------------------- what a row says

  function agentStatus(agent) {
    if (!agent) return "unknown";
    if (!agent.online) return "offline";
    // Its own liveness (from the heartbeat interval it declares) when the server sent one.
    const liveness = agent.liveness || state.liveness;
    return serverNow() - Date.parse(agent.last_seen) > liveness * 1000 ? "silent" : "online";
  }

  function statusOf(event) {
    if (!event.open) return { text: event.phase === "canceled" ? "Canceled" : "Completed", cls: "b-muted" };
    const parts = [];
    let cls = event.phase === "started" ? "b-started" : "b-scheduled";
    parts.push(event.phase === "started" ? "Started" : "Scheduled");
    const approval = event.approval;
    if (event.approved) {
      const applied = event.outcomes.find((o) => o.applied && !o.dry_run);
      parts.push(`approved${applied ? ` on ${applied.vm}` : ""}`);
      cls = event.phase === "started" ? cls : "b-ok";
    } else if (approval && approval.outcome === "sent") {
      parts.push(`approval sent to ${approval.target}`);
      cls = "b-ok";
    } else if (approval && approval.outcome === "rejected") {
      parts.push(`approval rejected (${approval.detail})`);
    }
    if (event.hold) { parts.push(`held by ${event.hold.by}`); cls = "b-hold"; }
    return { text: parts.join(" · "), cls };
  }

  function duration(event) {
    if (event.duration < 0) return "unknown";
    if (event.duration === 0) return "none (0 s)";
    return `${event.duration} s`;
  }

  function hooksText(event) {
    const out = [];
    for (const vm of event.vms) {
      for (const hook of vm.hooks) {
        out.push(`${vm.name}: ${hook.name} ${hook.ok ? "ok" : hook.outcome}`);
      }
    }
    return out;
  }

  function decisionText(event) {
    const d = event.decision;
    const lines = [];
    if (d) lines.push(`${d.action}: ${d.reason} (${d.policy})`);
    const a = event.action;
    if (a) lines.push(`operator ${a.by}: ${a.action}${a.reason ? ` (${a.reason})` : ""}`);
    return lines;
  }

  function countdown(event) {
    if (!event.not_before) return { text: "–", soon: false };
    const left = Date.parse(event.not_before) - serverNow();
    if (left >= 0) return { text: `in ${span(left)}`, soon: left < 120000 };
    return { text: `passed ${span(left)} ago`, soon: true };
  }

  function searchable(event) {
    if (event._search === undefined) event._search = searchText(event);
    return event._search;
  }

  function searchText(event) {
    const parts = [event.id, event.type, event.phase, event.source || "", statusOf(event).text];
    for (const vm of event.vms) {
      parts.push(vm.name);
      const agent = state.agents.get(key(vm.name));
      if (agent) parts.push(agent.scale_set || "", agent.zone || "");
    }
    return parts.join(" ").toLowerCase();
  }

  // --------------------------------------------------------------------- sorted tables

  // A table of many rows, sorted, of which the page holds only the first `limit` that match
  // the filter: a burst of 10,000 events costs a sorted insert each and one reconciliation
  // of at most `limit` rows per batch, never a redraw of 10,000. A row is rendered when its
  // data changes while it is on the page, or when it comes onto the page.
  class SortedTable {
    constructor(body, more, { keyOf, render, matches, limit }) {
      Object.assign(this, { body, more, keyOf, render, matches, limit, step: limit });
      this.rows = new Map(); // id -> { data, key, tr, stale }
      this.order = [];       // [{ key, id }] sorted by key
      this.dirty = false;
      if (more) {
        more.addEventListener("click", () => { this.limit += this.step; this.sync(true); });
      }
    }

    find(key) {
      let lo = 0, hi = this.order.length;
      while (lo < hi) {
        const mid = (lo + hi) >> 1;
        if (compare(this.order[mid].key, key) < 0) lo = mid + 1; else hi = mid;
      }
      return lo;
    }

    upsert(id, data) {
      const key = this.keyOf(data);
      let row = this.rows.get(id);
      if (row) {
        stats.rowsUpdated++;
        if (compare(row.key, key) !== 0) {
          this.unorder(id, row.key);
          this.order.splice(this.find(key), 0, { key, id });
          this.dirty = true;
        }
        Object.assign(row, { data, key, stale: true });
        this.dirty = true; // it may match the filter no longer, or again
        if (row.tr && row.tr.isConnected) this.paint(row);
      } else {
        stats.rowsCreated++;
        row = { data, key, tr: null, stale: true };
        this.rows.set(id, row);
        this.order.splice(this.find(key), 0, { key, id });
        this.dirty = true;
      }
    }

    unorder(id, key) {
      const at = this.find(key);
      if (this.order[at] && this.order[at].id === id) this.order.splice(at, 1);
    }

    remove(id) {
      const row = this.rows.get(id);
      if (!row) return;
      stats.rowsRemoved++;
      this.unorder(id, row.key);
      if (row.tr) row.tr.remove();
      this.rows.delete(id);
      this.dirty = true;
    }

    repaint(id) {
      const row = this.rows.get(id);
      if (!row) return;
      row.stale = true;
      row.data._search = undefined;
      this.dirty = true;
      if (row.tr && row.tr.isConnected) this.paint(row);
    }

    paint(row) {
      if (!row.tr) row.tr = el("tr");
      this.render(row.tr, row.data);
      row.stale = false;
      stats.rowsRendered++;
    }

    // Put on the page exactly the first `limit` matching rows, in order.
    sync(force) {
      if (!this.dirty && !force) return;
      this.dirty = false;
      const wanted = [];
      let matching = 0;
      for (const { id } of this.order) {
        const row = this.rows.get(id);
        if (!this.matches(row.data)) continue;
        matching++;
        if (wanted.length < this.limit) wanted.push(row);
        else if (!state.filter) { matching = this.visibleCount(); break; }
      }
      let cursor = this.body.firstChild;
      for (const row of wanted) {
        if (row.stale || !row.tr) this.paint(row);
        if (cursor === row.tr) { cursor = cursor.nextSibling; continue; }
        this.body.insertBefore(row.tr, cursor);
      }
      while (cursor) { const next = cursor.nextSibling; cursor.remove(); cursor = next; }
      if (this.more) {
        const hidden = matching - wanted.length;
        this.more.hidden = hidden <= 0;
        this.more.textContent = `Show ${Math.min(this.step, hidden)} more (${hidden} not shown)`;
      }
    }

    visibleCount() {
      let n = 0;
      for (const row of this.rows.values()) if (this.matches(row.data)) n++;
      return n;
    }

    each(fn) { for (const row of this.rows.values()) if (row.tr && row.tr.isConnected) fn(row); }
  }

  function compare(a, b) {
    for (let i = 0; i < a.length; i++) {
      if (a[i] < b[i]) return -1;
      if (a[i] > b[i]) return 1;
    }
    return 0;
  }

  // One element inside each cell, so that at phone width (a grid: label, content) a cell of
  // several parts stays in the content column.
  function cell(label, ...children) {
    return el("td", { "data-label": label }, el("div", {}, ...children));
  }

  // --------------------------------------------------------------------- event rows

  function renderEventRow(tr, event) {
    const status = statusOf(event);
    const vms = el("ul");
    const shown = event.vms.slice(0, 6);
    for (const vm of shown) {
      const agent = state.agents.get(key(vm.name));
      const where = agent ? [agent.scale_set, agent.zone ? `zone ${agent.zone}` : null].filter(Boolean).join(" · ") : "";
      const live = agentStatus(agent);
      vms.append(el("li", {}, vm.name, where ? el("span", { class: "small" }, ` (${where})`) : null,
        live !== "online" ? el("span", { class: "small" }, ` – agent ${live}`) : null));
    }
    if (event.vms.length > shown.length) vms.append(el("li", { class: "small" }, `+${event.vms.length - shown.length} more`));
    const hooks = hooksText(event);
    const decision = decisionText(event);
    const when = countdown(event);
    const link = el("a", { href: `#/event/${encodeURIComponent(event.id)}`, class: "event-id", title: event.id,
      "aria-label": `Event ${event.type} ${event.id}` }, event.id.slice(0, 8));
    tr.replaceChildren(
      cell("Event", link),
      cell("Type", event.type, event.source ? el("div", { class: "small" }, event.source) : null),
      cell("VMs", vms),
      cell("Status", el("span", { class: `badge ${status.cls}` }, status.text)),
      cell("NotBefore", el("time", { class: `countdown${when.soon ? " soon" : ""}`, datetime: event.not_before || null,
        title: event.not_before ? utc(event.not_before) : null }, when.text)),
      cell("Duration", duration(event)),
      cell("Hooks", hooks.length ? el("ul", {}, ...hooks.map((h) => el("li", {}, h))) : "–"),
      cell("Decision", decision.length ? el("ul", {}, ...decision.map((d) => el("li", {}, d))) : "–"),
    );
    tr.dataset.eventId = event.id;
    tr.dataset.version = event.version;
    tr.dataset.phase = event.phase;
  }

  const eventMatches = (event) => !state.filter || searchable(event).includes(state.filter);
  const tables = {};

  function indexVms(event, add) {
    for (const vm of event.vms) {
      const k = key(vm.name);
      let set = state.eventsOfVm.get(k);
      if (add) {
        if (!set) state.eventsOfVm.set(k, (set = new Set()));
        set.add(event.id);
      } else if (set) {
        set.delete(event.id);
        if (!set.size) state.eventsOfVm.delete(k);
      }
    }
  }

  function upsertEvent(event) {
    const previous = state.events.get(event.id);
    if (previous) indexVms(previous, false);
    state.events.set(event.id, event);
    indexVms(event, true);
    (event.open ? tables.ended : tables.open).remove(event.id);
    (event.open ? tables.open : tables.ended).upsert(event.id, event);
  }

  function removeEvent(id) {
    const event = state.events.get(id);
    if (!event) return;
    indexVms(event, false);
    state.events.delete(id);
    tables.open.remove(id);
    tables.ended.remove(id);
  }

  function repaintEvent(id) {
    tables.open.repaint(id);
    tables.ended.repaint(id);
  }

  // --------------------------------------------------------------------- agent rows

  const STATUS_RANK = { offline: 0, silent: 1, online: 2, unknown: 3 };

  function renderAgentRow(tr, agent) {
    const status = agentStatus(agent);
    const cls = { online: "b-ok", silent: "b-started", offline: "b-bad" }[status] || "b-muted";
    const said = status === "offline" && agent.offline_reason ? ` (${agent.offline_reason})` : "";
    tr.replaceChildren(
      cell("VM", agent.name),
      cell("Scale set", agent.scale_set || "–"),
      cell("Zone", agent.zone || "–"),
      cell("Status", el("span", { class: `badge ${cls}` }, status + said)),
      cell("Last heartbeat", el("span", { class: "ago", "data-at": agent.last_heartbeat || "", title: utc(agent.last_heartbeat) }, ago(agent.last_heartbeat))),
      cell("Last heard", el("span", { class: "ago", "data-at": agent.last_seen || "", title: utc(agent.last_seen) }, ago(agent.last_seen))),
      cell("Agent", agent.version || "–"),
    );
    tr.dataset.vm = agent.name;
    tr.dataset.status = status;
  }

  function agentMatches(agent) {
    const status = state.agentStatus.get(agent.key) || agentStatus(agent);
    if (status === "online" && !state.showOnline) return false;
    if (!state.filter) return true;
    return `${agent.name} ${agent.scale_set || ""} ${agent.zone || ""} ${status}`.toLowerCase().includes(state.filter);
  }

  function upsertAgent(agent) {
    const before = state.agents.get(agent.key);
    state.agents.set(agent.key, agent);
    const status = agentStatus(agent);
    const changed = !before || before.scale_set !== agent.scale_set || before.zone !== agent.zone
      || state.agentStatus.get(agent.key) !== status;
    state.agentStatus.set(agent.key, status);
    tables.agents.upsert(agent.key, agent);
    if (changed) for (const id of state.eventsOfVm.get(agent.key) || []) repaintEvent(id);
  }

  function removeAgent(k) {
    state.agents.delete(k);
    state.agentStatus.delete(k);
    tables.agents.remove(k);
  }

  // --------------------------------------------------------------------- batches

  function reset() {
    stats.resets++;
    for (const id of [...state.events.keys()]) removeEvent(id);
    for (const k of [...state.agents.keys()]) removeAgent(k);
  }

  function apply(batch) {
    const began = performance.now();
    applyBatch(batch);
    const took = performance.now() - began;
    stats.applyMs += took;
    stats.longestApplyMs = Math.max(stats.longestApplyMs, took);
  }

  function applyBatch(batch) {
    stats.batches++;
    state.offset = Date.parse(batch.now) - Date.now();
    state.liveness = batch.liveness || state.liveness;
    if (batch.reset) reset();
    for (const agent of batch.agents) upsertAgent(agent);
    for (const event of batch.events) upsertEvent(event);
    for (const id of batch.removed || []) removeEvent(id);
    for (const k of batch.removed_agents || []) removeAgent(k);
    if (batch.final) {
      for (const table of Object.values(tables)) table.sync();
      summarize();
      if (state.current && (batch.reset || batch.events.some((e) => e.id === state.current)
          || (batch.removed || []).includes(state.current))) {
        renderEventView(false);
      }
    }
  }

  function summarize() {
    $("open-count").textContent = tables.open.rows.size;
    $("ended-count").textContent = tables.ended.rows.size;
    $("no-events").hidden = tables.open.rows.size > 0;
    let scheduled = 0, started = 0, held = 0;
    for (const row of tables.open.rows.values()) {
      if (row.data.phase === "started") started++; else scheduled++;
      if (row.data.hold) held++;
    }
    $("summary").textContent = `${scheduled} scheduled, ${started} started, ${held} held`;
    const counts = { online: 0, silent: 0, offline: 0 };
    for (const status of state.agentStatus.values()) counts[status] = (counts[status] || 0) + 1;
    $("agent-summary").textContent =
      `${counts.online} online, ${counts.silent} silent, ${counts.offline} offline (silent: not heard for ${state.liveness} s, or longer where an agent declares a longer heartbeat interval)`;
  }

  function tick() {
    // Agents fall silent as time passes, with no message to say so.
    for (const [k, agent] of state.agents) {
      const status = agentStatus(agent);
      if (state.agentStatus.get(k) !== status) upsertAgent(agent);
    }
    for (const table of [tables.open, tables.ended]) {
      table.each((row) => {
        const time = row.tr.querySelector("time.countdown");
        const when = countdown(row.data);
        if (time && time.textContent !== when.text) {
          time.textContent = when.text;
          time.classList.toggle("soon", when.soon);
        }
      });
    }
    tables.agents.each((row) => {
      for (const span of row.tr.querySelectorAll(".ago")) span.textContent = ago(span.dataset.at || null);
    });
    for (const table of Object.values(tables)) table.sync();
    if (state.current) {
      const event = state.events.get(state.current);
      const left = $("event-countdown");
      if (event && left) left.textContent = countdown(event).text;
    }
    summarize();
  }

  let source = null;
  function connect() {
    const line = $("connection");
    source = new EventSource("/api/stream");
    source.addEventListener("batch", (message) => {
      apply(JSON.parse(message.data));
      line.textContent = "Live";
      line.classList.add("live");
    });
    source.onerror = async () => {
      line.textContent = "Reconnecting…";
      line.classList.remove("live");
      if (source.readyState === EventSource.CLOSED) {
        try { await api("/api/me"); } catch (_) { return; }
        setTimeout(connect, 2000);
      }
    };
  }

  // --------------------------------------------------------------------- the event view

  function fact(dl, name, ...value) {
    dl.append(el("dt", {}, name), el("dd", {}, ...value));
  }

  function renderEventView(focus) {
    const id = state.current;
    const event = state.events.get(id);
    const title = $("event-title");
    const facts = $("event-facts");
    const actions = $("event-actions");
    const body = $("event-vms").tBodies[0];
    if (!event) {
      title.textContent = `Event ${id}`;
      facts.replaceChildren(el("dt", {}, "Now"), el("dd", {}, "Not in the fleet view (over and forgotten, or never seen); its timeline follows."));
      actions.replaceChildren();
      body.replaceChildren();
    } else {
      title.textContent = `${event.type} ${event.id}`;
      const status = statusOf(event);
      facts.replaceChildren();
      fact(facts, "Status", el("span", { class: `badge ${status.cls}` }, status.text));
      fact(facts, "NotBefore", event.not_before ? `${utc(event.not_before)} (` : "–",
        event.not_before ? el("span", { id: "event-countdown", class: "countdown" }, countdown(event).text) : null,
        event.not_before ? ")" : null);
      fact(facts, "Duration", duration(event));
      fact(facts, "Source", event.source || "–");
      fact(facts, "Description", event.description || "–");
      fact(facts, "Version", el("code", { id: "event-version" }, event.version));
      const d = event.decision;
      fact(facts, "Approver's decision", d ? `${d.action}: ${d.reason} (${d.policy}, ${utc(d.at)})` : "none yet");
      if (event.action) fact(facts, "Last operator action", `${event.action.action} by ${event.action.by}: ${event.action.reason} (${utc(event.action.at)})`);
      if (event.hold) fact(facts, "Hold", `held by ${event.hold.by} since ${utc(event.hold.at)}: ${event.hold.reason}`);
      if (event.approval) {
        const a = event.approval;
        fact(facts, "Approval", `${a.outcome}${a.detail ? ` (${a.detail})` : ""}: to ${a.target}${a.by ? ` by ${a.by}` : ""} at ${utc(a.at)}`);
      }
      if (event.silent.length) fact(facts, "Not reported by", event.silent.join(", "));
      renderActions(actions, event);
      body.replaceChildren(...event.vms.map((vm) => {
        const agent = state.agents.get(key(vm.name));
        const hooks = vm.hooks.map((h) => `${h.name} on ${h.transition}: ${h.ok ? "ok" : h.outcome}`);
        return el("tr", {},
          cell("VM", vm.name),
          cell("Scale set", (agent && agent.scale_set) || "–"),
          cell("Zone", (agent && agent.zone) || "–"),
          cell("Agent", agentStatus(agent)),
          cell("Last report", vm.report ? `${vm.report} (${vm.status}) ${utc(vm.at)}` : "none"),
          cell("Hooks", hooks.length ? el("ul", {}, ...hooks.map((h) => el("li", {}, h))) : "–"));
      }));
    }
    refreshTimeline();
    if (focus) title.focus();
  }

  function renderActions(box, event) {
    box.replaceChildren();
    const me = state.me;
    if (!me.may_act) {
      box.append(el("p", { class: "hint" }, `You are signed in as a ${me.role}: you can look, not act.`));
      return;
    }
    if (!event.open) return;
    if (event.phase !== "scheduled") {
      box.append(el("p", { class: "hint" }, "The event started: there is nothing left to approve or hold."));
      if (!event.hold) return;
    } else {
      const approve = el("button", { type: "button", id: "approve" }, "Approve now…");
      approve.addEventListener("click", () => confirmAction("approve", event));
      if (me.can_approve) box.append(approve);
      else box.append(el("p", { class: "hint" }, "This console has no signing key: it cannot approve."));
    }
    if (event.hold) {
      const release = el("button", { type: "button", id: "release", class: "quiet" }, "Release the hold…");
      release.addEventListener("click", () => confirmAction("release", event));
      box.append(release);
    } else if (event.phase === "scheduled") {
      const hold = el("button", { type: "button", id: "hold", class: "danger" }, "Hold…");
      hold.addEventListener("click", () => confirmAction("hold", event));
      box.append(hold);
    }
  }

  const wording = {
    approve: (e) => [`Approve ${e.type} ${e.id} now`,
      `Azure may then start it at once for every VM of the event: ${e.resources.join(", ")}. ` +
      `The approval is bound to the version you see (${e.version}): if the event changes, the agent refuses it.`],
    hold: (e) => [`Hold ${e.type} ${e.id}`,
      "The automatic approver will not approve it: it starts at NotBefore, unless an operator approves it or the hold is released."],
    release: (e) => [`Release the hold on ${e.id}`, "The automatic approver decides on it again at once."],
  };

  function confirmAction(action, event) {
    const dialog = $("confirm");
    const [title, text] = wording[action](event);
    $("confirm-title").textContent = title;
    $("confirm-text").textContent = text;
    $("confirm-warning").hidden = true;
    $("confirm-reason").value = "";
    $("confirm-ok").textContent = { approve: "Approve", hold: "Hold", release: "Release" }[action];
    const version = event.version; // bound to what is on screen now
    dialog.returnValue = "";
    dialog.onclose = async () => {
      if (dialog.returnValue !== "confirm") return;
      const reason = $("confirm-reason").value;
      try {
        const body = action === "approve" ? { version, reason } : { reason };
        const result = await post(`/api/events/${encodeURIComponent(event.id)}/${action}`, body);
        toast(result.message);
      } catch (error) {
        toast(error.status === 409 && action === "approve" ? `Not sent: ${error.message}` : `Refused: ${error.message}`, true);
      }
      refreshTimeline();
    };
    dialog.showModal();
    $("confirm-reason").focus();
  }

  let timelineTimer = null;
  function refreshTimeline() {
    clearTimeout(timelineTimer);
    timelineTimer = setTimeout(async () => {
      const id = state.current;
      if (!id) return;
      try {
        const result = await api(`/api/events/${encodeURIComponent(id)}/timeline`);
        if (state.current === id) $("timeline").textContent = [result.header, ...result.lines].join("\n");
      } catch (error) {
        $("timeline").textContent = `The timeline could not be read: ${error.message}`;
      }
    }, 300);
  }

  // --------------------------------------------------------------------- history

  async function search(form) {
    const params = new URLSearchParams();
    for (const [name, value] of new FormData(form)) if (String(value).trim()) params.set(name, String(value).trim());
    const list = $("history-results");
    try {
      const result = await api(`/api/history?${params}`);
      list.replaceChildren(...result.entries.map((entry) => el("li", {},
        entry.event_id ? el("a", { href: `#/event/${encodeURIComponent(entry.event_id)}` }, entry.line) : entry.line)));
      $("history-count").textContent = result.count
        ? `${result.count} entries${result.count >= result.limit ? " (the newest; narrow the search for more)" : ""}, oldest first, UTC`
        : "Nothing recorded matches.";
    } catch (error) {
      $("history-count").textContent = `Search refused: ${error.message}`;
    }
  }

  // --------------------------------------------------------------------- navigation

  function route() {
    const hash = location.hash || "#/";
    const match = hash.match(/^#\/event\/(.+)$/);
    const view = match ? "event" : hash.startsWith("#/history") ? "history" : "fleet";
    $("fleet-view").hidden = view !== "fleet";
    $("event-view").hidden = view !== "event";
    $("history-view").hidden = view !== "history";
    for (const [id, name] of [["nav-fleet", "fleet"], ["nav-history", "history"]]) {
      if (view === name) $(id).setAttribute("aria-current", "page");
      else $(id).removeAttribute("aria-current");
    }
    state.current = match ? decodeURIComponent(match[1]) : null;
    if (view === "event") renderEventView(true);
    document.title = view === "event" ? `Event ${state.current} · Scheduled Events console`
      : view === "history" ? "History · Scheduled Events console" : "Scheduled Events console";
  }

  function applyFilter() {
    state.filter = $("filter").value.trim().toLowerCase();
    for (const table of Object.values(tables)) table.sync(true);
  }

  async function start() {
    tables.open = new SortedTable($("open-rows"), $("more-open"), {
      keyOf: (e) => [e.phase === "started" ? 0 : 1, e.not_before || "9999", e.id],
      render: renderEventRow, matches: eventMatches, limit: 200,
    });
    tables.ended = new SortedTable($("ended-rows"), $("more-ended"), {
      keyOf: (e) => [-Date.parse(e.last_update || 0), e.id],
      render: renderEventRow, matches: eventMatches, limit: 100,
    });
    tables.agents = new SortedTable($("agent-rows"), $("more-agents"), {
      keyOf: (a) => [STATUS_RANK[agentStatus(a)], a.key],
      render: renderAgentRow, matches: agentMatches, limit: 200,
    });
    state.me = await api("/api/me");
    state.liveness = state.me.liveness;
    $("user").textContent = `${state.me.operator_name} · ${state.me.role}`;
    $("sign-out").addEventListener("click", async () => {
      try { await post("/logout"); } finally { location.assign("/login"); }
    });
    let filterTimer = null;
    $("filter").addEventListener("input", () => { clearTimeout(filterTimer); filterTimer = setTimeout(applyFilter, 150); });
    $("show-online").addEventListener("change", (e) => { state.showOnline = e.target.checked; applyFilter(); });
    $("history-form").addEventListener("submit", (e) => { e.preventDefault(); search(e.target); });
    window.addEventListener("hashchange", route);
    route();
    connect();
    setInterval(tick, 1000);
  }

  document.addEventListener("DOMContentLoaded", () => { start().catch((error) => toast(`The console could not start: ${error.message}`, true)); });
})();
