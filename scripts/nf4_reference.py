#!/usr/bin/env python3
"""Reference NF4 quantizations made by bitsandbytes itself, for rlhost's QLoRA tests.

It writes tests/fixtures/nf4_reference.safetensors: a few f32 weight matrices (shapes
whose element count is and is not a multiple of the 64-value block) and, for each, what
`bitsandbytes.functional.quantize_4bit(..., quant_type="nf4", blocksize=64)` makes of it
and what `dequantize_4bit` gives back, without and with double quantization of the absmax
values (`compress_statistics=True`: the absmax values less their mean, quantized to 8 bits
with bitsandbytes' signed dynamic map in blocks of 256):

    <name>.weight                 the f32 input, [out, in]
    <name>.packed                 NF4 codes, two per byte (first value in the high nibble)
    <name>.absmax                 f32 per 64-value block
    <name>.dequantized            dequantize_4bit of the above
    <name>.dq.packed / .dq.absmax (u8 codes of absmax − offset) / .dq.offset ([1] f32)
    <name>.dq.nested_absmax       f32 per 256 absmax values
    <name>.dq.nested_quant_map    the 256-value dynamic map
    <name>.dq.dequantized         dequantize_4bit with the nested statistics
    nf4.quant_map                 the 16 NF4 values
    qwen2.qlora_logits[_nodq]     logits of the qwen2 fixture model loaded in 4 bits by
                                  transformers (BitsAndBytesConfig nf4, f32 compute, with
                                  and without double quantization) with the fixture's PEFT
                                  adapter, on the fixture's reference batch
    qwen2.qlora_loss              with double quantization, the fixtures' `lora_loss` (mean
                                  next-token NLL over the batch's real tokens)
    qwen2.qlora_grad.<PEFT name>  and its gradient for every lora_A / lora_B weight

and tests/fixtures/models/qwen2-nf4/: the same 4-bit base model as `save_pretrained`
writes it (bitsandbytes' serialized layout: `weight` u8, `weight.absmax`,
`weight.quant_map`, `weight.nested_absmax`, `weight.nested_quant_map`,
`weight.quant_state.bitsandbytes__nf4`, and `quantization_config` in config.json), for
loading pre-quantized checkpoints.

It is run by developers, not by CI:

    /tmp/refvenv/bin/pip install torch bitsandbytes safetensors transformers peft
    /tmp/refvenv/bin/python scripts/nf4_reference.py [--out FILE]

Last run with: torch==2.15.0 bitsandbytes==0.50.2 transformers==5.24.0 peft (see the
printed versions) (Python 3.11.7, CPU).
"""

import argparse
import shutil
from pathlib import Path

import sys

import bitsandbytes.functional as F
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import lora_loss  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent / "tests/fixtures"


def qlora(out):
    """Logits of the 4-bit qwen2 fixture with its PEFT adapter, and the saved 4-bit base."""
    import peft
    import transformers
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    print("transformers", transformers.__version__, "peft", peft.__version__)
    src = FIXTURES / "models/qwen2"
    r = load_file(str(src / "reference.safetensors"))
    for suffix, double in [("", True), ("_nodq", False)]:
        config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=double,
            bnb_4bit_compute_dtype=torch.float32,
        )
        model = AutoModelForCausalLM.from_pretrained(src, quantization_config=config, device_map="cpu", dtype=torch.float32)
        if double:
            dest = FIXTURES / "models/qwen2-nf4"
            shutil.rmtree(dest, ignore_errors=True)
            model.save_pretrained(dest)
            for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"]:
                shutil.copy(src / f, dest / f)
        model = PeftModel.from_pretrained(model, src / "adapter", is_trainable=True)
        ids, mask = r["input_ids"].long(), r["attention_mask"].long()
        logits = model(input_ids=ids, attention_mask=mask, position_ids=r["position_ids"].long()).logits
        out[f"qwen2.qlora_logits{suffix}"] = logits.detach().float().contiguous()
        if double:
            # The adapter's gradients through the 4-bit base (bitsandbytes' own backward).
            loss = lora_loss(logits, ids, mask)
            loss.backward()
            out["qwen2.qlora_loss"] = loss.detach().float().reshape(())
            for name, p in model.named_parameters():
                if p.requires_grad:
                    out[f"qwen2.qlora_grad.{name}"] = p.grad.float().contiguous()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests/fixtures/nf4_reference.safetensors")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(4)
    out = {"nf4.quant_map": F.get_4bit_type("nf4", device="cpu").float().contiguous()}
    # Weights at the scale of a trained projection (std 0.02), with a few outliers, one
    # all-zero block, and a shape whose size leaves a partial last block.
    shapes = {"a": (128, 64), "b": (96, 200), "c": (7, 45)}
    for name, (rows, cols) in shapes.items():
        w = torch.randn(rows, cols, generator=g) * 0.02
        w.view(-1)[5] = 0.31
        if name == "a":
            w.view(-1)[64:128] = 0.0
        out[f"{name}.weight"] = w.contiguous()
        q, st = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
        out[f"{name}.packed"] = q.view(-1).contiguous()
        out[f"{name}.absmax"] = st.absmax.contiguous()
        out[f"{name}.dequantized"] = F.dequantize_4bit(q, st).contiguous()
        q, st = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
        out[f"{name}.dq.packed"] = q.view(-1).contiguous()
        out[f"{name}.dq.absmax"] = st.absmax.contiguous()
        out[f"{name}.dq.offset"] = st.offset.view(1).float().contiguous()
        out[f"{name}.dq.nested_absmax"] = st.state2.absmax.contiguous()
        out[f"{name}.dq.nested_quant_map"] = st.state2.code.contiguous()
        out[f"{name}.dq.dequantized"] = F.dequantize_4bit(q, st).contiguous()
    qlora(out)
    save_file(out, str(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
