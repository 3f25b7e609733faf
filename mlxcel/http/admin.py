"""mlxcel's own routes: health, the cache's statistics and reset, the LoRA scales, Prometheus metrics."""

from __future__ import annotations

import json

from quart import Response

from mlxcel.http.route import SMALL_BODY_BYTES, RouteContext, json_response
from mlxcel.http.validation import parse_adapter_scales

# The stats carry every tenant's counters, so they are the admin's, like the reset.
ADMIN_ROUTES = frozenset({"/v1/cache/reset", "/v1/cache/stats", "/metrics"})
# GET lists the adapters; POST (the admin's) changes the server-wide scales, as llama.cpp's server.
LORA_ROUTE = "/lora-adapters"
OPEN_ROUTES = frozenset({"/health"})


async def health(context: RouteContext) -> Response:
    return json_response({"status": "ok", "model": context.engine.model_id})


async def cache_stats(context: RouteContext) -> Response:
    stats = await context.engine.cache_stats()
    scheduler = await context.engine.scheduler_stats()
    stats["scheduler"] = {"num_waiting": scheduler.num_waiting, "num_running": scheduler.num_running}
    return json_response(stats)


async def cache_reset(context: RouteContext) -> Response:
    # ?disk=true (or {"disk": true}) clears the disk tier too; the body is optional and small.
    raw = await context.read_raw_body(min(SMALL_BODY_BYTES, context.config.max_body_bytes))
    try:
        body = json.loads(raw) if raw.strip() else None
    except ValueError:
        body = None
    disk = context.query.get("disk", [""])[0].lower() in ("1", "true", "yes") or (
        isinstance(body, dict) and body.get("disk") is True)
    return json_response(await context.engine.reset_cache(disk=disk))


async def lora_adapters(context: RouteContext) -> Response:
    return json_response(await context.engine.lora_adapters())


async def set_lora_adapters(context: RouteContext) -> Response:
    scales = parse_adapter_scales(await context.read_small_body(allow_list=True), "body")
    return json_response(await context.engine.lora_adapters(scales))


async def metrics(context: RouteContext) -> Response:
    return Response(await context.engine.metrics_text(), mimetype="text/plain; version=0.0.4")
