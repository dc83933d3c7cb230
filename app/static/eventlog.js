// The "Session events" card: what the session said, newest first.

import { $, el } from "./dom.js";

const logList = $("#log");

export function log(text, kind = "") {
  const t = new Date().toLocaleTimeString([], { hour12: false });
  logList.prepend(el("li", { class: kind }, el("time", {}, t), el("span", {}, text)));
  while (logList.children.length > 60) logList.lastChild.remove();
}
