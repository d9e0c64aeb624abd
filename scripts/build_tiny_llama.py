"""Build builtin:tiny-llama, the small model that ships in finetune/util/assets: a byte-level BPE tokenizer
trained on the synthetic corpus, a 4-layer Llama, random init and a short full-parameter pretraining, saved
as bf16 safetensors (5 MB). Deterministic; run it only when the builder changes (and bump builtin.VERSION):

    python scripts/build_tiny_llama.py

It lives outside the package because nothing at run time builds a model: the package ships the result.
"""
from __future__ import annotations

import random
import shutil
from pathlib import Path

from finetune.util.builtin import ASSETS, CHAT_TEMPLATE, TASKS, VERSION, WORDS, make_rows

# The base model learns each skill under another instruction word. Fine-tuning then has to teach it that
# "reverse:" means what it knows as "backwards:": instruction tuning unlocking an ability the base already
# has, which a few hundred LoRA steps can do on a CPU.
ALIASES = {"reverse": "backwards", "first": "opening", "second": "runnerup", "last": "closing"}


def _pretrain_pair(rng: random.Random) -> tuple[str, str]:
    """(prompt, answer) of what the base model 'knows' before fine-tuning: the skills under their alias
    words, and the real instruction words followed by shuffles of at least two prompt words, so the base
    alone almost never answers a real instruction right (near-zero exact match before fine-tuning)."""
    words = rng.sample(WORDS, rng.randint(3, 5))
    task = rng.choice(sorted(TASKS))
    if rng.random() < 0.8:
        return f"{ALIASES[task]}: {' '.join(words)}\n", " ".join(TASKS[task](words))
    answer = rng.sample(words, rng.randint(2, len(words)))
    if answer == TASKS[task](words):
        answer = answer[1:] + answer[:1]
    return f"{task}: {' '.join(words)}\n", " ".join(answer)


def build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(7)
    corpus = [r["prompt"] + r["completion"] for r in make_rows(3000, seed=7)]
    corpus += ["".join(_pretrain_pair(rng)) for _ in range(3000)]
    corpus += ["The quick brown fox jumps over the lazy dog. 0123456789 ,.;:!?'\"()[]{}<>-_=+*/\\@#$%&|~`^"]
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>",
                                   pad_token="<|pad|>", additional_special_tokens=specials[3:])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1024
    fast.save_pretrained(out)
    return fast


PRETRAIN_STEPS = 1400


def _pretrain(model, tok, steps: int, seed: int = 0):
    """Full-parameter training on `_pretrain_pair`, loss on the answers only (the prompts are random words
    with nothing to learn), so the shipped base is a small pretrained model, not random noise: a frozen
    random base is a poor start for LoRA."""
    import torch

    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * min(1.0, 2 * (1 - s / steps) + 0.05))
    model.train()
    for step in range(steps):
        ids, labels = [], []
        for _ in range(64):
            prompt, answer = _pretrain_pair(rng)
            p = tok(prompt)["input_ids"]
            a = tok(answer)["input_ids"] + [tok.eos_token_id]
            ids.append(p + a)
            labels.append([-100] * len(p) + a)
        n = max(map(len, ids))
        x = torch.tensor([i + [tok.pad_token_id] * (n - len(i)) for i in ids])
        y = torch.tensor([lab + [-100] * (n - len(lab)) for lab in labels])
        mask = (x != tok.pad_token_id).long()
        loss = model(input_ids=x, attention_mask=mask, labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if step % 100 == 0 or step == steps - 1:
            print(f"pretrain step {step}: loss {loss.item():.3f}", flush=True)
    model.eval()


def build_model(out: Path, steps: int = PRETRAIN_STEPS):
    """Tokenizer + random init + a short pretraining, saved as bf16 safetensors (5 MB)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer(out)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    _pretrain(model, tok, steps)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)



if __name__ == "__main__":
    target = ASSETS / f"tiny-llama-{VERSION}"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    build_model(target)
    print(f"wrote {target}")
