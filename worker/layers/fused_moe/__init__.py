"""Mixture-of-experts layers: routing (router.py) and the experts of a layer as one fused
native product (layer.py, worker/kernels/fused_moe.cpp); their weights come from the
quantization configs' MoE methods."""
