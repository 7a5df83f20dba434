"""The runners: one model decoding a batch of rows on caches of its own (`core.protocols`).

hf.py (transformers models on a ragged KV cache, tree passes), static.py (the same on a static cache with compiled
passes: the GPU path), rowwise.py (row by row), mapped.py (a reduced-vocabulary draft), llamacpp.py (llama.cpp's
kernels), skipping.py (the target minus a skip set), packed.py and quantized.py (torch weight layouts). The native
GGUF runner is `models/gguf/runner.py`.
"""
