"""Quantization methods by name, and which one a model runs with.

A checkpoint's own method is the `quant_method` of its `quantization_config` ("gguf" for a
GGUF file, "none" for dense checkpoints); `--quantization` picks what runs:
  auto  the checkpoint's (a GGUF file keeps its blocks; a dense checkpoint stays dense)
  gguf  a GGUF file's blocks kept and multiplied as they are (GGUF checkpoints only)
  gguf_a8  the same blocks multiplied with activations quantized to 8 bits per block of 32
        (llama.cpp's arithmetic; NOT exact, opt-in only: `auto` never picks it)
  int8  weight-only int8 quantized at load (dense checkpoints only)
  w8a8  int8 weights quantized at load (per output channel) times activations quantized per
        token to int8 (vLLM's CPU W8A8; dense checkpoints only; NOT exact, opt-in only)
  none  dense weights (a GGUF file's tensors dequantized to float32 at load)
"""
from __future__ import annotations

CHECKPOINT_METHODS = ("none", "gguf")  # what a checkpoint may declare
# what --quantization may ask for
QUANTIZATION_CHOICES = ("auto", "gguf", "gguf_a8", "int8", "w8a8", "none")


def resolve_quantization(requested: str, checkpoint: str) -> str:
    """The method a model runs with: `requested` checked against the checkpoint's method;
    ValueError for a combination that cannot run."""
    if requested not in QUANTIZATION_CHOICES:
        raise ValueError(f"unknown quantization {requested!r}; known: "
                         f"{', '.join(QUANTIZATION_CHOICES)}")
    if requested == "auto":
        return checkpoint
    if requested in ("gguf", "gguf_a8") and checkpoint != "gguf":
        raise ValueError(f"--quantization {requested} needs a GGUF model (a .gguf file or a "
                         "model converted from one); this checkpoint is dense: use int8, w8a8 "
                         "or none")
    if requested in ("int8", "w8a8") and checkpoint != "none":
        alternatives = f"{checkpoint}, gguf_a8 or none" if checkpoint == "gguf" else \
            f"{checkpoint} or none"
        raise ValueError(f"--quantization {requested} quantizes a dense checkpoint at load; "
                         f"this model is already {checkpoint}: use {alternatives}")
    return requested
