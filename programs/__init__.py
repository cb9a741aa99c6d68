"""What the programs (decode.py, bench.py, train_prompt.py, visualize.py) share beyond the core: the
command line of `python decode.py` (`cli.py`, `prompts.py`, `show_tree.py`), the offline prompt sets and
charts of the benchmarks (`bench_data.py`, `lists_due.py`, `charts.py`), converting the embedded default
model (`convert.py`), and files written whole with progress shown (`staging.py`, `progress.py`).
"""
