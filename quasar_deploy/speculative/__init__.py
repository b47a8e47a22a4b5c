"""Speculative decoding: drafters propose, the verifier checks k+1 positions in one forward, acceptance keeps it lossless.

Import from the submodules (``loop``, ``acceptance``, ``causal_lm``, ``registry``, one per
drafter): this package itself loads nothing, so reading the drafter table costs no torch.
"""
