"""`deltaserve kernels build`: compile the native CPU kernels now (what a worker otherwise
does before it reports ready on first use), and `deltaserve kernels list`."""
from __future__ import annotations

import argparse
import sys


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kernels", help="the native CPU kernels: build them ahead of time")
    commands = p.add_subparsers(dest="kernels_command", required=True)
    commands.add_parser("build", help="compile every native kernel this CPU and compiler lack "
                                      "(cached: another checkout of the same sources reuses "
                                      "them)")
    commands.add_parser("list", help="each native kernel library and whether it is built")


def run(args: argparse.Namespace) -> int:
    from worker.native.library import cache_dir
    from worker.native.prebuild import declared_libraries, prebuild
    if args.kernels_command == "list":
        for library in declared_libraries():
            print(f"{library.tag:22s} {'built' if library.is_built() else 'not built'}")
        print(f"cache: {cache_dir()}")
        return 0
    report = prebuild(say=lambda line: print(f"deltaserve: {line}", file=sys.stderr,
                                             flush=True))
    if not report.compiled:
        print(f"deltaserve: {report.summary()}", file=sys.stderr)
    return 1 if report.failed else 0
