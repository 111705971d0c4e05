"""Quantisation and export: 4-bit NF4 loading (nf4.py); LoRA merge and the GGUF writer come next."""
