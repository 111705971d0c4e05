"""Quantisation and export: 4-bit NF4 loading (nf4.py), LoRA merge and GGUF writing (export.py,
gguf_writer.py), validation of every GGUF file in llama.cpp (gguf_check.py), and the Ollama
Modelfile (modelfile.py)."""
