"""The frontend's output processor: what a stream's consumer is told of each call's tokens."""

from __future__ import annotations

from pdserve.frontend.output_processor import OutputProcessor
from pdserve.frontend.tokenizer import load_tokenizer
from pdserve.types import EngineCoreOutput, SamplingParams


def test_outputs_of_one_request_in_one_call_each_add_their_tokens(stories_path):
    """A handoff releases a first token and the decode worker's held bursts together: the
    consumer counts every token (the usage it reports), not the last output's alone."""
    tok = load_tokenizer(stories_path)
    ids = tok("Once upon a time, Lily", add_special_tokens=False)["input_ids"]
    proc = OutputProcessor(tok)
    proc.add_request("r", None, ids, SamplingParams(max_tokens=12, ignore_eos=True), 0.0)
    (core,) = proc.core_ids("r")
    first, burst, last = [ids[0]], ids[1:4], ids[4:6]
    out = proc.process([EngineCoreOutput(core, first), EngineCoreOutput(core, burst)])
    (request,) = out.request_outputs
    assert request.outputs[0].new_token_ids == first + burst
    out = proc.process([EngineCoreOutput(core, last)])
    assert out.request_outputs[0].outputs[0].new_token_ids == last
    assert out.request_outputs[0].outputs[0].token_ids == first + burst + last
