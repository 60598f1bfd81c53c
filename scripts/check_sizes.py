#!/usr/bin/env python3
"""Fails when a file in dist/ passes 450 lines or a function there passes 80.

dist/ is the code people read to learn how distributed training works: a reader should
find one idea a file and see a function whole. A function is counted from its opening
line at column 0 (clang-format puts namespace-level definitions there) to its closing
brace at column 0; members defined inside a class body are short by construction here.
Usage: scripts/check_sizes.py [project root]
"""
import pathlib
import re
import sys

MAX_FILE, MAX_FUNCTION = 450, 80
SOURCES = {".h", ".cpp", ".cu"}
# A definition's first line: a name and an argument list at column 0, not a declaration.
START = re.compile(r"^(?!namespace|struct|class|enum|using|template|#|//|\}|static_assert)[A-Za-z_].*\(")


def functions(lines):
    """(name line, first line number, length) for every function defined at column 0."""
    start = None
    for number, line in enumerate(lines, 1):
        if start is None and START.match(line) and not line.rstrip().endswith(";"):
            start = number
        elif start is not None and line.startswith("}"):
            yield lines[start - 1].strip(), start, number - start + 1
            start = None
        elif start is not None and line.rstrip().endswith(";") and number == start:
            start = None


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent)
    problems = []
    for path in sorted((root / "dist").rglob("*")):
        if path.suffix not in SOURCES:
            continue
        rel = path.relative_to(root).as_posix()
        lines = path.read_text(errors="replace").splitlines()
        if len(lines) > MAX_FILE:
            problems.append(f"{rel}: {len(lines)} lines (at most {MAX_FILE}: split it by concept)")
        for name, first, length in functions(lines):
            if length > MAX_FUNCTION:
                problems.append(f"{rel}:{first}: {length} lines in {name[:70]} (at most {MAX_FUNCTION})")
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"dist/: every file within {MAX_FILE} lines, every function within {MAX_FUNCTION}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
