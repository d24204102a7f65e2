"""Document masking's proof of exactness: a packed window's loss equals the token-weighted mean of its documents'
losses, each document run alone (GPT, Llama, MoE and a Llama-layout Hugging Face model; fp32, within 1e-5), with the
documents and boundary targets the data side makes, and the step's loss divided by the tokens counted over the
global batch."""

import pytest
import torch

from distrain.data.packing import count_step_tokens, mask_documents
from distrain.data.sampler import IGNORE_INDEX, Batch, step_token_count
from distrain.models.common.documents import document_attention_mask, document_positions
from distrain.models.gpt.model import GPT
from distrain.models.llama.model import Llama
from distrain.models.moe.model import MoE
from distrain.models.spec import spec_of

EOS = 0
SIZES = {"vocab_size": 64, "max_seq_len": 64, "d_model": 32, "n_layers": 2, "n_heads": 4}
MODELS = {
    "gpt": lambda: GPT(**SIZES),
    "llama": lambda: Llama(**SIZES, n_kv_heads=2, ffn_hidden=48),
    "moe": lambda: MoE(**SIZES, n_kv_heads=2, expert_hidden=24, n_experts=4, top_k=2),
}


def packed_window(lengths, seed=0, tail=6):
    """One window of seq + 1 tokens: documents of ``lengths`` tokens, each ended by EOS, then ``tail`` tokens of a
    document the window cuts (ids 1.. so that only the ends are EOS)."""
    generator = torch.Generator().manual_seed(seed)
    pieces = []
    for length in lengths:
        pieces += [torch.randint(1, SIZES["vocab_size"], (length,), generator=generator), torch.tensor([EOS])]
    pieces.append(torch.randint(1, SIZES["vocab_size"], (tail,), generator=generator))
    return torch.cat(pieces)


def test_documents_positions_and_mask_of_a_window():
    window = torch.tensor([[5, 6, EOS, 7, EOS, 8, 9, 9]])
    batch = mask_documents(Batch(window[:, :-1], window[:, 1:]), EOS)
    assert batch.documents.tolist() == [[0, 0, 0, 1, 1, 2, 2]]  # an end belongs to the document it ends
    assert batch.targets.tolist() == [[6, EOS, IGNORE_INDEX, EOS, IGNORE_INDEX, 9, 9]]
    assert batch.num_tokens == 5 and batch.model_kwargs["documents"] is batch.documents
    assert document_positions(batch.documents).tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    mask = document_attention_mask(batch.documents)[0, 0]
    assert mask[3].tolist() == [False, False, False, True, False, False, False]  # a first token sees itself only
    assert mask[4].tolist() == [False, False, False, True, True, False, False]
    share = document_attention_mask(batch.documents, torch.tensor([6, 1]))[0, 0]  # a context-parallel share
    assert share.tolist() == [mask[6].tolist(), mask[1].tolist()]


@pytest.fixture(params=[*sorted(MODELS), "hf"])
def model(request):
    """Each family's tiny model in fp32; ``hf``: a Llama-layout Hugging Face model, run by its own layers."""
    if request.param == "hf":
        from distrain.models.hf.model import HFCausalLM

        path = request.getfixturevalue("tiny_hf_llama")
        return HFCausalLM(name_or_path=str(path), max_seq_len=64, attn_implementation="sdpa").eval()
    torch.manual_seed(0)
    return MODELS[request.param]().eval()


def test_a_packed_window_scores_each_document_as_if_it_ran_alone(model):
    spec = spec_of(model)
    assert spec.document_masking
    windows = torch.stack([packed_window([7, 12, 3, 9], seed=1), packed_window([15, 2, 1, 13], seed=2)])
    batch = mask_documents(Batch(windows[:, :-1], windows[:, 1:]), EOS)
    with torch.no_grad():
        packed = model(batch.inputs, **batch.model_kwargs)
        packed_loss = spec.loss(packed, batch.targets) / batch.num_tokens
        loss_sum, counted, largest_gap = torch.zeros((), dtype=torch.float64), 0, 0.0
        for row in range(len(windows)):
            for document in batch.documents[row].unique().tolist():
                where = batch.documents[row] == document
                alone = model(batch.inputs[row, where][None])
                largest_gap = max(largest_gap, (alone[0] - packed[row, where]).abs().max().item())
                targets = batch.targets[row, where][None]
                loss_sum += spec.loss(alone, targets).double()
                counted += int((targets != IGNORE_INDEX).sum())
    assert counted == batch.num_tokens == 2 * 40 - 8  # every target but the 8 after an end of document
    assert largest_gap < 1e-5, largest_gap  # logits equal token by token, not only the loss
    assert abs(packed_loss.item() - (loss_sum / counted).item()) < 1e-5
    unmasked = model(batch.inputs)  # without the documents, later documents see earlier ones: not the same
    assert (unmasked - packed).abs().max() > 1e-3


def test_the_step_divides_by_the_tokens_counted_over_the_global_batch():
    windows = torch.stack([packed_window([3, 4], seed=3, tail=3), packed_window([9], seed=4, tail=2)])
    batches = [mask_documents(Batch(windows[i : i + 1, :-1], windows[i : i + 1, 1:]), EOS) for i in range(2)]
    assert [b.num_tokens for b in batches] == [9, 10]
    assert step_token_count(batches) == 19  # one process: its own count
    stepped = count_step_tokens(batches, torch.device("cpu"))
    assert [b.step_tokens for b in stepped] == [19.0, 19.0] and step_token_count(stepped) == 19.0
    plain = [Batch(windows[:, :-1], windows[:, 1:])]
    assert count_step_tokens(plain, torch.device("cpu"))[0].step_tokens is None  # nothing to count: no collective
    assert step_token_count(plain) == windows[:, 1:].numel()
