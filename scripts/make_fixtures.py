#!/usr/bin/env python3
"""Make tiny Hugging Face model fixtures and reference outputs for rlhost's Rust parity tests.

What it makes (under tests/fixtures/ by default, or under --out DIR):

* tokenizer.json / tokenizer_config.json / chat_template.jinja / generation_config.json:
  a small byte-level BPE tokenizer (Qwen2-style pre-tokenizer, 512 tokens) trained on a
  synthetic English + arithmetic + python corpus generated below, with Qwen special tokens
  and a Qwen2.5-style chat template written for this project.
* chat_template_cases.json: chat template rendering cases with the rendered text and ids.
* chat_tools/: the real chat templates of Qwen2.5-Instruct, Qwen3 and Llama-3.1-Instruct
  (qwen2_5.jinja, qwen3.jinja, llama3_1.jinja: written out below, not downloaded) and
  cases.json, conversations with tools, tool calls (arguments as objects and as JSON
  text) and tool results, rendered by transformers' apply_chat_template and tokenized by
  the fixture tokenizer; where a template raises, the error.
* models/qwen2, models/qwen3, models/llama: tiny random Qwen2 (tied, qkv bias, f32),
  Qwen3 (q_norm/k_norm, untied, saved in bfloat16) and Llama (llama3 rope scaling, untied,
  sharded safetensors) models, each with its config, weights, tokenizer files and a
  reference.safetensors of f32 CPU outputs (base logits, LoRA logits/loss/grads, ...)
  and reference_half.safetensors of the same in bf16 and f16 (f32 adapter, as PEFT).
  Each also holds the PEFT LoRA adapter the references were made with (adapter/);
  models/qwen2 also holds config.v4.json / tokenizer_config.v4.json (the transformers-4
  forms of its config and tokenizer config).
* README.md: what every file holds and the facts checked while making them.

It is run by developers, not by CI:

    python3 -m venv /tmp/fixvenv
    /tmp/fixvenv/bin/pip install torch transformers peft safetensors tokenizers jinja2
    /tmp/fixvenv/bin/python scripts/make_fixtures.py [--out DIR]

chat_tools/ alone (after a full run has written tokenizer.json), without torch or PEFT:
transformers, tokenizers and jinja2 are enough. It also updates README.md's section on it:

    python scripts/make_fixtures.py --only tool-templates [--out DIR]

Everything is created locally (no hub downloads). Output is deterministic: fixed seeds
everywhere, so running it twice on the same machine gives byte-identical files.

Last run with: torch==2.15.0 transformers==5.23.0 peft==0.21.2 tokenizers==0.23.3
safetensors==0.8.0 Jinja2==3.1.6 (Python 3.11.7, CPU, 2 threads); chat_tools/ with
`--only tool-templates`: transformers==5.19.0 tokenizers==0.23.3 Jinja2==3.1.6 (Python 3.11.7).
"""

import argparse
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import tokenizers  # noqa: E402
import transformers  # noqa: E402
import jinja2  # noqa: E402
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers  # noqa: E402
from tokenizers import pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

RUN_WITH = {
    "torch": "2.15.0",
    "transformers": "5.23.0",
    "peft": "0.21.2",
    "tokenizers": "0.23.3",
    "safetensors": "0.8.0",
    "jinja2": "3.1.6",
}
# `--only tool-templates` (chat_tools/) was last run with these.
TOOL_TEMPLATES_RUN_WITH = {"transformers": "5.19.0", "tokenizers": "0.23.3", "jinja2": "3.1.6"}
INSTALLED = {
    "transformers": transformers.__version__,
    "tokenizers": tokenizers.__version__,
    "jinja2": jinja2.__version__,
}


def import_model_libraries():
    """torch, PEFT, safetensors and the model classes: the full run needs them, `--only
    tool-templates` does not (it runs with transformers, tokenizers and jinja2 alone). They
    are bound as module globals, which the model functions below use."""
    global torch, safetensors, peft, save_file, load_file, HALF_DTYPES, INSTALLED
    global GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    global Qwen3Config, Qwen3ForCausalLM, LoraConfig, get_peft_model
    import torch
    import safetensors
    import peft
    from safetensors.torch import save_file, load_file
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )
    from peft import LoraConfig, get_peft_model

    HALF_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
    INSTALLED = {
        "torch": torch.__version__.split("+")[0],
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
        "jinja2": jinja2.__version__,
    }


DEFAULT_OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
VOCAB_SIZE = 512  # total, special and added tokens included
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2.5 has these as added, non-special tokens; so does this tokenizer.
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# Qwen2's pre-tokenizer split pattern.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEFAULT_SYSTEM = "You are a helpful assistant."
SEQ_LEN = 12
PAD_LEFT = 3
PREFIX_LEN = 5
# Models whose LoRA adapter is saved (adapter/); the others keep references only.
ADAPTER_MODELS = ("qwen2", "qwen3", "llama")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# A Qwen2.5-style chat template, written for rlhost. Rendered by transformers with
# trim_blocks=True and lstrip_blocks=True, and with a tojson filter that does not
# HTML-escape (json.dumps(ensure_ascii=False)).
CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content }}
    {%- else %}
        {{- '""" + DEFAULT_SYSTEM + """' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\n""" + DEFAULT_SYSTEM + """<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


# --------------------------------------------------------------------------- corpus


def make_corpus(seed=1234, n_lines=600):
    rng = random.Random(seed)
    names = ["Alice", "Bob", "Carol", "Dave", "Eve", "Mallory", "Trent", "Peggy"]
    nouns = ["apples", "books", "coins", "marbles", "pencils", "stamps", "cookies", "tickets"]
    verbs = ["has", "buys", "finds", "gives away", "sells", "collects", "loses", "counts"]
    places = ["the market", "school", "the library", "the park", "home", "the office"]
    adjs = ["small", "large", "quick", "careful", "happy", "tired", "clever", "quiet"]
    ops = ["+", "-", "*", "/"]
    fn_names = ["add", "mul", "solve", "compute", "total", "average", "score", "reward"]
    unicode_bits = ["café", "naïve", "über", "→", "≤", "π", "你好", "日本語", "emoji 🙂"]

    def num():
        return str(rng.choice([rng.randint(0, 9), rng.randint(10, 99), rng.randint(100, 999)]))

    def expr(depth=0):
        if depth > 1 or rng.random() < 0.4:
            return num()
        a, b = expr(depth + 1), expr(depth + 1)
        op = rng.choice(ops)
        e = f"{a} {op} {b}"
        return f"({e})" if rng.random() < 0.5 else e

    def safe_eval(e):
        try:
            v = eval(e, {"__builtins__": {}}, {})  # only digits, spaces, parens, + - * /
        except ZeroDivisionError:
            return "undefined"
        return str(round(v, 3)) if isinstance(v, float) else str(v)

    lines = []
    for _ in range(n_lines):
        kind = rng.randrange(8)
        if kind == 0:
            lines.append(
                f"{rng.choice(names)} {rng.choice(verbs)} {num()} {rng.choice(nouns)} at "
                f"{rng.choice(places)}."
            )
        elif kind == 1:
            lines.append(
                f"The {rng.choice(adjs)} student walked to {rng.choice(places)} and "
                f"read {num()} pages before lunch."
            )
        elif kind == 2:
            e = expr()
            lines.append(f"What is {e}? <calc>{e}</calc> <result>{safe_eval(e)}</result>")
        elif kind == 3:
            e = expr()
            lines.append(
                f"Question: compute {e}.\nAnswer: <answer>{safe_eval(e)}</answer>"
            )
        elif kind == 4:
            f, a, b = rng.choice(fn_names), rng.choice("abxyn"), rng.choice("cdmkz")
            op = rng.choice(ops)
            lines.append(
                f"def {f}({a}, {b}):\n    return {a} {op} {b}\n\nprint({f}({num()}, {num()}))"
            )
        elif kind == 5:
            v = rng.choice("ijk")
            lines.append(
                f"for {v} in range({num()}):\n    if {v} % {rng.randint(2, 9)} == 0:\n"
                f"        print({v} * {rng.randint(2, 9)})"
            )
        elif kind == 6:
            lines.append(
                f'{{"name": "{rng.choice(fn_names)}", "arguments": {{"x": {num()}, '
                f'"y": "{rng.choice(nouns)}"}}}}'
            )
        else:
            lines.append(
                f"The user asks the assistant about {rng.choice(unicode_bits)}; the system "
                f"says {rng.choice(adjs)} things & it's <fine> ({num()} > {num()})."
            )
    return lines


# --------------------------------------------------------------------------- tokenizer


def build_tokenizer(out):
    corpus = make_corpus()
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    n_extra = len(SPECIAL_TOKENS) + len(ADDED_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - n_extra,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE - n_extra, tok.get_vocab_size()
    # Like Qwen: plain vocab first, then <|endoftext|>, <|im_start|>, <|im_end|>, then
    # the added (non-special) tool tokens.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    assert tok.get_vocab_size() == VOCAB_SIZE

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=256,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    assert len(hf_tok) == VOCAB_SIZE
    hf_tok.save_pretrained(out)

    ids = {t: hf_tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + ADDED_TOKENS}
    gen = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        do_sample=True,
        temperature=0.7,
        top_p=0.8,
        top_k=20,
        repetition_penalty=1.05,
    )
    gen.save_pretrained(out)
    return hf_tok, ids


def tokenizer_files(out):
    return sorted(p.name for p in Path(out).iterdir() if p.is_file() and (
        p.name.startswith("tokenizer") or p.name in ("chat_template.jinja", "generation_config.json")
    ) and not p.name.endswith(".v4.json"))


def write_tokenizer_config_v4(out, hf_tok, ids):
    """The transformers-4 / Qwen2.5 hub form of tokenizer_config.json: chat template inline."""
    added = {}
    for t in SPECIAL_TOKENS + ADDED_TOKENS:
        added[str(ids[t])] = {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
    cfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 256,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    write_json(out / "tokenizer_config.v4.json", cfg)


# --------------------------------------------------------------------------- helpers


def write_json(path, obj, compact_ids=False):
    text = json.dumps(obj, indent=2, ensure_ascii=False)
    # Lists of plain integers (token ids) on one line each.
    text = re.sub(r"\[(?:\s*-?\d+,)*\s*-?\d+\s*\]", lambda m: json.dumps(json.loads(m.group(0))), text)
    if compact_ids:
        # `"input_ids": [...]` without spaces (only that key: a string value may hold a
        # list that must stay as written).
        text = re.sub(r'("input_ids": )(\[[-\d, ]*\])',
                      lambda m: m.group(1) + m.group(2).replace(" ", ""), text)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")


def common_shape(vocab, ids):
    return dict(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        hidden_act="silu",
        attention_dropout=0.0,
        initializer_range=0.02,
    )


def no_grad(fn):
    """`@torch.no_grad()` that needs torch only when called (see import_model_libraries)."""
    def wrapper(*args, **kwargs):
        with torch.no_grad():
            return fn(*args, **kwargs)
    wrapper.__name__, wrapper.__doc__ = fn.__name__, fn.__doc__
    return wrapper


@no_grad
def init_weights(model, seed):
    """Seeded init large enough that logits are far from 0."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if p.dim() == 1 and "norm" in name:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(0.2 * torch.randn(p.shape, generator=g))


def make_inputs(hf_tok, pad_id):
    a = hf_tok(
        "<|im_start|>user\nWhat is (12 + 7) * 3? <calc>(12 + 7) * 3</calc> <result>57</result>",
        add_special_tokens=False,
    ).input_ids
    b = hf_tok(
        "Alice buys 12 apples at the market and reads 30 pages.", add_special_tokens=False
    ).input_ids
    assert len(a) >= SEQ_LEN and len(b) >= SEQ_LEN - PAD_LEFT, (len(a), len(b))
    assert pad_id not in a and pad_id not in b
    row0 = a[:SEQ_LEN]
    row1 = [pad_id] * PAD_LEFT + b[: SEQ_LEN - PAD_LEFT]
    input_ids = torch.tensor([row0, row1], dtype=torch.int64)
    attention_mask = torch.tensor(
        [[1] * SEQ_LEN, [0] * PAD_LEFT + [1] * (SEQ_LEN - PAD_LEFT)], dtype=torch.int64
    )
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


def forward_logits(model, input_ids, attention_mask, position_ids):
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    )
    return out.logits.float()


def zero_pads(logits, attention_mask):
    """Logits at pad positions are implementation noise; store them as 0."""
    return (logits * attention_mask.unsqueeze(-1).to(logits.dtype)).contiguous()


def masked_max_diff(a, b, attention_mask):
    m = attention_mask.bool()
    return (a[m] - b[m]).abs().max().item()


def lora_loss(logits, input_ids, attention_mask):
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    tgt = input_ids[:, 1:]
    nll = -logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    valid = (attention_mask[:, :-1] * attention_mask[:, 1:]).to(nll.dtype)
    return (nll * valid).sum() / valid.sum()


@no_grad
def kv_cache_check(model, input_ids, full_logits):
    """Prefill the first PREFIX_LEN tokens of row 0, then decode the rest one token at a
    time with past_key_values; compare with the full (batched, masked) forward."""
    ids = input_ids[:1]
    out = model(
        input_ids=ids[:, :PREFIX_LEN],
        position_ids=torch.arange(PREFIX_LEN).unsqueeze(0),
        use_cache=True,
    )
    pkv = out.past_key_values
    diffs = [(out.logits[0].float() - full_logits[0, :PREFIX_LEN]).abs().max().item()]
    for t in range(PREFIX_LEN, SEQ_LEN):
        out = model(
            input_ids=ids[:, t : t + 1],
            position_ids=torch.tensor([[t]]),
            past_key_values=pkv,
            use_cache=True,
        )
        pkv = out.past_key_values
        diffs.append((out.logits[0, -1].float() - full_logits[0, t]).abs().max().item())
    return max(diffs)


# --------------------------------------------------------------------------- models


def build_model(name, vocab, ids):
    shape = common_shape(vocab, ids)
    if name == "qwen2":
        # rlhost bounds rollout.max_total_tokens by the context: the countdown configs run
        # this model on prompts of ~290 tokens with a limit of 512.
        shape["max_position_embeddings"] = 1024
        cfg = Qwen2Config(**shape, tie_word_embeddings=True, use_sliding_window=False)
        cls, seed = Qwen2ForCausalLM, 1002
    elif name == "qwen3":
        cfg = Qwen3Config(
            **shape, head_dim=16, tie_word_embeddings=False, attention_bias=False,
            use_sliding_window=False,
        )
        cls, seed = Qwen3ForCausalLM, 1003
    elif name == "llama":
        cfg = LlamaConfig(
            **shape,
            head_dim=16,
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        cls, seed = LlamaForCausalLM, 1004
    else:
        raise ValueError(name)
    torch.manual_seed(seed)
    model = cls(cfg)
    init_weights(model, seed)
    model.eval()
    return model


def qwen2_config_other_form(cfg_path):
    """config.json in the other transformers major form (v4 <-> v5)."""
    cfg = json.loads(Path(cfg_path).read_text())
    if "rope_parameters" in cfg or "layer_types" in cfg:  # v5 -> v4
        rp = cfg.pop("rope_parameters", None) or {}
        cfg.pop("layer_types", None)
        out = {}
        for k, v in cfg.items():
            if k == "dtype":
                out["torch_dtype"] = v
            elif k == "transformers_version":
                continue
            else:
                out[k] = v
        out["rope_theta"] = rp.get("rope_theta", 10000.0)
        extra = {k: v for k, v in rp.items() if k not in ("rope_theta", "rope_type")}
        out["rope_scaling"] = (
            None if rp.get("rope_type", "default") == "default" else {"rope_type": rp["rope_type"], **extra}
        )
        # Qwen2.5 hub configs carry a numeric sliding_window even with use_sliding_window=false.
        if out.get("sliding_window") is None:
            out["sliding_window"] = out["max_position_embeddings"]
        return dict(sorted(out.items())), "v4"
    # v4 -> v5
    out = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    out["dtype"] = cfg.get("torch_dtype")
    rs = cfg.get("rope_scaling") or {}
    out["rope_parameters"] = {"rope_theta": cfg["rope_theta"], "rope_type": rs.get("rope_type", "default"), **{
        k: v for k, v in rs.items() if k not in ("rope_type", "type")}}
    out["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    out.pop("transformers_version", None)
    return dict(sorted(out.items())), "v5"


def config_form(cfg):
    return "v5" if ("rope_parameters" in cfg or "layer_types" in cfg) else "v4"


def make_model_fixture(name, out, hf_tok, ids, facts):
    vocab = len(hf_tok)
    mdir = out / "models" / name
    if mdir.exists():
        shutil.rmtree(mdir)
    mdir.mkdir(parents=True)

    # ---- weights + config
    model = build_model(name, vocab, ids)
    if name == "qwen3":
        model = model.to(torch.bfloat16)
        model.save_pretrained(mdir)
    elif name == "llama":
        model.save_pretrained(mdir, max_shard_size="200KB")
    else:
        model.save_pretrained(mdir)
    del model
    for f in tokenizer_files(out):
        shutil.copyfile(out / f, mdir / f)  # our generation_config.json replaces the model's

    cfg_json = json.loads((mdir / "config.json").read_text())
    facts[name] = {"config_form": config_form(cfg_json)}
    weight_files = sorted(p.name for p in mdir.glob("*.safetensors"))
    facts[name]["weight_files"] = weight_files
    if name == "llama":
        assert len(weight_files) >= 2 and (mdir / "model.safetensors.index.json").exists(), weight_files

    if name == "qwen2":
        other, form = qwen2_config_other_form(mdir / "config.json")
        write_json(mdir / f"config.{form}.json", other)
        facts[name]["other_config_file"] = f"config.{form}.json"
        write_tokenizer_config_v4(mdir, hf_tok, ids)
        # Check that transformers reads the other form to the same config.
        a = Qwen2Config.from_pretrained(mdir)
        b = Qwen2Config.from_dict(other)
        keys = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "rms_norm_eps", "tie_word_embeddings",
                "max_position_embeddings", "use_sliding_window"]
        same = all(getattr(a, k) == getattr(b, k) for k in keys)
        ra = getattr(a, "rope_parameters", None) or {"rope_theta": getattr(a, "rope_theta", None)}
        rb = getattr(b, "rope_parameters", None) or {"rope_theta": getattr(b, "rope_theta", None)}
        same = same and ra.get("rope_theta") == rb.get("rope_theta")
        assert same, (a, b)
        facts[name]["other_config_reads_same"] = True

    # ---- reload exactly like a loader: f32 on CPU
    cls = {"qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM, "llama": LlamaForCausalLM}[name]
    model = cls.from_pretrained(mdir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    if name == "qwen3":
        raw = load_file(str(mdir / "model.safetensors"))
        assert all(t.dtype == torch.bfloat16 for t in raw.values())
        sd = model.state_dict()
        for k, v in raw.items():
            assert torch.equal(sd[k], v.float()), k
        facts[name]["bf16_upcast_exact"] = True
    if name == "qwen2":
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    input_ids, attention_mask, position_ids = make_inputs(hf_tok, ids["<|endoftext|>"])
    ref = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "prefix_len": torch.tensor(PREFIX_LEN, dtype=torch.int64),
    }
    with torch.no_grad():
        logits = forward_logits(model, input_ids, attention_mask, position_ids)
    facts[name]["logits_std"] = float(logits[attention_mask.bool()].std())
    facts[name]["kv_cache_max_abs_diff"] = kv_cache_check(model, input_ids, logits)
    assert facts[name]["kv_cache_max_abs_diff"] < 1e-4
    ref["logits"] = zero_pads(logits, attention_mask)

    # ---- LoRA
    torch.manual_seed(2000 + ord(name[-1]))
    lcfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS, bias="none")
    pm = get_peft_model(model, lcfg)
    g = torch.Generator().manual_seed(3000 + ord(name[-1]))
    with torch.no_grad():
        for pname, p in sorted(pm.named_parameters(), key=lambda kv: kv[0]):
            if "lora_B" in pname:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    pm.eval()
    lora_params = sorted((n, p) for n, p in pm.named_parameters() if "lora_" in n)
    assert all(p.requires_grad for _, p in lora_params)
    facts[name]["lora_param_count"] = len(lora_params)

    lora_logits = forward_logits(pm, input_ids, attention_mask, position_ids)
    loss = lora_loss(lora_logits, input_ids, attention_mask)
    pm.zero_grad(set_to_none=True)
    loss.backward()
    ref["lora_logits"] = zero_pads(lora_logits.detach(), attention_mask)
    ref["lora_loss"] = loss.detach().float().reshape(())
    for n, p in lora_params:
        assert p.grad is not None, n
        ref[f"grad.{n}"] = p.grad.detach().float().contiguous()
    facts[name]["lora_vs_base_max_abs_diff"] = masked_max_diff(lora_logits.detach(), logits, attention_mask)
    facts[name]["lora_loss"] = loss.item()

    with torch.no_grad():
        with pm.disable_adapter():
            dis = forward_logits(pm, input_ids, attention_mask, position_ids)
    d = masked_max_diff(dis, logits, attention_mask)
    assert d == 0.0, f"disabled-adapter logits differ from base by {d}"
    facts[name]["disabled_adapter_max_abs_diff"] = d
    ref["lora_disabled_logits"] = zero_pads(dis, attention_mask)

    if name in ADAPTER_MODELS:
        pm.peft_config["default"].base_model_name_or_path = None
        pm.save_pretrained(mdir / "adapter")
        readme = mdir / "adapter" / "README.md"
        if readme.exists():
            readme.unlink()  # PEFT's boilerplate model card
        # PEFT writes the base model's absolute path, and target_modules from a set (its
        # order changes with PYTHONHASHSEED): make both deterministic.
        acfg_path = mdir / "adapter" / "adapter_config.json"
        acfg = json.loads(acfg_path.read_text())
        acfg["base_model_name_or_path"] = None
        acfg["target_modules"] = sorted(acfg["target_modules"])
        write_json(acfg_path, dict(sorted(acfg.items())))
        # The saved adapter on a freshly loaded base model gives the same logits.
        from peft import PeftModel
        base = cls.from_pretrained(mdir, dtype=torch.float32, attn_implementation="eager").eval()
        if name == "qwen2":
            other = json.loads((mdir / facts[name]["other_config_file"]).read_text())
            base_other = cls.from_pretrained(
                mdir, config=Qwen2Config.from_dict(other), dtype=torch.float32,
                attn_implementation="eager").eval()
            with torch.no_grad():
                lo = forward_logits(base_other, input_ids, attention_mask, position_ids)
            facts[name]["other_config_logits_max_abs_diff"] = masked_max_diff(lo, logits, attention_mask)
            assert facts[name]["other_config_logits_max_abs_diff"] == 0.0
        reloaded = PeftModel.from_pretrained(base, mdir / "adapter").eval()
        with torch.no_grad():
            rl = forward_logits(reloaded, input_ids, attention_mask, position_ids)
        facts[name]["adapter_reload_vs_lora_max_abs_diff"] = masked_max_diff(rl, lora_logits.detach(), attention_mask)
        assert facts[name]["adapter_reload_vs_lora_max_abs_diff"] < 1e-4
    if name == "qwen2":
        merged = pm.merge_and_unload()
        merged.eval()
        with torch.no_grad():
            mlog = forward_logits(merged, input_ids, attention_mask, position_ids)
        facts[name]["merged_vs_lora_max_abs_diff"] = masked_max_diff(mlog, lora_logits.detach(), attention_mask)
        assert facts[name]["merged_vs_lora_max_abs_diff"] < 1e-4
        ref["merged_logits"] = zero_pads(mlog, attention_mask)

    ref = {k: v.contiguous() for k, v in ref.items()}
    save_file(ref, str(mdir / "reference.safetensors"), metadata={"format": "pt"})
    half_references(name, mdir, cls, (input_ids, attention_mask, position_ids), ref, facts)
    facts[name]["reference_tensors"] = {
        k: (list(v.shape), str(v.dtype).replace("torch.", "")) for k, v in sorted(ref.items())
    }


def half_references(name, mdir, cls, inputs, ref, facts):
    """reference_half.safetensors: the same batch as transformers and PEFT run it in half
    precision. The base is loaded in bf16 (f16) with eager attention (scores in the compute
    dtype, softmax in f32); the saved adapter goes on it with PEFT's default
    `autocast_adapter_dtype=True`, so lora_A/lora_B stay f32, the LoRA input is cast to f32
    and `result + lora_B(lora_A(x)) * scaling` is summed in f32 and cast back; logits are
    upcast to f32 for the loss. Also measures how far each is from the f32 references (the
    precision a half-precision model has to begin with)."""
    from peft import PeftModel
    input_ids, attention_mask, position_ids = inputs
    out = {}
    for tag, dtype in HALF_DTYPES.items():
        base = cls.from_pretrained(mdir, dtype=dtype, attn_implementation="eager").eval()
        with torch.no_grad():
            logits = forward_logits(base, input_ids, attention_mask, position_ids)
        pm = PeftModel.from_pretrained(base, mdir / "adapter", is_trainable=True).eval()
        lora_params = sorted((n, p) for n, p in pm.named_parameters() if "lora_" in n)
        assert lora_params and all(p.dtype == torch.float32 for _, p in lora_params)
        assert all(p.dtype == dtype for n, p in pm.named_parameters() if "lora_" not in n)
        lora_logits = forward_logits(pm, input_ids, attention_mask, position_ids)
        loss = lora_loss(lora_logits, input_ids, attention_mask)
        pm.zero_grad(set_to_none=True)
        loss.backward()
        # The same with PyTorch's fused attention (sdpa): two valid implementations in
        # one dtype differ by this much, which is what the Rust tests' tolerances rest on.
        sdpa = cls.from_pretrained(mdir, dtype=dtype, attn_implementation="sdpa").eval()
        sdpa = PeftModel.from_pretrained(sdpa, mdir / "adapter").eval()
        with torch.no_grad():
            sdpa_logits = forward_logits(sdpa, input_ids, attention_mask, position_ids)
        # Logits are stored in their own dtype (lossless: they were computed in it).
        out[f"{tag}.sdpa_lora_logits"] = zero_pads(sdpa_logits, attention_mask).to(dtype)
        out[f"{tag}.logits"] = zero_pads(logits, attention_mask).to(dtype)
        out[f"{tag}.lora_logits"] = zero_pads(lora_logits.detach(), attention_mask).to(dtype)
        out[f"{tag}.lora_loss"] = loss.detach().float().reshape(())
        worst = 0.0
        for n, p in lora_params:
            assert p.grad is not None, n
            g = p.grad.detach().float().contiguous()
            out[f"{tag}.grad.{n}"] = g
            want = ref[f"grad.{n}"]
            worst = max(worst, ((g - want).abs().max() / want.abs().max()).item())
        f = facts[name]
        f[f"{tag}_logits_vs_f32"] = masked_max_diff(logits, ref["logits"], attention_mask)
        f[f"{tag}_lora_logits_vs_f32"] = masked_max_diff(
            lora_logits.detach(), ref["lora_logits"], attention_mask)
        f[f"{tag}_lora_loss"] = loss.item()
        f[f"{tag}_sdpa_vs_eager"] = masked_max_diff(sdpa_logits, lora_logits.detach(), attention_mask)
        f[f"{tag}_grads_vs_f32"] = worst
    out = {k: v.contiguous() for k, v in out.items()}
    save_file(out, str(mdir / "reference_half.safetensors"), metadata={"format": "pt"})


# --------------------------------------------------------------------------- chat cases


def chat_cases(hf_tok):
    calc_tool = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression like '(12 + 7) * 3'. Use <, > & "
                           "parentheses; don't pass code.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {"type": "string", "description": "e.g. 3 < 4 && 5 > 2"},
                },
                "required": ["expression"],
            },
        },
    }
    search_tool = {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up a word — returns the définition (unicode ok).",
            "parameters": {
                "type": "object",
                "properties": {
                    "word": {"type": "string"},
                    "limit": {"type": "integer", "default": 3},
                },
                "required": ["word"],
            },
        },
    }
    call = {"type": "function", "function": {"name": "calculator",
                                             "arguments": {"expression": "(12 + 7) * 3"}}}
    call2 = {"type": "function", "function": {"name": "lookup",
                                              "arguments": {"word": "l'été <&>", "limit": 2}}}
    cases = [
        ("single_user_default_system", [{"role": "user", "content": "What is 2 + 3?"}], None, True),
        ("single_user_no_generation_prompt", [{"role": "user", "content": "What is 2 + 3?"}], None, False),
        ("explicit_system",
         [{"role": "system", "content": "You are a calculator. Answer in <answer> tags."},
          {"role": "user", "content": "What is (12 + 7) * 3?"}], None, True),
        ("multi_turn",
         [{"role": "system", "content": "Be brief."},
          {"role": "user", "content": "Hi!"},
          {"role": "assistant", "content": "Hello. How can I help?"},
          {"role": "user", "content": "Add 4 and 5."},
          {"role": "assistant", "content": "<answer>9</answer>"}], None, False),
        ("multi_turn_generation_prompt",
         [{"role": "user", "content": "Add 4 and 5."},
          {"role": "assistant", "content": "<answer>9</answer>"},
          {"role": "user", "content": "Now times 3."}], None, True),
        ("second_system_message",
         [{"role": "system", "content": "First rules."},
          {"role": "user", "content": "ok"},
          {"role": "system", "content": "New rules."},
          {"role": "user", "content": "and now?"}], None, True),
        ("tool_call_and_tool_message",
         [{"role": "user", "content": "What is (12 + 7) * 3?"},
          {"role": "assistant", "content": "", "tool_calls": [call]},
          {"role": "tool", "content": "57"}], [calc_tool], True),
        ("tool_message_without_tools",
         [{"role": "user", "content": "Compute it."},
          {"role": "assistant", "content": "Calling the tool.", "tool_calls": [call]},
          {"role": "tool", "content": "{\"result\": 57}"},
          {"role": "assistant", "content": "The answer is 57."}], None, False),
        ("consecutive_tool_messages",
         [{"role": "system", "content": "Use tools."},
          {"role": "user", "content": "Two things please."},
          {"role": "assistant", "content": "", "tool_calls": [call, call2]},
          {"role": "tool", "content": "57"},
          {"role": "tool", "content": "summer <n.> & 'heat'"},
          {"role": "user", "content": "thanks"}], [calc_tool, search_tool], True),
        ("tools_given_default_system",
         [{"role": "user", "content": "Is 3 < 4 & 5 > 2? Don't guess."}], [calc_tool, search_tool], True),
        ("tools_given_explicit_system",
         [{"role": "system", "content": "You solve <math> & 'logic'."},
          {"role": "user", "content": "2 > 1?"},
          {"role": "assistant", "content": "Yes."}], [calc_tool], False),
        ("unicode_and_newlines",
         [{"role": "user", "content": "Café naïve → 你好 🙂\nline two\n\n    indented\tTAB\r\nend"},
          {"role": "assistant", "content": "ok:\n- ü\n- ∑ x² ≤ π"}], None, True),
        ("empty_user_content", [{"role": "user", "content": ""}], None, True),
    ]
    out = []
    for name, msgs, tools, agp in cases:
        rendered = hf_tok.apply_chat_template(
            msgs, tools=tools, tokenize=False, add_generation_prompt=agp
        )
        assert isinstance(rendered, str)
        input_ids = hf_tok(rendered, add_special_tokens=False).input_ids
        assert hf_tok.decode(input_ids) == rendered, name
        out.append({
            "name": name,
            "messages": msgs,
            "tools": tools,
            "add_generation_prompt": agp,
            "rendered": rendered,
            "input_ids": input_ids,
        })
    return out


def jinja_checks(cases, template):
    """Render the cases with plain Jinja2 (not transformers): with a json.dumps tojson like
    transformers', and with Jinja2's own tojson (HTML-escaping, sorted keys)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def render(custom_tojson):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        if custom_tojson:
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        t = env.from_string(template)
        return [t.render(messages=c["messages"], tools=c["tools"],
                         add_generation_prompt=c["add_generation_prompt"]) for c in cases]

    same = all(r == c["rendered"] for r, c in zip(render(True), cases))
    differ = [c["name"] for r, c in zip(render(False), cases) if r != c["rendered"]]
    return {"plain_jinja2_json_dumps_tojson_matches_all": same, "jinja2_builtin_tojson_differs_in": differ}


# --------------------------------------------------------------------------- tool templates
#
# The chat templates of three instruct families, written out (nothing is downloaded), and
# conversations with tools rendered by transformers: chat_tools/. Each template is the
# `chat_template` of the model's hub tokenizer_config.json, character for character; where
# it came from and what it was checked against is said above each.

# Qwen/Qwen2.5-7B-Instruct (the whole Qwen2.5-Instruct family shares it). Compared byte
# for byte with the JSON-escaped hub string copied into public code (a vLLM request's
# `extra_body={"chat_template": ...}`, and the same text in a second project's
# tokenizer_config excerpt, both ending in "{%- endif %}\n"). Hermes calls:
# `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`; arguments always go
# through `tojson`, so a JSON-string argument is rendered as a JSON string.
QWEN2_5_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Qwen/Qwen3-8B at revision 895c8d171bc03c30e113cd7a28c02494b5e068b7 (the one SkyRL's
# skyrl_train/utils/templates/README.md links as "the official Qwen3 jinja template", and
# quotes in part): the text that reads `content` and `reasoning_content` only when they are
# strings. Compared byte for byte with a Qwen3-4B-Thinking-2507 tokenizer_config.json
# copied into public code (identical but for its generation prompt, which always opens
# `<think>`); the generation prompt with `enable_thinking` is the original release's
# (llama.cpp's models/templates/Qwen-Qwen3-0.6B.jinja, which otherwise lacks the two
# string checks), and a transformers.js project inlines this exact combination.
# Thinking: an assistant turn after the last real user query is rendered with its
# `<think>` block (from `reasoning_content`, or split out of `content` at `</think>`);
# `enable_thinking=False` adds an empty think block to the generation prompt.
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# meta-llama/Llama-3.1-8B-Instruct (hub tokenizer_config.json; Llama 3.3 ships the same
# text). Compared byte for byte with the JSON-escaped hub string copied into public code
# (an evaluation script's `get_chat_template("llama")`, ending in "\n"), and line by line
# with marin's experiments/llama.py (the 3.3 template plus `{% generation %}`) and an
# llm_templates copy sourced from the hub file. Custom tools go into the first user
# message (or the system message with `tools_in_user_message=False`) as
# `tojson(indent=4)`; a call is rendered `{"name": ..., "parameters": ...}` (no
# `<|python_tag|>`: that tag is for the built-in tools,
# `<|python_tag|>brave_search.call(query="...")`); one call per message, or
# `raise_exception`; tool results come back as `ipython` turns and, being strings (which
# Jinja2 counts as iterable), go through `tojson`; `date_string` defaults to 26 Jul 2024.
LLAMA3_1_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# The special tokens each model's tokenizer_config.json sets, as transformers hands them
# to the template; how an assistant turn opens and ends in the rendered text; the
# tool-call format rlhost reads there.
TOOL_TEMPLATES = {
    "qwen2_5": {
        "model": "Qwen/Qwen2.5-7B-Instruct",
        "template": QWEN2_5_TEMPLATE,
        "special_tokens": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "assistant_header": "<|im_start|>assistant\n",
        "end_of_turn": ["<|im_end|>"],
        "call_format": "hermes",
    },
    "qwen3": {
        "model": "Qwen/Qwen3-8B",
        "template": QWEN3_TEMPLATE,
        "special_tokens": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "assistant_header": "<|im_start|>assistant\n",
        "end_of_turn": ["<|im_end|>"],
        "call_format": "hermes",
    },
    "llama3_1": {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "template": LLAMA3_1_TEMPLATE,
        "special_tokens": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        "assistant_header": "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "end_of_turn": ["<|eot_id|>", "<|eom_id|>"],
        "call_format": "llama3_json",
    },
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather and forecast for a city — température en °C ou °F.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string",
                             "description": "City and country, e.g. « Zürich, CH » or 東京"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7,
                         "description": "Forecast length in days"},
            },
            "required": ["location"],
        },
    },
}
FLIGHTS_TOOL = {
    "type": "function",
    "function": {
        "name": "search_flights",
        "description": "Search flights between two airports; prices in €.",
        "parameters": {
            "type": "object",
            "properties": {
                "route": {
                    "type": "object",
                    "description": "Where from and where to",
                    "properties": {
                        "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                        "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                        "date": {"type": "string", "format": "date"},
                    },
                    "required": ["from", "to"],
                },
                "passengers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                        "required": ["name"],
                    },
                },
                "cabin": {"type": "string", "enum": ["economy", "premium", "business"]},
                "max_price": {"type": "number"},
                "direct_only": {"type": "boolean", "default": False},
            },
            "required": ["route", "passengers"],
        },
    },
}
CONVERT_TOOL = {
    "type": "function",
    "function": {
        "name": "convert_currency",
        "description": "Convert an amount between currencies (ISO 4217 codes: EUR, JPY ¥, …).",
        "parameters": {
            "type": "object",
            "properties": {
                "amount": {"type": "number", "exclusiveMinimum": 0},
                "from": {"type": "string"},
                "to": {"type": "array", "items": {"type": "string"},
                       "description": "One or more target currencies"},
                "rounding": {"type": ["integer", "null"],
                             "description": "Decimal places, or null to keep all"},
            },
            "required": ["amount", "from", "to"],
        },
    },
}
ALL_TOOLS = [WEATHER_TOOL, FLIGHTS_TOOL, CONVERT_TOOL]


def tool_call(call_id, name, arguments):
    """An OpenAI-shape call; `arguments` a dict, or JSON text as the OpenAI API sends it."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_result(call_id, content):
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def tool_conversations():
    """(name, messages, tools, add_generation_prompt) shared by the three templates."""
    weather_zh = tool_call("call_w1", "get_weather",
                           {"location": "Zürich, CH", "unit": "celsius", "days": 2})
    flights = tool_call("call_f1", "search_flights", {
        "route": {"from": "ZRH", "to": "NRT", "date": "2025-03-14"},
        "passengers": [{"name": "Anna", "age": 34}, {"name": "Ben"}],
        "cabin": "economy", "max_price": 1500.0, "direct_only": True,
    })
    # Arguments as JSON text, compact as a model or an API client writes them.
    convert_text = tool_call("call_c1", "convert_currency",
                             '{"amount":1250.5,"from":"EUR","to":["JPY","USD"],"rounding":null}')
    weather_text = tool_call("call_w2", "get_weather",
                             '{"location": "東京, JP", "unit": "fahrenheit"}')
    tricky = tool_call("call_t1", "get_weather", {
        "location": "Saint-Jean </tool_call> \"de\" Luz; {FR}\n\\n",
        "unit": "celsius",
    })
    tricky_text = tool_call("call_t2", "get_weather",
                            '{"location": "<tool_call>{\\"name\\": \\"x\\"}</tool_call>"}')
    return [
        ("one_call_no_system",
         [{"role": "user", "content": "Wie ist das Wetter in Zürich? Antworte auf Deutsch."},
          {"role": "assistant", "content": None, "tool_calls": [weather_zh]},
          tool_result("call_w1", '{"temp": 21.5, "sky": "sonnig ☀", "forecast": [22, 19]}'),
          {"role": "assistant", "content": "In Zürich ist es sonnig bei 21,5 °C."}],
         ALL_TOOLS, False),
        ("two_calls_one_turn_system",
         [{"role": "system", "content": "You are a travel agent. Quote prices in euros."},
          {"role": "user", "content": "Flights ZRH→NRT for Anna (34) and Ben, direct, and "
                                      "1250.5 EUR in JPY and USD?"},
          {"role": "assistant", "content": "", "tool_calls": [flights, convert_text]},
          tool_result("call_f1", '[{"flight": "LX160", "price": 1180.0}]'),
          tool_result("call_c1", '{"JPY": 201234, "USD": 1362.4}'),
          {"role": "assistant", "content": "LX160 costs €1180; 1250.5 EUR is ¥201234 or $1362.40."}],
         [FLIGHTS_TOOL, CONVERT_TOOL], False),
        ("content_and_string_arguments_then_user",
         [{"role": "system", "content": "Answer briefly."},
          {"role": "user", "content": "Weather in Tokyo, in fahrenheit?"},
          {"role": "assistant", "content": "Let me check.", "tool_calls": [weather_text]},
          tool_result("call_w2", '{"temp": 75}'),
          {"role": "assistant", "content": "75 °F and clear."},
          {"role": "user", "content": "And tomorrow?"}],
         [WEATHER_TOOL], True),
        ("prompt_only",
         [{"role": "user", "content": "How much is 100 CHF in EUR and ¥?"}],
         [WEATHER_TOOL, CONVERT_TOOL], True),
        ("tool_history_without_tools",
         [{"role": "system", "content": "You are terse."},
          {"role": "user", "content": "Weather in Zürich?"},
          {"role": "assistant", "content": None, "tool_calls": [weather_zh]},
          tool_result("call_w1", "21 °C, sunny"),
          {"role": "assistant", "content": "21 °C and sunny."}],
         None, False),
        ("multi_step_then_generation_prompt",
         [{"role": "user", "content": "Weather in Zürich, then convert 1250.5 EUR."},
          {"role": "assistant", "content": None, "tool_calls": [weather_zh]},
          tool_result("call_w1", '{"temp": 21.5}'),
          {"role": "assistant", "content": None, "tool_calls": [convert_text]},
          tool_result("call_c1", '{"JPY": 201234, "USD": 1362.4}'),
          {"role": "assistant", "content": "21.5 °C; ¥201234 or $1362.40."},
          {"role": "user", "content": "Thanks! Now flights?"}],
         [WEATHER_TOOL, CONVERT_TOOL], True),
        ("markup_inside_arguments_and_results",
         [{"role": "user", "content": "Two odd places, please."},
          {"role": "assistant", "content": None, "tool_calls": [tricky]},
          tool_result("call_t1", "<tool_response>nested</tool_response>\n{\"ok\": true}"),
          {"role": "assistant", "content": None, "tool_calls": [tricky_text]},
          tool_result("call_t2", "no such place"),
          {"role": "assistant", "content": "One found, one not."}],
         [WEATHER_TOOL], False),
        # A tool that returned nothing: Jinja2 prints None as "None", and Llama 3.1's
        # `content is iterable` is false for it (it is true for strings and for undefined).
        ("tool_result_null",
         [{"role": "user", "content": "Weather in Zürich?"},
          {"role": "assistant", "content": None, "tool_calls": [weather_zh]},
          tool_result("call_w1", None),
          {"role": "assistant", "content": "The weather service said nothing."}],
         None, False),
    ]


def tool_template_cases():
    """(template, name, messages, tools, kwargs, add_generation_prompt), all templates.
    Qwen3 runs with `enable_thinking=False` too where there is a generation prompt, the
    only place that switch changes the text."""
    cases = []
    for name, msgs, tools, agp in tool_conversations():
        cases.append(("qwen2_5", name, msgs, tools, {}, agp))
        cases.append(("qwen3", name, msgs, tools, {}, agp))
        if agp:
            cases.append(("qwen3", name + "_no_thinking", msgs, tools,
                          {"enable_thinking": False}, agp))
        cases.append(("llama3_1", name, msgs, tools, {}, agp))

    # Qwen3 reasoning: `reasoning_content`, and a `<think>` block inside `content`.
    reasoning = [
        {"role": "user", "content": "Is it warmer in Zürich or Tokyo?"},
        {"role": "assistant", "content": "",
         "reasoning_content": "\nI need both temperatures; call get_weather twice.\n",
         "tool_calls": [tool_call("call_r1", "get_weather", {"location": "Zürich, CH"}),
                        tool_call("call_r2", "get_weather", '{"location": "東京, JP"}')]},
        tool_result("call_r1", '{"temp": 21}'),
        tool_result("call_r2", '{"temp": 24}'),
        {"role": "assistant", "content": "<think>\nTokyo 24 > Zürich 21.\n</think>\n\nTokyo is warmer."},
    ]
    then_user = reasoning + [{"role": "user", "content": "By how much?"}]
    cases.append(("qwen3", "reasoning_turns", reasoning, [WEATHER_TOOL], {}, False))
    cases.append(("qwen3", "reasoning_turns_then_user", then_user, [WEATHER_TOOL], {}, True))
    cases.append(("qwen3", "reasoning_turns_then_user_no_thinking", then_user, [WEATHER_TOOL],
                  {"enable_thinking": False}, True))

    # Llama 3.1's own switches.
    one_call = tool_conversations()[0][1]
    cases.append(("llama3_1", "tools_in_system_message", one_call, [WEATHER_TOOL],
                  {"tools_in_user_message": False}, False))
    cases.append(("llama3_1", "date_string", one_call, [WEATHER_TOOL],
                  {"date_string": "14 Mar 2025"}, True))
    cases.append(("llama3_1", "builtin_tools_eom", [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "Search the Zürich forecast, then get the weather."},
        {"role": "assistant", "content": None,
         "tool_calls": [tool_call("call_b1", "brave_search", {"query": "Zürich forecast"})]},
        tool_result("call_b1", "Sunny, 21 °C"),
        {"role": "assistant", "content": None, "tool_calls": [tool_call(
            "call_b2", "get_weather", {"location": "Zürich, CH", "days": 1})]},
        tool_result("call_b2", '{"temp": 21}'),
        {"role": "assistant", "content": "Sunny, 21 °C."},
    ], [WEATHER_TOOL], {"builtin_tools": ["brave_search", "wolfram_alpha"]}, False))
    cases.append(("llama3_1", "tool_result_as_object", [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [tool_call(
            "call_o1", "get_weather", {"location": "Zürich, CH"})]},
        {"role": "tool", "tool_call_id": "call_o1", "content": {"temp": 21.5, "sky": "sunny"}},
    ], [WEATHER_TOOL], {}, True))
    cases.append(("llama3_1", "tools_without_user_message",
                  [{"role": "system", "content": "No user yet."}], [WEATHER_TOOL], {}, True))
    return cases


def make_tool_templates(out):
    """chat_tools/: the three templates and cases.json, rendered by transformers'
    apply_chat_template and tokenized by the fixture tokenizer (raw `tokenizers`, no added
    special tokens). A case whose render raises records the error instead."""
    import copy

    tokenizer_file = out / "tokenizer.json"
    if not tokenizer_file.exists():
        sys.exit(f"{tokenizer_file} is missing: run the full script once first")
    raw = Tokenizer.from_file(str(tokenizer_file))
    tdir = out / "chat_tools"
    tdir.mkdir(parents=True, exist_ok=True)

    hf = {}
    meta = {}
    for key, t in TOOL_TEMPLATES.items():
        (tdir / f"{key}.jinja").write_text(t["template"], encoding="utf-8")
        tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), **t["special_tokens"])
        tok.chat_template = t["template"]
        hf[key] = tok
        meta[key] = {
            "model": t["model"],
            "file": f"{key}.jinja",
            "bos_token": t["special_tokens"].get("bos_token"),
            "eos_token": t["special_tokens"].get("eos_token"),
            "assistant_header": t["assistant_header"],
            "end_of_turn": t["end_of_turn"],
            "call_format": t["call_format"],
        }

    cases = []
    for key, name, msgs, tools, kwargs, agp in tool_template_cases():
        sent = copy.deepcopy(msgs)
        case = {"template": key, "name": name, "messages": msgs, "tools": tools,
                "kwargs": kwargs, "add_generation_prompt": agp}
        try:
            rendered = hf[key].apply_chat_template(
                sent, tools=copy.deepcopy(tools), tokenize=False, add_generation_prompt=agp,
                **kwargs)
        except jinja2.TemplateError as err:
            case.update(rendered=None, input_ids=None, error=str(err))
        else:
            assert isinstance(rendered, str), (key, name)
            assert sent == msgs, f"{key}/{name}: apply_chat_template changed the messages"
            ids = raw.encode(rendered, add_special_tokens=False).ids
            assert raw.decode(ids, skip_special_tokens=False) == rendered, (key, name)
            case.update(rendered=rendered, input_ids=ids, error=None)
        cases.append(case)
    assert len({(c["template"], c["name"]) for c in cases}) == len(cases)

    made_with = {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                 "jinja2": jinja2.__version__, "python": sys.version.split()[0]}
    write_json(tdir / "cases.json", {"made_with": made_with, "templates": meta, "cases": cases},
               compact_ids=True)
    return {"templates": meta, "cases": cases, "made_with": made_with}


def tool_templates_readme(tool):
    """The README section on chat_tools/ (also spliced in alone by `--only tool-templates`)."""
    L = []
    w = L.append
    w("## Tool-calling chat templates (`chat_tools/`)")
    w("")
    w("Made by `make_fixtures.py --only tool-templates` (or the full run) with "
      + ", ".join(f"{k}=={v}" for k, v in tool["made_with"].items() if k != "python")
      + f" (Python {tool['made_with']['python']}); it needs no torch or PEFT.")
    w("")
    for key, m in tool["templates"].items():
        n = sum(c["template"] == key for c in tool["cases"])
        w(f"- `{m['file']}`: the chat template of `{m['model']}`, written out in the script "
          f"(not downloaded; its source is in a comment there); calls in the "
          f"`{m['call_format']}` format; {n} cases.")
    w("- `cases.json`: `{made_with, templates, cases}`. `templates.<name>` has the file, the")
    w("  `bos_token`/`eos_token` transformers gave the template (null where the model has none),")
    w("  the text that opens an assistant turn and the tokens that end one, and the call format.")
    w("  Each case is `{template, name, messages, tools, kwargs, add_generation_prompt, rendered,")
    w("  input_ids, error}`: `rendered` is `apply_chat_template(messages, tools=tools,")
    w("  tokenize=False, add_generation_prompt=..., **kwargs)` with a `PreTrainedTokenizerFast`")
    w("  of `tokenizer.json` given those special tokens, `input_ids` its encoding by the raw")
    w("  `tokenizers` library with `add_special_tokens=False` (the fixture tokenizer has none of")
    w("  Llama's special tokens, so those are plain text there). Where the template raises")
    w("  (Llama 3.1 with two calls in one message, or tools and no user message), `rendered` and")
    w("  `input_ids` are null and `error` is the message. Messages are OpenAI-shaped: calls")
    w("  `{id, type: \"function\", function: {name, arguments}}` with arguments as objects and")
    w("  as JSON text, `tool` messages with `tool_call_id`; Qwen3 cases with a generation")
    w("  prompt also run with `enable_thinking=False` (`_no_thinking`; it changes nothing")
    w("  else). Cases: "
      + ", ".join(f"`{c['template']}/{c['name']}`" for c in tool["cases"]) + ".")
    return L


# --------------------------------------------------------------------------- README


def readme_files(out):
    """Every file here but the README, and their total size."""
    files = sorted(p for p in out.rglob("*") if p.is_file() and p != out / "README.md")
    return files, sum(p.stat().st_size for p in files)


def readme_files_table(out, files):
    lines = ["## Files", "", "| file | bytes |", "| --- | --- |"]
    return lines + [f"| `{p.relative_to(out).as_posix()}` | {p.stat().st_size} |" for p in files]


def splice_tool_templates_readme(out, tool):
    """`--only tool-templates`: put the chat_tools/ section into the README the full run
    wrote (before "## Models", or in place of the old one) and refresh its file list."""
    readme = out / "README.md"
    if not readme.exists():
        print(f"{readme} is missing; run the full script to write it", file=sys.stderr)
        return
    text = readme.read_text(encoding="utf-8")
    section = "\n".join(tool_templates_readme(tool)) + "\n\n"
    heading = "## Tool-calling chat templates"
    if heading in text:
        start = text.index(heading)
        end = text.index("\n## ", start) + 1
        text = text[:start] + section + text[end:]
    else:
        at = text.index("## Models")
        text = text[:at] + section + text[at:]
    files, total = readme_files(out)
    text = re.sub(r"Total size of all files here except this README: \d+ bytes\.",
                  f"Total size of all files here except this README: {total} bytes.", text)
    text = text[:text.index("## Files")] + "\n".join(readme_files_table(out, files)) + "\n"
    readme.write_text(text, encoding="utf-8")


def write_readme(out, ids, facts, cases, jchecks, tool):
    files, total = readme_files(out)
    L = []
    w = L.append
    w("# Test fixtures: tiny Hugging Face models and reference outputs")
    w("")
    w("Generated by `scripts/make_fixtures.py` (this README too: change the script, not this")
    w("file). Everything here is created locally from fixed seeds; no hub downloads.")
    w("")
    w("Regenerate (developers, not CI):")
    w("")
    w("```sh")
    w("python3 -m venv /tmp/fixvenv")
    w("/tmp/fixvenv/bin/pip install torch transformers peft safetensors tokenizers jinja2")
    w("/tmp/fixvenv/bin/python scripts/make_fixtures.py            # writes tests/fixtures/")
    w("/tmp/fixvenv/bin/python scripts/make_fixtures.py --out DIR  # elsewhere")
    w("```")
    w("")
    w("Versions used: " + ", ".join(f"{k}=={v}" for k, v in INSTALLED.items())
      + f"; Python {sys.version.split()[0]}; CPU, `torch.set_num_threads(2)`.")
    w("Two runs on the same machine give byte-identical files (checked with sha256, also with")
    w("different PYTHONHASHSEED and a different --out). Float outputs may differ in")
    w("the last bits on another CPU or with other versions.")
    w("")
    w("## Tokenizer (top level, copied into every model folder)")
    w("")
    w("- `tokenizer.json`: byte-level BPE, Qwen2 pre-tokenizer (NFC normalizer, regex Split")
    w("  then ByteLevel without regex), trained on a seeded synthetic corpus (English,")
    w(f"  arithmetic with `<calc>`/`<result>`/`<answer>` tags, python, JSON). {VOCAB_SIZE} tokens:")
    w(f"  ids 0..{VOCAB_SIZE - len(ids) - 1} BPE vocab (0..255 are the byte alphabet), then:")
    for t, i in ids.items():
        w(f"  - `{t}` = {i} ({'special' if t in SPECIAL_TOKENS else 'added, not special'})")
    w("- `tokenizer_config.json`: as transformers " + INSTALLED["transformers"]
      + " writes it (eos `<|im_end|>`, pad `<|endoftext|>`,")
    w("  no bos). transformers 5 writes the chat template to `chat_template.jinja`, NOT into")
    w("  `tokenizer_config.json`.")
    w("- `chat_template.jinja`: a Qwen2.5-style template written for this project (system /")
    w("  user / assistant with `tool_calls` / tool roles, tools block with `tojson`,")
    w(f"  default system message \"{DEFAULT_SYSTEM}\", `add_generation_prompt`). transformers")
    w("  renders it with `trim_blocks=True, lstrip_blocks=True` and its own `tojson`")
    w("  (`json.dumps(x, ensure_ascii=False)`: no HTML escaping of `<`, `>`, `&`, `'`;")
    w("  separators `, ` and `: `; dict key order kept).")
    w("- `generation_config.json`: eos_token_id is a LIST `[<|im_end|>, <|endoftext|>]` as in")
    w("  Qwen2.5-Instruct, plus bos/pad ids and sampling defaults.")
    w("- `chat_template_cases.json`: list of cases `{name, messages, tools (or null),")
    w("  add_generation_prompt, rendered, input_ids}`; `rendered` is")
    w("  `apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=...)`,")
    w("  `input_ids` is the tokenizer's encoding of `rendered` with `add_special_tokens=False`")
    w("  (decoding them gives `rendered` back; checked; the raw `tokenizers` library gives the")
    w("  same ids). Several cases are longer than `model_max_length` 256: no truncation is")
    w("  applied. Cases: "
      + ", ".join(f"`{c['name']}`" for c in cases) + ".")
    w("")
    L.extend(tool_templates_readme(tool))
    w("")
    w("## Models (`models/<name>/`)")
    w("")
    w("All three: hidden 64, 2 layers, 4 attention heads, 2 KV heads, head_dim 16,")
    w(f"intermediate 128, vocab {VOCAB_SIZE}, max_position_embeddings 256 (1024 for qwen2, whose")
    w("countdown configs run longer), rms_norm_eps 1e-6,")
    w("rope_theta 10000, silu. Seeded random weights: linear/embedding N(0, 0.2²), norm weights")
    w("1 + N(0, 0.1²), biases N(0, 0.1²). Each folder has config.json (as transformers writes")
    w("it), weights, and copies of the tokenizer files and generation_config.json.")
    w("")
    w("| model | class | weights | notes |")
    w("| --- | --- | --- | --- |")
    w("| qwen2 | Qwen2ForCausalLM | `model.safetensors` f32 | tied embeddings (no `lm_head.weight` in the file), q/k/v bias |")
    w("| qwen3 | Qwen3ForCausalLM | `model.safetensors` **bf16** | q_norm/k_norm, untied, no attention bias |")
    w("| llama | LlamaForCausalLM | " + ", ".join(f"`{f}`" for f in facts["llama"]["weight_files"])
      + " f32 + `model.safetensors.index.json` | untied, rope_type llama3 factor 8, low 1, high 4, original_max_position_embeddings 64 |")
    w("")
    form = facts["qwen2"]["config_form"]
    w(f"`config.json` files are in the transformers-{form[1]} form ({form}: "
      + ("`rope_parameters` {rope_theta, rope_type, ...}, `layer_types`, `dtype`, `sliding_window: null`)."
         if form == "v5" else "`rope_theta` at top level, `rope_scaling`, `torch_dtype`)."))
    other = facts["qwen2"]["other_config_file"]
    w(f"`models/qwen2/{other}` is the same config in the other form (made by the script"
      + (": `rope_theta` at top level, `rope_scaling: null`, `torch_dtype`, numeric"
         " `sliding_window` (= max_position_embeddings, unused since `use_sliding_window` is"
         " false), no `layer_types`, no `rope_parameters`, no `transformers_version`)."
         if other == "config.v4.json" else ")."))
    w("transformers reads both to the same model config (checked). Qwen2 configs have no")
    w("`head_dim` key (it is hidden_size / num_attention_heads = 16); qwen3 and llama have one.")
    w("`models/qwen2/tokenizer_config.v4.json` is a hand-made Qwen2.5-hub-style")
    w("tokenizer_config.json with the chat template inline (`chat_template` key),")
    w("`added_tokens_decoder` and `tokenizer_class: Qwen2Tokenizer`, for testing that loader path.")
    w("")
    w("`models/qwen2/adapter/`: the PEFT LoRA adapter (`adapter_config.json`,")
    w("`adapter_model.safetensors`) used for qwen2's LoRA references;")
    w("`base_model_name_or_path` is set to null and `target_modules` sorted (PEFT writes an")
    w("absolute path and set order); PEFT's README model card is removed.")
    w("")
    w("## `models/<name>/reference.safetensors`")
    w("")
    w("All computed on CPU in float32 from the saved files loaded with")
    w("`from_pretrained(dir, dtype=float32, attn_implementation=\"eager\")` (qwen3: the bf16")
    w("weights upcast to f32; checked equal to a plain `.float()` of the stored tensors).")
    w("")
    w("| tensor | shape | dtype | meaning |")
    w("| --- | --- | --- | --- |")
    w(f"| `input_ids` | [2, {SEQ_LEN}] | int64 | row 0: {SEQ_LEN} real tokens; row 1: {PAD_LEFT} left pads (`<|endoftext|>`) then {SEQ_LEN - PAD_LEFT} tokens |")
    w(f"| `attention_mask` | [2, {SEQ_LEN}] | int64 | 1 = real token, 0 = pad |")
    w(f"| `position_ids` | [2, {SEQ_LEN}] | int64 | `(attention_mask.cumsum(-1) - 1).clamp(min=0)` |")
    w(f"| `prefix_len` | [] | int64 | {PREFIX_LEN}: prompt length for the KV-cache check |")
    w(f"| `logits` | [2, {SEQ_LEN}, {VOCAB_SIZE}] | float32 | base model forward with that mask and position_ids |")
    w(f"| `lora_logits` | [2, {SEQ_LEN}, {VOCAB_SIZE}] | float32 | same inputs with the LoRA adapter on |")
    w(f"| `lora_disabled_logits` | [2, {SEQ_LEN}, {VOCAB_SIZE}] | float32 | PEFT model under `disable_adapter()`; equals `logits` exactly (asserted) |")
    w(f"| `merged_logits` (qwen2 only) | [2, {SEQ_LEN}, {VOCAB_SIZE}] | float32 | after `merge_and_unload()` |")
    w("| `lora_loss` | [] | float32 | loss below, with the adapter on |")
    w("| `grad.<PEFT name>` | shape of the parameter | float32 | d lora_loss / d every lora_A and lora_B weight |")
    w("")
    w("Logits are stored in full (all positions) except that **pad positions are set to 0.0**:")
    w("their values are implementation noise (fully masked attention rows); compare only where")
    w("`attention_mask == 1`.")
    w("")
    w("LoRA: `LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=[q,k,v,o,gate,up,down]_proj,")
    w("bias=\"none\")` (scaling alpha/r = 2), `get_peft_model` after a fixed `torch.manual_seed`,")
    w("then every `lora_B` set to seeded N(0, 0.1²) (PEFT initialises B to zero).")
    w("The adapter weights are saved for " + ", ".join(ADAPTER_MODELS) + " (`adapter/`), so")
    w("`lora_logits`, `lora_loss` and `grad.*` can be reproduced from these files.")
    w("Gradient names are PEFT parameter names, e.g.")
    w("`grad.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight`")
    w("(lora_A: [4, in_features], lora_B: [out_features, 4]).")
    w("")
    w("Loss: targets are `input_ids` shifted left by one; the mean over positions t with")
    w("`attention_mask[t] == 1 and attention_mask[t+1] == 1` (t < 11) of")
    w("`-log_softmax(lora_logits[t])[input_ids[t+1]]`.")
    w("")
    w(f"KV cache (checked, nothing extra saved): row 0 prefilled with its first `prefix_len`")
    w("tokens, then decoded one token at a time with `past_key_values`; every step's logits")
    w("match `logits[0, t]` from the full batched forward (asserted < 1e-4; measured below).")
    w("")
    w("## `models/<name>/reference_half.safetensors`")
    w("")
    w("The same batch in half precision, as transformers and PEFT run it: the base loaded with")
    w("`from_pretrained(dir, dtype=bfloat16 | float16, attn_implementation=\"eager\")` (scores in")
    w("the compute dtype, softmax in f32), the saved adapter put on it with")
    w("`PeftModel.from_pretrained(base, adapter/, is_trainable=True)`: PEFT's default")
    w("`autocast_adapter_dtype=True` keeps lora_A/lora_B in f32, casts the LoRA input to f32,")
    w("adds the product to the base output in f32 and casts the sum back (asserted: adapter f32,")
    w("everything else in the half dtype). Logits are upcast to f32 before the loss.")
    w("")
    w("| tensor | meaning |")
    w("| --- | --- |")
    w("| `bf16.logits`, `f16.logits` | base logits, stored in their dtype (pads 0) |")
    w("| `bf16.lora_logits`, `f16.lora_logits` | with the adapter on |")
    w("| `bf16.sdpa_lora_logits`, `f16.sdpa_lora_logits` | the same with `attn_implementation=\"sdpa\"`: how far two valid implementations in one dtype fall apart |")
    w("| `bf16.lora_loss`, `f16.lora_loss` | the loss above, with the adapter on |")
    w("| `bf16.grad.<PEFT name>`, `f16.grad.<PEFT name>` | its gradients (f32, as the adapter) |")
    w("")
    w("## Measured facts")
    w("")
    w("| | qwen2 | qwen3 | llama |")
    w("| --- | --- | --- | --- |")

    def row(label, key, fmt="{:.3g}"):
        vals = []
        for n in ("qwen2", "qwen3", "llama"):
            v = facts[n].get(key)
            vals.append("-" if v is None else (fmt.format(v) if isinstance(v, float) else str(v)))
        w(f"| {label} | " + " | ".join(vals) + " |")

    row("config.json form", "config_form")
    row("std of logits (real positions)", "logits_std")
    row("KV-cache decode vs full forward, max abs diff", "kv_cache_max_abs_diff")
    row("disabled adapter vs base logits, max abs diff", "disabled_adapter_max_abs_diff")
    row("LoRA vs base logits, max abs diff", "lora_vs_base_max_abs_diff")
    row("merged vs LoRA logits, max abs diff", "merged_vs_lora_max_abs_diff")
    row("saved adapter reloaded (PeftModel.from_pretrained) vs LoRA logits, max abs diff",
        "adapter_reload_vs_lora_max_abs_diff")
    row("logits with the other config form vs base logits, max abs diff",
        "other_config_logits_max_abs_diff")
    row("lora_loss", "lora_loss", "{:.6f}")
    row("number of LoRA parameters (grad.* tensors)", "lora_param_count")
    for tag in HALF_DTYPES:
        row(f"{tag} base logits vs f32, max abs diff", f"{tag}_logits_vs_f32")
        row(f"{tag} LoRA logits vs f32, max abs diff", f"{tag}_lora_logits_vs_f32")
        row(f"{tag} LoRA logits, sdpa vs eager attention, max abs diff", f"{tag}_sdpa_vs_eager")
        row(f"{tag} lora_loss", f"{tag}_lora_loss", "{:.6f}")
        row(f"{tag} LoRA gradients vs f32, worst relative diff", f"{tag}_grads_vs_f32")
    w("")
    w("Chat template: every case renders identically with plain Jinja2")
    w("(`ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`) given a")
    w("`tojson` of `json.dumps(x, ensure_ascii=False)`: "
      + str(jchecks["plain_jinja2_json_dumps_tojson_matches_all"]).lower() + ". With Jinja2's")
    w("built-in `tojson` (escapes `<`, `>`, `&`, `'` as `\\u003c` etc. and sorts keys) these")
    w("cases differ: " + ", ".join(f"`{n}`" for n in jchecks["jinja2_builtin_tojson_differs_in"])
      + ". A Rust renderer must match the transformers behaviour.")
    w("")
    w(f"Total size of all files here except this README: {total} bytes.")
    w("")
    L.extend(readme_files_table(out, files))
    (out / "README.md").write_text("\n".join(L) + "\n", encoding="utf-8")
    return total


# --------------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", choices=["tool-templates"],
                    help="make only these files (tool-templates: chat_tools/, which needs "
                         "transformers, tokenizers and jinja2 but no torch or PEFT)")
    args = ap.parse_args()
    out = args.out.resolve()

    if args.only == "tool-templates":
        for k, v in TOOL_TEMPLATES_RUN_WITH.items():
            if INSTALLED[k] != v:
                print(f"warning: {k} {INSTALLED[k]} installed, chat_tools/ was made with {v}",
                      file=sys.stderr)
        tool = make_tool_templates(out)
        splice_tool_templates_readme(out, tool)
        print(f"{len(tool['cases'])} cases in {out / 'chat_tools'}")
        return

    import_model_libraries()
    for k, v in RUN_WITH.items():
        if INSTALLED[k] != v:
            print(f"warning: {k} {INSTALLED[k]} installed, fixtures were made with {v}", file=sys.stderr)

    torch.set_num_threads(2)
    torch.manual_seed(0)
    random.seed(0)
    torch.use_deterministic_algorithms(True)

    out.mkdir(parents=True, exist_ok=True)
    hf_tok, ids = build_tokenizer(out)

    cases = chat_cases(hf_tok)
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    for c in cases:
        assert raw.encode(c["rendered"], add_special_tokens=False).ids == c["input_ids"], c["name"]
    jchecks = jinja_checks(cases, CHAT_TEMPLATE)
    assert jchecks["plain_jinja2_json_dumps_tojson_matches_all"], jchecks
    write_json(out / "chat_template_cases.json", cases)
    tool = make_tool_templates(out)

    facts = {}
    for name in ("qwen2", "qwen3", "llama"):
        make_model_fixture(name, out, hf_tok, ids, facts)

    total = write_readme(out, ids, facts, cases, jchecks, tool)
    print(json.dumps(facts, indent=2, default=str))
    print(f"total bytes (without README.md): {total}")
    # Fixtures other scripts write (data/, the NF4 and RL references) count too: a bound on
    # what a checkout carries, not on this script alone.
    assert total <= 4 * 1024 * 1024, total


if __name__ == "__main__":
    main()
