"""Routing generators: shapes and dtypes, distinct experts, the hot expert, seeds, Zipf skew."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ep_comm.testing.routing import hot_routing, make_routing, uniform_routing, zipf_routing


def check_routing(routing, num_tokens, num_experts, num_topk):
    idx, w = routing
    assert idx.dtype == np.int64 and idx.shape == (num_tokens, num_topk)
    assert w.dtype == np.float32 and w.shape == (num_tokens, num_topk)
    assert ((idx >= 0) & (idx < num_experts)).all()
    assert all(len(set(row)) == num_topk for row in idx.tolist()), "experts repeat inside a row"
    assert (w > 0).all()
    np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-6)
    assert (np.diff(w, axis=1) <= 0).all(), "weights descend along the row"


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["uniform", "hot", "zipf"]), num_tokens=st.integers(0, 64),
       num_experts=st.integers(1, 40), data=st.data())
def test_properties(kind, num_tokens, num_experts, data):
    num_topk = data.draw(st.integers(1, num_experts))
    hot = data.draw(st.integers(0, num_experts - 1))
    routing = make_routing(kind, num_tokens, num_experts, num_topk, seed=3, hot_expert=hot)
    check_routing(routing, num_tokens, num_experts, num_topk)
    if kind == "hot":
        assert (routing.topk_idx == hot).any(axis=1).all()


def test_hot_expert_in_every_row_and_rest_uniform():
    idx, _ = hot_routing(4000, 16, 4, seed=1, hot_expert=5)
    assert (idx[:, 0] == 5).all() and not (idx[:, 1:] == 5).any()
    counts = np.bincount(idx[:, 1:].ravel(), minlength=16)
    others = np.delete(counts, 5)
    expected = 4000 * 3 / 15
    assert (np.abs(others - expected) < 0.15 * expected).all()


def test_uniform_is_balanced():
    idx, _ = uniform_routing(8000, 32, 8, seed=2)
    counts = np.bincount(idx.ravel(), minlength=32)
    expected = 8000 * 8 / 32
    assert (np.abs(counts - expected) < 0.1 * expected).all()


def test_zipf_is_skewed_toward_low_ids():
    idx, _ = zipf_routing(8000, 64, 4, seed=0, s=1.2)
    counts = np.bincount(idx.ravel(), minlength=64)
    assert counts[0] > 5 * counts[-1]
    head, tail = counts[:8].sum(), counts[-8:].sum()
    assert head > 3 * tail
    flat, _ = zipf_routing(8000, 64, 4, seed=0, s=0.1)
    assert np.bincount(flat.ravel(), minlength=64)[0] < counts[0]


@pytest.mark.parametrize("kind", ["uniform", "hot", "zipf"])
def test_deterministic_by_seed(kind):
    a = make_routing(kind, 100, 32, 4, seed=(7, 1))
    b = make_routing(kind, 100, 32, 4, seed=(7, 1))
    c = make_routing(kind, 100, 32, 4, seed=(7, 2))
    assert np.array_equal(a.topk_idx, b.topk_idx) and np.array_equal(a.topk_weights, b.topk_weights)
    assert not np.array_equal(a.topk_idx, c.topk_idx)


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda: make_routing("bursty", 4, 8, 2), r"kind='bursty': must be one of"),
        (lambda: uniform_routing(4, 8, 9), r"num_topk=9: must be in \[1, num_experts=8\]"),
        (lambda: uniform_routing(-1, 8, 2), r"num_tokens=-1: must be >= 0"),
        (lambda: hot_routing(4, 8, 2, hot_expert=8), r"hot_expert=8: must be in \[0, num_experts=8\)"),
        (lambda: zipf_routing(4, 8, 2, s=0.0), r"s=0.0: the Zipf exponent must be > 0"),
    ],
)
def test_errors_name_argument_value_rule(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()
