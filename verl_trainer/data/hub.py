"""Hub dataset ids as data paths, read offline from the local Hugging Face cache. Nothing is downloaded.

Every entry point that takes a data path (``data.train_files``, ``data.val_files``, ``PromptDataset``,
``SFTDataset``) accepts ``org/name``, ``org/name@split``, ``org/name:config`` and
``org/name:config@split`` when the path is not a local file (TRL's ``dataset_name`` / ``dataset_config`` /
``dataset_train_split`` in one string; split ``train`` by default, ``test`` for ``data.val_files``).

The dataset is read from the hub cache only (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``): ``snapshot_download(..., local_files_only=True)`` finds the snapshot (a
partial one is read for the files it has, with a warning) and ``datasets`` streams its files in place
(configs from the dataset card, splits by file name). A dataset with several configs and no default needs
``:config``.

Raises (through the readers): a missing id, config or split is an error naming it, where it was looked
for and the fix; split slices (``train[:10%]``) are refused listing the splits there are. User guide:
docs/trl.md.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verl_trainer.utils.hub_cache import hub_cache_dir, looks_like_hub_id

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["HubDataset", "HubDatasetNotFoundError", "data_fingerprint", "hub_snapshot", "parse_hub_dataset",
           "read_hub_rows", "resolve_hub_split", "with_default_split"]

DATA_SUFFIXES = (".parquet", ".pq", ".jsonl", ".json", ".csv", ".tsv", ".txt", ".arrow")
"""Local data files; a path with one of these suffixes is never taken for a hub id."""

_REF = re.compile(r"^(?P<repo>[^:@]+)(?::(?P<config>[^:@]+))?(?:@(?P<split>[^@]+))?$")


class HubDatasetNotFoundError(FileNotFoundError):
    """A data path that looks like a hub dataset id, which is not in the local HF hub cache."""


@dataclass(frozen=True)
class HubDataset:
    """A hub dataset reference: ``repo_id[:config][@split]``.

    Attributes:
        repo_id: The dataset's id on the Hub (``org/name``).
        config: Its config (``datasets``' ``name``); ``None``: the default or only one.
        split: The split; ``None``: the caller's default (``train``, or ``test`` for validation).
    """

    repo_id: str
    config: str | None = None
    split: str | None = None

    def text(self, split: str | None = None) -> str:
        """The reference as a data path, with ``split`` in place of its own when given."""
        split = split or self.split
        return self.repo_id + (f":{self.config}" if self.config else "") + (f"@{split}" if split else "")


def parse_hub_dataset(path: str | os.PathLike) -> HubDataset | None:
    """The hub dataset ``path`` names, or ``None`` when it is a local path or not of the form.

    A path that exists locally, or ends in a data file's suffix (``.parquet``, ``.jsonl``, ...), is local.
    """
    text = str(path)
    match = _REF.match(text)
    if match is None or Path(text).expanduser().exists():
        return None
    repo = match["repo"]
    if not looks_like_hub_id(repo) or Path(repo).suffix.lower() in DATA_SUFFIXES:
        return None
    return HubDataset(repo, match["config"], match["split"])


def with_default_split(path: str, split: str) -> str:
    """``path`` with ``@split`` added when it names a hub dataset without a split; else ``path`` as it is."""
    ref = parse_hub_dataset(path)
    return ref.text(split) if ref is not None and ref.split is None else path


def _named(text: str, what: str | None) -> str:
    return f"{what}={text!r}" if what else repr(text)


def hub_snapshot(path: str, what: str | None = None) -> Path:
    """The cached snapshot directory of the hub dataset ``path`` names (no network access).

    Args:
        path: A hub dataset reference (``org/name[:config][@split]``).
        what: How the user named the setting (``"data.train_files"``), for the message.

    Raises:
        HubDatasetNotFoundError: Not in the local hub cache (the message names the id, the cache searched
            and the fixes).
        ValueError: ``path`` is not a hub dataset reference.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    ref = parse_hub_dataset(path)
    if ref is None:
        raise ValueError(f"{_named(path, what)} is not a hub dataset id (org/name[:config][@split])")
    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(ref.repo_id, repo_type="dataset", local_files_only=True,
                                      cache_dir=str(cache)))
    except IncompleteSnapshotError as partial:  # e.g. `hf download --include 'main/*'`: one config's files
        warnings.warn(f"{_named(path, what)}: {partial} Reading the files it has; a split whose files are "
                      "missing fails, but one with some of its shards missing would be read short.",
                      stacklevel=2)
        return Path(partial.snapshot_path)
    except LocalEntryNotFoundError:
        folder = cache / f"datasets--{ref.repo_id.replace('/', '--')}"
        raise HubDatasetNotFoundError(
            f"{_named(path, what)} is not a local file, and it looks like a hub dataset id but "
            f"{ref.repo_id!r} is not in the local HF hub cache (looked for {folder}, its refs/main and "
            f"snapshot; set HF_HOME or HF_HUB_CACHE if your cache is elsewhere). verl-trainer never "
            f"downloads data: download it on a machine with access (`hf download --repo-type dataset "
            f"{ref.repo_id}`, or `huggingface-cli download --repo-type dataset {ref.repo_id}`, or "
            f"`datasets.load_dataset({ref.repo_id!r})`) and copy that cache here, or set "
            f"{what or 'the path'} to a local .parquet / .jsonl file"
        ) from None


def _choose(choices: list[str], given: str | None, kind: str, where: str, example: Any) -> str:
    if given in choices:
        return given
    said = f"has no {kind} {given!r}" if given is not None else f"has several {kind}s and no default"
    raise ValueError(f"{where} {said}; its {kind}s: {', '.join(choices)}. Choose one: {example(choices[0])}")


def _datasets(where: str) -> ModuleType:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{where}: reading a hub dataset needs the `datasets` library: "
                         "pip install 'verl-trainer[data]' (or pip install datasets)") from None
    return datasets


def resolve_hub_split(path: str, what: str | None = None,
                      default_split: str = "train") -> tuple[Path, str, str]:
    """The cached snapshot, config and split that the hub dataset ``path`` names; nothing is read yet.

    Args:
        path: ``org/name[:config][@split]``.
        what: How the user named the setting (``"data.train_files"``), for the messages.
        default_split: The split when ``path`` names none.

    Returns:
        ``(snapshot directory, config, split)``.

    Raises:
        HubDatasetNotFoundError: The dataset is not in the local hub cache.
        ValueError: A config or split it does not have (the message lists the ones it has), or no
            ``datasets`` library to read it with.
    """
    snapshot = hub_snapshot(path, what)
    ref = parse_hub_dataset(path)
    assert ref is not None  # hub_snapshot checked it
    where = f"{_named(path, what)} (the cached dataset at {snapshot})"
    datasets = _datasets(where)
    configs = datasets.get_dataset_config_names(str(snapshot))
    default = datasets.get_dataset_default_config_name(str(snapshot))
    config = ref.config or default or (configs[0] if len(configs) == 1 else None)
    config = _choose(configs, config, "config", where,
                     lambda c: HubDataset(ref.repo_id, c, ref.split).text())
    splits = datasets.get_dataset_split_names(str(snapshot), config)
    split = _choose(splits, ref.split or default_split, "split", where,
                    lambda s: HubDataset(ref.repo_id, ref.config, s).text())
    return snapshot, config, split


def read_hub_rows(path: str, what: str | None = None, default_split: str = "train") -> list[dict[str, Any]]:
    """The rows of one split of a cached hub dataset, as dicts (see the module).

    The files are streamed in place (``load_dataset(snapshot, config, split=..., streaming=True)``).
    Arguments and errors: :func:`resolve_hub_split`.
    """
    snapshot, config, split = resolve_hub_split(path, what, default_split)
    stream = _datasets(path).load_dataset(str(snapshot), config, split=split, streaming=True)
    return [dict(row) for row in stream]


def data_fingerprint(path: str | os.PathLike) -> Any:
    """A JSON-able key of a data path's content; ``None`` for a path that is neither of these.

    A local file's key is ``utils.cached_dir.fingerprint``'s; a cached hub dataset's is
    ``"hub:<id>@<commit>"`` (the commit fixes every file).
    """
    from verl_trainer.utils.cached_dir import fingerprint  # lazy: 7 more modules only when used

    key = fingerprint(path)
    ref = parse_hub_dataset(path) if key is None else None
    if ref is None:
        return key
    try:
        return f"hub:{ref.repo_id}@{hub_snapshot(str(path)).name}"
    except HubDatasetNotFoundError:
        return None
