"""Draft heads' checkpoints: medusa.py (the Medusa repository's format), eagle3.py (SpecForge's EAGLE-3 format,
the checks a head must pass), eagle3_ttt.py (EAGLE-3's training-time test), shipped.py (the heads shipped for the
default target and their manifests).
"""
