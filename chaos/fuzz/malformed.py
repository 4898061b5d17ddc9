"""Malformed HTTP requests on raw sockets: what a scanner, a broken client or an attacker sends.

:class:`CaseMaker` draws one :class:`Case` at a time from these families: bad request
lines (garbage, missing or unknown versions, control bytes, long targets, LF-only
lines), bad headers (no colon, folding, too many, too large, non-ASCII, conflicting or
nonsensical ``Content-Length``, ``Transfer-Encoding`` tricks, missing or foreign
``Host``), bad bodies (not JSON, wrong JSON types, deep nesting, invalid UTF-8, over
MAX_REQUEST_BYTES, chunked bodies with bad sizes or cut short, bodies shorter than
declared), wrong methods, unknown paths, admin routes without the token, and
slowloris-style requests dripped a byte at a time (bounded: the client gives up after
two seconds).

A case sent whole must get a reaction (a response or a close) within ten seconds.
Never acceptable: a 5xx answer, no reaction, a non-JSON error on a ``/v1/`` route the
application served, or a status other than the one SPEC §5 names where it names one.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from dataclasses import dataclass, field

MODEL = "nope-model"  # unknown: these requests never reach a worker
REACTION_SECS = 10.0


@dataclass
class Case:
    label: str
    parts: list[bytes]
    #: The request is complete as sent: the server must react to it.
    complete: bool = True
    #: Statuses SPEC §5 requires, when it names them.
    expect: frozenset[int] | None = None
    #: An error answer must be JSON (a /v1/ route the application serves).
    json_errors: bool = False
    #: Seconds between parts (slowloris).
    pause: float = 0.0
    #: How long an incomplete request's connection is kept open before the client leaves.
    hold: float = 1.0


#: The kinds of problem a reaction can show, each judged by its own check.
PROBLEMS = {
    "5xx": "no 5xx answer to a malformed request",
    "no reaction": "a reaction to every complete request",
    "status": "the status SPEC §5 names",
    "not JSON": "JSON errors on /v1/ routes",
    "not HTTP": "well-formed responses",
}


@dataclass
class HttpTally:
    sent: int = 0
    labels: Counter[str] = field(default_factory=Counter)
    reactions: Counter[str] = field(default_factory=Counter)
    #: kind -> case label -> how often, and a few examples per kind.
    problems: dict[str, Counter[str]] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def problem(self, kind: str, label: str, text: str) -> None:
        self.problems.setdefault(kind, Counter())[label] += 1
        examples = self.examples.setdefault(kind, [])
        if len(examples) < 4:
            examples.append(f"{label}: {text}")


class CaseMaker:
    def __init__(self, rng: random.Random, port: int, max_request: int) -> None:
        self.rng = rng
        self.host = f"127.0.0.1:{port}"
        self.max_request = max_request

    def head(
        self,
        method: str = "POST",
        path: str = "/v1/chat/completions",
        headers: list[str] | None = None,
        *,
        version: str = "HTTP/1.1",
        host: bool = True,
    ) -> bytes:
        lines = [f"{method} {path} {version}"]
        if host:
            lines.append(f"Host: {self.host}")
        lines.append("Connection: close")
        lines.extend(headers or [])
        return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")

    def post(
        self,
        body: bytes,
        path: str = "/v1/chat/completions",
        headers: list[str] | None = None,
        **kwargs: object,
    ) -> bytes:
        extra = ["Content-Type: application/json", f"Content-Length: {len(body)}", *(headers or [])]
        return self.head("POST", path, extra, **kwargs) + body  # type: ignore[arg-type]

    def case(self) -> Case:
        rng = self.rng
        family = rng.choices(
            [self.request_line, self.headers, self.body, self.method, self.path, self.slow],
            weights=[18, 22, 26, 12, 18, 4],
        )[0]
        return family()

    # -- families ------------------------------------------------------------------

    def request_line(self) -> Case:
        rng = self.rng
        cases = [
            Case("garbage request line", [rng.randbytes(rng.randint(1, 200)) + b"\r\n\r\n"]),
            Case("no HTTP version", [b"GET /health\r\n\r\n"], complete=False),
            Case("HTTP/9.9", [self.head("GET", "/health", version="HTTP/9.9")]),
            Case(
                "HTTP/1.0 request",
                [self.post(b'{"model":"nope-model"}', version="HTTP/1.0")],
                json_errors=True,
            ),
            Case("lowercase method", [self.head("get", "/health")]),
            Case("control bytes in the method", [b"G\x00T /health HTTP/1.1\r\nHost: x\r\n\r\n"]),
            Case("8 KB target", [self.head("GET", "/v1/" + "a" * 8000)]),
            Case("70 KB target", [self.head("GET", "/v1/" + "a" * 70_000)]),
            Case(
                "NUL and dot segments in the target", [self.head("GET", "/v1/%00/../../etc/passwd")]
            ),
            Case("absolute-form target", [self.head("GET", f"http://{self.host}/health")]),
            # RFC 9112 §2.2 lets a server insist on CRLF: it may wait for the end of the head.
            Case(
                "LF-only line ends",
                [f"GET /health HTTP/1.1\nHost: {self.host}\n\n".encode()],
                complete=False,
            ),
            Case("HTTP/0.9 request", [b"GET /\r\n"], complete=False),
            Case("extra spaces", [f"GET  /health  HTTP/1.1\r\nHost: {self.host}\r\n\r\n".encode()]),
            # RFC 9112 §2.2: empty lines before a request line are skipped; the server waits.
            Case("empty lines only", [b"\r\n\r\n"], complete=False),
            Case("binary noise", [rng.randbytes(rng.randint(1, 4000))], complete=False),
        ]
        return rng.choice(cases)

    def headers(self) -> Case:
        rng = self.rng
        body = json.dumps({"model": MODEL, "messages": []}).encode()
        many = [f"X-H{i}: v" for i in range(rng.randint(101, 400))]
        cases = [
            Case("header without a colon", [self.post(body, headers=["NoColonHere"])]),
            Case("space before the colon", [self.post(body, headers=["X-A : b"])]),
            Case("obs-fold continuation", [self.post(body, headers=["X-A: a", " folded"])]),
            Case(
                "over 100 headers",
                [self.post(body, headers=many)],
                expect=frozenset({431}),
                json_errors=True,
            ),
            Case(
                "17 KB header",
                [self.post(body, headers=["X-Pad: " + "p" * 17_000])],
                expect=frozenset({431}),
                json_errors=True,
            ),
            Case("100 KB header line", [self.post(body, headers=["X-Pad: " + "p" * 100_000])]),
            Case("non-ASCII header bytes", [self.post(body, headers=["X-\udcff: \udcfe\udce9"])]),
            Case(
                "two different Content-Lengths",
                [
                    self.head(
                        "POST",
                        "/v1/chat/completions",
                        [f"Content-Length: {len(body)}", "Content-Length: 3"],
                    )
                    + body
                ],
            ),
            Case(
                "Content-Length and Transfer-Encoding",
                [
                    self.head(
                        "POST",
                        "/v1/chat/completions",
                        [f"Content-Length: {len(body)}", "Transfer-Encoding: chunked"],
                    )
                    + body
                ],
                complete=False,
            ),
            Case(
                "Transfer-Encoding: gzip, chunked",
                [
                    self.head("POST", "/v1/chat/completions", ["Transfer-Encoding: gzip, chunked"])
                    + b"5\r\nhello\r\n0\r\n\r\n"
                ],
            ),
            Case(
                "Content-Length -1",
                [self.head("POST", "/v1/chat/completions", ["Content-Length: -1"]) + body],
                complete=False,
            ),
            Case(
                "Content-Length abc",
                [self.head("POST", "/v1/chat/completions", ["Content-Length: abc"]) + body],
                complete=False,
            ),
            Case(
                "Content-Length 1e3",
                [self.head("POST", "/v1/chat/completions", ["Content-Length: 1e3"]) + body],
                complete=False,
            ),
            Case(
                "Content-Length 30 digits",
                [self.head("POST", "/v1/chat/completions", ["Content-Length: " + "9" * 30]) + body],
                complete=False,
            ),
            Case("no Host header", [self.post(body, host=False)]),
            Case(
                "foreign Host header", [self.post(body, headers=["Host: evil.example"], host=False)]
            ),
            Case("Expect: 100-continue", [self.post(body, headers=["Expect: 100-continue"])]),
            Case(
                "Upgrade: websocket on an API route",
                [self.post(body, headers=["Upgrade: websocket", "Connection: Upgrade"])],
            ),
            Case(
                "bogus Content-Type",
                [
                    self.head(
                        "POST",
                        "/v1/chat/completions",
                        ["Content-Type: \x7f/\x01", f"Content-Length: {len(body)}"],
                    )
                    + body
                ],
            ),
        ]
        return rng.choice(cases)

    def body(self) -> Case:
        rng = self.rng
        path = rng.choice(["/v1/chat/completions", "/v1/messages", "/v1/responses"])
        depth = rng.randint(1000, 20_000)
        nested = b'{"model":"nope-model","messages":' + b"[" * depth + b"]" * depth + b"}"
        over = b'{"model":"nope-model","pad":"' + b"a" * self.max_request + b'"}'
        good = json.dumps({"model": MODEL, "messages": []}).encode()

        def post(body: bytes, **kw: object) -> bytes:
            return self.post(body, path, **kw)  # type: ignore[arg-type]

        def chunked(raw: bytes) -> bytes:
            return (
                self.head(
                    "POST", path, ["Content-Type: application/json", "Transfer-Encoding: chunked"]
                )
                + raw
            )

        json400 = {"expect": frozenset({400}), "json_errors": True}
        cases = [
            Case(
                "body not JSON",
                [post(rng.randbytes(rng.randint(1, 300)).replace(b"\x00", b"x"))],
                expect=frozenset({400}),
                json_errors=True,
            ),
            Case("JSON array body", [post(b'[{"model":"nope-model"}]')], **json400),  # type: ignore[arg-type]
            Case("JSON string body", [post(b'"model"')], **json400),  # type: ignore[arg-type]
            Case("model is a number", [post(b'{"model":42}')], **json400),  # type: ignore[arg-type]
            Case("model is a list", [post(b'{"model":["a"]}')], **json400),  # type: ignore[arg-type]
            Case("model is null", [post(b'{"model":null}')], **json400),  # type: ignore[arg-type]
            Case("model is empty", [post(b'{"model":"  "}')], **json400),  # type: ignore[arg-type]
            Case("stream is a string", [post(b'{"model":"nope-model","stream":"yes"}')], **json400),  # type: ignore[arg-type]
            Case("empty body", [post(b"")], **json400),  # type: ignore[arg-type]
            Case(
                "deeply nested JSON", [post(nested)], expect=frozenset({400, 404}), json_errors=True
            ),
            Case(
                "body over MAX_REQUEST_BYTES",
                [post(over)],
                expect=frozenset({413}),
                json_errors=True,
            ),
            # No body follows: a server may wait for it (daphne does) or refuse at once.
            Case(
                "declared length over the limit",
                [
                    self.head(
                        "POST",
                        path,
                        [
                            "Content-Type: application/json",
                            f"Content-Length: {self.max_request * 4}",
                        ],
                    )
                ],
                complete=False,
                expect=frozenset({413}),
                json_errors=True,
            ),
            Case("invalid UTF-8 body", [post(b'{"model":"nope-\xff\xfe"}')], **json400),  # type: ignore[arg-type]
            Case(
                "Content-Type text/plain",
                [post(good, headers=["Content-Type: text/plain"])],
                json_errors=True,
            ),
            Case("unknown model", [post(good)], expect=frozenset({404}), json_errors=True),
            Case(
                "body shorter than declared",
                [
                    self.head(
                        "POST", path, ["Content-Type: application/json", "Content-Length: 500"]
                    )
                    + good
                ],
                complete=False,
            ),
            Case("chunked body cut short", [chunked(b"40\r\n" + good[:20])], complete=False),
            Case("chunked body with a bad size", [chunked(b"zz\r\n" + good + b"\r\n0\r\n\r\n")]),
            Case(
                "chunked body with a huge size",
                [chunked(b"ffffffffffffffff\r\n" + good)],
                complete=False,
            ),
            Case(
                "chunked body, well-formed",
                [chunked(b"%x\r\n%s\r\n0\r\n\r\n" % (len(good), good))],
                expect=frozenset({404}),
                json_errors=True,
            ),
        ]
        return rng.choice(cases)

    def method(self) -> Case:
        rng = self.rng
        path = rng.choice(["/v1/chat/completions", "/v1/messages", "/v1/responses"])
        method = rng.choice(["GET", "PUT", "DELETE", "PATCH", "OPTIONS"])
        cases = [
            Case(
                f"{method} on an inference route",
                [self.head(method, path)],
                expect=frozenset({405}),
                json_errors=True,
            ),
            Case("HEAD on an inference route", [self.head("HEAD", path)], expect=frozenset({405})),
            Case("TRACE", [self.head("TRACE", path)]),
            Case("CONNECT", [self.head("CONNECT", self.host)]),
            Case(
                "POST /v1/models",
                [self.post(b"{}", "/v1/models")],
                expect=frozenset({405}),
                json_errors=True,
            ),
            Case("made-up method", [self.head("BREW", "/health")]),
        ]
        return rng.choice(cases)

    def path(self) -> Case:
        rng = self.rng
        word = "".join(rng.choice("abcxyz%/._-09") for _ in range(rng.randint(1, 40)))
        cases = [
            Case(
                "unknown /v1/ path",
                [self.head("GET", f"/v1/{word}")],
                expect=frozenset({400, 404, 405}),
                json_errors=True,
            ),
            Case(
                "POST to an unknown /v1/ path",
                [self.post(b"{}", f"/v1/x{word}")],
                expect=frozenset({400, 404, 405}),
                json_errors=True,
            ),
            Case(
                "unknown model id",
                [self.head("GET", f"/v1/models/{word}")],
                expect=frozenset({404}),
                json_errors=True,
            ),
            Case("unknown path", [self.head("GET", f"/{word}")]),
            Case(
                "admin API without a token",
                [self.head("GET", "/admin/workers")],
                expect=frozenset({403}),
            ),
            Case(
                "admin API with a wrong token",
                [self.head("GET", "/admin/stats", ["Authorization: Bearer nope"])],
                expect=frozenset({403}),
            ),
            Case(
                "drain without a token",
                [self.post(b"{}", "/admin/workers/w-x/drain")],
                expect=frozenset({403}),
            ),
            Case("/metrics", [self.head("GET", "/metrics")], expect=frozenset({200})),
            Case("/health", [self.head("GET", "/health")], expect=frozenset({200})),
            Case("Django admin", [self.head("GET", "/django-admin/")]),
            Case("percent-encoded garbage", [self.head("GET", "/%ff%fe/%2e%2e/%c0%af")]),
        ]
        return rng.choice(cases)

    def slow(self) -> Case:
        rng = self.rng
        body = json.dumps({"model": MODEL, "messages": []}).encode()
        whole = self.post(body)
        if rng.random() < 0.5:
            # A few bytes every 0.2 s for under two seconds, then silence, then the client leaves.
            cut = rng.randint(5, len(whole) - 20)
            step = max(1, cut // 8)
            parts = [whole[i : min(i + step, cut)] for i in range(0, cut, step)]
            return Case(
                "slowloris: a partial request dripped", parts, complete=False, pause=0.2, hold=1.0
            )
        step = max(1, len(whole) // 8)
        parts = [whole[i : i + step] for i in range(0, len(whole), step)]
        return Case(
            "slow but complete request",
            parts,
            pause=0.12,
            expect=frozenset({404}),
            json_errors=True,
        )


async def send_case(port: int, case: Case, tally: HttpTally) -> None:
    """Send one case and judge the server's reaction."""
    tally.sent += 1
    tally.labels[case.label] += 1
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as exc:
        tally.problem("no reaction", case.label, f"cannot connect ({exc})")
        return
    reaction = ""
    try:
        for i, part in enumerate(case.parts):
            if i and case.pause:
                await asyncio.sleep(case.pause)
            writer.write(part)
            await writer.drain()
        wait = REACTION_SECS if case.complete else case.hold
        async with asyncio.timeout(wait):
            head = await reader.read(65536)
            while head and b"\r\n\r\n" not in head and len(head) < 65536:
                more = await reader.read(65536)
                if not more:
                    break
                head += more
        reaction = _judge(case, head, tally)
    except TimeoutError:
        reaction = "no reaction" if case.complete else "held"
        if case.complete:
            tally.problem("no reaction", case.label, f"nothing within {REACTION_SECS:g}s")
    except (ConnectionError, OSError):
        reaction = "reset"
    finally:
        writer.transport.abort()
    tally.reactions[reaction] += 1


def _judge(case: Case, head: bytes, tally: HttpTally) -> str:
    if not head:
        return "closed"
    line, _, rest = head.partition(b"\r\n")
    parts = line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        tally.problem("not HTTP", case.label, f"{head[:60]!r}")
        return "garbage"
    status = int(parts[1])
    headers = rest.lower()
    request_line = case.parts[0].split(b"\r\n", 1)[0][:80]
    if status >= 500:
        tally.problem("5xx", case.label, f"{request_line!r} -> {head[:200]!r}")
    if case.expect is not None and status not in case.expect:
        tally.problem(
            "status", case.label, f"{request_line!r} -> {status}, expected {sorted(case.expect)}"
        )
    if case.json_errors and status >= 400 and b"content-type: application/json" not in headers:
        tally.problem("not JSON", case.label, f"{request_line!r} -> {head[:100]!r}")
    return f"{status}"
