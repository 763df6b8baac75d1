"""Speculative decoding: propose tokens cheaply, verify them all in one forward of the model.

Decode is bandwidth-bound: a forward over k + 1 tokens of one request reads the same weights as
over one, so when the proposals are often right, one step yields several tokens. The pieces:

- `ngram.propose`: prompt lookup, the continuation of the latest earlier occurrence of the
  request's last few tokens (no model; torch-free);
- `proposer.Proposer`: which requests propose this step and how many tokens (the adaptive rule;
  torch-free, called by the scheduler, which budgets k + 1 tokens for such a request);
- `verify.verify`: the target model's verdict on one request's proposals, lossless (greedy:
  the longest agreeing prefix and the model's own next token; sampled: rejection sampling).
"""
