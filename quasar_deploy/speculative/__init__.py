"""Speculative decoding: drafters propose, the verifier checks k+1 positions in one forward, acceptance keeps it lossless.

Import from the submodules: this package loads nothing, so reading the drafter table costs no torch."""
