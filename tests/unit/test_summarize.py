"""bench/summarize.py: a compressed raw file (what bench/device_capacity.sh brings back when a JSON is too large)
summarizes as the file itself does."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from bench.summarize import summarize_file


def test_a_gzipped_json_summarizes_as_the_json(tmp_path: Path):
    data = {"c": 1, "ok": "10/10", "engine_p50_ms": {"ttfa_ms": 34.2}}
    plain = tmp_path / "ws_bench.json"
    plain.write_text(json.dumps(data, indent=1))
    packed = tmp_path / "ws_bench.json.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    body = summarize_file(plain).split("\n", 1)[1]  # past the heading (name, size)
    assert '"ttfa_ms":34.2' in body
    assert summarize_file(packed).split("\n", 1)[1] == body
