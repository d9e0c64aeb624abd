"""A packed batch gives the same per-sequence losses as the same sequences run unpacked, on the builtin
tiny model: position ids that restart per document keep attention inside each document."""
import pytest
import torch
import torch.nn.functional as F

from finetune.data import batching as B
from finetune.data import encode as E
from finetune.recipe import DataSpec, TrainSpec


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def examples(tok):
    """Prompt/completion, multi-turn chat and raw text, of different lengths."""
    rows = [{"prompt": f"reverse: {' '.join(['red', 'cat', 'sun', 'dog', 'fox'][: 1 + i % 5])}\n",
             "completion": " ".join(["dog", "fox", "owl"][: 1 + i % 3])} for i in range(14)]
    rows += [{"messages": [{"role": "user", "content": "first: red cat"}, {"role": "assistant", "content": "red"},
                           {"role": "user", "content": "last: sun moon star"}, {"role": "assistant", "content": "star"}]}]
    rows += [{"text": " ".join(["one two six ten"] * (2 + i))} for i in range(3)]
    return [E.encode(r, "auto", tok, DataSpec()) for r in rows]


def model_for(path, attn):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)
    return m.eval()


def token_ce(model, batch):
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), batch["labels"][:, 1:].reshape(-1),
                         ignore_index=E.IGNORE, reduction="none")
    return ce.view(logits.size(0), -1)


def unpacked_losses(model, examples):
    batch = B.collate(examples, pad_id=0)
    ce = token_ce(model, batch)
    out = []
    for i, e in enumerate(examples):
        keep = batch["labels"][i, 1:len(e["input_ids"])] != E.IGNORE
        out.append(float(ce[i, : len(e["input_ids"]) - 1][keep].mean()))
    return out


def packed_losses(model, rows, flat):
    batch = B.collate_packed(rows, pad_id=0, flat=flat)
    ce = token_ce(model, batch)
    labels = batch["labels"]
    got = {}
    for i in range(batch["input_ids"].shape[0]):
        pos = batch["position_ids"][i].tolist()
        n = len(rows[i]["input_ids"]) if not flat else len(pos)
        starts = [j for j in range(n) if pos[j] == 0] + [n]
        for a, b in zip(starts, starts[1:]):
            keep = labels[i, a + 1:b] != E.IGNORE
            got[tuple(batch["input_ids"][i, a:b].tolist())] = float(ce[i, a:b - 1][keep].mean())
    return got


@pytest.mark.parametrize("attn, flat", [("sdpa", False), ("eager", False), ("sdpa", True)])
def test_packed_per_sequence_losses_equal_unpacked(tiny_model_dir, examples, attn, flat):
    model = model_for(tiny_model_dir, attn)
    rows = B.pack(examples, max_len=64)
    assert len(rows) < len(examples)
    assert any(r["position_ids"].count(0) >= 3 for r in rows)  # rows really hold several documents
    packed = packed_losses(model, rows, flat)
    want = dict(zip((tuple(e["input_ids"]) for e in examples), unpacked_losses(model, examples)))
    assert packed.keys() == want.keys()
    for k in want:
        assert packed[k] == pytest.approx(want[k], abs=1e-4, rel=1e-4)


def test_without_restarting_positions_documents_leak_into_each_other(tiny_model_dir, examples):
    """The control: the same packed rows with plain 0..n-1 positions (what a packer without position ids
    gives) change the losses, so the equality above is not vacuous."""
    model = model_for(tiny_model_dir, "sdpa")
    rows = B.pack(examples, max_len=64)
    good = B.collate_packed(rows, pad_id=0)
    leaky = dict(good, position_ids=torch.arange(good["input_ids"].shape[1]).expand_as(good["input_ids"]))
    assert (token_ce(model, good) - token_ce(model, leaky)).abs().max() > 1e-2


def test_loop_loss_sum_matches_packed_vs_unpacked_on_the_4bit_model(tiny_model_dir, examples):
    """The training loop's own loss (token_loss_sum) over the QLoRA model: same sum, same token count."""
    from finetune.recipe import LoraSpec, ModelSpec, QuantizationSpec
    from finetune.train.lora import apply_lora
    from finetune.train.loss import token_loss_sum
    from finetune.weights.load.model import load_model

    model = load_model(ModelSpec(name=str(tiny_model_dir), gradient_checkpointing=False), QuantizationSpec(),
                       quiet=True)
    model = apply_lora(model, LoraSpec(r=8, dropout=0.0), seed=0)
    with torch.no_grad():  # make the adapters non-zero so they take part
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    model.eval()
    spec = TrainSpec(mixed_precision="no")
    with torch.no_grad():
        lp, np_ = token_loss_sum(model, B.collate_packed(B.pack(examples, 64), 0), "cpu", spec)
        lu, nu = token_loss_sum(model, B.collate(examples, 0), "cpu", spec)
    assert np_ == nu
    assert float(lp) == pytest.approx(float(lu), rel=1e-4)
