"""``data.document_masking``'s own check, in the launching process before any rank starts: the data marks where its
documents end and the model's forward takes documents; one line naming ``data.document_masking`` otherwise."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from distrain.config.checks import ConfigError
from distrain.data.mixture import source_settings
from distrain.data.token_format import read_index
from distrain.data.tokens import dataset_directory
from distrain.ft.config import has_replica_groups
from distrain.models.spec import ModelSpec

KEY = "data.document_masking"
MARKED = "a dataset prepared by python -m distrain.data.prepare ends each document with its tokenizer's end-of-text id"


def end_of_document_ids(corpus: DictConfig) -> dict[str, int | None]:
    """The end-of-document id of each dataset a corpus reads (by its setting's name), from their indexes; empty for
    the built-in corpora, which are one stream without documents."""
    if "path" in corpus:
        return {"data.path": read_index(dataset_directory(corpus.path), "train").eos_id}
    if "sources" in corpus:
        return {
            f"data.sources.{name}.path": read_index(dataset_directory(path), "train").eos_id
            for name, (path, _) in source_settings(corpus.sources).items()
        }
    return {}


def check_document_masking(cfg: DictConfig, spec: ModelSpec) -> None:
    """Refuse ``data.document_masking=true`` for data without end-of-document ids or a model that cannot take
    documents; nothing to check when it is false."""
    masking: Any = cfg.data.get("document_masking", False)
    if not isinstance(masking, bool):
        raise ConfigError(KEY, masking, "true or false")
    if not masking:
        return
    ids = end_of_document_ids(cfg.data.corpus)
    if not ids:
        raise ConfigError(KEY, True, f"false for this data: its text is one stream without documents ({MARKED})")
    unmarked = [key for key, eos_id in ids.items() if eos_id is None]
    if unmarked:
        raise ConfigError(
            KEY, True, f"false for the dataset of {unmarked[0]}: its index names no end-of-document id ({MARKED})"
        )
    if len(set(ids.values())) > 1:
        raise ConfigError(KEY, True, f"false for sources that end documents with different ids: {ids}")
    if "ft" in cfg and has_replica_groups(cfg):
        raise ConfigError(
            KEY,
            True,
            "false with ft=torchft: replica groups average their gradients with equal weights, and masked steps count "
            "different tokens in each group (the mean would not be the token mean)",
        )
    if not spec.document_masking:
        raise ConfigError(
            KEY, True, f"false for {spec.label}: its forward takes no documents (its spec's document_masking)"
        )
