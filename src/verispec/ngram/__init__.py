"""Corpus n-gram tables for drafting: `table.py` (the .ngram file and in-memory counts), `build.py`
(`verispec ngram build`)."""
