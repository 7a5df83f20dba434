"""verispec's own quantized CPU runner for GGUF models: weights stay in their block formats (repacked once
at load), matmuls run in C kernels over int8-quantized activations, and every op computes a row with the
same arithmetic whatever the pass width (batch invariance)."""

# A row cache's key/value element type (NativeRunner's cache_dtype, `--kv-cache`); the first is the default: halves,
# as llama.cpp's default cache keeps them (half the bytes a pass reads and a row holds).
CACHE_DTYPES = ("float16", "float32")
