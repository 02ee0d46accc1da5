"""`parallel.sp_backend`: ours or xDiT's USP as the attention core of the sequence-parallel forward.

On the CPU (CI): the field and its errors. Choosing xfuser with model.device=cpu fails at start,
naming the field, before a cluster starts or a model loads (`start_runtime`, `DiTRunner`, the CLI);
a CUDA machine without xfuser is told how to install it. The processor's xfuser branch runs at
degree 1 against a stand-in for xfuser's kernel entry (xfuser itself cannot import without a CUDA
build of torch).

On a GPU (`-m gpu`, CI does not run it): the real xfuser at degree 1, unbound and bound to a 1-rank
NCCL world, against ours and the stock forward.
"""

from __future__ import annotations

import importlib.metadata
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from test_ulysses import TOL, _stock, _tiny_model_and_inputs

from spotlight.config import DiTRecipe, ParallelConfig
from spotlight.core.config_io import load_config
from spotlight.parallel import SPContext, install_ulysses, ulysses_forward

RECIPE = "configs/dit/tiny-shapes.yaml"


def _cfg(*overrides: str) -> DiTRecipe:
    return load_config(DiTRecipe, RECIPE, list(overrides))


def test_ours_is_the_default_and_a_wrong_name_is_refused_naming_the_field():
    assert ParallelConfig().sp_backend == "ours" and _cfg().parallel.sp_backend == "ours"
    assert _cfg("parallel.sp_backend=xfuser", "model.device=cuda").parallel.sp_backend == "xfuser"  # loads anywhere
    with pytest.raises(ValueError, match=r"parallel\.sp_backend=xfuser runs on CUDA only.*'cpu'"):
        _cfg("parallel.sp_backend=xfuser")  # a CPU recipe that names xfuser fails as it loads
    with pytest.raises(ValueError, match=r"parallel\.sp_backend"):
        _cfg("parallel.sp_backend=deepspeed")
    ctx = SPContext()
    assert ctx.backend == "ours" and ctx.xfuser is None
    with pytest.raises(ValueError, match="ours, xfuser"):
        SPContext(backend="deepspeed")


def test_xfuser_on_the_cpu_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"parallel\.sp_backend=xfuser runs on CUDA only.*'cpu'.*sp_backend=ours"):
        ParallelConfig(sp_backend="xfuser").check_device("cpu")
    ParallelConfig(sp_backend="xfuser").check_device("cuda:0")  # the device check passes; the import decides
    ParallelConfig(sp_backend="ours").check_device("cpu")


def _must_not_run(what: str):
    def fail(*args, **kwargs):
        raise AssertionError(f"{what} ran before parallel.sp_backend was checked")

    return fail


def test_xfuser_on_the_cpu_fails_before_a_cluster_or_a_model_loads(monkeypatch, tmp_path):
    import spotlight.policy
    import spotlight.spot_runtime
    from spotlight.jobs import DiTRunner

    cfg = _cfg("parallel.sp_backend=xfuser", "runtime.rollouts=cluster", "explore.mode=none", "model.device=cuda")
    cfg.model.device = "cpu"  # past the recipe's own check (a config built in code): the runtime checks again
    monkeypatch.setattr(spotlight.spot_runtime, "import_ray_on_loopback", _must_not_run("the local cluster"))
    monkeypatch.setattr(spotlight.policy, "load_policy", _must_not_run("load_policy"))
    with pytest.raises(ValueError, match=r"parallel\.sp_backend=xfuser runs on CUDA only"):
        spotlight.spot_runtime.start_runtime(cfg, tmp_path)
    with pytest.raises(ValueError, match=r"parallel\.sp_backend=xfuser runs on CUDA only"):
        DiTRunner(cfg)


def test_the_cli_says_which_field_and_leaves_no_run_dir(monkeypatch, tmp_path, capsys):
    import spotlight.spot_runtime
    from spotlight.cli import main

    monkeypatch.setattr(spotlight.spot_runtime, "import_ray_on_loopback", _must_not_run("the local cluster"))
    run = tmp_path / "run"
    args = [
        "train",
        RECIPE,
        "--run-dir",
        str(run),
        "--quiet",
        "runtime.rollouts=cluster",
        "explore.mode=none",
        "parallel.sp_backend=xfuser",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "parallel.sp_backend=xfuser runs on CUDA only" in err and "model.device is 'cpu'" in err, err
    assert not run.exists()


def test_a_cuda_machine_without_xfuser_is_told_how_to_install_it(monkeypatch):
    """Before the model loads, on a machine where model.device=cuda passes the device check."""
    import spotlight.policy
    from spotlight.jobs import DiTRunner

    real_version = importlib.metadata.version

    def version(name: str, found: str | None = None) -> str:
        if name == "xfuser":
            if found is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return found
        return real_version(name)

    monkeypatch.setattr(spotlight.policy, "load_policy", _must_not_run("load_policy"))
    monkeypatch.setattr(importlib.metadata, "version", version)
    hint = "pip install 'spotlight-rl[gpu]'"
    with pytest.raises(
        ImportError, match=r"parallel\.sp_backend=xfuser needs xfuser \(xDiT\), which is not installed"
    ) as e:
        DiTRunner(_cfg("parallel.sp_backend=xfuser", "model.device=cuda"))
    assert hint in str(e.value)

    monkeypatch.setattr(importlib.metadata, "version", lambda name: version(name, "0.4.5"))
    with pytest.raises(ImportError, match=r"needs xfuser >= 0\.5\.0 .*found 0\.4\.5") as e:
        SPContext(backend="xfuser")
    assert hint in str(e.value)

    # Installed but unusable (here: its modules cannot import, as on a CPU build of torch without triton).
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version(name, "0.7.0"))
    monkeypatch.setitem(sys.modules, "xfuser.model_executor.layers.usp", None)
    with pytest.raises(ImportError, match=r"parallel\.sp_backend=xfuser: importing xfuser 0\.7\.0 failed") as e:
        SPContext(backend="xfuser")
    assert hint in str(e.value) and "CUDA build of torch" in str(e.value)


def _stand_in():
    """xfuser's SDPA kernel entry as `usp.attention` calls it: (B, H, K, E) inputs, the mask in attention_kwargs."""

    def attention(q, k, v, dropout_p=0.0, is_causal=False, backend=None, attention_kwargs=None):
        assert backend == "SDPA"
        mask = (attention_kwargs or {}).get("attn_mask")
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)

    return SimpleNamespace(version="stand-in", usp=SimpleNamespace(attention=attention), sdpa="SDPA")


def test_the_xfuser_branch_at_degree_1_matches_the_stock_forward(monkeypatch):
    """The processor's layout and key mask through xfuser's calling convention (padded prompts)."""
    import spotlight.parallel.xfuser_usp as xu

    monkeypatch.setattr(xu, "load_xfuser", _stand_in)
    model, inputs = _tiny_model_and_inputs()
    reference = _stock(model, inputs)
    ctx = install_ulysses(model, SPContext(backend="xfuser"))
    assert ctx.xfuser is not None and ctx.xfuser.degree is None
    ctx.set_group(None)  # unbinding an unbound core is a no-op
    assert (ulysses_forward(model, ctx, *inputs) - reference).abs().max().item() <= TOL


# -- on a GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_xfuser_at_degree_1_on_cuda_matches_ours(tmp_path):
    """The real xfuser (the gpu extra) at degree 1: unbound (`usp.attention`) and bound to a 1-rank NCCL
    world (`USP` over xfuser's own groups, bound, released and bound again), against ours and the stock
    forward, in float32 (TF32 off) and bfloat16."""
    import torch.distributed as dist

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        model, cpu_inputs = _tiny_model_and_inputs()
        model.cuda()
        results = {}
        for dtype in (torch.float32, torch.bfloat16):
            model.to(dtype)
            inputs = [x.cuda() if torch.is_tensor(x) else x for x in cpu_inputs]
            inputs[:2] = [x.to(dtype) for x in inputs[:2]]
            inputs[3] = inputs[3].to(dtype)
            stock = _stock(model, inputs).float()
            ours = ulysses_forward(model, install_ulysses(model, SPContext()), *inputs).float()
            ctx = install_ulysses(model, SPContext(backend="xfuser"))  # ImportError with the install hint if absent
            got = {"unbound": ulysses_forward(model, ctx, *inputs).float()}
            dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store_{dtype}", rank=0, world_size=1)
            try:
                for name in ("bound", "rebound"):
                    ctx.set_group(dist.group.WORLD)
                    assert ctx.xfuser.degree == 1
                    got[name] = ulysses_forward(model, ctx, *inputs).float()
                    ctx.set_group(None)
                    assert ctx.xfuser.degree is None
            finally:
                ctx.set_group(None)
                dist.destroy_process_group()
            scale = max(1.0, stock.abs().max().item())
            results[dtype] = {
                name: ((out - ours).abs().max().item(), (out - stock).abs().max().item()) for name, out in got.items()
            }
            print(
                f"{dtype}: max |xfuser - ours|, |xfuser - stock| = {results[dtype]}, |ours - stock| = "
                f"{(ours - stock).abs().max().item():.3g}, scale {scale:.3g}"
            )
            tol_ours, tol_stock = (
                (1e-5 * scale, 1e-4 * scale) if dtype == torch.float32 else (2e-2 * scale, 5e-2 * scale)
            )
            for name, (vs_ours, vs_stock) in results[dtype].items():
                assert vs_ours <= tol_ours, (dtype, name, vs_ours)
                assert vs_stock <= tol_stock, (dtype, name, vs_stock)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
