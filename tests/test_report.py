"""The nightly report: hand-computed numbers, the demo's golden text, a real SMTP server, errors."""

from __future__ import annotations

import email
import os
import re
import shutil
import socket
import ssl
import subprocess
from email.message import EmailMessage
from email.policy import default as default_policy
from pathlib import Path
from typing import Any

import duckdb
import pytest
from click.testing import CliRunner
from tiny_analysis_db import T0_NS, make_tiny_db, mark_unobserved

from kvlens.cli import cli
from kvlens.dashboards.report import Report, build_report, parse_duration_ns, png_size, write_report
from kvlens.dashboards.report.mail import SmtpSettings, build_message, send_message
from kvlens.errors import ConfigError, KvlensError, NoDataError

GOLDEN = Path(__file__).parent / "data" / "golden" / "report_demo.txt"
# The demo trace's last arrival is 2025-01-01T00:58:56.999Z; the golden window is the 30 minutes
# before 00:58:57 (so that the day-over-day part compares two full windows).
DEMO_NOW_NS = 1_735_693_137 * 10**9
DEMO_SINCE = "30m"


@pytest.fixture
def tiny_db(tmp_path: Path) -> Path:
    return make_tiny_db(tmp_path / "tiny.duckdb")


@pytest.fixture(scope="module")
def demo_report(demo_workdir: Path) -> Report:
    return build_report(demo_workdir / "kvlens.duckdb", since_ns=parse_duration_ns(DEMO_SINCE),
                        now_ns=DEMO_NOW_NS)


# --- numbers by hand ---------------------------------------------------------------------------

def test_tiny_headline_and_findings_are_computed_from_the_ledger(tiny_db: Path) -> None:
    text = build_report(tiny_db).text
    assert re.search(r"^a\s+measured\s+2\s+350\s+0\.0%\s+0\.0%", text, re.M)
    # 100 of 350 tokens; 1000 of 3500 B
    assert re.search(r"^b\s+modelled\s+2\s+350\s+28\.6%\s+28\.6%", text, re.M)
    assert ("In a (measured), 28.6% of prompt tokens missed because the block lived on another replica "
            "(miss_routing); the worst replica is replica-1, where it cost 40.0% of its prompt tokens. "
            "Of those tokens, b (modelled) served 100.0%") in text
    assert ("b has the highest token hit ratio (28.6%, modelled), 28.6 points above a (0.0%, measured)."
            in text)


def test_every_figure_says_measured_or_modelled_and_what_it_assumed(tiny_db: Path) -> None:
    # a is measured, b a simulated what-if (scenarios.provenance, not the name): TTFT cells carry
    # the label, the headline names the assumption, and the byte figures their geometry.
    text = build_report(tiny_db).text
    assert re.search(r"^a\s+measured\s.*200\.0 ms \(measured\)\s+298\.0 ms \(measured\)$", text, re.M)
    assert re.search(r"^b\s+modelled\s.*150\.0 ms \(modelled\)\s+199\.0 ms \(modelled\)$", text, re.M)
    assert ("Modelled, not measured: b (a simulated what-if; tiny simulator: TTFT = queue + prefill at a "
            "stated rate).") in text
    assert "Byte figures use tiny's KV geometry, 10 B per token (given to kvlens analyze)." in text
    assert re.search(r"^outcome\s+a \(measured\)\s+b \(modelled\)$", text, re.M)
    con = duckdb.connect(str(tiny_db))
    con.execute("UPDATE scenarios SET model_source = 'default', model = 'llama-3.1-70b'")
    con.execute("INSERT INTO fanout (scenario, window_start_ns, needed_blocks, shared_blocks, "
                f"fanout_max_replicas, duplicate_bytes) VALUES ('a', {T0_NS}, 2, 1, 2, 1000)")
    con.close()
    assumed = build_report(tiny_db).text
    assert ("Byte figures use llama-3.1-70b's KV geometry, 10 B per token (assumed: no model was given "
            "(pass --model or --model-config to kvlens analyze)).") in assumed
    assert ("1000 B of KV held or computed more than once; bytes assume llama-3.1-70b's KV geometry: "
            "no model was given.") in assumed


def test_sections_without_rows_are_absent_and_appear_with_rows(tiny_db: Path) -> None:
    before = build_report(tiny_db)
    assert "Latency tails" not in before.text and "Prefixes worth publishing" not in before.text
    assert "tails" not in before.images
    con = duckdb.connect(str(tiny_db))
    con.execute("INSERT INTO latency_tails (scenario, replica, window_start_ns, prefix_class, requests, "
                "ttft_p50_ms, ttft_p95_ms, ttft_p99_ms, p99_p50_ratio) VALUES "
                "('a', '*', NULL, 'all', 2, 200, 290, 298, 1.49), "
                "('a', '*', NULL, 'miss_routing', 1, 300, 300, 300, 1.0), "
                "('a', 'replica-1', NULL, 'all', 1, 999, 999, 999, 1.0)")
    con.execute("INSERT INTO prefix_ranking (scenario, prefix_hash, prefix_tokens, reuses, replicas, bytes, "
                "benefit_ms, recommendation, reason, rank) VALUES "
                "('a', 11, 100, 1, 2, 1000, 1500.0, 'publish', 'needed on 2 replicas', 1)")
    con.execute("INSERT INTO crossover (scenario, device, model, prefix_tokens, kv_bytes, path, "
                "recompute_ms, recompute_label, load_ms, load_label, winner) VALUES "
                "('a', 'H100', 'tiny', 256, 2560, 'pool', 1.0, 'modelled', 2.0, 'modelled', 'recompute'), "
                "('a', 'H100', 'tiny', 4096, 40960, 'pool', 9.0, 'modelled', 4.0, 'modelled', 'load')")
    con.execute("INSERT INTO fanout (scenario, window_start_ns, needed_blocks, shared_blocks, "
                f"fanout_max_replicas, duplicate_bytes) VALUES ('a', {T0_NS}, 2, 1, 2, 1000)")
    con.close()
    after = build_report(tiny_db)
    assert "Latency tails (whole scenario)" in after.text and "tails" in after.images
    assert re.search(r"^a\s+2\s+200\.0 ms \(measured\)\s+290\.0 ms \(measured\)\s+298\.0 ms \(measured\)"
                     r"\s+1\.5x \(measured\)", after.text, re.M)  # the roll-up row
    assert "TTFT of a is measured." in after.text
    assert ("In a (measured), the slowest prefix class is miss_routing (1 requests, whole scenario): "
            "TTFT P99 300.0 ms (measured)" in after.text)
    assert "000000000000000b" in after.text and "publish" in after.text
    assert ("On H100 (tiny), loading a prefix beats recomputing it from 4,096 tokens over pool "
            "(load modelled, recompute modelled).") in after.text
    assert set(after.images) == {"ledger", "trend", "tails", "crossover"}
    assert ("In a (measured), 1 of 2 distinct blocks needed per window (50.0%) were needed by two replicas "
            "or more (up to 2): 1000 B of KV held or computed more than once.") in after.text
    assert "replicas or more" not in before.text


def test_day_over_day_compares_the_window_before(tiny_db: Path) -> None:
    # now = t0 + 15 s, since 10 s: r2 (t0 + 10 s) is current, r1 (t0) is the previous window.
    text = build_report(tiny_db, since_ns=10 * 10**9, now_ns=T0_NS + 15 * 10**9).text
    assert re.search(r"^requests\s+1\s+1\s+\+0\.0%$", text, re.M)
    assert re.search(r"^prompt tokens\s+100\s+250\s+\+150\.0%$", text, re.M)
    assert re.search(r"^token hit ratio\s+0\.0%\s+40\.0%\s+\+40\.0 pts$", text, re.M)  # scenario b


def test_headline_ratios_match_the_dashboards(tiny_db: Path) -> None:
    from kvlens.dashboards import queries
    from kvlens.dashboards.read import Window, open_db

    con = open_db(tiny_db)
    try:
        mine = queries.headlines(con, ["a", "b"], Window(0, 2**62))
        theirs = queries.hit_ratios(con, "b", Window())
    finally:
        con.close()
    assert mine["b"].token_hit_ratio == pytest.approx(theirs["token_hit_ratio"]) == pytest.approx(100 / 350)
    assert mine["b"].byte_hit_ratio == pytest.approx(theirs["byte_hit_ratio"]) == pytest.approx(1000 / 3500)


def test_the_comparison_finding_uses_the_headlines_ratio(tiny_db: Path) -> None:
    """b's r1 ran on a replica that published no KV events: the headline counts its 100 tokens as
    unobserved, not hit (100 of 350 = 28.6%); the finding that ranks the scenarios says the same
    number (it said 40.0%, leaving r1 out, beside a headline of 28.6%)."""
    mark_unobserved(tiny_db, "b", "r1", 100)
    text = build_report(tiny_db).text
    assert re.search(r"^b\s+modelled\s+2\s+350\s+28\.6%", text, re.M)
    assert ("b has the highest token hit ratio (28.6%, modelled), 28.6 points above a (0.0%, measured)."
            in text)


def test_the_trend_has_no_ratio_where_nothing_was_observed(tiny_db: Path) -> None:
    """a's r1 ran on a replica that published no KV events: its 1 s bucket has no token hit ratio
    (it drew 0.0%, as if every block had missed); r2's bucket keeps its measured 0.0%."""
    from kvlens.dashboards import queries
    from kvlens.dashboards.read import Window, open_db

    mark_unobserved(tiny_db, "a", "r1", 100)
    con = open_db(tiny_db)
    try:
        frame = queries.trend(con, "a", Window(), 10**9)
    finally:
        con.close()
    assert frame["requests"].to_list() == [1, 1]
    assert frame["token_hit_ratio"].to_list() == [None, 0.0]


def test_scenario_filter(tiny_db: Path) -> None:
    text = build_report(tiny_db, scenarios=["b"]).text
    assert "Scenarios b;" in text and not re.search(r"^a\s", text, re.M)
    with pytest.raises(NoDataError, match="no analyzed scenario among zzz"):
        build_report(tiny_db, scenarios=["zzz"])


def test_cli_window_options(tiny_db: Path, tmp_path: Path) -> None:
    out = tmp_path / "nightly" / "r.html"
    result = CliRunner().invoke(cli, ["report", "--db", str(tiny_db), "--out", str(out),
                                      "--now", "2025-01-01T00:00:15Z", "--since", "10s"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"report written: {out} (") and "2 charts" in result.output
    page = out.read_text()
    assert "2025-01-01 00:00:05 UTC to 2025-01-01 00:00:15 UTC (10s)" in page and "+40.0 pts" in page
    bad = CliRunner().invoke(cli, ["report", "--db", str(tiny_db), "--out", str(out), "--now", "yesterday"])
    assert bad.exit_code == 1 and "--now" in bad.output


def test_duration_parsing() -> None:
    assert parse_duration_ns("24h") == 86_400 * 10**9
    assert parse_duration_ns("1h30m") == 5_400 * 10**9
    for bad in ("", "24", "5x", "h", "0s"):
        with pytest.raises(ConfigError):
            parse_duration_ns(bad)


# --- the demo: golden text, self-contained HTML -----------------------------------------------

_TIME = re.compile(r"\d[\d,]*(?:\.\d+)? (?:ms|s)\b(?! \((?:modelled|measured)\))")


def _section(text: str, title: str) -> str:
    start = text.index(f"\n{title}\n")
    end = text.find("\n\n\n", start)  # sections are separated by a blank line pair
    nxt = re.search(r"\n[^\n]+\n-{3,}\n", text[start + len(title) + 3:])
    return text[start:start + len(title) + 3 + nxt.start()] if nxt else text[start:end if end > 0 else None]


def test_every_modelled_number_of_the_demo_report_says_so(demo_report: Report) -> None:
    # Every scenario of the demo report is a simulated what-if: each TTFT figure in the headline
    # and the tails carries its label, and each finding says modelled.
    text = demo_report.text
    for title in ("Every scenario (what-ifs named as such)", "Latency tails (whole scenario)"):
        part = _section(text, title)
        assert "(modelled)" in part and not _TIME.findall(part.split("\n\n", 1)[-1]), title
    bullets = [line for line in _section(text, "Top findings").splitlines() if line.startswith("- ")]
    assert bullets and all("modelled" in b for b in bullets), [b for b in bullets if "modelled" not in b]
    assert "effective cache" not in text  # nothing was subtracted: C_eff is the configured cache
    assert "C_eff = C_physical" in text

GOLDEN_DEFAULT_NOW = GOLDEN.with_name("report_demo_default_now.txt")


@pytest.mark.parametrize("which", ["fixed_clock", "default_now"])
def test_golden_report_for_the_demo(which: str, demo_report: Report, demo_workdir: Path) -> None:
    """Regenerate both with: KVLENS_UPDATE_GOLDEN=1 .venv/bin/pytest tests/test_report.py"""
    if which == "fixed_clock":
        golden, text = GOLDEN, demo_report.text
    else:  # each scenario's window ends at its own latest arrival: 24 h of every trace
        golden, text = GOLDEN_DEFAULT_NOW, build_report(demo_workdir / "kvlens.duckdb").text
    if os.environ.get("KVLENS_UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text, encoding="utf-8")
    update = "KVLENS_UPDATE_GOLDEN=1 .venv/bin/pytest tests/test_report.py"
    assert golden.is_file(), f"no golden {golden}: run {update}"
    assert text == golden.read_text(encoding="utf-8"), f"report changed: review, then {update}"


def test_demo_html_is_self_contained_with_every_chart(demo_report: Report, tmp_path: Path) -> None:
    page = demo_report.file_html
    assert "cid:" not in page and not re.search(r"(src|href)=\"https?:", page)
    assert "<style>" in page and "<link" not in page and "<script" not in page
    sizes = re.findall(r'<img src="data:image/png;base64,[A-Za-z0-9+/=]+" alt="[^"]*" width="(\d+)" '
                       r'height="(\d+)">', page)
    assert len(sizes) == len(demo_report.charts) >= 2  # the ledger and the trend at least
    for chart, (w, h) in zip(demo_report.charts, sizes, strict=True):
        assert png_size(chart.png) == (int(w), int(h))
        assert int(w) >= 300 and int(h) >= 100
    assert set(demo_report.images) >= {"ledger", "trend"}
    assert re.findall(r'src="cid:([^"]+)"', demo_report.html) == [c.cid for c in demo_report.charts]


def test_default_now_is_each_scenarios_latest_arrival(demo_workdir: Path, tmp_path: Path) -> None:
    out = write_report(demo_workdir / "kvlens.duckdb", tmp_path / "r.html")
    page = out.read_text()
    # The conversation trace's last arrival is 00:58:56.999: its what-ifs end just after it.
    assert "to 2025-01-01 00:58:56 UTC: cache8, cache8-lf2, rr8." in page
    assert "12,031" in page  # every request of the trace is in the 24 h window


# --- a real SMTP server on loopback --------------------------------------------------------------

class _Inbox:
    def __init__(self) -> None:
        self.messages: list[tuple[list[str], bytes]] = []

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        self.messages.append((list(envelope.rcpt_tos), envelope.original_content or envelope.content))
        return "250 OK"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _check_received(raw: bytes, report: Report, subject: str) -> None:
    msg = email.message_from_bytes(raw, policy=default_policy)
    assert isinstance(msg, EmailMessage) and msg["Subject"] == subject
    types = [p.get_content_type() for p in msg.walk()]
    assert types[:2] == ["multipart/alternative", "text/plain"] and "text/html" in types
    parts = {p.get_content_type(): p for p in msg.walk()}
    assert parts["text/plain"].get_content().replace("\r\n", "\n") == report.text
    referenced = set(re.findall(r'src="cid:([^"]+)"', parts["text/html"].get_content()))
    images = {p["Content-ID"].strip("<>"): p.get_content() for p in msg.walk()
              if p.get_content_type() == "image/png"}
    assert referenced == set(images) == set(report.images) and referenced  # each referenced, each present
    for cid, png in images.items():
        assert png == report.images[cid] and png_size(png)[0] > 0


def test_email_through_smtp_with_login(tiny_db: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from aiosmtpd.controller import Controller
    from aiosmtpd.smtp import AuthResult

    logins: list[tuple[bytes, bytes]] = []

    def authenticate(server: Any, session: Any, envelope: Any, mechanism: str, data: Any) -> AuthResult:
        logins.append((data.login, data.password))
        return AuthResult(success=data.password == b"s3cret", handled=False)  # False: the server says 535

    inbox, port = _Inbox(), _free_port()
    ctl = Controller(inbox, hostname="127.0.0.1", port=port, authenticator=authenticate,
                     auth_require_tls=False)
    ctl.start()
    try:
        monkeypatch.setenv("KVLENS_SMTP_PASSWORD", "s3cret")
        result = CliRunner().invoke(cli, [
            "report", "--db", str(tiny_db), "--out", str(tmp_path / "r.html"),
            "--email-to", "a@x.org, b@x.org", "--smtp", f"127.0.0.1:{port}",
            "--user", "kv", "--password-env", "KVLENS_SMTP_PASSWORD",
            "--from", "kvlens@x.org", "--subject", "nightly kvlens"])
        assert result.exit_code == 0, result.output
        assert "s3cret" not in result.output
        monkeypatch.setenv("KVLENS_SMTP_PASSWORD", "wrong")
        bad = CliRunner().invoke(cli, [
            "report", "--db", str(tiny_db), "--out", str(tmp_path / "r.html"), "--email-to", "a@x.org",
            "--smtp", f"127.0.0.1:{port}", "--user", "kv", "--password-env", "KVLENS_SMTP_PASSWORD"])
    finally:
        ctl.stop()
    assert logins[0] == (b"kv", b"s3cret")
    assert len(inbox.messages) == 1 and inbox.messages[0][0] == ["a@x.org", "b@x.org"]
    _check_received(inbox.messages[0][1], build_report(tiny_db), "nightly kvlens")
    assert bad.exit_code == 1 and _error_lines(bad.output) == [bad.output.splitlines()[-1]]
    assert "refused the login of 'kv'" in bad.output


def test_email_settings_from_the_config_file_and_flags_over_them(tiny_db: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from aiosmtpd.controller import Controller
    from aiosmtpd.smtp import AuthResult

    logins: list[bytes] = []

    def authenticate(server: Any, session: Any, envelope: Any, mechanism: str, data: Any) -> AuthResult:
        logins.append(data.login)
        return AuthResult(success=data.password == b"from-env", handled=False)

    inbox, port = _Inbox(), _free_port()
    toml = tmp_path / "kvlens.toml"
    toml.write_text(f"""
[smtp]
server = "127.0.0.1:{port}"
user = "nightly"
password_env = "KVLENS_TEST_SMTP_PASSWORD"
from = "kvlens@x.org"
to = ["ops@x.org", "kv@x.org"]
""")
    ctl = Controller(inbox, hostname="127.0.0.1", port=port, authenticator=authenticate,
                     auth_require_tls=False)
    ctl.start()
    try:
        monkeypatch.setenv("KVLENS_TEST_SMTP_PASSWORD", "from-env")
        base = ["report", "--db", str(tiny_db), "--out", str(tmp_path / "r.html"), "--config", str(toml)]
        from_file = CliRunner().invoke(cli, base)
        overridden = CliRunner().invoke(cli, [*base, "--email-to", "oncall@x.org", "--from", "night@x.org"])
    finally:
        ctl.stop()
    assert from_file.exit_code == 0 and overridden.exit_code == 0, from_file.output + overridden.output
    assert logins == [b"nightly", b"nightly"]
    assert [rcpt for rcpt, _ in inbox.messages] == [["ops@x.org", "kv@x.org"], ["oncall@x.org"]]
    senders = [email.message_from_bytes(raw)["From"] for _, raw in inbox.messages]
    assert senders == ["kvlens@x.org", "night@x.org"]


@pytest.mark.parametrize(("body", "message"), [
    ('[smtp]\nserver = "h:25"\npassword = "x"\n', "never read from the file"),
    ('[smtp]\nserver = "h:25"\nto = ["not-an-address"]\n', "to must be a list of addresses"),
    ('[smtp]\nserver = "h:25"\nuser = "u"\n', "user and password_env go together"),
    ('[smtp]\nsrever = "h:25"\n', "unknown key(s) ['srever']"),
])
def test_bad_smtp_config_is_one_line(body: str, message: str, tiny_db: Path, tmp_path: Path) -> None:
    toml = tmp_path / "kvlens.toml"
    toml.write_text(body)
    result = CliRunner().invoke(cli, ["report", "--db", str(tiny_db), "--out", str(tmp_path / "r.html"),
                                      "--config", str(toml)])
    assert result.exit_code == 1 and message in result.output
    assert _error_lines(result.output) == [result.output.splitlines()[-1]]


def _error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("Error: ")]


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl binary to make a self-signed certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return cert, key


def test_email_with_starttls(tiny_db: Path, tmp_path: Path) -> None:
    from aiosmtpd.controller import Controller

    cert, key = _self_signed(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    inbox, port = _Inbox(), _free_port()
    ctl = Controller(inbox, hostname="127.0.0.1", port=port, tls_context=server_ctx, require_starttls=True)
    ctl.start()
    report = build_report(tiny_db)
    try:
        msg = build_message(report, sender="kvlens@x.org", recipients=["ops@x.org"])
        with pytest.raises(KvlensError, match="could not send the report through SMTP server"):
            send_message(msg, SmtpSettings("127.0.0.1", port))  # the server insists on STARTTLS
        send_message(msg, SmtpSettings("127.0.0.1", port, starttls=True,
                                       ssl_context=ssl.create_default_context(cafile=str(cert))))
    finally:
        ctl.stop()
    assert len(inbox.messages) == 1
    _check_received(inbox.messages[0][1], report, report.subject)


# --- operator errors: one line, exit 1 --------------------------------------------------------------

@pytest.mark.parametrize("case", ["missing_db", "not_a_db", "smtp_refused", "no_password",
                                  "email_without_smtp"])
def test_errors_are_one_line(case: str, tiny_db: Path, tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVLENS_NO_SUCH_VAR", raising=False)
    garbage = tmp_path / "garbage.duckdb"
    garbage.write_text("not a database")
    args = {
        "missing_db": ["--db", str(tmp_path / "nope.duckdb")],
        "not_a_db": ["--db", str(garbage)],
        "smtp_refused": ["--db", str(tiny_db), "--email-to", "a@x.org",
                         "--smtp", f"127.0.0.1:{_free_port()}"],
        "no_password": ["--db", str(tiny_db), "--email-to", "a@x.org", "--smtp", "127.0.0.1:25",
                        "--user", "u", "--password-env", "KVLENS_NO_SUCH_VAR"],
        "email_without_smtp": ["--db", str(tiny_db), "--email-to", "a@x.org"],
    }[case]
    result = CliRunner().invoke(cli, ["report", "--out", str(tmp_path / "r.html"), *args])
    assert result.exit_code == 1
    assert _error_lines(result.output) == [result.output.splitlines()[-1]], result.output  # one line, last
    assert "Traceback" not in result.output


def test_no_requests_in_window_is_an_error(tiny_db: Path) -> None:
    with pytest.raises(NoDataError, match="no requests arrived"):
        build_report(tiny_db, now_ns=T0_NS - 10**9)
