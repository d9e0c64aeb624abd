"""Layer `gguf`: a run's merged model (or its adapter) as a GGUF file for llama.cpp and Ollama, beside `merge/`
and above it (a GGUF of the merged model merges first). write.py is the export, converter.py fetches and runs
llama.cpp's own converter, llama_shim.py registers pre-tokenizers in the converter's process, readback.py
compares every tensor read back with its source (stacked_experts.py presents MoE experts as the converter
stacks them), greedy.py compares llama.cpp's greedy generations with transformers', modelfile.py writes the
Ollama Modelfile beside a merged model's GGUF.
"""
