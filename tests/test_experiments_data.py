"""The experiments' data generators: deterministic per seed, labels right on hand-checked cases."""

from __future__ import annotations


import numpy as np
import pytest

from damcha_core import DamchaValueError
from damcha_experiments import _data
from damcha_experiments import crosshead_answer, listops_eval, listops_parse, listops_tokens, make_crosshead, make_listops


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
    assert ids == [_data.OP0 + 0, _data.DIGIT0 + 3, _data.OP0 + 1, _data.DIGIT0 + 4, _data.DIGIT0 + 1,
                   _data.CLOSE, _data.CLOSE]


def _decode(ids):
    """Token ids back to text, independently of the generator."""
    names = {_data.CLOSE: "]", **{_data.DIGIT0 + i: str(i) for i in range(10)},
             **{_data.OP0 + i: "[" + op for i, op in enumerate(_data.LISTOPS_OPS)}}
    return " ".join(names[i] for i in ids)


def _python_eval(text):
    """An evaluator that shares no code with the generator: rewrite to Python and eval."""
    src = text.replace("[MAX", "max(").replace("[MIN", "min(").replace("[MED", "med(").replace("[SM", "sm(")
    src = src.replace(" ]", ")").replace("( ", "(")
    src = src.replace(" ", ",").replace("(,", "(")
    return eval(src, {"max": lambda *a: max(a), "min": lambda *a: min(a),
                      "med": lambda *a: sorted(a)[(len(a) - 1) // 2], "sm": lambda *a: sum(a) % 10})


def test_listops_generated_labels_match_an_independent_evaluator():
    data = make_listops(80, seed=5, max_len=64)
    assert data.inputs.shape == (80, 64, 1) and data.readout == 0
    for x, y in zip(data.inputs[..., 0], data.targets):
        assert x[0] == _data.CLS
        body = [int(t) for t in x[1:] if t != _data.PAD]
        assert np.all(x[1 + len(body):] == _data.PAD)  # padding only at the end
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
        (lambda: make_crosshead(0, 0), "`n` must be an int >= 1"),
        (lambda: make_crosshead(5, 0, blocks=4, items=3), "items >= blocks"),
        (lambda: make_listops(5, 0, max_args=1), "`max_args` must be an int >= 2"),
        (lambda: _data.stdlib_corpus(val_fraction=1.5), "`val_fraction` must be in"),
    ],
    ids=["n-zero", "too-few-items", "max-args", "val-fraction"],
)
def test_bad_arguments_are_named(call, match):
    with pytest.raises(DamchaValueError, match=match):
        call()
