"""Latent attention (mla): its two forms agree, only the rotated key carries a position, and the
cache per token is the latent plus one shared rotated key."""

from __future__ import annotations

import torch

from models.positional import matched_config
from models.transformer import Transformer


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(matched_config("mla")).eval()


def test_absorbed_decode_matches_up_projected_forward() -> None:
    model = _model()
    tokens = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        full, _ = model(tokens)
        model.return_new_key_values_only()
        head, past = model(tokens[:, :30])
        tail, new = model(tokens[:, 30:], past_key_values=past)
    torch.testing.assert_close(torch.cat((head, tail), dim=1), full, atol=2e-5, rtol=0)
    assert [layer[0].shape for layer in new] == [(2, 1, 10, 64 + 16)] * 4  # one [latent; rotated key] a layer


def test_moving_rotated_keys_equals_computing_them_later() -> None:
    model = _model()
    tokens = torch.randint(0, 256, (1, 24))
    positions = torch.arange(24)[None]
    with torch.no_grad():
        _, at_zero = model(tokens, position_ids=positions)
        _, later = model(tokens, position_ids=positions + 100)
    for (cache_zero,), (cache_later,) in zip(at_zero, later, strict=True):
        torch.testing.assert_close(model.positional.move_keys(cache_zero, 100), cache_later, atol=1e-5, rtol=0)
        torch.testing.assert_close(cache_zero[..., :64], cache_later[..., :64])  # the latent carries no position
        assert not torch.allclose(cache_zero[..., 64:], cache_later[..., 64:])


def test_cache_per_token_is_under_a_third_of_ropes_with_the_same_parameter_budget() -> None:
    mla, rope = Transformer(matched_config("mla")), Transformer(matched_config("rope"))
    with torch.no_grad():
        _, mla_cache = mla(torch.zeros((1, 1), dtype=torch.long))
        _, rope_cache = rope(torch.zeros((1, 1), dtype=torch.long))
    floats = sum(t.numel() for layer in mla_cache for t in layer)
    assert floats / sum(k.numel() + v.numel() for k, v in rope_cache) <= 0.35
    assert abs(mla.num_parameters() / rope.num_parameters() - 1) < 0.01


def test_the_up_projected_serving_form_bench_times_computes_the_same_step() -> None:
    """bench/latent.py's yardstick (every cached latent up-projected each call) is the same function."""
    model = _model()
    tokens = torch.randint(0, 256, (1, 30))
    with torch.no_grad():
        model.return_new_key_values_only()
        _, past = model(tokens[:, :29])
        absorbed, _ = model(tokens[:, 29:], past_key_values=past)
        for block in model.blocks:
            block.attn.serve_in_place(absorbed=False)
        projected, new = model(tokens[:, 29:], past_key_values=past)
    torch.testing.assert_close(projected, absorbed, atol=2e-5, rtol=0)
    assert new[0][0].shape[2] == 1  # still only the new entry back


def test_training_form_pads_values_for_the_fused_kernel_and_computes_the_same() -> None:
    """The training form pads each head's values to the query's width (PyTorch's fused kernel wants one
    width); outputs and gradients match the plain products, at widths whose query is wider than a head."""
    torch.manual_seed(0)
    model = Transformer(matched_config("mla", latent_dim=56, latent_rope_dim=32)).train()
    tokens = torch.randint(0, 256, (2, 40))
    plain_out, _ = model(tokens)
    plain_out.square().mean().backward()
    plain_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.attend_with_fused_kernel()
    fused_out, _ = model(tokens)
    fused_out.square().mean().backward()
    torch.testing.assert_close(fused_out, plain_out, atol=2e-5, rtol=0)
    for plain, fused in zip(plain_grads, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-4)
