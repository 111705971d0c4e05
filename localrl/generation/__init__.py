"""Producing tokens: grouped sampling with torch (one prefill per prompt), the same from llama.cpp, Markovian
(chunked) traces, and multi-turn episodes in an environment. The samplers in ``localrl.samplers`` drive these
engines and score what they produce."""
