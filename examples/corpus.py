"""The demo's data: a corpus from the standard library's own text, read through Grain.

Used by ``examples/train.py``; nothing is downloaded.
"""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

VOCAB = 128  # ASCII; anything else becomes '?'


def build_corpus(max_chars: int = 1_500_000) -> str:
    """Docstrings, then source, of the standard library's modules (sorted, so the same everywhere).

    Parsing the standard library takes a few seconds: the text is kept in the temporary
    directory, one file per interpreter, standard library and size (written beside, then
    renamed, so a run that stops midway leaves none), and read back by the next run.
    """
    import hashlib
    import os
    import sys
    import tempfile

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    key = hashlib.sha256(f"{sys.version}|{stdlib}|{max_chars}|1".encode()).hexdigest()[:16]
    kept = Path(tempfile.gettempdir()) / f"dtensor-demo-corpus-{key}.txt"
    try:  # its first line: the text's length (a damaged file is parsed again)
        with open(kept, encoding="utf-8", newline="") as f:
            length, text = int(f.readline()), f.read()
        if len(text) == length:
            return text
    except (OSError, UnicodeDecodeError, ValueError):
        pass
    corpus = _parse_corpus(stdlib, max_chars)
    beside = kept.with_name(f"{kept.name}.{os.getpid()}.tmp")
    try:
        with open(beside, "w", encoding="utf-8", newline="") as f:
            f.write(f"{len(corpus)}\n{corpus}")
        os.replace(beside, kept)
    except OSError:  # a read-only temporary directory: parse again next time
        beside.unlink(missing_ok=True)
    return corpus


def _parse_corpus(stdlib: Path, max_chars: int) -> str:
    files = sorted(f for f in stdlib.glob("*.py") if not f.name.startswith("_"))
    docs: list[str] = []
    sources: list[str] = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    docs.append(doc.strip() + "\n\n")
        sources.append(text)
    corpus = "".join(docs)
    for text in sources:
        if len(corpus) >= max_chars:
            break
        corpus += text
    return corpus[:max_chars]


def encode(text: str):
    import numpy as np

    codes = np.frombuffer(text.encode("ascii", errors="replace"), dtype=np.uint8)
    return np.minimum(codes, VOCAB - 1).astype(np.int32)


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("ascii", errors="replace")


def windows_dataset(data, seq: int, seed: int, ctx, global_batch: int):
    """This process's share of the batches: a Grain pipeline of shuffled windows of the corpus.

    Index-based (a shuffled ``MapDataset`` of window starts, repeated), so its
    position is saved with each checkpoint and a run resumes on the very next
    batch, even on another number of processes.
    """
    import grain
    import numpy as np

    def window(start) -> dict:
        w = data[int(start) : int(start) + seq + 1]
        return {"x": w[:-1], "y": w[1:]}

    rows = ctx.get_per_pipeline_batch_size(global_batch)
    starts = grain.MapDataset.range(len(data) - seq - 1).shuffle(seed=seed).repeat()
    share = starts[ctx.input_pipeline_id :: ctx.num_input_pipelines].map(window)
    return share.batch(rows, batch_fn=lambda xs: {k: np.stack([x[k] for x in xs]) for k in xs[0]})


def batch_for_step(data, step: int, batch: int, seq: int, seed: int):
    """The batch of a step: random windows chosen by the step number (resumes reproduce it)."""
    import numpy as np

    rng = np.random.default_rng((seed, step))
    starts = rng.integers(0, len(data) - seq - 1, size=batch)
    windows = np.stack([data[s : s + seq + 1] for s in starts])
    return {"x": windows[:, :-1], "y": windows[:, 1:]}
