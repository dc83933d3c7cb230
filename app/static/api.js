// The gateway's HTTP API, with the API key when the server requires one (kept in localStorage).

export const AUTH = document.body.dataset.auth === "true";
const KEY_STORE = "zonos.apiKey";

export function apiKey() {
  return AUTH ? localStorage.getItem(KEY_STORE) || "" : "";
}

export function setApiKey(key) {
  localStorage.setItem(KEY_STORE, key);
}

// fetch() with the API key header; throws Error("code: message") on the server's JSON errors.
export async function api(path, opts = {}) {
  const headers = new Headers(opts.headers || {});
  if (apiKey()) headers.set("X-API-Key", apiKey());
  const res = await fetch(path, { ...opts, headers });
  if (!res.ok) {
    let msg = `${res.status} ${res.statusText}`;
    try {
      const j = await res.json();
      if (j.error) msg = `${j.error.message} (${j.error.code})`;
    } catch {
      /* not JSON */
    }
    const err = new Error(msg);
    err.status = res.status;
    throw err;
  }
  return res;
}
