"""Model directories of published shapes (config.json only) for benchmarks with random weights.

The shapes live in the package (``conveyor.engine.dummy_model``), where ``conveyor serve
api_server --dummy-weights SHAPE`` finds them too; this module keeps the benchmarks' import
path and the command line:

    python -m benchmarks.dummy_model llama2-7b /tmp/llama2-7b   # prints the directory
"""

from __future__ import annotations

import argparse

from conveyor.engine.dummy_model import SHAPES, param_count, write_model_dir

__all__ = ["SHAPES", "param_count", "write_model_dir"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("dest")
    args = ap.parse_args()
    print(write_model_dir(args.shape, args.dest))


if __name__ == "__main__":
    main()
