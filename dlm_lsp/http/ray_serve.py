"""`dlm-lsp ray-serve`: engine replicas on Ray Serve behind its HTTP proxy, speaking the same API as
`dlm-lsp http` (dlm_lsp/http/app.py): each replica is a FimServer with its own EngineService (one
torch thread, one CPU, or one GPU), and Ray Serve's proxy spreads requests over the replicas,
restarts a replica that dies, and drains one that fails its health check. Nothing here schedules
across machines: Ray does.

Safety: the local cluster's processes and Serve's proxy are bound to 127.0.0.1 (the proxy to
--host, which like `dlm-lsp http` needs a token off loopback), the dashboard is off, Ray's usage
statistics are off (it would reach the network), and Ray's own token authentication stays on.
Ray moves Python objects between its own processes with cloudpickle; what this module hands it is
strings and numbers (the replica's settings), and request bodies stay JSON parsed by fim_api.
A replica is built from its settings at replica start (`__serve_build_asgi_app__`): no app object
is pickled.

Run on a cluster of several machines with `ray start` on each and `--address` here; one replica
per GPU with `--gpus-per-replica 1`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

from dlm_lsp.http import fim as fim_api
from dlm_lsp.http.app import DEFAULT_TOKEN_ENV, FimServer, engine_factory, is_loopback, load_tokenizer, model_id_for
from dlm_lsp.http.fim import Limits

if TYPE_CHECKING:
    from ray.serve import Application
    from starlette.applications import Starlette

log = logging.getLogger("dlm.ray")

DEFAULT_PORT = 8766
APP_NAME = "dlm-fim"


class FimReplica:
    """One replica: a FimServer over an in-process EngineService; Ray calls check_health()."""

    def __init__(self, settings: dict):
        s = dict(settings)
        token = os.environ.get(s.get("token_env") or "", "").strip() or None
        limits = Limits(max_body_bytes=int(s["max_body_kb"]) * 1024, max_tokens_cap=int(s["max_fill_tokens"]))
        self.server = FimServer(
            engine_factory("inproc", s.get("model"), s.get("device", "auto"), s.get("threads") or 1),
            s["model_id"],
            token=token,
            limits=limits,
            language=s.get("language", "python"),
            budget_ms=int(s["budget_ms"]),
            max_inflight=int(s["max_inflight"]),
            tokenizer=load_tokenizer(s.get("model")),
        )
        self.server.engine.start()  # the ASGI lifespan would too; a replica is ready once it has loaded
        if not self.server.engine.wait_ready(600):
            raise RuntimeError(f"the engine did not load: {self.server.info.get('message')}")

    def __serve_build_asgi_app__(self) -> Starlette:
        return self.server.app

    def check_health(self) -> None:
        """Raises when the engine is in the error state: Ray replaces the replica."""
        if self.server.state == "error":
            raise RuntimeError(self.server.info.get("message") or "engine error")


def build(
    settings: dict, replicas: int, cpus_per_replica: float = 1.0, gpus_per_replica: float = 0.0, max_ongoing: int = 8
) -> Application:
    """The bound Serve application (replicas of FimReplica)."""
    from ray import serve

    cls = serve.ingress()(FimReplica)
    deployment = serve.deployment(
        cls,
        name="FimReplica",
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing,
        ray_actor_options={
            "num_cpus": cpus_per_replica,
            "num_gpus": gpus_per_replica,
            "runtime_env": {
                "env_vars": {"OMP_NUM_THREADS": str(settings.get("threads") or 1), "RAY_USAGE_STATS_ENABLED": "0"}
            },
        },
        health_check_period_s=5,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=5,
    )
    # ray types serve.deployment as always returning a decorator; given the class it returns the Deployment
    return deployment.bind(settings)  # type: ignore[attr-defined]


def add_ray_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="engine replicas (default: the CPU cores, or GPUs with --gpus-per-replica)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address of Serve's HTTP proxy (any but loopback needs a token)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"its port (default {DEFAULT_PORT})")
    p.add_argument(
        "--address", default=None, help="an existing Ray cluster (`ray start --head` ...); default: a local one"
    )
    p.add_argument("--model", default=None)
    p.add_argument("--model-id", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica (default 1: one core each)")
    p.add_argument("--gpus-per-replica", type=float, default=0.0)
    p.add_argument("--max-ongoing", type=int, default=8, help="requests a replica takes at once (it batches them)")
    p.add_argument("--token-env", default=DEFAULT_TOKEN_ENV)
    p.add_argument("--budget-ms", type=int, default=1000)
    p.add_argument("--max-fill-tokens", type=int, default=64)
    p.add_argument("--max-body-kb", type=int, default=1024)
    p.add_argument("--max-inflight", type=int, default=64)
    p.add_argument("--language", default="python")


def run_ray_serve(args: argparse.Namespace) -> int:
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # before ray is imported: it would report to the network
    if not args.address:
        # A local cluster on loopback only: Ray otherwise binds its GCS and raylets to the machine's
        # outward address even when asked for 127.0.0.1 (services.resolve_ip_for_localhost); this
        # switch (read when ray is imported) makes it use the loopback address, as on macOS.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    token = os.environ.get(args.token_env or "", "").strip() or None
    if not is_loopback(args.host) and token is None:
        print(
            f"dlm-lsp ray-serve: refusing to listen on {args.host} without a token: set {args.token_env}",
            file=sys.stderr,
        )
        return 2
    if not 1 <= args.max_fill_tokens <= fim_api.MAX_SLOTS:
        print(f"dlm-lsp ray-serve: --max-fill-tokens must be 1..{fim_api.MAX_SLOTS}", file=sys.stderr)
        return 2
    try:
        import ray
        from ray import serve
    except ImportError:
        print(
            "dlm-lsp ray-serve needs Ray Serve: pip install 'ray[serve]==2.60.0' (or the project's dev extra)",
            file=sys.stderr,
        )
        return 2
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    replicas = args.replicas or (1 if args.gpus_per_replica else max(1, cores // max(1, args.threads)))
    settings = {
        "model": args.model,
        "model_id": args.model_id or model_id_for(args.model),
        "device": args.device,
        "threads": args.threads,
        "token_env": args.token_env,
        "budget_ms": args.budget_ms,
        "max_fill_tokens": args.max_fill_tokens,
        "max_body_kb": args.max_body_kb,
        "max_inflight": args.max_inflight,
        "language": args.language,
    }
    if args.address:
        ray.init(address=args.address, log_to_driver=False)
    else:
        ray.init(
            num_cpus=max(cores, replicas),
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}},
        )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(
            build(
                settings, replicas, 1.0 if not args.gpus_per_replica else 0.0, args.gpus_per_replica, args.max_ongoing
            ),
            name=APP_NAME,
            route_prefix="/",
        )
        shown = f"[{args.host}]" if ":" in args.host else args.host
        print(
            json.dumps(
                {
                    "listening": f"http://{shown}:{args.port}",
                    "model": settings["model_id"],
                    "replicas": replicas,
                    "token": token is not None,
                }
            ),
            flush=True,
        )
        stop.wait()
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0
