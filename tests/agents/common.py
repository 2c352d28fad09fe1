"""A tiny policy that has learned to call the calculator: built from a config and warm-started in seconds.

The character tokenizer's chat template renders ``role: content`` lines, ``tool`` messages included, so
the tool-use trace of ``"a+b="`` is::

    user: a+b=
    assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "a+b"}}</tool_call><eos>
    tool: <a+b>
    assistant: <a+b><eos>

:func:`tool_policy` trains a randomly initialised 2-layer model on a few such traces (the loss on the
assistant tokens only), so greedy decoding makes the tool call: the multi-turn tests then exercise real
tool calls sampled by a real model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from verl_trainer.agents import Environment, ObservationEncoder, StepResult
from verl_trainer.data import schema
from verl_trainer.data.prompts import PromptDataset, save_rows, to_verl_row
from verl_trainer.models.loading import load_causal_lm, load_tokenizer
from verl_trainer.models.tiny import make_tiny_model
from verl_trainer.rollout import AGENT_INFO

QUESTIONS = ("2+3=", "4+4=", "7+1=", "5+2=")


def call_text(expression: str) -> str:
    """The Hermes tool call of the calculator on ``expression``."""
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + \
        "</tool_call>"


def trace(tokenizer, question: str) -> tuple[list[int], list[int], list[int]]:
    """``(prompt ids, response ids, response loss mask)`` of the tool-use trace of ``question``."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                           add_generation_prompt=True)
    answer = str(eval(question[:-1]))  # noqa: S307 - the test's own fixed questions
    eos = [tokenizer.eos_token_id]
    first = tokenizer.encode(call_text(question[:-1]), add_special_tokens=False) + eos
    observation = ObservationEncoder(tokenizer, eos).encode([{"role": "tool", "content": answer}])
    second = tokenizer.encode(answer, add_special_tokens=False) + eos
    response = first + observation + second
    mask = [1] * len(first) + [0] * len(observation) + [1] * len(second)
    return tokenizer.encode(prompt, add_special_tokens=False), response, mask


_TRAINED: dict[tuple, dict[str, bytes]] = {}
"""The files of each trained :func:`tool_policy`, by its arguments: a process trains each shape once."""


def tool_policy(path: str | Path, steps: int = 150, **shape: int) -> str:
    """A 1-layer qwen2 (hidden 32) trained to call the calculator on :data:`QUESTIONS`, saved to ``path``.

    ``shape`` overrides :func:`~verl_trainer.models.tiny.make_tiny_model` fields (the vLLM tests need a
    head size of at least 32: ``hidden_size=64, num_attention_heads=2``). The training is deterministic,
    so a second call with the same arguments writes the first one's files (training takes seconds).
    """
    key = (steps, tuple(sorted(shape.items())))
    if key not in _TRAINED:
        _train_tool_policy(path, steps, **shape)
        root = Path(path)
        _TRAINED[key] = {str(f.relative_to(root)): f.read_bytes() for f in root.rglob("*") if f.is_file()}
    else:
        for name, data in _TRAINED[key].items():
            (Path(path) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(path) / name).write_bytes(data)
    return str(path)


def _train_tool_policy(path: str | Path, steps: int, **shape: int) -> None:
    make_tiny_model(path, **{"arch": "qwen2", "hidden_size": 32, "num_hidden_layers": 1, "seed": 3, **shape})
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path)
    rows = [trace(tokenizer, q) for q in QUESTIONS]
    width = max(len(p) + len(r) for p, r, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (p, r, m) in enumerate(rows):
        seq = torch.tensor(p + r)
        ids[i, : len(seq)] = seq
        target = torch.tensor([t if k else -100 for t, k in zip(r, m)])
        labels[i, len(p): len(p) + len(r)] = target
    torch.manual_seed(0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
    model.save_pretrained(path)


def prompts(model: str, questions: tuple[str, ...] = QUESTIONS) -> PromptDataset:
    """The arithmetic questions as a prompt dataset (ground truth: the answer)."""
    rows = [to_verl_row([{"role": "user", "content": q}], str(eval(q[:-1])), "arithmetic")  # noqa: S307
            for q in questions]
    return PromptDataset(rows, load_tokenizer(model))


def record_turns(rollout) -> list:
    """Keep what the backend sampled, call by call (the real call runs); ``del
    rollout.generate_token_ids`` stops recording."""
    calls = []
    generate = rollout.generate_token_ids

    def recording(prompts, config, seeds):
        out = generate(prompts, config, seeds)
        calls.append((prompts, out[0]))
        return out

    rollout.generate_token_ids = recording
    return calls


def response(batch, row: int) -> tuple[list[int], list[float], list[float]]:
    """Row ``row``'s response: ``(ids, loss mask, rollout log-probs)``."""
    start, length = int(batch[schema.PROMPT_LEN][row]), int(batch[schema.RESPONSE_LEN][row])
    part = slice(start, start + length)
    return (batch[schema.INPUT_IDS][row, part].tolist(), batch[schema.LOSS_MASK][row, part].tolist(),
            batch[schema.ROLLOUT_LOG_PROBS][row, part].tolist())


def sampled_turns(batch, calls: list, eos_token_ids) -> dict[int, list[int]]:
    """Each row's model turns as the backend returned them (cut at eos and the budget), from ``calls``.

    Also checks that every call continued its row's own history (prompt and response so far).
    """
    eos = set(eos_token_ids)
    rows = range(batch.batch_size[0])
    turns = [batch[AGENT_INFO][r]["turns"] for r in rows]
    sampled: dict[int, list[int]] = {r: [] for r in rows}
    for t, (contexts, outs) in enumerate(calls):
        active = [r for r in rows if turns[r] > t]  # the loop asks for the unfinished rows, in order
        assert len(active) == len(outs)
        for r, context, out in zip(active, contexts, outs):
            ids, _, _ = response(batch, r)
            prompt_len = int(batch[schema.PROMPT_LEN][r])
            assert context == batch[schema.INPUT_IDS][r, : len(context)].tolist()  # this row's history
            cut = next((k + 1 for k, tok in enumerate(out) if tok in eos), len(out))
            sampled[r].extend(out[:cut][: len(ids) - (len(context) - prompt_len)])
    return sampled


class Again(Environment):
    """Answers the first message with "no"; the second ends the episode with reward 1."""

    def reset(self, row):
        self.seen = 0

    def step(self, message):
        self.seen += 1
        return StepResult("no", 1.0 if self.seen == 2 else 0.0, self.seen == 2)


def check_again_trajectories(batch, calls: list, tokenizer, eos_token_ids) -> None:
    """A multi-turn batch with :class:`Again`: trained ids are the sampled ids, observations are ``no``
    (mask 0), rewards follow the turns, and some row's sampled ids differ from decode-then-encode."""
    sampled = sampled_turns(batch, calls, eos_token_ids)
    eos = set(eos_token_ids)
    observation = ObservationEncoder(tokenizer, eos_token_ids).encode([{"role": "user", "content": "no"}])
    rows = range(batch.batch_size[0])
    turns = [batch[AGENT_INFO][r]["turns"] for r in rows]
    differs = 0
    finished = []  # the row's last turn ended with eos (a whole message the environment answered)
    for row in rows:
        ids, mask, _ = response(batch, row)
        trained = [t for t, m in zip(ids, mask) if m == 1]
        assert trained == sampled[row]
        finished.append(trained[-1] in eos)
        observed = [t for t, m in zip(ids, mask) if m == 0]
        assert observed == (observation * (turns[row] - 1))[: len(observed)]
        body = [t for t in trained if t not in eos]  # sampled special tokens (pad, bos, unk) amid the text
        text = tokenizer.decode(body, skip_special_tokens=True)
        differs += tokenizer.encode(text, add_special_tokens=False) != body
    assert differs > 0  # re-tokenising the decoded text would have trained other ids
    rewards = [i["reward"] for i in batch[AGENT_INFO]]
    assert rewards == [1.0 if t == 2 and f else 0.0 for t, f in zip(turns, finished)]
    assert 1.0 in rewards  # some rows went through two turns


def tool_assets(base: Path, val_rows: int, **shape: int) -> Path:
    """``base/model`` (:func:`tool_policy` of ``shape``), ``base/train.jsonl`` (:data:`QUESTIONS`) and
    ``base/val.jsonl`` (the first ``val_rows``)."""
    tool_policy(base / "model", **shape)
    rows = [to_verl_row([{"role": "user", "content": q}], str(eval(q[:-1])), "arithmetic")  # noqa: S307
            for q in QUESTIONS]
    save_rows(rows, base / "train.jsonl")
    save_rows(rows[:val_rows], base / "val.jsonl")
    return base


def fit_grpo_tools(base: str, root: str, dynamic: bool, steps: int, extra: tuple[str, ...] = ()) -> dict:
    """GRPO with the calculator for ``steps`` steps on :func:`tool_assets` ``base`` (run on spawned ranks).

    Every rollout batch is checked (observations masked, 0 rollout log-prob there). ``extra``: more
    recipe overrides (e.g. the vLLM rollout).

    Returns:
        ``rows`` (per step the ``(ids, mask)`` of each sample), ``metrics`` (per step), ``params`` (rank 0's
        final weights) and ``val`` (validation metrics after the fit).
    """
    from verl_trainer import Trainer
    from verl_trainer.algorithms import GRPO, PromptDataModule
    from verl_trainer.callbacks import Callback
    from verl_trainer.data import schema
    from verl_trainer.models.loading import load_tokenizer
    from verl_trainer.recipe_config import GRPORecipeConfig, load_config
    from verl_trainer.rollout import AGENT_INFO

    class Record(Callback):
        def __init__(self) -> None:
            self.rows: list[list[tuple]] = []
            self.metrics: list[dict[str, float]] = []

        def on_rollout_end(self, trainer, module, batch) -> None:
            step = []
            for i in range(batch.batch_size[0]):
                n, p = int(batch[schema.SEQ_LEN][i]), int(batch[schema.PROMPT_LEN][i])
                mask = batch[schema.LOSS_MASK][i]
                info = batch[AGENT_INFO][i]
                assert int((mask[p:n] == 0).sum()) == info["observation_tokens"]  # observations masked
                assert float(mask[:p].sum()) == 0.0 and float(mask[n:].sum()) == 0.0
                assert torch.equal(batch[schema.ROLLOUT_LOG_PROBS][i][mask == 0],
                                   torch.zeros(int((mask == 0).sum())))
                step.append((tuple(batch[schema.INPUT_IDS][i, :n].tolist()), tuple(mask[:n].tolist())))
            self.rows.append(step)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.metrics.append(dict(trainer.callback_metrics))

    overrides = [
        f"algorithm.model_path={base}/model", f"data.train_files={base}/train.jsonl",
        f"data.val_files={base}/val.jsonl",
        "data.train_batch_size=4", "data.max_prompt_length=32", "algorithm.rollout.n=2",
        "algorithm.rollout.max_new_tokens=120", "algorithm.rollout.temperature=1.0",
        "algorithm.actor.ppo_mini_batch_size=4", "algorithm.actor.optim.lr=1e-4",
        "algorithm.rollout.multi_turn.enable=true", "algorithm.rollout.multi_turn.max_turns=2",
        "algorithm.rollout.multi_turn.tools=[verl_trainer.agents.builtin_tools:calculator]",
        "algorithm.reward.name=math", "algorithm.rollout_correction.level=token",
    ]
    overrides += list(extra)
    if dynamic:
        overrides += ["algorithm.actor.engine.use_dynamic_bsz=true",
                      "algorithm.actor.engine.max_token_len_per_gpu=200"]
    cfg = load_config(GRPORecipeConfig, Path(__file__).resolve().parents[2] / "configs" / "grpo.yaml",
                      overrides)
    record = Record()
    trainer = Trainer(devices=dist.get_world_size(), max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, default_root_dir=root,
                      val_check_interval=None, callbacks=[record], seed=7)
    module = GRPO(cfg.algorithm)
    data = PromptDataModule(cfg.data, load_tokenizer(f"{base}/model"))
    trainer.fit(module, datamodule=data)
    params = {n: t.detach().clone() for n, t in module.actor.get_per_tensor_param()}
    rank0 = dist.get_rank() == 0
    val = trainer.validate(module, datamodule=data)[0]
    return {"rows": record.rows, "metrics": record.metrics, "params": params if rank0 else None, "val": val}
