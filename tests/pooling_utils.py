"""Pooling checkpoints made with transformers, their reference outputs, and an in-process
engine (the real scheduler and model runner, no sockets) to run pooling requests on."""
from __future__ import annotations

import json
import os

import numpy as np
import torch
from model_utils import ARCHS, save_tiny_tokenizer

from engine_core import EngineCore
from protocol import AddRequest, EngineConfig, PoolingParams, SamplingParams
from worker.model_runner import ModelRunner

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             initializer_range=0.1, eos_token_id=None, bos_token_id=None,
             tie_word_embeddings=False)


def make_classifier(directory: str, arch: str = "llama", num_labels: int = 3, seed: int = 0,
                    tokenizer: bool = False, **overrides) -> str:
    """A tiny random `*ForSequenceClassification` (pad token 0: prompts avoid it, so HF's
    last-non-pad pooling is the last token); with `tokenizer`, model_utils' BPE."""
    import transformers
    config_cls, causal_cls, extra = ARCHS[arch]
    if tokenizer:
        overrides = {"vocab_size": save_tiny_tokenizer(directory), **overrides}
    values = {**SMALL, **extra, "num_labels": num_labels, "pad_token_id": 0, **overrides}
    config = getattr(transformers, config_cls)(**values)
    torch.manual_seed(seed)
    cls = getattr(transformers, causal_cls.replace("ForCausalLM", "ForSequenceClassification"))
    cls(config).eval().save_pretrained(directory)
    return directory


def make_bare_decoder(directory: str, arch: str = "qwen3", pooling: str | None = None,
                      normalize: bool = True, seed: int = 0) -> str:
    """A tiny random `*Model` (names without `model.`, no LM head), as Qwen3-Embedding ships,
    with sentence-transformers' modules.json and pooling config when `pooling` is given."""
    import transformers
    config_cls, causal_cls, extra = ARCHS[arch]
    config = getattr(transformers, config_cls)(**{**SMALL, **extra})
    torch.manual_seed(seed)
    getattr(transformers, causal_cls.replace("ForCausalLM", "Model"))(config).eval() \
        .save_pretrained(directory)
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type":
                    "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type":
                    "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type":
                            "sentence_transformers.models.Normalize"})
        with open(os.path.join(directory, "modules.json"), "w") as f:
            json.dump(modules, f)
        os.makedirs(os.path.join(directory, "1_Pooling"), exist_ok=True)
        modes = {"cls_token": "CLS", "mean_tokens": "MEAN", "lasttoken": "LAST"}
        with open(os.path.join(directory, "1_Pooling", "config.json"), "w") as f:
            json.dump({"word_embedding_dimension": 64, **{
                f"pooling_mode_{m}": name == pooling for m, name in modes.items()}}, f)
    return directory


def hf_hidden(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """transformers' final hidden states [len, hidden] (after the final norm), float32."""
    from transformers import AutoModel
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).last_hidden_state[0].float()


def hf_pooled(hidden: torch.Tensor, pooling: str, normalize: bool) -> np.ndarray:
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling]
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector.numpy()


def hf_classifier_logits(model_dir: str, prompt: list[int]) -> np.ndarray:
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(
        model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().numpy()


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


class PoolingEngine:
    """An EngineCore with a ModelRunner as its executor, in this process."""

    def __init__(self, model: str, **options) -> None:
        options = {"num_gpu_blocks_override": 256, "max_model_len": 256, **options}
        self.config = EngineConfig.create(model=model, **options).with_runner()
        self.runner = ModelRunner(self.config)
        self.engine = EngineCore.from_config(self.config, self.runner, self.runner.num_blocks,
                                             self.runner.max_model_len,
                                             self.runner.model_config.vocab_size)
        self._ids = 0

    def run(self, prompts: list[list[int]], params: PoolingParams | None = None,
            ) -> list:
        """Each prompt's final EngineCoreOutput, in prompt order (all added before step 1)."""
        names = []
        for prompt in prompts:
            name = f"r{self._ids}"
            self._ids += 1
            names.append(name)
            refused = self.engine.handle(AddRequest(
                name, prompt, SamplingParams(max_tokens=1), float(self._ids),
                pooling_params=params or PoolingParams(task=self.config.convert)))
            assert refused == [], refused
        final = {}
        while self.engine.has_work():
            for out in self.engine.step()[1]:
                if out.finished:
                    final[out.request_id] = out
        self.engine.scheduler.check_integrity()
        return [final[name] for name in names]

    def vectors(self, prompts: list[list[int]], params: PoolingParams | None = None,
                ) -> list[np.ndarray]:
        outs = self.run(prompts, params)
        assert all(o.finish_reason == "stop" and o.error is None for o in outs), outs
        return [np.frombuffer(o.pooling_output, "<f4") for o in outs]
