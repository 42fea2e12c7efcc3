"""Text and token ids: chat templates (bounded), formats, prompt ids, reasoning, stops, the context window, attachments. No llama.cpp, no I/O."""
