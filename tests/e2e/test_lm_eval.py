"""lm-evaluation-harness itself scores stories260K through `pdserve serve` (its
`local-completions` model: token ids, echo, logprobs), on a log-likelihood task built from local
text, and gets the numbers transformers gets on the same weights.

Needs the `eval` extra (`pip install -e ".[dev,eval]"`); nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

DOCS = [
    ("Once upon a time, there was a little girl named", " Lily."),
    ("Lily loved to play outside in the", " park."),
    ("One day, she saw a big, red", " ball."),
    ("Tim and his mom went to the", " store to buy some food."),
    ("The sun was shining and the birds were", " singing."),
    ("The dog wagged its", " tail."),
    ("She was very happy and said, thank", " you."),
    ("They played together all day and had a lot of", " fun."),
]
TASK = """
task: stories_continuation
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
target_delimiter: ""
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def reference(stories_path: str) -> list[tuple[float, bool]]:
    """(log-likelihood of the continuation, is it the greedy one) per doc, from transformers,
    tokenized the way lm-eval does: BOS + context, continuation without special tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_path)
    model = AutoModelForCausalLM.from_pretrained(stories_path, dtype=torch.float32).eval()
    out = []
    for context, continuation in DOCS:
        whole = tok.encode(context + continuation, add_special_tokens=False)
        ctx = tok.encode(context, add_special_tokens=False)
        ids = [tok.bos_token_id, *whole]
        with torch.no_grad():
            logprobs = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        targets = range(1 + len(ctx), len(ids))
        ll = sum(logprobs[i - 1, ids[i]].item() for i in targets)
        greedy = all(logprobs[i - 1].argmax().item() == ids[i] for i in targets)
        out.append((ll, greedy))
    return out


def test_lm_eval_scores_match_transformers(server, stories_path, tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"context": c, "continuation": t}) + "\n" for c, t in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "stories_continuation.yaml").write_text(TASK.format(data=data))
    model_args = ",".join([
        f"base_url={server.url}/v1/completions",
        "model=stories",
        f"tokenizer={stories_path}",
        "tokenizer_backend=huggingface",
        "add_bos_token=True",
        "num_concurrent=1",
        "max_retries=1",
    ])  # fmt: skip
    out = tmp_path / "results"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OPENAI_API_KEY": "x"}
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions",
           "--model_args", model_args, "--tasks", "stories_continuation",
           "--include_path", str(tasks), "--output_path", str(out), "--log_samples"]  # fmt: skip
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]

    (results_file,) = out.rglob("results_*.json")
    metrics = json.loads(results_file.read_text())["results"]["stories_continuation"]
    ref = reference(stories_path)
    ref_ppl = math.exp(-sum(ll for ll, _ in ref) / len(ref))
    assert metrics["perplexity,none"] == pytest.approx(ref_ppl, rel=1e-4)
    assert metrics["acc,none"] == pytest.approx(sum(g for _, g in ref) / len(ref))

    (samples_file,) = out.rglob("samples_stories_continuation_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    got = sorted((s["doc"]["context"], float(s["resps"][0][0][0])) for s in samples)
    want = sorted((c, ll) for (c, _), (ll, _) in zip(DOCS, ref))
    for (c1, ll1), (c2, ll2) in zip(got, want):
        assert c1 == c2 and ll1 == pytest.approx(ll2, abs=1e-4)
    server.wait_idle()
