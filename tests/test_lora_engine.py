"""LoRA through the whole engine, held to Hugging Face + PEFT's greedy tokens: three adapters
and the base model in one batch under chunked prefill, preemption and prefix caching (no block
of one adapter serves another), recorded and replayed byte for byte; at tensor-parallel size
2 (with llama.cpp's GGUF form of an adapter); and adapters loaded and unloaded at run time
through the server."""
from __future__ import annotations

import json
import os

import httpx
import pytest
from lora_utils import make_adapter, peft_greedy, write_gguf_adapter
from model_utils import make_tiny_model
from server_utils import CHAT_TEMPLATE, Server

from launch import LLM, LoRARequest, SamplingParams
from replay.recorded_run import RecordedRun
from replay.replay import replay_scheduler, replay_workers

MAX_TOKENS = 10
SHARED = list(range(3, 43))  # 40 tokens: two full blocks of 16 that every prompt shares


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> tuple[str, dict[str, str]]:
    root = tmp_path_factory.mktemp("lora-engine")
    model = make_tiny_model(str(root / "model"), "llama", tokenizer=True)
    return model, {
        "a1": make_adapter(model, str(root / "a1"), 1),  # every target, r 8
        "a2": make_adapter(model, str(root / "a2"), 2, ["q_proj", "v_proj"], r=4, alpha=8),
        "a3": make_adapter(model, str(root / "a3"), 3, ["up_proj", "down_proj", "o_proj"],
                           r=16, alpha=4, rslora=True)}


def _prompts(names: list[str | None]) -> list[list[int]]:
    return [SHARED + [50 + i, 60 + i] for i in range(len(names))]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mixed_adapters_equal_peft_and_replay(adapters, tmp_path):
    model, paths = adapters
    loras = {n: LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(paths.items())}
    names = [None, "a1", "a2", "a3", "a1", "a2", "a3", None]
    prompts = _prompts(names)
    long = 24  # 42 + 24 tokens: 5 blocks, of which admission reserves the prompt's 3
    refs = peft_greedy(model, [paths.get(n) for n in names], prompts, long)
    journal = str(tmp_path / "run.journal")
    params = SamplingParams(temperature=0.0, max_tokens=long)
    # 16-token steps chunk every prompt; 8 usable blocks make running requests preempt.
    with LLM(model, enable_lora=True, max_loras=3, max_num_batched_tokens=16,
             num_gpu_blocks_override=9, record_path=journal) as llm:
        warm = llm.generate([{"prompt_token_ids": SHARED + [99]}], params, use_tqdm=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                            lora_request=[loras.get(n) for n in names])
        again = [llm.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False,
                              lora_request=loras["a1"])[0] for _ in range(2)]
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert refs[1] != peft_greedy(model, [None], [prompts[1]], long)[0]  # it matters
    assert warm[0].num_cached_tokens == 0 and outs[0].num_cached_tokens == 32  # base: a hit
    first = {n: outs[names.index(n)] for n in loras}
    assert all(o.num_cached_tokens == 0 for o in first.values())  # never another's blocks
    assert again[1].num_cached_tokens == 32  # its own adapter's blocks serve it
    assert all(o.outputs[0].token_ids == refs[1] for o in again)
    assert outs[1].lora_request.lora_name == "a1"
    run = RecordedRun(journal)
    assert any(s.scheduler_output.preempted_req_ids for s in run.steps)
    assert any(s.scheduler_output.total_num_scheduled_tokens == 16 and len(
        s.scheduler_output.scheduled_req_ids) > 1 for s in run.steps)
    assert replay_workers(journal, out=lambda _: None) == 0  # fresh workers read the adapters
    assert replay_scheduler(journal, out=lambda _: None) == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensor_parallel_adapters_equal_peft_with_evictions(adapters, tmp_path):
    model, paths = adapters
    names = ["a1", None, "a3", "a2", "g1"]  # g1: a1 as llama.cpp's GGUF adapter file
    prompts = _prompts(names)
    with open(os.path.join(model, "config.json")) as f:
        twin = write_gguf_adapter(paths["a1"], str(tmp_path / "a1.gguf"), json.load(f))
    refs = peft_greedy(model, [{**paths, "g1": paths["a1"]}.get(n) for n in names], prompts,
                       MAX_TOKENS)
    loras = {n: LoRARequest(n, i + 1, p)
             for i, (n, p) in enumerate({**paths, "g1": twin}.items())}
    # Two adapters per step and two kept loaded: a2 waits for a slot, and one of the three
    # is evicted and read again (cut for its rank again).
    with LLM(model, enable_lora=True, max_loras=2, max_cpu_loras=2,
             tensor_parallel_size=2) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                            use_tqdm=False, lora_request=[loras.get(n) for n in names])
    assert [o.outputs[0].token_ids for o in outs] == refs


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_runtime_load_and_unload_through_the_server(adapters, tmp_path):
    model, paths = adapters
    prompt = _prompts(["a2"])[0]
    (ref,) = peft_greedy(model, [paths["a2"]], [prompt], MAX_TOKENS)
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    server = Server(model, "--enable-lora", "--max-loras", "2", "--lora-modules",
                    f'{{"name": "a1", "path": "{paths["a1"]}", "base_model_name": "{model}"}}',
                    "--allow-runtime-lora-updating", "--chat-template", str(template),
                    api_key="secret")
    try:
        client = httpx.Client(base_url=server.url, headers=server.headers, timeout=60)
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        missing = client.post("/v1/completions", json={**body, "model": "a2"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == \
            "model_not_found" and "'a2'" in missing.json()["error"]["message"]
        load = {"lora_name": "a2", "lora_path": paths["a2"]}
        assert httpx.post(server.url + "/v1/load_lora_adapter", json=load).status_code == 401
        assert client.post("/v1/load_lora_adapter", json=load).status_code == 200
        again = client.post("/v1/load_lora_adapter", json=load)
        assert again.status_code == 400 and "already been loaded" in again.text
        answer = client.post("/v1/completions", json={**body, "model": "a2"}).json()
        assert answer["model"] == "a2"
        tokens = client.post("/tokenize", json={"prompt": answer["choices"][0]["text"]})
        assert tokens.status_code == 200
        with_ids = client.post("/v1/completions", json={**body, "model": "a2",
                                                       "return_token_ids": True}).json()
        assert with_ids["choices"][0]["token_ids"] == ref
        _chat_routes(client)
        cards = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        assert cards["a1"]["parent"] == model and cards["a2"]["root"] == paths["a2"]
        info = [k for k in server.metrics() if k.startswith("vllm:lora_requests_info")]
        assert info and 'max_lora="2"' in info[0]
        _refusals(client, model, tmp_path)
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 200
        assert client.post("/v1/completions", json={**body, "model": "a2"}).status_code == 404
        assert client.post("/v1/unload_lora_adapter",
                           json={"lora_name": "a2"}).status_code == 404
        base = client.post("/v1/completions", json={**body, "model": "a1"})
        assert base.status_code == 200  # the static adapter still serves
    finally:
        server.stop()


def _chat_routes(client: httpx.Client) -> None:
    """Chat completions, Responses and Messages pick the adapter by `model` and name it."""
    messages = [{"role": "user", "content": "hi"}]
    chat = client.post("/v1/chat/completions", json={"model": "a2", "messages": messages,
                                                     "max_tokens": 4})
    responses = client.post("/v1/responses", json={"model": "a2", "input": "hi",
                                                   "max_output_tokens": 4})
    anthropic = client.post("/v1/messages", json={"model": "a2", "messages": messages,
                                                  "max_tokens": 4})
    for answer in (chat, responses, anthropic):
        assert answer.status_code == 200 and answer.json()["model"] == "a2", answer.text


def _refusals(client: httpx.Client, model: str, tmp_path) -> None:
    """Each bad load is a 400 naming why (404 without an adapter), and serving goes on."""
    big = make_adapter(model, str(tmp_path / "big"), 5, ["q_proj"], r=32)
    other = make_tiny_model(str(tmp_path / "other"), "llama", hidden_size=32,
                            intermediate_size=64)
    foreign = make_adapter(other, str(tmp_path / "foreign"), 6, ["q_proj"])
    cases = {big: (400, "more than --max-lora-rank 16"), foreign: (400, "another base model"),
             str(tmp_path / "none"): (404, "not found")}
    for path, (status, reason) in cases.items():
        answer = client.post("/v1/load_lora_adapter",
                             json={"lora_name": os.path.basename(path), "lora_path": path})
        assert answer.status_code == status and reason in answer.json()["error"]["message"]
    conflict = client.post("/v1/load_lora_adapter", json={"lora_name": model,
                                                          "lora_path": str(tmp_path)})
    assert conflict.status_code == 400 and "conflicts with a served base model" in conflict.text
