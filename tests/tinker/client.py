"""Drives `rlhost serve --tinker` with the official `tinker` SDK (tests/integration/tinker.rs).

Usage: client.py BASE_URL [CHECK ...]   (BASE_URL as TINKER_BASE_URL; no names: every check)

The server serves the built-in multiply model (`builtin:multiply`, its tokenizer loaded by
the SDK from the model's own directory). Each check asserts what a script written against
the Tinker API relies on; the first that fails ends the script with a message naming it.
Figures each check measured are printed as `measured: ...` lines.
"""

import os
import random
import re
import sys
import threading
import time

os.environ["TINKER_BASE_URL"] = sys.argv[1]
os.environ.setdefault("TINKER_API_KEY", "tml-rlhost-local")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import numpy as np  # noqa: E402
import tinker  # noqa: E402
from tinker import types  # noqa: E402

from calculator import calc  # noqa: E402  (tests/tinker/calculator.py)

service = tinker.ServiceClient()
BASE = service.get_server_capabilities().supported_models[0].model_name

checks = []


def check(name):
    def wrap(f):
        checks.append((name, f))
        return f

    return wrap


def ready(x):
    """SDK 0.38 answers create_* calls with a future that also stands in for the client
    (deprecated): wait for the client itself."""
    return x.result() if hasattr(x, "result") else x


def training_client(rank=8, **kw):
    """A LoRA training client; as the SDK's default, its adapter trains the output head too
    (`train_unembed=False` leaves it out)."""
    return ready(service.create_lora_training_client(base_model=BASE, rank=rank, **kw))


_tokenizer = None


def tokenizer():
    global _tokenizer
    if _tokenizer is None:
        _tokenizer = training_client(rank=1).get_tokenizer()
    return _tokenizer


def chat_prompt(a, b):
    """The multiply task's prompt, rendered by the model's chat template."""
    text = tokenizer().apply_chat_template(
        [{"role": "user", "content": f"What is {a} * {b}?"}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer().encode(text, add_special_tokens=False)


def sft_datum(text_prompt, text_answer):
    """A supervised datum: the prompt (not trained on) and the answer (trained on)."""
    tok = tokenizer()
    p = tok.encode(text_prompt)
    a = tok.encode(text_answer)
    seq = p + a
    weights = [0.0] * (len(p) - 1) + [1.0] * len(a)
    return types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": weights},
    )


def mean_loss(result, data):
    """Loss per trained token (the API's loss is a sum)."""
    return result.metrics["loss:sum"] / sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in data)


SFT = [(f"Q: {a}+{b}=", f" {a + b}.") for a, b in [(3, 4), (10, 20), (7, 8), (12, 30), (5, 5), (41, 2)]]


@check("a supervised loop (cross_entropy) drives the loss down")
def supervised():
    tc = training_client(rank=8)
    data = [sft_datum(p, a) for p, a in SFT]
    losses = []
    for _ in range(20):
        fb = tc.forward_backward(data, "cross_entropy")
        # 5e-3: at 1e-2 Adam overshoots now and then (a loss of 1.6 back to 14 in one
        # step on some initialisations); at 5e-3 twelve initialisations ended at 5-18% of
        # the first loss.
        op = tc.optim_step(types.AdamParams(learning_rate=5e-3))
        losses.append(mean_loss(fb.result(), data))
        op.result()
    print(f"measured: supervised loss per token {losses[0]:.3f} -> {losses[-1]:.3f} in 20 steps")
    assert losses[-1] < 0.3 * losses[0], losses


@check("each loss's value is its documented formula of the returned log-probs")
def losses():
    tc = training_client(rank=4)
    tok = tokenizer()
    rng = np.random.default_rng(0)
    seq = tok.encode("What is 12 * 34? <answer>408</answer>")
    n = len(seq) - 1
    q = rng.uniform(-3, -0.1, n).astype(np.float32)
    adv = rng.normal(0, 1, n).astype(np.float32)
    weights = rng.uniform(0, 2, n).astype(np.float32)

    def datum(**inputs):
        return types.Datum(
            model_input=types.ModelInput.from_ints(seq[:-1]),
            loss_fn_inputs={"target_tokens": seq[1:], **inputs},
        )

    ce = tc.forward([datum(weights=weights)], "cross_entropy").result()
    lp = np.array(ce.loss_fn_outputs[0]["logprobs"].tolist(), dtype=np.float64)
    assert len(lp) == n and np.all(lp <= 0), lp
    ratio = np.exp(lp - q)
    want = {
        "cross_entropy": -(lp * weights).sum(),
        "importance_sampling": -(ratio * adv).sum(),
        "ppo": -np.minimum(ratio * adv, np.clip(ratio, 0.9, 1.1) * adv).sum(),
        "cispo": -(np.clip(ratio, 0.8, 1.2) * lp * adv).sum(),
        "dro": -(lp * adv - 0.5 * 0.05 * (lp - q) ** 2).sum(),
    }
    configs = {
        "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
        "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        "dro": {"beta": 0.05},
    }
    for name, expected in want.items():
        inputs = {"weights": weights} if name == "cross_entropy" else {"logprobs": q, "advantages": adv}
        got = tc.forward([datum(**inputs)], name, loss_fn_config=configs.get(name)).result()
        value = got.metrics["loss:sum"]
        assert abs(value - expected) <= 1e-4 * max(1.0, abs(expected)), (name, value, expected)
        per = np.array(got.loss_fn_outputs[0]["elementwise_loss"].tolist())
        assert abs(per.sum() - value) <= 1e-4 * max(1.0, abs(value)), (name, per.sum(), value)


def answer_of(text):
    found = re.findall(r"<answer>\s*(-?\d+)\s*</answer>", text)
    return int(found[-1]) if found else None


def rollout(sampler, a, b, n, temperature, seed):
    """The multiply task played through the API: the model's turn up to a calculator call
    (`</calc>`) or its end, the calculator's result appended (as rlhost's trigger does) and
    the turn continued. Returns per sample the full token list, the sampler's log-probs of
    the tokens it drew (None elsewhere) and the reward (task's: 1 correct, +0.1 format)."""
    tok = tokenizer()
    prompt = chat_prompt(a, b)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    first = sampler.sample(
        prompt=types.ModelInput.from_ints(prompt),
        num_samples=n,
        sampling_params=types.SamplingParams(
            max_tokens=40, temperature=temperature, stop=["</calc>", "<|im_end|>"], seed=seed
        ),
    )
    out = []
    for j, s in enumerate(first.result().sequences):
        tokens, lps = list(prompt) + s.tokens, [None] * len(prompt) + s.logprobs
        text = tok.decode(s.tokens)
        if text.endswith("</calc>") and len(tokens) < 150:
            result = tok.encode(calc(text))
            tokens += result
            lps += [None] * len(result)
            more = sampler.sample(
                prompt=types.ModelInput.from_ints(tokens),
                num_samples=1,
                sampling_params=types.SamplingParams(
                    max_tokens=40, temperature=temperature, stop=[eos], seed=seed * 1000 + j
                ),
            ).result()
            s2 = more.sequences[0]
            tokens += s2.tokens
            lps += s2.logprobs
            text += tok.decode(result) + tok.decode(s2.tokens)
        given = answer_of(text)
        reward = (1.0 if given == a * b else 0.0) + (0.1 if given is not None else 0.0)
        out.append((tokens, lps, reward))
    return out


def accuracy(sampler, problems):
    """Greedy accuracy on held-out problems."""
    right = 0
    for i, (a, b) in enumerate(problems):
        (_, _, reward), = rollout(sampler, a, b, 1, 0.0, 10_000 + i)
        right += reward >= 1.0
    return right / len(problems)


@check("an RL loop (importance_sampling) raises the built-in task's reward")
def reinforcement():
    rng = random.Random(7)
    draw = lambda: (rng.randint(100, 999), rng.randint(10, 99))  # noqa: E731
    held_out = [draw() for _ in range(24)]
    # A fixed adapter seed: the rest of the loop is seeded already, so the run is the same
    # each time on one machine (a short RL run on a tiny model goes its own way with each
    # initialisation; see below).
    tc = training_client(rank=16, seed=1)
    sampler = ready(tc.save_weights_and_get_sampling_client())
    before = accuracy(sampler, held_out)
    rewards = []
    # 16 steps at 1e-3. This loop's calculator used to answer a*b whatever the call said:
    # the expression inside <calc> went unrewarded, drifted into noise, and now and then
    # the noise broke the format for good (every group all wrong: nothing left to learn
    # from; CI saw it three times, 1 adapter seed in 17 here). Evaluating the call, as the
    # plugin's trigger does, keeps the expression learned: the seed that collapsed now
    # ends at 0.94 mean reward (steps 15-16), 71% held out.
    steps = 16
    for step in range(steps):
        data = []
        step_rewards = []
        for p in range(8):
            a, b = draw()
            group = rollout(sampler, a, b, 8, 1.0, step * 100 + p)
            rs = [r for _, _, r in group]
            step_rewards += rs
            mean = sum(rs) / len(rs)
            for tokens, lps, r in group:
                adv = r - mean
                if adv == 0:
                    continue
                targets = tokens[1:]
                q = [lp if lp is not None else 0.0 for lp in lps[1:]]
                a_t = [adv if lp is not None else 0.0 for lp in lps[1:]]
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": targets, "logprobs": q, "advantages": a_t},
                    )
                )
        rewards.append(sum(step_rewards) / len(step_rewards))
        if step == steps - 1:
            # The trainer's log-probs of the tokens sampled with the current weights are
            # the sampler's (both through the trained output head adapter): the ratio is 1.
            out = tc.forward(data, "importance_sampling").result()
            gap = max(
                abs(lp - q)
                for d, o in zip(data, out.loss_fn_outputs)
                for lp, q, a in zip(o["logprobs"].tolist(), d.loss_fn_inputs["logprobs"].tolist(),
                                    d.loss_fn_inputs["advantages"].tolist())
                if a != 0.0
            )
            print(f"measured: largest |trainer - sampler| log-prob of a sampled token at step {steps}: {gap:.2e}")
            assert gap < 1e-3, gap
        if data:
            tc.forward_backward(data, "importance_sampling").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        sampler = ready(tc.save_weights_and_get_sampling_client())
    after = accuracy(sampler, held_out)
    print(
        f"measured: RL mean reward {sum(rewards[:2]) / 2:.2f} (steps 1-2) -> {sum(rewards[-2:]) / 2:.2f} "
        f"(steps {steps - 1}-{steps}); held-out greedy accuracy {before:.0%} -> {after:.0%}"
    )
    assert after >= before + 0.25, (before, after, rewards)


@check("two training clients at once never see each other's weights")
def isolation():
    tok = tokenizer()
    probe = tok.encode("Q: 12+30= 42.")
    probe_datum = types.Datum(
        model_input=types.ModelInput.from_ints(probe[:-1]),
        loss_fn_inputs={"target_tokens": probe[1:], "weights": [1.0] * (len(probe) - 1)},
    )
    base = ready(service.create_sampling_client(base_model=BASE))
    base_lp = base.compute_logprobs(types.ModelInput.from_ints(probe)).result()[1:]

    a = training_client(rank=4)
    b = training_client(rank=16, seed=3, train_unembed=False, train_attn=False)
    data_a = [sft_datum(p, x) for p, x in SFT[:3]]
    data_b = [sft_datum(p, " no.") for p, _ in SFT[3:]]
    errors = []

    def train(tc, data, loss, lr):
        try:
            for _ in range(6):
                tc.forward_backward(data, loss).result()
                tc.optim_step(types.AdamParams(learning_rate=lr)).result()
        except Exception as e:  # surfaced below
            errors.append(e)

    ta = threading.Thread(target=train, args=(a, data_a, "cross_entropy", 1e-2))
    tb = threading.Thread(target=train, args=(b, data_b, "cross_entropy", 5e-3))
    ta.start(), tb.start(), ta.join(), tb.join()
    assert not errors, errors
    lp_a = a.forward([probe_datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    lp_b = b.forward([probe_datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    # A third client, never trained, is the base model: no one's update leaked into it.
    c = training_client(rank=8)
    lp_c = c.forward([probe_datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert np.allclose(lp_c, base_lp, atol=1e-4), (lp_c, base_lp)
    assert not np.allclose(lp_a, lp_b, atol=1e-3)
    # Each client's sampler weights are its own: A's checkpoint samples as A forwards.
    sa = ready(a.save_weights_and_get_sampling_client())
    sa_lp = sa.compute_logprobs(types.ModelInput.from_ints(probe)).result()[1:]
    assert np.allclose(sa_lp, lp_a, atol=1e-4), (sa_lp, lp_a)
    last = sa.sample(
        prompt=types.ModelInput.from_ints(probe), num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
        prompt_logprobs_last_n=3,
    ).result().prompt_logprobs
    assert last[:-3] == [None] * (len(probe) - 3) and np.allclose(last[-3:], lp_a[-3:], atol=1e-4), last
    # Given tokens' log-probs at each prompt position, and draws there with theirs.
    n = len(probe) - 1
    asked = np.full((n, 2), -1, dtype=np.int64)
    asked[:, 0] = probe[1:]
    out = sa.sample(
        prompt=types.ModelInput.from_ints(probe), num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=1, seed=5),
        target_prompt_logprobs=types.TensorData(data=asked, dtype="int64", shape=[n, 2]),
        prompt_alt_tokens_k=3,
    ).result()
    got = np.array(out.target_prompt_logprobs.tolist())
    assert got.shape == (n, 2) and np.allclose(got[:, 0], lp_a, atol=1e-4) and np.all(got[:, 1] == 0.0), got
    alt_ids = np.array(out.prompt_alt_tokens.tokens.tolist())
    alt_lp = np.array(out.prompt_alt_tokens.logprobs.tolist())
    assert alt_ids.shape == (n, 3) and alt_lp.shape == (n, 3), (alt_ids.shape, alt_lp.shape)
    again = sa.sample(
        prompt=types.ModelInput.from_ints(probe), num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=1),
        target_prompt_logprobs=types.TensorData(data=alt_ids, dtype="int64", shape=[n, 3]),
    ).result()
    assert np.allclose(np.array(again.target_prompt_logprobs.tolist()), alt_lp, atol=1e-4), (alt_lp,)
    # B's data pulled B toward " no.", which A never saw.
    no = tok.encode(" no.")
    q = tok.encode("Q: 3+4=")
    d = types.Datum(
        model_input=types.ModelInput.from_ints((q + no)[:-1]),
        loss_fn_inputs={"target_tokens": (q + no)[1:], "weights": [0.0] * (len(q) - 1) + [1.0] * len(no)},
    )
    la = a.forward([d], "cross_entropy").result().metrics["loss:sum"]
    lb = b.forward([d], "cross_entropy").result().metrics["loss:sum"]
    print(f"measured: loss of B's answer under A {la:.2f}, under B {lb:.2f}")
    assert lb < 0.5 * la, (la, lb)


@check("a future outlives a step longer than a poll, and checkpoints resume exactly")
def slow_and_resume():
    tc = training_client(rank=8)
    tok = tokenizer()
    big = tok.encode("Q: 41+2= 43. " * 60)
    poll = int(os.environ.get("RLHOST_TINKER_POLL_MS", "20000")) / 1000

    def step(rows):
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(big[:-1]),
                loss_fn_inputs={"target_tokens": big[1:], "weights": [1.0] * (len(big) - 1)},
            )
            for _ in range(rows)
        ]
        t0 = time.time()
        result = tc.forward_backward(data, "cross_entropy").result()
        assert len(result.loss_fn_outputs) == rows
        return time.time() - t0

    # How long a step takes depends on the machine and on what else runs on it: a step
    # that came back within two polls is retried with the rows scaled to take about four
    # (the gradients add up; the optimizer step below takes them all).
    rows = int(os.environ.get("RLHOST_TINKER_SLOW_ROWS", "48"))
    took = step(rows)
    for _ in range(3):
        if took > 2 * poll:
            break
        rows = min(512, max(rows + 1, int(rows * 4 * poll / max(took, 1e-3))))
        took = step(rows)
    print(
        f"measured: a forward_backward of {rows} x {len(big) - 1} tokens answered after {took:.1f} s "
        f"({took / poll:.1f} polls' time)"
    )
    assert took > 2 * poll, "the step was not longer than two polls: lower RLHOST_TINKER_POLL_MS"
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    # save_state then load it with the optimizer: the next step equals the original's.
    small = [sft_datum(p, a) for p, a in SFT]
    path = tc.save_state("resume-check").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/resume-check"), path
    twin = ready(service.create_training_client_from_state_with_optimizer(path))
    for client in (tc, twin):
        client.forward_backward(small, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    la = tc.forward(small, "cross_entropy").result().metrics["loss:sum"]
    lb = twin.forward(small, "cross_entropy").result().metrics["loss:sum"]
    assert abs(la - lb) <= 1e-5 * max(1.0, abs(la)), (la, lb)


@check("bad requests are answered in the API's error shape, and the client goes on")
def bad_requests():
    try:
        ready(service.create_lora_training_client(base_model="Qwen/not-served", rank=4, train_unembed=False))
        raise AssertionError("an unknown base model was accepted")
    except tinker.BadRequestError as e:
        assert "not served here" in str(e), e
    tc = training_client(rank=4)
    bad_token = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 10**6]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    short_weights = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0]},
    )
    stray_input = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "logprobs": [0.0] * 3, "advantages": [1.0] * 3, "mask": np.ones(3, dtype=np.float32)},
    )
    for datum, loss, words in [
        (bad_token, "cross_entropy", ["datum 0", "1000000", "outside the vocabulary"]),
        (short_weights, "cross_entropy", ["datum 0", "weights", "shape [3]"]),
        (stray_input, "importance_sampling", ["datum 0", '"mask"']),
        (short_weights, "gspo", ["gspo", "cross_entropy"]),
    ]:
        try:
            tc.forward_backward([datum], loss).result()
            raise AssertionError(f"{words} was accepted")
        except tinker.RequestFailedError as e:
            assert all(w in str(e) for w in words), (words, str(e))
    sampler = ready(tc.save_weights_and_get_sampling_client())
    try:
        sampler.sample(
            prompt=types.ModelInput.from_ints([1, 10**6]),
            num_samples=1,
            sampling_params=types.SamplingParams(max_tokens=2),
        ).result()
        raise AssertionError("a prompt token outside the vocabulary was sampled")
    except tinker.RequestFailedError as e:
        assert "outside the vocabulary" in str(e), e
    # Issue 68: sizes, settings and keys a hostile or careless client sends are refused by
    # name, and none of them ends the server (the checks after these still run).
    try:
        ready(service.create_lora_training_client(base_model=BASE, rank=10**6))
        raise AssertionError("rank 10**6 was accepted")
    except tinker.BadRequestError as e:
        assert "rank must be 1 to 128" in str(e), e
    for kwargs, words in [
        ({"topk_prompt_logprobs": 10**9, "include_prompt_logprobs": True}, ["topk_prompt_logprobs", "1000000000"]),
        ({"topk_sample_logprobs": 10**9}, ["topk_sample_logprobs", "1000000000"]),
    ]:
        try:
            sampler.sample(
                prompt=types.ModelInput.from_ints([1, 2, 3]),
                num_samples=1,
                sampling_params=types.SamplingParams(max_tokens=2),
                **kwargs,
            ).result()
            raise AssertionError(f"{kwargs} was accepted")
        except tinker.RequestFailedError as e:
            assert all(w in str(e) for w in words), (words, str(e))
    try:
        sampler.sample(
            prompt=types.ModelInput.from_ints([1, 2, 3]),
            num_samples=1,
            sampling_params=types.SamplingParams(max_tokens=2, temperature=1e-40),
        ).result()
        raise AssertionError("temperature 1e-40 was accepted")
    except tinker.RequestFailedError as e:
        assert "temperature must be 0 (greedy) or at least 0.001" in str(e), e
    good = [sft_datum(*SFT[0])]
    for params, name in [
        (types.AdamParams(learning_rate=1e-3, beta1=1.0), "beta1"),
        (types.AdamParams(learning_rate=1e30), "learning_rate"),
        (types.AdamParams(learning_rate=1e-3, eps=0.0), "eps"),
        (types.AdamParams(learning_rate=1e-3, eps=float("nan")), "eps"),
        (types.AdamParams(learning_rate=1e-3, weight_decay=-1e6), "weight_decay"),
        (types.AdamParams(learning_rate=1e-3, grad_clip_norm=-1.0), "grad_clip_norm"),
    ]:
        tc.forward_backward(good, "cross_entropy").result()
        try:
            tc.optim_step(params).result()
            raise AssertionError(f"{params} was accepted")
        except tinker.RequestFailedError as e:
            assert f"adam_params.{name} must be" in str(e), (name, str(e))
    # A client without the server's key is turned away, in the API's error shape.
    try:
        stranger = tinker.ServiceClient(api_key="tml-not-the-key")
        stranger.get_server_capabilities()
        raise AssertionError("a client with the wrong key was served")
    except tinker.AuthenticationError as e:
        assert "Bearer" in str(e) or "key" in str(e), e
    # The client still trains after its refused requests.
    tc.forward_backward(good, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()


names = sys.argv[2:]
selected = [(n, f) for n, f in checks if not names or any(x in n for x in names)]
for name, f in selected:
    t0 = time.time()
    try:
        f()
    except Exception as e:
        print(f"FAILED: {name}: {type(e).__name__}: {e}")
        sys.exit(1)
    print(f"ok: {name} ({time.time() - t0:.1f} s)")
service.holder.close() if hasattr(service, "holder") else None
print(f"all {len(selected)} checks passed", flush=True)
# The checks are done: the SDK's background threads (each client's session heartbeat,
# the refused client's) are left to the OS. Their teardown is the SDK's business, and
# once, on CI, it turned the status non-zero after every check had passed.
sys.stderr.flush()
os._exit(0)
