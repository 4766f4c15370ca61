"""ProjectionSite.blocks (damcha_core._layout), which both ports' converters read:
a grouped site needs ``groups`` to divide the head count of each role it holds,
and only those (Qwen3-Next's q_proj: H runs of a query head and its output
gate, beside a k_proj of G key heads that H runs need not divide)."""

from __future__ import annotations

import pytest

import damcha_core as dc
from damcha_core._layout import ProjectionSite


def test_a_grouped_site_of_one_role_need_not_divide_the_other_roles_heads():
    # 4 query heads of 8 features, each followed by 8 gate features; 3 key heads elsewhere.
    assert ProjectionSite("q_proj", q=0, groups=4).blocks(4, 3, 8, 64) == [("q", 8), (None, 8)]
    # Keys only: 2 runs of a key head and 8 other features, beside 3 query heads.
    assert ProjectionSite("kv", k=0, groups=2).blocks(3, 2, 8, 32) == [("k", 8), (None, 8)]
    # The gate first, then the query head (offsets within each run).
    assert ProjectionSite("q_proj", q=8, groups=4).blocks(4, 3, 8, 64) == [(None, 8), ("q", 8)]


@pytest.mark.parametrize(
    ("site", "heads", "features", "pattern"),
    [
        # The role the site holds must still split into its runs.
        (ProjectionSite("q_proj", q=0, groups=3), (4, 2), 48, r"groups=3 for `q_proj` with 48 features, 4 query heads"),
        (ProjectionSite("kv", k=0, groups=2), (4, 3), 48, r"groups=2 for `kv` with 48 features, 4 query heads and 3"),
        # A site with both roles needs both head counts divided.
        (ProjectionSite("qkv", q=0, k=8, groups=4), (4, 2), 96, r"groups=4 for `qkv` .* 2 key heads"),
        # And the features.
        (ProjectionSite("q_proj", q=0, groups=4), (4, 3), 66, r"groups=4 for `q_proj` with 66 features"),
    ],
    ids=["query-heads", "key-heads", "both-roles", "features"],
)
def test_a_grouped_site_whose_roles_do_not_split_is_refused(site, heads, features, pattern):
    with pytest.raises(dc.DamchaValueError, match=r"Invalid argument `groups`: expected a divisor.*" + pattern):
        site.blocks(*heads, 8, features)
