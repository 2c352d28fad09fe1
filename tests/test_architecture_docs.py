"""The "how to add ..." blocks of ``docs/architecture.md`` run as written (the backend one: tests/engine)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from verl_trainer.algorithms import GRPO, GRPOConfig
from verl_trainer.core_algos.advantages import ADV_ESTIMATOR_REGISTRY, estimator_inputs
from verl_trainer.core_algos.losses import PPOLossConfig
from verl_trainer.core_algos.policy_losses import POLICY_LOSS_REGISTRY
from verl_trainer.data import schema
from verl_trainer.data.packing import make_batch
from verl_trainer.metrics import Metric

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def doc_block(heading: str) -> str:
    """The first python block after ``heading`` in ``docs/architecture.md``."""
    text = DOC.read_text()
    return re.search(r"```python\n(.*?)```", text[text.index(heading):], re.S).group(1)


def test_the_loss_and_estimator_recipe_registers_names_configs_use():
    exec(compile(doc_block("**A policy loss or an advantage estimator.**"), str(DOC), "exec"), {})
    try:
        assert estimator_inputs("my_adv") == {"index"}
        config = GRPOConfig(adv_estimator="my_adv")  # accepted by name, like the built-in ones
        assert PPOLossConfig(policy_loss="my_loss").policy_loss == "my_loss"
        batch = make_batch([[4, 5]] * 4, [[6], [6, 7], [6], [6, 7, 8]], uids=[0, 0, 1, 1])
        mask = batch[schema.RESPONSE_MASK]
        rewards = torch.zeros(mask.shape)
        rewards[torch.arange(4), mask.float().cumsum(-1).argmax(-1)] = torch.tensor([1.0, 0.0, 0.5, 0.5])
        batch[schema.TOKEN_LEVEL_REWARDS] = rewards
        GRPO(config).compute_advantages(batch, torch.zeros(4), {})
        per_sample = (batch[schema.ADVANTAGES] * mask).sum(-1) / mask.sum(-1)
        torch.testing.assert_close(per_sample, torch.tensor([0.5, -0.5, 0.0, 0.0]))
        log_prob = torch.randn(mask.shape, requires_grad=True)
        advantages = batch[schema.ADVANTAGES]
        loss, metrics = POLICY_LOSS_REGISTRY["my_loss"](log_prob.detach(), log_prob, advantages, mask)
        loss.backward()
        assert torch.isfinite(loss) and isinstance(metrics["actor/my_metric"], Metric)
        assert log_prob.grad is not None and log_prob.grad[~mask.bool()].abs().sum() == 0
    finally:
        del ADV_ESTIMATOR_REGISTRY["my_adv"], POLICY_LOSS_REGISTRY["my_loss"]


ROOT = DOC.parents[1]


def test_the_architecture_page_is_a_map_not_a_log():
    """No dated entries, commit hashes or branch names; a layer row names its paths, not their story."""
    text = DOC.read_text()
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "dated history belongs in git or docs/benchmarks.md"
    assert not re.search(r"`[0-9a-f]{7,40}`|\bwt-[a-z0-9]+", text)
    layers = text[text.index("## Layers"):text.index("## One RL step")]
    rows = [row for row in layers.splitlines() if row.startswith("| ") and not row.startswith("| layer |")]
    assert len(rows) >= 10
    for row in rows:
        assert len(row.split(" | ")[1]) <= 80, f"describe the layer in a few words: {row[:80]}"


def test_every_design_citation_names_a_section_of_docs_design_md():
    sections = set(re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "design.md").read_text(), re.M))
    cited = []
    folders = ("verl_trainer", "callbacks", "recipes", "docs", "bench", "scripts", "tests")
    for path in [ROOT / "setup.py", ROOT / "README.md", *(p for f in folders for p in (ROOT / f).rglob("*"))]:
        if path.suffix in (".py", ".md") and path.is_file():
            for start, end in re.findall(r"design\.md\)? §(\d+)(?:[–-](\d+))?", path.read_text()):
                cited += [(path, start), *([(path, end)] if end else [])]
    assert cited, "the code cites docs/design.md"
    assert [(str(p.relative_to(ROOT)), s) for p, s in cited if s not in sections] == []
