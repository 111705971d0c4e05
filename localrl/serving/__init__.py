"""Working with a trained model: chat (a run, a directory or a GGUF) and the OpenAI-compatible server."""
