"""Who writes a reply: the Backend protocol, llama.cpp in this process (the only package that imports llama_cpp) and OpenAI-compatible servers."""
