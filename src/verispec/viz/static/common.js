// Shared helpers for the verispec viz pages: API calls, number formatting, small SVG drawing.
"use strict";
const SVG_NS = "http://www.w3.org/2000/svg";

// The server's API key, when it has one: given once in the page's URL fragment (#key=..., never sent to the
// server in a URL) and kept for this tab's pages.
const VIZ_KEY = (() => {
  const given = location.hash.match(/(?:^#|&)key=([^&]*)/);
  if (given) sessionStorage.setItem("verispec-key", decodeURIComponent(given[1]));
  return sessionStorage.getItem("verispec-key");
})();

async function api(path, body) {
  const headers = body === undefined ? {} : { "Content-Type": "application/json" };
  if (VIZ_KEY) headers["Authorization"] = "Bearer " + VIZ_KEY;
  const init = body === undefined ? { headers } : { method: "POST", headers, body: JSON.stringify(body) };
  const res = await fetch(path, init);
  const data = await res.json();
  if (res.status === 401) throw new Error("this visualizer needs its API key: open it as " + location.origin + "/#key=<key>");
  const error = data.error && (data.error.message || data.error);
  if (!res.ok) throw new Error(error || data.detail && JSON.stringify(data.detail) || res.statusText);
  return data;
}

function fmt(x, digits = 3) { return x === null || x === undefined ? "-" : Number(x).toFixed(digits); }

function el(tag, attrs = {}, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function svgEl(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function showError(id, err) { document.getElementById(id).textContent = err ? String(err.message || err) : ""; }

// A token's text made visible: spaces as a middle dot, newlines as a return sign.
function visible(text) { return text === "" ? "\u2205" : text.replace(/ /g, "\u00b7").replace(/\n/g, "\u21b5"); }
