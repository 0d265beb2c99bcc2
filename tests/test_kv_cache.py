"""The KV cache's size (worker/kv_cache.py): by default a quarter of what the host can give a
rank (available memory, the room under a cgroup memory limit, `DELTASERVE_MEMORY_LIMIT`:
worker/host/memory.py), at most 4 GiB; the startup line says where the figure came from, and
a budget that holds fewer than 2 blocks stops the engine with an error that says why."""
from __future__ import annotations

import functools

import pytest
import torch
from model_utils import make_tiny_model
from test_host import _write

from common.byte_size import byte_size
from engine_core.workers.group_startup import WorkerCapacity
from launch import LLM, SamplingParams
from launch.errors import EngineDeadError
from worker.host import memory
from worker.host.cgroup import cgroup_memory_room
from worker.kv_cache import determine_num_blocks
from worker.models import footprint
from worker.models.registry import load_model_config

CPU = torch.device("cpu")
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("llama") / "m"), "llama")


def _block_bytes(model_dir: str) -> int:
    """One block of the tiny float32 model at one rank (its spec, counted from the config)."""
    return footprint.kv_block_bytes(load_model_config(model_dir), BLOCK_SIZE, 1, 4)


def test_default_budget_is_a_quarter_of_the_smallest_figure(monkeypatch):
    monkeypatch.setenv(memory.LIMIT_ENV, str(400 << 20))
    size = determine_num_blocks(1 << 20, CPU, max_useful=10_000)
    assert size.num_blocks == 100 and memory.LIMIT_ENV in size.reason
    size = determine_num_blocks(1 << 20, CPU, max_useful=10_000, world_size=2)
    assert size.num_blocks == 50 and "over 2 ranks" in size.reason
    assert determine_num_blocks(1 << 20, CPU, max_useful=30).num_blocks == 30
    given = determine_num_blocks(1 << 20, CPU, max_useful=10_000, kv_cache_memory_bytes=5 << 20)
    assert given.num_blocks == 5 and "kv_cache_memory_bytes" in given.reason


def test_default_budget_is_at_most_4_gib(monkeypatch):
    monkeypatch.delenv(memory.LIMIT_ENV, raising=False)
    if memory.available_memory()[0] < 16 << 30:
        pytest.skip("this host gives less than 16 GiB: its quarter is under the 4 GiB cap")
    size = determine_num_blocks(1 << 20, CPU, max_useful=1 << 20)
    assert size.num_blocks == 4096 and "CPU default" in size.reason


def test_default_budget_counts_the_cgroup_memory_limit(monkeypatch, tmp_path):
    """A container's limit, not the host's memory psutil reports, bounds the default (read
    from a cgroup v2 tree laid out as the kernel does: 1 GiB limit, 200 MiB in use)."""
    monkeypatch.delenv(memory.LIMIT_ENV, raising=False)
    _write(tmp_path / "proc", "0::/job\n")
    _write(tmp_path / "fs/job/memory.max", f"{1 << 30}\n")
    _write(tmp_path / "fs/job/memory.current", f"{200 << 20}\n")
    monkeypatch.setattr(memory, "cgroup_memory_room", functools.partial(
        cgroup_memory_room, tmp_path / "fs", tmp_path / "proc"))
    assert memory.available_memory() == (824 << 20, "room under the cgroup memory limit")
    size = determine_num_blocks(1 << 20, CPU, max_useful=10_000)
    assert size.num_blocks == 206 and "cgroup memory limit" in size.reason


@pytest.mark.slow
def test_engine_sizes_its_cache_within_the_memory_limit(tiny, monkeypatch, capfd):
    """A real engine under `DELTASERVE_MEMORY_LIMIT` holds a quarter of it in blocks (the
    cache, not the 4 GiB default or the host's free memory), says so, and serves."""
    limit = 4 * 40 * _block_bytes(tiny) + 100
    monkeypatch.setenv(memory.LIMIT_ENV, str(limit))
    with LLM(tiny, dtype="float32", block_size=BLOCK_SIZE, max_model_len=256) as llm:
        assert llm.inputs.ready.num_blocks == 40
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    err = capfd.readouterr().err
    assert f"KV cache: 40 blocks of {BLOCK_SIZE} tokens" in err
    block = _block_bytes(tiny)
    assert (f"40 KV blocks of {BLOCK_SIZE} tokens, {byte_size(40 * block)} "
            f"({byte_size(block)} a block)\n") in err  # the engine core's ready line
    assert f"({memory.LIMIT_ENV})" in err.split("KV cache: 40 blocks", 1)[1].splitlines()[0]


def test_the_ready_lines_give_the_cache_in_bytes():
    """The engine core's lines: the whole cache and one block over every rank, and per KV
    layer group the bytes of the blocks one sequence holds (every group's block the same)."""
    ready = WorkerCapacity(num_blocks=1000, max_model_len=4096, vocab_size=256,
                           attention_backend="cpu", sliding_windows=(0, 512),
                           block_bytes=256 << 10)
    assert ready.kv_size(2) == ", 250.0 MiB (256.0 KiB a block over 2 ranks)"
    assert ready.kv_size(1) == ", 250.0 MiB (256.0 KiB a block)"
    assert ready.group_sizes([256, 33]) == " (64.0 MiB, 8.2 MiB)"
    unsaid = WorkerCapacity(1000, 4096, 256, "cpu")  # a worker that did not say
    assert unsaid.kv_size(1) == "" and unsaid.group_sizes([256]) == ""


@pytest.mark.slow
def test_engine_that_cannot_hold_two_blocks_says_why(tiny, monkeypatch):
    monkeypatch.setenv(memory.LIMIT_ENV, str(4 * _block_bytes(tiny)))  # a quarter: one block
    with pytest.raises(
            EngineDeadError, match=r"worker_0 failed to start: ValueError: a KV cache budget of "
                                   rf".*\({memory.LIMIT_ENV}\)\) holds 1 block of .* at least 2 "
                                   r"are needed.*kv_cache_memory_bytes"):
        LLM(tiny, dtype="float32", block_size=BLOCK_SIZE, max_model_len=256)
