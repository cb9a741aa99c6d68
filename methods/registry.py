"""Every decoding method `--method` offers, in one registry.

Per method: its one-line help, the paper it implements, its own command-line options, the option that
sets its size (inputs per forward pass, which --calibrate tunes), whether it has trained parts, and
how to build it: a *drafter* for the guess-and-verify loop (decode.py), or an *engine* with a loop of
its own (APAR). cli.py makes its parser and option checks from this table; bench.py builds the same
drafters from it. The options every program that decodes shares (the model's, each method's) and the
loading of the model they name are here too, so that the programs (cli, visualize, bench) import each
other for nothing.

    method = METHODS["anpd"]
    drafter = build_drafter(method, default_options(ngram_n=4), model, tokenizer)
"""

import argparse
import gc
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from methods import eagle
from methods import medusa
from methods import ppd
from methods.apar import FORK_BIAS, MAX_FORK_BIAS, MAX_GUESSES_PER_PASS, load_apar_model
from methods.artifacts import kind_of, shipped_artifact
from calibrate import calibrated_rows, machine_latency
from methods.combined import combined_drafter
from programs.convert import default_model_dir
from methods.cost_aware import CostAware, Costs
from methods.latency import Latency
import backends
from drafters import Drafter, DraftModelDrafter, NGramDrafter, TrieDrafter, first_layers
from methods.recycling import RecyclingDrafter
from errors import UserError, integer, number
from checkpoint import DTYPES, load_checkpoint, parse_device
from tokenizer import Tokenizer, check_fits

DEFAULT_DRAFT_LAYERS = 4
DEFAULT_TREE_ROWS = 6  # medusa and ppd without --calibrate (measured: docs/constants.md)
EAGLE_TREE_ROWS = 16  # eagle without --calibrate: its dynamic tree's nodes at most, the root included
AUTO_EAGLE_ROWS = 6  # EAGLE's tree in auto's: one source among several, each tree merged into one
MAX_TREE_ROWS = 256  # the most --tree-rows (docs/constants.md)
MAX_LAYERS = 1024  # --draft-layers: the model's own count is checked once it is loaded


@dataclass(frozen=True)
class Size:
    """The option that sets how many inputs a forward pass gets: `option`'s value + `root` inputs
    (the root is one more input unless the option counts it), `default` without a calibration."""
    option: str
    default: int
    root: int


@dataclass(frozen=True)
class Method:
    name: str
    summary: str  # for --help
    paper: str
    options: tuple[str, ...] = ()  # its own options (OPTIONS), refused with any other method
    size: Size | None = None
    trained: bool = False  # its trained parts are an artifact: trained/<name>-<model folder>
    guesses: bool = True  # its passes verify guesses (so --acceptance means something)
    drafter: Callable[["Build"], Drafter] | None = None  # its drafter, for the guess-and-verify loop
    engine: Callable | None = None  # (options, model, tokenizer) -> an engine with .generate (apar.py)
    costs: type[Costs] = Costs  # what cost-aware drafting weighs (ppd.SoftTokenCosts: soft tokens too)

    def cost_aware(self, options) -> bool:
        """Whether its trees are cut to what pays (cost_aware.py): it guesses, and --fixed-size is not given."""
        return self.guesses and not options.fixed_size


@dataclass
class Build:
    """What a method's drafter is built from."""
    options: argparse.Namespace  # the command line's (or default_options')
    model: torch.nn.Module
    tokenizer: Tokenizer
    inputs: int | None  # inputs per forward pass (its size option, calibrated or given), if it has a size
    costs: Costs | None  # cost-aware drafting, or None (--fixed-size, or a method that guesses nothing)
    latency: Callable[[], Latency]  # this machine's L(n), measured only when asked for


# ---- how each method is built ---------------------------------------------------------------------

def trained_path(method: str, options) -> Path:
    """--trained, else the artifact shipped for the model's folder."""
    return options.trained if options.trained is not None else shipped_path(method, options)


def shipped_path(method: str, options) -> Path:
    """The artifact shipped for the model's folder (--model, else the default model)."""
    return shipped_artifact(method, options.model if options.model is not None else default_model_dir())


def load_draft(options, model, tokenizer):
    """The draft for --method speculative: --draft-model's checkpoint (checked to share the
    tokenizer), or the model's own first --draft-layers layers."""
    if options.draft_model is None:
        return first_layers(model, options.draft_layers)
    draft = load_checkpoint(options.draft_model, model.dtype, model.device)
    if draft.config.vocab_size != model.config.vocab_size:
        raise UserError(f"the draft model's vocabulary has {draft.config.vocab_size} tokens, the "
                        f"model's {model.config.vocab_size}: a draft must share the model's tokenizer")
    if Tokenizer(options.draft_model).vocabulary() != tokenizer.vocabulary():
        raise UserError(f"the draft model in {options.draft_model} uses another tokenizer than the model: "
                        "its token ids would mean other text")
    return draft


def vanilla_drafter(build: Build) -> Drafter:
    return Drafter()


def anpd_drafter(build: Build) -> NGramDrafter:
    return NGramDrafter(n=build.options.ngram_n, k=build.inputs - 1)


def lookahead_drafter(build: Build) -> TrieDrafter:
    return TrieDrafter(build.inputs - 1, build.options.branch_length,
                       hierarchical=build.options.lookahead_mode == "hierarchical")


def draft_model_drafter(build: Build) -> DraftModelDrafter:
    """--method speculative's drafter; a draft step's cost over the model's is estimated by the
    multiply-adds per token of their layers and LM heads (embedding lookups are free). Before its
    verdicts, cost-aware drafting expects the self-draft (an untrained early exit) to be right as
    rarely as it was on held-out prompts, and a --draft-model half the time."""
    draft = load_draft(build.options, build.model, build.tokenizer)

    def multiply_adds(m):
        return sum(p.numel() for p in m.layers.parameters()) + m.lm_head.weight.numel()
    prior = (DraftModelDrafter.SELF_DRAFT_ALPHA if build.options.draft_model is None
             else DraftModelDrafter.UNKNOWN_DRAFT_ALPHA)
    return DraftModelDrafter(draft, build.options.gamma, step_cost=multiply_adds(draft) / multiply_adds(build.model),
                             costs=build.costs, prior_alpha=prior)


def recycling_drafter(build: Build) -> RecyclingDrafter:
    return RecyclingDrafter(build.model.config.vocab_size, build.inputs - 1)


def medusa_drafter(build: Build) -> medusa.MedusaDrafter:
    return medusa.load_drafter(build.model, trained_path("medusa", build.options), build.inputs, build.costs)


def eagle_drafter(build: Build) -> eagle.EagleDrafter:
    return eagle_on_backend(build.model, trained_path("eagle", build.options), build.inputs, build.costs)


def eagle_on_backend(model, path: Path, inputs: int, costs) -> eagle.EagleDrafter:
    """EAGLE's drafter with the head saved at `path`, its steps run by the model's backend where it can."""
    return eagle.EagleDrafter(model, backends.draft_head(model, eagle.load_head(model, path)), inputs, costs=costs)


def ppd_drafter(build: Build) -> ppd.PPDDrafter:
    return ppd.load_drafter(build.model, trained_path("ppd", build.options), build.inputs, build.options.static_tree,
                            build.costs)


def auto_drafter(build: Build):
    """--method auto: ANPD's n-grams, Lookahead's trie and, when trained for the model, EAGLE's head and
    PPD's soft tokens (combined.py). --trained names one of the last two, whichever its JSON says it is
    (an unreadable one is taken for PPD's, whose loading says what is wrong); the other is the one shipped."""
    options = build.options
    given_eagle = options.trained is not None and kind_of(options.trained) == "eagle"
    ppd_path = shipped_path("ppd", options) if given_eagle else trained_path("ppd", options)
    eagle_path = options.trained if given_eagle else shipped_path("eagle", options)
    soft = head = None
    if ppd_path == options.trained or ppd_path.with_suffix(".safetensors").is_file():
        soft = ppd.load_drafter(build.model, ppd_path, DEFAULT_TREE_ROWS)
    if eagle_path == options.trained or eagle_path.with_suffix(".safetensors").is_file():
        head = eagle_on_backend(build.model, eagle_path, AUTO_EAGLE_ROWS, build.costs)
    return combined_drafter(NGramDrafter(n=options.ngram_n, k=options.ngram_k or NGramDrafter.DEFAULT_K),
                            TrieDrafter(options.decoding_length or TrieDrafter.DEFAULT_DECODING_LENGTH,
                                        options.branch_length),
                            soft, build.latency(), build.costs, head)


# --apar-guesses: each thread's own drafter, and the options that size it
APAR_GUESSERS = {"anpd": ("ngram_n", "ngram_k"), "lookahead": ("decoding_length", "branch_length")}


def apar_guesser(options) -> Callable[[], Drafter] | None:
    """--apar-guesses: what makes each APAR thread's own drafter, sized by that method's own options."""
    if options.apar_guesses == "anpd":
        return lambda: NGramDrafter(options.ngram_n, options.ngram_k or NGramDrafter.DEFAULT_K)
    if options.apar_guesses == "lookahead":
        return lambda: TrieDrafter(options.decoding_length or TrieDrafter.DEFAULT_DECODING_LENGTH,
                                   options.branch_length)
    return None


def apar_engine(options, model, tokenizer):
    """--method apar: the model with the adapter merged and, with --apar-guesses, a drafter per thread
    (apar.py: APAR + a guesser)."""
    engine = load_apar_model(model, tokenizer, trained_path("apar", options))
    engine.guesser, engine.fork_bias = apar_guesser(options), options.fork_bias
    return engine


METHODS = {m.name: m for m in [
    Method("vanilla", "plain autoregressive decoding, one forward pass per token", "", guesses=False,
           drafter=vanilla_drafter),
    Method("anpd", "adaptive n-gram parallel decoding: a chain of guesses from n-grams of the text so far",
           "Ou et al. 2024", ("ngram_n", "ngram_k", "fixed_size"), Size("ngram_k", NGramDrafter.DEFAULT_K, 1),
           drafter=anpd_drafter),
    Method("lookahead", "trie-based retrieval of several guessed branches from prompts and earlier output "
           "(Zhao et al.'s Lookahead, not Fu et al.'s Jacobi 'lookahead decoding')",
           "Zhao et al. 2023", ("decoding_length", "branch_length", "lookahead_mode", "fixed_size"),
           Size("decoding_length", TrieDrafter.DEFAULT_DECODING_LENGTH, 1), drafter=lookahead_drafter),
    Method("recycling", "token recycling: a tree of guesses read from the model's own top-8 next tokens after "
           "each token the last time it was an input (recycling.py)", "Luo et al. 2024",
           ("tree_rows", "fixed_size"), Size("tree_rows", RecyclingDrafter.DEFAULT_ROWS, 0), drafter=recycling_drafter),
    Method("speculative", "a small draft model guesses a chain of --gamma tokens (by default a draft made of "
           "the model's own first --draft-layers layers)", "Leviathan et al. 2023; Chen et al. 2023",
           ("draft_model", "draft_layers", "gamma", "fixed_size"), drafter=draft_model_drafter),
    Method("medusa", "trained Medusa heads guess the next tokens from the model's last hidden state; their "
           "top-k form a sparse tree", "Cai et al. 2024", ("trained", "tree_rows", "fixed_size"),
           Size("tree_rows", DEFAULT_TREE_ROWS, 0), trained=True, drafter=medusa_drafter),
    Method("ppd", "parallel prompt decoding: trained soft tokens ride along in each forward pass and guess "
           "the next tokens; a dynamic sparse tree", "Chen et al. 2024", ("trained", "tree_rows", "static_tree", "fixed_size"),
           Size("tree_rows", DEFAULT_TREE_ROWS, 0), trained=True, drafter=ppd_drafter, costs=ppd.SoftTokenCosts),
    Method("eagle", "a trained draft head continues the model's own features (its last hidden state and the token "
           "chosen after it) and drafts a dynamic tree of its likeliest guesses", "Li et al. 2024 (EAGLE, EAGLE-2)",
           ("trained", "tree_rows", "fixed_size"), Size("tree_rows", EAGLE_TREE_ROWS, 0), trained=True,
           drafter=eagle_drafter),
    Method("apar", "auto-parallel decoding (apar.py): the model, fine-tuned with the shipped adapter, writes "
           "[Fork] where the rest of a point can be written in parallel, and one forward pass steps all "
           "its threads. Its text is the fine-tuned model's, NOT the base model's", "Liu et al. 2024",
           ("trained", "fork_bias", "apar_guesses", "ngram_n", "ngram_k", "decoding_length", "branch_length"),
           trained=True, guesses=False, engine=apar_engine),
    Method("auto", "the combined drafter (combined.py): one tree from ANPD's n-grams, Lookahead's trie, EAGLE's "
           "head and PPD's soft tokens (the last two when trained for the model and while they pay here), cut "
           "each step to what pays", "Ou et al. 2024; Zhao et al. 2023; Li et al. 2024; Chen et al. 2024",
           ("ngram_n", "ngram_k", "decoding_length", "branch_length", "trained", "fixed_size"), drafter=auto_drafter,
           costs=ppd.SoftTokenCosts),
]}


# ---- the options methods own ----------------------------------------------------------------------

OPTIONS = {  # dest -> (flag, argparse settings); the methods that take each are in METHODS
    "ngram_n": ("--ngram-n", dict(
        type=integer(2, NGramDrafter.MAX_N), default=NGramDrafter.DEFAULT_N, metavar="N",
        help=f"longest n-gram level, 2..{NGramDrafter.MAX_N}; levels 2..N are kept and the longest match wins")),
    "ngram_k": ("--ngram-k", dict(
        type=integer(1, NGramDrafter.MAX_K), metavar="K",
        help=f"guessed tokens per step, 1..{NGramDrafter.MAX_K} (default: what --calibrate chose on this "
             f"machine, else {NGramDrafter.DEFAULT_K})")),
    "decoding_length": ("--decoding-length", dict(
        type=integer(1, TrieDrafter.MAX_DECODING_LENGTH), metavar="N",
        help=f"guessed tokens per step over all branches, 1..{TrieDrafter.MAX_DECODING_LENGTH} (the paper "
             "uses up to 64 on GPUs; on a "
                       "CPU a pass over 16 tokens costs ~1.9x one token, over 8 ~1.55x; default: what "
                       f"--calibrate chose on this machine, else {TrieDrafter.DEFAULT_DECODING_LENGTH})")),
    "branch_length": ("--branch-length", dict(
        type=integer(1, TrieDrafter.MAX_BRANCH_LENGTH), default=TrieDrafter.DEFAULT_BRANCH_LENGTH, metavar="N",
        help=f"the longest guessed branch, 1..{TrieDrafter.MAX_BRANCH_LENGTH} tokens")),
    "lookahead_mode": ("--lookahead-mode", dict(
        default="hierarchical", choices=["hierarchical", "parallel"],
        help="merge branches that share a prefix (hierarchical) or lay them side by side")),
    "draft_model": ("--draft-model", dict(
        type=Path, metavar="DIR", help="a smaller Hugging Face Llama checkpoint with the same tokenizer, as the draft")),
    "draft_layers": ("--draft-layers", dict(
        type=integer(1, MAX_LAYERS), default=DEFAULT_DRAFT_LAYERS, metavar="N",
        help="without --draft-model, the draft is the model itself cut after its first N layers (then its "
             "final norm and LM head), 1..its layers - 1: self-speculative, no extra weights")),
    "gamma": ("--gamma", dict(
        type=integer(1, DraftModelDrafter.MAX_GAMMA), default=DraftModelDrafter.DEFAULT_GAMMA, metavar="N",
        help=f"tokens the draft guesses per step, 1..{DraftModelDrafter.MAX_GAMMA}")),
    "apar_guesses": ("--apar-guesses", dict(
        default="none", choices=["none", *APAR_GUESSERS],
        help="APAR + a guesser: every thread gets its own ANPD or Lookahead drafter, and each thread's guesses "
             "are verified in the same forward pass as all threads' (exactly: each thread writes what it would "
             "without guesses). A thread's tree is sized by --ngram-n/--ngram-k (K default "
             f"{NGramDrafter.DEFAULT_K} here, never calibrated) or --decoding-length (default "
             f"{TrieDrafter.DEFAULT_DECODING_LENGTH})/--branch-length; a pass feeds at most {MAX_GUESSES_PER_PASS} "
             "guesses over all threads")),
    "fork_bias": ("--fork-bias", dict(
        type=number(-MAX_FORK_BIAS, MAX_FORK_BIAS), default=FORK_BIAS, metavar="NATS",
        help=f"added to [Fork]'s logit where a thread may fork, -{MAX_FORK_BIAS:g}..{MAX_FORK_BIAS:g}: greedy forks "
             "wherever [Fork] is within NATS of the likeliest token (0: the adapter as trained; with the shipped "
             "one, 1 forked on 62%% of held-out list prompts instead of 54%%, at 1.32x vanilla's perplexity "
             "instead of 1.22x)")),
    "trained": ("--trained", dict(
        type=Path, metavar="PATH",
        help="the trained heads / soft tokens / EAGLE head / APAR adapter, PATH.safetensors + PATH.json, made by "
             "train_prompt.py (default: trained/<method>-<model folder>, shipped for the default model; auto: PPD's "
             "soft tokens or EAGLE's head, whichever the file is)")),
    "tree_rows": ("--tree-rows", dict(
        type=integer(2, MAX_TREE_ROWS), metavar="N",
        help=f"inputs per forward pass, 2..{MAX_TREE_ROWS}: the root, the guesses and (ppd) the soft tokens "
             f"(default: what --calibrate chose on this machine, else {DEFAULT_TREE_ROWS}; recycling: "
             f"{RecyclingDrafter.DEFAULT_ROWS}, the candidates cost-aware drafting cuts from)")),
    "fixed_size": ("--fixed-size", dict(
        action="store_true",
        help="send the method's whole tree every step, as its paper does, instead of the part of it that pays "
             "on this machine (cost-aware drafting, cost_aware.py: each guess's chance of acceptance, "
             "calibrated as the answer goes, against the measured cost of a pass over n inputs)")),
    "static_tree": ("--static-tree", dict(
        action="store_true", help="every node carries all soft tokens, instead of the dynamic sparse tree "
                                  "(section 4) that gives them where they pay most")),
}


def methods_taking(option: str) -> list[str]:
    return [name for name, method in METHODS.items() if option in method.options]


def default_options(**overrides) -> argparse.Namespace:
    """Every method option at its default (the model: the default one), then `overrides`."""
    defaults = {dest: settings.get("default", False if settings.get("action") == "store_true" else None)
                for dest, (_, settings) in OPTIONS.items()}
    return argparse.Namespace(**(defaults | {"model": None} | overrides))


# ---- building -------------------------------------------------------------------------------------

def calibration_name(method: Method, options) -> str:
    """The name --calibrate saves the method's best size under (PPD's static tree is another tree)."""
    return method.name + ("-static" if method.name == "ppd" and options.static_tree else "")


def inputs_per_pass(method: Method, options, model) -> int | None:
    """The size option if given, else this machine's calibrated size, else the default (None for a
    method without a size)."""
    size = method.size
    if size is None:
        return None
    if getattr(options, size.option) is not None:
        return getattr(options, size.option) + size.root
    return calibrated_rows(model, calibration_name(method, options), size.default + size.root)


def build_drafter(method: Method, options, model, tokenizer, inputs: int | None = None,
                  latency: Latency | None = None) -> Drafter:
    """The method's drafter, with at most `inputs` inputs per forward pass (default: inputs_per_pass),
    cost-aware unless --fixed-size (L(n): `latency`, default this machine's, calibrate.machine_latency)."""
    if method.drafter is None:
        raise ValueError(f"{method.name} is an engine, not a drafter")

    def this_machines():  # measured only when needed (once per machine: calibrate.machine_latency)
        return latency or machine_latency(model)
    costs = method.costs(this_machines()) if method.cost_aware(options) else None
    drafter = method.drafter(Build(options, model, tokenizer, inputs or inputs_per_pass(method, options, model),
                                   costs, this_machines))
    return drafter if costs is None else CostAware(drafter, costs)


# ---- what the programs share: the model and method options, loading ----------------------------------

def add_model_options(p: argparse.ArgumentParser) -> None:
    """Which model, where, and how the prompt reaches it (decode.py and visualize.py)."""
    p.add_argument("--model", type=Path, metavar="DIR",
                   help="a Hugging Face Llama checkpoint folder (config.json, *.safetensors, "
                        "tokenizer.json or tokenizer.model); default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weights and activations")
    p.add_argument("--device", default="cpu", help="cpu, cuda, or cuda:N")
    p.add_argument("--backend", default="reference", choices=list(backends.BACKENDS),
                   help="how the decoding passes run: " + "; ".join(f"{name}: {what}" for name, (_, what)
                                                                   in backends.BACKENDS.items()))
    p.add_argument("--raw", action="store_true",
                   help="feed the prompt as-is instead of through the checkpoint's chat template")


def add_method_options(p: argparse.ArgumentParser) -> None:
    """Each method's own options from the registry, grouped under its paper."""
    added = set()
    for method in METHODS.values():
        own = [dest for dest in method.options if dest not in added]
        group = p.add_argument_group(f"{method.name} ({method.paper})") if own else None
        for dest in own:
            flag, settings = OPTIONS[dest]
            takers = methods_taking(dest)
            shared = f" [{', '.join(takers)}]" if len(takers) > 1 else ""
            group.add_argument(flag, **(settings | {"help": settings["help"] + shared}))
            added.add(dest)


def refuse_idle_options(args, parser, rules, methods: list[str]) -> None:
    """Refuse an option given where it does nothing: each rule is (dest, acts(args), where it acts).
    A method's own options act only with that method (one of `methods`, those asked for)."""
    refuse_idle(args, parser, [(dest, lambda args, dest=dest: bool(set(methods) & set(methods_taking(dest))),
                                "--method " + spoken_list(methods_taking(dest))) for dest in OPTIONS] + rules)


def spoken_list(names: list[str]) -> str:
    """"a", "a and b", "a, b and c"."""
    return " and ".join(filter(None, [", ".join(names[:-1]), names[-1]]))


def refuse_idle(args, parser, rules) -> None:
    """Refuse an option given where it does nothing: each rule is (dest, acts(args), where it acts)."""
    for dest, acts, where in rules:
        if getattr(args, dest) != parser.get_default(dest) and not acts(args):
            raise UserError(f"{flag(dest)} applies to {where} only (here it would do nothing)")


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def load(args, method: Method):
    """The model and tokenizer the options name, with a progress line on stderr."""
    device = parse_device(args.device)
    backends.check(args.backend, device, [DTYPES[args.dtype]])  # refused before the model is converted or loaded
    if args.backend != "reference" and method.engine is not None:
        raise UserError(f"--backend {args.backend} runs the guess-and-verify loop's passes; --method {method.name} "
                        "runs its own engine")
    folder = args.model if args.model is not None else default_model_dir()
    started = time.perf_counter()
    model = load_checkpoint(folder, DTYPES[args.dtype], device)
    model = backends.apply(model, args.backend, MAX_TREE_ROWS if method.guesses else 1)
    tokenizer = Tokenizer(folder)
    check_fits(tokenizer, model.config.vocab_size, folder)
    print(f"Loaded {folder.name} ({args.dtype}, {device}) in {time.perf_counter() - started:.1f}s",
          file=sys.stderr)
    freeze_loaded()
    return model, tokenizer


def freeze_loaded() -> None:
    """Keep what is loaded by now out of Python's cycle collector (gc.freeze): the modules, torch's and
    numba's objects, the tokenizer's tables, ~380,000 objects that live as long as the process, which
    each full collection would walk again, ~0.45 s on 2 AVX2 EPYC cores. Such a collection comes when
    enough new objects have piled up, whoever made them: in bench.py one landed in `auto`'s drafting
    time (3-5 ms a pass over a generation, where 0.7 is its own), and in decode.py it stalls an answer
    as long. (The few thousand unreachable objects numba's compiler leaves by then, its IR, stay too:
    collecting them first cost as long, and freed no memory.)"""
    gc.freeze()
