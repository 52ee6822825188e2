"""Phase 4: whole models.

Training: HF ``BertForMaskedLM`` at BERT-base size (12 layers, hidden 768, vocab 30522),
dropout 0.1, bf16 autocast over fp32 weights, batch 32 × 512 with 15% of the tokens
labelled, one AdamW step per iteration (forward, backward, ``step``, ``zero_grad``).
Columns, every one from the same initial weights: HF eager, HF SDPA, HF SDPA with
gradient checkpointing, ``torch.compile`` of HF SDPA, ``sf.patch`` at the ``none``,
``qkv+mlp`` and ``full`` recompute policies, and on a batch with ~50% padding (the
attention lengths of ``attention.padded_lengths``) HF SDPA against ``sf.patch(model,
unpad=True)``. Per column: tokens/s = real tokens / median step time (each step
synchronised: host time counts, as in training), and the step's peak
``torch.cuda.max_memory_allocated`` (weights, gradients and optimizer state included).

The planner: ``sf.plan``'s profile of the same model (``slimformer.plan.profile``, measured
at 1, 2 and 4 rows) predicts the step peak at the training batch for uniform ``none`` and
``qkv+mlp`` and for the middle plan of its ladder; each is then run as the training
columns are and its measured peak (above what was allocated before the step, plus the
parameters, buffers, AdamW state and batch, as the prediction counts) set beside it.

Inference: HF ``BertModel`` at BERT-base size, batch 32 × 128, eval, fp16 with SDPA,
against ``sf.quantize(model, "int8")`` and ``"int8-weight-only"`` of the same model:
median latency of a synchronised forward, and the least cosine similarity of a
sequence's ``last_hidden_state`` to the fp16 model's.
"""

import copy
import math
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

import slimformer as sf
from bench.gpu_check.attention import padded_lengths
from bench.gpu_check.cases import brief, free_memory

FULL = dict(
    layers=12,
    hidden=768,
    heads=12,
    ff=3072,
    vocab=30522,
    batch=32,
    seq=512,
    infer_batch=32,
    infer_seq=128,
    steps=10,
    infer_calls=10,
)
DRY = dict(
    layers=2,
    hidden=64,
    heads=2,
    ff=128,
    vocab=512,
    batch=2,
    seq=32,
    infer_batch=2,
    infer_seq=16,
    steps=2,
    infer_calls=3,
)
LABELLED = 0.15
WARMUP_STEPS = 2
# name -> how the column's model is made; most important first, so a short budget drops the last
TRAIN_COLUMNS = {
    "HF SDPA": dict(attn="sdpa"),
    "slimformer qkv+mlp": dict(attn="sdpa", policy="qkv+mlp"),
    "HF eager": dict(attn="eager"),
    "slimformer none": dict(attn="sdpa", policy="none"),
    "slimformer full": dict(attn="sdpa", policy="full"),
    "HF SDPA + checkpointing": dict(attn="sdpa", checkpointing=True),
    "HF SDPA, 50% padding": dict(attn="sdpa", padded=True),
    "slimformer unpad=True, 50% padding": dict(attn="sdpa", policy="none", unpad=True, padded=True),
    "torch.compile(HF SDPA)": dict(attn="sdpa", compiled="default"),
    "torch.compile(slimformer none)": dict(attn="sdpa", policy="none", compiled="default"),
    "torch.compile(slimformer qkv+mlp)": dict(attn="sdpa", policy="qkv+mlp", compiled="default"),
    "reduce-overhead(HF SDPA)": dict(attn="sdpa", compiled="reduce-overhead"),
    "reduce-overhead(slimformer none)": dict(attn="sdpa", policy="none", compiled="reduce-overhead"),
}
# the compiled columns run after the inference ones (their compiles are the longest work)
COMPILED_COLUMNS = tuple(name for name, spec in TRAIN_COLUMNS.items() if "compiled" in spec)
INFER_COLUMNS = ("HF SDPA fp16", "slimformer int8", "slimformer int8-weight-only")


def _config(sizes: dict):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=sizes["vocab"],
        hidden_size=sizes["hidden"],
        num_hidden_layers=sizes["layers"],
        num_attention_heads=sizes["heads"],
        intermediate_size=sizes["ff"],
        max_position_embeddings=max(512, sizes["seq"]),
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )


def training_batch(config, batch: int, seq: int, padded: bool, device) -> tuple[dict, int]:
    """(inputs with labels, real token count): right padding to ``seq`` when ``padded``."""
    generator = torch.Generator().manual_seed(0)
    lengths = padded_lengths(batch, seq) if padded else [seq] * batch
    real = torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]
    ids = torch.randint(5, config.vocab_size, (batch, seq), generator=generator).masked_fill(~real, 0)
    labelled = (torch.rand(batch, seq, generator=generator) < LABELLED) & real
    inputs = {"input_ids": ids, "attention_mask": real.long(), "labels": torch.where(labelled, ids, -100)}
    return {name: t.to(device) for name, t in inputs.items()}, int(real.sum())


def _train_model(base, spec: dict, tokens: int, device, dry_run: bool):
    model = copy.deepcopy(base).to(device).train()
    model.set_attn_implementation(spec["attn"])
    if spec.get("checkpointing"):
        model.gradient_checkpointing_enable()
    if "policy" in spec:
        sf.patch(model, recompute=spec["policy"], unpad=spec.get("unpad", False))
        model.set_attn_implementation("slimformer")  # the fused layers get the (batch, seq) padding mask
        model.max_labelled_tokens = labelled_bound(tokens)  # the head's fixed-shape gather: no host sync
    forward = model
    if spec.get("compiled"):
        mode = None if spec["compiled"] == "default" else spec["compiled"]
        forward = torch.compile(model, backend="eager" if dry_run else "inductor", mode=None if dry_run else mode)
    return model, forward


def labelled_bound(tokens: int) -> int:
    """An upper bound on a batch's labelled tokens when each of ``tokens`` is labelled with
    probability ``LABELLED``: the mean plus 6 standard deviations (as a user sets
    ``max_labelled_tokens`` from the collator's masking rate)."""
    mean = tokens * LABELLED
    return math.ceil(mean + 6 * math.sqrt(mean * (1 - LABELLED)))


def training_step(forward, optimizer, inputs: dict, device, graphs: bool = False) -> Callable[[], torch.Tensor]:
    """One step of every training column: bf16 autocast forward, backward, AdamW, zero_grad;
    returns the loss. ``graphs``: the forward replays CUDA graphs (``mode="reduce-overhead"``),
    so each step is marked as a new iteration for them."""

    def step():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = forward(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def train_column(name: str, base, sizes: dict, device, dry_run: bool, steps: int) -> dict:
    """One training column (see the module docstring): tokens/s, step time, peak memory."""
    spec = TRAIN_COLUMNS[name]
    inputs, tokens = training_batch(base.config, sizes["batch"], sizes["seq"], spec.get("padded", False), device)
    model, forward = _train_model(base, spec, tokens, device, dry_run)
    graphs = spec.get("compiled") == "reduce-overhead" and not dry_run
    step = training_step(forward, torch.optim.AdamW(model.parameters(), lr=1e-4), inputs, device, graphs)
    start = time.perf_counter()
    first_loss = float(step())
    _sync(device)
    first_step_s = time.perf_counter() - start
    for _ in range(WARMUP_STEPS - 1):
        step()
    times, peaks, losses = [], [], []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        start = time.perf_counter()
        losses.append(float(step()))
        _sync(device)
        times.append(time.perf_counter() - start)
        peaks.append(torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)
    median = statistics.median(times)
    return {
        "syncs_per_step": host_syncs(step, device),
        "tokens": tokens,
        "tokens_per_s": tokens / median,
        "step_ms": {"median": median * 1e3, "min": min(times) * 1e3, "max": max(times) * 1e3},
        "peak_bytes": max(peaks) if peaks[0] is not None else None,
        "first_step_s": first_step_s,
        "losses": [first_loss, *losses],
        "steps": steps,
    }


def host_syncs(step: Callable, device) -> int | None:
    """The host syncs of one more ``step()``, as ``torch.cuda.set_sync_debug_mode`` warns of
    them (None off CUDA, where nothing syncs)."""
    if device.type != "cuda":
        return None
    _sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(warning.message) for warning in caught)


def plan_rows(base, sizes: dict, device, dry_run: bool) -> dict:
    """sf.plan's predicted step peak against the measured one (see the module docstring)."""
    from slimformer.plan import ladder, plannable_layers, profile

    model = copy.deepcopy(base).to(device).train()
    sf.patch(model)
    model.set_attn_implementation("slimformer")
    inputs, _ = training_batch(base.config, sizes["batch"], sizes["seq"], False, device)
    start = time.perf_counter()
    plan_profile, flops = profile(model, inputs, autocast=torch.bfloat16)
    result = {"profile_s": round(time.perf_counter() - start, 1), "rows": {}}
    layers = [layer for _, layer in plannable_layers(model)]
    rungs = ladder(plan_profile, flops, sizes["batch"])
    plans = {"uniform none": ("none",) * len(layers), "uniform qkv+mlp": ("qkv+mlp",) * len(layers)}
    plans["ladder's middle plan"] = rungs[len(rungs) // 2].policies
    for label, policies in plans.items():
        for layer, policy in zip(layers, policies):
            layer.recompute = policy
        predicted = plan_profile.predict(policies, sizes["batch"]).peak_bytes
        measured, allocator = _measured_step_peak(model, inputs, device)
        result["rows"][label] = {
            "policies": ", ".join(f"{p} x{policies.count(p)}" for p in dict.fromkeys(policies)),
            "predicted_bytes": predicted,
            "peak_bytes": measured,
            "error": predicted / measured - 1 if measured else None,
            "max_memory_allocated": allocator,
            "error_vs_max_memory_allocated": predicted / allocator - 1 if allocator else None,
        }
    return result


def _measured_step_peak(model, inputs: dict, device) -> tuple[int, int | None]:
    """A training step's peak as ``sf.plan`` counts it (the allocator's peak above the step's
    start, plus the storages of what persists), and ``torch.cuda.max_memory_allocated``
    over the step itself (everything the allocator holds: also what else is on the device,
    cuBLAS's workspace say; None off CUDA)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: the plan rows share one model
    step = training_step(model, optimizer, inputs, device)
    for _ in range(WARMUP_STEPS):
        step()
    with sf.memory.peak_memory(device) as peak:
        step()
    tensors = [*model.parameters(), *model.buffers(), *inputs.values()]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    persistent = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    allocator = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return peak.bytes + sum(persistent.values()), allocator


def infer_column(name: str, base, sizes: dict, device, dry_run: bool, calls: int) -> tuple[dict, torch.Tensor]:
    """One inference column: median latency of a synchronised forward; and its output, on the CPU."""
    dtype = torch.float32 if dry_run else torch.float16
    model = copy.deepcopy(base).to(device, dtype).eval()
    model.set_attn_implementation("sdpa")
    if name != "HF SDPA fp16":
        sf.quantize(model, name.removeprefix("slimformer "))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, base.config.vocab_size, (sizes["infer_batch"], sizes["infer_seq"]), generator=generator)
    ids = ids.to(device)

    def forward():
        with torch.no_grad():
            return model(input_ids=ids).last_hidden_state

    output = forward().float().cpu()
    times = _wall_times(forward, device, calls)
    return {
        "latency_ms": {"median": statistics.median(times) * 1e3, "min": min(times) * 1e3, "max": max(times) * 1e3},
        "sequences_per_s": sizes["infer_batch"] / statistics.median(times),
        "calls": calls,
    }, output


def _wall_times(fn: Callable, device, calls: int) -> list[float]:
    for _ in range(2):
        fn()
    times = []
    for _ in range(calls):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def base_models(dry_run: bool):
    """(BertForMaskedLM, BertModel) with seeded random weights, on the CPU."""
    from transformers import BertForMaskedLM, BertModel

    sizes = DRY if dry_run else FULL
    config = _config(sizes)
    torch.manual_seed(0)
    return BertForMaskedLM(config), BertModel(config, add_pooling_layer=False)


def run(
    device,
    dry_run: bool,
    deadline: float,
    on_result: Callable[[str, str, dict], None],
    columns: list[str] | None = None,
) -> None:
    """Every training column, then the inference ones, in order, while time is left; each
    result (or ``{"error": ...}`` / ``{"skipped": ...}``) goes to ``on_result(kind, name, result)``."""
    sizes = DRY if dry_run else FULL
    mlm, encoder = base_models(dry_run)
    work = [("train", name) for name in TRAIN_COLUMNS if name not in COMPILED_COLUMNS]
    work += [("infer", name) for name in INFER_COLUMNS] + [("train", name) for name in COMPILED_COLUMNS]
    work += [("plan", "sf.plan")]
    fp16_output = None
    for kind, name in work:
        if columns is not None and name not in columns:
            continue
        if time.monotonic() > deadline - 3:
            on_result(kind, name, {"skipped": "not run: the phase's time was used up"})
            continue
        try:
            if kind == "train":
                result = train_column(name, mlm, sizes, device, dry_run, sizes["steps"])
            elif kind == "plan":
                result = plan_rows(mlm, sizes, device, dry_run)
            else:
                result, output = infer_column(name, encoder, sizes, device, dry_run, sizes["infer_calls"])
                fp16_output = output if name == INFER_COLUMNS[0] else fp16_output
                if fp16_output is not None:
                    result["cosine_vs_fp16"] = (
                        F.cosine_similarity(output.flatten(1), fp16_output.flatten(1)).min().item()
                    )
        except Exception as error:
            result = {"error": brief(error)}
        on_result(kind, name, result)
        free_memory(device)


def warm_compiled(device, dry_run: bool) -> list[dict]:
    """A precompile worker's share of this phase: one step of each compiled column, so that
    their Inductor code lands in the on-disk caches before the phase runs (a dry run, which
    checks the mechanics, warms the first only)."""
    mlm, _ = base_models(dry_run)
    sizes = DRY if dry_run else FULL
    records = []
    for name in COMPILED_COLUMNS[:1] if dry_run else COMPILED_COLUMNS:
        start = time.perf_counter()
        try:
            train_column(name, mlm, sizes, device, dry_run, steps=1)
            records.append({"case": f"model {name}", "seconds": round(time.perf_counter() - start, 2)})
        except Exception as error:
            records.append({"case": f"model {name}", "error": brief(error)})
        free_memory(device)
    return records
