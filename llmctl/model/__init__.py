"""Everything that reads a model, without torch: the model argument, config.json, the model
check, safetensors headers and tensors, the tokenizer and chat template, token bytes, and
the random `demo` model. The engine and the backends sit above this package."""
