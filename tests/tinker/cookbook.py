"""Runs tinker-cookbook's two basic recipes against `rlhost serve --tinker` (issue 49, point 4).

Usage: cookbook.py BASE_URL TOKENIZER_DIR LOG_DIR [sl] [rl] [custom]   (no names: all three)

The server serves the built-in multiply model under a Hub name the cookbook knows
(`--served-model-name Qwen/Qwen3-4B-Instruct-2507`): the recipes pick their renderer from a
fixed table of model names, and `qwen3_instruct`'s rendering is the built-in model's chat
template token for token (checked below). The tokenizer is the served model's own directory,
registered under that name with the cookbook's `register_tokenizer`, so nothing is fetched.

What runs is the recipes' own code, `recipes/sl_basic.py` and `recipes/rl_basic.py`: their
`build_config_blueprint` and `main`, which drive the cookbook's `supervised.train` and
`rl.train` loops. Changed through the blueprint, as a user of the recipe would:
- sl_basic: the dataset is the cookbook's own `example_data/conversations.jsonl` through
  `FromConversationFileBuilder` (the swap the recipe's comment shows; No Robots is a Hub
  download), with 16 conversations held out; batch, epochs and learning rate fit a small model.
- rl_basic: the dataset is the built-in multiply task written as a cookbook environment
  (`MultiplyEnv` below; GSM8K is a Hub download and beyond a model of this size): the model's
  turn runs to a calculator call, the calculator's result is appended, and the turn goes on.
Each check reads the metrics the recipe logged (`metrics.jsonl`) and prints `measured:` lines.
A third check, `custom`, is the SDK's `forward_backward_custom`, which needs torch on the
client: this venv is the one that has it.
"""

import asyncio
import json
import os
import random
import re
import sys
from pathlib import Path

BASE_URL, TOKENIZER_DIR, LOG_DIR = sys.argv[1], sys.argv[2], Path(sys.argv[3])
WANTED = sys.argv[4:] or ["sl", "rl", "custom"]

os.environ.setdefault("TINKER_API_KEY", "tml-rlhost-local")
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_COOKBOOK_RUNS_DIR", str(LOG_DIR))

import chz  # noqa: E402
import tinker  # noqa: E402
from tinker_cookbook import renderers, tokenizer_utils  # noqa: E402
from tinker_cookbook.utils import cost_estimation  # noqa: E402
from tinker_cookbook.rl.types import (  # noqa: E402
    Env,
    EnvGroupBuilder,
    RLDataset,
    RLDatasetBuilder,
    StepResult,
)

from calculator import calc  # noqa: E402  (tests/tinker/calculator.py)

# The Hub name the recipes look the renderer up by; the server serves the built-in model under it.
MODEL = "Qwen/Qwen3-4B-Instruct-2507"


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


tokenizer_utils.register_tokenizer(MODEL, _tokenizer)

# The loops price their tokens from the hosted service's price list, fetched once from its
# docs site; a local server has no prices, and this machine reaches no such site. Marked as
# fetched-and-missing, which is the state a failed fetch leaves (the loops then log token
# counts only), so that no request leaves the machine.
cost_estimation._pricing_fetched = True


def metrics(log):
    path = log / "metrics.jsonl"
    assert path.exists(), f"the recipe wrote no {path}"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(rows, key):
    return [(r["step"], r[key]) for r in rows if key in r]


def check_renderer():
    """The recipes' renderer for MODEL renders exactly the built-in model's chat template."""
    from tinker_cookbook import model_info

    name = model_info.get_recommended_renderer_name(MODEL)
    tok = tokenizer_utils.get_tokenizer(MODEL)
    renderer = renderers.get_renderer(name, tok)
    convo = [{"role": "user", "content": "What is 123 * 45?"}]
    ours = renderer.build_generation_prompt(convo).to_ints()
    template = tok.encode(
        tok.apply_chat_template(convo, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    assert ours == template, (name, tok.decode(ours), tok.decode(template))
    print(f"measured: renderer {name} renders the served model's chat template token for token")


# --- sl_basic -------------------------------------------------------------------------------


def supervised():
    import tinker_cookbook
    from tinker_cookbook.recipes import sl_basic
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    log = LOG_DIR / "sl_basic"
    blueprint = sl_basic.build_config_blueprint(MODEL)
    renderer_name = blueprint.make().renderer_name
    data = FromConversationFileBuilder(
        common_config=ChatDatasetBuilderCommonConfig(
            model_name_for_tokenizer=MODEL,
            renderer_name=renderer_name,
            max_length=1024,
            batch_size=16,
            train_on_what=renderers.TrainOnWhat.ALL_ASSISTANT_MESSAGES,
        ),
        file_path=str(Path(tinker_cookbook.__file__).parent / "example_data/conversations.jsonl"),
        test_size=16,
    )
    config = blueprint.apply(
        {
            "base_url": BASE_URL,
            "log_path": str(log),
            "dataset_builder": data,
            "learning_rate": 2e-3,
            "lora_rank": 16,
            "num_epochs": 3,
            "eval_every": 7,
            "save_every": 0,
        }
    ).make()
    sl_basic.main(config)

    rows = metrics(log)
    train = series(rows, "train_mean_nll")
    test = series(rows, "test/nll")
    assert train and test, f"no train_mean_nll or test/nll in {log}/metrics.jsonl: {rows[:2]}"
    first, last = train[0][1], sum(v for _, v in train[-3:]) / 3
    print(
        f"measured: sl_basic {len(train)} steps; train NLL per token {first:.2f} (step {train[0][0]}) -> "
        f"{last:.2f} (mean of the last 3); held-out NLL {test[0][1]:.2f} (step {test[0][0]}) -> "
        f"{test[-1][1]:.2f} (step {test[-1][0]})"
    )
    assert last < 0.7 * first, train
    assert test[-1][1] < 0.8 * test[0][1], test
    final = [json.loads(x) for x in (log / "checkpoints.jsonl").read_text().splitlines()]
    assert any(c.get("name") == "final" for c in final), final


# --- rl_basic on the built-in task -----------------------------------------------------------


def answer_of(text):
    found = re.findall(r"<answer>\s*(-?\d+)\s*</answer>", text)
    return int(found[-1]) if found else None


class MultiplyEnv(Env):
    """The built-in multiply task as a cookbook environment: the model's turn up to a
    calculator call (`</calc>`) or its end; a call gets the calculator's `<result>` appended
    (calculator.py, as rlhost's trigger answers) and the turn goes on. Reward: 1 for the right `<answer>`, 0.1 for
    an answer in the format (the task's own)."""

    def __init__(self, renderer, a, b):
        self.renderer, self.a, self.b = renderer, a, b
        self.tokens = []
        self.text = ""
        self.eos = renderer.get_stop_sequences()

    async def initial_observation(self):
        prompt = self.renderer.build_generation_prompt(
            [{"role": "user", "content": f"What is {self.a} * {self.b}?"}]
        )
        self.tokens = prompt.to_ints()
        return prompt, ["</calc>", "<|im_end|>"]

    async def step(self, action, *, extra=None):
        tok = self.renderer.tokenizer
        self.tokens = self.tokens + list(action)
        self.text += tok.decode(list(action))
        if self.text.endswith("</calc>") and len(self.tokens) < 150:
            result = tok.encode(calc(self.text), add_special_tokens=False)
            self.tokens += result
            self.text += tok.decode(result)
            return StepResult(
                reward=0.0,
                episode_done=False,
                next_observation=tinker.ModelInput.from_ints(self.tokens),
                next_stop_condition=self.eos,
            )
        given = answer_of(self.text)
        correct = float(given == self.a * self.b)
        return StepResult(
            reward=correct + (0.1 if given is not None else 0.0),
            episode_done=True,
            next_observation=tinker.ModelInput.empty(),
            next_stop_condition=self.eos,
            metrics={"correct": correct, "format": float(given is not None)},
        )


class MultiplyGroup(EnvGroupBuilder):
    def __init__(self, renderer, a, b, n):
        self.renderer, self.a, self.b, self.n = renderer, a, b, n

    async def make_envs(self):
        return [MultiplyEnv(self.renderer, self.a, self.b) for _ in range(self.n)]

    def logging_tags(self):
        return ["multiply"]


class MultiplyDataset(RLDataset):
    def __init__(self, renderer, problems, batch_size, group_size):
        self.renderer, self.problems = renderer, problems
        self.batch_size, self.group_size = batch_size, group_size

    def get_batch(self, index):
        chunk = self.problems[index * self.batch_size : (index + 1) * self.batch_size]
        return [MultiplyGroup(self.renderer, a, b, self.group_size) for a, b in chunk]

    def __len__(self):
        return len(self.problems) // self.batch_size


@chz.chz
class MultiplyDatasetBuilder(RLDatasetBuilder):
    """Problems drawn as the built-in task draws them: three digits times two."""

    batch_size: int
    group_size: int
    renderer_name: str
    model_name_for_tokenizer: str
    steps: int
    held_out: int = 96
    seed: int = 7

    async def __call__(self):
        renderer = renderers.get_renderer(
            self.renderer_name, tokenizer_utils.get_tokenizer(self.model_name_for_tokenizer)
        )
        rng = random.Random(self.seed)
        draw = lambda n: [(rng.randint(100, 999), rng.randint(10, 99)) for _ in range(n)]  # noqa: E731
        test = draw(self.held_out)
        train = draw(self.steps * self.batch_size)
        return (
            MultiplyDataset(renderer, train, self.batch_size, self.group_size),
            MultiplyDataset(renderer, test, self.held_out, 1),
        )


def reinforcement():
    from tinker_cookbook.recipes import rl_basic

    log = LOG_DIR / "rl_basic"
    blueprint = rl_basic.build_config_blueprint(MODEL)
    renderer_name = blueprint.make().renderer_name
    # 16 steps and 96 held-out problems: with 12 and 48, a CI run that drew a slow start (the
    # adapter's seed and the samples are random, as on the hosted service) ended at
    # +14.6 points, under the check's 15; four runs here: +52 at 12 steps, +44, +44 and +47 at 16.
    steps = 16
    config = blueprint.apply(
        {
            "base_url": BASE_URL,
            "log_path": str(log),
            "dataset_builder": MultiplyDatasetBuilder(
                batch_size=8,
                group_size=8,
                renderer_name=renderer_name,
                model_name_for_tokenizer=MODEL,
                steps=steps,
            ),
            # 1e-3: at 2e-3 a CI run rose to 0.89 mean reward by step 6 and fell to 0.02 by
            # step 14 (the recipe's importance_sampling loss has no clip); at 1e-3 two runs side
            # by side here went +44 and +47 points.
            "learning_rate": 1e-3,
            "lora_rank": 16,
            "max_tokens": 40,
            "eval_every": steps,
            "save_every": 0,
        }
    ).make()
    rl_basic.main(config)

    rows = metrics(log)
    reward = series(rows, "env/all/reward/total")
    test = series(rows, "test/env/all/correct")
    assert len(reward) == steps and len(test) >= 2, (reward, test)
    early = sum(v for _, v in reward[:2]) / 2
    late = sum(v for _, v in reward[-2:]) / 2
    print(
        f"measured: rl_basic {steps} steps of 8 x 8; mean reward {early:.2f} (steps 1-2) -> {late:.2f} "
        f"(steps {steps - 1}-{steps}); held-out accuracy (96 problems, temperature 1) "
        f"{test[0][1]:.0%} (step {test[0][0]}) -> {test[-1][1]:.0%} (step {test[-1][0]})"
    )
    assert late >= early + 0.1, reward
    assert test[-1][1] >= test[0][1] + 0.15, test


# --- the SDK's forward_backward_custom (it needs torch, which this venv has) -------------------


def custom():
    """`forward_backward_custom` runs the loss in torch on the client over `forward`'s
    log-probs and sends `-dC/dlogprobs` as real-valued `cross_entropy` weights. Checked: a
    custom loss equal to cross-entropy moves the weights exactly as the built-in one does
    (two clients from one saved state), and a DPO-style loss raises its preference margin."""
    import torch
    from tinker import types

    service = tinker.ServiceClient(base_url=BASE_URL)
    tok = tokenizer_utils.get_tokenizer(MODEL)

    def datum(prompt, answer):
        p = tok.encode(prompt, add_special_tokens=False)
        a = tok.encode(answer, add_special_tokens=False)
        seq = p + a
        return types.Datum(
            model_input=types.ModelInput.from_ints(seq[:-1]),
            loss_fn_inputs={
                "target_tokens": seq[1:],
                "weights": [0.0] * (len(p) - 1) + [1.0] * len(a),
            },
        )

    data = [datum(f"Q: {a}+{b}=", f" {a + b}.") for a, b in [(3, 4), (10, 20), (7, 8)]]
    adam = types.AdamParams(learning_rate=1e-2)

    # Twins from one state: the same adapter weights and (empty) optimizer state.
    seed = service.create_lora_training_client(base_model=MODEL, rank=8).result()
    state = seed.save_state("custom-twin").result().path
    builtin = service.create_training_client_from_state(state).result()
    ours = service.create_training_client_from_state(state).result()

    def ce(batch, logprobs):
        loss = sum(
            -(torch.tensor(d.loss_fn_inputs["weights"].tolist()) * lp).sum()
            for d, lp in zip(batch, logprobs, strict=True)
        )
        return loss, {"ce": loss.item()}

    losses = []
    for _ in range(3):
        a = builtin.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
        losses.append(a)
        b = ours.forward_backward_custom(data, ce).result().metrics["ce"]
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (a, b)
        builtin.optim_step(adam).result()
        ours.optim_step(adam).result()
    after = [builtin.forward(data, "cross_entropy").result(), ours.forward(data, "cross_entropy").result()]
    gap = max(
        abs(x - y)
        for o1, o2 in zip(after[0].loss_fn_outputs, after[1].loss_fn_outputs)
        for x, y in zip(o1["logprobs"].tolist(), o2["logprobs"].tolist())
    )
    last = after[0].metrics["loss:sum"]
    print(
        f"measured: custom cross-entropy vs built-in, 3 steps (loss {losses[0]:.1f} -> {last:.1f}): "
        f"largest log-prob gap {gap:.1e}"
    )
    assert gap < 1e-4, gap
    assert last < 0.8 * losses[0], (losses, last)

    # DPO-style: the chosen answer over the rejected one, -log sigmoid(beta * margin).
    chosen, rejected = datum("Q: 6*7=", " 42."), datum("Q: 6*7=", " 13.")

    def dpo(batch, logprobs):
        w = [torch.tensor(d.loss_fn_inputs["weights"].tolist()) for d in batch]
        margin = (w[0] * logprobs[0]).sum() - (w[1] * logprobs[1]).sum()
        return -torch.nn.functional.logsigmoid(0.5 * margin), {"margin": margin.item()}

    tc = service.create_lora_training_client(base_model=MODEL, rank=8).result()
    margins = []
    for _ in range(8):
        margins.append(tc.forward_backward_custom([chosen, rejected], dpo).result().metrics["margin"])
        tc.optim_step(adam).result()
    print(f"measured: DPO-style custom loss, preference margin {margins[0]:.2f} -> {margins[-1]:.2f} in 8 steps")
    assert margins[-1] > margins[0] + 1.0, margins


RECIPES = {"sl": supervised, "rl": reinforcement, "custom": custom}

check_renderer()
for name in WANTED:
    print(f"--- {name}", flush=True)
    RECIPES[name]()
    print(f"ok: {name}", flush=True)
