"""The pieces of a Qwen3-MoE-shaped decode step apart (issue 31; the shape of bench_moe.py's
model: 8 layers, hidden 1024, 64 experts of 512, top 8, 16/2 heads of 128, vocabulary 32,000),
random weights, 2 threads, median of --repeats calls each, at 1 and 32 tokens:

  moe        the fused MoE kernel over 8 layers (routing from random logits), GB/s of the
             active experts' weights it reads
  proj       the attention's qkv and o projections of 8 layers: oneDNN-packed, and for a
             16-bit --dtype at 1 token the plain rows through gguf_matmul (what a bf16
             layer runs up to 8 rows now); 40 layers' weights cycled, so they come from
             memory, not from the 260 MB L3 as 8 layers' 75 MB would
  lm_head    the LM head: float32 oneDNN (the old bf16 path's copy) and, for a 16-bit
             --dtype, the table itself through gguf_matmul (what a bf16 head runs now)

Run: python benchmarks/bench_moe_kernel.py [--dtype bfloat16|float32] [--repeats 20]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from worker.layers import onednn_linear
from worker.layers.fused_moe.router import select_experts
from worker.native import fused_moe, gguf_ops

E, H, INTER, LAYERS, TOP_K, VOCAB, QKV, O_IN = 64, 1024, 512, 8, 8, 32000, 2560, 2048
PROJ_SETS = 40  # layers' projections cycled (375 MB in bf16: more than the L3)


def timed(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    size = torch.finfo(dtype).bits // 8
    moe = [fused_moe.bind_stacked((torch.randn(E, 2 * INTER, H) * .05).to(dtype),
                                  (torch.randn(E, H, INTER) * .05).to(dtype), H)
           for _ in range(LAYERS)]
    plain = [((torch.randn(QKV, H) * .05).to(dtype), (torch.randn(H, O_IN) * .05).to(dtype))
             for _ in range(PROJ_SETS)]
    proj = [(onednn_linear.pack(a), onednn_linear.pack(b)) for a, b in plain]
    table = torch.randn(VOCAB, H) * .05
    head32, head16, ops = onednn_linear.pack(table), table.to(dtype), gguf_ops.native()
    for tokens in (1, 32):
        x = torch.randn(tokens, H).to(dtype).float()
        weights, ids = select_experts(torch.randn(tokens, E), TOP_K, True)
        seconds = timed(lambda: [layer(x, weights, ids) for layer in moe], args.repeats)
        active = LAYERS * ids.unique().numel() * 3 * H * INTER * size
        print(f"{tokens:2d} tokens  moe      {seconds * 1e3:7.2f} ms  {active / seconds / 1e9:5.1f} "
              f"GB/s ({ids.unique().numel()} experts a layer)", flush=True)
        xa, xo = torch.randn(tokens, H).to(dtype), torch.randn(tokens, O_IN).to(dtype)
        seconds = timed(lambda: [(onednn_linear.linear(xa, a), onednn_linear.linear(xo, b))
                                 for a, b in proj], args.repeats) * LAYERS / PROJ_SETS
        print(f"{tokens:2d} tokens  proj     {seconds * 1e3:7.2f} ms oneDNN", flush=True)
        if size == 2 and ops is not None and tokens <= gguf_ops.DENSE_ROWS:
            seconds = timed(lambda: [(ops.dense_matmul(xa.float(), a).to(dtype),
                                      ops.dense_matmul(xo.float(), b).to(dtype))
                                     for a, b in plain], args.repeats) * LAYERS / PROJ_SETS
            print(f"{tokens:2d} tokens  proj     {seconds * 1e3:7.2f} ms plain rows "
                  "(gguf_matmul)", flush=True)
        xf = torch.randn(tokens, H)
        seconds = timed(lambda: onednn_linear.linear(xf, head32), args.repeats)
        print(f"{tokens:2d} tokens  lm_head  {seconds * 1e3:7.2f} ms float32 oneDNN", flush=True)
        if size == 2 and ops is not None:
            seconds = timed(lambda: ops.dense_matmul(xf, head16), args.repeats)
            print(f"{tokens:2d} tokens  lm_head  {seconds * 1e3:7.2f} ms {args.dtype} table "
                  "(gguf_matmul)", flush=True)


if __name__ == "__main__":
    main()
