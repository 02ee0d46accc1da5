"""GRPO for tokens: closed-form gradients, clipping, the k3 estimator, aggregation."""

from __future__ import annotations

import pytest
import torch

from vlm.grpo import aggregate, clipped_surrogate, grpo_token_loss, k3_kl

torch.manual_seed(0)


def _batch(lengths: list[int], width: int = 5):
    mask_BT = torch.zeros(len(lengths), width)
    for i, n in enumerate(lengths):
        mask_BT[i, :n] = 1
    logp_BT = (-torch.rand(len(lengths), width) * 2).requires_grad_(True)
    return logp_BT, mask_BT


@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_gradient_at_ratio_one_is_the_policy_gradient(agg):
    lengths = [5, 2, 3, 1]
    logp_BT, mask_BT = _batch(lengths)
    adv_B = torch.tensor([1.5, -0.5, 0.25, -2.0])
    loss, stats = grpo_token_loss(logp_BT, logp_BT.detach(), None, adv_B, mask_BT, clip_range=0.2, beta=0.0, agg=agg)
    loss.backward()
    if agg == "token":  # d/dlogp_bt = -A_b / (total tokens)
        expected = -adv_B[:, None] * mask_BT / mask_BT.sum()
    else:  # d/dlogp_bt = -A_b / (B * L_b)
        expected = -adv_B[:, None] * mask_BT / (len(lengths) * torch.tensor(lengths, dtype=torch.float)[:, None])
    torch.testing.assert_close(logp_BT.grad, expected)
    assert stats["clip_frac"] == 0.0 and stats["ratio_mean"] == pytest.approx(1.0)


def test_clipping_stops_the_gradient_only_outside_the_trust_region():
    old_BT = torch.zeros(4, 1)
    # ratios 1.5 and 0.5 with A > 0 and A < 0: clipped exactly when the step would go further.
    logp_BT = torch.log(torch.tensor([[1.5], [0.5], [1.5], [0.5]])).requires_grad_(True)
    adv_B = torch.tensor([1.0, 1.0, -1.0, -1.0])
    clipped_surrogate(logp_BT, old_BT, adv_B, 0.2).sum().backward()
    grad = logp_BT.grad.squeeze(1)
    assert grad[0] == 0 and grad[3] == 0  # A > 0 and r > 1 + eps; A < 0 and r < 1 - eps
    torch.testing.assert_close(grad[1], torch.tensor(-0.5))  # -A r, not clipped: still pushes up
    torch.testing.assert_close(grad[2], torch.tensor(1.5))


def test_clip_higher_widens_only_the_upper_bound():
    old_BT = torch.zeros(4, 1)
    # ratios 1.25 and 0.75; DAPO's clip-higher (eps_high 0.28) keeps r = 1.25 with A > 0 in range.
    logp_BT = torch.log(torch.tensor([[1.25], [0.75], [1.25], [0.75]])).requires_grad_(True)
    adv_B = torch.tensor([1.0, -1.0, -1.0, 1.0])
    clipped_surrogate(logp_BT, old_BT, adv_B, 0.2, 0.28).sum().backward()
    grad = logp_BT.grad.squeeze(1)
    torch.testing.assert_close(grad[0], torch.tensor(-1.25))  # symmetric 0.2 would clip it (grad 0)
    assert grad[1] == 0  # A < 0, r < 1 - eps: still clipped below
    torch.testing.assert_close(grad[2], torch.tensor(1.25))
    torch.testing.assert_close(grad[3], torch.tensor(-0.75))
    # None is the symmetric range, and the loss's clip fraction counts against the widened bound.
    torch.testing.assert_close(
        clipped_surrogate(logp_BT, old_BT, adv_B, 0.2, None), clipped_surrogate(logp_BT, old_BT, adv_B, 0.2, 0.2)
    )
    mask_BT = torch.ones(4, 1)
    _, sym = grpo_token_loss(logp_BT, old_BT, None, adv_B, mask_BT, clip_range=0.2, beta=0.0, agg="token")
    _, high = grpo_token_loss(
        logp_BT, old_BT, None, adv_B, mask_BT, clip_range=0.2, beta=0.0, agg="token", clip_range_high=0.28
    )
    assert sym["clip_frac"] == 1.0 and high["clip_frac"] == 0.5


def test_k3_is_nonnegative_and_zero_when_policies_match():
    logp = -torch.rand(64, 7) * 5
    ref = -torch.rand(64, 7) * 5
    assert (k3_kl(logp, ref) >= 0).all()
    assert torch.equal(k3_kl(logp, logp), torch.zeros_like(logp))
    assert (k3_kl(logp, ref) > 0).any()


def test_k3_is_an_unbiased_kl_estimate_under_samples_of_the_policy():
    gen = torch.Generator().manual_seed(1)
    pi = torch.softmax(torch.randn(6, generator=gen), 0)
    ref = torch.softmax(torch.randn(6, generator=gen), 0)
    exact = (pi * (pi.log() - ref.log())).sum()
    tokens = torch.multinomial(pi, 200_000, replacement=True, generator=gen)
    estimate = k3_kl(pi.log()[tokens], ref.log()[tokens]).mean()
    assert abs(float(estimate - exact)) < 0.02 * float(exact) + 2e-3
    # k3's gradient in logp at logp = ref is zero: the KL term leaves an unchanged policy alone.
    logp = ref.log().clone().requires_grad_(True)
    k3_kl(logp, ref.log()).sum().backward()
    assert torch.allclose(logp.grad, torch.zeros(6))


def test_kl_term_pulls_toward_the_reference():
    logp_BT = torch.log(torch.tensor([[0.9]])).requires_grad_(True)
    ref_BT = torch.log(torch.tensor([[0.5]]))
    loss, stats = grpo_token_loss(
        logp_BT, logp_BT.detach(), ref_BT, torch.zeros(1), torch.ones(1, 1), clip_range=0.2, beta=1.0, agg="token"
    )
    loss.backward()
    assert logp_BT.grad.item() > 0  # gradient descent lowers logp toward the reference
    assert stats["kl_ref"] > 0


def test_aggregations_differ_for_unequal_lengths_and_agree_for_equal_ones():
    values_BT = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    unequal = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    assert aggregate(values_BT, unequal, "token").item() == pytest.approx(8 / 5)
    assert aggregate(values_BT, unequal, "sequence").item() == pytest.approx((1 + 4) / 2)
    equal = torch.ones(2, 4)
    assert aggregate(values_BT, equal, "token").item() == pytest.approx(aggregate(values_BT, equal, "sequence").item())
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(values_BT, equal, "batch")


@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_micro_batches_add_up_to_the_minibatch_loss(agg):
    lengths = [4, 1, 3, 2, 5, 2]
    logp_BT, mask_BT = _batch(lengths)
    old_BT = logp_BT.detach() + 0.1 * torch.randn_like(logp_BT)
    ref_BT = logp_BT.detach() - 0.3
    adv_B = torch.randn(6)
    kw = dict(clip_range=0.2, beta=0.05, agg=agg)
    full, _ = grpo_token_loss(logp_BT, old_BT, ref_BT, adv_B, mask_BT, **kw)
    parts = sum(
        grpo_token_loss(
            logp_BT[s],
            old_BT[s],
            ref_BT[s],
            adv_B[s],
            mask_BT[s],
            num_sequences=6,
            num_tokens=float(mask_BT.sum()),
            **kw,
        )[0]
        for s in (slice(0, 2), slice(2, 6))
    )
    torch.testing.assert_close(parts, full)
