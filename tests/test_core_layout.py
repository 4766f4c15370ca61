"""damcha_core._layout, which both ports' converters read. ProjectionSite.blocks:
a grouped site needs ``groups`` to divide the head count of each role it holds,
and only those (Qwen3-Next's q_proj: H runs of a query head and its output
gate, beside a k_proj of G key heads that H runs need not divide). The three
classes check their fields where a custom adapter builds them, and
``check_layout`` what an adapter's ``layout()`` returned."""

from __future__ import annotations

import numpy as np
import pytest

import damcha_core as dc
from damcha_core._layout import AttentionLayout, ModelAdapter, ProjectionSite, check_layout, check_site_sizes


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


def _site(**kw):
    return ProjectionSite(**{"attr": "qkv", "q": 0, "k": 8, **kw})


def _layout(**kw):
    fields = {"num_heads": 2, "num_kv_heads": 2, "head_dim": 4, "query_features": 8, "key_features": 8}
    return AttentionLayout(**{**fields, "sites": (_site(),), **kw})


def _adapter(**kw):
    return ModelAdapter(**{"name": "a", "description": "d", "matches": bool, "layout": _layout, **kw})


@pytest.mark.parametrize(
    ("make", "error", "pattern"),
    [
        (lambda: _site(attr=""), dc.DamchaTypeError, r"`attr`: expected the projection's attribute name.*attr=''"),
        (lambda: _site(attr=3), dc.DamchaTypeError, r"`attr`.*attr=3"),
        (lambda: _site(q=None, k=None), dc.DamchaValueError, r"`q`: expected the feature offset.*q=None, k=None"),
        (lambda: _site(q=-4), dc.DamchaValueError, r"`q`: expected an int >= 0 or None.*ProjectionSite\(q=-4\)"),
        (lambda: _site(k=8.0), dc.DamchaTypeError, r"`k`: expected an int >= 0 or None.*k=8\.0"),
        (lambda: _site(groups=0), dc.DamchaValueError, r"`groups`: expected an int >= 1.*groups=0"),
        (lambda: _site(groups=True), dc.DamchaTypeError, r"`groups`: expected an int >= 1.*groups=True"),
        (lambda: _layout(num_heads=0), dc.DamchaValueError, r"`num_heads`: expected an int >= 1.*num_heads=0"),
        (lambda: _layout(head_dim="4"), dc.DamchaTypeError, r"`head_dim`: expected an int >= 1.*head_dim='4'"),
        (lambda: _layout(sites=_site()), dc.DamchaTypeError, r"`sites`: expected a tuple of ProjectionSite"),
        (lambda: _layout(sites=("qkv",)), dc.DamchaTypeError, r"`sites`: expected a tuple of ProjectionSite"),
        (lambda: _layout(self_attention="yes"), dc.DamchaTypeError, r"`self_attention`: expected True, False or None"),
        (lambda: _adapter(name=""), dc.DamchaTypeError, r"`name`: expected a non-empty str"),
        (lambda: _adapter(description=None), dc.DamchaTypeError, r"`description`: expected a str"),
        (lambda: _adapter(matches=True), dc.DamchaTypeError, r"`matches`: expected a callable.*matches=True"),
        (lambda: _adapter(layout="x"), dc.DamchaTypeError, r"`layout`: expected a callable.*layout='x'"),
    ],
    ids=[
        "site-attr-empty",
        "site-attr-int",
        "site-no-role",
        "site-negative-offset",
        "site-float-offset",
        "site-groups-zero",
        "site-groups-bool",
        "layout-no-heads",
        "layout-head-dim-str",
        "layout-sites-not-a-tuple",
        "layout-site-not-a-site",
        "layout-self-attention-str",
        "adapter-name-empty",
        "adapter-description-none",
        "adapter-matches-not-callable",
        "adapter-layout-not-callable",
    ],
)
def test_a_bad_field_is_refused_where_it_is_built(make, error, pattern):
    with pytest.raises(error, match=r"Invalid argument " + pattern):
        make()


def test_integer_fields_are_stored_as_ints():
    # Sizes read off a config as NumPy integers are accepted and stored as plain ints.
    layout = _layout(num_heads=np.int64(2), sites=[_site(k=np.int32(8), groups=np.int64(1))])
    assert type(layout.num_heads) is int and isinstance(layout.sites, tuple)
    assert type(layout.sites[0].k) is int and type(layout.sites[0].groups) is int


@pytest.mark.parametrize(
    ("layout", "error", "pattern"),
    [
        (
            None,
            dc.DamchaTypeError,
            r"`layout`: expected an AttentionLayout\. Received: adapter 'a''s layout\(\) returned None",
        ),
        (
            _layout(sites=(_site(k=None),)),
            dc.DamchaValueError,
            r"`sites`: expected sites that project the queries \(q\) and the keys \(k\) once each.*roles \['q'\]",
        ),
        (
            _layout(sites=(_site(), ProjectionSite("k2", k=0))),
            dc.DamchaValueError,
            r"`sites`: .*once each.*roles \['k', 'k', 'q'\] in \['qkv', 'k2'\]",
        ),
        (_layout(sites=(_site(k=6),)), dc.DamchaValueError, r"`k`: expected a multiple of head_dim=4.*k=6 for `qkv`"),
    ],
    ids=["not-a-layout", "no-key-site", "two-key-sites", "part-of-a-head"],
)
def test_check_layout_refuses_what_convert_cannot_map(layout, error, pattern):
    with pytest.raises(error, match=r"Invalid argument " + pattern):
        check_layout(_adapter(), layout)


def test_check_layout_returns_a_layout_that_fits():
    layout = _layout()
    assert check_layout(_adapter(), layout) is layout


_SIZED = AttentionLayout(
    2, 1, 4, 12, 10, (ProjectionSite("q_proj", q=0), ProjectionSite("kv", k=0)), self_attention=False
)


@pytest.mark.parametrize(
    "site, in_features, out_features, pattern",
    [
        (
            0,
            10,
            None,
            r"`query_features`: expected the input features of `q_proj`.*query_features=12 with `q_proj` "
            r"taking 10 input features",
        ),
        (1, 12, None, r"`key_features`: expected the input features of `kv`.*key_features=10 with `kv` taking 12"),
        (
            0,
            None,
            7,
            r"`q`: expected an offset whose 8 features lie in the projection's output \(7 features\).*q=0 for `q_proj`",
        ),
    ],
    ids=["query-input", "key-input", "query-output"],
)
def test_check_site_sizes_names_the_field_a_projection_contradicts(site, in_features, out_features, pattern):
    """Both converters' one check of a site's projection sizes: the input against the
    layout's query_features/key_features for each role it projects, the output
    against the blocks the site describes."""
    with pytest.raises(dc.DamchaValueError, match=pattern):
        check_site_sizes(_SIZED, _SIZED.sites[site], in_features=in_features, out_features=out_features)


def test_check_site_sizes_takes_fitting_and_unknown_sizes():
    for site, features in ((0, 12), (1, 10)):
        check_site_sizes(_SIZED, _SIZED.sites[site], in_features=features, out_features=8 if site == 0 else 4)
        check_site_sizes(_SIZED, _SIZED.sites[site], in_features=None, out_features=None)
