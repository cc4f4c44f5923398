"""The control plane over HTTP: versions, weights, live/rollback/pin, acceptance series, dashboard.

Contract: `add_control_routes(app, plane)` mounts the same routes on the learner sidecar and on an
embedded `specd serve`:
  GET  /v1/versions                 {"live": n, "versions": [manifest, ...]}
  GET  /v1/versions/{n}             one manifest
  GET  /v1/versions/{n}/weights     the safetensors file (servers check its sha256)
  GET  /v1/acceptance               acceptance time series and totals per version and server (the
                                    learned drafter's own drafts), and per drafting source
  GET  /v1/status                   learner and store status
  POST /v1/live      {"version": n}            make n live; a candidate (a version that never went
                                               through the gate) is first put through the learner's
                                               gate where there is one: 409 if it fails, 503 with
                                               Retry-After while the gate lacks evidence
  POST /v1/rollback  {"version": n?, "if_live": m?}
                                               roll back (default: the previous live version);
                                               with if_live, only while m is live (409 otherwise)
  POST /v1/pin       {"version": n, "pinned": true|false}   answers {"live", "version", "pinned"}
  GET  /  and /dashboard            the dashboard page
POST routes need `Authorization: Bearer <token>` when a token is configured; a body field a route
does not take is refused (400), not ignored. A version an operator makes live or rolls back to
(one that served before, or a file put in the store by hand) is first checked as every server
will check it (`check_servable`: the digest, then the file loaded for `fingerprint`), so the store
never names a live version that servers refuse: 409 with the reason. A default rollback is taken
against the version live when the request came: two at once roll back one step, not two. Store
errors become JSON errors with the reason and their kind's status (404 for a version that does
not exist, 409 for an operation the store refuses, 400 for a malformed body, 413 for a body over
`MAX_CONTROL_BODY_BYTES`); `control_app()` is the application a process that serves only the
plane starts from (unknown routes and methods answered in JSON too).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import torch
from aiohttp import web

from specd.control.acceptance import AcceptanceLog
from specd.core.errors import BadRequest, InternalError, SpecdError, StoreError, VersionNotFound
from specd.core.http_requests import bearer_matches, json_object_off_loop, read_body
from specd.hotswap.integrity import check_servable
from specd.hotswap.store import MAX_VERSION, WeightStore
from specd.model.fingerprint import TargetFingerprint

MAX_CONTROL_BODY_BYTES = 8 * 1024 * 1024   # a body is a few fields; the OpenAI routes' limit


@dataclass
class ControlPlane:
    store: WeightStore
    acceptance: AcceptanceLog
    token: str | None = None
    status: Callable[[], dict[str, Any]] = field(default=lambda: {})
    on_change: Callable[[], None] = field(default=lambda: None)  # e.g. announce the new live version
    # the learner's gate for candidates an operator wants live (None: no learner here, no gate)
    submit: Callable[[int], Future[dict[str, Any]]] | None = None
    gate_timeout_s: float = 300.0
    # the target servers load versions for: an operator's version is checked as they will check it
    # (None: its digest alone)
    fingerprint: TargetFingerprint | None = None
    target_embedding: torch.Tensor | None = None

    def check(self, version: int) -> None:
        """Refuse (409, StoreError) a version that every server would refuse. One whose files are gone
        is left to the store's own operation, which names what is missing (404)."""
        if not self.store.weights_path(version).is_file():
            return
        try:
            if self.fingerprint is not None:
                check_servable(version, self.store.weights_path(version), self.store.manifest(version),
                               self.fingerprint, self.target_embedding)
            else:
                self.store.check_weights(version)
        except VersionNotFound:
            raise
        except (SpecdError, OSError) as error:  # a bad digest, a file not for this target, non-finite values
            raise StoreError(f"version {version} cannot go live: {error}") from None


log = logging.getLogger(__name__)
PLANE = web.AppKey("control_plane", ControlPlane)


def _error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": code}},
                             status=status)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _answers_errors(handler: Handler) -> Handler:
    """Every control route's errors, mapped in this one place (as the API's `_errors` middleware
    maps its own): a `SpecdError` becomes its kind's status and JSON body, aiohttp's own HTTP
    errors (a version that is not a number) the same shape. The plane is mounted on other apps
    (a server's, the learner sidecar's), so it carries its mapping with its routes."""

    @functools.wraps(handler)
    async def answered(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except SpecdError as error:
            return web.json_response(error.as_json(), status=error.http_status)
        except web.HTTPException as error:
            return _error(error.status, error.reason)
        except Exception:  # a bug: its traceback in the log, a JSON 500 to the client (never aiohttp's text page)
            log.exception("control route %s %s failed", request.method, request.path)
            return web.json_response(InternalError().as_json(), status=InternalError.http_status)

    return answered


def _version(request: web.Request) -> int:
    text = request.match_info["version"]
    if not (text.isascii() and text.isdigit()):  # int() would also take "1_0", "+1" and other scripts' digits
        raise web.HTTPBadRequest(reason="the version must be a number in decimal digits")
    if len(text) > len(str(MAX_VERSION)):  # never a file name that long: past any version a store holds
        raise VersionNotFound(f"version {text[:24]}… does not exist (no store numbers a version that high)")
    return int(text)


def _fields(body: dict[str, Any], allowed: tuple[str, ...]) -> dict[str, Any]:
    """The body, refused if it carries a field the route does not take (a typo must not be ignored)."""
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(repr(f[:40]) for f in unknown[:5])}; "
                         f"this route takes {', '.join(repr(f) for f in allowed)}")
    return body


async def _authorised_body(request: web.Request) -> dict[str, Any] | web.Response:
    plane = request.app[PLANE]
    given = request.headers.get("Authorization", "")
    if plane.token and not bearer_matches(given, plane.token):
        said = "; the token given is not this server's --token" if given else ""
        return _error(401, f"this control operation needs `Authorization: Bearer <token>`{said}",
                      kind="authentication_error", code="invalid_token")  # as the OpenAI routes' key
    try:
        raw = await read_body(request) if request.can_read_body else b"{}"
    except web.HTTPRequestEntityTooLarge:
        return _error(413, f"the request body is over this server's limit of {request.client_max_size} bytes",
                      code="request_too_large")
    return await json_object_off_loop(raw)


def _optional_int(body: dict[str, Any], name: str, required: bool) -> int | None:
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"'{name}' must be an integer version number")
    if value >= MAX_VERSION:  # never a file name that long: past any version a store holds
        raise VersionNotFound(f"version {str(value)[:24]}… does not exist (no store numbers a version that high)")
    return value


async def versions(request: web.Request) -> web.Response:
    store = request.app[PLANE].store
    return web.json_response({"live": store.live_version(), "versions": store.manifests()})


async def manifest(request: web.Request) -> web.Response:
    return web.json_response(request.app[PLANE].store.manifest(_version(request)))


async def weights(request: web.Request) -> web.StreamResponse:
    path = request.app[PLANE].store.weights_path(_version(request))
    if not path.is_file():
        return _error(404, f"version {_version(request)} has no weights here")
    return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})


async def acceptance(request: web.Request) -> web.Response:
    log = request.app[PLANE].acceptance
    return web.json_response({"series": list(log.series), "totals": log.totals_as_dict(),
                              "source_series": list(log.source_series), "source_totals": log.source_totals_as_dict()})


async def status(request: web.Request) -> web.Response:
    plane = request.app[PLANE]
    return web.json_response({"live": plane.store.live_version(), **plane.status()})


async def _operate(request: web.Request, operation: Callable[[ControlPlane, dict[str, Any]], dict[str, Any]],
                   body: dict[str, Any] | None = None) -> web.Response:
    if body is None:
        authorised = await _authorised_body(request)
        if isinstance(authorised, web.Response):
            return authorised
        body = authorised
    plane = request.app[PLANE]
    # off the event loop: the store hashes weights and waits for its lock, and in `specd serve` this
    # loop also streams answers. A malformed body, or an operation the store refuses, raises: see
    # _answers_errors. The answer says what the operation did (the version it made live), not a later reading.
    answer = await asyncio.to_thread(operation, plane, body)
    plane.on_change()
    return web.json_response(answer)


async def set_live(request: web.Request) -> web.Response:
    body = await _authorised_body(request)
    if isinstance(body, web.Response):
        return body
    plane = request.app[PLANE]
    version = _optional_int(_fields(body, ("version",)), "version", True) or 0
    status = plane.store.manifest(version).get("status")
    if plane.submit is None or status != "candidate":  # a version that has been live before: no gate
        def make_live(plane: ControlPlane, body: dict[str, Any]) -> dict[str, Any]:
            # but what its manifest says is not evidence that servers can load it
            plane.store.set_live(version, "operator", check=plane.check)
            return {"live": version}

        return await _operate(request, make_live, body)
    # a file that servers would refuse needs no evaluation (a replay of the held-out records): a 409 now
    await asyncio.to_thread(plane.check, version)
    try:  # evaluated on the learner's thread; this loop keeps serving meanwhile
        # shielded: a verdict already under way cannot be called off, so the timeout must not pretend to
        verdict = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(plane.submit(version))),
                                         plane.gate_timeout_s)
    except TimeoutError:
        return _error(504, f"the gate has not decided on version {version} within {plane.gate_timeout_s:.0f} s; "
                           f"it is still being judged and goes live if it passes (GET /v1/versions/{version})")
    except (SpecdError, OSError) as error:
        return _error(409, f"version {version} cannot be evaluated: {error}")
    if verdict.get("waiting"):
        response = _error(503, f"version {version} is not live: {verdict['reason']}")
        response.headers["Retry-After"] = "30"
        return response
    if not verdict.get("passed"):
        message = f"version {version} is not live: the gate refused it: {verdict['reason']}"
        return web.json_response({"error": {"message": message, "type": "invalid_request_error"},
                                  "evaluation": verdict}, status=409)
    plane.on_change()
    return web.json_response({"live": plane.store.live_version(), "evaluation": verdict})


def _roll_back(plane: ControlPlane, body: dict[str, Any], live_when_asked: int | None) -> dict[str, Any]:
    _fields(body, ("version", "if_live"))
    to, if_live = _optional_int(body, "version", False), _optional_int(body, "if_live", False)
    # against the version live when the request came (or the one the operator saw): a second
    # request sent at once, or a second click, finds another version live and is refused (409)
    # rather than going back another step
    live = live_when_asked if if_live is None else if_live
    return {"live": plane.store.operator_rollback(to, live, plane.check)}


async def rollback(request: web.Request) -> web.Response:
    live_when_asked = request.app[PLANE].store.live_version()  # before anything else awaits
    return await _operate(request, lambda plane, body: _roll_back(plane, body, live_when_asked))


def _pinned(body: dict[str, Any]) -> bool:
    value = body.get("pinned", True)
    if not isinstance(value, bool):  # "false" is a true string: it must not pin
        raise BadRequest(f"'pinned' must be true or false, got {value!r}")
    return value


def _pin(plane: ControlPlane, body: dict[str, Any]) -> dict[str, Any]:
    version, pinned = _optional_int(_fields(body, ("version", "pinned")), "version", True) or 0, _pinned(body)
    plane.store.pin(version, pinned)
    return {"live": plane.store.live_version(), "version": version, "pinned": pinned}


async def pin(request: web.Request) -> web.Response:
    return await _operate(request, _pin)


async def dashboard(request: web.Request) -> web.Response:
    # one self-contained page (inline SVG charts, no CDN): see specd/control/dashboard.html
    page = resources.files("specd.control").joinpath("dashboard.html").read_text()
    return web.Response(text=page, content_type="text/html")


@web.middleware
async def _json_http_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own answers for routes and methods that do not exist, as JSON like every other."""
    try:
        return await handler(request)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        response = _error(error.status, error.reason)
        if "Allow" in error.headers:  # a 405 names the methods the route takes, as HTTP asks
            response.headers["Allow"] = error.headers["Allow"]
        return response


def control_app() -> web.Application:
    """An application for a process that serves the control plane (the learner sidecar)."""
    return web.Application(middlewares=[_json_http_errors], client_max_size=MAX_CONTROL_BODY_BYTES)


def add_control_routes(app: web.Application, plane: ControlPlane) -> None:
    app[PLANE] = plane
    routes: list[tuple[str, str, Handler]] = [
        ("GET", "/v1/versions", versions), ("GET", "/v1/versions/{version}", manifest),
        ("GET", "/v1/versions/{version}/weights", weights), ("GET", "/v1/acceptance", acceptance),
        ("GET", "/v1/status", status), ("POST", "/v1/live", set_live), ("POST", "/v1/rollback", rollback),
        ("POST", "/v1/pin", pin), ("GET", "/", dashboard), ("GET", "/dashboard", dashboard)]
    for method, path, handler in routes:  # add_get: HEAD too, as HTTP says every GET route takes it
        add = app.router.add_get if method == "GET" else app.router.add_post
        add(path, _answers_errors(handler))
