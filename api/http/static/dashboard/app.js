// The foldtune dashboard's shell: sign-in, routing by URL hash, polling. A single page over the /v1 API; the
// API key is kept in sessionStorage (gone when the tab closes) and sent as X-API-Key, so the page sees exactly
// what the key's owner sees through the API. The pages live in jobs.js, plan.js and trainings.js; shared
// helpers in core.js, plots in plot.js (drawn by plotly.js).
"use strict";

const POLL_MS = 2000;
let pollTimer = null;
let renderSeq = 0;  // a page render started later wins over one still waiting for the API

function signOut(message) {
  sessionStorage.removeItem(KEY);
  stopPolling();
  showSignIn(message);
}

function showSignIn(message) {
  document.getElementById("nav").hidden = true;
  const main = document.getElementById("main");
  main.replaceChildren(h("form", {id: "signin", class: "card signin", onsubmit: async ev => {
      ev.preventDefault();
      const key = document.getElementById("api-key").value.trim();
      sessionStorage.setItem(KEY, key);
      try {
        await api("/v1/jobs?limit=1");
        route();
      } catch (e) {
        if (!(e instanceof ApiError && e.status === 401)) showSignIn(String(e.message || e));
      }
    }},
    h("h2", {}, "Sign in"),
    h("p", {}, "Paste an API key from ", h("code", {}, "foldtune keys create NAME"),
      ". It stays in this tab's session storage and is sent with each API call."),
    h("input", {id: "api-key", type: "password", placeholder: "ft_…", autocomplete: "off", required: true}),
    h("button", {type: "submit"}, "Sign in"),
    message ? h("p", {class: "error", id: "signin-error"}, message) : null));
}

function stopPolling() {
  if (pollTimer) clearTimeout(pollTimer);
  pollTimer = null;
}

function pollWhile(active) {
  stopPolling();
  if (active) pollTimer = setTimeout(() => route(true), POLL_MS);
}

// The page for a hash's parts, e.g. ["jobs", "3", "compare", "0", "2"]; null keeps the page as it is.
function pageFor(parts, refresh) {
  const [what, id, sub, a, b] = parts;
  if (what === "jobs" && id && sub === "compare") return trialComparePage(+id, +a, +b);
  if (what === "jobs" && id) return jobPage(+id);
  if (what === "plan") return refresh ? null : planPage();  // polling must not wipe the form
  if (what === "trainings" && id === "compare") return trainingComparePage(+sub, +a);
  if (what === "trainings" && id) return trainingPage(+id);
  if (what === "trainings") return trainingsPage();
  return jobsPage();
}

async function route(refresh) {
  stopPolling();
  if (!sessionStorage.getItem(KEY)) return showSignIn();
  document.getElementById("nav").hidden = false;
  const hash = location.hash || "#/jobs";
  const parts = hash.slice(2).split("/");
  for (const a of document.querySelectorAll("#nav a[data-page]")) {
    a.classList.toggle("active", a.dataset.page === parts[0]);
  }
  const seq = ++renderSeq;
  const main = document.getElementById("main");
  try {
    const page = await pageFor(parts, refresh);
    if (seq !== renderSeq || !page) return;
    Plot.purge(main);
    main.replaceChildren(page.node);
    if (page.after) page.after();
    main.dataset.loaded = hash;
    pollWhile(page.live);
  } catch (e) {
    if (seq !== renderSeq || (e instanceof ApiError && e.status === 401)) return;
    Plot.purge(main);
    main.replaceChildren(h("section", {class: "card"}, h("p", {class: "error", id: "page-error"},
      e instanceof ApiError && e.status === 404 ? `Not found: ${e.message}` : String(e.message || e))));
    main.dataset.loaded = hash;
  }
}

window.addEventListener("hashchange", () => route());
window.addEventListener("DOMContentLoaded", () => {
  document.getElementById("sign-out").addEventListener("click", () => signOut("Signed out."));
  route();
});
