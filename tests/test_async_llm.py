"""`AsyncLLM` in-process: streams, continuous batching, abort, engine death (and the app's
answers once the engine is dead)."""
from __future__ import annotations

import asyncio
import time

import httpx
import psutil
import pytest
from model_utils import make_tiny_model

from launch import AsyncLLM, EngineDeadError, RequestOutputKind, SamplingParams
from launch.entrypoints.openai.api_server import build_app

pytestmark = pytest.mark.slow
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("async") / "tiny"), tokenizer=True,
                           max_position_embeddings=512)
    engine = AsyncLLM(path, dtype="float32", max_model_len=512)
    yield engine
    engine.shutdown()


async def _collect(engine: AsyncLLM, prompt: str, params: SamplingParams, rid: str,
                   kind: RequestOutputKind) -> list:
    return [out async for out in engine.generate(prompt, params, rid, output_kind=kind)]


def test_delta_cumulative_and_final_only_agree(engine):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, n=2, seed=1,
                            stop=["ab"], include_stop_str_in_output=True)

    async def main():
        return await asyncio.gather(*(
            _collect(engine, "def add(a, b):", params, f"agree-{kind.value}", kind)
            for kind in RequestOutputKind))
    cumulative, delta, final = asyncio.run(main())
    assert len(final) == 1 and final[0].finished and cumulative[-1].finished
    for i in range(2):
        text = final[0].outputs[i].text
        assert cumulative[-1].outputs[i].text == text
        assert "".join(out.outputs[i].text for out in delta) == text
        assert sum((out.outputs[i].token_ids for out in delta), []) == \
            final[0].outputs[i].token_ids
    assert len(cumulative) > 1, "outputs should stream as tokens arrive"


def test_requests_join_the_running_batch_and_abort(engine):
    async def main():
        first = engine.generate("x", LONG, "long", output_kind=RequestOutputKind.DELTA)
        await first.__anext__()
        t0 = time.monotonic()
        short = await _collect(engine, "y", SamplingParams(max_tokens=3), "short",
                               RequestOutputKind.CUMULATIVE)
        assert "long" in engine.streams, "the short request should not wait for the long one"
        await engine.abort("long")
        rest = [out async for out in first]
        return short, rest, time.monotonic() - t0
    short, rest, _ = asyncio.run(main())
    assert short[-1].outputs[0].finish_reason == "length"
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert not engine.streams


def test_duplicate_ids_and_bad_params_raise(engine):
    async def main():
        gen = engine.generate("x", LONG, "dup")
        await gen.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await engine.generate("x", LONG, "dup").__anext__()
        await gen.aclose()  # a consumer that stops early aborts its request
        assert "dup" not in engine.streams
        with pytest.raises(ValueError, match="top_p"):
            await engine.generate("x", SamplingParams(top_p=2.0)).__anext__()
    asyncio.run(main())


def test_engine_death_ends_every_stream(engine):
    async def main():
        gens = [engine.generate("x", LONG, f"dying-{i}") for i in range(3)]
        for gen in gens:
            await gen.__anext__()
        worker = next(p for p in psutil.Process(engine.engine.proc.pid).children()
                      if "worker_0" in " ".join(p.cmdline()))
        worker.kill()
        t0 = time.monotonic()
        errors = []
        for gen in gens:
            with pytest.raises(EngineDeadError) as info:
                async for _ in gen:
                    pass
            errors.append(info.value)
        took = time.monotonic() - t0
        with pytest.raises(EngineDeadError):
            await engine.generate("x", LONG).__anext__()
        app = build_app(engine, "tiny", owns_engine=False)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                     base_url="http://t") as client:
            health = await client.get("/health")
            completion = await client.post("/v1/completions", json={"prompt": "x"})
        return errors, took, health, completion
    errors, took, health, completion = asyncio.run(main())
    assert all(e.process == errors[0].process for e in errors)
    assert "worker" in errors[0].process or "worker" in str(errors[0]), errors[0]
    assert took < 5.0
    assert health.status_code == 503 and completion.status_code == 503
    assert completion.json()["error"]["code"] == "engine_unavailable"
