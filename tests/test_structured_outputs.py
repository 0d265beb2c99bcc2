"""Structured outputs without processes: the params, the grammar engine's checks, the
whitespace and additional-properties rules, masks and stop tokens, the worker's apply, the
scheduler holding requests for their grammars, the compile time bound, and the wire."""
from __future__ import annotations

import json
import time

import msgspec
import numpy as np
import pytest
import torch
from model_utils import save_tiny_tokenizer

from engine_core import CacheConfig, Request, RequestStatus, Scheduler, SchedulerConfig
from engine_core.structured_output.bitmask_builder import BitmaskBuilder
from engine_core.structured_output.grammar import check_grammar
from engine_core.structured_output.grammar_compiler import GrammarCompiler
from engine_core.structured_output.mask_row import fill_row
from engine_core.structured_output.structured_output_manager import StructuredOutputManager
from engine_core.structured_output.structured_output_request import StructuredOutputRequest
from protocol import (
    AddRequest,
    CachedRequestData,
    Channel,
    Codec,
    DraftTokens,
    GrammarBitmask,
    IntColumn,
    MaskedSchedulerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
    SpecDecodeSchedulerOutput,
    StructuredOutputsParams,
)
from protocol.structured_outputs import MAX_CONSTRAINT_CHARS
from worker.input_batch import InputBatch, StepProtocolError
from worker.sample.grammar_bitmask import GrammarBitmaskLogitsProcessor, unpack_disallowed
from worker.sample.sampler import Sampler

S = StructuredOutputsParams
EOS = 0  # the tiny tokenizer's <|endoftext|>


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    save_tiny_tokenizer(str(path))
    return str(path)


@pytest.fixture(scope="module")
def compiler(model_dir):
    compiler = GrammarCompiler(model_dir, None, timeout_s=30.0)
    yield compiler
    compiler.shutdown()


def matcher(compiler, params: S):
    task = compiler.compile(params, EOS)
    return compiler.matcher(task)


def accepts(compiler, params: S, text: str) -> bool:
    m = matcher(compiler, params)
    ids = compiler.tokenizer(EOS).tokenize_str(text)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


# --- params -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fields,match", [
    ({}, "exactly one of json, json_object, regex, choice, grammar; got none"),
    ({"json": {}, "regex": "a"}, "got json and regex"),
    ({"json_object": False}, "got none"),
    ({"json": 3}, "structured_outputs.json"),
    ({"regex": 5}, "structured_outputs.regex"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 1]}, "structured_outputs.choice"),
    ({"grammar": b"x"}, "structured_outputs.grammar"),
    ({"json_object": "yes"}, "structured_outputs.json_object"),
    ({"regex": "a", "disable_any_whitespace": None}, "disable_any_whitespace"),
    ({"grammar": "x" * (MAX_CONSTRAINT_CHARS + 1)}, "at most 65536 characters"),
    ({"json": {"enum": ["x" * 100] * 1000}}, "at most 65536 characters"),
])
def test_bad_params_name_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        S(**fields)


def test_a_schema_sharing_sub_dicts_is_refused_quickly():
    node: dict = {"type": "integer"}
    for _ in range(60):  # 2**60 nodes once expanded
        node = {"anyOf": [node, node]}
    start = time.monotonic()
    with pytest.raises(ValueError, match="structured_outputs.json must be at most"):
        S(json=node)
    assert time.monotonic() - start < 1.0


def test_params_travel_once_and_round_trip():
    codec = Codec(Channel.FRONTEND_TO_CORE)
    params = SamplingParams(structured_outputs=S(json={"type": "object", "properties": {
        "b": {"type": "integer"}, "a": {"type": "string"}}}, disable_any_whitespace=True))
    request = AddRequest("r", [1, 2], params, 0.0)
    decoded = codec.decode(codec.encode(request))
    assert decoded == request
    assert decoded.sampling_params.structured_outputs.spec == \
        '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}}}'
    assert S(json='{"type": "object"}').key != S(json={"type": "object"}).key  # text as given
    with pytest.raises(ValueError, match="structured_outputs must be StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})


# --- the grammar engine's checks and the JSON rules -------------------------------------------

@pytest.mark.parametrize("params,field", [
    (S(json={"type": "foo"}), "structured_outputs.json is not a valid JSON schema"),
    (S(json='{"type": '), "structured_outputs.json is not valid JSON"),
    (S(json="[1, 2]"), "structured_outputs.json must be a JSON schema object"),
    (S(json={"type": "string", "format": "no-such-format"}), "structured_outputs.json"),
    (S(json={"properties": {"a": {"$ref": "#/$defs/missing"}}}), "structured_outputs.json"),
    (S(regex="(unclosed"), "structured_outputs.regex is not a valid regex"),
    (S(grammar="start: undefined_rule"), "structured_outputs.grammar is not a valid grammar"),
])
def test_the_grammar_engine_refuses_naming_the_field(params, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        check_grammar(params)


def test_valid_constraints_pass():
    for params in (S(json={"type": "object"}), S(json_object=True), S(regex="[0-9]{3}"),
                   S(choice=["yes", "no"]), S(grammar='start: "a" b\nb: /[0-9]+/'),
                   S(grammar='root ::= "yes" | "no"')):  # GBNF too
        check_grammar(params)


def test_whitespace_is_json_dumps_by_default(compiler):
    schema = {"type": "object", "required": ["a", "b"], "properties": {
        "a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "integer"}}}}
    value = {"a": 1, "b": [2, 3]}
    spaced = S(json=schema)
    assert accepts(compiler, spaced, json.dumps(value))
    for other in ('{"a":1,"b":[2,3]}', '{ "a": 1, "b": [2, 3]}', '{"a": 1,  "b": [2, 3]}',
                  '{"a": 1, "b": [2, 3]}\n'):
        assert not accepts(compiler, spaced, other), other
    compact = S(json=schema, disable_any_whitespace=True)
    assert accepts(compiler, compact, json.dumps(value, separators=(",", ":")))
    assert not accepts(compiler, compact, json.dumps(value))
    flexible = S(json={**schema, "x-guidance": {"whitespace_flexible": True,
                                                 "item_separator": ",", "key_separator": ":"}})
    assert accepts(compiler, flexible, '{ "a" :1,\n "b": [2,3]}')


def test_objects_are_closed_unless_the_schema_or_the_flag_opens_them(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    extra = '{"a": 1, "z": 2}'
    assert not accepts(compiler, S(json=schema), extra)
    assert not accepts(compiler, S(json=schema, disable_additional_properties=True), extra)
    assert accepts(compiler, S(json=schema, disable_additional_properties=False), extra)
    assert accepts(compiler, S(json={**schema, "additionalProperties": True}), extra)
    assert accepts(compiler, S(json=schema), '{"a": 1}')


# --- masks ------------------------------------------------------------------------------------

def _request(params: SamplingParams, outputs: int = 0) -> Request:
    request = Request("r", [5, 6], params, eos_token_id=EOS)
    request.req_id = 3
    for _ in range(outputs):
        request.append_output_token_ids(7)
    return request


def _state(m, vocab: int) -> StructuredOutputRequest:
    """A request's grammar state with its next row computed, as MaskPipeline leaves it."""
    return StructuredOutputRequest(m, ("regex", "", False, None), "regex",
                                   fill_row(m, (vocab + 31) // 32))


def _allowed(bitmask: GrammarBitmask, vocab: int) -> np.ndarray:
    words = np.frombuffer(bitmask.bitmask, "<i4").reshape(len(bitmask.req_ids), -1)
    return ~unpack_disallowed(words, vocab)


def test_stop_tokens_are_allowed_exactly_when_the_grammar_accepts(compiler):
    vocab = compiler.tokenizer(EOS).vocab_size
    stop = 1
    params = SamplingParams(stop_token_ids=[stop], structured_outputs=S(regex="ab+"))
    request, m = _request(params), matcher(compiler, params.structured_outputs)
    builder = BitmaskBuilder(vocab)
    tokenizer = compiler.tokenizer(EOS)
    for text, accepting in (("", False), ("a", False), ("b", True), ("b", True)):
        if text:
            assert m.consume_token(tokenizer.tokenize_str(text)[0])
        row = _allowed(builder.build([(request, _state(m, vocab), [])], 8), vocab)[0]
        assert row[EOS] == row[stop] == accepting, text
        assert row.any()


def test_min_tokens_holds_stops_back_until_the_grammar_can_only_end(compiler):
    vocab = compiler.tokenizer(EOS).vocab_size
    params = SamplingParams(min_tokens=5, structured_outputs=S(regex="a+"))
    request = _request(params, outputs=1)
    m = matcher(compiler, params.structured_outputs)
    assert m.consume_token(compiler.tokenizer(EOS).tokenize_str("a")[0])
    builder = BitmaskBuilder(vocab)
    row = _allowed(builder.build([(request, _state(m, vocab), [])], 8), vocab)[0]
    assert m.is_accepting() and not row[EOS] and row.any()  # more "a" is possible: held back
    done = SamplingParams(min_tokens=5, structured_outputs=S(choice=["a"]))
    request = _request(done, outputs=1)
    m = matcher(compiler, done.structured_outputs)
    assert m.consume_token(compiler.tokenizer(EOS).tokenize_str("a")[0])
    row = _allowed(builder.build([(request, _state(m, vocab), [])], 8), vocab)[0]
    assert row[EOS] and row.sum() == 1 and request.min_tokens == 0  # the grammar wins


def test_a_request_with_drafts_gets_the_mask_after_each_prefix_of_them(compiler):
    vocab = compiler.tokenizer(EOS).vocab_size
    params = SamplingParams(structured_outputs=S(regex="ab+c"))
    request, m = _request(params), matcher(compiler, params.structured_outputs)
    a, b, c = (compiler.tokenizer(EOS).tokenize_str(t)[0] for t in "abc")
    built = BitmaskBuilder(vocab).build([(request, _state(m, vocab), [a, b, a])], 8)
    assert list(built.req_ids) == [3] * 4
    rows = _allowed(built, vocab)
    expected = []
    for token in (None, a, b):  # known tokens, then after each accepted draft
        if token is not None:
            assert m.consume_token(token)
        expected.append(_allowed(BitmaskBuilder(vocab).build(
            [(request, _state(m, vocab), [])], 8), vocab)[0])
    # Past the refused draft (the second "a") the last row repeats: nothing there is verified.
    assert (rows == np.stack(expected + expected[-1:])).all()
    assert rows[2][b] and rows[2][c] and not rows[2][a]
    m.rollback(2)
    assert m.validate_tokens([a, b, a]) == 2  # the matcher was left as it began


def test_the_processor_keeps_an_allowed_argmax_and_touches_only_constrained_rows():
    torch.manual_seed(0)
    vocab, rows = 70, 4
    logits = torch.randn(rows, vocab)
    argmax = logits.argmax(-1)
    words = np.zeros((2, 3), np.int32)
    allowed = [[int(argmax[1]), 5], [9]]  # row 1 keeps its argmax, row 3 is forced
    for k, tokens in enumerate(allowed):
        for t in tokens:
            words[k, t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))
    metadata = _metadata(rows, np.array([1, 3]), words)
    out = GrammarBitmaskLogitsProcessor().apply(logits, metadata)
    assert torch.equal(out[[0, 2]], logits[[0, 2]])
    assert out.argmax(-1).tolist() == [int(argmax[0]), int(argmax[1]), int(argmax[2]), 9]
    assert torch.isinf(out[1]).sum() == vocab - 2 and not torch.isnan(out).any()
    assert torch.equal(logits.argmax(-1), argmax)  # the input is not modified
    tokens, _ = Sampler(0, torch.device("cpu")).sample(logits, metadata)
    assert tokens == [int(argmax[0]), int(argmax[1]), int(argmax[2]), 9]


def _metadata(rows: int, grammar_rows: np.ndarray, words: np.ndarray):
    batch = InputBatch(64, 16, torch.device("cpu"), vocab_size=70)
    for h in range(rows):
        batch.add_request(NewRequestData(h, f"r{h}", [1, 2], SamplingParams(temperature=0.0),
                                         [1], 0, EOS))
    grammar = GrammarBitmask(IntColumn(grammar_rows.tolist()), words.astype("<i4").tobytes())
    return batch.sampling_metadata(np.arange(rows), grammar)


def _speculative(grammar_rows: np.ndarray, words: np.ndarray):
    """Request 1 verifies 2 drafts (logits rows 1, 2, 3) between two plain requests."""
    batch = InputBatch(64, 16, torch.device("cpu"), vocab_size=70)
    for h in range(3):
        batch.add_request(NewRequestData(h, f"r{h}", [1, 2], SamplingParams(temperature=0.0),
                                         [1], 0, EOS))
    grammar = GrammarBitmask(IntColumn(grammar_rows.tolist()), words.astype("<i4").tobytes())
    return batch.sampling_metadata(np.array([0, 1, 1, 1, 2]), grammar,
                                   np.array([0, 0, 1, 2, 0]))


def test_a_speculative_request_gets_one_mask_per_logits_row():
    words = np.arange(1, 13, dtype=np.int32).reshape(4, 3)
    metadata = _speculative(np.array([1, 1, 1, 2]), words)
    assert metadata.grammar_rows.tolist() == [1, 2, 3, 4]
    assert (metadata.grammar_bitmask == words).all()


def test_the_worker_refuses_masks_it_cannot_apply():
    words = np.full((1, 3), -1, np.int32)
    with pytest.raises(StepProtocolError, match="do not match the logits rows"):
        batch = InputBatch(64, 16, torch.device("cpu"), vocab_size=70)
        for h in range(2):
            batch.add_request(NewRequestData(h, f"r{h}", [1], SamplingParams(), [1], 0))
        batch.sampling_metadata(np.array([0]), GrammarBitmask(IntColumn([1]),
                                                              words.tobytes()))
    with pytest.raises(StepProtocolError, match="allows no token"):
        _metadata(2, np.array([0]), np.zeros((1, 3), np.int32))
    with pytest.raises(StepProtocolError, match="do not match the logits rows"):
        _speculative(np.array([1, 1]), np.full((2, 3), -1, np.int32))  # 3 logits rows
    with pytest.raises(StepProtocolError, match="bytes"):
        _metadata(2, np.array([0]), np.zeros((1, 2), np.int32))


# --- the engine core's side -------------------------------------------------------------------

def _scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                     max_model_len=64),
                     CacheConfig(4, 64, True))


def test_a_request_waits_for_its_grammar_in_its_place():
    scheduler = _scheduler()
    constrained = SamplingParams(structured_outputs=S(regex="a"))
    requests = [Request("first", [1] * 4, constrained, arrival_time=1.0),
                Request("second", [2] * 4, SamplingParams(), arrival_time=2.0),
                Request("third", [3] * 4, constrained, arrival_time=3.0)]
    for request in requests:
        scheduler.add_request(request)
    assert requests[0].status == RequestStatus.WAITING_FOR_GRAMMAR
    assert scheduler.has_runnable_requests()
    so = scheduler.schedule()
    assert [r.request_id for r in so.scheduled_new_reqs] == ["second"]
    assert [r.request_id for r in scheduler.waiting] == ["first", "third"]
    scheduler.check_integrity()
    scheduler.unblock_request(requests[2])
    so = scheduler.schedule()
    assert [r.request_id for r in so.scheduled_new_reqs] == ["third"]
    scheduler.finish_requests("first")  # aborted while waiting
    scheduler.check_integrity()
    assert scheduler.num_blocked == 0


def test_a_grammar_that_does_not_compile_in_time_fails_alone(model_dir):
    manager = StructuredOutputManager(model_dir, None, timeout_s=0.1)
    manager.compiler.tokenizer(EOS)  # loaded once; the bound covers compiling only
    slow = S(json={"type": "object", "properties": {f"p{i}": {"format": "email"}
                                                    for i in range(1800)}})
    requests = [Request("fast", [1], SamplingParams(structured_outputs=S(choice=["a", "b"])),
                        eos_token_id=EOS),
                Request("slow", [1], SamplingParams(structured_outputs=slow), eos_token_id=EOS)]
    for request in requests:
        manager.add_request(request)
    events = []
    deadline = time.monotonic() + 30
    while manager.pending and time.monotonic() < deadline:
        event = manager.poll()
        if event is not None:
            events.append(event)
        time.sleep(0.005)
    ready = [r for e in events for r in e.ready]
    failed = [(f.request_id, f.message) for e in events for f in e.failed]
    assert ready == ["fast"]
    assert failed == [("slow", "structured_outputs.json did not compile within 0.1 s")]
    manager.shutdown()


def test_steps_without_masks_encode_as_before():
    codec = Codec(Channel.CORE_TO_WORKER)
    so = SchedulerOutput([NewRequestData(0, "a", [1, 2, 3], SamplingParams(temperature=0.0,
                                                                           max_tokens=5),
                                         [1], 0, 2)],
                         CachedRequestData([1, 2], [10, 11], [None, [7]], []),
                         {0: 3, 1: 1, 2: 1}, 5, [4], [], 9)
    # The bytes of this step before structured outputs existed.
    before = ("d5029801919700a16193010203dc001101cb0000000000000000cb3ff000000000000000cb00000"
              "00000000000c0c0c0c20500cb0000000000000000cb0000000000000000cb3ff0000000000000c0"
              "c3c29101000294c403420102c403420a0b92c0910790c404420301010591049009")
    encoded = bytes(codec.encode(so)).hex()
    # New since: the request's `structured_outputs` (None, one byte), and NewRequestData's
    # `lora_request` and `pooling_params` (None each: array_like structs send every field),
    # all sent once, with the new request.
    assert encoded == before.replace("dc0011", "dc0012").replace(
        "c0c3c2910100", "c0c3c2c0910100").replace("919700", "919900").replace(
        "91010002", "91010002c0c0")
    masked = so.with_grammar_bitmask(GrammarBitmask(IntColumn([0]), b"\xff" * 4))
    decoded = codec.decode(codec.encode(masked))
    assert isinstance(decoded, MaskedSchedulerOutput) and decoded == masked
    assert decoded.num_scheduled_tokens == {0: 3, 1: 1, 2: 1} and so.grammar_bitmask is None
    assert msgspec.structs.replace(masked).grammar_bitmask.bitmask == b"\xff" * 4
    drafts = DraftTokens.from_lists([1], [[4, 5]])
    spec = SpecDecodeSchedulerOutput(*(getattr(so, n) for n in so.__struct_fields__), drafts)
    both = spec.with_grammar_bitmask(GrammarBitmask(IntColumn([1, 1, 1]), b"\xff" * 12))
    decoded = codec.decode(codec.encode(both))
    assert isinstance(decoded, SpecDecodeSchedulerOutput) and decoded == both
    assert decoded.scheduled_spec_decode_tokens.as_dict() == {1: [4, 5]}
    # A speculative step without masks does not carry the field.
    assert len(codec.encode(both)) - len(codec.encode(spec)) > 12
