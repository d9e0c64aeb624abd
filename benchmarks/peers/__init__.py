"""finetune beside other fine-tuning tools on the same model, rows and batch: TRL's SFTTrainer on CPU (row 7:
trl_sft runs the two arms of trl_arms and compares them with trl_compare) and on a GPU (trl_gpu, run by the
GPU proof's trl stage)."""
