"""Deterministic data for the four experiments; nothing is downloaded.

Every generator takes an explicit ``seed`` and draws from its own
``numpy.random.Generator``, so the same seed gives the same arrays on every
machine. Inputs are integer arrays (n, T, F): T tokens, each made of F
categorical fields that the model embeds and sums (F = 1 for ordinary text).
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import numpy as np

from damcha_core import DamchaTypeError, DamchaValueError, invalid_argument


def _check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise DamchaTypeError(invalid_argument(name, "an int >= 1", f"{name}={value!r} ({type(value).__name__})"))
    if value < 1:
        raise DamchaValueError(invalid_argument(name, "an int >= 1", f"{name}={value}"))
    return int(value)


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A classification set: ``inputs`` (n, T, F) int64, ``targets`` (n,) int64.

    ``vocab_sizes[f]`` is the number of symbols of field f; the label is read
    at token position ``readout`` (``-1`` = last token).
    """

    inputs: np.ndarray
    targets: np.ndarray
    vocab_sizes: tuple[int, ...]
    num_classes: int
    readout: int


# --------------------------------------------------------------- task 1: crosshead


def crosshead_example(blocks: np.ndarray, shift: int) -> np.ndarray:
    """The item a query matches: its blocks rotated, ``item[c] = query[(c - shift) % C]``.

    Equivalently the query's block c must equal the item's block (c + shift) % C:
    the comparison pairs query block c with key block c + shift, a cross-block
    (hence cross-head, one block per head) comparison chosen by the data.
    """
    return np.roll(np.asarray(blocks), shift)


def crosshead_answer(items: np.ndarray, query_blocks: np.ndarray, shift: int) -> int:
    """Index of the unique item with ``item[(c + shift) % C] == query[c]`` for all c."""
    want = crosshead_example(query_blocks, shift)
    hits = np.flatnonzero(np.all(items == want, axis=-1))
    if len(hits) != 1:
        raise DamchaValueError(
            invalid_argument(
                "items",
                f"exactly one item whose blocks match `query_blocks` shifted by shift={shift}",
                f"items.shape={np.shape(items)} with {len(hits)} matching items",
            )
        )
    return int(hits[0])


def make_crosshead(n: int, seed: int, *, blocks: int = 4, symbols: int = 8, items: int = 8, labels: int = 8) -> Dataset:
    """Shifted-block retrieval: find the item whose blocks match the query's after a shift.

    Each example is ``items`` item tokens and one query token (last). An item
    has ``blocks`` block symbols in [0, symbols) and a label in [0, labels); the
    query has ``blocks`` block symbols and a shift r in [0, blocks). The target
    is the item whose block (c + r) % C equals the query's block c for every c;
    the answer is its label.

    The first ``blocks`` items are *all* cyclic rotations of one base tuple, so
    the target's bag of symbols is shared by C-1 distractors and one of them
    equals the query verbatim: neither bag-of-symbols nor aligned matching
    finds the target unless r is used. Because r multiplies with the contents
    (which block meets which), one head's fixed bilinear form q^T W k cannot
    use it; a fixed-projection MHA must spend a head per shift and pack all C
    blocks into that head's d dims. A data-adaptive cross-head map can instead
    route query block c to head c + r, so every head compares one block.

    Field layout (F = blocks + 2): ``[b_0 .. b_{C-1}, label_or_shift, kind]``
    where kind is 0 for an item and 1 for the query; an item's label field holds
    its label, the query's holds ``labels + r`` (the two ranges are disjoint).
    """
    n = _check_positive("n", n)
    C = _check_positive("blocks", blocks)
    V = _check_positive("symbols", symbols)
    M = _check_positive("items", items)
    K = _check_positive("labels", labels)
    if C < 2 or M < C:
        raise DamchaValueError(
            invalid_argument(
                "blocks" if C < 2 else "items", "blocks >= 2 and items >= blocks", f"blocks={C}, items={M}"
            )
        )
    rng = np.random.default_rng(seed)
    inputs = np.zeros((n, M + 1, C + 2), dtype=np.int64)
    targets = np.zeros(n, dtype=np.int64)
    for e in range(n):
        # A base tuple whose C rotations are pairwise distinct (not periodic).
        while True:
            base = rng.integers(0, V, size=C)
            rots = np.stack([np.roll(base, s) for s in range(C)])
            if len({tuple(r) for r in rots}) == C:
                break
        item_blocks = np.concatenate([rots, rng.integers(0, V, size=(M - C, C))])
        # Redraw random items that collide with a rotation, so the match stays unique.
        for j in range(C, M):
            while any(np.array_equal(item_blocks[j], r) for r in rots):
                item_blocks[j] = rng.integers(0, V, size=C)
        order = rng.permutation(M)
        item_blocks = item_blocks[order]
        item_labels = rng.integers(0, K, size=M)
        target_rot = int(rng.integers(0, C))  # which rotation of base is the target
        shift = int(rng.integers(0, C))
        target_blocks = rots[target_rot]
        query_blocks = np.roll(target_blocks, -shift)  # so that roll(query, shift) == target
        answer = crosshead_answer(item_blocks, query_blocks, shift)
        inputs[e, :M, :C] = item_blocks
        inputs[e, :M, C] = item_labels
        inputs[e, M, :C] = query_blocks
        inputs[e, M, C] = K + shift
        inputs[e, M, C + 1] = 1
        targets[e] = item_labels[answer]
    return Dataset(inputs, targets, (V,) * C + (K + C, 2), K, -1)


# ----------------------------------------------------------------- task 3: listops

LISTOPS_OPS = ("MAX", "MIN", "MED", "SM")
# Token ids: 0 pad, 1 CLS, 2..11 digits 0-9, 12..15 operators, 16 close bracket.
PAD, CLS, DIGIT0, OP0, CLOSE = 0, 1, 2, 12, 16
LISTOPS_VOCAB = 17


def listops_eval(tree: object) -> int:
    """Value of an expression tree: an int digit or ``(op, [children])``."""
    if isinstance(tree, (int, np.integer)):
        return int(tree)
    op, args = cast("tuple[str, list[object]]", tree)  # an int was handled above
    values = [listops_eval(a) for a in args]
    if op == "MAX":
        return max(values)
    if op == "MIN":
        return min(values)
    if op == "MED":
        # The lower median for even counts, as in the original ListOps.
        return sorted(values)[(len(values) - 1) // 2]
    if op == "SM":
        return sum(values) % 10
    raise DamchaValueError(f"unknown ListOps operator {op!r}; expected one of {LISTOPS_OPS}")


def listops_tokens(tree: object) -> list[int]:
    """Prefix tokens of a tree: ``[MAX 3 [MIN 4 1 ] ]`` -> ids."""
    if isinstance(tree, (int, np.integer)):
        return [DIGIT0 + int(tree)]
    op, args = cast("tuple[str, list[object]]", tree)  # an int was handled above
    out = [OP0 + LISTOPS_OPS.index(op)]
    for a in args:
        out += listops_tokens(a)
    return out + [CLOSE]


def listops_parse(text: str) -> object:
    """Parse ``"[MAX 3 [MIN 4 1 ] ]"`` into a tree (for hand-written test cases)."""
    tokens = text.replace("[", " [").replace("]", " ] ").split()
    pos = 0

    def parse() -> object:
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok.startswith("["):
            op, args = tok[1:], []
            while tokens[pos] != "]":
                args.append(parse())
            pos += 1
            return (op, args)
        return int(tok)

    tree = parse()
    if pos != len(tokens):
        raise DamchaValueError(f"trailing tokens in ListOps expression: {text!r}")
    return tree


def _random_tree(rng: np.random.Generator, depth: int, max_args: int) -> object:
    # Leaves get likelier with depth, so lengths vary but stay bounded.
    if depth == 0 or rng.random() < 0.3:
        return int(rng.integers(0, 10))
    op = LISTOPS_OPS[int(rng.integers(0, len(LISTOPS_OPS)))]
    return (op, [_random_tree(rng, depth - 1, max_args) for _ in range(int(rng.integers(2, max_args + 1)))])


# Consecutive rejected draws before make_listops gives up: the full preset's test set rejects about
# 1 draw in 10, so 10,000 in a row (1e-10000 there) means no expression is left to draw.
_LISTOPS_MAX_REDRAWS = 10_000


def listops_expressions(data: Dataset) -> set[bytes]:
    """The expressions of a ListOps set, one key each: its token ids without CLS and padding, as bytes.

    Independent of ``max_len`` (the padding is dropped), so sets padded to
    different lengths compare.
    """
    tokens = np.asarray(data.inputs)[:, 1:, 0]
    return {bytes(row[row != PAD].astype(np.uint8)) for row in tokens}


def make_listops(
    n: int,
    seed: int,
    *,
    max_depth: int = 3,
    max_args: int = 4,
    max_len: int = 48,
    exclude: Dataset | Sequence[Dataset] = (),
) -> Dataset:
    """ListOps-style expressions; the label is the value 0-9.

    Sequences are ``[CLS] tokens... [PAD]...`` of length ``max_len``; the label
    is read at the CLS position. Expressions longer than ``max_len - 1`` tokens
    and bare digits are redrawn, so every example has at least one operator.

    ``exclude``: ListOps sets whose expressions are redrawn too, so the result
    shares no expression with them (how the experiments make validation and
    test sets disjoint from training: the generator's short expressions are
    few, and 100,000 independent training draws held 171 of 2,000 test
    expressions verbatim). A redraw is a plain rejection in the same random
    stream: the result is the generator's own sequence with the excluded
    expressions skipped (no label or length is chosen), i.e. a sample of the
    generator conditioned on an unseen expression. That condition drops the
    most frequent, shortest expressions (measured at 100,000 training
    expressions: 8% of the generator's mass; the mean length rises from 10.7
    to 11.1 tokens) and leaves the label distribution as it was (each label's
    share within 0.001). Deterministic for a seed and an ``exclude``.
    """
    n = _check_positive("n", n)
    max_depth = _check_positive("max_depth", max_depth)
    max_len = _check_positive("max_len", max_len)
    if isinstance(max_args, bool) or not isinstance(max_args, (int, np.integer)) or max_args < 2:
        raise DamchaValueError(invalid_argument("max_args", "an int >= 2", f"max_args={max_args!r}"))
    excluded: set[bytes] = set()
    for other in (exclude,) if isinstance(exclude, Dataset) else exclude:
        if not isinstance(other, Dataset):
            raise DamchaTypeError(
                invalid_argument(
                    "exclude",
                    "a Dataset or a sequence of Datasets (ListOps sets)",
                    f"an item of type {type(other).__name__}",
                )
            )
        excluded |= listops_expressions(other)
    rng = np.random.default_rng(seed)
    inputs = np.full((n, max_len, 1), PAD, dtype=np.int64)
    targets = np.zeros(n, dtype=np.int64)
    for e in range(n):
        for _ in range(_LISTOPS_MAX_REDRAWS):
            tree = _random_tree(rng, max_depth, max_args)
            toks = listops_tokens(tree)
            if not isinstance(tree, int) and len(toks) < max_len and bytes(toks) not in excluded:
                break
        else:
            # Too short a max_len, or an exclude holding (nearly) every expression that fits, would loop forever.
            raise DamchaValueError(
                invalid_argument(
                    "max_len",
                    "room for expressions not in `exclude` (an operator and two digits need max_len >= 5)",
                    f"max_len={max_len}, {len(excluded)} excluded expressions: "
                    f"{_LISTOPS_MAX_REDRAWS} draws in a row were too long or excluded",
                )
            )
        inputs[e, 0, 0] = CLS
        inputs[e, 1 : 1 + len(toks), 0] = toks
        targets[e] = listops_eval(tree)
    return Dataset(inputs, targets, (LISTOPS_VOCAB,), 10, 0)


# ---------------------------------------------------------------- task 2: char LM


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Byte-level text: ``train``/``val``/``test`` uint8 arrays and where they came from."""

    train: np.ndarray
    val: np.ndarray
    files: tuple[str, ...]
    sha256: str
    python_version: str
    test: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.uint8))


def stdlib_split_lengths(max_bytes: int, val_fraction: float = 0.1, test_fraction: float = 0.0) -> tuple[int, int]:
    """(validation, test) bytes ``stdlib_corpus`` would cut, from the files' sizes (nothing is read)."""
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        total += path.stat().st_size
        if total >= max_bytes:
            break
    n = min(total, max_bytes)
    cut = int(n * (1.0 - val_fraction - test_fraction))
    cut_test = int(n * (1.0 - test_fraction)) if test_fraction else n
    return cut_test - cut, n - cut_test


def stdlib_corpus(max_bytes: int = 1_000_000, val_fraction: float = 0.1, test_fraction: float = 0.0) -> Corpus:
    """Concatenate this interpreter's standard-library ``*.py`` files (sorted by name).

    The files are the top-level modules of ``sysconfig.get_paths()["stdlib"]``
    in sorted order, read as bytes until ``max_bytes``. The text is cut in
    order: train, then ``val_fraction`` validation, then ``test_fraction``
    test (empty by default), at byte offsets: the three are different files'
    text except the one file straddling each cut (a few KB of shared style,
    no shared window). The
    SHA-256 and Python version are recorded because another Python version
    ships different sources.
    """
    max_bytes = _check_positive("max_bytes", max_bytes)
    if not 0.0 < val_fraction < 1.0:
        raise DamchaValueError(invalid_argument("val_fraction", "a number in (0, 1)", f"val_fraction={val_fraction!r}"))
    if not 0.0 <= test_fraction < 1.0 - val_fraction:
        raise DamchaValueError(
            invalid_argument(
                "test_fraction",
                "a number in [0, 1 - val_fraction)",
                f"test_fraction={test_fraction!r}, val_fraction={val_fraction!r}",
            )
        )
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, files, total = [], [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        files.append(path.name)
        total += len(data)
        if total >= max_bytes:
            break
    text = b"".join(chunks)[:max_bytes]
    if len(text) < 10_000:
        raise DamchaValueError(f"standard library at {root} gave only {len(text)} bytes of text")
    codes = np.frombuffer(text, dtype=np.uint8)
    cut = int(len(codes) * (1.0 - val_fraction - test_fraction))
    cut_test = int(len(codes) * (1.0 - test_fraction)) if test_fraction else len(codes)
    return Corpus(
        codes[:cut].copy(),
        codes[cut:cut_test].copy(),
        tuple(files),
        hashlib.sha256(text).hexdigest(),
        f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}",
        codes[cut_test:].copy(),
    )


def lm_batch(data: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random windows: inputs (batch, length, 1) and next-byte targets (batch, length)."""
    starts = rng.integers(0, len(data) - length - 1, size=batch)
    idx = starts[:, None] + np.arange(length + 1)[None, :]
    win = data[idx].astype(np.int64)
    return win[:, :-1, None], win[:, 1:]


def lm_eval_windows(data: np.ndarray, length: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` evenly spaced, fixed windows of ``data`` (the same for every run)."""
    starts = np.linspace(0, len(data) - length - 2, count).astype(np.int64)
    idx = starts[:, None] + np.arange(length + 1)[None, :]
    win = data[idx].astype(np.int64)
    return win[:, :-1, None], win[:, 1:]


# ------------------------------------------------------------- task 4: digits


@dataclasses.dataclass(frozen=True)
class ImageSplit:
    """scikit-learn's 8x8 digits, split: images (n, 8, 8) float32 in [0, 1], labels (n,) int64."""

    train_images: np.ndarray
    train_labels: np.ndarray
    val_images: np.ndarray
    val_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray


def digits_split(seed: int = 0, val_fraction: float = 0.2, test_fraction: float = 0.2) -> ImageSplit:
    """The 1,797 bundled 8x8 digit images (``sklearn.datasets.load_digits``), stratified split.

    Within each class the images are shuffled with ``seed`` and cut into
    train / validation / test in the given fractions, so every split has every
    digit in about the data set's proportions. Pixels (0-16) are scaled to
    [0, 1]. Needs scikit-learn (``pip install "damcha[experiments]"``); the
    data ship inside it, nothing is downloaded.
    """
    if not (0.0 < val_fraction < 1.0 and 0.0 < test_fraction < 1.0 and val_fraction + test_fraction < 1.0):
        raise DamchaValueError(
            invalid_argument(
                "val_fraction" if not 0.0 < val_fraction < 1.0 else "test_fraction",
                "`val_fraction` and `test_fraction` in (0, 1) with a sum below 1",
                f"val_fraction={val_fraction!r}, test_fraction={test_fraction!r}",
            )
        )
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = (np.asarray(bunch.images, dtype=np.float32) / 16.0).astype(np.float32)
    labels = np.asarray(bunch.target, dtype=np.int64)
    rng = np.random.default_rng(seed)
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": [], "test": []}
    for c in range(10):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_val, n_test = round(len(idx) * val_fraction), round(len(idx) * test_fraction)
        parts["val"].append(idx[:n_val])
        parts["test"].append(idx[n_val : n_val + n_test])
        parts["train"].append(idx[n_val + n_test :])
    # Sorted indices: the split is a set; the training order comes from the run's seed.
    sel = {k: np.sort(np.concatenate(v)) for k, v in parts.items()}
    return ImageSplit(
        images[sel["train"]],
        labels[sel["train"]],
        images[sel["val"]],
        labels[sel["val"]],
        images[sel["test"]],
        labels[sel["test"]],
    )
