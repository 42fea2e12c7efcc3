"""llama.cpp in this process: the only package that imports ``llama_cpp``."""
