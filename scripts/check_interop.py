#!/usr/bin/env python3
"""Checks that Hugging Face loads what rlhost writes (developers, not CI: needs torch).

    cargo build -p rlhost
    /tmp/fixvenv/bin/python scripts/check_interop.py

For each fixture model (qwen2, qwen3, llama):
1. `rlhost export` re-saves the fixture's PEFT adapter through rlhost's loader and writer;
   `PeftModel.from_pretrained` loads the result, and its logits must equal the reference
   `lora_logits` (max abs diff <= 1e-5 at real positions).
2. `rlhost export --merge` writes a merged model; `AutoModelForCausalLM.from_pretrained`
   loads it, and its logits must match `lora_logits` (<= 1e-4; merging reorders float
   additions).
Prints the measured differences; exits non-zero on a mismatch.
"""

import os
import subprocess
import sys
import tempfile

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures", "models")
BIN = os.path.join(ROOT, "target", "debug", "rlhost")


def masked_diff(a, b, mask):
    return ((a - b).abs() * mask[..., None]).max().item()


def logits(model, ref):
    with torch.no_grad():
        return model(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"],
                     position_ids=ref["position_ids"]).logits


def main():
    torch.set_num_threads(2)
    bad = False
    for name in ["qwen2", "qwen3", "llama"]:
        base_dir = os.path.join(FIX, name)
        ref = load_file(os.path.join(base_dir, "reference.safetensors"))
        mask = ref["attention_mask"].float()
        with tempfile.TemporaryDirectory() as tmp:
            adapter = os.path.join(tmp, "adapter")
            merged = os.path.join(tmp, "merged")
            for extra, out in [([], adapter), (["--merge", "--dtype", "f32"], merged)]:
                subprocess.run([BIN, "export", "--model", base_dir, "--adapter",
                                os.path.join(base_dir, "adapter"), "--out", out] + extra, check=True)
            base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                        attn_implementation="eager")
            peft_model = PeftModel.from_pretrained(base, adapter)
            d1 = masked_diff(logits(peft_model, ref), ref["lora_logits"], mask)
            m = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32,
                                                     attn_implementation="eager")
            d2 = masked_diff(logits(m, ref), ref["lora_logits"], mask)
        ok = d1 <= 1e-5 and d2 <= 1e-4
        bad |= not ok
        print(f"{name}: PEFT loads rlhost's adapter: max diff {d1:.2e}; "
              f"transformers loads rlhost's merged model: max diff {d2:.2e} {'ok' if ok else 'MISMATCH'}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
