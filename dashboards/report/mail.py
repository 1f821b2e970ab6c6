"""Dashboards: the report as a multipart email, sent through SMTP (optional STARTTLS and login).

The message is multipart/alternative: a text/plain part, then multipart/related holding the
HTML part and every chart as an inline image/png whose Content-ID the HTML references
(``cid:NAME``). Sending failures become one-line KvlensErrors; a password is passed in by the
caller (the CLI reads it from an environment variable), never logged.
"""

from __future__ import annotations

import logging
import smtplib
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from email.message import EmailMessage
from email.utils import formatdate, make_msgid

from kvlens.dashboards.report.build import Report
from kvlens.errors import ConfigError, KvlensError

__all__ = ["SmtpSettings", "build_message", "parse_smtp", "send_message"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SmtpSettings:
    host: str
    port: int
    starttls: bool = False
    user: str | None = None
    password: str | None = None
    timeout_s: float = 30.0
    ssl_context: ssl.SSLContext | None = None  # default: the system's trust store


def parse_smtp(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6addr]:PORT`` too) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--smtp {text!r} is not HOST:PORT: write e.g. smtp.example.com:587")
    return host.strip("[]"), int(port)


def build_message(report: Report, *, sender: str, recipients: Sequence[str], subject: str | None = None,
                  date_s: float | None = None) -> EmailMessage:
    """The report as an EmailMessage: text/plain, and text/html with its images inline by Content-ID."""
    if not recipients:
        raise ConfigError("no recipient: pass --email-to ADDR[,ADDR]")
    msg = EmailMessage()
    msg["Subject"] = subject or report.subject
    msg["From"] = sender
    msg["To"] = ", ".join(recipients)
    msg["Date"] = formatdate(date_s, usegmt=True)
    msg["Message-ID"] = make_msgid(domain="kvlens")
    msg.set_content(report.text)
    msg.add_alternative(report.html, subtype="html")
    html_part = next(p for p in msg.iter_parts() if p.get_content_type() == "text/html")
    for cid, png in report.images.items():
        html_part.add_related(png, maintype="image", subtype="png", cid=f"<{cid}>", filename=f"{cid}.png",
                              disposition="inline")
    return msg


def send_message(msg: EmailMessage, settings: SmtpSettings) -> None:
    """Send through ``settings``; any SMTP or network failure is one KvlensError line."""
    where = f"{settings.host}:{settings.port}"
    try:
        with smtplib.SMTP(settings.host, settings.port, timeout=settings.timeout_s) as smtp:
            if settings.starttls:
                smtp.starttls(context=settings.ssl_context or ssl.create_default_context())
            if settings.user is not None:
                smtp.login(settings.user, settings.password or "")
            refused = smtp.send_message(msg)
    except smtplib.SMTPAuthenticationError as e:
        raise KvlensError(f"SMTP server {where} refused the login of {settings.user!r} ({e.smtp_code}): "
                          "check --user and the password variable") from None
    except smtplib.SMTPNotSupportedError as e:
        raise KvlensError(f"SMTP server {where}: {e}: drop --starttls or --user, "
                          "or use another server") from None
    except (smtplib.SMTPException, OSError) as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise KvlensError(f"could not send the report through SMTP server {where}: {reason}: "
                          "check --smtp, --starttls and that the server is up") from None
    if refused:
        log.warning("SMTP server %s refused recipients: %s", where, ", ".join(refused))
    log.info("report sent through %s to %s", where, msg["To"])
