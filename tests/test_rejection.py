"""Layer 1 and 2 on toy distributions: the algebraic identity, then seeded chi-square tests of `verify`."""

import pytest
import torch

from verispec.chisquare import chi_square_test
from verispec.rejection import acceptance_probability, residual_distribution, verify, verify_greedy
from verispec.tree import Draft


def random_dist(V, gen, zeros=0):
    x = torch.rand(V, generator=gen, dtype=torch.float64) ** 3
    if zeros:
        x[torch.randperm(V, generator=gen)[:zeros]] = 0
    return x / x.sum()


def output_distribution(p, q):
    """Exact output of one verification step: accepted mass + rejected mass x residual."""
    accepted = q * acceptance_probability(p, q)  # (V,)
    rejected_mass = 1 - accepted.sum()
    return accepted + rejected_mass * residual_distribution(p, q)


@pytest.mark.parametrize("case", ["random", "sparse", "equal", "disjoint", "one_hot"])
def test_identity_accepted_plus_rejected_times_residual_is_p(case):
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        V = 50
        p = random_dist(V, gen, zeros=10 if case == "sparse" else 0)
        if case == "equal":
            q = p.clone()
        elif case == "disjoint":
            p = torch.zeros(V, dtype=torch.float64)
            p[:25] = random_dist(25, gen)
            q = torch.zeros(V, dtype=torch.float64)
            q[25:] = random_dist(25, gen)
        elif case == "one_hot":
            q = torch.zeros(V, dtype=torch.float64)
            q[int(torch.randint(V, (1,), generator=gen))] = 1.0
        else:
            q = random_dist(V, gen, zeros=10 if case == "sparse" else 0)
        torch.testing.assert_close(output_distribution(p, q), p, atol=1e-6, rtol=0)


@pytest.mark.parametrize("case", ["random", "sparse", "one_hot"])
def test_verify_decides_by_the_identitys_rule_on_every_draw(case):
    """The identity above is about `acceptance_probability` and `residual_distribution`; `verify` has its rule
    inline (u * q(x) < p(x), no division). On every draw, verify accepts x exactly when u < min(1, p(x)/q(x)),
    and a recovered token lies in the residual's support, so the identity speaks for the rule that runs."""
    gen = torch.Generator().manual_seed(1)
    for trial in range(300):
        p, q = random_dist(20, gen, zeros=5 if case == "sparse" else 0), random_dist(20, gen)
        if case == "one_hot":
            q = torch.zeros(20, dtype=torch.float64)
            q[trial % 20] = 1.0
        x = int(torch.multinomial(q, 1, generator=gen))
        verdict, u = verify(p[None].repeat(2, 1), Draft(torch.tensor([x]), None if case == "one_hot" else q[None]),
                            torch.Generator().manual_seed(trial), return_uniforms=True)
        alpha = float(acceptance_probability(p, q)[x])
        if abs(float(u[0]) - alpha) > 1e-9:  # away from the boundary, where rounding may decide either way
            assert (verdict.num_accepted == 1) == (float(u[0]) < alpha), (trial, float(u[0]), alpha)
        if verdict.num_accepted == 0:
            assert residual_distribution(p, q)[verdict.token] > 0


def test_residual_is_a_distribution_and_empty_residual_falls_back_to_p():
    gen = torch.Generator().manual_seed(1)
    p, q = random_dist(30, gen), random_dist(30, gen)
    r = residual_distribution(p, q)
    assert torch.all(r >= 0) and abs(float(r.sum()) - 1) < 1e-9
    assert torch.all(r[p <= q] == 0)
    torch.testing.assert_close(residual_distribution(p, p), p)


def sample_verify(p, q, draft_from_q, n, seed, one_hot_token=None):
    """Run `verify` for a one-token draft n times; returns counts of emitted first tokens."""
    rng = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[-1])
    P = torch.stack([p, p])  # (2, V): position 1 and the bonus position
    for _ in range(n):
        if one_hot_token is None:
            x = torch.multinomial(q, 1, generator=rng)
            verdict = verify(P.float(), Draft(x, q[None].float()), rng)
        else:
            x = torch.tensor([one_hot_token])
            verdict = verify(P.float(), Draft(x), rng)
        first = int(x[0]) if verdict.num_accepted else verdict.token
        counts[first] += 1
    return counts


@pytest.mark.parametrize("case", ["random", "disjoint", "equal", "one_hot"])
def test_verify_samples_match_p_chi_square(case):
    gen = torch.Generator().manual_seed(2)
    V = 12
    p = random_dist(V, gen)
    q = {"random": random_dist(V, gen), "equal": p.clone(),
         "disjoint": torch.cat([torch.zeros(6, dtype=torch.float64), random_dist(6, gen)]),
         "one_hot": None}[case]
    if case == "disjoint":
        p = torch.cat([random_dist(6, gen), torch.zeros(6, dtype=torch.float64)])
    counts = sample_verify(p, q, True, 6000, seed=3, one_hot_token=5 if case == "one_hot" else None)
    fit = chi_square_test(counts, p)
    assert fit.p_value > 1e-3, fit


def test_chi_square_detects_a_wrong_rule():
    """Negative control: sampling the recovered token from p instead of the residual is biased."""
    gen = torch.Generator().manual_seed(2)
    V = 12
    p, q = random_dist(V, gen), random_dist(V, gen)
    rng = torch.Generator().manual_seed(3)
    counts = torch.zeros(V)
    for _ in range(6000):
        x = int(torch.multinomial(q, 1, generator=rng))
        accept = float(torch.rand(1, generator=rng)) < min(1.0, float(p[x] / q[x]))
        counts[x if accept else int(torch.multinomial(p, 1, generator=rng))] += 1
    assert chi_square_test(counts, p).p_value < 1e-6


def test_verify_greedy_accepts_matching_prefix_then_emits_argmax():
    argmax = torch.tensor([4, 7, 1, 9])
    assert verify_greedy(argmax, Draft(torch.tensor([4, 7, 2]))) == verify_greedy(argmax, Draft(torch.tensor([4, 7, 3])))
    v = verify_greedy(argmax, Draft(torch.tensor([4, 7, 2])))
    assert (v.num_accepted, v.token, v.bonus) == (2, 1, False)
    v = verify_greedy(argmax, Draft(torch.tensor([4, 7, 1])))
    assert (v.num_accepted, v.token, v.bonus) == (3, 9, True)
    v = verify_greedy(argmax[:1], Draft(torch.zeros(0, dtype=torch.long)))
    assert (v.num_accepted, v.token, v.bonus) == (0, 4, True)


def test_verify_is_deterministic_for_a_seed():
    gen = torch.Generator().manual_seed(5)
    P = torch.stack([random_dist(20, gen) for _ in range(4)]).float()
    Q = torch.stack([random_dist(20, gen) for _ in range(3)]).float()
    x = torch.tensor([1, 2, 3])
    a = [verify(P, Draft(x, Q), torch.Generator().manual_seed(s)) for s in range(20)]
    b = [verify(P, Draft(x, Q), torch.Generator().manual_seed(s)) for s in range(20)]
    assert a == b


@pytest.mark.parametrize("V, block", [(12, 4), (13, 4), (3000, 1024), (5, 1024)])
def test_the_categorical_sampler_draws_its_weights(V, block, monkeypatch):
    """`sample` (the two-level float64 inverse CDF behind every recovered, bonus and sampled draft token)
    draws each id with its weight's share, never an id of weight 0, and takes only its generator's state."""
    import verispec.sampling as sampling

    monkeypatch.setattr(sampling, "SAMPLE_BLOCK", block)
    gen = torch.Generator().manual_seed(5)
    weights = random_dist(V, gen, zeros=V // 3).float() * 7.0  # unnormalised, a third of the ids impossible
    if V >= 1024:
        weights[: V // 2] = 0.0  # whole blocks without mass
        weights[-1] = 0.0  # the last id too (rounding past the end must not land on it)
    rng = torch.Generator().manual_seed(6)
    counts = torch.zeros(V)
    for _ in range(6000 if V < 100 else 20000):
        counts[sampling.sample(weights, rng)] += 1
    assert counts[weights == 0].sum() == 0
    live = weights > 0
    fit = chi_square_test(counts[live], (weights[live] / weights[live].sum()).double())
    assert fit.p_value > 1e-3, fit
    a, b = torch.Generator().manual_seed(6), torch.Generator().manual_seed(6)
    assert [sampling.sample(weights, a) for _ in range(8)] == [sampling.sample(weights, b) for _ in range(8)]
    with pytest.raises(ValueError, match="total"):
        sampling.sample(torch.zeros(V), rng)


def test_the_categorical_sampler_with_a_biased_block_choice_is_caught():
    """Negative control: picking the block uniformly instead of by its mass fails the same test."""
    from verispec.sampling import _first_above

    gen = torch.Generator().manual_seed(5)
    weights = random_dist(12, gen).float()
    blocks = weights.view(3, 4)
    rng = torch.Generator().manual_seed(6)
    counts = torch.zeros(12)
    for _ in range(6000):
        b = int(torch.randint(3, (), generator=rng))
        inner = blocks[b].cumsum(0, dtype=torch.float64)
        counts[4 * b + _first_above(inner, float(torch.rand((), generator=rng, dtype=torch.float64)) * float(inner[-1]))] += 1
    assert chi_square_test(counts, weights.double() / weights.sum()).p_value < 1e-6
