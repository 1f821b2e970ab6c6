"""kvlens gateway against stub engines that are real HTTP servers on 127.0.0.1 (tests/gateway_stub.py)."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from gateway_stub import StubEngine, stub_tokens

from kvlens.collector.gateway_server import Gateway, GatewayOptions
from kvlens.collector.hashing import vllm_block_hashes
from kvlens.collector.otlp_server import OtlpReceiver, ReceiverOptions
from kvlens.config import ReplicaConfig
from kvlens.errors import ConfigError
from kvlens.query import query


def _replica(stub: StubEngine, name: str) -> ReplicaConfig:
    return ReplicaConfig(endpoint=stub.endpoint, name=name, model="tiny", url=stub.url, block_size=4,
                         hash_algo="sha256_cbor", hash_seed="0")


@contextmanager
def fleet(tmp_path: Path, n: int = 2, publish: bool = False,
          **opts: Any) -> Iterator[tuple[Gateway, list[StubEngine]]]:
    with ExitStack() as stack:
        stubs = [stack.enter_context(StubEngine(publish=publish, name=f"e{i}")) for i in range(n)]
        options = GatewayOptions(replicas=tuple(_replica(s, f"r{i}") for i, s in enumerate(stubs)),
                                 lake=str(tmp_path / "lake"), **opts)
        gateway = Gateway(options).start()
        try:
            yield gateway, stubs
        finally:
            gateway.stop()


def _url(gateway: Gateway, path: str) -> str:
    return f"http://127.0.0.1:{gateway.port}{path}"


def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read()


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, r.read()


def _rows(tmp_path: Path, sql: str) -> list[tuple[Any, ...]]:
    return query(sql, lake=tmp_path / "lake")[1]


def _sent(stub: StubEngine, path: str) -> list[dict[str, Any]]:
    return [b for p, b in stub.bodies if p == path]


def _hashes(tokens: list[int]) -> list[int]:
    return [b.value for b in vllm_block_hashes(tokens, 4, algo="sha256_cbor", seed="0")]


def test_a_completion_reaches_the_client_unchanged_and_is_recorded_with_its_blocks(tmp_path: Path) -> None:
    prompt = "the same system prompt, then a question"
    with fleet(tmp_path) as (gw, stubs):
        status, body = _post(_url(gw, "/v1/completions"), {"model": "tiny", "prompt": prompt, "max_tokens": 3,
                                                            "user": "alice"})
        assert status == 200
        reply = json.loads(body)
        assert reply["id"] == "cmpl-e0-1" and reply["choices"][0]["text"] == "xxx"
        status, body = _post(_url(gw, "/v1/completions"), {"model": "tiny", "prompt": prompt + "?",
                                                            "max_tokens": 2},
                             headers={"X-Session-Id": "s-9"})
        assert status == 200 and json.loads(body)["id"] == "cmpl-e1-1"  # round robin: the other replica
        # the stubs saw exactly the client's bodies
        assert _sent(stubs[0], "/v1/completions")[0]["prompt"] == prompt
    rows = _rows(tmp_path, "SELECT request_id, replica, session_id, prompt_tokens, output_tokens, "
                           "cached_tokens, model, source, scenario FROM requests ORDER BY request_id")
    tokens = stub_tokens(prompt)
    assert rows == [("cmpl-e0-1", "r0", "alice", len(tokens), 3, 0, "tiny", "gateway", "live"),
                    ("cmpl-e1-1", "r1", "s-9", len(tokens) + 1, 2, 0, "tiny", "gateway", "live")]
    blocks = _rows(tmp_path, "SELECT block_hash, block_tokens, token_ids FROM request_blocks "
                             "WHERE request_id = 'cmpl-e0-1' ORDER BY position")
    assert [b[0] for b in blocks] == _hashes(tokens)  # the engine's keys, from the engine's own tokenizer
    assert {b[1] for b in blocks} == {4} and all(b[2] is None for b in blocks)  # no token ids at rest


def test_cached_tokens_are_the_engines_and_keep_tokens_keeps_them(tmp_path: Path) -> None:
    ids = list(range(100, 118))
    with fleet(tmp_path, n=1, keep_tokens=True) as (gw, _):
        for _ in range(2):
            assert _post(_url(gw, "/v1/completions"), {"model": "tiny", "prompt": ids})[0] == 200
    assert _rows(tmp_path, "SELECT cached_tokens FROM requests ORDER BY request_id") == [(0,), (16,)]
    kept = _rows(tmp_path, "SELECT token_ids FROM request_blocks WHERE request_id = 'cmpl-e0-1' "
                           "ORDER BY position")
    assert [list(k[0]) for k in kept] == [ids[i:i + 4] for i in range(0, 16, 4)]


def _raw_stream(url: str, body: dict[str, Any]) -> bytes:
    host, port = url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("Content-Type", "").startswith("text/event-stream")
        return r.read()
    finally:
        conn.close()


@pytest.mark.parametrize("client_asks_usage", [False, True])
def test_a_stream_is_relayed_unchanged_and_usage_is_read(tmp_path: Path, client_asks_usage: bool) -> None:
    body: dict[str, Any] = {"model": "tiny", "prompt": "stream me please", "max_tokens": 3, "stream": True}
    if client_asks_usage:
        body["stream_options"] = {"include_usage": True}
    with StubEngine(name="direct") as direct:
        expected = _raw_stream(direct.url + "/v1/completions", body).replace(b"cmpl-direct-1", b"cmpl-e0-1")
    with fleet(tmp_path, n=1) as (gw, stubs):
        got = _raw_stream(_url(gw, "/v1/completions"), body)
        sent = _sent(stubs[0], "/v1/completions")[0]
    assert got == expected  # byte for byte what the engine streams to a direct client
    assert (b'"usage"' in got) is client_asks_usage
    assert sent["stream_options"] == {"include_usage": True}  # the gateway asked, to record usage
    rows = _rows(tmp_path, "SELECT prompt_tokens, output_tokens, ttft_ms, first_token_ns > arrival_ns "
                           "FROM requests")
    assert rows[0][:2] == (len(stub_tokens("stream me please")), 3)
    assert rows[0][2] > 0 and rows[0][3]


def test_errors_pass_through_and_an_unreachable_replica_is_a_502(tmp_path: Path) -> None:
    with fleet(tmp_path, n=1) as (gw, _):
        status, body = _post(_url(gw, "/v1/completions"), {"model": "tiny", "prompt": "fail"})
        assert status == 400 and json.loads(body)["message"] == "the stub refuses 'fail'"
        assert gw.metrics.value("kvlens_gateway_errors_total", replica="r0", kind="status") == 1
    dead = ReplicaConfig(endpoint="tcp://127.0.0.1:1", name="gone", url="http://127.0.0.1:9", block_size=4)
    gateway = Gateway(GatewayOptions(replicas=(dead,), lake=str(tmp_path / "lake2"))).start()
    try:
        status, body = _post(_url(gateway, "/v1/completions"), {"model": "tiny", "prompt": [1, 2, 3]})
        assert status == 502 and "replica gone at http://127.0.0.1:9 did not answer" in body.decode()
        assert gateway.metrics.value("kvlens_gateway_errors_total", replica="gone", kind="unreachable") == 1
    finally:
        gateway.stop()
    assert _rows(tmp_path, "SELECT count(*) FROM requests") == [(0,)]


def test_chat_is_tokenized_by_the_replica_with_its_template_fields(tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    with fleet(tmp_path, n=1) as (gw, stubs):
        status, _ = _post(_url(gw, "/v1/chat/completions"), {"model": "tiny", "messages": messages,
                                                             "add_generation_prompt": False})
        assert status == 200
        tokenized = [b for p, b in stubs[0].bodies if p == "/tokenize"]
    assert tokenized == [{"messages": messages, "add_generation_prompt": False, "model": "tiny"}]
    expected = len(stub_tokens("<system>be brief<user>hi there"))
    assert _rows(tmp_path, "SELECT prompt_tokens FROM requests") == [(expected,)]


def test_models_health_and_metrics(tmp_path: Path) -> None:
    with fleet(tmp_path, n=1) as (gw, _):
        assert json.loads(_get(_url(gw, "/v1/models"))[1])["data"][0]["id"] == "tiny"
        assert _get(_url(gw, "/health"))[0] == 200
        _post(_url(gw, "/v1/completions"), {"model": "tiny", "prompt": "count me"})
        text = _get(_url(gw, "/metrics"))[1].decode()
    for name in ("kvlens_gateway_requests_total", "kvlens_gateway_tokenize_seconds_count",
                 "kvlens_gateway_queue_depth_requests", "kvlens_gateway_rows_written_total",
                 "kvlens_gateway_errors_total", "kvlens_gateway_routed_total"):
        assert name in text
    assert 'kvlens_gateway_requests_total{code="200",replica="r0"} 1.0' in text


def test_session_affinity_keeps_a_session_and_records_the_reason(tmp_path: Path) -> None:
    with fleet(tmp_path, n=3, routing="session_affinity") as (gw, _):
        for i in range(6):
            _post(_url(gw, "/v1/completions"), {"model": "tiny", "prompt": f"turn {i}", "user": "sess-a"})
        assert sum(gw.metrics.value("kvlens_gateway_routed_total", replica=f"r{r}", reason="session")
                   for r in range(3)) == 6
    assert len(_rows(tmp_path, "SELECT DISTINCT replica FROM requests")) == 1


def _wait_for(condition: Any, gw: Gateway, what: str, poke: Any = None) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        if poke is not None:
            poke()
        _get(_url(gw, "/health"))  # a round trip between checks, not a sleep


def test_cache_aware_follows_the_replicas_events_to_the_longest_prefix(tmp_path: Path) -> None:
    shared = list(range(1000, 1032))  # 8 full blocks
    with fleet(tmp_path, n=2, publish=True, routing="cache_aware") as (gw, stubs):
        resident = gw.resident
        assert resident is not None
        # ZMQ's SUB joins asynchronously: a batch published before it joined is lost, so first
        # wait until each replica's stream reaches the gateway
        for r, stub in enumerate(stubs):
            _wait_for(lambda r=r: resident.batches[r] > 0, gw, "no events reached the gateway",
                      poke=lambda r=r, stub=stub: stub.publish_blocks([r] * 4))
        # nothing shared is resident yet: below the threshold, the least loaded (ties: r0)
        first = _post(_url(gw, "/v1/completions"), {"model": "tiny", "prompt": [*shared, 1, 2]})
        assert json.loads(first[1])["id"] == "cmpl-e0-1"
        _wait_for(lambda: resident.matched(0, _hashes(shared)) == 8, gw, "r0's stored blocks did not arrive")
        assert resident.matched(1, _hashes(shared)) == 0
        for _ in range(2):  # round robin would alternate; cache_aware stays with the prefix
            second = _post(_url(gw, "/v1/completions"), {"model": "tiny", "prompt": [*shared, 7, 7, 7]})
            assert json.loads(second[1])["id"].startswith("cmpl-e0-")
        assert gw.metrics.value("kvlens_gateway_routed_total", replica="r0", reason="longest_prefix") == 2
        assert gw.metrics.value("kvlens_gateway_routed_total", replica="r0", reason="below_threshold") == 1
    cached = _rows(tmp_path, "SELECT cached_tokens FROM requests ORDER BY request_id")
    assert cached == [(0,), (32,), (32,)]


def test_the_gateways_spans_reach_kvlens_otlp_receiver(tmp_path: Path) -> None:
    receiver = OtlpReceiver(ReceiverOptions(lake=tmp_path / "otlp-lake", port=0, flush_age_s=3600)).start()
    try:
        host, port = receiver.address
        ids = list(range(10, 30))
        with fleet(tmp_path, n=1, otlp_endpoint=f"http://{host}:{port}") as (gw, _):
            for _ in range(2):
                _post(_url(gw, "/v1/completions"), {"model": "tiny", "prompt": ids})
        # the gateway's stop() shut its tracer provider down, which exported every span
    finally:
        receiver.stop()
    rows = query("SELECT request_id, prompt_tokens, cached_tokens, source FROM requests ORDER BY request_id",
                 lake=tmp_path / "otlp-lake")[1]
    assert rows == [("cmpl-e0-1", 20, 0, "otlp"), ("cmpl-e0-2", 20, 16, "otlp")]


def test_rows_are_committed_within_the_flush_window_while_it_runs(tmp_path: Path) -> None:
    with fleet(tmp_path, n=1, flush_age_s=0.2) as (gw, _):
        _post(_url(gw, "/v1/completions"), {"model": "tiny", "prompt": [1, 2, 3, 4, 5]})
        deadline = time.monotonic() + 30
        while gw.metrics.value("kvlens_gateway_rows_written_total", table="requests") < 1:
            assert time.monotonic() < deadline, "the time bound did not commit the row"
            _get(_url(gw, "/health"))
        # committed before any stop: what a kill -9 now would leave
        assert _rows(tmp_path, "SELECT count(*) FROM requests") == [(1,)]
        assert _rows(tmp_path, "SELECT count(*) FROM request_blocks") == [(1,)]


def _char_tokenizer(path: Path) -> str:
    """A tokenizer.json that encodes as the stub does (one token per character), for the fallback."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {chr(c): stub_tokens(chr(c))[0] for c in range(32, 127)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=" "))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.save(str(path))
    return str(path)


def test_a_replica_without_tokenize_is_recorded_through_its_local_tokenizer(tmp_path: Path) -> None:
    prompt = "a prompt the replica cannot tokenize for us"
    with StubEngine(name="e0") as stub:
        stub.tokenize_down = True
        replica = ReplicaConfig(endpoint=stub.endpoint, name="r0", model="tiny", url=stub.url, block_size=4,
                                hash_algo="sha256_cbor", hash_seed="0",
                                tokenizer=_char_tokenizer(tmp_path / "tokenizer.json"))
        gw = Gateway(GatewayOptions(replicas=(replica,), lake=str(tmp_path / "lake"))).start()
        try:
            status, _ = _post(_url(gw, "/v1/completions"),
                              {"model": "tiny", "prompt": prompt, "max_tokens": 1})
            assert status == 200
            # a chat's template is the engine's: not encoded locally, so not recorded
            status, _ = _post(_url(gw, "/v1/chat/completions"),
                              {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
            assert status == 200
            _, metrics = _get(_url(gw, "/metrics"))
        finally:
            gw.stop()
    assert _sent(stub, "/tokenize")  # it was asked first, and failed
    assert 'kvlens_gateway_tokenize_local_total{replica="r0"} 1.0' in metrics.decode()
    blocks = _rows(tmp_path, "SELECT block_hash FROM request_blocks ORDER BY request_id, position")
    assert [b[0] for b in blocks] == _hashes(stub_tokens(prompt))  # the engine's keys, from tokenizer.json
    assert _rows(tmp_path, "SELECT count(*) FROM requests") == [(1,)]


def test_a_tokenizer_that_is_not_a_tokenizer_json_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    replica = ReplicaConfig(endpoint="tcp://127.0.0.1:5557", name="r0", url="http://127.0.0.1:8000",
                            tokenizer=str(bad))
    with pytest.raises(ConfigError, match=r"not a readable Hugging Face tokenizer\.json"):
        Gateway(GatewayOptions(replicas=(replica,), lake=str(tmp_path / "lake")))


def test_a_fleet_without_urls_is_refused(tmp_path: Path) -> None:
    bare = ReplicaConfig(endpoint="tcp://127.0.0.1:5557", name="r0")
    with pytest.raises(ConfigError, match="have no url"):
        Gateway(GatewayOptions(replicas=(bare,), lake=str(tmp_path / "lake")))
    with pytest.raises(ConfigError, match="load fallback"):
        Gateway(GatewayOptions(replicas=(ReplicaConfig(endpoint="tcp://127.0.0.1:5557",
                                                       url="http://127.0.0.1:8000"),),
                               lake=str(tmp_path / "l"), load_factor=2.0))


def test_the_config_gives_each_replica_its_url_and_hashing(tmp_path: Path) -> None:
    from kvlens.config import load_config

    good = tmp_path / "good.toml"
    good.write_text('[[fleet.replicas]]\nname = "a"\nendpoint = "tcp://127.0.0.1:5557"\n'
                    'url = "http://127.0.0.1:8000/"\nblock_size = 32\nhash_algo = "sha256_cbor"\n'
                    'hash_seed = "0"\nloras = { sql = "/models/sql" }\n')
    r = load_config(good).replicas[0]
    assert (r.url, r.block_size, r.hash_algo, r.hash_seed, r.loras) == (
        "http://127.0.0.1:8000", 32, "sha256_cbor", "0", (("sql", "/models/sql"),))
    for line, message in (('url = "127.0.0.1:8000"', "is not an http:// or https:// URL"),
                          ("block_size = 0", "block_size must be a positive integer"),
                          ('hash_algo = "md5"', "hash_algo 'md5' is not one of")):
        bad = tmp_path / "bad.toml"
        bad.write_text(f'[[fleet.replicas]]\nendpoint = "tcp://127.0.0.1:5557"\n{line}\n')
        with pytest.raises(ConfigError, match=message):
            load_config(bad)


def test_cache_aware_choice_is_the_simulators_rule() -> None:
    from kvlens.routing import cache_aware_choice

    # longest prefix wins when it covers at least half the full blocks
    assert cache_aware_choice([3, 6], [0, 0], 10) == (1, "longest_prefix")
    # below the threshold: the least loaded
    assert cache_aware_choice([3, 4], [2, 1], 10) == (1, "below_threshold")
    # a tie in matched blocks: the less loaded
    assert cache_aware_choice([8, 8], [3, 1], 10) == (1, "longest_prefix")
    # the load fallback: 9 in flight > 1.5 x the mean of 5
    assert cache_aware_choice([9, 0], [9, 1], 10, load_factor=1.5) == (1, "load_fallback")
    assert cache_aware_choice([9, 0], [9, 1], 10, load_factor=2.0) == (0, "longest_prefix")


def test_the_cli_says_what_is_wrong_in_one_line(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kvlens.cli import cli

    config = tmp_path / "kvlens.toml"
    config.write_text('[[fleet.replicas]]\nname = "a"\nendpoint = "tcp://127.0.0.1:5557"\n')
    result = CliRunner().invoke(cli, ["gateway", "--config", str(config), "--listen", "127.0.0.1:0",
                                      "--lake", str(tmp_path / "lake")])
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1].startswith("Error: replica(s) a have no url")


def _recorded(i: int) -> Any:
    from kvlens.collector.gateway_writer import Recorded

    return Recorded({"request_id": f"q{i}", "arrival_ns": 1_700_000_000_000_000_000 + i, "prompt_tokens": 4},
                    [{"request_id": f"q{i}", "arrival_ns": 1_700_000_000_000_000_000 + i, "position": 0,
                      "block_hash": i, "block_tokens": 4, "block_size_tokens": 4}])


def test_a_full_writer_pushes_back_and_the_size_bound_commits(tmp_path: Path) -> None:
    import threading

    from kvlens.collector.gateway_writer import RequestWriter

    written: list[tuple[str, int]] = []
    committed = threading.Event()

    def on_written(table: str, n: int) -> None:
        written.append((table, n))
        if table == "requests":
            committed.set()

    writer = RequestWriter(tmp_path / "lake", scenario="live", writer_id="gw-test", flush_age_s=3600,
                           flush_requests=3, queue_requests=2, on_written=on_written)
    assert writer.offer(_recorded(0)) and writer.offer(_recorded(1))
    assert not writer.offer(_recorded(2))  # full: the proxy then waits in put()
    assert not writer.put(_recorded(2), timeout_s=0.05)
    assert writer.depth == 2
    writer.start()
    assert writer.put(_recorded(2), timeout_s=30)  # the thread drains the queue
    assert committed.wait(30)  # three requests: the size bound commits, long before the hour
    assert written == [("request_blocks", 3), ("requests", 3)]  # blocks first
    assert _rows(tmp_path, "SELECT count(*) FROM requests") == [(3,)]
    writer.put(_recorded(3))
    writer.stop()  # the rest at stop
    assert _rows(tmp_path, "SELECT count(*) FROM requests") == [(4,)]


def test_arrival_is_when_the_replica_was_sent_the_request_so_look_ups_keep_the_engines_order(
        tmp_path: Path) -> None:
    """A request held up by /tokenize reaches the engine after one sent ahead of it: the ledger orders
    look-ups by arrival_ns, so arrival_ns must keep the engine's order (the gateway's receipt does not)."""
    import threading

    with fleet(tmp_path, n=1, routing="prefix_hash") as (gw, stubs):
        slow = threading.Thread(target=_post, args=(_url(gw, "/v1/completions"), {"model": "tiny",
                                                                                  "prompt": "slow"}))
        slow.start()
        try:
            assert stubs[0].slow_seen.wait(30)  # the slow request is at the gateway, tokenizing
            assert _post(_url(gw, "/v1/completions"), {"model": "tiny", "prompt": [5, 6, 7, 8, 9]})[0] == 200
        finally:
            stubs[0].release.set()
            slow.join(30)
        served = [b["prompt"] for p, b in stubs[0].bodies if p == "/v1/completions"]
    assert served == [[5, 6, 7, 8, 9], "slow"]  # the engine got the token prompt first
    order = _rows(tmp_path, "SELECT request_id FROM requests ORDER BY arrival_ns")
    assert order == [("cmpl-e0-1",), ("cmpl-e0-2",)]
