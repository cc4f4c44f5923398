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
  POST /v1/rollback  {"version": n?}           roll back (default: the previous live version)
  POST /v1/pin       {"version": n, "pinned": true|false}
  GET  /  and /dashboard            the dashboard page
POST routes need `Authorization: Bearer <token>` when a token is configured. Store errors become
JSON errors with the reason and their kind's status (404 for a version that does not exist, 409
for an operation the store refuses, 400 for a malformed body).
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

from aiohttp import web

from specd.control.acceptance import AcceptanceLog
from specd.core.errors import BadRequest, InternalError, SpecdError, StoreError
from specd.core.http_requests import bearer_matches, json_object, read_body
from specd.hotswap.store import WeightStore


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
    try:
        return int(request.match_info["version"])
    except ValueError:
        raise web.HTTPBadRequest(reason="the version must be an integer") from None


async def _authorised_body(request: web.Request) -> dict[str, Any] | web.Response:
    plane = request.app[PLANE]
    if plane.token and not bearer_matches(request.headers.get("Authorization", ""), plane.token):
        return _error(401, "this control operation needs `Authorization: Bearer <token>`",
                      kind="authentication_error", code="invalid_token")  # as the OpenAI routes' key
    return json_object(await read_body(request)) if request.can_read_body else {}


def _optional_int(body: dict[str, Any], name: str, required: bool) -> int | None:
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"'{name}' must be an integer version number")
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


async def _operate(request: web.Request, operation: Callable[[ControlPlane, dict[str, Any]], Any],
                   body: dict[str, Any] | None = None) -> web.Response:
    if body is None:
        authorised = await _authorised_body(request)
        if isinstance(authorised, web.Response):
            return authorised
        body = authorised
    plane = request.app[PLANE]
    # off the event loop: the store hashes weights and waits for its lock, and in `specd serve` this
    # loop also streams answers. A malformed body, or an operation the store refuses, raises: see
    # _answers_errors. The answer is the version the operation made live, not a later reading.
    made_live = await asyncio.to_thread(operation, plane, body)
    plane.on_change()
    return web.json_response({"live": made_live if isinstance(made_live, int) else plane.store.live_version()})


async def set_live(request: web.Request) -> web.Response:
    body = await _authorised_body(request)
    if isinstance(body, web.Response):
        return body
    plane = request.app[PLANE]
    version = _optional_int(body, "version", True) or 0
    status = plane.store.manifest(version).get("status")
    if plane.submit is None or status != "candidate":  # a version that has been live before is trusted
        def make_live(plane: ControlPlane, body: dict[str, Any]) -> int:
            plane.store.set_live(version, "operator")
            return version

        return await _operate(request, make_live, body)
    try:  # a file that fails its checksum needs no evaluation (a replay of the held-out records)
        await asyncio.to_thread(plane.store.check_weights, version)
    except (StoreError, OSError) as error:
        return _error(409, f"version {version} cannot go live: {error}")
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


async def rollback(request: web.Request) -> web.Response:
    return await _operate(request, lambda p, b: p.store.rollback(_optional_int(b, "version", False),
                                                                 {"by": "operator"}))


def _pinned(body: dict[str, Any]) -> bool:
    value = body.get("pinned", True)
    if not isinstance(value, bool):  # "false" is a true string: it must not pin
        raise BadRequest(f"'pinned' must be true or false, got {value!r}")
    return value


async def pin(request: web.Request) -> web.Response:
    return await _operate(request, lambda p, b: p.store.pin(_optional_int(b, "version", True) or 0, _pinned(b)))


async def dashboard(request: web.Request) -> web.Response:
    # one self-contained page (inline SVG charts, no CDN): see specd/control/dashboard.html
    page = resources.files("specd.control").joinpath("dashboard.html").read_text()
    return web.Response(text=page, content_type="text/html")


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
