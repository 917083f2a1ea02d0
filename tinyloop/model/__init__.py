"""The model family: architecture, the .tinyloop format and its quantization, tokenizer, presets,
the float64 oracle and memory estimates. Knows nothing of decoding."""
