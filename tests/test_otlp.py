"""Tests for collector.otlp: real vLLM OTLP bodies (protobuf), OTLP JSON, and the file import."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner
from google.protobuf.json_format import MessageToDict
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvlens.cli import cli
from kvlens.collector.otlp import OtlpDecodeError, import_otlp, parse_otlp_json, parse_otlp_protobuf
from kvlens.errors import InputError
from kvlens.query import query

DATA = Path(__file__).resolve().parent / "data"
BODIES = [DATA / "vllm-cpu-capture" / "otlp_000.pb", DATA / "vllm-cpu-capture" / "otlp_001.pb"]
CLIENT = DATA / "vllm-cpu-capture" / "client.jsonl"
INSTANCE = "d33504db-fe4f-4f39-8bc7-5a06c508bae9"  # the capture's resource service.instance.id


def otlp_json(body: bytes, *, snake: bool = False) -> dict[str, Any]:
    """A protobuf body as OTLP JSON: camelCase (or snake_case), int64 as strings, ids as hex."""
    msg = ExportTraceServiceRequest.FromString(body)
    out = MessageToDict(msg, preserving_proto_field_name=snake)
    id_keys = ("trace_id", "span_id", "parent_span_id") if snake else ("traceId", "spanId", "parentSpanId")
    for rs, prs in zip(out.get("resource_spans" if snake else "resourceSpans", []), msg.resource_spans,
                       strict=True):
        scopes = rs.get("scope_spans" if snake else "scopeSpans", [])
        for ss, pss in zip(scopes, prs.scope_spans, strict=True):
            for span, pspan in zip(ss["spans"], pss.spans, strict=True):
                for key, raw in zip(id_keys, (pspan.trace_id, pspan.span_id, pspan.parent_span_id),
                                    strict=True):
                    if raw:
                        span[key] = raw.hex()
    return out


def _client() -> list[dict[str, Any]]:
    """The client's view of each request: id, arrival and the API usage counts."""
    out = []
    for line in CLIENT.read_text().splitlines():
        r = json.loads(line)
        usage = r["usage"]
        out.append({"request_id": r["request_id"], "arrival_unix": r["arrival_unix"],
                    "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
                    "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]})
    return out


def _all_rows() -> list[dict[str, Any]]:
    return [row for body in BODIES for row in parse_otlp_protobuf(body.read_bytes()).rows]


def test_real_bodies_hold_one_llm_request_span_per_request() -> None:
    batches = [parse_otlp_protobuf(p.read_bytes()) for p in BODIES]
    assert [len(b.rows) for b in batches] == [230, 70]
    assert all(b.other_spans == 0 and b.bad_spans == 0 for b in batches)
    rows = [r for b in batches for r in b.rows]
    # The span's id is the engine's: the API response id plus "-0" (vLLM's prompt index), kept as
    # sent; they match the client's ids one for one (analyzers/join.py pairs them), in the order
    # the engine finished them (one at a time).
    assert [r["request_id"] for r in rows] == [c["request_id"] + "-0" for c in _client()]


def test_real_bodies_give_the_engine_timings_and_usage() -> None:
    rows, client = _all_rows(), _client()
    for row, c in zip(rows, client, strict=True):
        assert row["prompt_tokens"] == c["prompt_tokens"]
        assert row["output_tokens"] == c["completion_tokens"]
        # Same machine, same clock: the engine sees the request a little after the client sent it.
        assert 0 <= row["arrival_ns"] - round(c["arrival_unix"] * 1e9) < 500_000_000
        assert row["arrival_ns"] < row["first_token_ns"] <= row["end_ns"]
        assert row["first_token_ns"] == row["arrival_ns"] + round(row["ttft_ms"] * 1e6)
        assert 0 < row["queue_ms"] < row["ttft_ms"]
        assert 0 < row["prefill_ms"] < row["ttft_ms"]
        assert row["replica"] == INSTANCE and row["source"] == "otlp" and row["model"] is None


def test_first_span_matches_its_hand_read_values() -> None:
    row = parse_otlp_protobuf(BODIES[0].read_bytes()).rows[0]
    assert row["request_id"] == "cmpl-9d4e923b891af8e2-0"
    assert row["arrival_ns"] == 1796064004308312064 and row["end_ns"] == 1796064004337894297
    assert row["ttft_ms"] == pytest.approx(17.369747161865234)
    assert row["queue_ms"] == pytest.approx(0.035071999718638835)
    assert row["prefill_ms"] == pytest.approx(8.344025000042166)
    assert (row["prompt_tokens"], row["output_tokens"]) == (338, 11)


def test_configured_replica_and_model_win() -> None:
    row = parse_otlp_protobuf(BODIES[1].read_bytes(), replica="replica-a", model="tiny").rows[0]
    assert (row["replica"], row["model"]) == ("replica-a", "tiny")


@pytest.mark.parametrize("snake", [False, True])
def test_otlp_json_gives_the_same_rows_as_protobuf(snake: bool) -> None:
    for path in BODIES:
        body = path.read_bytes()
        doc = otlp_json(body, snake=snake)
        span = next(iter(doc.values()))[0]["scope_spans" if snake else "scopeSpans"][0]["spans"][0]
        assert isinstance(span["start_time_unix_nano" if snake else "startTimeUnixNano"], str)
        assert parse_otlp_json(json.dumps(doc).encode()).rows == parse_otlp_protobuf(body).rows


def _span(name: str, attrs: dict[str, Any], start: int = 1_000, end: int = 2_000) -> dict[str, Any]:
    return {"name": name, "startTimeUnixNano": str(start), "endTimeUnixNano": end,
            "attributes": [{"key": k, "value": v} for k, v in attrs.items()]}


def _doc(spans: list[dict[str, Any]], resource: dict[str, str] | None = None) -> bytes:
    res = {"attributes": [{"key": k, "value": {"stringValue": v}} for k, v in (resource or {}).items()]}
    return json.dumps({"resourceSpans": [{"resource": res, "scopeSpans": [{"spans": spans}]}]}).encode()


def test_json_values_follow_the_otlp_mapping() -> None:
    attrs = {"gen_ai.request.id": {"stringValue": "chatcmpl-7-1"},
             "gen_ai.usage.prompt_tokens": {"intValue": "4096"},
             "gen_ai.usage.completion_tokens": {"intValue": 3},
             "gen_ai.latency.time_to_first_token": {"doubleValue": 0.25},
             "gen_ai.latency.time_in_queue": {"doubleValue": "NaN"},
             "gen_ai.request.model": {"stringValue": "llama"}}
    row = parse_otlp_json(_doc([_span("llm_request", attrs)])).rows[0]
    assert row["request_id"] == "chatcmpl-7-1"  # as sent
    assert (row["prompt_tokens"], row["output_tokens"], row["model"]) == (4096, 3, "llama")
    assert row["ttft_ms"] == 250.0 and row["first_token_ns"] == 1_000 + 250_000_000
    assert row["queue_ms"] is None and row["prefill_ms"] is None  # NaN and absent: unknown


@pytest.mark.parametrize(("resource", "replica"), [
    ({"service.instance.id": "i-1", "host.name": "h", "service.name": "vllm"}, "i-1"),
    ({"host.name": "h", "service.name": "vllm"}, "h"),
    ({"service.name": "vllm"}, "vllm"),
    ({}, None),
])
def test_replica_comes_from_the_resource(resource: dict[str, str], replica: str | None) -> None:
    span = _span("llm_request", {"gen_ai.request.id": {"stringValue": "r-0"}})
    assert parse_otlp_json(_doc([span], resource)).rows[0]["replica"] == replica


def test_other_and_idless_spans_are_counted_not_errors() -> None:
    spans = [_span("Overall Loading", {}), _span("Allocate KV cache", {}),
             _span("llm_request", {"gen_ai.usage.prompt_tokens": {"intValue": "5"}}),
             _span("llm_request", {"gen_ai.request.id": {"stringValue": "ok-0"}})]
    batch = parse_otlp_json(_doc(spans))
    assert (len(batch.rows), batch.other_spans, batch.bad_spans, batch.spans) == (1, 2, 1, 4)
    assert batch.rows[0]["request_id"] == "ok-0"


def test_request_ids_are_never_rewritten() -> None:
    # A span whose own id is bar-0 lands as bar-0; matching vLLM's <id>-<index> form is the join's job.
    ids = ["bar-0", "bar-1", "bar", "cmpl-x-0-0", "-0"]
    spans = [_span("llm_request", {"gen_ai.request.id": {"stringValue": rid}}) for rid in ids]
    assert [r["request_id"] for r in parse_otlp_json(_doc(spans)).rows] == ids


@pytest.mark.parametrize("body", [b"{}", b'{"resourceSpans": []}'])
def test_empty_requests_are_valid(body: bytes) -> None:
    assert parse_otlp_json(body).spans == 0
    assert parse_otlp_protobuf(b"").spans == 0  # an empty message is a valid protobuf body


@pytest.mark.parametrize("body", [b"", b"not json", b"[1, 2]", b'{"resourceSpans": 5}',
                                  b'{"resourceSpans": [{"scopeSpans": [{"spans": [7]}]}]}'])
def test_bad_json_is_a_decode_error(body: bytes) -> None:
    with pytest.raises(OtlpDecodeError):
        parse_otlp_json(body)


def test_truncated_protobuf_is_a_decode_error() -> None:
    with pytest.raises(OtlpDecodeError):
        parse_otlp_protobuf(BODIES[1].read_bytes()[:-7])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_decoders_never_crash_on_arbitrary_bytes(data: bytes) -> None:
    for parse in (parse_otlp_protobuf, parse_otlp_json):
        try:
            batch = parse(data)
        except OtlpDecodeError:
            continue
        assert batch.spans >= 0


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["resourceSpans", "scopeSpans", "spans", "attributes", "key", "value", "name",
                         "stringValue", "intValue", "doubleValue", "startTimeUnixNano", "resource",
                         "gen_ai.request.id"]) | st.text(max_size=4), inner, max_size=5),
    max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(_JSON)
def test_json_decoder_never_crashes_on_odd_shapes(doc: Any) -> None:
    try:
        batch = parse_otlp_json(msgspec.json.encode(doc))
    except OtlpDecodeError:
        return
    assert all(isinstance(r["request_id"], str) for r in batch.rows)


# -- file import ------------------------------------------------------------------------------


def _query(lake: Path, sql: str) -> list[tuple[Any, ...]]:
    return query(sql, lake=lake)[1]


def _collector_file(path: Path, extra: list[str] | None = None) -> Path:
    lines = [json.dumps(otlp_json(p.read_bytes())) for p in BODIES] + (extra or [])
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


@pytest.mark.parametrize("name", ["traces.jsonl", "traces.jsonl.gz"])
def test_import_otlp_json_cli_writes_requests_only(tmp_path: Path, name: str) -> None:
    trace = _collector_file(tmp_path / name)
    lake = tmp_path / "lake"
    args = ["import", "otlp-json", str(trace), "--lake", str(lake), "--scenario", "cap"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "imported 300 requests" in result.output
    got = _query(lake, "SELECT count(*), count(DISTINCT request_id), sum(prompt_tokens), min(source), "
                       "count(ttft_ms) FROM requests WHERE scenario = 'cap'")
    assert got == [(300, 300, sum(c["prompt_tokens"] for c in _client()), "otlp", 300)]
    assert _query(lake, "SELECT count(*) FROM request_blocks") == [(0,)]
    # A re-import replaces the scenario, never duplicates it.
    assert CliRunner().invoke(cli, args).exit_code == 0
    assert _query(lake, "SELECT count(*) FROM requests") == [(300,)]


def test_import_otlp_json_bad_line_named_or_skipped(tmp_path: Path) -> None:
    trace = _collector_file(tmp_path / "t.jsonl", extra=["{broken"])
    with pytest.raises(InputError, match=r"t\.jsonl, line 3"):
        import_otlp("otlp-json", [trace], tmp_path / "lake")
    result = import_otlp("otlp-json", [trace], tmp_path / "lake", skip_bad_lines=True, replica="r1")
    assert (result.requests, result.bad_lines) == (300, 1)
    assert _query(tmp_path / "lake", "SELECT DISTINCT replica FROM requests") == [("r1",)]


def test_import_raw_protobuf_bodies(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["import", "otlp", *map(str, BODIES), "--lake", str(tmp_path / "lake"),
                                      "--model", "tiny"])
    assert result.exit_code == 0, result.output
    assert _query(tmp_path / "lake", "SELECT count(*), min(model) FROM requests") == [(300, "tiny")]
    bad = tmp_path / "bad.pb"
    bad.write_bytes(b"\xff" * 10)
    result = CliRunner().invoke(cli, ["import", "otlp", str(bad), "--lake", str(tmp_path / "lake")])
    assert result.exit_code == 1 and "Error:" in result.output and "bad.pb" in result.output
