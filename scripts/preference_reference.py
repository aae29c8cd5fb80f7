#!/usr/bin/env python3
"""Reference numbers for rlhost's preference losses, made by TRL's own trainers.

It writes tests/fixtures/preference_reference.safetensors and .json: one fixed batch of
preference pairs as token ids (prompt, chosen, rejected) for the fixture model
tests/fixtures/models/qwen2 with its PEFT adapter (models/qwen2/adapter, whose lora_B is
not zero, so the policy differs from the reference), and, for each loss:

* TRL's `DPOTrainer.compute_loss` (trl.trainer.dpo_trainer) with `loss_type` `sigmoid`,
  `robust` (label_smoothing 0.1) and `ipo`, the reference being the base model (passed as
  `ref_model`: rlhost's reference is the model with its adapter off);
* TRL's `CPOTrainer` (trl.experimental.cpo) with `loss_type="simpo"`, `cpo_alpha=0`
  (SimPO's own setting: no NLL term) and label smoothing 0.1,

the loss, the metrics TRL logs for it (rewards/chosen, rewards/rejected, rewards/margins,
rewards/accuracies) and the gradient of every LoRA tensor (`<module>.lora_A` /
`.lora_B`, rlhost's names; f32). rlhost's test (`rl::dpo::tests::
dpo_matches_trls_trainers_on_the_fixture_batch`) computes the same from the same ids.

And for the reward model, TRL's `RewardTrainer.compute_loss` with margins and
`center_rewards_coefficient` 0.01, on transformers' `AutoModelForSequenceClassification`
(num_labels 1) of the same fixture with the same adapter and a fixed `score.weight`
(`rm/score.weight` in the safetensors): each sequence's score, the loss, and the gradients
of the adapter and the head (`rm/...`). Read by `rl::reward_model::tests`.

It is run by developers, not by CI:

    python3 -m venv /tmp/prefvenv
    /tmp/prefvenv/bin/pip install torch transformers peft trl accelerate datasets safetensors
    /tmp/prefvenv/bin/python scripts/preference_reference.py

Last run with: torch 2.13.0, transformers 5.19.0, peft 0.21.2, trl 1.16.0 (Python
3.11.7, CPU, f32).
"""

import argparse
import json
import os
import re
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests/fixtures/models/qwen2"

# Three pairs of unequal lengths (so padding and the per-token averages of IPO and SimPO
# matter), ids well inside the fixture tokenizer's vocabulary.
PAIRS = [
    {"prompt_ids": [5, 17, 42, 9], "chosen_ids": [33, 71, 8], "rejected_ids": [33, 90]},
    {"prompt_ids": [11, 12], "chosen_ids": [100, 101, 102, 103, 7], "rejected_ids": [64, 3, 250]},
    {"prompt_ids": [300, 21, 19, 18, 200], "chosen_ids": [44], "rejected_ids": [45, 46, 47, 48]},
]
BETA = 0.2
SMOOTHING = 0.1
SIMPO_GAMMA = 0.5


def rl_name(peft_name: str) -> str:
    """PEFT's `base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight` as
    rlhost's `model.layers.0.self_attn.q_proj.lora_A`."""
    name = re.sub(r"^base_model\.model\.", "", peft_name)
    return re.sub(r"\.default\.weight$", "", name)


def load_model():
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(MODEL, torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, MODEL / "adapter", is_trainable=True)
    model.train()
    # No dropout: the loss must be a function of the weights alone.
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def grads_of(model):
    return {
        rl_name(n): p.grad.detach().float().contiguous()
        for n, p in model.named_parameters()
        if p.requires_grad and p.grad is not None
    }


def dpo_case(loss_type, smoothing, out_dir):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    model = load_model()
    tok = AutoTokenizer.from_pretrained(MODEL)
    args = DPOConfig(
        output_dir=out_dir,
        loss_type=[loss_type],
        beta=BETA,
        label_smoothing=smoothing,
        report_to=[],
        per_device_train_batch_size=len(PAIRS),
        max_length=None,
        use_cpu=True,
        # TRL's configs turn bf16 on by default, which runs the reference model's forward
        # in bf16 autocast even on the CPU (measured: its log-probs moved by up to 0.06);
        # the reference numbers are f32 throughout.
        bf16=False,
    )
    # rlhost's reference is the base model (the adapter off). Given a model that already
    # holds an adapter, TRL would take that adapter as loaded for the reference; the base
    # is passed as ref_model so that both mean the same.
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(MODEL, torch_dtype=torch.float32).eval()
    trainer = DPOTrainer(
        model=model,
        ref_model=ref,
        args=args,
        # The trainer prepares a dataset it is given; the batch below is collated from the
        # ids directly, so this one only has to be one TRL accepts.
        train_dataset=Dataset.from_list([{"prompt": "1+1=", "chosen": "2", "rejected": "3"}]),
        processing_class=tok,
    )
    batch = trainer.data_collator([dict(p) for p in PAIRS])
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith("rewards/")}
    return float(loss), metrics, grads_of(trainer.model)


def simpo_case(out_dir):
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    model = load_model()
    args = CPOConfig(
        output_dir=out_dir,
        loss_type="simpo",
        cpo_alpha=0.0,
        beta=BETA,
        simpo_gamma=SIMPO_GAMMA,
        label_smoothing=SMOOTHING,
        report_to=[],
        use_cpu=True,
    )
    trainer = CPOTrainer.__new__(CPOTrainer)
    # Only the loss path is used: the trainer's settings as its __init__ sets them.
    trainer.loss_type = args.loss_type
    trainer.beta = args.beta
    trainer.simpo_gamma = args.simpo_gamma
    trainer.label_smoothing = args.label_smoothing
    trainer.cpo_alpha = args.cpo_alpha
    trainer.is_encoder_decoder = False
    trainer.alpha = args.alpha  # AlphaPO's transform, off at its default 0
    import types

    trainer.accelerator = types.SimpleNamespace(device=torch.device("cpu"))
    # The policy's per-completion mean log-probs, computed as CPOTrainer's
    # concatenated_forward does with average_log_prob=True.
    chosen, rejected = [], []
    for p in PAIRS:
        for side, out in (("chosen_ids", chosen), ("rejected_ids", rejected)):
            ids = torch.tensor([p["prompt_ids"] + p[side]])
            labels = ids.clone()
            labels[:, : len(p["prompt_ids"])] = -100
            logits = model(input_ids=ids).logits
            out.append(CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True, is_encoder_decoder=False))
    chosen, rejected = torch.cat(chosen), torch.cat(rejected)
    losses, chosen_rewards, rejected_rewards = trainer.cpo_loss(chosen, rejected)
    loss = losses.mean()
    loss.backward()
    metrics = {
        "rewards/chosen": float(chosen_rewards.mean()),
        "rewards/rejected": float(rejected_rewards.mean()),
        "rewards/margins": float((chosen_rewards - rejected_rewards).mean()),
        "rewards/accuracies": float((chosen_rewards > rejected_rewards).float().mean()),
    }
    return float(loss), metrics, grads_of(model)


RM_MARGINS = [0.5, 0.0, 1.0]
RM_CENTER = 0.01


def rm_case(out_dir):
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    tok = AutoTokenizer.from_pretrained(MODEL)
    base = AutoModelForSequenceClassification.from_pretrained(MODEL, num_labels=1, dtype=torch.float32)
    base.config.pad_token_id = tok.pad_token_id
    # A fixed head, seeded: rlhost reads the same values from the fixture.
    g = torch.Generator().manual_seed(11)
    head = torch.randn(base.score.weight.shape, generator=g) * 0.5
    with torch.no_grad():
        base.score.weight.copy_(head)
    adapter_cfg = json.loads((MODEL / "adapter/adapter_config.json").read_text())
    cfg = LoraConfig(
        task_type="SEQ_CLS",
        r=adapter_cfg["r"],
        lora_alpha=adapter_cfg["lora_alpha"],
        lora_dropout=0.0,
        target_modules=adapter_cfg["target_modules"],
    )
    model = get_peft_model(base, cfg)
    state = load_file(str(MODEL / "adapter/adapter_model.safetensors"))
    # The head as a saved SEQ_CLS adapter holds it (what `rlhost rm` writes).
    state["base_model.model.score.weight"] = head
    set_peft_model_state_dict(model, state)
    model.train()
    args = RewardConfig(
        output_dir=out_dir,
        center_rewards_coefficient=RM_CENTER,
        report_to=[],
        use_cpu=True,
        bf16=False,
        max_length=None,
    )
    trainer = RewardTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "1+1=", "chosen": "2", "rejected": "3"}]),
        processing_class=tok,
    )
    rows = [
        {"chosen_ids": p["prompt_ids"] + p["chosen_ids"], "rejected_ids": p["prompt_ids"] + p["rejected_ids"], "margin": m}
        for p, m in zip(PAIRS, RM_MARGINS)
    ]
    batch = trainer.data_collator(rows)
    with torch.no_grad():
        scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        if p.requires_grad and p.grad is not None:
            name = "score.weight" if ".score." in n else rl_name(n)
            grads[name] = p.grad.detach().float().contiguous()
    grads["score.weight.value"] = head.float().contiguous()
    return float(loss), scores.tolist(), grads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "tests/fixtures/preference_reference"))
    args = ap.parse_args()
    import peft
    import transformers
    import trl
    from safetensors.torch import save_file

    torch.manual_seed(0)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__, "trl": trl.__version__}
    print(versions)
    cases = {}
    tensors = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, loss_type, smoothing in [("sigmoid", "sigmoid", 0.0), ("robust", "robust", SMOOTHING), ("ipo", "ipo", 0.0)]:
            loss, metrics, grads = dpo_case(loss_type, smoothing, os.path.join(tmp, name))
            cases[name] = {"label_smoothing": smoothing, "loss": loss, "metrics": metrics}
            tensors.update({f"{name}/{k}": v for k, v in grads.items()})
            print(name, loss, metrics)
        loss, metrics, grads = simpo_case(os.path.join(tmp, "simpo"))
        cases["simpo"] = {"label_smoothing": SMOOTHING, "simpo_gamma": SIMPO_GAMMA, "loss": loss, "metrics": metrics}
        tensors.update({f"simpo/{k}": v for k, v in grads.items()})
        print("simpo", loss, metrics)
        loss, scores, grads = rm_case(os.path.join(tmp, "rm"))
        cases["rm"] = {"margins": RM_MARGINS, "center_rewards_coefficient": RM_CENTER, "loss": loss, "scores": scores}
        tensors.update({f"rm/{k}": v for k, v in grads.items()})
        print("rm", loss, scores)
    meta = {"versions": versions, "beta": BETA, "pairs": PAIRS, "cases": cases}
    Path(args.out + ".json").write_text(json.dumps(meta, indent=1) + "\n")
    save_file(tensors, args.out + ".safetensors")
    print("wrote", args.out + ".json", "and .safetensors")


if __name__ == "__main__":
    main()
