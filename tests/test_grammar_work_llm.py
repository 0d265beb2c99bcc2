"""Grammar work through real engine processes (issue 30): a limit a grammar meets only while
it runs ends that request alone with the reason (and its grammar stays failed); masks that
miss their step make their requests sit out steps, journaled, so the run replays byte-exact."""
from __future__ import annotations

import re

import pytest
from model_utils import make_tiny_model

from launch import LLM, SamplingParams, StructuredOutputsParams
from protocol import GrammarsCompiled
from replay import replay
from replay.recorded_run import RecordedRun

pytestmark = pytest.mark.slow
S = StructuredOutputsParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("grammar_llm") / "m"), tokenizer=True)


def test_a_limit_met_while_running_ends_its_request_alone_with_the_reason(tiny):
    # 60 [ab] before the end: the lexer needs more than 40 states, but only tokens in.
    deep = SamplingParams(temperature=1.0, seed=3, max_tokens=100,
                          structured_outputs=S(regex="[ab]{60}c"))
    with LLM(tiny, dtype="float32", max_model_len=256,
             structured_outputs_max_lexer_states=40) as llm:
        for _ in range(2):  # and the next request with that grammar fails alike
            outs = llm.generate(["x", "y", "z"], [
                deep, SamplingParams(max_tokens=8, ignore_eos=True),
                SamplingParams(max_tokens=20, structured_outputs=S(regex="(ab)+c"))],
                use_tqdm=False)
            failed = outs[0].outputs[0]
            assert failed.finish_reason == "error"
            assert "--structured-outputs-max-lexer-states" in failed.stop_reason
            assert "refused a sampled token" not in failed.stop_reason
            assert len(outs[1].outputs[0].token_ids) == 8
            assert re.fullmatch("(ab)+c", outs[2].outputs[0].text)


def test_late_masks_sit_out_steps_journaled_and_the_run_replays(tiny, tmp_path):
    path = str(tmp_path / "late.journal")
    params = ([SamplingParams(temperature=1.0, seed=i, max_tokens=30,
                              structured_outputs=S(regex="[a-c]{4,9}(x|yz)"))
               for i in range(6)]
              + [SamplingParams(max_tokens=30, structured_outputs=S(json_object=True))] * 2
              + [SamplingParams(max_tokens=12, ignore_eos=True)] * 3)
    with LLM(tiny, dtype="float32", max_model_len=256, record_path=path, block_size=8,
             max_num_batched_tokens=32, structured_outputs_mask_wait_ms=0) as llm:
        outs = llm.generate([f"p{i}" for i in range(len(params))], params, use_tqdm=False)
    for out, p in zip(outs, params):
        seq = out.outputs[0]
        assert seq.finish_reason in ("stop", "length"), seq.stop_reason
        if p.structured_outputs is not None and p.structured_outputs.regex is not None:
            assert re.fullmatch(p.structured_outputs.regex, seq.text), seq.text
    events = [r.message for r in RecordedRun(path).records
              if isinstance(r.message, GrammarsCompiled)]
    assert any(e.late for e in events) and any(e.caught_up for e in events)
    assert replay.replay_scheduler(path) == 0
    assert replay.replay_workers(path) == 0
