"""Every option of every config group composes, validates and builds; typos and wrong types are refused."""

from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import CONF_DIR, FAST, compose_config, write_token_dataset
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf.errors import ConfigAttributeError, ValidationError

from distrain.config.schema import CONFIG_GROUPS
from distrain.config.validate import validate


def group_options():
    for group in CONFIG_GROUPS:
        for path in sorted((CONF_DIR / group).glob("*.yaml")):
            yield group, path.stem


@pytest.mark.parametrize("group,option", list(group_options()))
def test_every_option_composes_validates_and_instantiates(group, option, tmp_path, request):
    fast = [o for o in FAST if not (group == "model" and o.startswith("model."))]
    if option == "synthetic":
        fast = [o.replace("max_bytes", "num_tokens") for o in fast]
    if group == "model" and option == "hf":  # a local Hugging Face directory, saved in the test
        fast.append(f"model.name_or_path={request.getfixturevalue('tiny_hf_llama')}")
    if option == "tokens":  # a dataset on disk, written in the test (bytes of this file as ids)
        ids = np.frombuffer(Path(__file__).read_bytes() * 4, dtype=np.uint8)
        fast = [o for o in fast if "max_bytes" not in o]
        fast.append(f"data.path={write_token_dataset(tmp_path / 'tokens', {'train': [ids], 'val': [ids[:2000]]})}")
    if option == "mix":  # two such datasets, mixed
        ids = np.frombuffer(Path(__file__).read_bytes() * 4, dtype=np.uint8)
        fast = [o for o in fast if "max_bytes" not in o]
        made = [write_token_dataset(tmp_path / name, {"train": [ids], "val": [ids[:2000]]}) for name in "ab"]
        fast.append(f"data.sources={{a:{{path:{made[0]},weight:0.7}},b:{{path:{made[1]},weight:0.3}}}}")
    cfg = compose_config([*fast, f"{group}={option}"])
    plan = validate(cfg)
    assert plan.nproc_per_node >= 1
    # Real-size models (billions of parameters) are built and run on the meta device: shapes only.
    device = "meta" if group == "model" and option in ("llama3_1b", "llama3_8b", "mixtral_8x7b") else "cpu"
    with torch.device(device):
        built = instantiate(cfg[group])
    if group == "model":
        logits = built(torch.zeros(2, 8, dtype=torch.long, device=device))
        assert logits.shape == (2, 8, cfg.model.vocab_size or built.vocab_size)
    elif group == "data":
        assert len(built.corpus.train) > 0 and len(built.corpus.val) > 0
    elif group == "optimizer":
        model = torch.nn.Linear(3, 3)
        optimizer = built(model.named_parameters())
        assert optimizer.param_groups[0]["lr"] == cfg.optimizer.lr
        scheduler = instantiate(cfg.scheduler)(optimizer, total_steps=10)
        assert scheduler.get_last_lr()[0] > 0
    elif group == "checkpoint":
        assert isinstance(built, partial)
        assert built(run_dir="/tmp/x").dir.name == "checkpoints"
    else:
        assert built is not None


def test_every_group_has_options_and_default_groups_match_config_yaml():
    for group in CONFIG_GROUPS:
        assert list((CONF_DIR / group).glob("*.yaml")), group
    cfg = compose_config([])
    assert cfg.parallelism.name == "ddp" and cfg.model.n_layers == 4 and cfg.data.seq_len == cfg.model.max_seq_len


def test_misspelt_key_is_refused():
    with pytest.raises(ConfigCompositionException) as err:
        compose_config(["trainer.max_step=5"])
    assert isinstance(err.value.__cause__, ConfigAttributeError)
    assert "max_step" in str(err.value.__cause__)


def test_wrong_type_is_refused():
    with pytest.raises(ConfigCompositionException) as err:
        compose_config(["trainer.max_steps=many"])
    assert isinstance(err.value.__cause__, ValidationError)


def test_unknown_group_option_is_refused():
    with pytest.raises(Exception, match="parallelism/warp"):
        compose_config(["parallelism=warp"])
