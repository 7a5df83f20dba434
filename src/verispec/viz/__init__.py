"""`verispec viz`: a local web app to watch speculative decoding (live view, losslessness demo, speedup calculator)."""
