"""Size and encode+decode time of a steady-state decode step, msgspec frame vs pickle.

Targets (issue 2): at most 8 bytes per request and 30 us encode+decode for 256 requests.
Run: python benchmarks/bench_protocol.py [--requests 256]
"""
from __future__ import annotations

import argparse
import pickle

from _common import decode_scheduler, median_us, step

from protocol import Channel, Codec


def decode_step_without_new_blocks(num_requests: int):
    scheduler = decode_scheduler(num_requests)
    while True:  # every 16th step some request opens a block; take a step where none does
        so = step(scheduler)
        if all(b is None for b in so.scheduled_cached_reqs.new_block_ids):
            return so


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    n = parser.parse_args().requests
    so = decode_step_without_new_blocks(n)
    codec = Codec(Channel.CORE_TO_WORKER)
    frame = codec.encode(so)
    assert codec.decode(frame) == so
    blob = pickle.dumps(so, protocol=pickle.HIGHEST_PROTOCOL)
    ours = median_us(lambda: codec.decode(codec.encode(so)))
    enc = median_us(lambda: codec.encode(so))
    theirs = median_us(lambda: pickle.loads(pickle.dumps(so, protocol=pickle.HIGHEST_PROTOCOL)))
    print(f"decode step, {n} running requests, no new blocks (step {so.step})")
    print(f"  msgspec frame : {len(frame):6d} B = {len(frame) / n:5.2f} B/request   "
          f"encode+decode {ours:6.1f} us (encode {enc:.1f} us)")
    print(f"  pickle        : {len(blob):6d} B = {len(blob) / n:5.2f} B/request   "
          f"dumps+loads   {theirs:6.1f} us")
    print(f"  ratio         : {len(blob) / len(frame):.2f}x smaller, {theirs / ours:.2f}x faster")
    print(f"  targets       : <= 8 B/request: {'met' if len(frame) / n <= 8 else 'MISSED'}; "
          f"<= 30 us: {'met' if ours <= 30 else 'MISSED'}")


if __name__ == "__main__":
    main()
