"""Open diffusion LM families (Dream lineage, LLaDA, CoDA, SDAR/TraDo, Fast-dLLM v2, WeDLM,
Open-dCoder) as data over engine/model/transformer.py: a registry (registry.py), config keys and tensor names
per layout (layouts.py), special ids from the checkpoint's files (specials.py), the loader
(loader.py) and the local Hugging Face cache listing (hub.py)."""

from engine.families.loader import family_config, is_family_checkpoint, load_family
from engine.families.registry import FAMILIES, Family, FamilyError, detect, supported

__all__ = [
    "FAMILIES",
    "Family",
    "FamilyError",
    "detect",
    "family_config",
    "is_family_checkpoint",
    "load_family",
    "supported",
]
