"""`finetune init`'s sizing: micro-batch, accumulation, max_seq_len, FSDP and offload from the memory
plan. The command itself, on real files: tests/integration/test_init_cli.py."""
from finetune.plan.starter import DataFacts, ModelFacts, size


def test_sizing_follows_the_memory_plan():
    model = ModelFacts(name="meta-llama/Meta-Llama-3-8B", architecture="LlamaForCausalLM", max_positions=8192,
                       dtype="bfloat16", chat_template=True)
    data = DataFacts(path="x.jsonl", format="messages", fields=["messages"], rows=20000, longest=5000, p99=2000,
                     chat=True)
    roomy = size(data, model, "cuda", 1, 80 << 30)
    tight = size(data, model, "cuda", 1, 12 << 30)
    assert roomy.max_seq_len == 2048 and tight.max_seq_len == 2048
    assert roomy.micro_batch > tight.micro_batch >= 1 and roomy.planned <= 80 << 30 and tight.planned <= 12 << 30
    assert roomy.micro_batch * roomy.accumulation <= 16 and roomy.eval_split == 0.025  # 500 rows of 20000
    small = size(data, model, "cuda", 1, 4 << 30)  # an 8B model's 4-bit weights alone nearly fill 4 GiB
    assert small.offload and small.micro_batch == 1 and any("does not fit" in n for n in small.notes), small
    assert not any("cpu_offload" in n for n in small.notes)


def test_longer_rows_get_the_longest_length_that_fits():
    # finetune.plan.longest, as `estimate --max-seq-len` answers: suggested when the data's longest rows pass
    # the 99th percentile that max_seq_len is set to
    from dataclasses import replace

    from finetune.plan import estimate as E
    from finetune.plan.longest import longest
    from finetune.recipe import from_dict
    from finetune.plan.starter import base_recipe

    model = ModelFacts(name="meta-llama/Meta-Llama-3-8B", architecture="LlamaForCausalLM", max_positions=131072,
                       dtype="bfloat16", chat_template=True)
    data = DataFacts(path="x.jsonl", format="messages", fields=["messages"], rows=200, longest=60000, p99=4000,
                     chat=True)
    z = size(data, model, "cuda", 1, 24 << 30)
    note = [n for n in z.notes if "your longest example has 60000 tokens" in n]
    setup = replace(E.from_recipe(from_dict(base_recipe(data, model, "cuda", 1))), seq_len=4032, device="cuda",
                    gpus=1, gpu_memory=24 << 30)
    plain, both = longest(setup), longest(replace(setup, activation_offload=True, tiled_mlp=True))
    assert 4032 < plain < 60000 < both  # the rows fit only with the knobs; the note says both figures
    assert note and f"up to {plain}, or {min(both, 131072)} with model.activation_offloading" in note[0], z.notes
    short = DataFacts(path="x.jsonl", format="messages", fields=["messages"], rows=200, longest=3000, p99=3000,
                      chat=True)
    assert not any("your longest example" in n for n in size(short, model, "cuda", 1, 24 << 30).notes)
