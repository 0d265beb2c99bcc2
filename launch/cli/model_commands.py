"""`deltaserve download NAME` and `deltaserve convert FILE.gguf OUT_DIR`."""
from __future__ import annotations

import argparse


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from launch.model_cache.cache import MODELS
    terms = "; ".join(f"{name}: {source.terms}" for name, source in sorted(MODELS.items())
                      if source.terms)
    d = sub.add_parser("download", help="fetch and convert a named model into the cache "
                                        "(prints its directory)",
                       epilog=f"Terms: {terms}." if terms else None)
    d.add_argument("name", choices=sorted(MODELS),
                   help="; ".join(f"{name}: {source.description} ({source.license})"
                                  for name, source in sorted(MODELS.items())))
    c = sub.add_parser("convert", help="convert a GGUF Llama or Gemma 3 file to a Hugging "
                                       "Face directory")
    c.add_argument("gguf_file")
    c.add_argument("out_dir")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def run(args: argparse.Namespace) -> int:
    """Run `download` or `convert`; errors are ValueErrors, for the caller to report."""
    if args.command == "download":
        import sys

        from launch.model_cache.cache import MODELS, download_model
        if MODELS[args.name].terms:
            print(f"deltaserve: {MODELS[args.name].terms}", file=sys.stderr)
        print(download_model(args.name))
        return 0
    from launch.model_cache.gguf import convert_gguf
    print(convert_gguf(args.gguf_file, args.out_dir, args.dtype))
    return 0
