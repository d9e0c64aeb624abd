"""Layer `artefacts`: the files a run dir and a merged model hold that other clients read (transformers 4,
llama.cpp's converter, TGI, peft): the tokenizer's files (`tokenizer`) and the adapter's (`adapter`). Both
training and the merge write them, so they live below both."""
