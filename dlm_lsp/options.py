"""Server options from `initializationOptions` and `workspace/didChangeConfiguration`.

Keys are camelCase in JSON. A bad value never fails the server: the default is kept and a warning
naming the key goes back to the editor (window/showMessage).

`model`, `engine`, `device` and `threads` are machine-scoped (MACHINE_KEYS): they are read from
initializationOptions only (`engine` can name an HTTP endpoint the code is sent to; `device` and
`threads` choose the GPU or how many CPU cores the engine takes). A repository can ship
workspace settings (VS Code's .vscode/settings.json), and the editor forwards those through
workspace/didChangeConfiguration, so a machine-scoped value arriving there that differs from the one
the server started with is refused with a warning: opening a folder never makes the server load
weights from a path the folder chose, nor move the model to another device. Changing them is a user
setting and a server restart.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

# languageIds parsed with a tree-sitter grammar; "*" in `languages` means every other language,
# handled by indentation alone.
GRAMMAR_LANGUAGES = ("python", "javascript", "javascriptreact", "typescript", "typescriptreact", "go", "rust")
DEFAULT_LANGUAGES = [*GRAMMAR_LANGUAGES, "*"]
CONTEXT_TOKENS_RANGE = (64, 32768)
# dlm_lsp.fill.suggest.APPROACHES (engine.api.EDIT_APPROACHES and "propagate"), spelled here so the
# options never import the engine's types
NEXT_EDIT_APPROACHES = (
    "window",
    "window+memory",
    "surprise",
    "memory",
    "surprise+memory",
    "propagate",
)  # contextTokens: room for a 64-slot block hole, up to the longest windows


@dataclass
class InitializationOptions:
    """What an editor can set; every field has a default."""

    model: str | None = None  # None: the embedded default model (models/default)
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    budget_ms: int = 300  # keystroke-to-fill budget; the engine's deadline is arrival + budget
    debounce_ms: int = 0  # wait this long for a newer request before starting a job
    max_fill_tokens: int = 64  # upper bound on mask slots for any hole
    # tokens of context (prefix + slots + suffix) a fill is given; None: the engine's budget for its
    # model and device (engine.api.context_budget: the model's trained window, at most 512 tokens on
    # the CPU and 4096 on CUDA), 512 where the engine reports none. The engine cuts any value to
    # the model's window.
    context_tokens: int | None = None
    languages: list[str] = field(default_factory=lambda: list(DEFAULT_LANGUAGES))
    # show a fill only when the engine's confidence in it (geometric mean of its tokens' probabilities
    # when committed) is at least this; 0 shows every fill that passes post-processing; None: the
    # model's own gate (serving.json in its folder, chosen from its accepted-vs-shown curve), else 0
    min_confidence: float | None = None
    # torch CPU threads of the engine; None: DLM_THREADS, else the cores free for it (engine.serve.service.cpu_threads)
    threads: int | None = None
    # where the engine runs: "shared" (the user's engine daemon, one model in memory for every editor
    # window: engine/serve/daemon.py) or "inproc" (inside this server); None: DLM_ENGINE, else "shared".
    # Or a FIM HTTP endpoint (engine/clients/http_engine.py): {"url", "api": "openai-fim" | "mercury",
    # "apiKeyEnv": the environment variable holding its key, "model"} (a URL string is
    # {"url": ..., "api": "openai-fim"}). Machine-scoped like `model`; read when the engine starts.
    engine: str | dict | None = None
    # Test hook: false returns the engine's text with only padding dropped and one-line holes cut to
    # one line (no dedup / syntax / bracket filters). Used by the e2e test that needs a fill from a
    # weak model; not meant for editors.
    postprocess: bool = True
    # cross-file context from the workspace folders' files (dlm_lsp.fill.workspace: the snippets most like
    # the code at the cursor, read locally, given to the engine with the fill; and the files themselves
    # to the engine's workspace memory, DecodeOptions.workspace_ngram); false: the other open documents only
    workspace_context: bool = True
    # next edits (dlm/nextEdit): how the window near the cursor is rewritten (dlm_lsp.fill.suggest.APPROACHES:
    # the engine's layouts, or "propagate", the recent substitutions carried without a model), and the
    # confidence a rewrite needs to be shown. "propagate" by default: on 728 never-seen release-pair
    # cases the embedded model's rewrites were never exact and moved 478 of 490 shown windows farther
    # from the truth, and it was silent on no noise case (docs/research/42-s29-next-edits.md). The
    # least confidence shown: a number for every kind, or None for the edit gate's own per kind
    # (dlm_lsp/fill/edit_gate.json; 0 for the engine's layouts)
    next_edit_approach: str = "propagate"
    next_edit_min_confidence: float | None = None

    def serves(self, language_id: str) -> bool:
        """True when fills are offered for documents of `language_id`."""
        return language_id in self.languages or "*" in self.languages


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.title() for w in rest)


_CHECKS = {
    "model": lambda v: v is None or (isinstance(v, str) and v.strip() != ""),
    "device": lambda v: isinstance(v, str) and (v in ("auto", "cpu", "cuda") or v.startswith("cuda:")),
    "budget_ms": lambda v: isinstance(v, int) and not isinstance(v, bool) and 10 <= v <= 60_000,
    "debounce_ms": lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 5_000,
    "max_fill_tokens": lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 512,
    "context_tokens": lambda v: v is None
    or (isinstance(v, int) and not isinstance(v, bool) and CONTEXT_TOKENS_RANGE[0] <= v <= CONTEXT_TOKENS_RANGE[1]),
    "languages": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "postprocess": lambda v: isinstance(v, bool),
    "workspace_context": lambda v: isinstance(v, bool),
    "threads": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 256),
    "engine": lambda v: v is None or v in ("inproc", "shared") or isinstance(v, dict),
    "next_edit_approach": lambda v: v in NEXT_EDIT_APPROACHES,
    "next_edit_min_confidence": lambda v: v is None
    or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 1.0),
    "min_confidence": lambda v: v is None
    or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 1.0),
}
_KEYS = {_camel(f.name): f.name for f in dataclasses.fields(InitializationOptions)}


# set only by initializationOptions (see the module docstring): what picks the weights loaded, where
# the code is sent (`engine` can name a URL and an environment variable), and the hardware the engine
# takes (`device`: a GPU or the CPU; `threads`: how many of the machine's cores)
MACHINE_KEYS = ("model", "engine", "device", "threads")

ENGINE_APIS = ("openai-fim", "mercury")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


def engine_endpoint(value: object) -> tuple[dict | None, str | None]:
    """(the normalized {"url", "api", "apiKeyEnv", "model"} of an HTTP `engine` value, None) or
    (None, what is wrong with it). A key itself is never taken from options: only the name of the
    environment variable that holds it."""
    if isinstance(value, str):
        value = {"url": value}
    if not isinstance(value, dict):
        return None, 'must be "shared", "inproc", a URL or an object {url, api, apiKeyEnv, model}'
    if any(k.lower() in ("apikey", "api_key", "key", "token") for k in value):
        return None, (
            "takes no API key: put the key in an environment variable (or VS Code's secret storage) "
            "and name the variable in apiKeyEnv"
        )
    unknown = sorted(set(value) - {"url", "api", "apiKeyEnv", "model"})
    if unknown:
        return None, f"has unknown keys {unknown}; known: url, api, apiKeyEnv, model"
    url = value.get("url")
    if not isinstance(url, str) or not re.match(r"https?://[^/\s@]+(/\S*)?$", url.strip()):
        return None, "needs url: an http:// or https:// URL with a host and no credentials"
    api = value.get("api", "openai-fim")
    if api not in ENGINE_APIS:
        return None, f"api must be one of {list(ENGINE_APIS)}"
    env = value.get("apiKeyEnv")
    if env is not None and not (isinstance(env, str) and _ENV_NAME.fullmatch(env)):
        return None, "apiKeyEnv must be the name of an environment variable"
    model = value.get("model")
    if model is not None and not (isinstance(model, str) and model.strip()):
        return None, "model must be a non-empty string"
    return {"url": url.strip(), "api": api, "apiKeyEnv": env, "model": model}, None


def parse_options(
    raw: object, base: InitializationOptions | None = None, from_settings: bool = False
) -> tuple[InitializationOptions, list[str]]:
    """Returns (options, warnings): `raw` applied over `base` (or the defaults); bad values keep the
    value from `base` and add a warning that names the key and the value used. `from_settings`:
    `raw` came from workspace settings (didChangeConfiguration), where MACHINE_KEYS may not change."""
    opts = dataclasses.replace(base) if base is not None else InitializationOptions()
    opts.languages = list(opts.languages)
    warnings: list[str] = []
    if raw is None:
        return opts, warnings
    if not isinstance(raw, dict):
        return opts, [f"dlm-lsp options must be an object, got {type(raw).__name__}; using defaults"]
    for key, value in raw.items():
        name = _KEYS.get(key)
        if name is None:
            warnings.append(f"dlm-lsp: unknown option {key!r} ignored")
            continue
        if isinstance(value, float) and value.is_integer() and name.endswith(("_ms", "_tokens")):
            value = int(value)  # JSON clients sometimes send 300.0
        if name == "model" and value in ("", "default"):
            value = None
        if name == "model" and isinstance(value, str):
            value = value.strip()
        if name == "engine" and value not in (None, "inproc", "shared"):
            value, problem = engine_endpoint(value)
            if problem:
                warnings.append(f"dlm-lsp: option 'engine' {problem}; using {getattr(opts, name) or 'the default'!r}")
                continue
        if from_settings and name in MACHINE_KEYS and value != getattr(opts, name):
            warnings.append(
                f"dlm-lsp: {key!r} cannot be changed through workspace settings (a repository can "
                f"ship those); keeping {getattr(opts, name) or 'default'!r}. Set it in your user "
                "settings and restart the server."
            )
            continue
        if not _CHECKS[name](value):
            kept = getattr(opts, name)
            warnings.append(f"dlm-lsp: invalid value {value!r} for {key!r}; using {kept!r}")
            continue
        setattr(opts, name, list(value) if name == "languages" else value)
    return opts, warnings


def dlm_section(settings: object) -> dict | None:
    """The `dlm` section of didChangeConfiguration settings ({"dlm": {...}}), or None if absent."""
    if isinstance(settings, dict):
        section = settings.get("dlm")
        if isinstance(section, dict):
            return section
    return None
