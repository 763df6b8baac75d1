"""Structured output: constrain what a request may generate (JSON schema, regex, choice, grammar).

`spec` (no torch) turns the API's fields into one llguidance grammar, checked in the frontend;
`matcher` compiles it against the tokenizer in the engine and turns each step's grammar state into
a token mask that the sampler applies.
"""
