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
