#!/usr/bin/env python3
"""Fails when an #include breaks the layering of docs/design.md ("Layers").

Layers, low to high: tensor/, cuda/ (it may include tensor/, not the other way round),
autograd/, nn/, optim/, dist/comm/, dist/tensor/, dist/zero/, dist/pipeline/. A library file includes from its own
layer or lower ones, never from the programs (examples/, bench/, tests/, zerograd.h),
which may include anything. Outside cuda/ and dist/ no library file includes a CUDA
header, so a build without CUDA needs no #ifdef there.
Usage: scripts/check_layers.py [project root]
"""
import pathlib
import re
import sys

LAYERS = ["tensor/", "cuda/", "autograd/", "nn/", "optim/", "dist/comm/", "dist/tensor/", "dist/zero/", "dist/pipeline/"]
PROGRAMS = ["examples/", "bench/", "tests/", "zerograd.h"]
CUDA_ALLOWED = ["cuda/", "dist/"]
SOURCES = {".h", ".hpp", ".cuh", ".cpp", ".cc", ".cu"}
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
# The toolkit's and its libraries' headers: runtime, cuBLAS(Lt), cuDNN (and its
# frontend), NCCL, NVTX, NVRTC, and libcu++ / CUB / Thrust.
CUDA_HEADER = re.compile(r"^(cuda[^/]*\.h|cublas|cudnn|curand|cufft|cusparse|cusolver|nccl\.h|nvrtc\.h|nvToolsExt"
                         r"|nvtx3/|cuda/|cub/|thrust/)")


def rank(path):
    """The layer index of a root-relative path; len(LAYERS) for the programs; None elsewhere."""
    if any(path == p or path.startswith(p) for p in PROGRAMS):
        return len(LAYERS)
    return next((i for i, prefix in enumerate(LAYERS) if path.startswith(prefix)), None)


def name(index):
    return LAYERS[index].rstrip("/") if index < len(LAYERS) else "the programs"


def check(root, path):
    rel = path.relative_to(root).as_posix()
    own = rank(rel)
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        match = INCLUDE.match(line)
        if not match:
            continue
        quoted, target = match.group(1) == '"', match.group(2)
        where = f"{rel}:{number}: {line.strip()}"
        # A quoted include names a path from the project root (the include root), or
        # one beside the including file.
        project = None
        if quoted and (root / target).is_file():
            project = target
        elif quoted and (path.parent / target).is_file():
            project = (path.parent / target).resolve().relative_to(root).as_posix()
        if project is not None:
            other = rank(project)
            if other is not None and other > own:
                yield f"{where}: {name(own)} includes from {name(other)}, a higher layer"
        elif CUDA_HEADER.match(target) and not any(rel.startswith(p) for p in CUDA_ALLOWED):
            yield f"{where}: a CUDA header outside cuda/ and dist/"


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent.parent).resolve()
    files = sorted(p for layer in LAYERS if (root / layer).is_dir() for p in (root / layer).rglob("*")
                   if p.is_file() and p.suffix in SOURCES)
    problems = [problem for path in files for problem in check(root, path)]
    for problem in problems:
        print(problem)
    print(f"check_layers: {len(files)} library files, {len(problems)} violation(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
