"""Speculative decoding through the real engine processes: greedy output identical to
speculation off (n-gram and draft model, TP 1 and 2, with chunked prefill, preemption, stop
strings, n > 1, logprobs, penalties and min_tokens in play), sampling that keeps the target's
distribution, record/replay, metrics, and configurations refused at startup."""
from __future__ import annotations

import httpx
import msgspec
import numpy as np
import pytest
import torch
from model_utils import CORPUS, make_tiny_model
from server_utils import Server

from launch import LLM, SamplingParams
from replay import journal_tools, replay
from replay.recorded_run import RecordedRun

pytestmark = pytest.mark.slow  # real engine processes

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
# Texts that repeat themselves, so that prompt lookup finds proposals; and others.
TEXTS = [CORPUS[i * 37:i * 37 + 60 + 9 * i] for i in range(10)] + [
    "def add(a, b):\n    return a + b\ndef add(", "x", "print('hello, world')\n" * 3,
    "Pack my box with five dozen liquor jugs!"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    target = make_tiny_model(str(root / "target"), "llama", tokenizer=True)
    # A different random model with the same tokenizer: a poor draft, rarely right.
    draft = make_tiny_model(str(root / "draft"), "llama", seed=7, tokenizer=True,
                            num_hidden_layers=1)
    return target, draft


def _engine(model: str, tp: int = 1, **engine_args) -> LLM:
    """A 16-token budget chunks the prefills; 24 blocks of 8 tokens force preemption."""
    return LLM(model, tensor_parallel_size=tp, dtype="float32", block_size=8,
               max_num_batched_tokens=16, num_gpu_blocks_override=24, max_model_len=256,
               **engine_args)


def _params(llm: LLM) -> list[SamplingParams]:
    """Greedy requests that exercise every feature speculation must keep exact."""
    text = llm.generate(TEXTS[0], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = next(c for c in text[len(text) // 3:] if c.strip())
    r = msgspec.structs.replace
    return [GREEDY, r(GREEDY, stop=[stop]), r(GREEDY, n=2), r(GREEDY, logprobs=2),
            r(GREEDY, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
            r(GREEDY, ignore_eos=False, min_tokens=6, max_tokens=40),
            r(GREEDY, max_tokens=3), GREEDY]


def _run(model: str, tp: int, **engine_args) -> tuple[list, object]:
    with _engine(model, tp, **engine_args) as llm:
        params = _params(llm)
        outs = llm.generate(TEXTS * 2, params * (len(TEXTS) * 2 // len(params)) +
                            params[:len(TEXTS) * 2 % len(params)], use_tqdm=False)
        return outs, llm.engine.stats


def _same(off: list, on: list) -> None:
    for a, b in zip(off, on, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text,
                                                             y.finish_reason), a.prompt
            if x.logprobs is not None:
                for p, q in zip(x.logprobs, y.logprobs, strict=True):
                    assert list(p) == list(q)
                    assert np.allclose([v.logprob for v in p.values()],
                                       [v.logprob for v in q.values()], atol=1e-4)


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def baseline(request, models):
    target, _ = models
    return request.param, _run(target, request.param)[0]


@pytest.mark.parametrize("method", ["ngram", "draft_model", "draft_is_target"])
def test_greedy_output_is_identical_to_speculation_off(baseline, models, method):
    tp, off = baseline
    target, draft = models
    spec = NGRAM if method == "ngram" else {
        "method": "draft_model", "num_speculative_tokens": 3,
        "model": target if method == "draft_is_target" else draft}
    on, stats = _run(target, tp, speculative_config=spec)
    _same(off, on)
    counts = stats.spec_decoding
    assert counts.num_drafts > 0, counts
    if method != "draft_model":  # (the poor draft may never be right)
        assert counts.num_accepted_tokens > 0, counts
    assert stats.num_preemptions > 0, "the cache was meant to be small enough to preempt"
    if method == "draft_is_target":  # the same model proposes what it then accepts (but
        # without the penalties some requests ask for: those it proposes less well)
        assert counts.num_accepted_tokens > 0.8 * counts.num_draft_tokens, counts


def _exact_second_token(model: str, prompt: list[int], temperature: float) -> np.ndarray:
    """The target's distribution of the second generated token, summed over the first."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.inference_mode():
        first = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        vocab = first.shape[0]
        ids = torch.tensor(prompt).repeat(vocab, 1)
        ids = torch.cat([ids, torch.arange(vocab)[:, None]], dim=1)
        second = torch.softmax(hf(ids).logits[:, -1] / temperature, -1)
    return (first @ second).double().numpy()


def test_sampling_with_a_bad_draft_keeps_the_target_distribution(models):
    """The second token (the first one verified against a draft) of many seeded samples,
    against the exact distribution computed with Hugging Face."""
    target, draft = models
    prompt, temperature, draws = [5, 17, 33, 2, 9], 0.7, 10_000
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": draft}
    with LLM(target, dtype="float32", max_model_len=64, max_num_seqs=256,
             speculative_config=spec) as llm:
        outs = llm.generate([{"prompt_token_ids": prompt}] * draws,
                            [SamplingParams(temperature=temperature, seed=i, max_tokens=3,
                                            ignore_eos=True) for i in range(draws)],
                            use_tqdm=False)
        drafts = llm.engine.stats.spec_decoding.num_drafts
    assert drafts >= draws
    counts = np.bincount([o.outputs[0].token_ids[1] for o in outs], minlength=len(
        expected := _exact_second_token(target, prompt, temperature))).astype(np.float64)
    keep = expected * draws >= 5  # rare tokens pooled into one cell
    observed = np.append(counts[keep], counts[~keep].sum())
    probs = np.append(expected[keep], expected[~keep].sum())
    stat = float(((observed - probs * draws) ** 2 / (probs * draws)).sum())
    p_value = float(torch.special.gammaincc(torch.tensor((len(observed) - 1) / 2.0,
                                                         dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    assert p_value > 1e-3, (stat, len(observed))


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_recorded_runs_replay_byte_exact(models, method, tmp_path, capsys):
    target, draft = models
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": draft,
                                            "num_speculative_tokens": 3}
    path = str(tmp_path / "spec.journal")
    with _engine(target, record_path=path, speculative_config=spec) as llm:
        seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True)
        llm.generate(TEXTS, [GREEDY, seeded] * (len(TEXTS) // 2), use_tqdm=False)
    run = RecordedRun(path)
    rows = journal_tools.step_rows(run)
    assert sum(r.drafts for r in rows) > 0 and sum(r.accepted for r in rows) > 0
    assert replay.replay_workers(path) == 0 and replay.replay_scheduler(path) == 0
    assert journal_tools.show(path) == 0
    out = capsys.readouterr().out
    assert "byte-identical" in out and "steps match" in out and "accepted" in out


def test_metrics_count_drafts(models):
    target, _ = models
    server = Server(target, "--dtype", "float32", "--max-model-len", "256",
                    "--served-model-name", "tiny",
                    "--speculative-config", msgspec.json.encode(NGRAM).decode())
    try:
        body = {"model": "tiny", "prompt": "print('hello, world')\n" * 4, "max_tokens": 32,
                "temperature": 0, "ignore_eos": True}
        assert httpx.post(server.url + "/v1/completions", json=body,
                          timeout=60).status_code == 200
        metrics = server.metrics()
    finally:
        assert server.stop() == 0
    names = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
             "vllm:spec_decode_num_accepted_tokens_total")
    drafts, draft_tokens, accepted = (metrics[name] for name in names)
    assert 0 < drafts <= draft_tokens and 0 < accepted <= draft_tokens


@pytest.mark.parametrize("spec, message", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 64}, "num_speculative_tokens must be in"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/nonexistent"},
     "Hugging Face style directory"),
])
def test_bad_configs_fail_at_startup(models, spec, message):
    with pytest.raises(ValueError, match=message):
        LLM(models[0], speculative_config=spec)


def test_a_draft_with_another_vocabulary_is_refused(models, tmp_path):
    other = make_tiny_model(str(tmp_path / "other"), "llama", vocab_size=512)
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": other}
    with pytest.raises(ValueError, match="must share one"):
        LLM(models[0], speculative_config=spec)
