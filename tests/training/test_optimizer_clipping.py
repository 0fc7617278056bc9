"""Gradient clipping with every AdamW implementation and precision: fused AdamW under mixed precision crashed at
the first optimizer step ("does not allow for gradient clipping because it performs unscaling of gradients
internally"); now it clips, and the clip really bounds the step. Runs on CPU (torch's fused AdamW has a CPU kernel)."""

import pytest
import torch

from training.lit import LitGPT, TrainingConfigError

from test_training import _tiny_loader, _trainer


def _train_one_step(impl: str, precision: str, clip):
    torch.manual_seed(0)
    lit = LitGPT(vocab_size=37, n_layer=1, n_head=2, d_model=32, block_size=16, learning_rate=1e-2, warmup_steps=0,
                 optimizer_impl=impl)
    before = {k: v.clone() for k, v in lit.model.state_dict().items()}
    trainer = _trainer(max_steps=1, limit_val_batches=0, precision=precision, gradient_clip_val=clip)
    trainer.fit(lit, _tiny_loader(16, 16, 37, 8))
    opt = trainer.optimizers[0]
    delta = sum((v.float() - before[k].float()).abs().sum().item() for k, v in lit.model.state_dict().items())
    return opt, delta


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_clipping_works_and_bounds_the_step(impl, precision):
    opt, free = _train_one_step(impl, precision, None)
    assert opt.defaults["fused"] == (impl == "fused")
    _, clipped = _train_one_step(impl, precision, 1e-12)
    # Adam divides by sqrt(v) + eps: gradients clipped to a norm of 1e-12 are far below eps = 1e-8, so the first
    # step is ~1e-4 of the unclipped one (which moves every weight by ~lr)
    assert free > 0 and clipped < 1e-2 * free, (free, clipped)


def test_clip_by_value_with_fused():
    _, free = _train_one_step("fused", "bf16-mixed", None)
    torch.manual_seed(0)
    lit = LitGPT(vocab_size=37, n_layer=1, n_head=2, d_model=32, block_size=16, learning_rate=1e-2, warmup_steps=0,
                 optimizer_impl="fused")
    before = {k: v.clone() for k, v in lit.model.state_dict().items()}
    _trainer(max_steps=1, limit_val_batches=0, precision="bf16-mixed", gradient_clip_val=1e-12,
             gradient_clip_algorithm="value").fit(lit, _tiny_loader(16, 16, 37, 8))
    delta = sum((v.float() - before[k].float()).abs().sum().item() for k, v in lit.model.state_dict().items())
    assert delta < 1e-2 * free


def test_bad_optimizer_impl():
    with pytest.raises(TrainingConfigError, match="model.optimizer_impl"):
        LitGPT(vocab_size=37, n_layer=1, n_head=2, d_model=32, block_size=16, optimizer_impl="sgd")


def test_compile_option_trains_and_keeps_state_dict_names():
    torch.manual_seed(0)
    lit = LitGPT(vocab_size=37, n_layer=1, n_head=2, d_model=32, block_size=16, learning_rate=1e-2, warmup_steps=0,
                 compile=True)
    names = set(lit.model.state_dict())
    _trainer(max_steps=2, limit_val_batches=0).fit(lit, _tiny_loader(16, 16, 37, 8))
    assert set(lit.model.state_dict()) == names
    assert lit.model._compiled_call_impl is not None


@pytest.mark.parametrize("kw", [dict(attention="mha"), dict(attention="mla", d_latent=16, latent_norm=True),
                                dict(attention="mla", d_latent=16, kvsplice_keep=0.1, latent_norm=True)],
                         ids=["mha", "mla", "kvsplice90"])
def test_training_forward_compiles_without_graph_break(kw):
    """The kernel choice is resolved at construction: ``torch.compile(fullgraph=True)`` (which raises on any graph
    break) traces the training forward and backward of every variant, and matches eager."""
    from models import GPT
    from models.config import GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=37, n_layer=2, n_head=2, d_model=32, block_size=16, **kw))
    x = torch.randint(0, 37, (2, 16))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # dynamo + autograd tracing, no codegen
    out = compiled(x)
    out.float().pow(2).mean().backward()
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)


def test_splice_lr_mult_groups_and_kvsplice_norm_trains():
    from training.lit import param_groups

    torch.manual_seed(0)
    lit = LitGPT(vocab_size=37, n_layer=1, n_head=2, d_model=32, block_size=16, attention="mla", d_latent=16,
                 kvsplice_keep=0.5, kvsplice_norm=True, learning_rate=1e-2, warmup_steps=0, splice_lr_mult=10.0)
    groups = {g["name"]: g for g in param_groups(lit.model, 0.1, splice_lr=0.1)}
    assert groups["splice_decay"]["lr"] == 0.1 and len(groups["splice_decay"]["params"]) == 2
    assert not any(".splice." in n for n, p in lit.model.named_parameters()
                   if any(p is q for q in groups["decay"]["params"]))
    assert [g["name"] for g in param_groups(lit.model, 0.1)] == ["decay", "no_decay"]  # default: unchanged layout
    trainer = _trainer(max_steps=2, limit_val_batches=0)
    trainer.fit(lit, _tiny_loader(16, 16, 37, 8))
    lrs = {g["name"]: g["lr"] for g in trainer.optimizers[0].param_groups}
    assert lrs["splice_decay"] == pytest.approx(10 * lrs["decay"])
    with pytest.raises(TrainingConfigError, match="splice_lr_mult"):
        LitGPT(vocab_size=37, n_layer=1, n_head=2, d_model=32, block_size=16, splice_lr_mult=0.0)
