"""KV-cache events: vLLM 0.32's wire format, checked against the block pool that emitted them.

`Mirror*` below is vLLM's `vllm.distributed.kv_events` as a consumer would copy it (names,
field order, tags, array_like batch); `test_vllm_decodes_our_batches` also decodes with vLLM's
own classes in the peer venv.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Any

import msgspec
import pytest
import zmq
from scripted_worker import ScriptedWorker

from common.process import free_port
from engine_core.config import CacheConfig, SchedulerConfig
from engine_core.engine_core import EngineCore
from engine_core.kv_cache.kv_cache_manager import hash_block_tokens
from engine_core.kv_event_publisher import END_SEQ, binds, offset_endpoint
from engine_core.sched.scheduler import Scheduler
from launch import LLM, SamplingParams
from protocol import AddRequest
from protocol import SamplingParams as WireParams
from protocol.kv_events import KVEventBatch, external_block_hash, parse_kv_events_config
from replay.replay import open_run

MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "launch", "model_cache", "default_model")
PEER_PYTHON = os.environ.get("DELTASERVE_VLLM_PYTHON", "/work/peer/venv/bin/python")


class MirrorEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(MirrorEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(MirrorEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(MirrorEvent):
    pass


class MirrorBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(MirrorBatch)


class Consumer:
    """What a cache-aware router keeps: the live hashes, each checked on arrival (a stored
    block's hash must be the chained hash of its tokens after its parent; a removed hash
    must be live)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.live: set[int] = set()
        self.digest_of: dict[int, bytes] = {}  # external hash -> our digest, recomputed
        self.stored = self.removed = self.cleared = 0

    def apply(self, batch: MirrorBatch) -> None:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.live.clear()
                self.cleared += 1
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.live, "removed a hash never stored"
                self.live -= set(event.block_hashes)
                self.removed += len(event.block_hashes)
            else:
                self._store(event)

    def _store(self, event: BlockStored) -> None:
        bs = event.block_size
        assert bs == self.block_size and event.medium == "GPU" and event.lora_id is None
        assert len(event.token_ids) == bs * len(event.block_hashes)
        parent = None if event.parent_block_hash is None else \
            self.digest_of[event.parent_block_hash]
        for i, block_hash in enumerate(event.block_hashes):
            parent = hash_block_tokens(parent, event.token_ids[i * bs:(i + 1) * bs])
            assert external_block_hash(parent) == block_hash, "tokens do not hash to the block"
            assert block_hash not in self.live, "stored a hash that is already live"
            self.digest_of[block_hash] = parent
            self.live.add(block_hash)
        self.stored += len(event.block_hashes)


def _pool_hashes(engine: EngineCore) -> set[int]:
    table = engine.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    return {external_block_hash(h) for h in table}


def _prompts(n: int, shared: int, own: int, seed: int = 0) -> list[list[int]]:
    """n prompts sharing a `shared`-token prefix, then `own` tokens of their own."""
    prefix = [(seed * 7 + i * 13) % 250 + 3 for i in range(shared)]
    return [prefix + [(j * 31 + i * 17 + seed) % 250 + 3 for i in range(own)] for j in range(n)]


def test_block_pool_events_follow_the_pool_step_by_step():
    """In process: after every step, the events so far rebuild exactly the pool's hash map,
    across prefix hits, evictions and preemptions."""
    block_size, num_blocks = 4, 24
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                          max_model_len=128),
                          CacheConfig(block_size, num_blocks, True), vocab_size=1000)
    engine = EngineCore(scheduler, ScriptedWorker(num_blocks, block_size))
    engine.record_kv_events()
    consumer = Consumer(block_size)
    prompts = _prompts(6, 12, 9) + _prompts(6, 10, 7, seed=1)
    for i, prompt in enumerate(prompts):
        engine.handle(AddRequest(f"r{i}", prompt, WireParams(max_tokens=12, ignore_eos=True),
                                 float(i)))
    hits = 0
    while engine.has_work():
        _, outputs = engine.step()
        hits += sum(out.num_cached_tokens > 0 for out in outputs)
        for payload in [msgspec.msgpack.encode(KVEventBatch(0.0, engine.take_kv_events(), 0))]:
            consumer.apply(DECODER.decode(payload))
        assert consumer.live == _pool_hashes(engine)
    engine.scheduler.check_integrity()
    assert hits and consumer.removed and engine.scheduler.num_preemptions
    assert consumer.cleared == 1


def _subscribe(context: zmq.Context, endpoint: str) -> zmq.Socket:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(endpoint)
    return sub


def _drain(sub: zmq.Socket, quiet_s: float = 1.0) -> dict[int, tuple[bytes, bytes]]:
    got = {}
    while sub.poll(int(quiet_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        got[int.from_bytes(seq, "big")] = (topic, payload)
    return got


def _replay(context: zmq.Context, endpoint: str, start: int) -> dict[int, bytes]:
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    got = {}
    try:
        while dealer.poll(5000):
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return got
            got[int.from_bytes(seq, "big")] = payload
        raise AssertionError("the replay endpoint did not finish its answer")
    finally:
        dealer.close(linger=0)


def _stranger(context: zmq.Context, endpoint: str) -> None:
    """Junk on the replay socket: wrong frame counts, a short sequence number, a huge
    frame (over the request limit)."""
    junk = context.socket(zmq.DEALER)
    junk.connect(endpoint)
    junk.send_multipart([b"hello"])
    junk.send_multipart([b"", b"\x01\x02"])
    junk.send_multipart([b"", os.urandom(1 << 20)])
    time.sleep(0.2)
    junk.close(linger=0)


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
    """A run with prefix hits and evictions, its events (seq -> payload) and its journal."""
    port, replay_port = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}",
              "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": "kv"}
    journal = str(tmp_path_factory.mktemp("kv") / "run.journal")
    context = zmq.Context()
    sub = _subscribe(context, config["endpoint"])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    try:
        with LLM(MODEL, kv_events_config=config, num_gpu_blocks_override=12, block_size=16,
                 max_num_seqs=4, record_path=journal) as llm:
            cached = 0
            for seed in range(4):  # each round evicts the last one's blocks
                prompts = [{"prompt_token_ids": p} for p in _prompts(3, 40, 8, seed)]
                outs = llm.generate(prompts, params, use_tqdm=False)
                cached += sum(out.num_cached_tokens for out in outs)
            _stranger(context, config["replay_endpoint"])
            assert llm.generate("still serving", params, use_tqdm=False)[0].outputs
            got = _drain(sub)
            replayed = _replay(context, config["replay_endpoint"], 0)
        assert cached > 0
        yield got, replayed, journal
    finally:
        sub.close(linger=0)
        context.term()


def test_events_are_gap_free_and_replay_fills_what_the_subscriber_missed(recorded_run):
    got, replayed, _ = recorded_run
    assert sorted(replayed) == list(range(len(replayed)))  # 0, 1, 2, ... with no gap
    assert set(got) <= set(replayed) and len(got) > 1
    assert all(topic == b"kv" and replayed[seq] == payload for seq, (topic, payload)
               in got.items())


def test_events_match_the_block_pool_of_the_run(recorded_run):
    """The engine's events, decoded by the mirror, equal what the same run's block pool
    emits when its journal is replayed into a fresh scheduler, and rebuild its hash map."""
    _, replayed, journal = recorded_run
    batches = [DECODER.decode(replayed[seq]) for seq in sorted(replayed)]
    assert all(b.data_parallel_rank == 0 for b in batches)
    consumer = Consumer(16)
    for batch in batches:
        consumer.apply(batch)
    engine, events = _replay_pool(journal)
    published = [e for b in batches for e in b.events]
    assert published == [DECODER.decode(msgspec.msgpack.encode(KVEventBatch(0.0, [e])))
                         .events[0] for e in events]
    assert consumer.live == _pool_hashes(engine)
    assert consumer.cleared == 1 and consumer.stored and consumer.removed


def _replay_pool(journal: str) -> tuple[EngineCore, list]:
    """The recorded run's scheduler, rebuilt from its journal, with its KV events."""
    from protocol import ModelRunnerOutput, SchedulerOutput
    run = open_run(journal, out=lambda *_: None)
    engine = EngineCore.from_config(run.header.engine_config, None, run.ready.num_blocks,
                                    run.ready.max_model_len, run.ready.vocab_size,
                                    run.ready.sliding_windows)
    engine.record_kv_events()
    pending, events = {}, []
    for record in run.records:
        for message in run.frontend_messages(record):
            engine.handle(message)
        if isinstance(record.message, SchedulerOutput):
            decided = engine.scheduler.schedule()
            pending[decided.step] = decided
        elif isinstance(record.message, ModelRunnerOutput) and record.peer == 0 \
                and record.message.step in pending:
            engine.scheduler.update_from_output(pending.pop(record.message.step),
                                                record.message)
        events += engine.take_kv_events()
    return engine, events


def test_vllm_decodes_our_batches(recorded_run, tmp_path):
    """vLLM 0.32's own KVEventBatch decodes every batch and re-encodes it to our bytes."""
    if not os.path.exists(PEER_PYTHON):
        pytest.skip(f"no vLLM peer venv at {PEER_PYTHON} (set DELTASERVE_VLLM_PYTHON)")
    _, replayed, _ = recorded_run
    path = tmp_path / "batches.msgpack"
    path.write_bytes(msgspec.msgpack.encode([replayed[s] for s in sorted(replayed)]))
    script = (
        "import sys, msgspec\n"
        "from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved\n"
        "payloads = msgspec.msgpack.decode(open(sys.argv[1], 'rb').read())\n"
        "dec = msgspec.msgpack.Decoder(KVEventBatch)\n"
        "kinds = {}\n"
        "for p in payloads:\n"
        "    batch = dec.decode(p)\n"
        "    assert msgspec.msgpack.encode(batch) == p, 'vLLM re-encodes differently'\n"
        "    for e in batch.events:\n"
        "        kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1\n"
        "print(sorted(kinds.items()))\n")
    env = dict(os.environ, VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    done = subprocess.run([PEER_PYTHON, "-c", script, str(path)], capture_output=True,
                          text=True, timeout=120, env=env, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    kinds = dict(eval(done.stdout.strip().splitlines()[-1]))
    assert kinds["AllBlocksCleared"] == 1 and kinds["BlockStored"] and kinds["BlockRemoved"]


def _consecutive_free_ports() -> int:
    """A port p on loopback with p + 1 free too (at the time of asking)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise AssertionError("no two consecutive free ports")


def test_each_replica_publishes_on_its_own_port():
    """Data-parallel rank r publishes on the endpoint's port + r, naming itself."""
    port = _consecutive_free_ports()
    context = zmq.Context()
    subs = [_subscribe(context, f"tcp://127.0.0.1:{port + rank}") for rank in (0, 1)]
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}",
              "topic": "kv"}
    try:
        with LLM(MODEL, data_parallel_size=2, kv_events_config=config) as llm:
            prompts = [{"prompt_token_ids": p} for p in _prompts(4, 40, 8)]
            llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
            got = [_drain(sub) for sub in subs]
    finally:
        for sub in subs:
            sub.close(linger=0)
        context.term()
    for rank, batches in enumerate(got):
        decoded = [DECODER.decode(payload) for _, payload in batches.values()]
        assert decoded and all(b.data_parallel_rank == rank for b in decoded)
        assert any(isinstance(e, BlockStored) for b in decoded for e in b.events)


def test_endpoints_and_config():
    assert offset_endpoint("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert binds("tcp://127.0.0.1:5557") and binds("tcp://*:5557") and binds("ipc:///x")
    assert not binds("tcp://10.1.2.3:5557") and not binds("tcp://router.example:5557")
    assert external_block_hash(bytes(range(16))) == int.from_bytes(bytes(range(8, 16)), "big")
    config = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "zmq"}')
    assert config.enabled and config.endpoint == "tcp://127.0.0.1:5557"
    assert not parse_kv_events_config({"enable_kv_cache_events": False}).enabled
    for bad, message in (("{not json", "not valid JSON"), ('{"topics": "x"}', "unknown field"),
                         ('{"buffer_steps": 0}', "at least 1"),
                         ('{"endpoint": "http://x"}', "tcp://")):
        with pytest.raises(ValueError, match=message):
            parse_kv_events_config(bad)


def test_malformed_config_is_one_line_on_the_command_line():
    done = subprocess.run([sys.executable, "-m", "launch", "generate", "--prompt", "x",
                           "--model", MODEL, "--kv-events-config", '{"enable_kv_cache_events"'],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--kv-events-config: invalid JSON" in done.stderr
    assert "Traceback" not in done.stderr
