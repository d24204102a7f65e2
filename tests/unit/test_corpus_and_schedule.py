import math

import pytest

from distrain.data.corpus import stdlib_source_corpus, synthetic_corpus
from distrain.optim.schedule import warmup_decay_factor


def test_stdlib_corpus_is_real_text_deterministic_and_split():
    a = stdlib_source_corpus(max_bytes=300_000, val_fraction=0.1)
    b = stdlib_source_corpus(max_bytes=300_000, val_fraction=0.1)
    assert a.train.equal(b.train) and a.val.equal(b.val)
    assert len(a.train) + len(a.val) == 300_000
    assert 0.02 < len(a.val) / 300_000 < 0.3
    text = bytes(a.train[:5000].tolist()).decode("utf-8", errors="replace")
    assert "def " in text or "import " in text


def test_synthetic_corpus_is_seeded():
    a = synthetic_corpus(num_tokens=1000, vocab_size=50, seed=3, val_fraction=0.1)
    assert a.train.equal(synthetic_corpus(num_tokens=1000, vocab_size=50, seed=3, val_fraction=0.1).train)
    assert int(a.train.max()) < 50 and len(a.val) == 100


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_warmup_then_decay(decay):
    kw = dict(warmup_steps=10, total_steps=110, decay=decay, min_lr_ratio=0.1)
    assert warmup_decay_factor(0, **kw) == pytest.approx(0.1)
    assert warmup_decay_factor(9, **kw) == pytest.approx(1.0)
    end = warmup_decay_factor(110, **kw)
    assert end == pytest.approx(1.0 if decay == "constant" else 0.1)
    mid = warmup_decay_factor(60, **kw)
    expected = {"cosine": 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)), "linear": 0.55, "constant": 1.0}[decay]
    assert mid == pytest.approx(expected)
