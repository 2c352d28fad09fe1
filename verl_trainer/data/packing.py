"""Conversions between the three forms of a batch: padded, jagged and packed.

* **padded**: the schema form (``verl_trainer.data.schema``): token fields ``[B, T, ...]``, right-padded,
  sample ``i`` holds its ``seq_len[i]`` real tokens at positions ``0 .. seq_len[i] - 1``.
* **jagged**: a ``torch.nested`` tensor with ``layout=torch.jagged``: ``[B, j, ...]``, no padding.
* **packed**: one row without padding, ``[1, N, ...]`` with ``N = sum(seq_len)``; samples follow each
  other and are delimited by ``cu_seqlens`` (int32 ``[B + 1]``, ``cu_seqlens[i] .. cu_seqlens[i+1]``
  are the tokens of sample ``i``). Position ids restart at 0 for every sample. This is what the engine
  feeds the model (see ``verl_trainer.models.attention``).

All conversions are vectorised (no Python loop over samples). Samples of length 0 are allowed
everywhere (their segment is empty).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from verl_trainer.data import schema
from verl_trainer.data.log_probs import chunked_log_probs_and_entropy
from verl_trainer.data.vision import model_vision_inputs

_STRUCTURAL_KEYS = (schema.INPUT_IDS, schema.ATTENTION_MASK, schema.POSITION_IDS)


def seq_lens_to_cu_seqlens(seq_lens: torch.Tensor) -> torch.Tensor:
    """Cumulative sequence offsets.

    Args:
        seq_lens: ``[B]`` integer lengths.

    Returns:
        ``[B + 1]`` int32, ``cu[0] = 0`` and ``cu[i + 1] = cu[i] + seq_lens[i]``.

    """
    cu = torch.zeros(seq_lens.numel() + 1, dtype=torch.int32, device=seq_lens.device)
    cu[1:] = torch.cumsum(seq_lens.reshape(-1), 0)
    return cu


def _valid_mask(seq_lens: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, width]`` bool, True at the real (non-padding) positions of each right-padded row."""
    if seq_lens.numel() and int(seq_lens.max()) > width:
        raise ValueError(f"a sequence length ({int(seq_lens.max())}) exceeds the padded width {width}")
    if seq_lens.numel() and int(seq_lens.min()) < 0:
        raise ValueError(f"sequence lengths must be >= 0, got {seq_lens.tolist()}")
    return torch.arange(width, device=seq_lens.device)[None, :] < seq_lens.reshape(-1, 1)


def _segment_index(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each packed token: its sample index and its position inside the sample.

    Args:
        cu_seqlens: ``[B + 1]`` offsets.

    Returns:
        ``(row, col)``, each ``[N]`` long.

    """
    cu = cu_seqlens.to(torch.long)
    lens = cu[1:] - cu[:-1]
    total = int(cu[-1])
    row = torch.repeat_interleave(torch.arange(lens.numel(), device=cu.device), lens, output_size=total)
    col = torch.arange(total, device=cu.device) - cu[:-1][row]
    return row, col


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Position ids of a packed row, restarting at 0 for every sample.

    Args:
        cu_seqlens: ``[B + 1]`` offsets.

    Returns:
        ``[1, N]`` long.

    """
    return _segment_index(cu_seqlens)[1].unsqueeze(0)


def unpack_to_padded(
    values: torch.Tensor, cu_seqlens: torch.Tensor, width: int, pad_value: float | int = 0
) -> torch.Tensor:
    """Scatter a packed row back into a right-padded batch (the inverse of packing).

    A tensor whose first dim is 1 and second dim is ``N`` is read as the packed row ``[1, N, ...]``;
    otherwise it must be ``[N, ...]``.

    Args:
        values: ``[1, N, ...]`` or ``[N, ...]``, ``N = cu_seqlens[-1]``.
        cu_seqlens: ``[B + 1]`` offsets.
        width: Padded width ``T`` of the result (>= the longest sample).
        pad_value: Value written at padding positions.

    Returns:
        ``[B, width, ...]`` with the dtype and device of ``values``.

    """
    total = int(cu_seqlens[-1])
    if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == total:
        values = values[0]
    if values.shape[0] != total:
        raise ValueError(
            f"values hold {values.shape[0]} tokens (shape {tuple(values.shape)}) but cu_seqlens "
            f"describes {total}; pass [1, N, ...] or [N, ...]"
        )
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long)
    if lens.numel() and int(lens.max()) > width:
        raise ValueError(f"a sequence length ({int(lens.max())}) exceeds the padded width {width}")
    row, col = _segment_index(cu_seqlens.to(values.device))
    out = values.new_full((lens.numel(), width, *values.shape[1:]), pad_value)
    out[row, col] = values
    return out


def pack_token_values(values: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """The real tokens of a right-padded ``[B, T, ...]`` tensor, in packed order: ``[N, ...]``."""
    return values[_valid_mask(seq_lens.to(values.device), values.shape[1])]


def padded_to_jagged(x: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Drop the right padding of a batch.

    Args:
        x: ``[B, T, ...]`` right-padded.
        seq_lens: ``[B]`` real lengths.

    Returns:
        A jagged nested tensor ``[B, j, ...]`` (``layout=torch.jagged``) whose ``values()`` are the packed
        tokens ``[N, ...]`` and ``offsets()`` the ``cu_seqlens`` (int64).

    """
    seq_lens = seq_lens.to(device=x.device)
    values = x[_valid_mask(seq_lens, x.shape[1])]
    offsets = seq_lens_to_cu_seqlens(seq_lens).to(torch.long)
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)


def jagged_to_padded(nt: torch.Tensor, width: int | None = None, pad_value: float | int = 0) -> torch.Tensor:
    """Right-pad a jagged nested tensor.

    Args:
        nt: Jagged nested tensor ``[B, j, ...]``.
        width: Padded width; defaults to the longest sequence.
        pad_value: Value written at padding positions.

    Returns:
        ``[B, width, ...]``.

    """
    offsets = nt.offsets()
    if width is None:
        width = int((offsets[1:] - offsets[:-1]).max()) if offsets.numel() > 1 else 0
    return unpack_to_padded(nt.values(), offsets, width, pad_value)


@dataclass
class PackedBatch:
    """A micro-batch packed into one row without padding.

    Attributes:
        input_ids: ``[1, N]`` long.
        position_ids: ``[1, N]`` long, restarting at 0 for every sample.
        cu_seqlens: ``[B + 1]`` int32 offsets of the samples in the row.
        max_seqlen: Longest sample (int).
        seq_lens: ``[B]`` long.
        width: Padded width ``T`` of the batch this was packed from (for :meth:`unpack`).
        fields: Other token fields, each ``[1, N, ...]``, packed the same way.
        output_mask: ``[N]`` bool, True at the tokens whose per-token outputs (log-prob, entropy, value)
            are used — where ``loss_mask`` or ``response_mask`` is set — or ``None``: all of them.
            The language-model head runs only where it is True (``engine/heads.py: head_positions``).
        gather_ids: ``[N, k]`` long, the batch's ``teacher_topk_ids`` packed (whatever ``keys`` asked for),
            or ``None``: a language model then also returns its log-probs of these ids
            (``gathered_log_probs``, ``engine/heads.py``); like :attr:`output_mask`, an input of the forward.
        vision: The model's image inputs of the micro-batch (``pixel_values`` ``[N_patches, D]``,
            ``image_grid_thw`` ``[num_images, 3]``, sample order: ``data.vision.model_vision_inputs``), or
            ``None`` when it carries no image.
        mrope_position_ids: ``[3, 1, N]`` multimodal-rope positions of a vision-language model's row, each
            sample's computed on its unpacked row (``models/vlm.py``), or ``None``: 1-D positions.

    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    seq_lens: torch.Tensor
    width: int
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    output_mask: torch.Tensor | None = None
    gather_ids: torch.Tensor | None = None
    vision: dict[str, torch.Tensor] | None = None
    mrope_position_ids: torch.Tensor | None = None

    @property
    def model_position_ids(self) -> torch.Tensor:
        """What the model's ``position_ids`` gets: ``[1, N]``, or ``[4, 1, N]`` (1-D, then the mrope rows)."""
        if self.mrope_position_ids is None:
            return self.position_ids
        return torch.cat([self.position_ids.unsqueeze(0), self.mrope_position_ids.to(self.position_ids)])

    @property
    def num_tokens(self) -> int:
        """``N``, the number of real tokens in the row."""
        return self.input_ids.shape[1]

    @property
    def batch_size(self) -> int:
        """``B``, the number of samples."""
        return self.seq_lens.numel()

    def unpack(self, values: torch.Tensor, pad_value: float | int = 0) -> torch.Tensor:
        """``[1, N, ...]`` or ``[N, ...]`` → ``[B, width, ...]`` (see :func:`unpack_to_padded`)."""
        return unpack_to_padded(values, self.cu_seqlens, self.width, pad_value)

    def to(self, device: torch.device | str) -> PackedBatch:
        """Return a copy with every tensor on ``device``."""
        return PackedBatch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            cu_seqlens=self.cu_seqlens.to(device),
            max_seqlen=self.max_seqlen,
            seq_lens=self.seq_lens.to(device),
            width=self.width,
            fields={k: v.to(device) for k, v in self.fields.items()},
            output_mask=None if self.output_mask is None else self.output_mask.to(device),
            gather_ids=None if self.gather_ids is None else self.gather_ids.to(device),
            vision=None if self.vision is None else {k: v.to(device) for k, v in self.vision.items()},
            mrope_position_ids=(None if self.mrope_position_ids is None
                                else self.mrope_position_ids.to(device)),
        )


def pack_batch(batch: TensorDict, keys: Sequence[str] | None = None) -> PackedBatch:
    """Pack a padded schema batch into one row.

    Args:
        batch: ``TensorDict`` with ``input_ids [B, T]`` and ``seq_len [B]`` or ``attention_mask [B, T]``
            (``loss_mask`` / ``response_mask [B, T]``, when present, give :attr:`PackedBatch.output_mask`;
            ``pixel_values`` / ``image_grid_thw``, when present, :attr:`PackedBatch.vision`).
        keys: Token keys to pack into :attr:`PackedBatch.fields`. ``None``: every key of
            ``schema.TOKEN_KEYS`` present in the batch except input_ids / attention_mask / position_ids.

    Returns:
        The :class:`PackedBatch`.

    """
    input_ids = batch[schema.INPUT_IDS]
    width = input_ids.shape[1]
    seq_lens = schema.sequence_lengths(batch).to(input_ids.device)
    valid = _valid_mask(seq_lens, width)
    cu_seqlens = seq_lens_to_cu_seqlens(seq_lens)
    if keys is None:
        keys = [k for k in schema.TOKEN_KEYS if k not in _STRUCTURAL_KEYS and k in batch.keys()]
    fields = {}
    for key in keys:
        value = batch[key]
        if tuple(value.shape[:2]) != tuple(input_ids.shape):
            raise ValueError(
                f"token field {key!r} has shape {tuple(value.shape)}, expected {tuple(input_ids.shape)} "
                "(aligned with input_ids)"
            )
        fields[key] = value[valid].unsqueeze(0)
    used = [batch[k] != 0 for k in (schema.LOSS_MASK, schema.RESPONSE_MASK) if k in batch.keys()]
    output_mask = None
    if used:
        output_mask = (used[0] | used[1] if len(used) == 2 else used[0])[valid]
    gather_ids = None
    if schema.TEACHER_TOPK_IDS in batch.keys():
        ids = batch[schema.TEACHER_TOPK_IDS]
        if ids.dim() != 3 or tuple(ids.shape[:2]) != tuple(input_ids.shape):
            raise ValueError(f"{schema.TEACHER_TOPK_IDS!r} has shape {tuple(ids.shape)}, expected "
                             f"{(*input_ids.shape, 'k')} (aligned with input_ids)")
        gather_ids = ids[valid].to(torch.long)
    has_images = any(k in batch.keys() for k in schema.VISION_KEYS)
    vision = (model_vision_inputs(batch) or None) if has_images else None
    return PackedBatch(
        input_ids=input_ids[valid].unsqueeze(0),
        position_ids=position_ids_from_cu_seqlens(cu_seqlens),
        cu_seqlens=cu_seqlens,
        max_seqlen=int(seq_lens.max()) if seq_lens.numel() else 0,
        seq_lens=seq_lens,
        width=width,
        fields=fields,
        output_mask=output_mask,
        gather_ids=gather_ids,
        vision=vision,
    )


def shift_to_targets(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Move per-position values of a packed row one step right, zeroing each sample's first position.

    Args:
        values: ``[N]``; ``values[j]`` describes the prediction made at position ``j`` (of token ``j+1``).
        cu_seqlens: ``[B + 1]`` offsets.

    Returns:
        ``[N]`` with ``out[j] = values[j - 1]`` inside a sample and ``0`` at sample starts: the schema's
        next-token convention, aligned with ``input_ids``.
    """
    if values.numel() == 0:
        return values
    out = torch.cat([values.new_zeros(1), values[:-1]])
    starts = cu_seqlens[:-1].to(device=values.device, dtype=torch.long)
    return out.index_fill(0, starts[starts < values.numel()], 0.0)


token_log_probs_and_entropy = chunked_log_probs_and_entropy
"""Log-prob of ``targets[j]`` under ``logits[j]`` (and the entropy at ``j``), in float32: the chunked
kernel of ``data/log_probs.py`` itself (the whole ``[n, V]`` is never copied to float32)."""


def next_token_log_probs_and_entropy(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) of a packed row under the schema's next-token convention.

    ``log_probs[t] = log p(input_ids[t] | tokens of the same sample before t)``, read from
    ``logits[t - 1]``; the first token of every sample has no prediction and gets 0.

    Args:
        logits: ``[1, N, V]`` (or ``[N, V]``).
        input_ids: ``[1, N]`` (or ``[N]``).
        cu_seqlens: ``[B + 1]`` offsets.
        temperature: Logits are divided by it first.
        calculate_entropy: Also return the entropy of the distribution that chose each token.

    Returns:
        ``(log_probs [N], entropy [N] | None)`` float32; ``PackedBatch.unpack`` gives ``[B, T]``.
    """
    targets = torch.roll(input_ids.reshape(-1), -1)  # position j predicts token j + 1
    log_probs, entropy = token_log_probs_and_entropy(logits, targets, temperature, calculate_entropy)
    log_probs = shift_to_targets(log_probs, cu_seqlens)
    return log_probs, None if entropy is None else shift_to_targets(entropy, cu_seqlens)


def make_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    uids: Sequence[int] | torch.Tensor | None = None,
    width: int | None = None,
    pad_token_id: int = 0,
) -> TensorDict:
    """Build a schema batch from token-id lists (prompt + response per sample).

    Args:
        prompts: ``B`` lists of prompt token ids.
        responses: ``B`` lists of response token ids (may be empty).
        uids: ``[B]`` group ids; default ``0 .. B - 1`` (every sample its own group).
        width: Padded width ``T``; default the longest prompt + response.
        pad_token_id: Id written at padding positions of ``input_ids``.

    Returns:
        ``TensorDict`` (batch_size ``[B]``) with input_ids, attention_mask, position_ids ``[B, T]`` long;
        loss_mask, response_mask ``[B, T]`` float32 (1 on the response tokens); uid, seq_len,
        prompt_len, response_len ``[B]`` long; is_padding ``[B]`` bool (all False).

    """
    if len(prompts) != len(responses):
        raise ValueError(f"got {len(prompts)} prompts but {len(responses)} responses")
    b = len(prompts)
    prompt_len = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    response_len = torch.tensor([len(r) for r in responses], dtype=torch.long)
    seq_len = prompt_len + response_len
    longest = int(seq_len.max()) if b else 0
    width = longest if width is None else width
    if width < longest:
        raise ValueError(f"width={width} is shorter than the longest sample ({longest} tokens)")
    flat = [t for p, r in zip(prompts, responses) for t in (*p, *r)]
    jagged_ids = torch.tensor(flat, dtype=torch.long)
    cu = seq_lens_to_cu_seqlens(seq_len)
    valid = _valid_mask(seq_len, width)
    pos = torch.arange(width).expand(b, width)
    in_response = (pos >= prompt_len[:, None]) & valid
    if uids is None:
        uid = torch.arange(b, dtype=torch.long)
    else:
        uid = torch.as_tensor(uids, dtype=torch.long).reshape(b)
    return TensorDict(
        {
            schema.INPUT_IDS: unpack_to_padded(jagged_ids, cu, width, pad_token_id),
            schema.ATTENTION_MASK: valid.long(),
            schema.POSITION_IDS: pos * valid,
            schema.LOSS_MASK: in_response.float(),
            schema.RESPONSE_MASK: in_response.float(),
            schema.UID: uid,
            schema.SEQ_LEN: seq_len,
            schema.PROMPT_LEN: prompt_len,
            schema.RESPONSE_LEN: response_len,
            schema.IS_PADDING: torch.zeros(b, dtype=torch.bool),
        },
        batch_size=[b],
    )
