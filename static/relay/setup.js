// ModelRelay setup wizard: copy buttons, platform tabs, the provider form's modes,
// and step 4, which asks the server once a second whether the new worker is connected.
(function () {
  "use strict";

  // ---------------------------------------------------------------- copy buttons

  function copyText(text) {
    if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
    // Plain-http pages (a relay on the LAN) have no clipboard API: select and copy.
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.append(area);
    area.select();
    try { document.execCommand("copy"); } finally { area.remove(); }
    return Promise.resolve();
  }

  document.addEventListener("click", (event) => {
    const button = event.target.closest("[data-copy]");
    if (!button) return;
    const selector = button.dataset.copy;
    const source = selector ? document.querySelector(selector) : button.parentElement.querySelector("pre");
    if (!source) return;
    copyText(source.textContent).then(() => {
      button.textContent = "Copied";
      button.classList.add("copied");
      window.setTimeout(() => { button.textContent = "Copy"; button.classList.remove("copied"); }, 1500);
    });
  });

  // ---------------------------------------------------------------- step 1: guess the platform

  const chooser = document.getElementById("choose-form");
  if (chooser && !chooser.querySelector('input[name="platform"]:checked')) {
    const ua = (navigator.userAgentData && navigator.userAgentData.platform) || navigator.platform || navigator.userAgent;
    const guess = /win/i.test(ua) ? "windows" : /mac/i.test(ua) ? "macos" : "linux";
    const input = chooser.querySelector('input[name="platform"][value="' + guess + '"]');
    if (input) input.checked = true;
  }

  // ---------------------------------------------------------------- step 3: provider form

  const form = document.getElementById("worker-form");
  if (form) {
    const sync = () => {
      const mode = (form.querySelector('input[name="mode"]:checked') || {}).value || "new";
      form.querySelectorAll("[data-mode]").forEach((field) => { field.hidden = !field.dataset.mode.split(" ").includes(mode); });
    };
    form.addEventListener("change", sync);
    sync();
  }

  // ---------------------------------------------------------------- step 3: platform tabs

  document.querySelectorAll(".tabs").forEach((tabs) => {
    tabs.addEventListener("click", (event) => {
      const tab = event.target.closest("[data-tab]");
      if (!tab) return;
      tabs.querySelectorAll("[data-tab]").forEach((t) => t.setAttribute("aria-selected", String(t === tab)));
      document.querySelectorAll("[data-panel]").forEach((panel) => { panel.hidden = panel.dataset.panel !== tab.dataset.tab; });
    });
  });

  // ---------------------------------------------------------------- step 4: wait for the worker

  const confirmBox = document.getElementById("confirm");
  if (!confirmBox) return;
  const statusUrl = confirmBox.dataset.statusUrl;
  const errorBox = document.getElementById("status-error");
  let failures = 0;

  function showReady(body) {
    document.getElementById("waiting").hidden = true;
    const list = document.getElementById("ready-workers");
    list.replaceChildren(...body.workers.map((w) => {
      const item = document.createElement("li");
      item.dataset.workerId = w.id;
      const name = document.createElement("strong");
      name.textContent = w.name;
      const models = document.createElement("span");
      models.className = "muted";
      models.textContent = w.models.length ? w.models.join(", ") : "no models yet";
      const load = document.createElement("span");
      load.className = "muted small";
      load.textContent = w.max_concurrent + (w.max_concurrent === 1 ? " slot" : " slots");
      item.append(name, models, load);
      return item;
    }));
    document.getElementById("no-model").hidden = Boolean(body.model);
    document.getElementById("curl-test").textContent = body.curl;
    document.getElementById("powershell-test").textContent = body.powershell;
    document.getElementById("powershell-block").hidden = confirmBox.dataset.platform !== "windows";
    document.getElementById("key-note").hidden = !body.api_key_required;
    document.getElementById("ready").hidden = false;
    const steps = document.querySelectorAll(".stepper li");
    steps.forEach((li, i) => {
      li.className = i < steps.length - 1 ? "done" : "current";
      if (i === steps.length - 1) li.setAttribute("aria-current", "step"); else li.removeAttribute("aria-current");
    });
  }

  async function poll() {
    let delay = 1000;
    try {
      const response = await fetch(statusUrl, { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (response.status === 403) {
        errorBox.textContent = "Your login expired: log in again in another tab; this page keeps checking.";
        errorBox.hidden = false;
        delay = 5000;
      } else if (response.ok) {
        const body = await response.json();
        errorBox.hidden = true;
        failures = 0;
        if (body.ready) { showReady(body); return; }
      } else {
        throw new Error("status " + response.status);
      }
    } catch (err) {
      failures += 1;
      delay = Math.min(10000, 1000 * 2 ** Math.min(failures, 4));
      errorBox.textContent = "Cannot reach the server right now; retrying…";
      errorBox.hidden = false;
    }
    window.setTimeout(poll, delay);
  }
  poll();
})();
