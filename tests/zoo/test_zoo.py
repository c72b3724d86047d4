"""The zoo models: parameter counts against hand formulas, shapes, causality, determinism, meta builds."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from autoplan.specs import load_model  # noqa: E402
from autoplan.zoo import build_model, cross_entropy_loss, num_parameters  # noqa: E402
from autoplan.zoo.model import MoE, run_experts  # noqa: E402

torch.set_num_threads(1)
NAMES = ["tiny-gpt", "tiny-llama", "tiny-moe"]


def gpt_params(spec) -> int:
    nl, h, v, s = spec.num_layers, spec.hidden_size, spec.vocab_size, spec.max_seq_length
    n = 12 * nl * h * h + 13 * nl * h + (v + s) * h + 2 * h  # tied embeddings (Narayanan et al. 2021, eq. 2)
    return n if spec.tie_embeddings else n + v * h


def llama_params(spec) -> int:
    h, dh, nh, nkv, v = spec.hidden_size, spec.dhead, spec.num_attention_heads, spec.kv_heads, spec.vocab_size
    attn = h * nh * dh + 2 * h * nkv * dh + nh * dh * h  # wq, wk, wv, wo (no biases)
    per_layer = attn + 2 * h  # two RMSNorm weights
    total = 0
    for i in range(spec.num_layers):
        if spec.is_moe_layer(i):
            f = spec.moe.expert_ffn_hidden_size or spec.ffn
            total += per_layer + h * spec.moe.num_experts + spec.moe.num_experts * 3 * h * f  # router + experts
        else:
            total += per_layer + 3 * h * spec.ffn  # SwiGLU w1, w3, w2
    emb = v * h * (1 if spec.tie_embeddings else 2)
    return total + emb + h  # + final norm


@pytest.mark.parametrize("name", NAMES)
def test_parameter_count_matches_formula(name):
    spec = load_model(name)
    expected = gpt_params(spec) if spec.activation == "gelu" else llama_params(spec)
    assert num_parameters(build_model(spec)) == expected


def test_parameter_count_hand_values():
    # Worked by hand: tiny-gpt 12*4*64^2 + 13*4*64 + (128+64)*64 + 2*64 (tied)
    assert num_parameters(build_model(load_model("tiny-gpt"))) == 196608 + 3328 + 12288 + 128
    # tiny-llama: per layer 12288 (attention, GQA 2 KV heads) + 33792 (SwiGLU 176) + 128 (norms); 2*128*64 + 64
    assert num_parameters(build_model(load_model("tiny-llama"))) == 4 * (12288 + 33792 + 128) + 16384 + 64
    # tiny-moe: per layer 12288 + 256 (router) + 4*3*64*96 (experts) + 128
    assert num_parameters(build_model(load_model("tiny-moe"))) == 4 * (12288 + 256 + 73728 + 128) + 16384 + 64


@pytest.mark.parametrize("name", NAMES)
def test_forward_shapes_and_loss(name):
    spec = load_model(name)
    model = build_model(spec).eval()
    tokens = torch.randint(0, spec.vocab_size, (2, 32))
    logits = model(tokens)
    assert logits.shape == (2, 32, spec.vocab_size)
    loss = cross_entropy_loss(logits, tokens)
    assert loss.ndim == 0 and 3.0 < loss.item() < 6.0  # near ln(128) = 4.85 at init


@pytest.mark.parametrize("name", NAMES)
def test_causal(name):
    spec = load_model(name)
    model = build_model(spec).eval()
    tokens = torch.randint(0, spec.vocab_size, (1, 32))
    changed = tokens.clone()
    changed[0, 20] = (changed[0, 20] + 1) % spec.vocab_size
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20], rtol=0, atol=0)
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_deterministic_by_name_and_seed():
    spec = load_model("tiny-llama")
    a, b, c = build_model(spec, seed=3), build_model(spec, seed=3), build_model(spec, seed=4)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(p, q), n
        if "norm" not in n:
            assert not torch.equal(p, r), n
    # A stage that deletes layers keeps the same values for what it holds
    d = build_model(spec, seed=3)
    del d.layers["0"]
    torch.testing.assert_close(d.layers["3"].mlp.w1.weight, a.layers["3"].mlp.w1.weight, rtol=0, atol=0)


def test_pipeline_slice_composes():
    spec = load_model("tiny-gpt")
    full = build_model(spec).eval()
    first, last = build_model(spec).eval(), build_model(spec).eval()
    for i in (2, 3):
        del first.layers[str(i)]
    for i in (0, 1):
        del last.layers[str(i)]
    first.norm = first.output = None
    last.tok_embeddings = last.pos_embeddings = None
    tokens = torch.randint(0, spec.vocab_size, (2, 16))
    torch.testing.assert_close(last(first(tokens)), full(tokens), rtol=1e-6, atol=1e-6)


def test_meta_build_gpt3_175b():
    model = build_model(load_model("gpt3-175b"), device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert num_parameters(model) == gpt_params(load_model("gpt3-175b"))


def test_moe_matches_per_token_loop():
    spec = load_model("tiny-moe")
    moe: MoE = build_model(spec).layers["0"].mlp
    x = torch.randn(2, 8, spec.hidden_size)
    got = moe(x)
    flat = x.reshape(-1, spec.hidden_size)
    ref = []
    for t in flat:
        logits = moe.router(t)
        w, idx = logits.topk(spec.moe.top_k)
        w = w.softmax(-1)
        ref.append(sum(wi * moe.experts[str(int(e))](t) for wi, e in zip(w, idx, strict=True)))
    torch.testing.assert_close(got.reshape(-1, spec.hidden_size), torch.stack(ref), rtol=1e-5, atol=1e-6)
    assert run_experts(moe.experts, flat[:0], [0] * 4, 0).shape == (0, spec.hidden_size)


def test_dropout_only_in_training():
    spec = load_model("tiny-gpt").model_copy(update={"dropout": 0.1})
    model = build_model(spec)
    tokens = torch.randint(0, spec.vocab_size, (1, 16))
    model.eval()
    torch.testing.assert_close(model(tokens), model(tokens))
    model.train()
    assert not torch.allclose(model(tokens), model(tokens))


def test_rotary_base_is_the_specs(monkeypatch):
    """The zoo model rotates q and k with its spec's rope_theta (Llama 3's presets: 500000), at the frequencies the
    Hugging Face families use (models.blocks.rope_inv_freq), and a different base is a different model."""
    from autoplan.models.arch import Arch
    from autoplan.models.blocks import rope_inv_freq
    from autoplan.zoo import model as zoo

    assert load_model("llama3-8b").rope_theta == 500000.0 and load_model("llama2-7b").rope_theta == 10000.0
    spec = load_model("tiny-llama")
    arch = Arch(family="llama", vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_layers=1,
                num_heads=spec.num_attention_heads, num_kv_heads=spec.kv_heads, head_dim=spec.dhead,
                ffn_size=spec.ffn, max_positions=spec.max_seq_length, rope_theta=500000.0)
    pos = torch.arange(spec.max_seq_length)
    cos, sin = zoo.rope_cos_sin(pos, spec.dhead, 500000.0)
    angles = pos.float()[:, None] * rope_inv_freq(arch)[None, :]
    torch.testing.assert_close(cos, angles.cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, angles.sin(), rtol=0, atol=1e-6)

    seen, real = [], zoo.rope_cos_sin
    monkeypatch.setattr(zoo, "rope_cos_sin", lambda p, d, base=10000.0: seen.append(base) or real(p, d, base))
    tokens = torch.randint(0, spec.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    logits = {}
    for theta in (10000.0, 500000.0):
        model = build_model(spec.model_copy(update={"rope_theta": theta}), seed=0)
        with torch.no_grad():
            logits[theta] = model(tokens)
        assert set(seen) == {theta}, seen
        seen.clear()
    assert not torch.allclose(logits[10000.0], logits[500000.0], atol=1e-4)


def test_squared_relu_mlp_is_relu_squared_and_priced_as_two_eager_ops(tmp_path, capsys):
    """activation: relu2 (Nemotron's squared ReLU): the zoo MLP computes w2(relu(w1 x)^2) and trains; a Hugging
    Face config with hidden_act relu2 reads as relu2 on both paths (spec and Arch); the cost model prices the two
    eager ops on autoplan's kernels and Megatron's fused one as one pass; Megatron's export says --squared-relu
    without the ReLU warning."""
    import json

    import yaml

    from autoplan.api import make_plan
    from autoplan.cli import main
    from autoplan.cost_models.specs import TrainingSpec
    from autoplan.inspect import export_megatron
    from autoplan.inspect.export_numerics import SQUARED_RELU_WARNING
    from autoplan.models.arch import read_arch
    from autoplan.specs import load_cluster, model_from_hf_config

    spec = load_model("tiny-gpt").model_copy(update={"activation": "relu2", "bias": False})
    model = build_model(spec, seed=0)
    mlp = model.layers["0"].mlp
    x = torch.randn(2, 5, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(mlp(x), mlp.w2(torch.relu(mlp.w1(x)) ** 2))
    tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())

    hf = {"architectures": ["NemotronForCausalLM"], "model_type": "nemotron", "hidden_act": "relu2",
          "hidden_size": 64, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
          "num_hidden_layers": 2, "vocab_size": 128, "max_position_embeddings": 64}
    assert model_from_hf_config(hf).activation == "relu2"
    # the runtime's own blocks take it as an activation of any family they build (Nemotron itself runs as the
    # user's module: its model_type is not one of autoplan/models' families)
    arch, problems = read_arch({**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    assert arch.act == "relu2" and not [p for p in problems if p.field == "hidden_act"]

    step = {}
    big = load_model("gpt3-1.3b")  # 8 x 2048 tokens a micro-batch: device-bound (small layers hide the bytes)
    for act in ("relu", "relu2"):
        path = tmp_path / f"{act}.yaml"
        path.write_text(yaml.safe_dump(big.model_copy(update={"name": act, "activation": act}).model_dump()))
        for stack in ("autoplan", "megatron-core"):
            assert main(["estimate", "--model", str(path), "--cluster", "dgx-h100", "--gpus", "8", "--global-batch",
                         "64", "--seq-len", "2048", "--parallel", "tp=1,mbs=8", "--stack", stack, "--json"]) == 0
            step[act, stack] = json.loads(capsys.readouterr().out)["step_time_s"]
    assert step["relu2", "autoplan"] > step["relu", "autoplan"]
    assert step["relu2", "megatron-core"] == step["relu", "megatron-core"]
    plan = make_plan(big.model_copy(update={"activation": "relu2"}), load_cluster("dgx-h100", gpus=8),
                     TrainingSpec(global_batch_size=64, seq_length=2048), "tp=1,mbs=8")
    ex = export_megatron(plan)
    assert "--squared-relu" in ex["flags"] and SQUARED_RELU_WARNING not in ex["warnings"]
