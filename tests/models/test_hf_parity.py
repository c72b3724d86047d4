"""Parity with transformers: for every family a tiny random config, the same weights in transformers' own model
and in autoplan's (autoplan.models.load), logits within 1e-5 (fp32) and the same loss; the weight conversion both
ways is bit-exact; unsupported fields are refused by name."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402

from autoplan import models  # noqa: E402
from autoplan.models import hf_weights  # noqa: E402
from autoplan.zoo import cross_entropy_loss  # noqa: E402

from .hf_configs import CONFIGS, hf_model  # noqa: E402

SEQ = 12  # longer than every test window, within max_position_embeddings


def _ours_from_hf(cfg, ref):
    model = models.load(cfg, device="meta")
    shapes = {n: p.shape for n, p in model.state_dict().items()}
    state = hf_weights.from_hf(ref.state_dict(), model.arch, shapes)
    model = model.to_empty(device="cpu")
    if model.arch.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected
    assert set(missing) <= {"output.weight"} and (not missing or model.arch.tie_embeddings)
    return model.eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_loss_match_transformers(name):
    torch.manual_seed(1)
    cfg = CONFIGS[name]
    ref = hf_model(cfg)
    ours = _ours_from_hf(cfg, ref)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters())
    tokens = torch.randint(0, cfg["vocab_size"], (2, SEQ))
    with torch.no_grad():
        want = ref(input_ids=tokens, labels=tokens)
        got = ours(tokens)
    assert got.shape == want.logits.shape
    diff = (got - want.logits).abs().max().item()
    assert diff <= 1e-5, f"{name}: max |logits diff| {diff:.2e}"
    # transformers shifts the labels inside; autoplan's loss takes already shifted labels
    loss = cross_entropy_loss(got[:, :-1], tokens[:, 1:])
    assert abs(loss.item() - want.loss.item()) <= 1e-5


@pytest.mark.parametrize("name", ["llama", "gpt2", "gpt_neox", "phi3", "mixtral", "gemma2"])
def test_weight_conversion_round_trip_is_bit_exact(name):
    ref = hf_model(CONFIGS[name])
    ours = _ours_from_hf(CONFIGS[name], ref)
    back = hf_weights.to_hf(ours.state_dict(), ours.arch)
    hf_state = {k: v for k, v in ref.state_dict().items() if not (ours.arch.tie_embeddings and k == "lm_head.weight")}
    assert set(back) == set(hf_state)
    for k, v in hf_state.items():
        assert torch.equal(back[k], v), k


def test_unsupported_fields_are_refused_by_name():
    bad = dict(CONFIGS["llama"], rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 16})
    problems = models.check(bad)
    assert [p.field for p in problems] == ["rope_parameters.rope_type"]
    with pytest.raises(models.UnsupportedConfigError, match="rope_type='yarn'"):
        models.load(bad, device="meta")
    opt = dict(CONFIGS["opt"], word_embed_proj_dim=16)
    with pytest.raises(models.UnsupportedConfigError, match="word_embed_proj_dim=16"):
        models.load(opt, device="meta")
    with pytest.raises(models.UnsupportedConfigError, match="model_type 'bert'"):
        models.load({"model_type": "bert"}, device="meta")


def test_zoo_presets_still_load_through_the_entry_point():
    from autoplan.zoo import TransformerLM

    m = models.load("tiny-llama")
    assert isinstance(m, TransformerLM)
    assert m(torch.zeros(1, 4, dtype=torch.long)).shape[-1] == m.spec.vocab_size
