"""The engines the server fills with: the real engine factory."""

from __future__ import annotations

import os
from typing import Any


def default_engine_factory(
    model: str | None,
    device: str,
    on_state: Any,
    threads: int | None = None,
    engine: str | dict | None = None,
) -> Any:
    """The real engine: the user's shared engine daemon (engine/clients/remote.py: this process never loads
    torch) or, with `engine` / DLM_ENGINE "inproc", an EngineService in this process (imported here
    so importing the server never loads torch), or with an `engine` endpoint object a FIM HTTP
    endpoint (engine/clients/http_engine.py)."""
    if isinstance(engine, dict):  # a FIM HTTP endpoint (dlm_lsp.options.engine_endpoint normalized it)
        from engine.clients.http_engine import HttpEngine

        return HttpEngine(
            engine["url"],
            api=engine.get("api") or "openai-fim",
            api_key_env=engine.get("apiKeyEnv"),
            model=engine.get("model"),
            on_state=on_state,
        )
    if (engine or os.environ.get("DLM_ENGINE") or "shared") == "shared":
        from engine.clients.remote import RemoteEngine

        return RemoteEngine(model=model, device=device, on_state=on_state, threads=threads)
    from engine.serve.service import EngineService

    return EngineService(model=model, device=device, on_state=on_state, threads=threads)
