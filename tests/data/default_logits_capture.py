"""Captures engine outputs for tests/test_families_default.py (run once, before an architecture change,
with the code of the commit it records: `python tests/data/default_logits_capture.py`)."""

import hashlib
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.api import DecodeOptions
from engine.decode.forward import build_canvas
from engine.decode.sampler import fill
from engine.weights.load import load_checkpoint
from tests.engine_models import cpu_vendor, peaked_model

torch.set_num_threads(1)
out = {}
g = torch.Generator().manual_seed(123)
ids = torch.randint(4, 300, (2, 20), generator=g)
valid = torch.ones(2, 20, dtype=torch.bool)
valid[1, 13:] = False
with torch.no_grad():
    for causal in (False, True):
        m = peaked_model(causal=causal, seed=5)
        tag = "causal" if causal else "bidir"
        out[f"peaked_{tag}_full"] = m(ids[:1])
        out[f"peaked_{tag}_padded"] = m(ids, key_valid=valid)
        h, kvs = m.hidden(ids[:1], return_kv=True)
        if causal:
            _, kv12 = m.hidden(ids[:1, :12], return_kv=True)
            out[f"peaked_{tag}_cached"] = m.logits(m.hidden(ids[:1, 12:19], pos=torch.arange(12, 19)[None], ctx=kv12))
        else:
            keep = torch.ones(20, dtype=torch.bool)
            keep[8:14] = False
            ctx = [(k[:, :, keep], v[:, :, keep]) for k, v in kvs]
            out[f"peaked_{tag}_cached"] = m.logits(m.hidden(ids[:1, 8:14], pos=torch.arange(8, 14)[None], ctx=ctx))
    meta = {}
    sub = torch.arange(0, 8192, 32)
    for name in ("default", "default-ar"):
        folder = Path(__file__).resolve().parents[2] / "models" / name
        meta[f"{name}_sha256"] = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
        m, tok, cfg = load_checkpoint(folder)
        text = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"
        t = torch.tensor([tok.encode(text)[:40]])
        out[f"{name}_full_sub"] = m(t)[..., sub]
        if name == "default":
            o = DecodeOptions()
            pre = tok.encode("class Point:\n    def __init__(self, x, y):\n        self.x = x\n        ")
            suf = tok.encode("\n\n    def norm(self):\n        return (self.x ** 2 + self.y ** 2) ** 0.5\n")
            r = fill(m, build_canvas(pre, suf, 12, cfg, o))
            out["default_fill_ids"] = torch.tensor(r.ids + [-1], dtype=torch.float32)
            o2 = DecodeOptions(cache=False, window=0, heal=False)
            r2 = fill(m, build_canvas(pre, suf, 12, cfg, o2))
            out["default_fill_nocache_ids"] = torch.tensor(r2.ids + [-1], dtype=torch.float32)
rev = subprocess.run(
    ["git", "-C", str(Path(__file__).resolve().parents[2]), "rev-parse", "HEAD"], capture_output=True, text=True
).stdout.strip()
meta.update(commit=rev, cpu=torch.backends.cpu.get_cpu_capability(), torch=torch.__version__, cpu_vendor=cpu_vendor())
out = {k: v.contiguous() for k, v in out.items()}
save_file(
    out,
    str(Path(__file__).with_suffix(".safetensors")).replace("_capture", ""),
    metadata={k: str(v) for k, v in meta.items()},
)
print(meta, {k: tuple(v.shape) for k, v in out.items()})
