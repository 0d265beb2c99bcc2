"""Speculative decoding of constrained requests through real engine processes: proposals cut
where the grammar refuses them, one mask per verified position, greedy output identical to
speculation off (constrained and unconstrained requests in one batch, with chunked prefill
and preemption), sampled output valid, record and replay byte-exact."""
from __future__ import annotations

import json

import jsonschema
import pytest
from json_schemas import SCHEMAS
from model_utils import make_tiny_model

from launch import LLM, SamplingParams, StructuredOutputsParams
from replay import replay
from replay.recorded_run import RecordedRun

pytestmark = pytest.mark.slow  # real engine processes

# JSON in the prompt, so that prompt lookup proposes what the grammar then asks for.
PROMPT = 'Example: {"name": "ab", "age": 3, "ok": true} {"color": "red"} Answer in JSON: '
TIGHT = dict(dtype="float32", max_model_len=256, block_size=8, max_num_batched_tokens=32,
             num_gpu_blocks_override=24)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def _params() -> list[SamplingParams]:
    """Constrained greedy, constrained seeded, unconstrained greedy."""
    constrained = [SamplingParams(temperature=0.0, max_tokens=60,
                                  structured_outputs=StructuredOutputsParams(json=schema))
                   for schema in SCHEMAS[:10]]
    seeded = [SamplingParams(temperature=1.0, seed=i, max_tokens=60,
                             structured_outputs=StructuredOutputsParams(json=SCHEMAS[i]))
              for i in range(4)]
    choice = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=(
        StructuredOutputsParams(choice=['{"name": "ab"}', '{"name": "abab"}', "red"])))
    return constrained + seeded + [choice] + [SamplingParams(temperature=0.0, max_tokens=30,
                                                             ignore_eos=True)] * 3


def _run(model: str, **engine_args) -> list[tuple[list[int], str]]:
    params = _params()
    with LLM(model, **TIGHT, **engine_args) as llm:
        outs = llm.generate([PROMPT + "x " * (i % 5) for i in range(len(params))], params,
                            use_tqdm=False)
    results = [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]
    for (_, text), p in zip(results, params):
        if p.structured_outputs is not None and p.structured_outputs.json is not None:
            jsonschema.validate(json.loads(text), p.structured_outputs.json)
    return results


def _greedy(results: list) -> list:
    return [r for r, p in zip(results, _params()) if p.temperature == 0.0]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_structured")
    target = make_tiny_model(str(root / "target"), tokenizer=True)
    draft = make_tiny_model(str(root / "draft"), seed=7, tokenizer=True, num_hidden_layers=1)
    return target, draft, _run(target)


def _masked_drafts(path: str) -> tuple[int, int]:
    """(steps where a constrained request verified drafts under d + 1 mask rows, draft
    tokens such requests had accepted in them)."""
    steps = accepted = 0
    for step in RecordedRun(path).steps:
        so, out = step.scheduler_output, step.model_runner_output
        if so.scheduled_spec_decode_tokens is None or so.grammar_bitmask is None:
            continue
        masked = list(so.grammar_bitmask.req_ids)
        emitted = dict(zip(out.req_ids, out.sampled_token_ids))
        for handle, drafts in so.scheduled_spec_decode_tokens.items():
            if handle in masked:
                assert masked.count(handle) == len(drafts) + 1
                steps += 1
                accepted += len(emitted[handle]) - 1
    return steps, accepted


def test_ngram_drafts_of_constrained_requests_are_verified_exactly(models, tmp_path):
    target, _, off = models
    path = str(tmp_path / "ngram.journal")
    on = _run(target, speculative_config=NGRAM, record_path=path)
    assert _greedy(on) == _greedy(off)
    steps, accepted = _masked_drafts(path)
    assert steps > 0 and accepted > 0, (steps, accepted)
    assert any(s.scheduler_output.preempted_req_ids for s in RecordedRun(path).steps)
    assert replay.replay_scheduler(path) == 0 and replay.replay_workers(path) == 0


def test_draft_model_drafts_of_constrained_requests(models, tmp_path):
    target, draft, off = models
    path = str(tmp_path / "draft.journal")
    spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 3}
    on = _run(target, speculative_config=spec, record_path=path)
    assert _greedy(on) == _greedy(off)
    assert _masked_drafts(path)[0] > 0
    assert _run(target, speculative_config={**spec, "model": draft})[:10] == off[:10]
