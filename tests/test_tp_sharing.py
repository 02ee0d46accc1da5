"""Weight sharing across TP layouts (vlm/tp_sharing.py) on tiny real Qwen2.5-VL models.

The expected shards come from `reference_shard` below, written from the Megatron splits directly
(independent of the module's rule table), so a wrong rule or a wrong view fails here.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vlm.tp_sharing import aliases, colocate, plan_sharing, qwen2_5_vl_rules

ROOT = Path(__file__).resolve().parents[1]


def tiny_config(num_heads: int, num_kv_heads: int, vision_heads: int):
    from transformers import Qwen2_5_VLConfig

    head_dim = 64 // num_heads
    half = head_dim // 2  # mrope_section sums to head_dim / 2
    section = [half - 2 * (half // 3), half // 3, half // 3]
    return Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            vocab_size=256,
            tie_word_embeddings=False,
            rope_scaling={"type": "mrope", "mrope_section": section},
            bos_token_id=0,
            eos_token_id=1,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=vision_heads,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            fullatt_block_indexes=[1],
        ),
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def models():
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    return {
        "A": Qwen2_5_VLForConditionalGeneration(tiny_config(4, 2, 2)),  # 4 q / 2 kv heads, vision 2 heads
        "B": Qwen2_5_VLForConditionalGeneration(tiny_config(8, 4, 4)),  # divisible by 4
    }


CASES = [("A", 2, 1), ("A", 1, 2), ("B", 4, 2)]


def reference_shard(name: str, full: torch.Tensor, degree: int, rank: int) -> torch.Tensor:
    """Megatron shard of one Qwen2.5-VL tensor, from the layer's role."""
    if re.search(r"attn\.qkv\.(weight|bias)$", name):  # fused [Q; K; V]: own q, own k, own v heads
        return torch.cat([part.chunk(degree, 0)[rank] for part in full.chunk(3, 0)])
    if re.search(r"(o_proj|attn\.proj|down_proj|merger\.mlp\.2)\.weight$", name):  # row-parallel
        return full.chunk(degree, 1)[rank]
    column = r"([qkv]_proj|gate_proj|up_proj|merger\.mlp\.0)\.(weight|bias)$|(embed_tokens|lm_head)\.weight$"
    if re.search(column, name):  # column- and vocab-parallel
        return full.chunk(degree, 0)[rank]
    return full  # norms, patch embedding, row-parallel biases


def build(model, t: int, r: int):
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = plan_sharing({n: x.shape for n, x in full.items()}, qwen2_5_vl_rules(model.config), t, r)
    return full, plan, colocate(full, plan)


@pytest.mark.parametrize(("which", "t", "r"), CASES)
def test_shards_equal_a_fresh_reshard(models, which, t, r):
    full, plan, shards = build(models[which], t, r)
    for p in plan.tensors:
        for i, tensor in enumerate(shards.train[p.name]):
            assert torch.equal(tensor, reference_shard(p.name, full[p.name], t, i)), (p.name, i)
        for j, tensor in enumerate(shards.rollout[p.name]):
            assert torch.equal(tensor, reference_shard(p.name, full[p.name], r, j)), (p.name, j)


@pytest.mark.parametrize(("which", "t", "r"), CASES)
def test_share_and_view_alias_training_storage(models, which, t, r):
    _, plan, shards = build(models[which], t, r)
    k = max(t, r) // min(t, r)
    nested = [(i, i // k) for i in range(t)] if t >= r else [(j // k, j) for j in range(r)]
    kinds = set()
    for p in plan.tensors:
        kinds.add(p.kind)
        for i, j in nested:
            assert aliases(shards.train[p.name][i], shards.rollout[p.name][j]) == (p.kind != "rebuild"), p.name
    assert kinds == {"share", "view", "rebuild"}
    whole = torch.zeros(10)
    assert not aliases(whole[:5], whole[5:]) and aliases(whole[:6], whole[5:])


@pytest.mark.parametrize(("which", "t", "r"), CASES)
def test_optimizer_step_then_refresh(models, which, t, r):
    """A real optimizer updates the training shards in place; share/view see it at once, rebuild after refresh()."""
    full, plan, shards = build(models[which], t, r)
    gen = torch.Generator().manual_seed(1)
    grads = {n: torch.randn(x.shape, generator=gen) for n, x in full.items()}
    params, seen = [], set()
    for p in plan.tensors:
        for i, tensor in enumerate(shards.train[p.name]):
            key = (tensor.data_ptr(), tensor.stride(), tuple(tensor.shape))
            if key in seen:  # replicated tensors of one group are one buffer: step it once
                continue
            seen.add(key)
            param = torch.nn.Parameter(tensor)
            assert aliases(param, tensor)
            param.grad = reference_shard(p.name, grads[p.name], t, i).clone()
            params.append(param)
    torch.optim.SGD(params, lr=0.1).step()
    new_full = {n: x.clone() for n, x in full.items()}
    reference = [torch.nn.Parameter(x) for x in new_full.values()]
    for param, name in zip(reference, new_full, strict=True):
        param.grad = grads[name]
    torch.optim.SGD(reference, lr=0.1).step()
    assert not any(torch.equal(full[n], new_full[n]) for n in full)  # the step changed every tensor

    pointers = {p.name: [x.data_ptr() for x in shards.rollout[p.name]] for p in plan.tensors}
    for p in plan.tensors:
        for j, tensor in enumerate(shards.rollout[p.name]):
            expected = reference_shard(p.name, (full if p.kind == "rebuild" else new_full)[p.name], r, j)
            torch.testing.assert_close(tensor, expected, msg=f"{p.name} ({p.kind}) before refresh")
    assert shards.refresh() == plan.numel("rebuild")
    for p in plan.tensors:
        assert [x.data_ptr() for x in shards.rollout[p.name]] == pointers[p.name]  # rebuilt in place
        for j, tensor in enumerate(shards.rollout[p.name]):
            torch.testing.assert_close(tensor, reference_shard(p.name, new_full[p.name], r, j), msg=p.name)


def test_known_classes_and_fractions(models):
    model = models["A"]
    shapes = {n: x.shape for n, x in model.named_parameters()}
    plan = plan_sharing(shapes, qwen2_5_vl_rules(model.config), 2, 1)
    kind = {p.name: p.kind for p in plan.tensors}
    text, vision = "model.language_model.layers.0.", "model.visual.blocks.0."
    assert kind[text + "self_attn.o_proj.weight"] == "view"  # row-parallel
    assert kind[text + "mlp.down_proj.weight"] == "view"
    assert kind[vision + "attn.proj.weight"] == "view"
    assert kind[vision + "attn.qkv.weight"] == kind[vision + "attn.qkv.bias"] == "rebuild"  # fused QKV
    for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.bias", "mlp.gate_proj.weight"):
        assert kind[text + name] == "share"  # column-parallel
    assert kind["model.language_model.embed_tokens.weight"] == kind["lm_head.weight"] == "share"
    assert kind[text + "input_layernorm.weight"] == kind[vision + "attn.proj.bias"] == "share"  # replicated
    fractions = plan.fractions()
    assert plan.numel() == sum(p.numel() for p in model.parameters())
    assert sum(fractions[k] for k in ("share", "view", "rebuild")) == pytest.approx(1.0)
    assert fractions["shared_fraction"] == pytest.approx(fractions["share"] + fractions["view"])
    same = plan_sharing(shapes, qwen2_5_vl_rules(model.config), 2, 2)
    assert same.fractions()["share"] == 1.0


def test_rollout_shards_compute_the_full_layers(models):
    """Row/column/fused splits mean what they say: summing the ranks' partial outputs gives the full layer."""
    model = models["B"]
    _, plan, shards = build(model, 4, 2)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 64, generator=gen)
    text, vision = "model.language_model.layers.0.mlp.", "model.visual.blocks.0.attn."
    gate, up, down = (shards.rollout[text + n] for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"))
    partial = [F.linear(F.silu(F.linear(x, gate[j])) * F.linear(x, up[j]), down[j]) for j in range(2)]
    with torch.no_grad():
        torch.testing.assert_close(sum(partial), model.model.language_model.layers[0].mlp(x))

    def attention(h, w_qkv, b_qkv, w_proj, num_heads):  # plain MHA, rows of qkv are [Q; K; V]
        q, k, v = F.linear(h, w_qkv, b_qkv).reshape(len(h), 3, num_heads, -1).unbind(1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return F.linear(out.transpose(0, 1).reshape(len(h), -1), w_proj)

    h = torch.randn(6, 32, generator=gen)
    params = dict(model.named_parameters())
    names = ("qkv.weight", "qkv.bias", "proj.weight")
    with torch.no_grad():
        full = attention(h, *(params[vision + n] for n in names), 4)  # 4 heads
        sharded = sum(attention(h, *(shards.rollout[vision + n][j] for n in names), 2) for j in range(2))
    torch.testing.assert_close(sharded, full)
    assert plan.by_name()[vision + "qkv.weight"].kind == "rebuild"


def test_bad_degrees_name_the_tensor_and_degree(models):
    model = models["A"]
    shapes = {n: x.shape for n, x in model.named_parameters()}
    rules = qwen2_5_vl_rules(model.config)
    qkv = r"model\.visual\.blocks\.0\.attn\.qkv\.weight"
    with pytest.raises(ValueError, match=qkv + r": 2 q heads .* training TP degree 4"):
        plan_sharing(shapes, rules, 4, 2)
    text_only = {n: s for n, s in shapes.items() if "visual" not in n}
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.k_proj\.weight: 2 kv heads .* rollout TP degree 4"):
        plan_sharing(text_only, rules, 1, 4)
    with pytest.raises(ValueError, match="do not nest"):
        plan_sharing(shapes, rules, 2, 3)
    with pytest.raises(ValueError, match="extra.weight: no split rule"):
        plan_sharing({**shapes, "extra.weight": (4, 4)}, rules, 2, 1)


def test_benchmark_prints_one_json_line(monkeypatch, capsys):
    """benchmarks/tp_sharing.py's entry point, run in-process (transformers is imported already)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import tp_sharing as bench

    monkeypatch.setattr(sys, "argv", ["tp_sharing.py", "--json", "--train-tp", "8", "--rollout-tp", "4"])
    bench.main()
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["share"] + result["view"] + result["rebuild"] == pytest.approx(1.0, abs=1e-3)
    assert result["shared_fraction"] == pytest.approx(result["share"] + result["view"], abs=1e-3)
    assert result["params_b"] > 30  # the 32B architecture, not a tiny one
    assert result["if_text_qkv_fused"]["rebuild"] > result["rebuild"]
