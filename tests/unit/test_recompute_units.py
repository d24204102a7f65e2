"""Activation checkpointing on one process: the same gradients, less memory kept for backward."""

import copy

import pytest
import torch

from distrain.models.gpt import GPT
from distrain.parallelism.recompute import apply_activation_checkpointing, chosen_blocks, saved_activation_bytes


def test_selective_takes_every_nth_block_from_the_first():
    assert chosen_blocks(6, "selective", 2) == [0, 2, 4]
    assert chosen_blocks(4, "full", 2) == [0, 1, 2, 3] and chosen_blocks(4, "none", 2) == []


def test_recomputation_keeps_gradients_and_keeps_less_for_backward():
    torch.manual_seed(0)
    base = GPT(vocab_size=256, max_seq_len=64, d_model=64, n_layers=4, n_heads=4)
    tokens = torch.randint(0, 256, (4, 64))
    kept, grads = {}, {}
    for mode in ("none", "selective", "full"):
        model = copy.deepcopy(base)
        assert len(apply_activation_checkpointing(model, mode, every=2)) == {"none": 0, "selective": 2, "full": 4}[mode]
        kept[mode] = saved_activation_bytes(model, tokens)
        model(tokens).float().square().mean().backward()
        grads[mode] = [p.grad for p in model.parameters()]
        assert list(model.state_dict()) == list(base.state_dict())  # no renamed parameters
    for mode in ("selective", "full"):
        assert all(torch.equal(a, b) for a, b in zip(grads[mode], grads["none"], strict=True)), mode
    assert kept["full"] < kept["selective"] < kept["none"]
    assert kept["full"] < 0.2 * kept["none"]  # only each block's input and the embeddings/head remain
    assert kept["selective"] == pytest.approx((kept["none"] + kept["full"]) / 2, rel=0.1)
