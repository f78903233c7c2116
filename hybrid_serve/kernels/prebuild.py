"""Build the C++ CPU kernels ahead of use: `python -m hybrid_serve.kernels.prebuild`.

With no flag, builds and loads this CPU's level (or `--level NAME`), as the server will at
start: exit 1 with the compiler's first error where a compiler is present and the build fails
(`make install` stops there), 0 with a warning where there is no compiler (the torch references
serve). `--all` compiles every level of this machine's architecture without loading any (a CPU
image prebuilds them all, so a container never compiles at start-up).
"""

from __future__ import annotations

import argparse
import logging
import sys

from hybrid_serve.kernels import cpp_build, cpu_levels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hybrid_serve.kernels.prebuild",
        description="Build the C++ CPU kernels: this CPU's level (default), one named level, or "
        "every level of this architecture (--all, compiled but not loaded).",
    )
    parser.add_argument("--level", default=None, help="a level name or auto (default: settings)")
    parser.add_argument("--all", action="store_true", help="every level of this architecture")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.all:
            cache = cpp_build.cache_dir()
            for level in cpu_levels.levels():
                print(f"{level.name}: {cpp_build.build(level, cache)}")
            return 0
        if cpp_build.load(args.level) is None:
            err = cpp_build.load_error()
            if isinstance(err, cpp_build.NoCompiler):
                return 0  # warned: the references serve
            print(f"error: {err}", file=sys.stderr)
            return 1
    except cpp_build.NoCompiler as e:
        print(f"warning: {e}; the torch references will serve", file=sys.stderr)
    except (cpp_build.BuildError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
