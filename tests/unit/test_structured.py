"""Structured output: specs become grammars (or clear errors), grammars become token masks."""

from __future__ import annotations

import pytest
import torch

from pdserve.structured import spec
from pdserve.structured.matcher import GrammarCompiler, apply_bitmask, fill_bitmask


def test_specs_compile_and_bad_ones_name_their_field():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for grammar in (
        spec.json_schema_grammar(schema, "guided_json"),
        spec.json_schema_grammar('{"type": "array"}', "guided_json"),
        spec.response_format_grammar({"type": "json_object"}),
        spec.response_format_grammar({"type": "json_schema", "json_schema": {"schema": schema}}),
        spec.regex_grammar(r"\d{3}-[a-z]+"),
        spec.choice_grammar(["yes", 'say "no"', "a|b"]),
        spec.lark_grammar('start: "x" ("," "x")*'),
    ):
        spec.check(grammar, "field")
    assert spec.response_format_grammar({"type": "text"}) is None
    cases = [
        (lambda: spec.json_schema_grammar("{not json", "guided_json"), "guided_json"),
        (lambda: spec.json_schema_grammar([1], "guided_json"), "guided_json"),
        (lambda: spec.response_format_grammar({"type": "yaml"}), "response_format"),
        (lambda: spec.response_format_grammar({"type": "json_schema"}), "response_format"),
        (lambda: spec.choice_grammar([]), "guided_choice"),
        (lambda: spec.check(spec.regex_grammar("([a-"), "guided_regex"), "guided_regex"),
        (lambda: spec.check(spec.lark_grammar("start: undefined_rule"), "g"), "g"),
    ]
    for make, field in cases:
        with pytest.raises(spec.SpecError) as e:
            make()
        assert e.value.field == field and str(e.value).startswith(f"invalid {field}:")


def test_apply_bitmask_keeps_exactly_the_allowed_tokens():
    vocab = 70  # three 32-bit words, the last one partly used
    torch.manual_seed(0)
    allowed = torch.rand(3, vocab) < 0.3
    allowed[2] = False  # a row that allows nothing is left unconstrained
    bitmask = torch.zeros(3, 3, dtype=torch.int32)
    for r, t in allowed.nonzero().tolist():  # the reference: bit t % 32 of word t // 32
        word = int(bitmask[r, t // 32]) | (1 << (t % 32))
        bitmask[r, t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    logits = torch.randn(3, vocab)
    masked = apply_bitmask(logits, bitmask)
    assert torch.equal(masked[:2].isfinite(), allowed[:2])
    assert torch.equal(masked[:2][allowed[:2]], logits[:2][allowed[:2]])
    assert torch.equal(masked[2], logits[2])


def test_matcher_masks_follow_the_grammar_and_catch_up_on_tokens(stories_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_path)
    compiler = GrammarCompiler(stories_path, tok.vocab_size, [tok.eos_token_id])
    state = compiler.submit(spec.choice_grammar([" happy", " sad"])).result(timeout=30)
    bitmask = torch.empty(1, compiler.bitmask_width, dtype=torch.int32)
    fill_bitmask([(state, [])], bitmask)
    logits = apply_bitmask(torch.zeros(1, tok.vocab_size), bitmask)[0]
    first = [t for t in range(tok.vocab_size) if logits[t].isfinite()]
    pieces = [tok.convert_tokens_to_string(["a", tok.convert_ids_to_tokens(t)])[1:] for t in first]
    assert tok.convert_tokens_to_ids("\u2581happy") in first
    assert tok.eos_token_id not in first
    assert all(" happy".startswith(p) or " sad".startswith(p) for p in pieces), pieces
    # tokens produced elsewhere (say by a prefill worker) are consumed before the next mask
    happy = tok.encode(" happy", add_special_tokens=False)
    fill_bitmask([(state, happy)], bitmask)
    logits = apply_bitmask(torch.zeros(1, tok.vocab_size), bitmask)[0]
    assert [t for t in range(tok.vocab_size) if logits[t].isfinite()] == [tok.eos_token_id]
    compiler.close()
