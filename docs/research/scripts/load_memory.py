# Research probe, kept as it ran at commit e53f7b7; not maintained: it may not run against today's layout.
"""Peak host memory of loading a family checkpoint, against one copy of its weights.

Writes a random bf16 checkpoint of Qwen2.5-Coder-0.5B shapes in the Open-dCoder layout (hidden 896,
24 layers, 14/2 heads, FFN 4864, vocab 151936, tied head, one model.safetensors as the real one),
then loads it through `engine.weights.load.load_checkpoint` (fp32 on CPU) in a fresh process and
reads VmHWM / RssAnon from /proc/self/status. Prints one JSON object (and writes it with --json).

    python docs/research/scripts/load_memory.py [--dir /tmp/q05] [--json docs/measurements/load_memory.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

WRITE = r'''
import json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
sys.path.insert(0, sys.argv[2])
from tests.families_tiny import QWEN_SPECIALS, tokenizer_json
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
D, F, V, L, KV = 896, 4864, 151936, 24, 128
cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": D, "intermediate_size": F,
       "num_hidden_layers": L, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": V,
       "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": True,
       "hidden_act": "silu", "use_sliding_window": False, "eos_token_id": 151643, "bos_token_id": 151643,
       "torch_dtype": "bfloat16"}
(out / "config.json").write_text(json.dumps(cfg))
(out / "tokenizer.json").write_text(tokenizer_json({**QWEN_SPECIALS, "<|mask|>": 151665}))
(out / "tokenizer_config.json").write_text(json.dumps({"mask_token": "<|mask|>"}))
shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
for i in range(L):
    p = f"model.layers.{i}."
    shapes.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                   p + "self_attn.q_proj.weight": (D, D), p + "self_attn.q_proj.bias": (D,),
                   p + "self_attn.k_proj.weight": (KV, D), p + "self_attn.k_proj.bias": (KV,),
                   p + "self_attn.v_proj.weight": (KV, D), p + "self_attn.v_proj.bias": (KV,),
                   p + "self_attn.o_proj.weight": (D, D), p + "mlp.gate_proj.weight": (F, D),
                   p + "mlp.up_proj.weight": (F, D), p + "mlp.down_proj.weight": (D, F)})
g = torch.Generator().manual_seed(0)
save_file({n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}, str(out / "model.safetensors"))
'''

MEASURE = r'''
import json, sys, time
sys.path.insert(0, sys.argv[2])
import torch
from engine.weights.load import load_checkpoint
def status():
    d = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
    return {k: int(d[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}
torch.set_num_threads(1)
base = status()
t0 = time.perf_counter()
m, tok, cfg = load_checkpoint(sys.argv[1])
load_s = time.perf_counter() - t0
after = status()
w = sum(p.numel() * p.element_size() for p in m.parameters())
print(json.dumps({"family": cfg.family, "params": sum(p.numel() for p in m.parameters()), "weights_bytes": w,
                  "dtype": str(m.head_weight.dtype), "load_s": round(load_s, 2), "before_load": base, "after_load": after,
                  "peak_rss_growth_over_weights": round((after["VmHWM"] - base["VmRSS"]) / w, 3),
                  "anon_growth_over_weights": round((after["RssAnon"] - base["RssAnon"]) / w, 3)}))
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary folder)")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dlm-mem-") as tmp:
        folder = Path(args.dir or Path(tmp) / "q05")
        if not (folder / "model.safetensors").exists():
            subprocess.run([sys.executable, "-c", WRITE, str(folder), str(ROOT)], check=True)
        out = subprocess.run([sys.executable, "-c", MEASURE, str(folder), str(ROOT)], check=True, capture_output=True,
                             text=True).stdout.strip().splitlines()[-1]
    print(out)
    if args.json:
        Path(args.json).write_text(json.dumps(json.loads(out), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
