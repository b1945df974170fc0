"""One bearer-token check for the admin API, the results API and ``/ui``'s login form:
the same table of tokens against all three, under a real server and Redis, gives the same
answers; the header's shapes give the same answers on both APIs; nothing is a 500."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.receiver.rawhttp import raw_request
from tests.servers import running_api

ADMIN = "auth-admin-token-0123456789"
CONSUMER = "auth-consumer-token-0123456789"
TEAM_A = "auth-team-a-token-0123456789"
CSRF = re.compile(r'name="csrf" value="([^"]+)"')

# (what is sent in place of the surface's own token T, accepted?)
TOKENS: list[tuple[str, str, bool]] = [
    ("good", "{T}", True),
    ("padded", "  {T}  ", True),
    ("wrong", "wrong-token-0123456789abcdef", False),
    ("truncated", "{T-1}", False),
    ("prefixed", "x{T}", False),
    ("two tokens", "{T} {T}", False),
    ("empty", "", False),
    ("non-ASCII", "{T}é", False),
    ("non-ASCII only", "tökén-ünïcödé-0123456789", False),
]
OTHER = {"admin": CONSUMER, "results": ADMIN}  # the other API's token: no use here


def _fill(template: str, own: str) -> str:
    return template.replace("{T-1}", own[:-1]).replace("{T}", own)


@pytest.fixture
async def surfaces(make_settings, redis_url):
    settings = make_settings(
        redis_url=redis_url,
        admin_tokens=[ADMIN],
        consumer_tokens=[{"token": CONSUMER}, {"token": TEAM_A, "tenant": "team-a"}],
        tenants={"team-a": {}},
        tenant_keys=["k" * 40],
    )
    async with running_api(settings, redis_url) as (base, _):
        yield base


SURFACES = {
    "admin": ("/admin/v1/watches", ADMIN, 200),
    "results": ("/v1/results/sim/x", CONSUMER, 404),
}


async def _api(base: str, surface: str, headers: list[tuple[bytes, bytes]]) -> httpx.Response:
    path, _, _ = SURFACES[surface]
    async with httpx.AsyncClient(base_url=base) as client:
        return await client.get(path, headers=headers)


async def _login(base: str, tokens: list[str] | None) -> int:
    """The status of /ui's login form with ``tokens`` typed in (None: no field at all)."""
    async with httpx.AsyncClient(base_url=base) as client:
        page = await client.get("/ui/login")
        csrf = CSRF.search(page.text).group(1)  # type: ignore[union-attr]
        data: dict[str, str | list[str]] = {"csrf": csrf}
        if tokens is not None:
            data["token"] = tokens
        r = await client.post("/ui/login", data=data)
        if r.status_code == 303:
            assert r.headers["location"] == "/ui/"
            assert (await client.get("/ui/")).status_code == 200
        return r.status_code


def _same_refusals(admin: httpx.Response, results: httpx.Response) -> str:
    """Both APIs refused alike: 401, the same reason and challenge but for the API's name;
    the reason."""
    assert admin.status_code == results.status_code == 401
    reason = admin.json()["error"]
    assert results.json()["error"] == reason.replace("admin", "consumer")
    assert admin.headers["www-authenticate"].startswith('Bearer realm="nopoll admin"')
    challenge = admin.headers["www-authenticate"].replace("nopoll admin", "nopoll results")
    assert results.headers["www-authenticate"] == challenge.replace("admin", "consumer")
    assert reason.startswith("Authorization: ")
    return reason


@pytest.mark.parametrize(
    ("sent", "accepted"), [(t, a) for _, t, a in TOKENS], ids=[n for n, _, _ in TOKENS]
)
async def test_every_surface_answers_a_token_alike(surfaces, sent: str, accepted: bool):
    answers = {}
    for surface, (_, own, ok_status) in SURFACES.items():
        header = (b"Bearer " + _fill(sent, own).encode()).rstrip(b" ")  # (httpx's rule)
        r = await _api(surfaces, surface, [(b"authorization", header)])
        assert r.status_code == (ok_status if accepted else 401), (surface, r.text)
        answers[surface] = r
        # the other API's token is refused here, like a wrong one
        other = await _api(
            surfaces, surface, [(b"authorization", b"Bearer " + OTHER[surface].encode())]
        )
        assert other.status_code == 401 and "not a valid" in other.json()["error"]
    login = await _login(surfaces, [_fill(sent, ADMIN)])
    assert login == (303 if accepted else 401)
    if not accepted:
        reason = _same_refusals(answers["admin"], answers["results"])
        assert re.search(
            r"not a valid admin bearer token|expected 'Bearer <token>'|not ASCII", reason
        )


HEADERS: list[tuple[str, list[bytes], bool, str]] = [
    ("lower-case scheme", [b"bearer {T}"], True, ""),
    ("upper-case scheme", [b"BEARER {T}"], True, ""),
    ("missing", [], False, "missing"),
    ("empty", [b""], False, "the scheme must be Bearer"),
    ("no scheme", [b"{T}"], False, "the scheme must be Bearer"),
    ("basic", [b"Basic {T}"], False, "the scheme must be Bearer"),
    ("scheme only", [b"Bearer"], False, "expected 'Bearer <token>'"),
    ("tab", [b"Bearer\t{T}"], False, "the scheme must be Bearer"),
    (
        "sent twice, good first",
        [b"Bearer {T}", b"Bearer wrong-token-0123456789"],
        False,
        "more than once",
    ),
    (
        "sent twice, good last",
        [b"Bearer wrong-token-0123456789", b"Bearer {T}"],
        False,
        "more than once",
    ),
    ("sent twice, the same", [b"Bearer {T}", b"Bearer {T}"], False, "more than once"),
    ("utf-8", ["Bearer tökén-0123456789".encode()], False, "not ASCII"),
    ("latin-1 byte", [b"Bearer {T}\xff"], False, "not ASCII"),
]


@pytest.mark.parametrize(
    ("values", "accepted", "reason"), [h[1:] for h in HEADERS], ids=[h[0] for h in HEADERS]
)
async def test_both_apis_read_the_authorization_header_alike(
    surfaces, values: list[bytes], accepted: bool, reason: str
):
    answers = {}
    for surface, (_, own, ok_status) in SURFACES.items():
        headers = [(b"authorization", v.replace(b"{T}", own.encode())) for v in values]
        r = await _api(surfaces, surface, headers)
        assert r.status_code == (ok_status if accepted else 401), (surface, r.text)
        answers[surface] = r
    if not accepted:
        assert reason in _same_refusals(answers["admin"], answers["results"])
    if values == []:  # no credentials at all: a challenge without an error code (RFC 6750)
        assert "error=" not in answers["admin"].headers["www-authenticate"]


@pytest.mark.parametrize(
    "typed",
    [None, [ADMIN, "wrong-token-0123456789"], ["wrong-token-0123456789", ADMIN], [ADMIN, ADMIN]],
    ids=["no field", "twice, good first", "twice, good last", "twice, the same"],
)
async def test_the_login_form_takes_exactly_one_token(surfaces, typed):
    assert await _login(surfaces, typed) == 401


async def test_a_consumer_token_logs_in_to_ui_only_when_it_is_limited_to_a_tenant(surfaces):
    """A consumer token limited to a tenant opens that tenant's view of /ui; one that is
    not limited reads every tenant's results, and must not open /ui at all."""
    assert await _login(surfaces, [TEAM_A]) == 303
    assert await _login(surfaces, [CONSUMER]) == 401


async def test_raw_non_ascii_authorization_bytes_are_401_never_500(surfaces):
    for path in ("/admin/v1/watches", "/v1/results/sim/x", "/v1/results/stream"):
        for value in (
            b"Bearer \xff\xfe",
            b"\xc3\xa9",
            "Bearer ünï".encode(),
            b"Bearer " + b"\x80" * 4000,
        ):
            head = (
                b"GET "
                + path.encode()
                + b" HTTP/1.1\r\nhost: x\r\nauthorization: "
                + value
                + b"\r\n"
            )
            status, body = await raw_request(surfaces, head)
            assert status == 401, (path, value[:20], status, body)
            assert body["error"].startswith("Authorization: ")
