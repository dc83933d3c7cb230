"""The docs say what the code does: every flag, route, message, params key and error code they name exists, the
ones that exist are written down where a user looks (every code our socket's modules raise in docs/protocol.md),
the params tables' defaults are the options' own, the commands they show name real scripts and flags and the
README's commands do what it says, and their links resolve; every file and symbol the contributing guide names
exists, and so does every symbol a user doc pins to a file and every variable or constant a doc names.
docs/benchmarks.md, docs/changelog.md and docs/bench-summaries/ record measurements of past builds and are left
out."""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
import re
from functools import cache
from pathlib import Path

import pytest

from app.__main__ import build_parser
from app.core.options import LONG_FORM_KEYS, PARAM_KEYS, SynthesisOptions
from app.doors import ws
from app.io.errors import GatewayError
from engine.contract.errors import EngineError
from engine.contract.flags import add_flags
from engine.contract.settings import WeightSources
from engine.frontend.textnorm import SUPPORTED_LANGUAGES

ROOT = Path(__file__).resolve().parents[2]
USER_DOCS = [
    "README.md",
    *(f"docs/{n}.md" for n in ("architecture", "clients", "dialects", "protocol", "reliability", "scaling")),
]
# the contributor's guide: checked as the user docs are (flags, paths, links, sections), and every file and symbol
# it names exists; it documents no flag, code or metric for a user (those checks read USER_DOCS alone)
CONTRIBUTING = "docs/contributing.md"
CHECKED_DOCS = [*USER_DOCS, CONTRIBUTING]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def text(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def prose(name: str) -> str:
    """A doc with its whitespace runs made one space (phrases wrap across lines)."""
    return re.sub(r"\s+", " ", text(name))


def test_the_checked_docs_are_every_doc_but_the_measurements() -> None:
    docs = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")} | {"README.md"}
    assert docs - set(CHECKED_DOCS) == {"docs/benchmarks.md", "docs/changelog.md"}


# ---- flags -----------------------------------------------------------------------------------------------------
@cache
def gateway_flags() -> frozenset[str]:
    return frozenset(s for a in build_parser()._actions for s in a.option_strings if s.startswith("--"))


@cache
def source_flags(path: str) -> frozenset[str]:
    """The --flags a script's argparse declares (read from its source: importing a bench script pulls in torch)."""
    return frozenset(re.findall(r"""["'](--[a-z][a-z0-9-]*)["']""", text(path)))


# A flag belongs to the last tool named before it in its command (the gateway when none is): a bench script, the
# engine's command line, the test script (pytest's flags), or an outside program the docs show. A command is a line
# of a code block (with the indented lines that continue it) or a run of inline code spans joined only by commas and
# slashes (`logits --cfg-scale` / `--uncond-input-ids`); a flag in neither is the gateway's.
TOOLS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"bench/(\w+)\.py"), "bench"),
    (
        re.compile(
            r"python -m engine\b|zonos-engine|\b(?:make-checkpoint|speaker-embed|synthesize|logits|prompt) [-\"]"
        ),
        "engine",
    ),
    (re.compile(r"deploy\.ray_local"), "deploy/ray_local.py"),
    (re.compile(r"(?<![\w-])-- --"), "gateway"),  # deploy.ray_local's `-- SERVER FLAGS`
    (re.compile(r"scripts/serve|python -m app\b|zonos-gateway"), "gateway"),
    (re.compile(r"scripts/test"), "scripts/test"),
    (re.compile(r"ray start"), "ray"),
    (re.compile(r"http\.server"), "http.server"),
    (re.compile(r"\bcurl\b"), "curl"),
    (re.compile(r"\bruff\b"), "ruff"),
]
OUTSIDE = {
    "scripts/test": {"--fast", "--dist"},  # its own switch; pytest-xdist's (the docs quote -n 2 --dist loadfile)
    "ray": {"--head", "--address"},
    "http.server": {"--directory"},
    "curl": {"--http2"},  # docs/reliability.md: what such a client sends
    "ruff": {"--check"},  # `ruff format --check .`: docs/contributing.md's check before a commit
}


def known_flags(tool: str, script: str | None) -> frozenset[str]:
    if tool == "bench":
        return source_flags(f"bench/{script}.py")
    if tool == "engine":  # its weight flags are the gateway's (add_flags(WeightSources))
        weights = argparse.ArgumentParser()
        add_flags(weights, WeightSources)
        return source_flags("engine/cli.py") | {s for a in weights._actions for s in a.option_strings}
    if tool == "deploy/ray_local.py":
        return source_flags(tool)
    if tool == "gateway":
        return gateway_flags()
    return frozenset(OUTSIDE[tool])


def marks(command: str) -> list[tuple[int, str, str | None]]:
    """Where a command names a tool: (offset, tool, bench script)."""
    return sorted((m.start(), t, m.group(1) if m.groups() else None) for p, t in TOOLS for m in p.finditer(command))


def flag_uses(name: str) -> list[tuple[str, frozenset[str], str]]:
    """(flag, the flags it may be, context) for every --flag of a doc. In a code block a flag is its line's tool's
    (an indented line continues the one before); in prose, its run of inline code spans' (`logits --cfg-scale` /
    `--uncond-input-ids`), or, in a run that names no tool, the gateway's or one of a tool the paragraph (or list
    item) named before it ("`bench/soak.py` ... `--duration` seconds")."""
    uses = []
    prose_parts = []
    for i, part in enumerate(re.split(r"^```.*$", text(name), flags=re.M)):
        if not i % 2:
            prose_parts.append(part)
            continue
        tool: tuple[str, str | None] = ("gateway", None)
        for line in part.splitlines():
            if not line[:1].isspace():
                tool = ("gateway", None)
            for m in FLAG.finditer(line):
                at = [(t, s) for o, t, s in marks(line) if o < m.start()]
                uses.append((m.group(), known_flags(*(at[-1] if at else tool)), line.strip()))
            for _, t, s in marks(line):
                tool = (t, s)
    for paragraph in re.split(r"\n\s*\n|\n(?=\s*[*-] )", "\n".join(prose_parts)):
        paragraph = re.sub(r"\s+", " ", paragraph)
        before: frozenset[str] = gateway_flags()
        for run in re.split(r"(`[^`]+`(?:[\s,/]*`[^`]+`)*)", paragraph):
            named = marks(run)
            for m in FLAG.finditer(run):
                at = [(t, s) for o, t, s in named if o < m.start()]
                uses.append(
                    (m.group(), known_flags(*at[-1]) if at else before, run[max(0, m.start() - 60) : m.end() + 20])
                )
            for _, t, s in named:
                before = before | known_flags(t, s)
    return uses


@pytest.mark.parametrize("name", CHECKED_DOCS)
def test_every_flag_a_doc_names_exists_in_its_tool(name: str) -> None:
    wrong = [f"{flag}: ...{context}..." for flag, known, context in flag_uses(name) if flag not in known]
    assert not wrong, f"{name} names flags its tool does not have:\n" + "\n".join(wrong)


@pytest.mark.parametrize("name", ["deploy/ray_serve.yaml", "deploy/ray_serve_local.yaml"])
def test_the_ray_configs_give_the_gateway_flags_it_has(name: str) -> None:
    """Their `gateway_args` are `python -m app`'s flags (a replica that cannot parse them never starts)."""
    args = re.findall(r"gateway_args: \[(.*?)\]", text(name), flags=re.S)
    assert args
    wrong = [f for f in re.findall(r'"(--[a-z0-9-]+)"', " ".join(args)) if f not in gateway_flags()]
    assert not wrong, f"{name}: {wrong}"


def test_every_gateway_flag_is_in_the_docs() -> None:
    """`python -m app --help` lists them all, and each is explained somewhere a user reads (a --no-X is its --X's)."""
    docs = " ".join(text(n) for n in USER_DOCS)
    named = set(FLAG.findall(docs))
    missing = sorted(
        f
        for f in gateway_flags()
        if f not in named and f.replace("--no-", "--", 1) not in named and "--no-" + f[2:] not in named
    )
    assert not missing, f"gateway flags no doc explains: {missing}"


@cache
def defaults() -> dict[str, object]:
    return {s: a.default for a in build_parser()._actions for s in a.option_strings}


UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def number(text: str, unit: str | None) -> float:
    return float(re.sub(r"[ ,]", "", text)) * UNITS.get(unit or "", 1)


@pytest.mark.parametrize("name", CHECKED_DOCS)
def test_a_default_a_doc_gives_a_flag_is_its_default(name: str) -> None:
    """ "`--continuation-grace-ms` (40 ms)", "`--stitch-ttl-s`, 600 s", "`--stitch-bytes` (4 MiB)": the parser's."""
    wrong = []
    for m in re.finditer(r"`(--[a-z0-9-]+)`,? \(?(\d[\d,]*(?:\.\d+)?)(?: ?(ms|s|KiB|MiB|GiB))?(?=[),;] )", prose(name)):
        flag, value, unit = m.groups()
        if flag in defaults() and number(value, unit) != defaults()[flag]:
            wrong.append(f"{m.group()} (default {defaults()[flag]})")
    assert not wrong, f"{name} gives flags defaults they do not have: {wrong}"


def test_the_limits_table_gives_each_flag_its_default() -> None:
    """docs/reliability.md's table of limits: a default column that is a number is the flag's default."""
    table = text("docs/reliability.md").split("## Limits\n", 1)[1].split("\n## ", 1)[0]
    checked, wrong = 0, []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4:
            continue
        value = re.fullmatch(r"(\d[\d ,]*(?:\.\d+)?) ?(KiB|MiB|GiB)?(?: .*)?", cells[1])
        flag = re.search(r"`(--[a-z0-9-]+)`", cells[2])
        if value and flag:
            checked += 1
            if number(*value.groups()) != defaults()[flag.group(1)]:
                wrong.append(f"{flag.group(1)}: {cells[1]} (default {defaults()[flag.group(1)]})")
    assert checked >= 20 and not wrong, f"{checked} rows checked; wrong defaults: {wrong}"


# ---- routes, messages, params, error codes ---------------------------------------------------------------------
def _path(p: str) -> str:
    return re.sub(r"\{[^}]*\}", "{}", p)


def test_every_route_is_written_out_in_the_readme_or_the_dialects_doc(tmp_path: Path) -> None:
    from app.server import create_app
    from app.settings import GatewaySettings

    routes = {getattr(r, "path", "") for r in create_app(GatewaySettings(data_dir=tmp_path)).routes} - {
        "/{path:path}",
        "/static",
    }
    docs = _path(text("README.md") + text("docs/dialects.md") + text("docs/protocol.md"))
    missing = sorted(p for p in routes if not re.search(re.escape(_path(p)) + r"(?![\w/-])", docs))
    assert not missing, (
        f"routes the README (HTTP endpoints), docs/dialects.md or docs/protocol.md do not name: {missing}"
    )


def test_every_route_a_doc_names_is_served(tmp_path: Path) -> None:
    from app.server import create_app
    from app.settings import GatewaySettings

    paths = {getattr(r, "path", "") for r in create_app(GatewaySettings(data_dir=tmp_path)).routes}
    served = [re.compile(re.sub(r"\\\{[^}]*\\\}", "[^/]+", re.escape(p)) + "$") for p in paths if "{path:" not in p]
    named = {
        m.rstrip(".").rstrip("/")
        for n in CHECKED_DOCS
        for m in re.findall(r"(?<![\w.:/-])(/(?:v1|tts|healthz|readyz|metrics)[\w/{}.-]*)", text(n))
    }
    assert len(named) > 20
    unknown = sorted(p for p in named if not any(r.match(p) for r in served))
    assert not unknown, f"the docs name routes the gateway does not serve: {unknown}"


def test_every_method_a_doc_gives_a_route_is_served(tmp_path: Path) -> None:
    """ "`GET/PATCH/DELETE /v1/voices/{id}`", "`POST /tts/bytes`": the route takes that method (a 405 otherwise)."""
    from app.server import create_app
    from app.settings import GatewaySettings

    served = [
        (re.compile(re.sub(r"\\\{[^}]*\\\}", "[^/]+", re.escape(r.path)) + "$"), getattr(r, "methods", None) or set())
        for r in create_app(GatewaySettings(data_dir=tmp_path)).routes
        if "{path:" not in getattr(r, "path", "{path:")
    ]
    said = [
        (methods.split("/"), re.sub(r"\[/\{id\}\]$", "", path.rstrip(".")), n)
        for n in CHECKED_DOCS
        for methods, path in re.findall(
            r"\b((?:GET|POST|PUT|PATCH|DELETE)(?:/(?:GET|POST|PUT|PATCH|DELETE))*)`? `?(/[\w/{}.-]*)", prose(n)
        )
    ]
    assert len(said) > 30
    wrong = []
    for methods, path, n in said:
        allowed = set().union(*(m for rx, m in served if rx.match(path)))
        wrong += [f"{n}: {m} {path}" for m in methods if m not in allowed]
    assert not wrong, f"the docs give routes methods they do not take: {wrong}"


def protocol_table(heading: str) -> dict[str, str]:
    """A table of docs/protocol.md under `## heading`: its first column's `name` -> the row."""
    doc = text("docs/protocol.md")
    section = doc.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    table = section[section.index("\n|") :].split("\n\n", 1)[0]  # its first table
    rows = {}
    for line in table.splitlines():
        m = re.match(r"\| `([\w.]+)` \|", line)
        if m:
            rows[m.group(1)] = line
    return rows


def test_every_message_type_of_our_socket_is_in_the_protocol_doc_and_no_other() -> None:
    source = inspect.getsource(ws) + inspect.getsource(__import__("app.core.session", fromlist=["x"]))
    sent = set(re.findall(r'"type": "([\w.]+)"', source))
    taken = set(re.findall(r'kind == "([\w.]+)"', inspect.getsource(ws)))
    assert {"session.created", "audio.start", "error"} <= sent and {"text", "cancel"} <= taken  # (the patterns hold)
    assert set(protocol_table("Server → client")) == sent
    assert set(protocol_table("Client → server")) == taken


@pytest.mark.parametrize("dialect", ["elevenlabs", "cartesia", "deepgram"])
def test_every_field_the_dialects_write_is_in_their_doc(dialect: str) -> None:
    """The keys of the dicts a dialect's socket and HTTP routes write (their messages, headers and bodies, and the
    tables of names they read) are each named in docs/dialects.md: a client reads the shapes there."""
    doc = text("docs/dialects.md")
    written = {
        key
        for path in (f"app/doors/dialects/{dialect}.py", f"app/doors/dialects/{dialect}_http.py")
        for key in re.findall(r'"([A-Za-z_]+)": ', text(path))
    }
    assert len(written) > 5  # (the pattern finds them)
    missing = sorted(k for k in written if not re.search(rf"(?<![\w-]){k}", doc))
    assert not missing, f"docs/dialects.md does not name the {dialect} fields {missing}"


def test_every_field_of_our_client_messages_is_in_its_protocol_row() -> None:
    rows = protocol_table("Client → server")
    source = inspect.getsource(ws.Session)
    fields = {
        "session.config": re.search(r"def _on_config.*?_check_fields\(data, (\{.*?\})\)", source, re.S),
        "text": re.search(r"def _text_message.*?_check_fields\(data, (\{.*?\})\)", source, re.S),
    }
    for message, found in fields.items():
        assert found is not None
        missing = [
            f for f in ast.literal_eval(found.group(1)) if f"`{f}`" not in rows[message]
        ]  # a set literal of names
        assert not missing, f"docs/protocol.md's {message} row does not name {missing}"


def test_every_field_of_our_session_messages_is_in_its_protocol_row() -> None:
    """session.created (its limits and model facts) and session.updated, as app/doors/ws.py writes them."""
    rows = protocol_table("Server → client")
    weights = WeightSources(aligner_path="model.pt").describe()  # (the model facts name them, the aligner with one)
    created = [*re.findall(r'"(\w+)":', inspect.getsource(ws.Session.on_open)), *weights]
    updated = re.findall(r'"(\w+)":', inspect.getsource(ws.Session._on_config).split('"session.updated"')[1])
    for message, fields in (("session.created", created), ("session.updated", updated)):
        missing = [f for f in fields if f != "type" and f"`{f}`" not in rows[message]]
        assert not missing, f"docs/protocol.md's {message} row does not name {missing}"


def test_the_params_tables_list_every_params_key_and_no_other() -> None:
    doc = text("docs/protocol.md").split("## Server → client")[0]
    keys = set()
    for line in doc.splitlines():
        m = re.match(r"\| (`\w+`(?: / `\w+`)*) \|", line)
        if m:
            keys |= set(re.findall(r"`(\w+)`", m.group(1)))
    assert keys - {"session.config", "text", "flush", "cancel", "close"} == PARAM_KEYS


def option_default(key: str) -> object:
    """What a params key is when a request leaves it out (SynthesisOptions, the one place every API starts from)."""
    opts = SynthesisOptions()
    emotion = {"emotion_enabled": "enabled", "emotion_sliders": "sliders", "emotion_valence": "valence"}
    emotion |= {"emotion_arousal": "arousal", "emotion_strength": "strength"}
    for obj, attr in (
        (opts.sampling, key),
        (opts.long_form, LONG_FORM_KEYS.get(key, "")),
        (opts.emotion, emotion.get(key, "")),
        (opts.cond, key),
        (opts, key),
    ):
        if attr and hasattr(obj, attr):
            return getattr(obj, attr)
    raise KeyError(key)


def test_the_params_tables_give_each_key_its_default() -> None:
    """docs/protocol.md's params tables: a default that is a value (`1.15`, `true`, `{}`, `word`, `en_us`), not words
    ("random", "server limit", "off"), is the key's default."""
    doc = text("docs/protocol.md").split("## Server → client")[0]
    checked, wrong = 0, []
    for line in doc.splitlines():
        m = re.match(r"\| (`\w+`(?: / `\w+`)*) \| (.*?) \|", line)
        if not m or m.group(1) in ("`session.config`", "`text`", "`flush`", "`cancel`", "`close`"):
            continue
        keys = re.findall(r"`(\w+)`", m.group(1))
        cells = m.group(2).split(" / ")  # one default for all the row's keys, or one each
        for key, cell in zip(keys, cells * len(keys) if len(cells) == 1 else cells, strict=True):
            try:
                said = json.loads(cell.strip("`"))
            except ValueError:
                if not re.fullmatch(r"`\w+`", cell):
                    continue  # words ("random", "server limit"), not a value
                said = cell.strip("`")
            checked += 1
            if said != option_default(key):
                wrong.append(f"{key}: {cell} (default {option_default(key)!r})")
    assert checked >= 25 and not wrong, f"{checked} keys checked; wrong defaults: {wrong}"


def test_the_language_row_lists_the_languages_the_normalizer_takes() -> None:
    row = re.search(r"^\| `language` \|.*\|(.*)\|$", text("docs/protocol.md"), flags=re.M)
    assert row is not None
    assert re.findall(r"\b[a-z]{2,3}(?:_[a-z]{2})?\b", row.group(1).split(":", 1)[1]) == list(SUPPORTED_LANGUAGES)


CODES = [*GatewayError, *EngineError]


@pytest.mark.parametrize("code", CODES, ids=[c.value for c in CODES])
def test_every_error_code_is_documented(code: GatewayError | EngineError) -> None:
    """The engine's codes (what any stream can end with) in docs/protocol.md; the gateway's in a doc a user of its
    API reads (the dialects' own in docs/dialects.md)."""
    where = ["docs/protocol.md"] if isinstance(code, EngineError) else USER_DOCS
    assert any(re.search(rf"`{re.escape(code.value)}`", text(n)) for n in where), f"no doc of {where} names `{code}`"


# The modules whose codes a client of our own socket (/v1/tts/ws) can get: its door, the handshake, the session core
# and the checks it runs. Exempt: the dialects' own (a lane per context) and what is counted but never sent.
SOCKET_MODULES = [
    "app/doors/ws.py",
    "app/doors/handshake.py",
    *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "app/core").glob("*.py"))),
    *(f"app/io/{n}.py" for n in ("auth", "checks", "json_input", "query_input")),
    "app/voices/lexicons.py",
]
NOT_ON_OUR_SOCKET = {"too_many_contexts": "the dialects' (docs/dialects.md)", "client_stalled": "counted only"}


def test_every_code_our_socket_can_send_is_in_the_protocol_doc() -> None:
    """A code the socket's modules raise (`G.X`, `E.X`) is one docs/protocol.md names: a client reads its codes
    there, not in the enum (a new one raised on the socket and written only elsewhere fails here)."""
    members = {"G": GatewayError, "E": EngineError}
    raised = {
        members[e][name].value
        for path in SOCKET_MODULES
        for e, name in re.findall(r"\b([GE])\.([A-Z][A-Z_]+)\b", text(path))
    }
    assert {"bad_message", "buffer_full", "engine_busy", "upload_too_large"} <= raised  # (the pattern finds them)
    doc = text("docs/protocol.md")
    missing = sorted(c for c in raised - set(NOT_ON_OUR_SOCKET) if f"`{c}`" not in doc)
    assert not missing, f"codes our socket can send that docs/protocol.md does not name: {missing}"


def test_the_openai_field_table_is_the_routes_fields() -> None:
    """docs/clients.md's table of `POST /v1/audio/speech` fields: every OpenAI field the route takes (and `null`),
    OpenAI's voice names as the route knows them, every response_format it takes with its aliases."""
    from app.doors.openai_speech import _OPENAI_FIELDS, OPENAI_VOICES
    from app.io.audio_output import FORMAT_ALIASES, FORMATS

    doc = text("docs/clients.md").split("## OpenAI SDK (Python)", 1)[1].split("\n## ", 1)[0]
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `(\w+)` \| (.*) \|$", doc, flags=re.M)}
    assert set(rows) == _OPENAI_FIELDS | {"null"}
    assert set(re.findall(r"`(\w+)`", rows["voice"].split("(", 1)[1].split(")", 1)[0])) == OPENAI_VOICES
    assert set(re.findall(r"`(\w+)`", rows["response_format"])) == set(FORMATS) | set(FORMAT_ALIASES)


def metric_names() -> list[str]:
    """Every metric the gateway exports, as Prometheus names it (a counter's family without `_total`)."""
    from app.core.metrics import Metrics

    return sorted({m.name for m in Metrics().registry.collect()})


@pytest.mark.parametrize("name", metric_names())
def test_every_metric_is_documented(name: str) -> None:
    """An operator finds each metric /metrics exports in a user doc: by its name, or, for an engine's gauges
    (docs/scaling.md), as `..._<rest>` after the unlabelled gauge it repeats."""
    short = "..." + name.removeprefix("zonos_engine") if name.endswith("_by_engine") else None
    assert any(name in text(n) or (short and short in text(n)) for n in USER_DOCS), f"no user doc names {name}"


def outside_parentheses(s: str) -> str:
    while (t := re.sub(r"\([^()]*\)", "", s)) != s:
        s = t
    return s


@pytest.mark.parametrize(
    "name,start,end",
    [
        ("docs/protocol.md", "Error codes: ", "Close codes:"),
        ("docs/reliability.md", "Other codes a client can see: ", "Over the WebSocket an error never"),
    ],
)
def test_the_lists_of_error_codes_name_only_codes(name: str, start: str, end: str) -> None:
    """Every code of the docs' lists (their glosses in parentheses aside) is a GatewayError or EngineError code."""
    listed = re.findall(r"`(\w+)`", outside_parentheses(prose(name).split(start, 1)[1].split(end, 1)[0]))
    assert len(listed) > 20
    unknown = sorted(set(listed) - {c.value for c in CODES})
    assert not unknown, f"{name} lists codes no API answers with: {unknown}"


# A status the code's table does not give, which a doc names with its reason: RequestError's status override
OTHER_STATUSES = {("voice_store_unavailable", 507)}  # a full disk (app/voices/library.py `_store_error`)


@pytest.mark.parametrize("name", CHECKED_DOCS)
def test_a_status_a_doc_gives_a_code_is_its_status(name: str) -> None:
    """ "413 `upload_too_large`", "`host_not_allowed` (403)": the status app/io/errors.py's `http_status` gives it."""
    from app.io.errors import http_status

    codes = {c.value for c in CODES}
    said = [(int(s), c) for s, c in re.findall(r"\b([45]\d\d) `(\w+)`", prose(name))]
    said += [(int(s), c) for c, s in re.findall(r"`(\w+)` \(([45]\d\d)[),;:]", prose(name))]
    wrong = sorted(
        f"{s} {c} (its status: {http_status(c)})"
        for s, c in said
        if c in codes and s != http_status(c) and (c, s) not in OTHER_STATUSES
    )
    assert not wrong, f"{name} gives codes statuses they do not have: {wrong}"


def test_the_protocol_doc_gives_each_engine_code_its_http_status() -> None:
    doc = prose("docs/protocol.md")
    m = re.search(r"400 for (.*?); 503 for (.*?); an unknown engine code is a bug and answers 500 `internal`", doc)
    assert m, "docs/protocol.md no longer says the engine codes' statuses in one sentence"
    said = {c: 400 for c in re.findall(r"`(\w+)`", m.group(1))} | {c: 503 for c in re.findall(r"`(\w+)`", m.group(2))}
    said["internal"] = 500
    assert said == {c.value: c.http_status for c in EngineError}


# ---- commands, paths, links ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CHECKED_DOCS)
def test_every_repository_path_a_doc_names_exists(name: str) -> None:
    paths = re.findall(r"(?<![\w/.-])((?:app|engine|bench|tests|scripts|deploy|docs|\.ci)/[\w./-]*[\w/])", text(name))
    missing = sorted({p for p in paths if not (ROOT / p).exists()})
    assert not missing, f"{name} names paths that do not exist: {missing}"


OUTSIDE_FILES = {"tts_ui.html"}  # the reference server's web UI (docs/clients.md), not ours


@cache
def repository_file_names() -> frozenset[str]:
    """The names of the repository's files (hidden folders but .ci, such as the virtualenvs and .git, left out)."""
    names: set[str] = set()
    for _, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d == ".ci" or (not d.startswith(".") and d not in ("data", "__pycache__"))]
        names.update(files)
    return frozenset(names)


@pytest.mark.parametrize("name", CHECKED_DOCS)
def test_every_file_a_doc_names_by_its_name_alone_exists(name: str) -> None:
    """docs/architecture.md's tree (`admission.py (the rule), profile.py (...)`), "`model.py`, no torchaudio
    needed": a bare file name is some file of the repository (a path is checked whole above); `*_http.py` is a
    pattern."""
    named = set(re.findall(r"(?<![\w/.*-])([A-Za-z_][\w-]*\.(?:py|js|sh|yaml|toml|html|css))\b", text(name)))
    missing = sorted(named - repository_file_names() - OUTSIDE_FILES)
    assert not missing, f"{name} names files the repository does not have: {missing}"


def test_the_scripts_the_docs_run_are_executable() -> None:
    """`scripts/serve`, `deploy/setup-ray.sh`, `.ci/run`: run as the docs write them, not through bash."""
    script = r"(?<![\w/.-])((?:scripts|\.ci)/[\w-]+|deploy/[\w-]+\.sh)\b"
    named = {p for n in CHECKED_DOCS for p in re.findall(script, text(n))}
    assert {"scripts/serve", "scripts/test", "deploy/setup-ray.sh"} <= named
    assert not [p for p in named if not os.access(ROOT / p, os.X_OK)]


def script_lines(path: str) -> list[str]:
    """A script's commands: its lines without comments."""
    return [s for line in text(path).splitlines() if (s := line.split(" #", 1)[0].strip()) and not s.startswith("#")]


def test_the_readme_commands_do_what_it_says() -> None:
    """README "Two commands": `scripts/serve` and `scripts/test` both run `scripts/setup` (the test script with the
    browser), the server gets the serve script's arguments, the tests run in two pytest-xdist workers by file
    (`-n 2 --dist loadfile`, one process with `TEST_WORKERS=0`), `--fast` runs ruff, mypy, tests/unit and
    tests/engine without the slow tests, and `.ci/run` runs `.ci/install-check`, then `scripts/test`."""
    readme = prose("README.md")
    for said in (
        "Both run `scripts/setup`",
        "`.ci/run` checks a plain `pip install .` (`.ci/install-check`), then runs `scripts/test`",
        "`scripts/test --fast` is the lane to run on every change: ruff, mypy, `tests/unit` and `tests/engine` "
        "without the slow tests",
        "`-n 2 --dist loadfile`; `TEST_WORKERS=0 scripts/test` runs one process",
    ):
        assert said in readme, f"the README no longer says {said!r}: update this test with it"
    serve, test, ci = script_lines("scripts/serve"), script_lines("scripts/test"), script_lines(".ci/run")
    assert "scripts/setup" in serve and 'exec .venv/bin/python -m app "$@"' in serve
    assert "scripts/setup --browser" in test and "scripts/setup" in test
    assert {".venv/bin/ruff check .", ".venv/bin/ruff format --check .", ".venv/bin/mypy"} <= set(test)
    assert 'workers=(-n "${TEST_WORKERS:-2}" --dist loadfile)' in test
    assert '[ "${TEST_WORKERS:-2}" = 0 ] && workers=()' in test
    fast = [s for s in test if "tests/unit tests/engine" in s]
    assert fast and '-m "not slow"' in fast[0]
    assert ci.index(".ci/install-check") < ci.index("exec scripts/test -q")


def anchors(name: str) -> set[str]:
    """GitHub's anchors of a doc's headings."""
    doc = re.sub(r"```.*?```", "", text(name), flags=re.S)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#+\s+(.*?)\s*$", doc, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("name", CHECKED_DOCS)
def test_every_link_resolves(name: str) -> None:
    bad = []
    for link in re.findall(r"\]\(([^)\s]+)\)", text(name)):
        if re.match(r"\w+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (ROOT / name).parent / path if path else ROOT / name
        unresolved = not target.exists() or (
            bool(anchor) and target.suffix == ".md" and anchor not in anchors(str(target.resolve().relative_to(ROOT)))
        )
        if unresolved:
            bad.append(link)
    assert not bad, f"{name}: links that do not resolve: {bad}"


@pytest.mark.parametrize("name", CHECKED_DOCS)
def test_every_section_a_doc_cites_by_name_exists(name: str) -> None:
    """`docs/reliability.md, "Shutting down"`: a heading, or a paragraph's bold lead, of that doc."""
    bad = []
    for doc, title in re.findall(r'(docs/\w+\.md|README(?:\.md)?)[,:]? \(?"([^"]{2,80})"', prose(name)):
        target = "README.md" if doc.startswith("README") else doc
        t = text(target)
        leads = re.findall(r"^#+\s+(.*)$", t, flags=re.M) + re.findall(r"\*\*([^*]+)\*\*", prose(target))
        if not any(re.sub(r"\s+", " ", h).lower().startswith(title.lower().rstrip(".")) for h in leads):
            bad.append(f"{doc} {title!r}")
    assert not bad, f"{name} cites sections that do not exist: {bad}"


# ---- the contributing guide: every file and symbol it names ----------------------------------------------------
# A code span that is a repository file (`app/core/options.py`, `pyproject.toml`), optionally with a symbol
# (`app/core/options.py:parse_options`, `app/core/session.py:StreamingSession.render_error`, a test as
# `tests/unit/test_docs.py::test_x`, a shell variable as `bench/device_env.sh:GPU_TESTS`); or a bare class or
# one of its members (`SubmitRequest`, `SamplingParams.validate`): some module of app/ or engine/ defines it.
FILE_SPAN = re.compile(
    r"(?P<path>(?:app|engine|bench|tests|scripts|deploy|docs|\.ci)/[\w./-]*[\w/]|[\w-]+\.(?:md|toml|py))"
    r"(?:::?(?P<symbol>[A-Za-z_]\w*(?:\.\w+)*))?"
)
CLASS_SPAN = re.compile(r"[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*(?:\.\w+)*")
SOURCE_FOLDERS = ("app", "engine")  # where a bare class is looked for


@cache
def module(path: str) -> ast.Module:
    return ast.parse(text(path))


def members(node: ast.AST) -> dict[str, ast.AST]:
    """The names a module or class body defines (functions, classes, assignments, annotated fields; a class's
    instance attributes too, `self.x = ...` in its methods)."""
    out: dict[str, ast.AST] = {}
    for n in getattr(node, "body", []):
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out[n.name] = n
        elif isinstance(n, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            for t in targets:
                for name in ast.walk(t):
                    if isinstance(name, ast.Name):
                        out.setdefault(name.id, n)
    if isinstance(node, ast.ClassDef):
        for n in ast.walk(node):
            if isinstance(n, ast.Assign | ast.AnnAssign):
                for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        out.setdefault(t.attr, n)
    return out


def defines(path: str, symbol: str) -> bool:
    """Whether `path` defines `symbol`: a dotted name through a Python module's classes, or a word of any other file
    (a shell variable, a pyproject key)."""
    if not path.endswith(".py"):
        return re.search(rf"(?<![\w-]){re.escape(symbol)}(?![\w-])", text(path)) is not None
    node: ast.AST = module(path)
    for part in symbol.split("."):
        if not isinstance(node, ast.Module | ast.ClassDef) or part not in members(node):
            return False
        node = members(node)[part]
    return True


@cache
def top_level_names() -> dict[str, tuple[str, ...]]:
    """Every name a module of app/ or engine/ defines at its top level -> the modules that define it."""
    found: dict[str, list[str]] = {}
    for folder in SOURCE_FOLDERS:
        for p in sorted((ROOT / folder).rglob("*.py")):
            path = str(p.relative_to(ROOT))
            for name in members(module(path)):
                found.setdefault(name, []).append(path)
    return {k: tuple(v) for k, v in found.items()}


def reference_exists(span: str) -> bool:
    """A code span of the guide that names a file, a file's symbol or a class (member) names one that exists; any
    other span is no reference (True)."""
    if m := FILE_SPAN.fullmatch(span):
        if not (ROOT / m["path"]).is_file() and not (ROOT / m["path"]).is_dir():
            return False
        return m["symbol"] is None or ((ROOT / m["path"]).is_file() and defines(m["path"], m["symbol"]))
    if CLASS_SPAN.fullmatch(span):
        name = span.split(".", 1)[0]
        return any(defines(path, span) for path in top_level_names().get(name, ()))
    return True


def references(name: str) -> list[str]:
    """The code spans of a doc that name a file, a file's symbol or a class (member)."""
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text(name), flags=re.M | re.S))
    return [s for s in spans if FILE_SPAN.fullmatch(s) or CLASS_SPAN.fullmatch(s)]


def test_every_reference_of_the_contributing_guide_exists() -> None:
    """Each recipe names the files and functions to change: one renamed or removed fails here, naming the span."""
    named = references(CONTRIBUTING)
    symbols = [s for s in named if ":" in s or not FILE_SPAN.fullmatch(s)]
    assert len(named) > 100 and len(symbols) > 60, (len(named), len(symbols))  # (the patterns still find them)
    missing = sorted({s for s in named if not reference_exists(s)})
    assert not missing, f"{CONTRIBUTING} names files or symbols that do not exist: {missing}"


@pytest.mark.parametrize(
    "span,exists",
    [
        ("app/core/options.py", True),
        ("app/core/no_such_module.py", False),
        ("app/core/options.py:parse_options", True),
        ("app/core/options.py:no_such_function", False),
        ("app/core/session.py:StreamingSession.render_error", True),
        ("app/core/session.py:StreamingSession.no_such_method", False),
        ("app/core/metrics.py:Metrics.errors", True),  # an instance attribute (`self.errors = ...`)
        ("engine/contract/records.py:SubmitRequest.first_samples", True),  # a dataclass field
        ("app/io/errors.py:GatewayError.BAD_PARAMS", True),  # an enum member
        ("app/core/options.py:parse_options.params", False),  # no name inside a function
        ("tests/unit/test_docs.py::test_every_reference_of_the_contributing_guide_exists", True),
        ("bench/device_env.sh:GPU_TESTS", True),
        ("bench/device_env.sh:NO_SUCH_LIST", False),
        ("SamplingParams.validate", True),
        ("SamplingParams.no_such_method", False),
        ("NoSuchClass", False),
        ("session.config", True),  # no reference: a message type
    ],
)
def test_a_reference_exists_only_where_its_file_defines_it(span: str, exists: bool) -> None:
    assert reference_exists(span) is exists


# ---- names and symbols of the code ------------------------------------------------------------------------------
CAPS_NAME = re.compile(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]*[A-Z0-9]\b")  # ZONOS_API_KEYS, HOL_GRACE_S, PARAM_KEYS
PLACEHOLDERS = {"PREV_CODES", "YOUR_CODE"}  # `--context-codes PREV_CODES.npy`, `RequestError(G.YOUR_CODE, ...)`


@cache
def source_words() -> frozenset[str]:
    """Every such name the repository's code, scripts and configuration hold (docs aside)."""
    words: set[str] = set()
    for folder in ("app", "engine", "bench", "tests", "scripts", "deploy", ".ci"):
        for p in (ROOT / folder).rglob("*"):
            if p.is_file() and p.suffix in {"", ".py", ".sh", ".js", ".yaml", ".toml", ".json"}:
                words |= set(CAPS_NAME.findall(p.read_text(encoding="utf-8", errors="replace")))
    return frozenset(words | set(CAPS_NAME.findall(text("pyproject.toml"))))


@pytest.mark.parametrize("name", CHECKED_DOCS)
def test_every_variable_and_constant_a_doc_names_exists(name: str) -> None:
    """`ZONOS_API_KEYS`, `TEST_WORKERS`, `HOLD_PER_AUDIO_S`, `UNSUPPORTED_TAGS`: an environment variable, constant
    or code a doc names is read or defined somewhere in the code (one renamed there is a lie here)."""
    unknown = sorted(set(CAPS_NAME.findall(text(name))) - source_words() - PLACEHOLDERS)
    assert not unknown, f"{name} names variables or constants no code has: {unknown}"


# A user doc pins a symbol to its file: "app/core/tag_vocabulary.py `attributes`", "(`codec_delay`,
# app/io/audio_output.py)", "`parse_options` in app/core/options.py".
CODE_FILE = r"((?:app|engine|bench|tests|scripts|deploy)/[\w./-]*\.(?:py|js|sh))"
PINNED = [
    re.compile(CODE_FILE + r",? `([A-Za-z_][\w.]*)`"),
    re.compile(r"`([A-Za-z_][\w.]*)`,? (?:in |\()?" + CODE_FILE),
]


def pinned_symbols(name: str) -> list[tuple[str, str]]:
    t = prose(name)
    return [(m[1], m[2]) for m in PINNED[0].finditer(t)] + [(m[2], m[1]) for m in PINNED[1].finditer(t)]


def pinned_symbol_exists(path: str, symbol: str) -> bool:
    """The file defines it (a module's or class's name), or a class of the file has it (`_step` beside
    `Scheduler.iterate`), or a class of the code does (`EngineSettings.cpus`, engine/contract/cpus.py: two
    references side by side), or the file assigns, defines or quotes it (a local list, an env variable, a report
    key)."""
    if not (ROOT / path).is_file():
        return False
    if reference_exists(f"{path}:{symbol}") or (CLASS_SPAN.fullmatch(symbol) and reference_exists(symbol)):
        return True
    if path.endswith(".py"):
        classes = [n for n in ast.walk(module(path)) if isinstance(n, ast.ClassDef)]
        if any(symbol in members(c) for c in classes):
            return True
    word = re.escape(symbol.rsplit(".", 1)[-1])
    defined = rf"\b(?:def|class|function|const|let|var)\s+{word}\b|\b{word}\s*(?::|=(?!=))|[\"']{word}[\"']"
    return re.search(defined, text(path)) is not None


@pytest.mark.parametrize("name", USER_DOCS)
def test_every_symbol_a_user_doc_pins_to_a_file_is_there(name: str) -> None:
    pins = pinned_symbols(name)
    missing = sorted({f"{p} `{s}`" for p, s in pins if not pinned_symbol_exists(p, s)})
    assert not missing, f"{name} names symbols their files do not have: {missing}"


def test_the_pinned_symbols_are_found() -> None:
    pins = [pin for n in USER_DOCS for pin in pinned_symbols(n)]
    assert len(pins) > 30 and ("app/core/options.py", "parse_options") in pins, len(pins)
    assert not pinned_symbol_exists("app/core/options.py", "no_such_function")
    assert not pinned_symbol_exists("app/static/session.js", "no_such_function")
    assert pinned_symbol_exists("app/static/session.js", "stall")


@cache
def known_tests() -> frozenset[str]:
    """Every test function and test file (its name without .py) of tests/."""
    names = set()
    for p in (ROOT / "tests").rglob("test_*.py"):
        names |= {p.stem, *re.findall(r"^\s*(?:async )?def (test_\w+)", text(str(p.relative_to(ROOT))), flags=re.M)}
    return frozenset(names)


@pytest.mark.parametrize("name", CHECKED_DOCS)
def test_every_test_a_doc_names_exists(name: str) -> None:
    """reliability.md's tables of tests, "`test_idle_session_is_closed`": a test renamed or removed is a reference
    that leads nowhere. A name may be a test's prefix (a parametrized family: `test_clip_limits[...]`)."""
    named = set(re.findall(r"(?<![\w/.:-])(test_\w+)(?![\w/])", text(name)))
    missing = sorted(n for n in named if n not in known_tests() and not any(t.startswith(n) for t in known_tests()))
    assert not missing, f"{name} names tests that do not exist: {missing}"


@pytest.mark.parametrize("name", USER_DOCS)
def test_every_class_member_a_user_doc_names_exists(name: str) -> None:
    """`Gateway.embed_clip`, `RealtimeAdmission.first_audio_wait`, `EngineSettings.cpus`: a class of app/ or engine/
    has that member (a bare class name may be another project's, `TimedString`; a dotted one is ours)."""
    members_named = {s for s in references(name) if "." in s and CLASS_SPAN.fullmatch(s) and not FILE_SPAN.fullmatch(s)}
    missing = sorted(s for s in members_named if not reference_exists(s))
    assert not missing, f"{name} names class members the code does not have: {missing}"
