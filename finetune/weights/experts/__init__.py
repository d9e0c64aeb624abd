"""Fused MoE experts held 4-bit: the module whose forward dequantizes only the routed experts (module.py), their
bytes streamed and quantized expert by expert, whole or each rank's span (expert_bytes.py), and peft's LoRA
wrapper running over them (expert_lora.py)."""
