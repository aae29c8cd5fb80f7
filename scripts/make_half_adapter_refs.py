#!/usr/bin/env python3
"""reference_half_adapter.safetensors for each fixture model: the batch of
reference.safetensors as PEFT runs it with the adapter itself in the half dtype, the
reference for rlhost's half-precision LoRA path on a GPU (issue 50: x·Aᵀ and (x·Aᵀ)·Bᵀ in
the compute dtype, f32 master weights cast to it per call).

reference_half.safetensors (scripts/make_fixtures.py) is PEFT's default instead
(`autocast_adapter_dtype=True`: lora_A/lora_B in f32, the LoRA input cast to f32), which
rlhost follows on the CPU. Here the base is loaded in bf16 (f16) with eager attention, as
there, the saved adapter goes on it and its weights are cast to the half dtype (exactly
what rlhost's per-call cast gives), so PEFT computes `lora_B(lora_A(x)) * scaling` and its
sum with the base output in that dtype; logits are upcast to f32 for the loss, the LoRA
gradients stored in f32. Runs on the CPU (deterministic; the models are tiny):

    python3 scripts/make_half_adapter_refs.py [--out DIR]   # default: the fixture dirs

Needs torch, transformers, peft and safetensors (the GPU machine's image has them).
"""

import argparse
import sys
from pathlib import Path

import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import forward_logits, lora_loss, masked_max_diff, zero_pads  # noqa: E402

import make_fixtures  # noqa: E402

make_fixtures.torch = torch  # its helpers use the module global its own run imports

MODELS = ["qwen2", "qwen3", "llama"]
HALF = {"bf16": torch.bfloat16, "f16": torch.float16}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="write <out>/<model>.safetensors instead of into the fixtures")
    args = ap.parse_args()
    root = make_fixtures.DEFAULT_OUT / "models"
    for name in MODELS:
        mdir = root / name
        ref = load_file(str(mdir / "reference.safetensors"))
        inputs = [ref[k].long() for k in ("input_ids", "attention_mask", "position_ids")]
        mask = inputs[1]
        half_ref = load_file(str(mdir / "reference_half.safetensors"))
        out = {}
        for tag, dtype in HALF.items():
            base = AutoModelForCausalLM.from_pretrained(mdir, dtype=dtype, attn_implementation="eager").eval()
            pm = PeftModel.from_pretrained(base, mdir / "adapter", is_trainable=True).eval()
            lora = sorted((n, p) for n, p in pm.named_parameters() if "lora_" in n)
            for _, p in lora:
                p.data = p.data.to(dtype)
            logits = forward_logits(pm, *inputs)
            loss = lora_loss(logits, inputs[0], mask)
            pm.zero_grad(set_to_none=True)
            loss.backward()
            out[f"{tag}.lora_logits"] = zero_pads(logits.detach(), mask).to(dtype)
            out[f"{tag}.lora_loss"] = loss.detach().float().reshape(())
            for n, p in lora:
                assert p.grad is not None and p.grad.dtype == dtype, n
                out[f"{tag}.grad.{n}"] = p.grad.detach().float().contiguous()
            f32_adapter = half_ref[f"{tag}.lora_logits"].float()
            print(f"{name} {tag}: half adapter vs f32 adapter (PEFT's default) "
                  f"{masked_max_diff(logits.detach(), f32_adapter, mask):.3e}, "
                  f"loss {loss.item():.6f} vs {half_ref[f'{tag}.lora_loss'].item():.6f}")
        out = {k: v.contiguous() for k, v in out.items()}
        dest = Path(args.out) / f"{name}.safetensors" if args.out else mdir / "reference_half_adapter.safetensors"
        dest.parent.mkdir(parents=True, exist_ok=True)
        save_file(out, str(dest), metadata={"format": "pt"})


if __name__ == "__main__":
    main()
