"""The experiments' data generators: deterministic per seed, labels right on hand-checked cases."""

from __future__ import annotations

import numpy as np
import pytest

from damcha_core import DamchaValueError
from damcha_experiments import (
    _data,
    crosshead_answer,
    listops_eval,
    listops_parse,
    listops_tokens,
    make_crosshead,
    make_listops,
)
from damcha_experiments._tasks import DIGITS_EVAL_MAX


@pytest.mark.parametrize("make", [make_crosshead, make_listops], ids=["crosshead", "listops"])
def test_generator_is_deterministic_per_seed(make):
    a, b, c = make(40, seed=7), make(40, seed=7), make(40, seed=8)
    np.testing.assert_array_equal(a.inputs, b.inputs)
    np.testing.assert_array_equal(a.targets, b.targets)
    assert not np.array_equal(a.inputs, c.inputs)


# ----------------------------------------------------------------- crosshead


def test_crosshead_hand_checked_example():
    # Query blocks (3, 1, 4, 1) with shift 1 pair query block c with item block c+1,
    # so the match is the item (1, 3, 1, 4); (3, 1, 4, 1) itself is a decoy.
    items = np.array([[3, 1, 4, 1], [1, 3, 1, 4], [4, 1, 3, 1], [1, 4, 1, 3], [0, 0, 0, 0]])
    query = np.array([3, 1, 4, 1])
    assert crosshead_answer(items, query, 1) == 1
    assert crosshead_answer(items, query, 0) == 0
    assert crosshead_answer(items, query, 2) == 2
    assert crosshead_answer(items, query, 3) == 3
    with pytest.raises(DamchaValueError, match="exactly one"):
        crosshead_answer(items[2:], query, 1)


def test_crosshead_labels_follow_the_rule_and_decoys_defeat_shortcuts():
    C, M, K = 4, 8, 8
    data = make_crosshead(60, seed=3, blocks=C, items=M, labels=K)
    assert data.inputs.shape == (60, M + 1, C + 2) and data.vocab_sizes == (8,) * C + (K + C, 2)
    for x, y in zip(data.inputs, data.targets):
        items, query = x[:M, :C], x[M, :C]
        shift = x[M, C] - K
        assert x[M, C + 1] == 1 and np.all(x[:M, C + 1] == 0) and 0 <= shift < C
        # The rule, written out independently: query block c == item block (c + shift) % C.
        matches = [j for j in range(M) if all(query[c] == items[j, (c + shift) % C] for c in range(C))]
        assert len(matches) == 1 and y == x[matches[0], C]
        # Shortcut checks: the query itself is one of the items (aligned matching finds
        # the decoy unless shift == 0), and the target's symbol bag is shared by C items.
        assert any(np.array_equal(query, it) for it in items)
        bag = sorted(items[matches[0]])
        assert sum(sorted(it) == bag for it in items) >= C


def test_crosshead_uses_every_shift():
    data = make_crosshead(200, seed=0)
    shifts = data.inputs[:, -1, 4] - 8
    assert set(shifts.tolist()) == {0, 1, 2, 3}


# ------------------------------------------------------------------- listops


@pytest.mark.parametrize(
    "text, value",
    [
        ("[MAX 3 [MIN 4 1 ] ]", 3),
        ("[MIN 7 [MAX 2 8 ] 5 ]", 5),
        ("[MED 1 9 5 7 ]", 5),  # even count: the lower median
        ("[MED 4 0 6 ]", 4),
        ("[SM 7 8 9 ]", 4),  # 24 mod 10
        ("[SM [MAX 9 1 ] [MED 3 3 8 ] ]", 2),  # (9 + 3) mod 10
    ],
    ids=["max-min", "min-max", "med-even", "med-odd", "sum-mod", "nested"],
)
def test_listops_hand_checked(text, value):
    assert listops_eval(listops_parse(text)) == value


def test_listops_tokens_hand_checked():
    ids = listops_tokens(listops_parse("[MAX 3 [MIN 4 1 ] ]"))
    assert ids == [
        _data.OP0 + 0,
        _data.DIGIT0 + 3,
        _data.OP0 + 1,
        _data.DIGIT0 + 4,
        _data.DIGIT0 + 1,
        _data.CLOSE,
        _data.CLOSE,
    ]


def _decode(ids):
    """Token ids back to text, independently of the generator."""
    names = {
        _data.CLOSE: "]",
        **{_data.DIGIT0 + i: str(i) for i in range(10)},
        **{_data.OP0 + i: "[" + op for i, op in enumerate(_data.LISTOPS_OPS)},
    }
    return " ".join(names[i] for i in ids)


def _python_eval(text):
    """An evaluator that shares no code with the generator: rewrite to Python and eval."""
    src = text.replace("[MAX", "max(").replace("[MIN", "min(").replace("[MED", "med(").replace("[SM", "sm(")
    src = src.replace(" ]", ")").replace("( ", "(")
    src = src.replace(" ", ",").replace("(,", "(")
    return eval(
        src,
        {
            "max": lambda *a: max(a),
            "min": lambda *a: min(a),
            "med": lambda *a: sorted(a)[(len(a) - 1) // 2],
            "sm": lambda *a: sum(a) % 10,
        },
    )


def test_listops_generated_labels_match_an_independent_evaluator():
    data = make_listops(80, seed=5, max_len=64)
    assert data.inputs.shape == (80, 64, 1) and data.readout == 0
    for x, y in zip(data.inputs[..., 0], data.targets):
        assert x[0] == _data.CLS
        body = [int(t) for t in x[1:] if t != _data.PAD]
        assert np.all(x[1 + len(body) :] == _data.PAD)  # padding only at the end
        assert _python_eval(_decode(body)) == y


# --------------------------------------------------------------------- charlm


def test_stdlib_corpus_is_deterministic_and_lm_targets_are_next_bytes():
    a, b = _data.stdlib_corpus(max_bytes=200_000), _data.stdlib_corpus(max_bytes=200_000)
    assert a.sha256 == b.sha256 and np.array_equal(a.train, b.train)
    assert len(a.train) + len(a.val) == 200_000
    x, y = _data.lm_batch(a.train, 4, 16, np.random.default_rng(0))
    x2, _ = _data.lm_batch(a.train, 4, 16, np.random.default_rng(0))
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(x[:, 1:, 0], y[:, :-1])
    # Each window is contiguous text of the training split.
    text = a.train.tobytes()
    for row_x, row_y in zip(x[..., 0], y):
        window = bytes(row_x.astype(np.uint8)) + bytes([row_y[-1]])
        assert window in text


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: make_crosshead(0, 0), "Invalid argument `n`: expected an int >= 1"),
        (lambda: make_crosshead(5, 0, blocks=4, items=3), "items >= blocks"),
        (lambda: make_listops(5, 0, max_args=1), "Invalid argument `max_args`: expected an int >= 2"),
        (lambda: _data.stdlib_corpus(val_fraction=1.5), "Invalid argument `val_fraction`: expected"),
    ],
    ids=["n-zero", "too-few-items", "max-args", "val-fraction"],
)
def test_bad_arguments_are_named(call, match):
    with pytest.raises(DamchaValueError, match=match):
        call()


# -------------------------------------------------------------------- digits


def test_digits_split_is_deterministic_stratified_and_disjoint():
    from sklearn.datasets import load_digits

    a, b, c = _data.digits_split(seed=0), _data.digits_split(seed=0), _data.digits_split(seed=1)
    for name in ("train_images", "train_labels", "val_images", "test_labels"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.val_labels, c.val_labels) or not np.array_equal(a.val_images, c.val_images)
    assert a.train_images.shape[1:] == (8, 8) and a.train_images.dtype == np.float32
    assert a.train_images.min() >= 0.0 and a.train_images.max() == 1.0
    sizes = (len(a.train_labels), len(a.val_labels), len(a.test_labels))
    assert sum(sizes) == 1797 and min(len(a.val_labels), len(a.test_labels)) == DIGITS_EVAL_MAX
    # Every image lands in exactly one split (compare against the raw data, not the split code).
    raw = load_digits().images.astype(np.float32) / 16.0
    keys = {img.tobytes() for img in raw}
    seen = [img.tobytes() for imgs in (a.train_images, a.val_images, a.test_images) for img in imgs]
    assert len(seen) == 1797 and set(seen) == keys
    # Stratified: each class's share of validation is within one image of 20%.
    for cls in range(10):
        n = int(np.sum(load_digits().target == cls))
        assert abs(int(np.sum(a.val_labels == cls)) - 0.2 * n) <= 1


# --------------------------------------------------------- task data, order


def test_corpus_test_split_is_the_tail_and_disjoint():
    c = _data.stdlib_corpus(max_bytes=100_000, val_fraction=0.1, test_fraction=0.1)
    assert (len(c.train), len(c.val), len(c.test)) == (80_000, 10_000, 10_000)
    whole = _data.stdlib_corpus(max_bytes=100_000, val_fraction=0.2)
    np.testing.assert_array_equal(np.concatenate([c.train, c.val, c.test]), np.concatenate([whole.train, whole.val]))
    with pytest.raises(DamchaValueError, match="Invalid argument `test_fraction`: expected a number in"):
        _data.stdlib_corpus(max_bytes=100_000, val_fraction=0.5, test_fraction=0.5)


def test_data_order_is_a_function_of_the_seed_and_resumes_exactly():
    from damcha_experiments._tasks import DataOrder

    a, b = DataOrder(3, 10), DataOrder(3, 10)
    first = np.concatenate([a.indices(4) for _ in range(5)])  # 20 draws: two full epochs
    np.testing.assert_array_equal(first, np.concatenate([b.indices(4) for _ in range(5)]))
    assert sorted(first[:10].tolist()) == list(range(10)) and sorted(first[10:].tolist()) == list(range(10))
    assert not np.array_equal(first, np.concatenate([DataOrder(4, 10).indices(4) for _ in range(5)]))
    # A copy restored from the state dict (through JSON, as checkpoints store it) continues identically.
    import json

    c = DataOrder(3, 10)
    c.indices(7)
    d = DataOrder(0, 10)
    d.load_state_dict(json.loads(json.dumps(c.state_dict())))
    np.testing.assert_array_equal(
        np.concatenate([c.indices(6) for _ in range(3)]), np.concatenate([d.indices(6) for _ in range(3)])
    )


@pytest.mark.parametrize("task", ["crosshead", "charlm", "listops", "listops3", "digits"])
def test_task_data_is_deterministic_and_splits_differ(task):
    from damcha_experiments._tasks import TaskData, task_config

    cfg = task_config(task, "smoke")
    a, b = TaskData(cfg), TaskData(cfg)
    for split in ("val", "test"):
        np.testing.assert_array_equal(getattr(a, split)[0], getattr(b, split)[0])
        np.testing.assert_array_equal(getattr(a, split)[1], getattr(b, split)[1])
    assert not np.array_equal(a.val[0], a.test[0])
    xa, ya = a.batch(a.order(5))
    xb, yb = b.batch(b.order(5))
    np.testing.assert_array_equal(xa, xb)
    np.testing.assert_array_equal(ya, yb)
    assert len(ya) == cfg.batch


def test_listops_setting_is_nested_and_not_constant():
    """The preset's ListOps (depth <= 2) has nested operators and a label spread a plateau cannot fake."""
    from damcha_experiments._tasks import task_config

    cfg = task_config("listops", "default")
    data = make_listops(2000, seed=0, **cfg.data)
    ops = np.isin(data.inputs[..., 0], np.arange(_data.OP0, _data.OP0 + 4)).sum(1)
    assert (ops >= 2).mean() > 0.3  # many expressions nest an operator inside another
    assert np.bincount(data.targets, minlength=10).max() / len(data.targets) < 0.25


def _nesting_depths(inputs: np.ndarray) -> np.ndarray:
    """Each expression's operator nesting depth, read from its prefix tokens (an operator opens, CLOSE closes)."""
    tokens = inputs[..., 0]
    opens = np.isin(tokens, np.arange(_data.OP0, _data.OP0 + 4)).astype(int) - (tokens == _data.CLOSE)
    return np.cumsum(opens, axis=1).max(axis=1)


@pytest.mark.parametrize("preset", ["default", "full"])
def test_listops3_is_listops_one_level_deeper(preset):
    """listops3 differs from listops only in its data (depth 3, longer windows) and the positions' budget.

    Most of its expressions nest three operators deep, none deeper, and its labels are as spread as
    depth 2's: the added depth is what a converged comparison measures.
    """
    import dataclasses

    from damcha_experiments._tasks import task_config

    two, three = task_config("listops", preset), task_config("listops3", preset)
    changed = {f.name for f in dataclasses.fields(two) if getattr(two, f.name) != getattr(three, f.name)}
    assert changed <= {"task", "description", "data", "param_budget", "max_steps"}, changed
    assert three.data == {"max_depth": 3, "max_args": 3, "max_len": 48}
    assert three.param_budget - two.param_budget == (48 - two.data["max_len"]) * two.embed_dim
    d2 = _nesting_depths(make_listops(2000, seed=0, **two.data).inputs)
    deeper = make_listops(2000, seed=0, **three.data)
    d3 = _nesting_depths(deeper.inputs)
    assert d2.max() == 2 and d3.max() == 3
    assert (d3 == 3).mean() > 0.8
    assert np.bincount(deeper.targets, minlength=10).max() / len(deeper.targets) < 0.25


@pytest.mark.parametrize("preset", ["smoke", "default", "full", "large"])
def test_listops3x3_is_listops3_with_three_layers(preset):
    """listops3x3 keeps listops3's data, sizes, rates and protocol; only depth of model and budget change.

    Its budget is a three-layer one: the widest variant (separate) at the preset's MLP width meets it.
    """
    import dataclasses

    from damcha_experiments._models import count_parameters
    from damcha_experiments._tasks import TaskData, task_config
    from damcha_experiments._train import build_model
    from damcha_experiments._variants import VARIANTS

    two, three = task_config("listops3", preset), task_config("listops3x3", preset)
    changed = {f.name for f in dataclasses.fields(two) if getattr(two, f.name) != getattr(three, f.name)}
    assert changed <= {"task", "description", "num_layers", "param_budget"}, changed
    assert three.num_layers == 3 and three.data == two.data
    data = TaskData(task_config("listops3x3", preset, train_size=64, val_size=8, test_size=8))
    widest = count_parameters(build_model(data, VARIANTS["damcha-heads-separate"], three.mlp_hidden))
    assert abs(widest - three.param_budget) < 0.001 * three.param_budget


def test_importing_the_package_and_the_report_needs_no_torch():
    import subprocess
    import sys

    code = (
        "import sys, damcha_experiments, damcha_experiments._report, damcha_experiments._cli; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_every_public_name_resolves():
    """docs/experiments.md named as_variant as public; it was only in _models (AttributeError)."""
    import damcha_experiments as de

    for name in de.__all__:
        assert getattr(de, name) is not None, name
    assert de.as_variant.__module__ == "damcha_experiments._models"


# ----------------------------------------------------------- disjoint splits


def _rows(x):
    return [row.tobytes() for row in np.ascontiguousarray(x).reshape(len(x), -1)]


@pytest.mark.parametrize("task", ["crosshead", "listops", "listops3"])
def test_task_data_evaluation_sets_share_no_example_with_training(task):
    """No validation or test example occurs verbatim in training, nor a test one in validation.

    With independent draws ListOps failed this: at these sizes 15 validation and 10 test
    expressions were training ones and 2 test ones validation ones (at the full preset
    177 and 171 of 2,000 were training ones).
    """
    from damcha_experiments._tasks import TaskData, task_config

    sizes = {"crosshead": (1500, 300), "listops": (5000, 500), "listops3": (5000, 500)}[task]
    data = TaskData(task_config(task, "default", train_size=sizes[0], val_size=sizes[1], test_size=sizes[1]))
    train, val, test = set(_rows(data.train_inputs)), _rows(data.val[0]), _rows(data.test[0])
    assert len(val) == len(test) == sizes[1]
    assert [r for r in val if r in train] == []
    assert [r for r in test if r in train] == []
    assert [r for r in test if r in set(val)] == []


def test_listops_exclusion_only_skips_seen_expressions():
    """``exclude`` is a rejection in the generator's own stream: nothing but the seen expressions changes.

    So the evaluation sets are the generator's distribution conditioned on an unseen
    expression, with no selection by label or length.
    """
    from damcha_experiments._tasks import task_config

    opts = task_config("listops", "default").data
    train = make_listops(3000, seed=0, **opts)
    seen = _data.listops_expressions(train)
    free = make_listops(800, seed=4, **opts)
    keys = [bytes(row[row != _data.PAD].astype(np.uint8)) for row in free.inputs[:, 1:, 0]]
    keep = [i for i, key in enumerate(keys) if key not in seen]
    assert 5 <= 800 - len(keep) <= 100  # the generator repeats itself: some draws are training ones
    held = make_listops(len(keep), seed=4, exclude=train, **opts)
    np.testing.assert_array_equal(held.inputs, free.inputs[keep])
    np.testing.assert_array_equal(held.targets, free.targets[keep])
    assert not _data.listops_expressions(held) & seen
    # Excluding several sets excludes their union; one set or a one-element sequence is the same.
    other = make_listops(200, seed=9, **opts)
    both = make_listops(100, seed=4, exclude=(train, other), **opts)
    assert not _data.listops_expressions(both) & (seen | _data.listops_expressions(other))
    np.testing.assert_array_equal(make_listops(50, seed=4, exclude=[train], **opts).inputs, held.inputs[:50])
    with pytest.raises(TypeError, match="Invalid argument `exclude`: expected a Dataset or a sequence"):
        make_listops(5, seed=4, exclude=[train.inputs])


def test_listops_with_nothing_left_to_draw_raises_instead_of_looping(monkeypatch):
    monkeypatch.setattr(_data, "_LISTOPS_MAX_REDRAWS", 300)
    match = "Invalid argument `max_len`: expected room for expressions not in `exclude`"
    with pytest.raises(DamchaValueError, match=match + r".*max_len=4, 0 excluded"):
        make_listops(5, 0, max_len=4)  # "[MAX 1 2 ]" is 4 tokens: nothing fits after CLS
    # All 400 expressions "[OP d d ]" fit max_len=5; excluding them leaves nothing.
    small = {"max_depth": 1, "max_args": 2, "max_len": 5}
    every = make_listops(3000, 0, **small)
    assert len(_data.listops_expressions(every)) == 4 * 10 * 10
    with pytest.raises(DamchaValueError, match=match + r".*max_len=5, 400 excluded"):
        make_listops(1, 1, exclude=every, **small)
