"""The next-edit gate: the probability that a model-free suggestion (nextedit.propagation) is the
developer's next edit, from what the suggestion did, and the threshold per kind under which the server
stays silent.

A substitution carried from the user's edits is right when the user meant it for every such place (a
migration: `typing.List` -> `list`, `"en_us"` -> `DEFAULT_LOCALE`, made again and again) and wrong
when it was a change of one place (a local renamed in one function, a call's argument rewritten); what
the suggestion did says which is likelier: how often the user made the substitution, how many places
it changes, how far from the cursor, whether it is a name defined or a use. `EditGate` is a logistic
regression over those `features`, its output is the suggestion's confidence, and its `gates` say the
least confidence shown per `kind_of` the suggestion ("definition": a use of a name renamed where it is
defined; "text": a word in strings or comments; "code": the rest). It is fitted by `dlm-lsp
calibrate-edits` (dlm_lsp/measure/calibrate_edit.py) on the samples `dlm-lsp eval --kinds edit
--edit-side train --samples` writes, never on the held-out packages' cases the eval judges it on, and
ships beside this file (edit_gate.json): it belongs to the rule, not to a model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dlm_lsp.fill.gate import _finite, _sigmoid

if TYPE_CHECKING:
    from dlm_lsp.fill.nextedit import Propagation

FEATURES = (
    "repeated",  # the user made the substitution in two or more of the recent edits
    "log_sites",  # log(1 + the places the suggestion changes)
    "log_distance",  # log(1 + window lines between the cursor's line and the changed run)
    "above",  # the changed run lies above the cursor's line
    "definition",  # a use of a name renamed where it is defined
    "text",  # a word inside strings or comments
    "qualified",  # the old text is more than one name (a dotted name, a call, a literal)
    "grows",  # the new text holds the old (`x` -> `self.x`, `foo` -> `foo_bar`)
    "shrinks",  # the old text holds the new (`_foo` -> `foo`, `typing.List` -> `List`)
    "log_chars",  # log(1 + characters of the old texts)
    "partial",  # a substitution no edit made alone: each that made it changed more (other tokens, other lines)
)
KINDS = ("code", "definition", "text")
PATH = Path(__file__).with_name("edit_gate.json")


def kind_of(p: Propagation) -> str:
    """The suggestion's kind for its gate: "definition" when a place changes as a use of a name renamed
    where it is defined, else "text" when a word in a string or comment changes, else "code"."""
    roles = {m.role for m in p.made}
    return "definition" if "definition" in roles else "text" if "text" in roles else "code"


def features(p: Propagation) -> list[float]:
    """The FEATURES of a propagation's suggestion, in order."""
    made = p.made
    olds = {m.old for m in made}
    names = [o for o in olds if o.isidentifier()]
    distance = p.first - p.cursor_line if p.first >= p.cursor_line else p.cursor_line - p.last + 1
    return [
        float(any(m.carry.count >= 2 for m in made)),
        math.log1p(len(made)),
        math.log1p(max(0, distance)),
        float(p.last <= p.cursor_line),
        float(any(m.role == "definition" for m in made)),
        float(any(m.role == "text" for m in made)),
        float(len(names) < len(olds)),
        float(any(m.old in m.carry.new for m in made)),
        float(any(m.carry.new and m.carry.new in m.old for m in made)),
        math.log1p(sum(len(o) for o in olds)),
        float(any(not m.carry.alone for m in made)),
    ]


@dataclass
class EditGate:
    """P(the suggestion is the next edit) = sigmoid(bias + weights . features); `names` are the
    FEATURES it was fitted on, `gates` the least probability shown per kind (a kind it does not name:
    0, every suggestion shown)."""

    names: tuple[str, ...]
    weights: tuple[float, ...]
    bias: float
    gates: dict[str, float] = field(default_factory=dict)
    fit_info: dict | None = None

    def probability(self, p: Propagation) -> float:
        return self.score(features(p))

    def score(self, values: Sequence[float]) -> float:
        """P(exact) from a suggestion's FEATURES values, in order."""
        x = dict(zip(FEATURES, values))
        return _sigmoid(self.bias + sum(w * x[n] for n, w in zip(self.names, self.weights)))

    def gate(self, p: Propagation) -> float:
        return self.gates.get(kind_of(p), 0.0)

    def to_json(self) -> dict:
        out: dict = {
            "features": list(self.names),
            "weights": [round(w, 6) for w in self.weights],
            "bias": round(self.bias, 6),
            "gates": {k: round(v, 6) for k, v in sorted(self.gates.items())},
        }
        if self.fit_info:
            out["fit"] = self.fit_info
        return out

    @classmethod
    def from_json(cls, raw: object) -> EditGate | None:
        """The gate stored as `to_json` writes it, or None when it is absent or malformed (unknown
        feature or kind names, non-numbers, lengths that differ)."""
        if not isinstance(raw, dict):
            return None
        names, weights, bias, gates = raw.get("features"), raw.get("weights"), raw.get("bias"), raw.get("gates", {})
        if not (isinstance(names, list) and isinstance(weights, list) and len(names) == len(weights) and names):
            return None
        if not all(isinstance(n, str) and n in FEATURES for n in names) or len(set(names)) != len(names):
            return None
        if not (all(_finite(w) for w in weights) and _finite(bias)):
            return None
        if not (isinstance(gates, dict) and all(k in KINDS and _finite(v) for k, v in gates.items())):
            return None
        fit = raw.get("fit")
        return cls(
            tuple(names),
            tuple(float(w) for w in weights),
            float(bias),
            {k: float(v) for k, v in gates.items()},
            fit if isinstance(fit, dict) else None,
        )


_SHIPPED: list[EditGate | None] = []


def shipped() -> EditGate | None:
    """The gate that ships with dlm-lsp (edit_gate.json beside this file), read once; None when the
    file is missing or malformed (then every suggestion the rules make is shown, at confidence 1)."""
    if not _SHIPPED:
        try:
            raw = json.loads(PATH.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raw = None
        _SHIPPED.append(EditGate.from_json(raw))
    return _SHIPPED[0]
