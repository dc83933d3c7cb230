// Small DOM and formatting helpers shared by the page's modules.

export const $ = (sel) => document.querySelector(sel);

export function el(tag, props = {}, ...children) {
  const n = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (k === "class") n.className = v;
    else if (k === "dataset") Object.assign(n.dataset, v);
    else if (k.startsWith("on")) n.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null && v !== false) n.setAttribute(k, v === true ? "" : v);
  }
  n.append(...children.filter((c) => c !== null && c !== undefined));
  return n;
}

// A form's one-line answer ("Cloned ...", an error), styled by kind: "ok", "err", "muted" or none.
export function setStatus(node, text, kind = "") {
  node.textContent = text;
  node.className = `form-status ${kind}`;
}

export const fmtMs = (x) => (x == null ? "–" : x < 1000 ? `${Math.round(x)} ms` : `${(x / 1000).toFixed(2)} s`);
export const fmtS = (samples, rate) => `${(samples / rate).toFixed(1)} s`;
