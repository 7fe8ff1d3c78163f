"""Speculative decoding: draft proposers, their configuration, and the acceptance feedback.

A proposer guesses the next few tokens of a sequence cheaply (`proposer.Proposer`); the
engine then scores the sequence's last token plus the k drafted tokens in one forward pass
(k + 1 query rows, like a small prefill chunk) and the sampler keeps the longest prefix of
the draft that the target model would have produced itself (engine/spec/verify.py), plus
one token of its own. Greedy output is unchanged token for token; sampled output keeps its
distribution (rejection sampling).
"""
