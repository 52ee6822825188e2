"""sf.plan: the predicted step peak against the measured one, the ladder's monotonicity,
apply, max_batch, the optimizer knob, and errors that change nothing.

"Measured" is a real training step (forward, backward, optimizer step after a warm-up
step) under ``slimformer.memory.peak_memory``, plus what persists across steps
(parameters, buffers, optimizer state, the batch): what ``plan.peak_bytes`` predicts.
Both read the allocator (on CPU its events, through torch.profiler); the tests allow 1%.
"""

import copy
import gc
import subprocess
import sys

import pytest
import torch
from torch import nn

import slimformer as sf
from slimformer.memory import peak_memory
from slimformer.plan import (
    OptimizerCost,
    ladder,
    max_batch,
    optimizer_in_backward,
    parse_budget,
    plannable_layers,
    profile,
    synthetic_batch,
)
from slimformer.plan.planner import choose
from slimformer.plan.profile import Envelope

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.xdist_group("plan")


@pytest.fixture(autouse=True)
def _pytorch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the PyTorch path keeps and makes what the kernels do, quicker


def _config(**kwargs):
    base = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=256, vocab_size=300)
    return transformers.BertConfig(**{**base, **kwargs})


def _model(head="BertForMaskedLM", **kwargs):
    torch.manual_seed(0)
    return getattr(transformers, head)(_config(**kwargs)).train()


def _persistent(tensors) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def measured_peak(model, batch, policies, optimizer="adamw", autocast=None, unpad=False, loss_fn=None) -> int:
    """A real step's peak (see the module docstring) of a patched copy of ``model``."""
    model = copy.deepcopy(model)
    if not plannable_layers(model):
        sf.patch(model, unpad=unpad)
    for (_, layer), policy in zip(plannable_layers(model), policies):
        layer.recompute = policy
    if optimizer == "adamw-in-backward":
        opt = optimizer_in_backward(model, torch.optim.AdamW)
        states = [o.state for o in opt.optimizers.values()]
    else:
        opt = torch.optim.AdamW(model.parameters(), fused=optimizer == "adamw-fused")
        states = [opt.state]
    loss_fn = loss_fn or (lambda m, b: m(**b).loss)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        gc.collect()
        with peak_memory("cpu") as peak:
            with torch.autocast("cpu", autocast, enabled=autocast is not None):
                loss = loss_fn(model, batch)
            loss.backward()
            del loss
            opt.step()
    kept = [v for state in states for s in state.values() for v in s.values() if torch.is_tensor(v)]
    return peak.bytes + _persistent([*model.parameters(), *model.buffers(), *kept, *batch.values()])


def _check(plan_profile, flops, model, batch, rows, optimizer="adamw", **kwargs):
    rungs = ladder(plan_profile, flops, rows)
    assert len(rungs) >= 3
    for rung in (rungs[0], rungs[len(rungs) // 2], rungs[-1]):
        measured = measured_peak(model, batch, rung.policies, optimizer, **kwargs)
        assert rung.prediction.peak_bytes == pytest.approx(measured, rel=0.01), rung.policies


@pytest.mark.parametrize(
    "head, optimizer, autocast",
    [
        ("BertForMaskedLM", "adamw", None),
        ("BertForSequenceClassification", "adamw-fused", None),
        ("BertForSequenceClassification", "adamw-in-backward", None),
    ],
)
def test_predicts_a_measured_step_at_an_unmeasured_batch(head, optimizer, autocast):
    model = _model(head)
    example = synthetic_batch(model, 5, 48)  # measured at 1, 2 and 4 rows, predicted at 5
    plan_profile, flops = profile(model, example, optimizer=optimizer, autocast=autocast)
    _check(plan_profile, flops, model, example, 5, optimizer, autocast=autocast)


def test_predicts_bf16_autocast_with_one_policy_for_every_layer():
    model = _model("BertForTokenClassification")
    example = synthetic_batch(model, 5, 48)
    plan_profile, _ = profile(model, example, autocast=torch.bfloat16)
    for policy in ("none", "qkv", "mlp", "full"):
        measured = measured_peak(model, example, (policy,) * 3, autocast=torch.bfloat16)
        assert plan_profile.predict((policy,) * 3, 5).peak_bytes == pytest.approx(measured, rel=0.01)


def test_predicts_bf16_autocast_with_mixed_policies_never_below_the_measured_peak():
    # Under autocast a layer at qkv keeps its fp32 input where the others keep a bf16 copy and HF drops
    # the input at the end of the model's forward: credited to the stage that made it, so a mix is exact
    # where that free is the only difference; where the head's forward peaks after such a free that
    # happened in its measurement but not in the mix, or the reverse, the prediction is above (never below).
    model = _model("BertForTokenClassification")
    example = synthetic_batch(model, 5, 48)
    plan_profile, _ = profile(model, example, autocast=torch.bfloat16)
    for policies in (("qkv", "mlp", "mlp"), ("mlp", "qkv", "qkv"), ("full", "none", "qkv+mlp")):
        measured = measured_peak(model, example, policies, autocast=torch.bfloat16)
        predicted = plan_profile.predict(policies, 5).peak_bytes
        assert measured <= predicted <= measured * 1.01, policies


def test_predicts_an_unpadded_model_in_real_tokens():
    model = _model("BertForSequenceClassification")
    example = synthetic_batch(model, 6, 48)
    example["attention_mask"][1::2, 30:] = 0
    plan_profile, flops = profile(model, example, unpad=True)
    assert plan_profile.unpadded and plan_profile.tokens(6) == example["attention_mask"].sum()
    _check(plan_profile, flops, model, example, 6, unpad=True)


def test_predicts_albert_whose_one_layer_runs_three_times():
    torch.manual_seed(0)
    config = transformers.AlbertConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=256, vocab_size=300,
        embedding_size=32,
    )  # fmt: skip
    model = transformers.AlbertForMaskedLM(config).train()
    example = synthetic_batch(model, 4, 40)
    plan_profile, flops = profile(model, example)
    assert len(plan_profile.layers) == 1 and len(plan_profile.stages) == 5  # embeddings, 3 applications, head
    for policy in ("none", "full"):
        predicted = plan_profile.predict((policy,), 4).peak_bytes
        assert predicted == pytest.approx(measured_peak(model, example, (policy,)), rel=0.01)


def test_predicts_a_slimformer_transformer_encoder():
    torch.manual_seed(0)
    layer = sf.TransformerEncoderLayer(64, 4, 256, dropout=0.1, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False).train()
    example = {"src": torch.randn(4, 40, 64)}

    def loss_fn(m, batch):
        return m(**batch).square().mean()

    plan_profile, flops = profile(model, example, loss_fn=loss_fn)
    rungs = ladder(plan_profile, flops, 4)
    for rung in (rungs[0], rungs[-1]):
        measured = measured_peak(model, example, rung.policies, loss_fn=loss_fn)
        assert rung.prediction.peak_bytes == pytest.approx(measured, rel=0.01)


@pytest.fixture(scope="module")
def mlm():
    with pytest.MonkeyPatch.context() as env:  # as _pytorch_path, which a module's fixture runs before
        env.setenv("TRITON_INTERPRET", "0")
        model = _model("BertForMaskedLM", num_hidden_layers=4)
        example = synthetic_batch(model, 4, 64)
        yield model, example, *profile(model, example)


def test_smaller_budgets_never_plan_a_higher_peak_nor_less_recompute(mlm):
    model, example, plan_profile, flops = mlm
    rungs = ladder(plan_profile, flops, 4)
    eager = plan_profile.predict(("none",) * 4, 4).peak_bytes
    least = rungs[-1].prediction.peak_bytes
    chosen = []
    for i in range(20):
        budget = round(eager - (eager - least) * i / 19)
        chosen.append(choose(plan_profile, flops, budget, 4))
    peaks = [plan.peak_bytes for plan in chosen]
    extras = [plan.extra_compute for plan in chosen]
    assert peaks == sorted(peaks, reverse=True) and extras == sorted(extras)
    assert all(plan.peak_bytes <= plan.budget for plan in chosen)
    assert len(set(peaks)) >= 4  # the ladder has rungs between none and full
    assert any(len(set(plan.policies.values())) > 1 for plan in chosen)  # mixed plans


def test_plan_apply_patches_and_sets_the_policies_and_plan_leaves_the_model_as_it_was(mlm):
    model, example, plan_profile, _ = mlm
    model = copy.deepcopy(model)
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    budget = (
        plan_profile.predict(("none",) * 4, 4).peak_bytes + plan_profile.predict(("full",) * 4, 4).peak_bytes
    ) // 2
    plan = sf.plan(model, example, budget)
    assert not plannable_layers(model) and not model.training  # not patched, mode kept
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert plan.peak_bytes <= budget < plan.rungs[0].prediction.peak_bytes
    plan.apply(model)
    assert [layer.recompute for _, layer in plannable_layers(model)] == list(plan.policies.values())
    text = str(plan)
    assert "predicted step peak" in text and "optimizer state" in text and "recompute" in text
    model.train()
    assert measured_peak(model, example, list(plan.policies.values())) <= budget


def test_max_batch_is_the_largest_that_fits(mlm):
    model, example, plan_profile, flops = mlm
    budget = ladder(plan_profile, flops, 9)[-1].prediction.peak_bytes + 1
    batch, plan = max_batch(model, 64, budget, example_batch=example)
    assert batch == 9 and plan.batch == 9 and plan.peak_bytes <= budget
    assert ladder(plan_profile, flops, 10)[-1].prediction.peak_bytes > budget


def test_max_seq_is_the_longest_that_fits_and_its_peak_is_measured_close():
    model = _model("BertForSequenceClassification", max_position_embeddings=96)
    one_row = synthetic_batch(model, 1, 96)
    plan_profile, flops = profile(model, one_row, seqs=(48, 96))
    budget = ladder(plan_profile, flops, 3, 80)[-1].prediction.peak_bytes + 1
    seq, plan = sf.max_seq(model, 3, budget)
    assert seq == 80 and plan.seq == 80 and plan.peak_bytes <= budget
    assert ladder(plan_profile, flops, 3, 81)[-1].prediction.peak_bytes > budget
    batch = synthetic_batch(model, 3, 80)
    measured = measured_peak(model, batch, list(plan.policies.values()))
    assert plan.peak_bytes == pytest.approx(measured, rel=0.03)  # predicted along seq, from one row


def test_a_budget_below_the_least_peak_says_what_the_least_is_and_changes_nothing(mlm):
    model, example, *_ = mlm
    model = copy.deepcopy(model)
    with pytest.raises(ValueError, match="below the smallest step peak .* optimizer state .*adamw-in-backward"):
        sf.plan(model, example, "1MiB")
    assert not plannable_layers(model) and not hasattr(model, "_slimformer_patch")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"budget": "ten gigs"}, ValueError, "budget must look like"),
        ({"budget": -5}, ValueError, "budget must be positive"),
        ({"budget": [1]}, TypeError, "budget must be a number"),
        ({"optimizer": "lion"}, ValueError, "optimizer must be one of"),
        ({"example_batch": {"input_idz": torch.zeros(2, 8, dtype=torch.long)}}, ValueError, "input_idz"),
        ({"example_batch": {"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(3, 8)}},
         ValueError, "labels"),
        ({"example_batch": torch.zeros(2, 8)}, TypeError, "example_batch must be"),
        ({"device": "meta"}, ValueError, "move it there first"),
    ],
)  # fmt: skip
def test_bad_arguments_raise_naming_them(kwargs, error, match):
    model = _model()
    args = {"example_batch": synthetic_batch(model, 2, 8), "budget": "1GiB", **kwargs}
    with pytest.raises(error, match=match):
        sf.plan(model, **args)
    assert not plannable_layers(model)


def test_a_model_without_a_layer_to_plan_is_named():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    with pytest.raises(ValueError, match="cannot plan Sequential"):
        sf.plan(model, {"input": torch.randn(2, 8)}, "1GiB", loss_fn=lambda m, b: m(b["input"]).sum())


def test_parse_budget():
    assert parse_budget("10GiB") == 10 * 2**30 and parse_budget("16 GB") == 16 * 10**9
    assert parse_budget("512MiB") == 512 * 2**20 and parse_budget(1000) == 1000


def test_optimizer_in_backward_updates_as_adamw_does_and_refuses_accumulation():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    fused = optimizer_in_backward(model, torch.optim.AdamW, lr=0.1, weight_decay=0.01)
    plain = torch.optim.AdamW(twin.parameters(), lr=0.1, weight_decay=0.01)
    for step in range(3):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        assert all(p.grad is None for p in model.parameters())  # freed in backward
        fused.step()
        plain.zero_grad()
        twin(x).square().mean().backward()
        plain.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b)
    model(x).sum().backward()
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="gradient accumulation is not possible"):
        model(x).sum().backward()
    # the raising hook is the first one of that backward: nothing was updated by it
    assert sum(not torch.equal(a, b) for a, b in zip(before, model.parameters())) < len(before)
    fused.remove()


def test_optimizer_costs_are_measured():
    cost = OptimizerCost.measure("adamw", torch.float32, torch.device("cpu"))
    assert cost.state_per_byte == 2.0 and cost.combine == "carry"  # exp_avg, exp_avg_sq; CPU steps tensor by tensor
    # the second tensor's temporaries are made while the first one's last is alive
    assert cost.carry_per_byte == 1.0
    assert cost.temporaries([100, 300]) == round(cost.temp_per_byte * 300 + cost.carry_per_byte * 100)
    fused = OptimizerCost.measure("adamw-fused", torch.float32, torch.device("cpu"))
    assert fused.temp_per_byte < cost.temp_per_byte


def test_envelope_keeps_the_moment_that_is_largest_at_some_token_count():
    # a constant 100-byte moment and one growing 10 bytes per token: they cross at 10 tokens
    envelope = Envelope.fit([(1.0, [100.0, 10.0, 5.0]), (2.0, [100.0, 20.0, 6.0])])
    assert envelope(5) == pytest.approx(100) and envelope(30) == pytest.approx(300)
    (lines,) = envelope.pieces
    assert sorted((round(a.intercept), round(a.slope)) for a in lines) == [(0, 10), (100, 0)]
    assert len(lines) == 2  # the 5 + 1 per token moment is below the other two everywhere


def test_envelope_follows_a_temporary_capped_by_its_op():
    # 50 bytes plus a chunk of 10 bytes per token capped at 150 (linear_cross_entropy's logits, say),
    # beside a moment of 2 bytes per token: measured at 10, 20 and 40 tokens
    envelope = Envelope.fit([(10.0, [150.0, 20.0]), (20.0, [200.0, 40.0]), (40.0, [200.0, 80.0])])
    assert envelope.knots == (20.0,)
    assert envelope(15) == pytest.approx(175) and envelope(80) == pytest.approx(200)  # a line would say 750
    assert envelope(200) == pytest.approx(400)  # where the growing moment overtakes the capped one


def test_envelope_separates_what_grows_with_each_rows_tokens_squared():
    # 1 row of 48 and 96 tokens and 2 rows of 48: a moment of 5 + 2 per token + 0.5 per (query, key) pair
    def moment(rows, seq):
        return 5 + 2 * rows * seq + 0.5 * rows * seq**2

    sizes = [(1, 48), (2, 48), (1, 96)]
    envelope = Envelope.fit([((r * s, r * s * s), [moment(r, s)]) for r, s in sizes])
    assert envelope(3 * 80, 3 * 80**2) == pytest.approx(moment(3, 80))  # a line in tokens: 29,957


def test_cli_help():
    result = subprocess.run(
        [sys.executable, "-m", "slimformer.plan", "--help"], capture_output=True, text=True, timeout=120, check=True
    )
    assert "--budget" in result.stdout and "--optimizer" in result.stdout
