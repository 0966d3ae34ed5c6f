"""suite align's pieces against plain references: the DPO and SimPO losses on hand-made
log-probabilities (values and gradients, label smoothing and the margin included), the reference
model's log-probabilities against a plain forward (a frozen copy, and a LoRA policy with its adapters
off), the pairs' targets (the response tokens only) and their refusals in one line."""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch

import suite.align.sampled_pairs as sampled_pairs
from suite.align.checks import check_align, check_align_layout
from suite.align.logps import next_token_logps, target_logps
from suite.align.pairs import build_pairs, read_pairs, task_pairs
from suite.align.preference import DPO, SimPO, check_preference
from suite.align.reference import AdapterOffReference, FrozenReference
from suite.align.rollout import rollout_generator, sample_group
from suite.align.sampled_pairs import policy_sampler, sampled_task_pairs
from suite.config.compose import compose_config, to_object
from suite.config.errors import ConfigError
from suite.config.schema import GenerateConfig, ModelConfig
from suite.data import load_tokenizer
from suite.data.batch import IGNORE_INDEX
from suite.data.chat import CHATML_TEMPLATE, prompt_ids
from suite.data.tasks import generate_task, get_task, score
from suite.frozen_model import FrozenModel
from suite.models import build_model, materialize
from suite.models.lora import apply_lora, init_lora, lora_parameters

# [pairs, 2] summed response log-probabilities (chosen, rejected) and response lengths, by hand
POLICY = [[-3.0, -5.5], [-7.25, -2.0], [-1.5, -1.5], [-10.0, -4.0]]
REFERENCE = [[-3.5, -5.0], [-6.0, -2.5], [-1.0, -2.0], [-9.0, -6.0]]
LENGTHS = [[3, 5], [4, 2], [1, 3], [8, 2]]


def plain_sigmoid_loss(z: torch.Tensor, ls: float) -> torch.Tensor:
    """-(1 - ls) log sigmoid(z) - ls log sigmoid(-z), written out without logsigmoid."""
    return -(1 - ls) * torch.log(1 / (1 + torch.exp(-z))) - ls * torch.log(1 / (1 + torch.exp(z)))


@pytest.mark.parametrize(("label_smoothing", "rpo_alpha"), [(0.0, 0.0), (0.2, 0.0), (0.1, 0.7)])
def test_dpo_loss_and_gradient_equal_a_plain_reference(label_smoothing, rpo_alpha):
    """rpo_alpha adds the chosen response's NLL per token (RPO): fails if it is summed over the tokens,
    taken on the rejected response, or added with the wrong sign."""
    beta = 0.3
    policy = torch.tensor(POLICY, dtype=torch.float64, requires_grad=True)
    reference = torch.tensor(REFERENCE, dtype=torch.float64)
    dpo = DPO(beta, label_smoothing, rpo_alpha)
    losses, chosen, rejected = dpo(policy, torch.tensor(LENGTHS), reference)
    losses.sum().backward()
    got = policy.grad.clone()

    plain = torch.tensor(POLICY, dtype=torch.float64, requires_grad=True)
    expected = []
    for i in range(len(POLICY)):  # one pair at a time, the paper's formula
        pc, pr = plain[i, 0], plain[i, 1]
        rc, rr = REFERENCE[i]
        z = beta * ((pc - rc) - (pr - rr))
        nll_per_token = -pc / LENGTHS[i][0]
        expected.append(plain_sigmoid_loss(z, label_smoothing) + rpo_alpha * nll_per_token)
    torch.stack(expected).sum().backward()
    assert torch.allclose(losses, torch.stack(expected).detach(), atol=1e-12)
    assert torch.allclose(got, plain.grad, atol=1e-12)
    assert torch.allclose(
        chosen, beta * (torch.tensor(POLICY)[:, 0] - torch.tensor(REFERENCE)[:, 0]).double()
    )
    assert torch.allclose(
        rejected, beta * (torch.tensor(POLICY)[:, 1] - torch.tensor(REFERENCE)[:, 1]).double()
    )
    # the same log-probabilities as the reference's: every pair's loss is log 2, whatever the smoothing
    same, _, _ = DPO(beta, label_smoothing)(reference, torch.tensor(LENGTHS), reference)
    assert torch.allclose(same, torch.full((4,), math.log(2), dtype=torch.float64))


@pytest.mark.parametrize(("gamma", "label_smoothing"), [(0.0, 0.0), (0.8, 0.0), (0.8, 0.1)])
def test_simpo_loss_and_gradient_equal_a_plain_reference(gamma, label_smoothing):
    beta = 2.0
    policy = torch.tensor(POLICY, dtype=torch.float64, requires_grad=True)
    losses, chosen, rejected = SimPO(beta, gamma, label_smoothing)(policy, torch.tensor(LENGTHS), None)
    losses.sum().backward()
    got = policy.grad.clone()

    plain = torch.tensor(POLICY, dtype=torch.float64, requires_grad=True)
    expected = []
    for i in range(len(POLICY)):
        (lc, lr) = LENGTHS[i]
        z = beta * plain[i, 0] / lc - beta * plain[i, 1] / lr - gamma
        expected.append(plain_sigmoid_loss(z, label_smoothing))
    torch.stack(expected).sum().backward()
    assert torch.allclose(losses, torch.stack(expected).detach(), atol=1e-12)
    assert torch.allclose(got, plain.grad, atol=1e-12)
    assert torch.allclose(chosen, beta * torch.tensor(POLICY)[:, 0].double() / torch.tensor(LENGTHS)[:, 0])
    assert torch.allclose(rejected, beta * torch.tensor(POLICY)[:, 1].double() / torch.tensor(LENGTHS)[:, 1])


def tiny_model() -> torch.nn.Module:
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, vocab_size=97, max_seq_len=16)
    return materialize(build_model(cfg), "cpu", seed=3).eval()


TOKENS = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(0))


def plain_next_token_logps(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens[:, t + 1]) from the model's plain logits; 0 at the last position."""
    with torch.no_grad():
        logp = model(tokens).double().log_softmax(-1)
    out = torch.zeros(tokens.shape, dtype=torch.float64)
    out[:, :-1] = logp[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return out


def test_reference_logps_equal_a_plain_forward():
    model = tiny_model()
    frozen = FrozenReference(FrozenModel(model, None, torch.device("cpu"), None))
    got = frozen.token_logps(TOKENS, {})
    assert got.dtype == torch.float32 and got.shape == TOKENS.shape
    assert torch.allclose(got.double(), plain_next_token_logps(model, TOKENS), atol=1e-5)
    assert bool((got[:, -1] == 0).all())


def test_lora_reference_is_the_base_with_adapters_off():
    base = tiny_model()
    policy = tiny_model()
    apply_lora(policy, rank=4, alpha=8.0)
    init_lora(policy, seed=0)
    with torch.no_grad():  # adapters that change the output (B starts at zero)
        for name, param in lora_parameters(policy).items():
            if ".lora_b." in name:
                param.normal_(0, 0.5)
    policy.train()
    adapted = plain_next_token_logps(policy.eval(), TOKENS)
    policy.train()
    got = AdapterOffReference(policy).token_logps(TOKENS, {})
    assert policy.training  # the reference runs in eval mode and hands the policy back in train mode
    assert torch.allclose(got.double(), plain_next_token_logps(base, TOKENS), atol=1e-5)
    assert not torch.allclose(adapted, plain_next_token_logps(base, TOKENS), atol=1e-3)
    # the adapters are back on afterwards
    assert torch.allclose(plain_next_token_logps(policy.eval(), TOKENS), adapted, atol=1e-6)


def test_target_logps_are_next_token_logps_at_the_targets():
    model = tiny_model()
    hidden = model(TOKENS, head=lambda h, w: (h, w))
    targets = torch.full_like(TOKENS, IGNORE_INDEX)
    targets[:, 3:7] = TOKENS[:, 4:8]
    scored = target_logps(*hidden, targets)
    every = next_token_logps(*hidden, TOKENS)
    assert torch.equal(scored[:, 3:7], every[:, 3:7])
    assert bool((scored[:, :3] == 0).all()) and bool((scored[:, 7:] == 0).all())


@pytest.fixture(scope="module")
def tokenizer(tiny_data):
    tok = load_tokenizer(tiny_data)
    tok.chat_template = CHATML_TEMPLATE
    return tok


def test_pairs_target_the_response_tokens_only(tokenizer):
    rows = [
        ("a.jsonl line 1", {"prompt": "Reverse 123.", "chosen": "321", "rejected": "312"}),
        (
            "a.jsonl line 2",
            {
                "prompt": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "yes"},
                    {"role": "user", "content": "sum 1 2"},
                ],
                "chosen": [{"role": "assistant", "content": "3"}],
                "rejected": [{"role": "assistant", "content": "4"}],
            },
        ),
        (  # implicit prompt: two conversations sharing their first turn
            "a.jsonl line 3",
            {
                "chosen": [{"role": "user", "content": "sum 2 2"}, {"role": "assistant", "content": "4"}],
                "rejected": [{"role": "user", "content": "sum 2 2"}, {"role": "assistant", "content": "5"}],
            },
        ),
    ]
    pairs = build_pairs(rows, tokenizer, CHATML_TEMPLATE, 96)
    assert len(pairs) == 3
    batch = pairs.batch([0, 1, 2])
    assert batch.num_targets == 3 and batch.tokens.shape == (6, 96)
    eos = tokenizer.eos_token
    for row, answer in enumerate(["321", "312", "3", "4", "4", "5"]):
        labels = batch.labels[row]
        scored = labels[labels != IGNORE_INDEX].tolist()
        assert tokenizer.decode(scored) == answer + eos, (row, tokenizer.decode(scored))
        # each target is the next input token (the reference scores those): the last one included
        at = (labels != IGNORE_INDEX).nonzero().flatten()
        assert torch.equal(batch.tokens[row, at + 1], labels[at])


@pytest.mark.parametrize(
    ("row", "words"),
    [
        ({"prompt": "p", "chosen": "a"}, "field 'rejected' is missing"),
        ({"chosen": "a", "rejected": "b"}, "field 'prompt' is missing"),
        ({"prompt": "p", "chosen": "same", "rejected": "same"}, "'chosen' and 'rejected' are the same"),
        ({"prompt": "p", "chosen": " ", "rejected": "b"}, "field 'chosen' is an empty response"),
        ({"prompt": "p", "chosen": "a", "rejected": "b " * 100}, "field 'rejected' makes a conversation of"),
    ],
    ids=["missing-field", "missing-prompt", "chosen-equals-rejected", "empty-response", "too-long"],
)
def test_bad_pairs_are_one_line_naming_file_row_and_field(tmp_path, tokenizer, row, words):
    path = tmp_path / "pairs.jsonl"
    good = {"prompt": "Reverse 123.", "chosen": "321", "rejected": "312"}
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ConfigError) as err:
        read_pairs(str(path), tokenizer, CHATML_TEMPLATE, 96)
    message = str(err.value)
    assert "\n" not in message and words in message and f"{path} line 2" in message, message


def test_task_pairs_are_right_against_wrong():
    pairs = task_pairs("reverse-3", 20)
    assert len(pairs) == 20 and all(p["chosen"] != p["rejected"] for p in pairs)
    assert all(p["chosen"] == p["prompt"].split()[-1].rstrip(".")[::-1] for p in pairs)


def test_task_pairs_leave_the_held_out_questions_out():
    from suite.data.tasks import generate_task

    _, held_out = generate_task("reverse-3", 50, 30, seed=0)
    asked = {m[0]["content"] for m in held_out}
    pairs = task_pairs("reverse-3", 50, seed=0, held_out=30)
    assert len(pairs) == 50 and not asked & {p["prompt"] for p in pairs}


def test_sampled_pairs_reject_the_most_frequent_wrong_sample_never_a_right_one():
    asked = []
    answers = {m[0]["content"]: m[1]["content"] for m in generate_task("addition-2", 30, 10, seed=0)[0]}

    def sample_one(number: int, messages: list[dict]) -> list[str]:
        asked.append((number, messages))
        answer = answers[messages[-1]["content"]]
        right = [answer, f" {answer} "]  # right after stripping: never a rejected answer
        return [right, [*right, *right, "7x", "99", "99"], [*right, *right]][number % 3]

    def sample(numbers: list[int], conversations: list[list[dict]]) -> list[list[str]]:
        return [sample_one(n, m) for n, m in zip(numbers, conversations)]

    pairs, fallbacks = sampled_task_pairs("addition-2", 30, seed=0, held_out=10, sample=sample)
    swapped = task_pairs("addition-2", 30, seed=0, held_out=10)
    assert [n for n, _ in asked] == list(range(30))  # every question, numbered in order
    assert all(m[-1]["role"] == "user" for _, m in asked)  # the prompt only, not its answer
    assert [p["prompt"] for p in pairs] == [p["prompt"] for p in swapped]
    assert [p["chosen"] for p in pairs] == [p["chosen"] for p in swapped]
    assert fallbacks == 20
    for i, (pair, plain) in enumerate(zip(pairs, swapped)):
        assert pair["rejected"] == ("99" if i % 3 == 1 else plain["rejected"]), (i, pair)


def test_policy_sampler_answers_are_the_models_own(tokenizer):
    """At a temperature near 0 the sampled answers are the model's greedy answers, decoded by a plain
    forward loop here: samples from another model or another prompt would differ."""
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, vocab_size=len(tokenizer), max_seq_len=64)
    model = materialize(build_model(cfg, "meta"), torch.device("cpu"), 3)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4)  # peaked distributions: the greedy answer is far ahead
    sample = policy_sampler(model, tokenizer, CHATML_TEMPLATE, "addition-2", 2, 1e-4, seed=0)
    pairs, _ = sampled_task_pairs("addition-2", 1, seed=0, held_out=0, sample=sample)
    rows, _ = generate_task("addition-2", 1, 0, seed=0)
    new = get_task("addition-2").max_answer_chars + 2
    for number, (pair, messages) in enumerate(zip(pairs, rows)):
        ids = prompt_ids(tokenizer, messages, CHATML_TEMPLATE)
        prompt_len = len(ids)
        with torch.no_grad():
            for _ in range(new):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
                if ids[-1] == tokenizer.eos_token_id:
                    ids.pop()
                    break
        greedy = tokenizer.decode(ids[prompt_len:], skip_special_tokens=False)
        assert sample([number], [messages[:-1]]) == [[greedy, greedy]]
        assert pair["rejected"] == greedy or score("addition-2", greedy, pair["chosen"])


def test_batched_pair_sampling_draws_what_each_question_draws_alone(tokenizer, monkeypatch):
    """Questions decoded together (several calls, prompts of several lengths) get the answers GRPO's
    one-prompt sampler draws for each alone from its (seed, question number) generator, at temperature
    1. Fails if one generator serves the batch, generators go to the wrong questions, the rows of
    different questions mix, or answers come back in another order than the questions'."""
    monkeypatch.setattr(sampled_pairs, "ROWS_PER_CALL", 6)  # 2 questions of 3 answers per call
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, vocab_size=len(tokenizer), max_seq_len=64)
    model = materialize(build_model(cfg, "meta"), torch.device("cpu"), 5).eval()
    rows, _ = generate_task("addition-2", 6, 0, seed=1)
    asked = ["What is 7 + 9?", "What is 123 + 4?", "What is 5 + 60?"]  # other lengths than addition-2's
    prompts = [m[:-1] for m in rows] + [[{"role": "user", "content": q}] for q in asked]
    numbers = [4, 0, 7, 1, 8, 2, 5, 3, 6]  # any numbering: each question's generator follows its number
    got = policy_sampler(model, tokenizer, CHATML_TEMPLATE, "addition-2", 3, 1.0, seed=11)(numbers, prompts)
    lengths = {len(prompt_ids(tokenizer, m, CHATML_TEMPLATE)) for m in prompts}
    assert len(lengths) > 1  # prompts of several lengths, so several batches
    new = get_task("addition-2").max_answer_chars + 2
    sampling = GenerateConfig(temperature=1.0, top_k=None, top_p=1.0)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    alone = []
    for number, messages in zip(numbers, prompts):
        ids = prompt_ids(tokenizer, messages, CHATML_TEMPLATE)
        group = sample_group(
            model, ids, 3, new, sampling, rollout_generator(11, number, torch.device("cpu")),
            tokenizer.eos_token_id, pad, kv=True,
        )  # fmt: skip
        alone.append([tokenizer.decode(c, skip_special_tokens=False) for c in group.completions])
    assert got == alone
    assert len({a for answers in alone for a in answers}) > 3  # random answers: a mix-up would show


@pytest.fixture(scope="module")
def align_configs() -> dict:
    """Each method's composed config, once (composing costs ~0.4 s)."""

    return {
        m: to_object(compose_config([f"align.method={m}", "model.init_from=runs/x"]))
        for m in ("dpo", "simpo", "grpo")
    }


@pytest.mark.parametrize("name", ["tp", "pp", "cp", "ep"])
def test_layouts_align_does_not_run_are_refused_naming_the_key_value_and_what_works(name, align_configs):
    """Each method, set by number (before the base model is read) and as 'auto' resolved to 2 (the
    layout check). Fails if a key is left to the generic layout checks (pp=2 got advice about
    micro-batches, ep=2 about data-parallel ranks) or to the ranks."""
    said = f"parallel.{name}=2: suite align runs under data parallelism and sharding only"
    works = f"(parallel.dp, parallel.sharding) for now; parallel.{name}=1"
    for method, composed in align_configs.items():
        cfg = copy.deepcopy(composed)
        setattr(cfg.parallel, name, 2)
        with pytest.raises(ConfigError) as caught:
            check_align(cfg)
        assert said in str(caught.value) and str(caught.value).endswith(works), (method, caught.value)
        setattr(cfg.parallel, name, "auto")
        check_align(cfg)  # 'auto' is settled with the world: the layout check below
        dims = SimpleNamespace(**({"data_parallel_size": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1} | {name: 2}))
        with pytest.raises(ConfigError, match=f"parallel.{name}=2: suite align runs"):
            check_align_layout(cfg, dims)


def test_rpo_alpha_is_refused_in_one_line_when_negative_or_without_dpo(align_configs):
    for method, value in (("dpo", -0.5), ("simpo", 1.0)):
        cfg = copy.deepcopy(align_configs[method])
        cfg.align.data, cfg.align.rpo_alpha = "task:addition-2", value
        with pytest.raises(ConfigError, match=f"align.rpo_alpha={value} with align.method={method}"):
            check_preference(cfg)
    cfg = copy.deepcopy(align_configs["dpo"])
    cfg.align.data, cfg.align.rpo_alpha = "task:addition-2", 1.0
    check_preference(cfg)
