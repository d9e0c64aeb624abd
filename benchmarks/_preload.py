"""Imported once by the fork server (common.fork_context) so forked runs skip the heavy imports."""
import accelerate  # noqa: F401
import bitsandbytes  # noqa: F401
import peft  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq  # noqa: F401
from transformers.models.llama import modeling_llama  # noqa: F401

import finetune.train.loop  # noqa: F401
