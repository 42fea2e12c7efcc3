"""Facts about a GGUF file: its header, quant tables, the memory a model needs. Leaves: no llama.cpp, no numpy."""
