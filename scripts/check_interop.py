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
3. `rlhost rm` trains a reward model on the qwen2 fixture for a few steps;
   `AutoModelForSequenceClassification` (num_labels 1) with `PeftModel.from_pretrained`
   loads what it wrote (a SEQ_CLS adapter with its `score` head), scores the held-out
   pairs, and the mean chosen and rejected scores must equal the ones rlhost logged for
   them at its last step (<= 1e-4).
Prints the measured differences; exits non-zero on a mismatch.
"""

import json
import os
import subprocess
import sys
import tempfile

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

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
    bad |= not reward_model()
    sys.exit(1 if bad else 0)


def reward_model():
    """rlhost rm's output scored by transformers + PEFT against rlhost's own scores."""
    base_dir = os.path.join(FIX, "qwen2")
    pairs = [{"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": "I cannot say."} for i in range(12)]
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "pairs.jsonl"), "w") as f:
            f.writelines(json.dumps(p) + "\n" for p in pairs)
        config = os.path.join(tmp, "rm.toml")
        with open(config, "w") as f:
            f.write(f'[run]\nseed = 3\nout_dir = "run"\n[model]\npath = {json.dumps(base_dir)}\n'
                    '[data]\npath = "pairs.jsonl"\neval_path = "pairs.jsonl"\n'
                    '[train]\nsteps = 4\nlr = 0.01\n[pairs]\nper_step = 4\n')
        subprocess.run([BIN, "rm", "--config", config, "-q"], check=True)
        rows = [json.loads(l) for l in open(os.path.join(tmp, "run", "metrics.jsonl"))]
        logged = rows[-1]["eval"]
        tok = AutoTokenizer.from_pretrained(base_dir)
        model = AutoModelForSequenceClassification.from_pretrained(base_dir, num_labels=1, dtype=torch.float32)
        model.config.pad_token_id = tok.pad_token_id
        model = PeftModel.from_pretrained(model, os.path.join(tmp, "run", "adapter")).eval()
        eos = tok.convert_tokens_to_ids(tok.eos_token)

        def score(prompt, reply):
            # As rlhost builds a completion: the prompt rendered with the generation
            # prompt, the reply's text, the end-of-turn token.
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
            ids = tok.encode(text, add_special_tokens=False) + tok.encode(reply, add_special_tokens=False) + [eos]
            with torch.no_grad():
                return model(input_ids=torch.tensor([ids])).logits[0, 0].item()

        chosen = sum(score(p["prompt"], p["chosen"]) for p in pairs) / len(pairs)
        rejected = sum(score(p["prompt"], p["rejected"]) for p in pairs) / len(pairs)
    d = max(abs(chosen - logged["rewards_chosen"]), abs(rejected - logged["rewards_rejected"]))
    ok = d <= 1e-4
    print(f"qwen2: transformers + PEFT load rlhost's reward model: mean scores {chosen:.5f} / {rejected:.5f}, "
          f"rlhost's {logged['rewards_chosen']:.5f} / {logged['rewards_rejected']:.5f}, max diff {d:.2e} "
          f"{'ok' if ok else 'MISMATCH'}")
    return ok


if __name__ == "__main__":
    main()
