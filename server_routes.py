"""HTTP routes behind the pack's web panel, added only when the pack runs inside a ComfyUI server.

``GET  /wan_accel/limits``        the limit cache (entries per namespace) and the machine's fingerprint, as JSON
``POST /wan_accel/limits/clear``  body ``{"namespace": "<name>" | "all"}``; clears that namespace (every machine)
``GET  /wan_accel/doctor``        each accelerated feature's recorded verdict on this machine (never probes)
``POST /wan_accel/doctor/recheck`` body ``{"feature": "<name>" | "all"}``; probes again and answers the new rows
``GET  /wan_accel/play``          the Matrix-Game-2 play sessions of this server
``POST /wan_accel/play/touch``    body ``{"session": id}``; the session, with the actions each chunk was given
                                  (the panel calls it while it shows the session: a watched session is not idle)
``POST /wan_accel/play/end``      body ``{"session": id}``; ends the session and frees its memory

ComfyUI also serves every route under ``/api`` (``/api/wan_accel/limits``), which is what the frontend calls.
The logic lives in plain functions (:func:`limits_payload`, :func:`clear_limits`) that tests call without
ComfyUI; the aiohttp handlers only parse the request, run the function off the event loop and wrap the answer.
The client never names a file: the routes always use the pack's default limit cache.
"""
from __future__ import annotations

import json
import logging
import math
import re
import sys

log = logging.getLogger("wan_accel")

ROUTE_LIMITS = "/wan_accel/limits"
ROUTE_CLEAR = "/wan_accel/limits/clear"
ROUTE_DOCTOR = "/wan_accel/doctor"
ROUTE_RECHECK = "/wan_accel/doctor/recheck"
ROUTE_PLAY = "/wan_accel/play"
ROUTE_PLAY_TOUCH = "/wan_accel/play/touch"
ROUTE_PLAY_END = "/wan_accel/play/end"
_SESSION_RE = re.compile(r"^[0-9a-f]{1,64}$")
MAX_ENTRIES_PER_NAMESPACE = 200   # the panel shows at most this many rows per namespace
MAX_BODY_BYTES = 4096
SUMMARY_CHARS = 140
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # the limit cache's own rule for names

_registered = False


class RequestError(ValueError):
    """A request the routes refuse (answered with HTTP 400 and this message)."""


# ---------------------------------------------------------------------------------------------- plain logic
def _open_cache(cache):
    if cache is not None:
        return cache
    from .cache import LimitCache

    return LimitCache()


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    if isinstance(value, (dict, list)):
        text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    else:
        text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def summarize_value(value: dict) -> str:
    """One readable line for an entry value: ``name=value`` pairs, long values shortened."""
    if not isinstance(value, dict):
        return _short(value)
    parts = [f"{k}={_short(v)}" for k, v in value.items()]
    text = ", ".join(parts)
    return text if len(text) <= SUMMARY_CHARS else text[:SUMMARY_CHARS - 3] + "..."


def limits_payload(cache=None, max_entries: int = MAX_ENTRIES_PER_NAMESPACE) -> dict:
    """What ``GET /wan_accel/limits`` answers.

    ``{"path", "fingerprint_id", "fingerprint", "known_namespaces",
       "namespaces": [{"name", "count", "other_machines", "truncated",
                       "entries": [{"key", "value", "summary", "hits", "created", "updated", "last_used"}]}]}``

    ``count`` is the number of entries measured on this machine (the ones that apply here), ``other_machines``
    the entries of other fingerprints (kept, never applied). Known namespaces are listed even when empty.
    """
    from .cache import KNOWN_NAMESPACES

    cache = _open_cache(cache)
    fid = cache.fingerprint_id
    rows = cache.entries(None, all_fingerprints=True)
    spaces: dict[str, dict] = {ns: {"name": ns, "count": 0, "other_machines": 0, "truncated": 0, "entries": []}
                               for ns in KNOWN_NAMESPACES}
    for row in rows:
        ns = spaces.setdefault(row["namespace"], {"name": row["namespace"], "count": 0, "other_machines": 0,
                                                  "truncated": 0, "entries": []})
        if row["fingerprint"] != fid:
            ns["other_machines"] += 1
            continue
        ns["count"] += 1
        if len(ns["entries"]) >= max_entries:
            ns["truncated"] += 1
            continue
        ns["entries"].append({"key": row["key"], "value": row["value"], "summary": summarize_value(row["value"]),
                              "hits": row["hits"], "created": row["created"], "updated": row["updated"],
                              "last_used": row["last_used"]})
    try:
        notices = cache.notices()
    except Exception as exc:  # noqa: BLE001 - the entries matter more than the notes about the file
        notices = [f"could not check the cache file: {exc}"]
    return {
        "path": str(cache.path),
        "notices": notices,
        "set_aside": set_aside_payload(cache),
        "fingerprint_id": fid,
        "fingerprint": dict(cache.fingerprint),
        "known_namespaces": list(KNOWN_NAMESPACES),
        "namespaces": [spaces[k] for k in sorted(spaces)],
    }


def set_aside_payload(cache) -> dict:
    """``{"path", "count", "items": [{namespace, fingerprint, key, entry, reason, time, summary}]}``: the entries
    set aside from the cache because they could not be used (the newest MAX_ENTRIES_PER_NAMESPACE)."""
    try:
        items = cache.set_aside()
        path = str(cache.set_aside_path)
    except Exception as exc:  # noqa: BLE001 - a side file that cannot be read must not cost the page
        return {"path": None, "count": 0, "items": [], "error": f"{type(exc).__name__}: {exc}"}
    shown = [dict(i, summary=summarize_value(i.get("entry"))) for i in items[-MAX_ENTRIES_PER_NAMESPACE:]]
    return {"path": path, "count": len(items), "items": shown}


def _string_field(body, field: str, example: str, rule: re.Pattern | None = None, what: str = "") -> str:
    """The one field ``field`` (a string) of a decoded POST body; RequestError naming what is wrong and showing
    ``example`` (a body the route accepts) for anything else: not an object, another field, a missing field, a
    value that is not a string, or one that ``rule`` does not match (it is not ``what``)."""
    if not isinstance(body, dict):
        raise RequestError(f"body must be a JSON object like {example}")
    extra = sorted(set(body) - {field})
    if extra:
        raise RequestError(f"unexpected field(s) {extra}: only '{field}' is accepted (a body like {example})")
    if field not in body:
        raise RequestError(f"missing field '{field}': send a JSON object like {example}")
    if not isinstance(body[field], str):
        raise RequestError(f"'{field}' must be a string, got {type(body[field]).__name__}")
    if rule is not None and not rule.match(body[field]):
        raise RequestError(f"'{field}' {body[field][:80]!r} is not {what}")
    return body[field]


def clear_limits(body, cache=None) -> dict:
    """What ``POST /wan_accel/limits/clear`` answers: ``{"cleared": n, "namespace": name}``.

    Accepts exactly ``{"namespace": "all"}`` or ``{"namespace": "<name>"}`` with a valid namespace name. A
    namespace that is neither one of the pack's namespaces nor present in the cache is refused, so a typo
    is reported instead of silently clearing nothing.
    """
    from .cache import KNOWN_NAMESPACES

    ns = _string_field(body, "namespace", '{"namespace": "operator"} or {"namespace": "all"}', _NAMESPACE_RE,
                       "a namespace name (1-64 letters, digits, '_', '.', '-')")    # ("all" is one of its names)
    ns = None if ns == "all" else ns
    cache = _open_cache(cache)
    if ns is not None and ns not in KNOWN_NAMESPACES:
        present = {row["namespace"] for row in cache.entries(None, all_fingerprints=True)}
        if ns not in present:
            raise RequestError(f"unknown namespace {ns!r}; known: {sorted(set(KNOWN_NAMESPACES) | present)} or 'all'")
    from .cache.safety import CacheUnavailableError

    try:
        removed = cache.clear(ns)
    except CacheUnavailableError as exc:
        raise RequestError(str(exc)) from None
    return {"cleared": int(removed), "namespace": "all" if ns is None else ns}


def _doctor(doctor):
    if doctor is not None:
        return doctor
    import torch

    from .app.doctor.core import doctor_for
    from .nodes.comfy import native_probe  # noqa: F401 - registers the native MODEL path's probe with the doctor

    return doctor_for("cuda" if torch.cuda.is_available() else "cpu", None)


def _doctor_answer(doctor) -> dict:
    from .app.doctor.report import doctor_rows, machine_line
    from .app.doctor.versions import known_breaks, stack

    keep = ("feature", "summary", "available", "verified", "status", "difference", "speed", "why_off", "fix")
    rows = doctor_rows(doctor, probe=False)
    found = stack()
    return {"machine": machine_line(doctor), "fingerprint_id": doctor.cache.fingerprint_id,
            "versions": found, "known_breaks": known_breaks(found),
            "features": [{k: r.get(k) for k in keep} for r in rows],
            "set_aside": set_aside_payload(doctor.cache)}


def doctor_payload(doctor=None) -> dict:
    """What ``GET /wan_accel/doctor`` answers: ``{"machine", "fingerprint_id", "features": [row, ...]}`` with the
    recorded verdicts only (a feature never checked here says so; the page never waits for a probe)."""
    return _doctor_answer(_doctor(doctor))


def recheck_feature(body, doctor=None) -> dict:
    """What ``POST /wan_accel/doctor/recheck`` answers: the rows after probing ``{"feature": name | "all"}`` again."""
    from .app.doctor.report import doctor_rows

    name = _string_field(body, "feature", '{"feature": "fused_qkv"} or {"feature": "all"}')
    doctor = _doctor(doctor)
    if name != "all" and name not in doctor.catalogue:
        raise RequestError(f"unknown feature {name[:80]!r}; known: {sorted(doctor.catalogue)} or 'all'")
    doctor_rows(doctor, None if name == "all" else [name], recheck=True)
    return _doctor_answer(doctor)


def play_sessions(registry=None) -> dict:
    """What ``GET /wan_accel/play`` answers: ``{"sessions": [{session, mode, keys, chunks, ended, idle_s, ...}]}``."""
    from .app.play.registry import REGISTRY

    return {"sessions": (registry or REGISTRY).listing()}


def _play_session(body, registry):
    from .app.play.registry import REGISTRY, PlayError

    session = _string_field(body, "session", '{"session": "<id from the Play Session node>"}', _SESSION_RE,
                            "a play session id")
    try:
        return (registry or REGISTRY).get(session)
    except PlayError as exc:
        raise RequestError(str(exc)) from None


def play_touch(body, registry=None) -> dict:
    """What ``POST /wan_accel/play/touch`` answers: the session and, per chunk, the action and the keyboard and mouse
    rows the model was given (a watched session is kept alive)."""
    play = _play_session(body, registry)
    return dict(play.describe(), session=body["session"], chunk_actions=list(play.log))


def play_end(body, registry=None) -> dict:
    """What ``POST /wan_accel/play/end`` answers: the session after ending it (its memory freed)."""
    play = _play_session(body, registry)
    play.free("ended by the user")
    return dict(play.describe(), session=body["session"])


def _refuse_constant(text: str):
    raise ValueError(f"{text} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):                    # 1e999: beyond a float's range
        raise ValueError(f"the number {text[:40]} is beyond a float's range")
    return value


def decode_json_body(raw: bytes):
    """Decode a request body, raising :class:`RequestError` for anything that is not small UTF-8 JSON: too large,
    not UTF-8, not JSON, nested too deeply, or holding NaN/Infinity (which JSON does not have)."""
    if len(raw) > MAX_BODY_BYTES:
        raise RequestError(f"body too large ({len(raw)} bytes; at most {MAX_BODY_BYTES})")
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise RequestError("body is nested too deeply to be a request of this page") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, NaN/Infinity, an over-long integer
        raise RequestError(f"body is not valid JSON ({exc})") from None


def strict_answer(value):
    """A route's answer as strict JSON can carry it: a NaN or an infinity becomes null (None), so an answer is
    always valid JSON."""
    from .cache.json_out import null_json
    try:
        json.dumps(value, allow_nan=False, default=str)
        return value
    except ValueError:
        return null_json(value)


async def _read_body(request) -> bytes:
    """The request body; one announced larger than MAX_BODY_BYTES is refused without being read."""
    length = getattr(request, "content_length", None)
    if isinstance(length, int) and length > MAX_BODY_BYTES:
        raise RequestError(f"body too large ({length} bytes; at most {MAX_BODY_BYTES})")
    try:
        return await request.read()
    except Exception as exc:  # noqa: BLE001 - aiohttp's own size limit, a dropped connection: the client's side
        raise RequestError(f"body could not be read ({type(exc).__name__}: {exc})") from None


# ---------------------------------------------------------------------------------------------- aiohttp face
ROUTES = (   # (path, plain function, POST with a JSON body rather than GET), in the order _make_handlers answers
    (ROUTE_LIMITS, limits_payload, False),
    (ROUTE_CLEAR, clear_limits, True),
    (ROUTE_DOCTOR, doctor_payload, False),
    (ROUTE_RECHECK, recheck_feature, True),
    (ROUTE_PLAY, play_sessions, False),
    (ROUTE_PLAY_TOUCH, play_touch, True),
    (ROUTE_PLAY_END, play_end, True),
)


def _make_handlers(web):
    import asyncio

    def _answer(route: str, fn, with_body: bool):
        """A handler: ``fn()`` (GET) or ``fn(json body)`` (POST) run off the event loop; a bad body is HTTP 400,
        anything else HTTP 500 with the error named (the server never goes down for a route)."""
        async def handler(request):
            try:
                args = (decode_json_body(await _read_body(request)),) if with_body else ()
                answer = await asyncio.get_running_loop().run_in_executor(None, fn, *args)
                return web.json_response(strict_answer(answer))
            except RequestError as exc:
                return web.json_response({"error": str(exc)}, status=400)
            except Exception as exc:  # noqa: BLE001 - report, never take the server down
                log.warning("wan_accel: %s %s failed: %r", "POST" if with_body else "GET", route, exc)
                return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=500)
        return handler

    return tuple(_answer(route, fn, with_body) for route, fn, with_body in ROUTES)


def register_routes(prompt_server=None) -> bool:
    """Add the routes to ComfyUI's server; True when added. A no-op (False) outside ComfyUI or when done already.

    Uses the ``server`` module only if ComfyUI already imported it (never imports it), so importing the pack
    elsewhere stays free of side effects.
    """
    global _registered
    if _registered:
        return False
    if prompt_server is None:
        server_mod = sys.modules.get("server")
        cls = getattr(server_mod, "PromptServer", None) if server_mod is not None else None
        prompt_server = getattr(cls, "instance", None) if cls is not None else None
    routes = getattr(prompt_server, "routes", None)
    if routes is None:
        return False
    try:
        from aiohttp import web

        for (route, _fn, with_body), handler in zip(ROUTES, _make_handlers(web)):
            (routes.post if with_body else routes.get)(route)(handler)
    except Exception as exc:  # noqa: BLE001 - the panel is optional; the nodes must still load
        log.warning("wan_accel: could not add the web panel routes: %r", exc)
        return False
    _registered = True
    return True


register_routes()
