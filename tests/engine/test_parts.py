"""Single-process tests of the engine parts: configs, LR schedule, mode contexts, heads, denominators."""

from __future__ import annotations

import math

import pytest
import torch

from verl_trainer.core_algos.aggregation import compute_global_batch_info
from verl_trainer.data.packing import pack_batch
from verl_trainer.engine import BaseEngine, EngineConfig, OptimConfig
from verl_trainer.engine.heads import next_token_log_probs_and_entropy, shift_to_targets
from verl_trainer.engine.optim import WarmupSchedule, build_lr_scheduler
from verl_trainer.engine.optimizers import build_optimizer

from .common import padded_log_probs, random_batch


# ---------------------------------------------------------------------------------------- configs
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr_scheduler": "step"}, r"lr_scheduler='step'; choose one of \('constant', 'cosine', 'linear'\)"),
        ({"lr_scheduler": "cosine"}, "needs total_training_steps > warmup_steps"),
        ({"lr_scheduler": "cosine", "total_training_steps": 5, "warmup_steps": 5}, "total_training_steps"),
        ({"betas": (0.9, 1.5)}, "betas must be two numbers"),
        ({"min_lr_ratio": 2.0}, "min_lr_ratio"),
        ({"eps": 0.0}, "eps must be > 0"),
    ],
)
def test_optim_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OptimConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"micro_batch_size_per_gpu": 0}, "micro_batch_size_per_gpu must be >= 1, got 0"),
        ({"use_dynamic_bsz": True}, "needs max_token_len_per_gpu > 0 .*, got None; set EngineConfig"),
        ({"use_dynamic_bsz": True, "max_token_len_per_gpu": "auto"}, "got 'auto'; .*no default or 'auto'"),
        ({"use_dynamic_bsz": True, "max_token_len_per_gpu": 0}, "needs max_token_len_per_gpu > 0 .*, got 0"),
        ({"param_dtype": "fp8"}, r"EngineConfig.param_dtype: unknown dtype 'fp8'"),
        ({"zero_stage": 4}, "zero_stage must be 1, 2 or 3"),
        ({"ulysses_sequence_parallel_size": 0}, "ulysses_sequence_parallel_size must be >= 1"),
    ],
)
def test_engine_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_config_replace_validates_and_dp_size():
    cfg = EngineConfig(ulysses_sequence_parallel_size=2)
    assert cfg.dp_size(8) == 4
    with pytest.raises(ValueError, match="world_size=6 is not divisible"):
        EngineConfig(ulysses_sequence_parallel_size=4).dp_size(6)
    with pytest.raises(ValueError, match=r"unknown EngineConfig field\(s\) \['micro_bsz'\]"):
        cfg.replace(micro_bsz=2)
    with pytest.raises(ValueError, match="zero_stage"):
        cfg.replace(zero_stage=0)
    assert cfg.replace(zero_stage=3).zero_stage == 3 and cfg.zero_stage == 2
    assert OptimConfig(betas=[0.9, 0.95]).betas == (0.9, 0.95)


# ---------------------------------------------------------------------------------- LR schedule
def test_warmup_cosine_schedule():
    s = WarmupSchedule(warmup_steps=4, kind="cosine", total_steps=14, min_lr_ratio=0.1)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(4) == pytest.approx(1.0)
    assert s(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s(14) == pytest.approx(0.1) and s(100) == pytest.approx(0.1)
    const = WarmupSchedule(warmup_steps=2, kind="constant")
    assert [const(i) for i in range(4)] == [0.5, 1.0, 1.0, 1.0]


def test_warmup_linear_schedule_is_hf_default_shape():
    """``lr_scheduler="linear"`` (HF's default, issue 29 item 10): warmup, then a straight line to
    ``min_lr_ratio`` (0 by default) at ``total_steps``."""
    s = WarmupSchedule(warmup_steps=2, kind="linear", total_steps=6)
    assert [s(i) for i in range(8)] == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
    floor = WarmupSchedule(warmup_steps=0, kind="linear", total_steps=4, min_lr_ratio=0.2)
    assert [floor(i) for i in range(5)] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    with pytest.raises(ValueError, match="lr_scheduler='linear' with total_training_steps=-1"):
        WarmupSchedule(0, "linear", -1)


def test_lr_scheduler_state_is_plain_data(tmp_path):
    model = torch.nn.Linear(2, 2)
    cfg = OptimConfig(lr=1.0, lr_scheduler="cosine", warmup_steps=1, total_training_steps=5)
    opt = build_optimizer(model.parameters(), cfg)
    sched = build_lr_scheduler(opt, cfg)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(3):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[0] == 1.0 and lrs[1] == 1.0 and lrs[2] < 1.0
    torch.save(sched.state_dict(), tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)
    opt2 = build_optimizer(model.parameters(), cfg)
    sched2 = build_lr_scheduler(opt2, cfg)
    sched2.load_state_dict(state)
    sched.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


# -------------------------------------------------------------------------------- mode contexts
class _FakeEngine(BaseEngine):
    """Records ``to`` calls; everything else is out of scope here."""

    def __init__(self, **cfg):
        super().__init__(EngineConfig(**cfg), OptimConfig(), backend="fake")
        self.module = torch.nn.Linear(1, 1)
        self.calls: list[tuple] = []

    def to(self, device, model=True, optimizer=True, grad=True):
        self.calls.append((str(device), model, optimizer, grad))

    initialize = forward_backward_batch = optimizer_zero_grad = optimizer_step = lr_scheduler_step = None
    get_data_parallel_size = get_data_parallel_rank = get_data_parallel_group = None
    get_per_tensor_param = save_checkpoint = load_checkpoint = None


_FakeEngine.__abstractmethods__ = frozenset()


def test_ctx_without_offload_moves_nothing():
    engine = _FakeEngine()
    with engine.train_mode() as e:
        assert e is engine and engine.mode == "train" and engine.module.training
    with engine.eval_mode():
        assert engine.mode == "eval" and not engine.module.training
    assert engine.calls == [] and engine.mode is None


def test_train_ctx_loads_and_offloads_params_and_optimizer():
    engine = _FakeEngine(param_offload=True, optimizer_offload=True)
    with engine.train_mode():
        assert engine.calls == [("cpu", True, False, True), ("cpu", False, True, False)]
    assert engine.calls[2:] == [("cpu", True, False, True), ("cpu", False, True, False)]


def test_eval_ctx_never_moves_the_optimizer_and_offloads_on_exception():
    engine = _FakeEngine(param_offload=True, optimizer_offload=True)
    with pytest.raises(RuntimeError, match="boom"):
        with engine.eval_mode():
            raise RuntimeError("boom")
    assert engine.calls == [("cpu", True, False, True), ("cpu", True, False, True)]
    assert engine.mode is None
    only_optim = _FakeEngine(optimizer_offload=True)
    with only_optim.eval_mode():
        pass
    assert only_optim.calls == []


# ----------------------------------------------------------------------------------------- heads
def test_log_probs_entropy_and_values_follow_the_next_token_convention():
    batch = random_batch(5, seed=3)
    packed = pack_batch(batch, keys=())
    torch.manual_seed(0)
    logits = torch.randn(1, packed.num_tokens, 17)
    ids = packed.input_ids.clamp_max(16)
    lp, ent = next_token_log_probs_and_entropy(logits, ids, packed.cu_seqlens, calculate_entropy=True,
                                               temperature=0.5)
    padded_logits = packed.unpack(logits[0]) / 0.5  # [B, T, V]
    padded_ids = packed.unpack(ids[0])
    mask = batch["attention_mask"].bool()
    mask[:, 0] = False
    want = padded_log_probs(padded_logits, padded_ids) * mask
    torch.testing.assert_close(packed.unpack(lp), want)
    dist = torch.distributions.Categorical(logits=padded_logits[:, :-1])
    want_ent = torch.cat([torch.zeros(5, 1), dist.entropy()], 1) * mask
    torch.testing.assert_close(packed.unpack(ent), want_ent)
    values = torch.arange(1.0, packed.num_tokens + 1)
    shifted = packed.unpack(shift_to_targets(values, packed.cu_seqlens))
    assert (shifted[:, 0] == 0).all()
    torch.testing.assert_close(shifted[:, 1:] * mask[:, 1:], packed.unpack(values)[:, :-1] * mask[:, 1:])


# -------------------------------------------------------------------------------- denominators
def test_global_batch_info_single_process():
    batch = random_batch(6)
    batch["is_padding"][-1] = True
    info = compute_global_batch_info(batch, None, 1, 0)
    assert info.batch_num_tokens == int(batch["loss_mask"].sum())
    assert info.global_batch_size == 5 and info.dp_size == 1


def test_configs_map_from_yaml_through_omegaconf():
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, ValidationError

    merged = OmegaConf.merge(OmegaConf.structured(OptimConfig),
                             OmegaConf.create("lr: 0.1\nbetas: [0.9, 0.95]\nlr_scheduler: cosine\n"
                                              "total_training_steps: 10\n"))
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, OptimConfig) and cfg.betas == (0.9, 0.95) and cfg.lr_scheduler == "cosine"
    with pytest.raises(ConfigKeyError):
        OmegaConf.merge(OmegaConf.structured(EngineConfig), {"micro_bsz": 2})
    with pytest.raises(ValidationError):
        OmegaConf.merge(OmegaConf.structured(OptimConfig), {"lr_scheduler": "step"})


def test_the_modes_part_holds_only_the_backend_move():
    """``engine.modes`` moves state through the backend's ``to`` and records the phase."""
    engine = _FakeEngine(param_offload=True)
    assert vars(engine.modes).keys() == {"move", "mode"}
    with engine.modes.phase("eval", engine.config, None, torch.device("cpu")):
        assert engine.mode == "eval"
    assert engine.calls == [("cpu", True, False, True), ("cpu", True, False, True)] and engine.mode is None
