"""Constrained decoding: regex -> byte-level DFA (this package), later DFA x vocabulary -> token index."""
